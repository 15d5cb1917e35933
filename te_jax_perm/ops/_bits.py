"""Pure row moves carry fp8 as raw bytes.

Triton has no fp8 zero constant in its interpreter and nothing in a copy needs fp8
semantics, so fp8 rows travel through the kernels as uint8 of the same width and are
viewed back afterwards: bit-exact, and one kernel binary serves every 1-byte dtype.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_fp8(dtype) -> bool:
    return np.dtype(dtype).name.startswith("float8")


def to_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if is_fp8(x.dtype) else x


def from_bits(y: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(y, dtype) if y.dtype != np.dtype(dtype) else y
