"""Pure-JAX references of the chunk sort: the public :func:`sort_chunks_reference`, and its
kernels' references (their ``xla`` backend), the map builders written once for NumPy and
JAX alike (``xp``) so that the autotuner's trial operands come from the same code.

Map convention: int32 ``[N]`` each, ``row_id_map`` the output row of each input row and
``src_map`` the input row of each output row, ``-1`` where there is none.
"""
from __future__ import annotations

from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from te_jax_perm.kernels import chunk_sort as K
from te_jax_perm import _checks


def sort_chunks_reference(inp: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array,
                          probs: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """What :func:`~te_jax_perm.ops.chunk_sort.api.sort_chunks_by_index` (``probs=None``) or
    :func:`~te_jax_perm.ops.chunk_sort.api.sort_chunks_by_index_with_probs` returns, in plain JAX,
    with their return arity."""
    inp, probs = checked_rows(_checks.flatten_rows("inp", _checks.array("inp", inp), "N", "H"), probs)
    split_sizes, sorted_indices = checked_chunks(split_sizes, sorted_indices)
    row_map, src_map = chunk_maps_reference(split_sizes, sorted_indices, num_tokens=inp.shape[0])
    outs = gather_rows_reference(inp, src_map, probs)
    return (outs[0], row_map) if probs is None else (outs[0], outs[1], row_map)



def checked_rows(inp, probs):
    """``(inp [N, H], probs [N] or None)`` as arrays, checked as the op and its reference take them."""
    inp = _checks.array("inp", inp)
    _checks.check_rank("inp", inp, (2,), "[N, H]")
    if probs is not None:
        probs = _checks.array("probs", probs)
        _checks.check_shape("probs", probs, (inp.shape[0],), f"({inp.shape[0]},) (one probability per row of inp)")
        _checks.check_probs_dtype("probs", probs)
    return inp, probs


def checked_chunks(split_sizes, sorted_indices):
    """``(split_sizes, sorted_indices)`` as int32 ``[C]`` vectors, checked before the cast."""
    split_sizes = _checks.index_vector("split_sizes", split_sizes)
    sorted_indices = _checks.index_vector("sorted_indices", sorted_indices)
    _checks.check_shape("sorted_indices", sorted_indices, split_sizes.shape,
                        f"{tuple(split_sizes.shape)} (one entry per chunk of split_sizes)")
    return split_sizes, sorted_indices


# -- the row maps: plan, then maps ---------------------------------------------------------
def chunk_sort_plan_reference(split_sizes, sorted_indices, *, num_tokens: int, xp: ModuleType = jnp):
    """The plan ``[PLAN_ROWS, C]`` int32 (rows in :mod:`te_jax_perm.kernels.chunk_sort`),
    scratch rows included, exactly as the plan kernel writes it, in plain ``xp``."""
    n, c = num_tokens, split_sizes.shape[0]
    # Sizes clipped to [0, N], then summed saturating at N: int32 cannot overflow, and chunks
    # are truncated where the input ends.
    sizes = xp.clip(split_sizes, 0, n).astype(xp.int32)
    if xp is np:
        incl = np.minimum(np.cumsum(sizes.astype(np.int64)), n).astype(np.int32)
    else:
        incl = jax.lax.associative_scan(lambda a, b: a + jnp.minimum(b, n - a), sizes)
    excl = xp.concatenate([xp.zeros((1,), xp.int32), incl[:-1]])
    eff = incl - excl
    # Each chunk is placed at the first position naming it; other positions are empty.
    pos = xp.arange(c, dtype=xp.int32)
    named = (sorted_indices >= 0) & (sorted_indices < c)
    at = xp.where(named, sorted_indices, 0).astype(xp.int32)
    code = _scatter_max(xp, xp.zeros((c,), xp.int32), at, xp.where(named, c - pos, 0).astype(xp.int32))
    first = named & (c - code[at] == pos)
    size_at = xp.where(first, eff[at], 0).astype(xp.int32)
    out_incl = xp.cumsum(size_at).astype(xp.int32)
    out_excl = out_incl - size_at
    placed = code > 0
    start = out_excl[xp.where(placed, c - code, 0)]
    rows = (incl, xp.where(placed, start - excl, 0), placed.astype(xp.int32), out_incl,
            xp.where(first, excl[at] - out_excl, 0), code, eff, excl, out_excl)
    return (xp.stack([r.astype(xp.int32) for r in rows]),)


def chunk_sort_map_reference(plan, *, num_tokens: int, xp: ModuleType = jnp):
    """``(row_id_map, src_map)`` of a chunk sort from its plan, in plain ``xp``."""
    c = plan.shape[1]
    rows = xp.arange(num_tokens, dtype=xp.int32)
    incl, out_incl = plan[int(K.INCL.value)], plan[int(K.OUT_INCL.value)]
    chunk = xp.minimum(xp.searchsorted(incl, rows, side="right"), c - 1)
    mapped = (rows < incl[-1]) & (plan[int(K.PLACED.value)][chunk] > 0)
    dst = xp.where(mapped, rows + plan[int(K.DST_SHIFT.value)][chunk], -1)
    pos = xp.minimum(xp.searchsorted(out_incl, rows, side="right"), c - 1)
    src = xp.where(rows < out_incl[-1], rows + plan[int(K.SRC_SHIFT.value)][pos], -1)
    return dst.astype(xp.int32), src.astype(xp.int32)


def chunk_maps_reference(split_sizes, sorted_indices, *, num_tokens: int, xp: ModuleType = jnp):
    """``(row_id_map, src_map)`` of a chunk sort, in plain ``xp``: plan, then maps."""
    (plan,) = chunk_sort_plan_reference(split_sizes, sorted_indices, num_tokens=num_tokens, xp=xp)
    return chunk_sort_map_reference(plan, num_tokens=num_tokens, xp=xp)


def _scatter_max(xp: ModuleType, base, index, values):
    if xp is np:
        np.maximum.at(base, index, values)
        return base
    return base.at[index].max(values)


# -- the row movement: a gather by a source map, with optional probs --------------------
def gather_rows_reference(inp, src_map, probs=None):
    """Output row ``i`` = ``inp[src_map[i]]`` (and the same for probs), zero where
    ``src_map[i]`` is outside ``[0, N)``, in plain JAX."""
    mapped = (src_map >= 0) & (src_map < inp.shape[0])
    src = jnp.where(mapped, src_map, 0)
    outs = (jnp.where(mapped[:, None], inp[src], jnp.zeros((), inp.dtype)),)
    if probs is not None:
        outs += (jnp.where(mapped, probs[src], jnp.zeros((), probs.dtype)),)
    return outs
