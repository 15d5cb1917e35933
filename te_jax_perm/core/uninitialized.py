"""Uninitialised device buffers for outputs the kernel writes completely.

``jnp.empty`` is zero-filled, which costs a full extra write of every output: at real MoE
sizes the dispatch output is ~k times its input, so the memset alone would cap dispatch
near half the copy bandwidth. On GPUs XLA provides the ``AllocateBuffer`` custom call,
which yields a buffer without touching it. Elsewhere (CPU) we fill with a poison pattern
instead: a kernel that leaves any element of an ``init="empty"`` output unwritten then
produces visibly wrong results in tests rather than silently correct zeros.
"""
from __future__ import annotations

import jax
import jax.ffi
import jax.extend  # noqa: F401
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

uninitialized_p = Primitive("te_jax_perm_uninitialized")
uninitialized_p.def_abstract_eval(lambda *, shape, dtype: jax.core.ShapedArray(shape, dtype))
uninitialized_p.def_impl(lambda *, shape, dtype: jnp.zeros(shape, dtype))


def _lower_allocate_buffer(ctx, *, shape, dtype):
    del shape, dtype  # the result type comes from ctx.avals_out
    return jax.ffi.ffi_lowering("AllocateBuffer", api_version=1)(ctx)


def _lower_poison(ctx, *, shape, dtype):
    return mlir.lower_fun(lambda: _poison(shape, dtype), multiple_results=False)(ctx)


def _poison(shape, dtype) -> jax.Array:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return jnp.ones(shape, dtype)
    # All-ones bytes: NaN for floats, -1 for signed ints - never a plausible result.
    bits = jnp.full(shape + (dtype.itemsize,), 0xFF, jnp.uint8)
    return jax.lax.bitcast_convert_type(bits, dtype) if dtype.itemsize > 1 else \
        jax.lax.bitcast_convert_type(bits[..., 0], dtype)


mlir.register_lowering(uninitialized_p, _lower_allocate_buffer, platform="cuda")
mlir.register_lowering(uninitialized_p, _lower_poison, platform="cpu")
mlir.register_lowering(uninitialized_p, _lower_poison)


def uninitialized(shape: tuple[int, ...], dtype) -> jax.Array:
    """A buffer of ``shape``/``dtype`` whose contents are unspecified."""
    return uninitialized_p.bind(shape=tuple(int(s) for s in shape), dtype=np.dtype(dtype))
