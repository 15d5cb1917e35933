"""``triton`` backend: the Triton kernel as one XLA custom call on CUDA, and the versions
of jax and Triton it works with.

The kernel is compiled by Triton itself (``core/triton_compile.py``) and called through
jaxlib's typed-FFI Triton call ``triton_kernel_call_ffi``, which XLA can capture in a
command buffer (a CUDA graph), so a jitted step of many small kernels runs without a host
launch per kernel. The call declares the launch's alias plan, so XLA never hands an output
the memory of another input.
"""
from __future__ import annotations

import functools
import importlib.metadata
import zlib
from typing import Any, Sequence

import jax
import jax.ffi
import numpy as np
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from te_jax_perm.core.aliasing import preallocate
from te_jax_perm.core.backends import BackendUnavailableError
from te_jax_perm.core.kernel_args import kernel_arguments, scalar_type
from te_jax_perm.core.launch import Launch
from te_jax_perm.core.triton_compile import CompiledKernel, compiled_for, launch_spec

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


# -- jaxlib version shims ----------------------------------------------------------------------
# ``jax._src.lib.gpu_triton`` (a.k.a. triton_kernel_call_lib) exposes TritonKernel,
# TritonKernelCall, create_array_parameter, create_scalar_parameter and
# get_compute_capability when jaxlib has its CUDA plugin. TritonKernel's arguments:
#   jaxlib >= 0.5: (name, num_warps, num_ctas, shared_mem_bytes, ptx, ttir, compute_capability
#                   [, global_scratch_size, global_scratch_align  -- jaxlib > 0.11.0 only])
# (older releases, which this library does not support, took cluster dims instead of num_ctas).


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
    if callable(registrations):
        registered = FFI_TARGET in registrations()
    else:
        jaxlib = installed("jaxlib")
        registered = jaxlib is not None and jaxlib >= FFI_MIN_JAXLIB
    if not registered:
        raise BackendUnavailableError("backend 'triton': " + "; ".join(problems() or [
            f"this jaxlib does not register {FFI_TARGET}: pip install 'jax[cuda13]>={FFI_MIN_JAXLIB}'"]))


def _triton_kernel(lib: Any, kernel: CompiledKernel) -> Any:
    args = [kernel.name, kernel.num_warps, kernel.num_ctas, kernel.shared_mem_bytes, kernel.ptx, "",
            kernel.compute_capability]
    if kernel.global_scratch_size:
        args += [kernel.global_scratch_size, kernel.global_scratch_align]
    try:
        return lib.TritonKernel(*args)
    except TypeError as e:
        if kernel.global_scratch_size:
            raise BackendUnavailableError(
                f"kernel {kernel.name} needs {kernel.global_scratch_size} bytes of global scratch memory, which "
                "this jaxlib's Triton call cannot provide: pip install 'jax[cuda13]>0.11.0'") from e
        raise


def compute_capability() -> int:
    """The compute capability the ``triton`` backend compiles for (e.g. 90 on an H100)."""
    return int(kernel_call_lib().get_compute_capability(0))


# -- the call ----------------------------------------------------------------------------------
def kernel_call_proto(launch: Launch, lib: Any) -> bytes:
    """The serialized, compressed kernel call of ``launch`` (the custom call's payload). Its
    parameters follow the kernel's order: every pointer (operands, preallocs, then outputs,
    which XLA hands over after the operands) 16-byte aligned, never zeroed by the call
    (zeroed outputs arrive zeroed as their preallocated operands); scalars by value, except
    those compiled in as constants (:func:`~te_jax_perm.core.triton_compile.launch_spec`)."""
    kernel = _triton_kernel(lib, compiled_for(launch, int(lib.get_compute_capability(0))))
    sig = launch_spec(launch)[0]
    params = [lib.create_array_parameter(0, 16) if a.is_pointer
              else lib.create_scalar_parameter(_python_scalar(a.value), scalar_type(a.value))
              for a in kernel_arguments(launch, launch.avals, launch.out_avals, launch.out_avals)
              if sig[a.name] != "constexpr"]
    call = lib.TritonKernelCall(kernel, *launch.grid3, params)
    return zlib.compress(call.to_proto(f"te_jax_perm.{launch.decl.name}", b""))


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
    result_types = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in launch.out_avals]
    payload = kernel_call_proto(launch, lib)
    with jax.named_scope(f"te_jax_perm.{launch.decl.name}"):
        call = jax.ffi.ffi_call(FFI_TARGET, result_types, input_output_aliases=plan.input_output_aliases)
        return list(call(*operands, *preallocs, opaque=payload))


def _python_scalar(v: Any) -> Any:
    # nanobind's strict casters reject NumPy scalars and int subclasses.
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    return float(v)
