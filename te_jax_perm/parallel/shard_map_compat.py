"""``jax.shard_map`` as the expert-parallel layer calls it."""
from __future__ import annotations

from typing import Any, Callable

import jax


def shard_map(fn: Callable, **kw: Any) -> Callable:
    """``jax.shard_map`` with the varying-manual-axes (vma) check off: our primitives'
    abstract evals carry no vma types, so custom VJPs would otherwise see mismatched
    ``{V:ep}`` types in the backward pass."""
    return jax.shard_map(fn, check_vma=False, **kw)
