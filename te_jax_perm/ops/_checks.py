"""Trace-time argument checks shared by the permutation ops.

Every message names the argument, the shape (or dtype/value) seen and what was expected.
"""
from __future__ import annotations

from typing import Any, Sequence

import jax.numpy as jnp
import numpy as np


def _dt(x: Any) -> np.dtype:
    return np.dtype(jnp.asarray(x).dtype) if not hasattr(x, "dtype") else np.dtype(x.dtype)


def check_rank(name: str, x: Any, ranks: Sequence[int], expected: str) -> None:
    if x.ndim not in ranks:
        raise ValueError(f"{name} has shape {tuple(x.shape)} (rank {x.ndim}); expected {expected}")


def check_shape(name: str, x: Any, shape: tuple[int, ...], expected: str | None = None) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {expected or tuple(shape)}")


def check_probs_dtype(name: str, x: Any) -> None:
    if _dt(x).name not in ("bfloat16", "float16", "float32"):
        raise TypeError(f"{name} has dtype {_dt(x).name}; expected bfloat16, float16 or float32")


def check_int32(name: str, x: Any) -> None:
    if _dt(x) != np.int32:
        raise TypeError(f"{name} has dtype {_dt(x).name}; expected int32")


def check_token_dtype(name: str, x: Any) -> None:
    dt = _dt(x)
    if not (jnp.issubdtype(dt, jnp.floating) or dt.name.startswith("float8")):  # np misses bfloat16
        raise TypeError(f"{name} has dtype {dt.name}; expected a floating dtype "
                        "(bfloat16, float16, float32 or float8_e4m3fn)")


def check_routing_dtype(name: str, x: Any) -> None:
    dt = _dt(x)
    if not (dt == np.bool_ or np.issubdtype(dt, np.integer)):
        raise TypeError(f"{name} has dtype {dt.name}; expected bool or an integer dtype holding 0/1")


def check_float(name: str, x: Any) -> None:
    dt = _dt(x)
    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{name} has dtype {dt.name}; expected a floating dtype")


def index_vector(name: str, x: Any) -> Any:
    """``x`` as an int32 vector ``[C]`` (chunk sizes, chunk orders), checked."""
    x = jnp.asarray(x)
    check_rank(name, x, (1,), "rank 1 [C]")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} has dtype {_dt(x).name}; expected an integer dtype")
    return x.astype(jnp.int32)


def check_static_int(name: str, v: Any, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be a static Python int, got {type(v).__name__} {v!r}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return int(v)


def num_experts_of_map(row_id_map: Any) -> int:
    """E from a row-id map of shape [T, 2E+1], with a clear error otherwise."""
    if row_id_map.ndim != 2 or row_id_map.shape[1] % 2 != 1:
        raise ValueError(f"row_id_map has shape {tuple(row_id_map.shape)}; expected [T, 2*E+1] "
                         "as returned by make_row_id_map")
    check_int32("row_id_map", row_id_map)
    return (row_id_map.shape[1] - 1) // 2
