"""The two row exchanges of the expert-parallel layer, dense and ragged.

Both deliver the same receive layout, ``[ep * C, H]`` with source rank ``s``'s rows at
``s*C .. s*C + n_s - 1`` and zeros after them, and bring the expert outputs home into the
dispatch layout ``[n, H]`` (rows bound for rank ``d`` at ``rank_start[d] ..``, zeros
elsewhere). They differ in what crosses the wire:

* ``dense``: ``jax.lax.all_to_all`` of a ``[ep, C, H]`` buffer, each chunk zero-padded to
  the static capacity ``C``; runs everywhere.
* ``ragged``: ``jax.lax.ragged_all_to_all`` straight from the dispatch buffer, exactly the
  kept rows per destination (offsets and sizes come from the per-expert row counts); no
  padding is sent, no send buffer is built. Each destination's rows go as up to ``slices``
  slices (:func:`ragged_slices` says how many, and why). Needs backend support (see
  :mod:`te_jax_perm.parallel.a2a_support`).

Rows of the dispatch buffer past the kept rows are never read (they may be uninitialised).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp

from te_jax_perm.core.manual_axes import vary_like

#: Slices per destination of the ragged exchange between the devices of one process. There
#: XLA runs its one-shot ragged all-to-all kernel, one 128-thread block per slice: with each
#: destination's rows as one slice, two H200s moved 16384 rows of 4096 bf16 per peer in 50 ms,
#: where the dense all_to_all took 1.6 ms; cut into 256 slices, 1.4 ms, and forward plus
#: backward 2.1 ms against the dense exchange's 7.1 ms. Empty slices cost next to nothing there.
SLICES_PER_PEER = 256


def ragged_slices(devices: Sequence[jax.Device]) -> int:
    """Slices per destination for a ragged exchange over ``devices``:
    :data:`SLICES_PER_PEER` where they all belong to one process, else 1. Across processes
    XLA sends every slice as a send/receive pair of its own, empty ones included, so there
    one slice per destination is the cheapest."""
    return SLICES_PER_PEER if len({d.process_index for d in devices}) == 1 else 1


def _a2a_vec(v: jax.Array, axis: str) -> jax.Array:
    """[ep] -> [ep]: element d goes to rank d, which receives one element from every rank."""
    return jax.lax.all_to_all(v[:, None], axis, 0, 0).reshape(-1)


def send_rows(rows: jax.Array, rank_start: jax.Array, sent: jax.Array, recv: jax.Array, cap: int,
              axis: str, mode: str, slices: int) -> jax.Array:
    """Delivers each destination's chunk of ``rows``.

    Args:
      rows: ``[n, H]`` dispatch buffer, chunk for rank ``d`` at ``rank_start[d]``.
      rank_start: int32 ``[ep]``, non-decreasing: the chunks lie side by side in rank order.
      sent: int32 ``[ep]`` rows sent to each rank (``<= cap``).
      recv: int32 ``[ep]`` rows received from each rank (``all_to_all`` of ``sent``).
      cap: static rows per (source, destination) slot.
      axis: mesh axis name.
      mode: ``"dense"`` or ``"ragged"``.
      slices: the ragged exchange's slices per destination (:func:`ragged_slices`); the
        dense one ignores it.

    Returns:
      ``[ep * cap, H]``: source ``s``'s rows at ``s*cap``, zeros after them.
    """
    ep = sent.shape[0]
    h = rows.shape[1]
    if mode == "ragged":
        me = jax.lax.axis_index(axis).astype(jnp.int32)
        return _ragged(rows, ep * cap, rank_start, jnp.full((ep,), me * cap, jnp.int32), sent, recv, cap,
                       slices, axis)
    slots = _slot_rows(rank_start, sent, cap)
    send = _move_rows(rows, *slots, *_row_slots(rank_start, sent, cap, rows.shape[0]))
    return jax.lax.all_to_all(send.reshape(ep, cap, h), axis, 0, 0).reshape(ep * cap, h)


def return_rows(back: jax.Array, rank_start: jax.Array, sent: jax.Array, recv: jax.Array, n: int,
                axis: str, mode: str, slices: int) -> jax.Array:
    """The inverse of :func:`send_rows`: ``[ep * cap, H]`` in receive layout -> ``[n, H]`` home.

    Rows that were not sent (dropped, or past the kept rows) are zero.
    """
    h = back.shape[1]
    ep = sent.shape[0]
    cap = back.shape[0] // ep
    if mode == "ragged":
        # Where the rows go on their home rank: that rank's rank_start entry for this rank.
        # Sliced as the rows were sliced on the way out: the sizes are the same counts.
        return _ragged(back, n, jnp.arange(ep, dtype=jnp.int32) * cap, _a2a_vec(rank_start, axis), recv, sent,
                       cap, slices, axis)
    ret = jax.lax.all_to_all(back.reshape(ep, cap, h), axis, 0, 0).reshape(ep * cap, h)   # [(dst, slot), H]
    return _move_rows(ret, *_row_slots(rank_start, sent, cap, n), *_slot_rows(rank_start, sent, cap))


# The dense exchange places rows with gathers both ways. Written as XLA's gather and scatter
# (a row gather whose gradient is a scatter-add, a scatter to bring rows home), the scatters
# alone took 5.8 ms of a 21.7 ms training step on two H200s; each placement here is a gather
# whose gradient is the gather the other way, as the chunks never overlap.

def _slot_rows(rank_start: jax.Array, sent: jax.Array, cap: int) -> tuple[jax.Array, jax.Array]:
    """For each ``(destination, slot)`` of the ``[ep * cap]`` send layout: the dispatch row
    it holds, and whether it holds one (slot ``< sent``)."""
    slot = jnp.arange(cap, dtype=jnp.int32)[None, :]
    ok = slot < sent[:, None]                                           # [ep, C]
    return jnp.where(ok, rank_start[:, None] + slot, 0).reshape(-1), ok.reshape(-1)


def _row_slots(rank_start: jax.Array, sent: jax.Array, cap: int, n: int) -> tuple[jax.Array, jax.Array]:
    """For each of the ``n`` dispatch rows: its ``(destination, slot)`` as ``d * cap + slot``,
    and whether it is sent. Row ``i`` belongs to the last rank whose chunk starts at or before
    it (empty chunks share their start with the next one)."""
    i = jnp.arange(n, dtype=jnp.int32)
    d = jnp.clip(jnp.searchsorted(rank_start, i, side="right").astype(jnp.int32) - 1, 0, sent.shape[0] - 1)
    slot = i - rank_start[d]
    ok = (slot >= 0) & (slot < sent[d])
    return jnp.where(ok, d * cap + slot, 0), ok


def _take_rows(x: jax.Array, src: jax.Array, ok: jax.Array) -> jax.Array:
    if x.shape[0] == 0:     # capacity 0: nothing is sent, and there is nothing to gather from
        return _zeros_varying_like((src.shape[0], *x.shape[1:]), x)
    return jnp.where(ok[:, None], x[src], jnp.zeros((), x.dtype))


@jax.custom_vjp
def _move_rows(x: jax.Array, src: jax.Array, ok: jax.Array, back_src: jax.Array, back_ok: jax.Array) -> jax.Array:
    """Row ``r`` of the result is ``x[src[r]]`` where ``ok[r]``, else zero. ``(back_src,
    back_ok)`` is the same map read the other way (row ``q`` of ``x`` went to result row
    ``back_src[q]`` where ``back_ok[q]``), so the gradient is a gather too."""
    return _take_rows(x, src, ok)


def _move_rows_fwd(x, src, ok, back_src, back_ok):
    return _take_rows(x, src, ok), (back_src, back_ok)


def _move_rows_bwd(res, g):
    back_src, back_ok = res
    return _take_rows(g, back_src, back_ok), None, None, None, None


_move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


def _ragged(x: jax.Array, out_rows: int, src_start: jax.Array, dst_start: jax.Array, count: jax.Array,
            recv: jax.Array, cap: int, slices: int, axis: str) -> jax.Array:
    """``ragged_all_to_all`` of ``count[d]`` rows of ``x`` from ``src_start[d]`` to rank
    ``d``'s rows from ``dst_start[d]`` of an ``[out_rows, H]`` result, ``recv[s]`` rows
    arriving from rank ``s``, each chunk in up to ``slices`` slices."""
    u = max(1, min(slices, cap))   # no more slices than a chunk can have rows
    done, sizes = _cuts(count, u)
    # The output typed as varying like the rows: JAX gives the collective's result the
    # varying axes of this buffer, not of the rows it receives; from a plain jnp.zeros the
    # result would claim to be the same on every device, and its gradient would then be one
    # device's cotangent on all of them.
    out = _zeros_varying_like((out_rows, x.shape[1]), x)
    return jax.lax.ragged_all_to_all(x, out, (src_start[:, None] + done).reshape(-1), sizes.reshape(-1),
                                     (dst_start[:, None] + done).reshape(-1), _cuts(recv, u)[1].reshape(-1),
                                     axis_name=axis)


def _cuts(count: jax.Array, u: int) -> tuple[jax.Array, jax.Array]:
    """``[ep]`` chunk sizes -> ``[ep, u]`` slices of ``ceil(count / u)`` rows (the last ones
    shorter or empty): each slice's first row within its chunk, and its rows; destination-
    major when flattened, as ``ragged_all_to_all`` reads them. Sender and receiver cut the
    same count alike, so their slice sizes agree. An empty slice starts at its chunk's end,
    never past it."""
    q = (count + u - 1) // u
    done = jnp.minimum(jnp.arange(u, dtype=jnp.int32)[None, :] * q[:, None], count[:, None])
    return done, jnp.minimum(count[:, None] - done, q[:, None])


def _zeros_varying_like(shape: tuple[int, ...], operand: jax.Array) -> jax.Array:
    """Zeros of ``operand``'s dtype, typed as varying along the mesh axes it varies along."""
    return vary_like([jnp.zeros(shape, operand.dtype)], [operand])[0]
