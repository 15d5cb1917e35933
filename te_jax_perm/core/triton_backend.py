"""``triton`` backend: the Triton kernel as one XLA custom call on CUDA, and the versions
of jax and Triton it works with.

The kernel is compiled by Triton's own compiler, cached per specialisation; the autotuner's
compile workers compile the same :class:`CompileSpec`, so a tuned binary is exactly the
one the backend launches. It is called through jaxlib's typed-FFI Triton call
``triton_kernel_call_ffi``, which XLA can capture in a command buffer (a CUDA graph), so a
jitted step of many small kernels runs without a host launch per kernel. The call
declares the launch's alias plan, so XLA never hands an output another input's memory.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import re
import zlib
from typing import Any, Sequence

import jax
import jax.ffi
import numpy as np
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from te_jax_perm.core import env
from te_jax_perm.core.aliasing import preallocate
from te_jax_perm.core.backends import BackendUnavailableError
from te_jax_perm.core.kernel_args import SCALAR, kernel_arguments, scalar_type, signature
from te_jax_perm.core.launch import Launch

FFI_TARGET = "triton_kernel_call_ffi"

# -- versions: one table, read by this backend's errors (each names the missing or
# mismatched package and the command that fixes it) and by the test of the [cuda] pins.
# jaxlib registers the typed-FFI Triton call ``triton_kernel_call_ffi`` from 0.10.1 on.
FFI_MIN_JAXLIB = Version("0.10.1")
JAX_SPEC = SpecifierSet(f">={FFI_MIN_JAXLIB}")
TRITON_SPEC = SpecifierSet(">=3.6")
# The Triton releases run on a GPU with this library (the [cuda] extra pins one of them).
TRITON_TESTED_SPEC = SpecifierSet(">=3.6,<3.7")


def installed(package: str) -> Version | None:
    try:
        return Version(importlib.metadata.version(package))
    except importlib.metadata.PackageNotFoundError:
        return None


def problems() -> list[str]:
    """What keeps the ``triton`` backend from working with the installed packages; each
    entry says how to fix it."""
    out = []
    jaxlib, triton = installed("jaxlib"), installed("triton")
    if triton is None:
        out.append("the triton package is not installed: pip install 'te_jax_perm[cuda]'")
    elif triton not in TRITON_SPEC:
        out.append(f"triton {triton} is installed; the triton backend needs triton{TRITON_SPEC}: "
                   "pip install 'te_jax_perm[cuda]'")
    if jaxlib is None or jaxlib not in JAX_SPEC:
        out.append(f"jaxlib {jaxlib or '(missing)'}: the triton backend needs jax{JAX_SPEC} with CUDA: "
                   "pip install 'te_jax_perm[cuda]'")
    return out


# -- compiling with Triton ---------------------------------------------------------------------
# Per-argument attributes are keyed by argument-index tuples ({(i,): [["tt.divisibility", 16]]}),
# and every supported release (3.6 and later) fills the metadata read below (``name``, ``shared``,
# ``num_warps``, ``num_ctas``, ``global_scratch_size``/``_align``, ``profile_scratch_size``);
# 3.6 leaves the global scratch fields ``None`` for a kernel without scratch.
DIVISIBILITY = [["tt.divisibility", 16]]


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """What XLA's Triton call needs of a compiled kernel."""

    name: str                 # the PTX entry point
    num_warps: int
    num_ctas: int
    shared_mem_bytes: int
    ptx: str
    compute_capability: int
    global_scratch_size: int   # bytes of on-device scratch the kernel needs (0: none)
    global_scratch_align: int


@dataclasses.dataclass(frozen=True)
class CompileSpec:
    """One compile of a kernel exactly as the ``triton`` backend compiles it; hashable (the
    compiled-kernel cache's key), and what the autotuner's compile workers compile."""

    kernel: Any                               # the ``@triton.jit`` function
    signature: tuple[tuple[str, str], ...]    # kernel parameter -> Triton type, in kernel order
    constexprs: tuple[tuple[str, Any], ...]
    aligned: tuple[int, ...]                  # argument positions known 16-byte divisible
    num_warps: int
    num_stages: int

    @property
    def is_gluon(self) -> bool:
        """A Gluon kernel (``@gluon.jit``: explicit layouts, warp specialisation)."""
        return bool(getattr(self.kernel, "is_gluon", lambda: False)())

    @property
    def attrs(self) -> dict[tuple[int, ...], Any]:
        return {(i,): DIVISIBILITY for i in self.aligned}

    def compile(self, target: tuple[str, Any, int]) -> Any:
        """``triton.compile`` for ``target`` (``("cuda", 90, 32)``); returns Triton's compiled
        kernel (``.asm``, ``.metadata``)."""
        import triton
        from triton.backends.compiler import GPUTarget
        if self.is_gluon:
            from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
        else:
            from triton.compiler import ASTSource
        source = ASTSource(fn=self.kernel, signature=dict(self.signature), constexprs=dict(self.constexprs),
                           attrs=self.attrs)
        # Multiply-adds fused (one rounding, as the kernels were measured and tested), named
        # rather than left to Triton's default, which its later releases turn off.
        # TRITON_FORCE_DISABLE_FP_FUSION still wins, as Triton documents.
        with env.triton_line_info_off():
            return triton.compile(source, target=GPUTarget(*target),
                                  options={"num_warps": self.num_warps, "num_stages": self.num_stages,
                                           "enable_fp_fusion": True})


def specialisation(value: Any) -> str | None:
    """How a runtime scalar is compiled, as Triton's launcher does it: an integer 1 becomes a
    constant (``"one"``); one divisible by 16 carries that fact (``"div16"``: ``row * E``
    offsets keep 16-byte alignment, loads vectorise); anything else is ``None``. The values
    are the call's static scalars, so the binary never meets another value."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    if int(value) == 1:
        return "one"
    return "div16" if int(value) % 16 == 0 else None


def launch_spec(launch: Launch) -> CompileSpec:
    """The compile of ``launch``: pointers are 16-byte aligned (XLA's allocations are) and
    integer scalars are specialised (:func:`specialisation`)."""
    sig, constexprs, aligned = signature(launch), dict(launch.constexprs), []
    # Constexprs follow every runtime argument, so argument i is kernel parameter i.
    for i, a in enumerate(kernel_arguments(launch, launch.avals, launch.out_avals, launch.out_avals)):
        kind = "div16" if a.is_pointer else specialisation(a.value) if a.role == SCALAR else None
        if kind == "one":
            sig[a.name], constexprs[a.name] = "constexpr", 1
        elif kind == "div16":
            aligned.append(i)
    return CompileSpec(launch.decl.kernel, tuple(sig.items()), tuple(constexprs.items()), tuple(aligned),
                       launch.config.num_warps, launch.config.num_stages)


def compiled_for(launch: Launch, compute_capability: int) -> CompiledKernel:
    """The compiled kernel of ``launch`` for a CUDA device of ``compute_capability`` (e.g.
    90), compiled once per (kernel, signature, constexprs, warps, stages, device)."""
    # The cache's first hash of a kernel parses its source, and so does every compile
    # (Triton's code generator): under ``source_lock``, as lowerings in several threads would
    # otherwise parse at once.
    with env.source_lock:
        return compile_cached(launch_spec(launch), int(compute_capability))


@functools.lru_cache(maxsize=1024)
def compile_cached(spec: CompileSpec, cc: int) -> CompiledKernel:
    """:func:`compiled_for`'s cache (``cache_info()`` counts the compiles)."""
    compiled = spec.compile(("cuda", cc, 32))
    if compiled.metadata.profile_scratch_size:
        raise NotImplementedError(f"{spec.kernel.fn.__name__}: compiled with Triton's profiling instrumentation "
                                  "(profile scratch memory), which XLA's Triton call cannot provide; unset "
                                  "the Triton instrumentation options")
    return CompiledKernel(
        # The compiled warp count: a warp-specialised kernel's adds its worker warps'.
        name=compiled.metadata.name, num_warps=compiled.metadata.num_warps, num_ctas=compiled.metadata.num_ctas,
        shared_mem_bytes=compiled.metadata.shared, ptx=compiled.asm["ptx"], compute_capability=cc,
        global_scratch_size=compiled.metadata.global_scratch_size or 0,
        global_scratch_align=compiled.metadata.global_scratch_align or 1)


# -- jaxlib version shims ----------------------------------------------------------------------
# ``jax._src.lib.gpu_triton`` (a.k.a. triton_kernel_call_lib) exposes TritonKernel,
# TritonKernelCall, create_array_parameter, create_scalar_parameter and
# get_compute_capability when jaxlib has its CUDA plugin. TritonKernel's arguments:
#   jaxlib >= 0.5: (name, num_warps, num_ctas, shared_mem_bytes, ptx, ttir, compute_capability
#                   [, global_scratch_size, global_scratch_align  -- jaxlib > 0.11.0 only]);
# this backend passes the first seven on every jaxlib and brings its own scratch
# (:func:`kernel_call_proto`). Older releases, which it does not support, took cluster dims
# instead of num_ctas.


@functools.lru_cache(maxsize=None)
def kernel_call_lib() -> Any:
    """jaxlib's Triton kernel-call bindings, loaded once; raises when jaxlib has no CUDA plugin."""
    try:
        from jax._src.lib import gpu_triton as lib
    except ImportError as e:  # pragma: no cover - every supported jaxlib has the module
        raise BackendUnavailableError(f"backend 'triton': jaxlib has no Triton kernel-call module ({e}); "
                                      "pip install 'te_jax_perm[cuda]'") from e
    if getattr(lib, "TritonKernelCall", None) is None:
        raise BackendUnavailableError(
            "backend 'triton' needs jaxlib's CUDA plugin (its Triton kernel call is missing): "
            "pip install 'te_jax_perm[cuda]'")
    return lib


def _check_ffi(lib: Any) -> None:
    """Raises unless jaxlib registered the typed-FFI Triton call (0.10.1 and later do)."""
    registrations = getattr(getattr(lib, "_cuda_triton", None), "registrations", None)
    if not (callable(registrations) and FFI_TARGET in registrations()):
        raise BackendUnavailableError("backend 'triton': " + "; ".join(problems() or [
            f"this jaxlib does not register {FFI_TARGET}: pip install 'jax[cuda13]>={FFI_MIN_JAXLIB}'"]))


def _triton_kernel(lib: Any, kernel: CompiledKernel) -> Any:
    # Never jaxlib's own global scratch: it allocates that memory on the stream for each
    # launch, which a command buffer cannot hold (CUDA refuses memory nodes in the child
    # graph a captured custom call becomes). The call passes a workspace XLA allocates.
    return lib.TritonKernel(kernel.name, kernel.num_warps, kernel.num_ctas, kernel.shared_mem_bytes, kernel.ptx,
                            "", kernel.compute_capability)


def compute_capability() -> int:
    """The compute capability the ``triton`` backend compiles for (e.g. 90 on an H100)."""
    return int(kernel_call_lib().get_compute_capability(0))


# Triton scalar type -> Python type: nanobind's strict casters reject NumPy scalars and int subclasses.
_PYTHON = {"i1": bool, "i32": int, "i64": int, "fp32": float}


# -- the call ----------------------------------------------------------------------------------
def workspace_bytes(launch: Launch, kernel: CompiledKernel) -> int:
    """Bytes of the global scratch ``kernel`` needs over ``launch``'s grid (each program
    its own slice, e.g. for tensor descriptors it builds on the device); 0 for none."""
    return int(np.prod(launch.grid3)) * kernel.num_ctas * kernel.global_scratch_size


def kernel_call_proto(launch: Launch, lib: Any, kernel: CompiledKernel) -> bytes:
    """The serialized, compressed kernel call of ``launch`` (the custom call's payload). Its
    parameters follow the kernel's order: every pointer (operands, preallocs, then outputs,
    which XLA hands over after the operands) 16-byte aligned, never zeroed by the call
    (zeroed outputs arrive zeroed as their preallocated operands); scalars by value, except
    those compiled in as constants (:func:`launch_spec`). Triton appends two pointers to
    every kernel, global then profile scratch: a kernel with global scratch gets the call's
    workspace (its last output) and a null profile pointer; jaxlib appends its own two
    after those, past the kernel's parameters, where CUDA never reads them."""
    spec = launch_spec(launch)
    sig = dict(spec.signature)
    params = [lib.create_array_parameter(0, 16) if a.is_pointer
              else lib.create_scalar_parameter(_PYTHON[scalar_type(a.value)](a.value), scalar_type(a.value))
              for a in kernel_arguments(launch, launch.avals, launch.out_avals, launch.out_avals)
              if sig[a.name] != "constexpr"]
    check_parameter_count(kernel, len(params) + 2)
    if kernel.global_scratch_size:
        params += [lib.create_array_parameter(0, max(16, kernel.global_scratch_align)),
                   lib.create_scalar_parameter(0, "u64")]
    call = lib.TritonKernelCall(_triton_kernel(lib, kernel), *launch.grid3, params)
    return zlib.compress(call.to_proto(f"te_jax_perm.{launch.decl.name}", b""))


def check_parameter_count(kernel: CompiledKernel, expected: int) -> None:
    """The call hands CUDA one pointer per kernel parameter; a count that differs from the
    compiled entry's would shift every argument after the first difference."""
    entry = re.search(r"\.entry\s+" + re.escape(kernel.name) + r"\s*\(([^)]*)\)", kernel.ptx)
    found = len(re.findall(r"\.param\b", entry.group(1))) if entry else None
    if found != expected:
        raise RuntimeError(f"kernel {kernel.name}: the compiled entry takes {found} parameters; the call passes "
                           f"{expected} (its arguments, then Triton's global and profile scratch pointers)")


def triton_call(launch: Launch, operands: Sequence[jax.Array],
                preallocs: Sequence[jax.Array] | None = None) -> list[jax.Array]:
    """Traceable: one custom call running ``launch`` on ``operands``, writing into
    ``preallocs`` (by default the alias plan's fresh buffers; the autotuner passes its own)."""
    plan = launch.aliases
    preallocs = preallocate(plan, launch.out_avals) if preallocs is None else list(preallocs)
    if launch.empty:
        return preallocs  # CUDA rejects empty grids; the preallocated buffers are the result
    lib = kernel_call_lib()
    _check_ffi(lib)
    kernel = compiled_for(launch, compute_capability())
    result_types = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in launch.out_avals]
    workspace = workspace_bytes(launch, kernel)
    if workspace:  # an output no one reads after the kernel: XLA allocates it, and frees it
        result_types.append(jax.ShapeDtypeStruct((workspace,), np.uint8))
    payload = kernel_call_proto(launch, lib, kernel)
    with jax.named_scope(f"te_jax_perm.{launch.decl.name}"):
        call = jax.ffi.ffi_call(FFI_TARGET, result_types, input_output_aliases=plan.input_output_aliases)
        return list(call(*operands, *preallocs, opaque=payload))[:len(launch.out_avals)]
