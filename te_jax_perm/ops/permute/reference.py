"""Pure-JAX row movement through a row-id map: the ``xla`` backend of every permute kernel.

These are the CPU default and the pure-XLA baseline on GPU, so they must stay O(N*H + T*H
+ T*E) in memory: never a [T, E, H] tensor (60 GB at T=8192, E=256, H=7168). The scatters
go through the inverse map (output row -> token, expert), built from int32 [T, E] entries,
and move whole rows by gathers over the N output rows; the gathers sum each row into its
token the same way where every row has one entry, and otherwise loop over the map's
columns, one [T, H] gather per column, as their kernels do.

The kernel-level functions take the kernels' operands. A scatter's ``owner`` table (from
``row_owner``) names each output row's one writer; the references derive the same table
from the map themselves, so a wrong table cannot make the backends disagree silently.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax_perm.ops.row_id_map.reference import dests, row_owner_reference


def _inverse_map(rid, pad, padded, n):
    """Per output row: (token int32 [n], expert int32 [n]) of the entry that owns it, and the
    owner table (see :func:`row_owner_reference`); rows no entry owns (padding, unused budget)
    get token T and expert E, which index the zero row/column that callers pad their [T, .]
    and [T, E] arrays with."""
    t, e = rid.shape[0], (rid.shape[1] - 1) // 2
    if t == 0:  # no tokens: no row has an owner (and there is no map row to look up)
        return jnp.zeros((n,), jnp.int32), jnp.full((n,), e, jnp.int32), jnp.zeros((n,), jnp.int32)
    (owner,) = row_owner_reference(rid, pad, num_out_rows=n, padded=padded)
    return (*_row_entries(rid, owner), owner)


def _row_entries(rid, owner):
    """(token, expert) per row of the entry ``owner`` names; (T, E) where none."""
    t, e = rid.shape[0], (rid.shape[1] - 1) // 2
    entry = jnp.maximum(owner - 1, 0)
    tok, col = entry // e, entry % e
    row_token = jnp.where(owner > 0, tok, t).astype(jnp.int32)
    row_expert = jnp.where(owner > 0, jnp.clip(rid[jnp.minimum(tok, t - 1), e + col], 0, e - 1), e)
    return row_token, row_expert.astype(jnp.int32)


def _pad_rows(x):
    """``x`` with one zero row appended (the row unwritten output rows gather)."""
    return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], axis=0)


def _weights_at(w, row_token, row_expert):
    """``w[token, expert]`` per output row as float32, 0 for unwritten rows."""
    wp = jnp.pad(w.astype(jnp.float32), ((0, 1), (0, 1)))
    return wp[row_token, row_expert]


def _to_token_expert(values, owner, row_token, row_expert, t, e, dtype):
    """Scatter one value per output row into a ``dtype`` [T, E] matrix (zero elsewhere). Of
    two rows owned by one token's entries naming one expert, the later map column's value
    is kept, as the kernels store them column by column (an owner grows with the column,
    so the largest wins); a scatter of both would keep either."""
    last = jnp.zeros((t + 1, e + 1), jnp.int32).at[row_token, row_expert].max(owner)
    keep = owner == last[row_token, row_expert]
    rows = jnp.where(keep, row_token, t), jnp.where(keep, row_expert, e)   # the others to the cut corner
    return jnp.zeros((t + 1, e + 1), dtype).at[rows].set(values.astype(dtype))[:t, :e]


def permute_rows_reference(x, rid, pad, owner, probs=None, *, num_out_rows, padded):
    """Kernels ``permute`` / ``permute_probs``: token rows to expert-sorted rows."""
    del owner
    row_token, row_expert, _ = _inverse_map(rid, pad, padded, num_out_rows)
    # A gather of N rows (zero row for unwritten ones): bit-exact data movement.
    out = _pad_rows(x)[row_token]
    if probs is None:
        return (out,)
    pout = jnp.pad(probs, ((0, 1), (0, 1)))[row_token, row_expert]
    return out, pout


def to_output(v: jax.Array, dtype) -> jax.Array:
    """float32 sums ``v`` in the output ``dtype`` as the kernels store them: rounded to
    nearest, and into fp8 saturating at its largest finite value (the GPU's ``.satfinite``
    conversion, which Triton's interpreter follows), where XLA's own cast would give NaN or
    inf. NaN stays NaN."""
    if jnp.dtype(dtype).name.startswith("float8"):
        big = float(jnp.finfo(dtype).max)
        v = jnp.clip(v, -big, big)
    return v.astype(dtype)


def unpermute_bwd_weighted_reference(g, rid, pad, owner, w, y, *, padded):
    """Kernel ``unpermute_bwd_weighted``: the weighted combine's gradients (rows and weights)."""
    del owner
    n, t, e = y.shape[0], g.shape[0], w.shape[1]
    row_token, row_expert, writer = _inverse_map(rid, pad, padded, n)   # derived, not the operand
    g_rows = _pad_rows(g.astype(jnp.float32))[row_token]  # [N, H]; zero for unwritten rows
    out = to_output(g_rows * _weights_at(w, row_token, row_expert)[:, None], y.dtype)
    # d w[t, e] = <g[t], y[r]> for the row r of (t, e): N dots over H, scattered into [T, E].
    dots = jnp.sum(g_rows * y.astype(jnp.float32), axis=-1)
    return out, _to_token_expert(dots, writer, row_token, row_expert, t, e, w.dtype)


def unpermute_rows_reference(y, rid, pad, w=None, gpp=None, *, padded):
    """Kernels ``unpermute`` / ``unpermute_weighted`` (``w``) / ``permute_bwd_probs`` (``gpp``):
    each token sums the rows of all its map entries, in fp32, then casts; the probability
    gradient of an entry is ``gpp`` at its row.

    The kernels' result for any map. When no two entries name one row (every map a
    dispatch builds), each row has one token and the sums are segment sums over the rows
    (a few fused kernels); otherwise :func:`_gather_per_entry` runs. The choice is a
    ``cond`` on the device's values."""
    (n, h), t, e = y.shape, rid.shape[0], (rid.shape[1] - 1) // 2
    if n == 0 or t == 0 or e == 0:  # no entry has a row to read
        out = jnp.zeros((t, h), y.dtype)
        return (out,) if gpp is None else (out, jnp.zeros((t, e), gpp.dtype))
    dest, ex, valid = dests(rid, pad, padded)
    ok = valid & (dest < n)
    (owner,) = row_owner_reference(rid, pad, num_out_rows=n, padded=padded)
    one_per_row = jnp.sum(ok) == jnp.sum(owner > 0)
    return jax.lax.cond(one_per_row, lambda: _gather_by_row(y, rid, owner, w, gpp),
                        lambda: _gather_per_entry(y, dest, ex, ok, w, gpp))


def _gather_by_row(y, rid, owner, w, gpp):
    """The gathers where every row has at most one entry: each row summed into its token."""
    t, e = rid.shape[0], (rid.shape[1] - 1) // 2
    row_token, row_expert = _row_entries(rid, owner)
    rows = y.astype(jnp.float32)
    if w is not None:
        rows = rows * _weights_at(w, row_token, row_expert)[:, None]
    # Unwritten rows go to segment T, which is sliced off; f32 accumulation, then cast.
    out = to_output(jax.ops.segment_sum(rows, row_token, num_segments=t + 1)[:t], y.dtype)
    if gpp is None:
        return (out,)
    return out, _to_token_expert(gpp, owner, row_token, row_expert, t, e, gpp.dtype)


def _gather_per_entry(y, dest, ex, ok, w, gpp):
    """The gathers entry by entry, as the kernel computes them, for any map (entries
    ``dest``/``ex`` [T, E] counting where ``ok``): a loop over the map's columns up to the
    last one in use, each step one ``[T, H]`` gather of every token's entry in that column,
    added in column order (the kernel's fp32 order); of two entries of one token naming one
    expert, the later column's probability gradient wins."""
    (n, h), (t, e) = y.shape, dest.shape
    dest = jnp.where(ok, dest, n)  # absent entries read row n, past the end: the gathers fill zero
    tok = jnp.arange(t)
    cols = jnp.max(jnp.where(ok, jnp.arange(1, e + 1, dtype=jnp.int32), 0), initial=0)

    def column(j, carry):
        acc, dp = carry
        d, x = dest[:, j], ex[:, j]
        v = jnp.take(y, d, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
        if w is not None:
            wx = jnp.take_along_axis(w, x[:, None], axis=1).astype(jnp.float32)
            v = v * jnp.where(ok[:, j, None], wx, 0)  # as the kernel: 0, not 0 * w (inf, NaN)
        if dp is not None:
            dp = dp.at[tok, jnp.where(ok[:, j], x, e)].set(jnp.take(gpp, d, mode="fill", fill_value=0))
        return acc + v, dp

    init = (jnp.zeros((t, h), jnp.float32), None if gpp is None else jnp.zeros((t, e + 1), gpp.dtype))
    out, dprobs = jax.lax.fori_loop(0, cols, column, init)
    out = to_output(out, y.dtype)
    return (out,) if gpp is None else (out, dprobs[:, :e])


def permute_bwd_probs_reference(y, rid, pad, gpp, *, padded):
    return unpermute_rows_reference(y, rid, pad, None, gpp, padded=padded)
