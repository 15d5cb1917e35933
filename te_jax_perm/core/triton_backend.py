"""``triton`` backend: the Triton kernel as one XLA custom call on CUDA.

The kernel is compiled by Triton itself (``core/triton_compile.py``) and called through
jaxlib's Triton kernel-call bindings, in one of three call modes:

* ``ffi`` (the default where jaxlib has it, 0.10.1 and later): the typed-FFI target
  ``triton_kernel_call_ffi``. XLA can capture it in a command buffer (a CUDA graph), so a
  jitted step of many small kernels runs without a host launch per kernel.
* ``legacy``: the same compiled kernel and call through the older custom call
  ``triton_kernel_call`` (API version 2), which XLA cannot capture.
* ``jax_triton``: through the jax-triton package (which needs a matching Triton).

``TE_JAX_PERM_TRITON_CALL`` or :func:`triton_call_mode` picks one. Every mode passes the
arguments :func:`~te_jax_perm.core.kernel_args.kernel_arguments` orders and declares the
launch's alias plan, so XLA never hands an output the memory of another input.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import zlib
from typing import Any, Iterator, Sequence

import jax
import jax.ffi
import numpy as np

from te_jax_perm.core import compat, env
from te_jax_perm.core.aliasing import preallocate
from te_jax_perm.core.backends import BackendUnavailableError
from te_jax_perm.core.kernel_args import OUTPUT, kernel_arguments, scalar_type
from te_jax_perm.core.launch import Launch
from te_jax_perm.core.triton_compile import CompiledKernel, compiled_for

FFI_TARGET = "triton_kernel_call_ffi"
LEGACY_TARGET = "triton_kernel_call"

# -- jaxlib version shims ----------------------------------------------------------------------
# ``jax._src.lib.gpu_triton`` (a.k.a. triton_kernel_call_lib) exposes TritonKernel,
# TritonKernelCall, create_array_parameter, create_scalar_parameter and
# get_compute_capability when jaxlib has its CUDA plugin. TritonKernel's arguments:
#   jaxlib >= 0.5: (name, num_warps, num_ctas, shared_mem_bytes, ptx, ttir, compute_capability
#                   [, global_scratch_size, global_scratch_align  -- jaxlib > 0.11.0 only])
# (older releases, which this library does not support, took cluster dims instead of num_ctas).


def _load_kernel_call_lib() -> Any:
    try:
        from jax._src.lib import gpu_triton
    except ImportError as e:  # pragma: no cover - every supported jaxlib has the module
        raise BackendUnavailableError(f"backend 'triton': jaxlib has no Triton kernel-call module ({e}); "
                                      "pip install 'te_jax_perm[cuda]'") from e
    if getattr(gpu_triton, "TritonKernelCall", None) is None:
        raise BackendUnavailableError(
            "backend 'triton' needs jaxlib's CUDA plugin (its Triton kernel call is missing): "
            "pip install 'te_jax_perm[cuda]'")
    return gpu_triton


def _ffi_registered(lib: Any) -> bool:
    """Whether jaxlib registered the typed-FFI Triton call (0.10.1 and later do)."""
    plugin = getattr(lib, "_cuda_triton", None)
    registrations = getattr(plugin, "registrations", None)
    if callable(registrations):
        return FFI_TARGET in registrations()
    jaxlib = compat.installed("jaxlib")
    return jaxlib is not None and jaxlib >= compat.FFI_MIN_JAXLIB


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


# -- the kernel-call library in use --------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _device_kernel_call_lib() -> Any:
    return _load_kernel_call_lib()


_override: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar("te_jax_perm_kernel_call_lib",
                                                                                   default=None)


@contextlib.contextmanager
def kernel_call_library(lib: Any, compute_capability: int) -> Iterator[None]:
    """Lowers with ``lib`` standing in for jaxlib's Triton kernel-call bindings, compiling
    for ``compute_capability``: lets a machine without a GPU lower (and check) the exact
    custom calls a GPU run would execute."""
    token = _override.set((lib, int(compute_capability)))
    try:
        yield
    finally:
        _override.reset(token)


def _lib_and_capability() -> tuple[Any, int]:
    override = _override.get()
    if override is not None:
        return override
    lib = _device_kernel_call_lib()
    return lib, int(lib.get_compute_capability(0))


# -- call mode ---------------------------------------------------------------------------------
_mode: contextvars.ContextVar[str | None] = contextvars.ContextVar("te_jax_perm_triton_call", default=None)


@contextlib.contextmanager
def triton_call_mode(mode: str) -> Iterator[str]:
    """Kernels lowered inside the context use call ``mode`` (``ffi``, ``legacy``, ``jax_triton``).

    The mode is read when a computation is lowered, and JAX caches lowerings: to switch
    modes for a function already compiled in this process, call ``jax.clear_caches()``.
    """
    if mode not in env.TRITON_CALL_VALUES:
        raise ValueError(f"unknown triton call mode {mode!r}; expected one of {env.TRITON_CALL_VALUES}")
    token = _mode.set(mode)
    try:
        yield mode
    finally:
        _mode.reset(token)


def requested_mode() -> str | None:
    """The call mode asked for: the context's, else the environment's, else ``None``."""
    return _mode.get() or env.triton_call()


def current_mode(lib: Any) -> str:
    """The call mode a lowering uses: the requested one, else ``ffi`` where jaxlib
    registers it and ``legacy`` where not."""
    return requested_mode() or ("ffi" if _ffi_registered(lib) else "legacy")


def _check_mode(mode: str, lib: Any) -> None:
    if mode == "ffi" and not _ffi_registered(lib):
        raise BackendUnavailableError("backend 'triton': " + "; ".join(compat.problems("ffi") or [
            f"this jaxlib does not register {FFI_TARGET}: pip install 'jax[cuda13]>={compat.FFI_MIN_JAXLIB}' or "
            "set TE_JAX_PERM_TRITON_CALL=legacy"]))


# -- the call ----------------------------------------------------------------------------------
def kernel_call_parameters(launch: Launch, lib: Any) -> list[Any]:
    """The kernel-call parameters in kernel order: every pointer (operands, preallocs, then
    outputs, which XLA hands over after the operands) 16-byte aligned, never zeroed by the
    call (zeroed outputs arrive zeroed as their preallocated operands); scalars by value."""
    args = kernel_arguments(launch, launch.avals, launch.out_avals, launch.out_avals)
    return [lib.create_array_parameter(0, 16) if a.is_pointer
            else lib.create_scalar_parameter(_python_scalar(a.value), scalar_type(a.value)) for a in args]


def kernel_call_proto(launch: Launch, lib: Any, compute_capability: int) -> bytes:
    """The serialized, compressed kernel call of ``launch`` (the custom call's payload)."""
    kernel = _triton_kernel(lib, compiled_for(launch, compute_capability))
    gx, gy, gz = launch.grid3
    call = lib.TritonKernelCall(kernel, gx, gy, gz, kernel_call_parameters(launch, lib))
    return zlib.compress(call.to_proto(f"te_jax_perm.{launch.decl.name}", b""))


def triton_call(launch: Launch, operands: Sequence[jax.Array]) -> list[jax.Array]:
    """Traceable: one custom call running ``launch`` on ``operands``."""
    plan = launch.aliases
    preallocs = preallocate(plan, launch.out_avals)
    if launch.empty:
        return preallocs  # CUDA rejects empty grids; the preallocated buffers are the result
    if requested_mode() == "jax_triton":
        return _jax_triton_call(launch, operands, preallocs)
    lib, capability = _lib_and_capability()
    mode = current_mode(lib)
    _check_mode(mode, lib)
    result_types = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in launch.out_avals]
    payload = kernel_call_proto(launch, lib, capability)
    with jax.named_scope(f"te_jax_perm.{launch.decl.name}"):
        if mode == "ffi":
            call = jax.ffi.ffi_call(FFI_TARGET, result_types, input_output_aliases=plan.input_output_aliases)
            outs = call(*operands, *preallocs, opaque=payload)
        else:
            call = jax.ffi.ffi_call(LEGACY_TARGET, result_types, input_output_aliases=plan.input_output_aliases,
                                    custom_call_api_version=2, legacy_backend_config=payload)
            outs = call(*operands, *preallocs)
    return list(outs)


def _jax_triton_call(launch: Launch, operands: Sequence[jax.Array], preallocs: Sequence[jax.Array]
                     ) -> list[jax.Array]:
    problems = compat.problems("jax_triton")
    if problems:
        raise BackendUnavailableError("backend 'triton' (call mode jax_triton): " + "; ".join(problems))
    jt = _jax_triton()
    decl, config = launch.decl, launch.config
    out_shape = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in launch.out_avals]
    # jax-triton appends the output pointers itself; it numbers aliases over array
    # arguments only (scalars sit between operands and preallocs in the kernel signature).
    args = kernel_arguments(launch, operands, preallocs, out_shape)
    with jax.named_scope(f"te_jax_perm.{decl.name}"):
        outs = jt.triton_call(
            *[a.value if a.is_pointer else _python_scalar(a.value) for a in args if a.role != OUTPUT],
            kernel=decl.kernel, out_shape=out_shape, grid=launch.grid,
            name=f"te_jax_perm.{decl.name}",
            num_warps=config.num_warps, num_stages=config.num_stages,
            input_output_aliases=launch.aliases.input_output_aliases,
            **launch.constexprs)
    return list(outs)


@functools.lru_cache(maxsize=None)
def _jax_triton() -> Any:
    with env.triton_cache_dir_kept():
        import jax_triton
    return jax_triton


def _python_scalar(v: Any) -> Any:
    # nanobind's strict casters reject NumPy scalars and int subclasses.
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, (int, np.integer)):
        return int(v)
    return float(v)
