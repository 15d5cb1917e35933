"""Pure-JAX references of the row-id map's kernels (their ``xla`` backend) and the public
:func:`row_id_map_reference`, written once for NumPy and JAX alike (``xp``) so that the
autotuner's trial operands come from the same code as the results they are checked against;
and the rules for reading a map (which entries count, which entry owns each row) that every
op reading one follows.
"""
from __future__ import annotations

from types import ModuleType

import jax.numpy as jnp

from te_jax_perm import _checks

NO_DROP = 2**31 - 1  # drop threshold meaning "keep every routed row"


def drop_threshold(num_out_tokens: int | None) -> int:
    """The kernels' ``drop_at`` of a row budget: rows at or past it are dropped."""
    return NO_DROP if num_out_tokens is None else _checks.check_static_int("num_out_tokens", num_out_tokens, 0)


def row_id_map_reference(routing_map, num_out_tokens: int | None = None, xp: ModuleType = jnp):
    """What :func:`~te_jax_perm.ops.row_id_map.api.make_row_id_map` returns, in plain ``xp``
    (``jax.numpy`` or ``numpy``). The map does not depend on how tokens are blocked, so one
    block holds them all."""
    block_t = max(routing_map.shape[0], 1)
    m = routed(routing_map, xp)
    return map_from_counts(routing_map, block_sums(m, block_t, xp), block_t, drop_threshold(num_out_tokens), xp)


def num_blocks(t: int, block_t: int) -> int:
    return -(-t // block_t)


def routed(rm, xp: ModuleType = jnp):
    return (rm != 0).astype(xp.int32)


def block_sums(m, block_t: int, xp: ModuleType = jnp):
    """Per-block column sums of the int32 [T, E] matrix ``m``: int32 [NB, E]."""
    t, e = m.shape
    nb = num_blocks(t, block_t)
    return xp.pad(m, ((0, nb * block_t - t), (0, 0))).reshape(nb, block_t, e).sum(axis=1, dtype=xp.int32)


def map_from_counts(rm, counts, block_t: int, drop_at: int, xp: ModuleType = jnp):
    """``(row_id_map int32 [T, 2E+1], kept int32 [E])`` of routing map ``rm`` given its
    per-block counts, exactly as the kernels build them (layout in ``kernels/row_id_map.py``)."""
    t, e = rm.shape
    m = routed(rm, xp)
    nb = num_blocks(t, block_t)
    within = (xp.cumsum(xp.pad(m, ((0, nb * block_t - t), (0, 0))).reshape(nb, block_t, e), axis=1)
              .reshape(nb * block_t, e)[:t] - m)
    totals = counts.sum(axis=0, dtype=xp.int32)
    prefix = xp.cumsum(counts, axis=0, dtype=xp.int32) - counts
    start = xp.cumsum(totals) - totals
    dest = start[None, :] + prefix[xp.arange(t) // block_t] + within
    is_routed = m > 0
    cnt = m.sum(axis=1, dtype=xp.int32)
    rank_r = xp.cumsum(m, axis=1) - m
    rank_n = xp.cumsum(1 - m, axis=1) - (1 - m)
    col = xp.where(is_routed, rank_r, cnt[:, None] + rank_n)
    order = xp.argsort(col, axis=1)  # a permutation per row: ties cannot occur
    vd = xp.where(is_routed & (dest < drop_at), dest, -1).astype(xp.int32)
    ve = xp.where(is_routed, xp.arange(e, dtype=xp.int32)[None, :], -1)
    rid = xp.concatenate([xp.take_along_axis(vd, order, 1), xp.take_along_axis(ve, order, 1).astype(xp.int32),
                          cnt[:, None]], axis=1)
    return rid, kept_of(totals, drop_at, xp)


def kept_of(totals, drop_at: int, xp: ModuleType = jnp):
    """Each expert's rows not dropped, from its routed-row ``totals`` ``[E]``: experts fill the
    expert-sorted rows in ascending order, and rows at or past ``drop_at`` are dropped (what
    the map kernels write as ``kept``)."""
    start = xp.cumsum(totals) - totals
    return xp.clip(drop_at - start, 0, totals).astype(xp.int32)


def padded_counts_of(kept, align: int):
    """Each expert's ``kept`` rows rounded up to a multiple of ``align``."""
    return (kept + align - 1) // align * align


def pad_offsets_of(kept, align: int, xp: ModuleType = jnp):
    """Padding rows before each expert when its ``kept`` rows are rounded up to multiples
    of ``align`` (zeros for ``align == 1``)."""
    padded = padded_counts_of(kept, align)
    return ((xp.cumsum(padded) - padded) - (xp.cumsum(kept) - kept)).astype(xp.int32)


# -- reading a map: the entries every kernel that reads one counts, and their owners ----------
def dests(rid, pad, padded):
    """(dest [T,E] with -1 where absent, expert ids [T,E] clipped to [0,E), valid [T,E]).

    An entry counts only as the kernels count it: a column below the token's routed count
    (clamped to [0, E]), a non-negative destination and an expert id in [0, E)."""
    e = (rid.shape[1] - 1) // 2
    dest, ex = rid[:, :e], rid[:, e:2 * e]
    n_routed = jnp.clip(rid[:, 2 * e], 0, e)
    valid = (dest >= 0) & (jnp.arange(e)[None, :] < n_routed[:, None]) & (ex >= 0) & (ex < e)
    if padded:
        dest = dest + pad[jnp.clip(ex, 0, e - 1)]
        valid = valid & (dest >= 0)
    return jnp.where(valid, dest, -1), jnp.clip(ex, 0, e - 1), valid


# Entry ids t*E + j + 1 are int32 (one per map entry, plus one).
MAX_ENTRIES = 2**31 - 2


def check_entry_ids(what: str, tokens: int, experts: int) -> None:
    """Raises unless every map entry of ``tokens`` x ``experts`` has an int32 entry id."""
    if tokens * experts > MAX_ENTRIES:
        raise ValueError(f"{what} of {tokens} tokens and {experts} experts has T*E = {tokens * experts} entries; "
                         f"at most {MAX_ENTRIES} are supported")


def padded_extent(drop_at: int, num_experts: int, align: int) -> int:
    """The most rows a dispatch map with row budget ``drop_at`` can address once each of
    ``num_experts`` experts' kept rows is padded up to a multiple of ``align`` (at most
    ``align - 1`` rows each): the largest value its int32 row arithmetic reaches."""
    return drop_at + num_experts * (align - 1)


def row_owner_reference(rid, pad, *, num_out_rows, padded):
    """Kernel ``row_owner``: per output row, ``t*E + j + 1`` of the highest map entry
    (token ``t``, column ``j``) addressing it, 0 where none does."""
    t, e = rid.shape[0], (rid.shape[1] - 1) // 2
    dest, _, valid = dests(rid, pad, padded)
    valid = valid & (dest < num_out_rows)
    ids = (jnp.arange(t, dtype=jnp.int32)[:, None] * e + jnp.arange(e, dtype=jnp.int32)[None, :] + 1)
    # Entries without a row are sent to row num_out_rows, past the table, and dropped there:
    # an extra slot would need num_out_rows + 1 as an int32 index, past int32 at 2**31 - 1 rows.
    safe = jnp.where(valid, dest, num_out_rows).ravel()
    owner = jnp.zeros((num_out_rows,), jnp.int32).at[safe].max(jnp.where(valid, ids, 0).ravel(), mode="drop")
    return (owner,)


def dispatch_extras(rid, kept, *, align, num_out_rows):
    """The dispatch map's extras, in JAX: destinations shifted by the padding, and each of
    ``num_out_rows`` rows' writing entry ``t*E + j + 1`` (0 for none), as the kernels write
    them."""
    e = kept.shape[0]
    dest = rid[:, :e]
    shifted = jnp.where(dest >= 0, dest + pad_offsets_of(kept, align)[jnp.clip(rid[:, e:2 * e], 0, e - 1)], dest)
    rid = jnp.concatenate([shifted.astype(jnp.int32), rid[:, e:]], axis=1)
    (owner,) = row_owner_reference(rid, jnp.zeros((e,), jnp.int32), num_out_rows=num_out_rows, padded=False)
    return rid, kept, owner


def row_id_map_block_counts_reference(rm, *, block_t):
    return (block_sums(routed(rm), block_t),)


def row_id_map_fill_reference(rm, counts, *, block_t, drop_at):
    return map_from_counts(rm, counts, block_t, drop_at)


def row_id_map_fused_reference(rm, *, block_t, drop_at):
    return map_from_counts(rm, block_sums(routed(rm), block_t), block_t, drop_at)


def dispatch_map_fill_reference(rm, counts, *, block_t, drop_at, align, num_out_rows):
    return dispatch_extras(*map_from_counts(rm, counts, block_t, drop_at), align=align, num_out_rows=num_out_rows)


def dispatch_map_fused_reference(rm, *, block_t, drop_at, align, num_out_rows):
    return dispatch_map_fill_reference(rm, block_sums(routed(rm), block_t), block_t=block_t, drop_at=drop_at,
                                       align=align, num_out_rows=num_out_rows)
