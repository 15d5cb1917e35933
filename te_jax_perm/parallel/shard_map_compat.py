"""``shard_map`` across jax versions (``jax.shard_map`` from 0.7, the experimental one before)."""
from __future__ import annotations

from typing import Any, Callable

import jax

# Our primitives' abstract evals do not carry shard_map's varying-manual-axes (vma) types,
# so the check is off (custom VJPs would otherwise see mismatched {V:ep} types in the
# backward pass).
CHECK_VMA = False


def shard_map(fn: Callable, **kw: Any) -> Callable:
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, check_vma=CHECK_VMA, **kw)
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover - older jax
    return legacy(fn, check_rep=CHECK_VMA, **kw)
