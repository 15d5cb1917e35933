"""Shared by every op that moves rows (permute, chunk sort): pure row moves carry bits, not values.

Every row move (dispatch forward, chunk sorts) runs on unsigned integers of the rows' byte
width and views the result back: bit-exact for every bit pattern on every backend (XLA on
CPU would otherwise quiet bf16 signalling NaNs in a select), one kernel binary per byte
width, and dtypes Triton cannot hold (fp8 in its interpreter, bool, complex, 8-byte types)
move like any other.

Rows are ``[N, H]``; types wider than 4 bytes travel as ``[N, H*k]`` uint32 words.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def to_bits(x: jax.Array) -> jax.Array:
    """``[N, H]`` rows of any dtype as unsigned-integer rows ``[N, H*k]`` holding the same bytes."""
    dt = np.dtype(x.dtype)
    if dt == np.bool_:
        return x.astype(jnp.uint8)  # jax stores bool as one byte holding 0 or 1
    if jnp.issubdtype(dt, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
        dt = np.dtype(x.dtype)
    if dt.itemsize in _UINT:
        y = jax.lax.bitcast_convert_type(x, _UINT[dt.itemsize])
    else:  # 8-byte elements: pairs of 32-bit words
        y = jax.lax.bitcast_convert_type(x, jnp.uint32)
    # The row width is spelled out: with no rows, -1 could stand for any width.
    return y.reshape(y.shape[0], math.prod(y.shape[1:]))


def from_bits(y: jax.Array, dtype, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`to_bits`: ``y`` viewed back as ``dtype`` rows of ``shape``."""
    dt = np.dtype(dtype)
    if dt == np.bool_:
        return y.reshape(shape).astype(jnp.bool_)
    if jnp.issubdtype(dt, jnp.complexfloating):
        part = np.dtype(jnp.finfo(dt).dtype)
        pairs = from_bits(y, part, tuple(shape) + (2,))
        return jax.lax.complex(pairs[..., 0], pairs[..., 1])
    if dt.itemsize in _UINT:
        return jax.lax.bitcast_convert_type(y.reshape(shape), dt)
    return jax.lax.bitcast_convert_type(y.reshape(tuple(shape) + (dt.itemsize // 4,)), dt)
