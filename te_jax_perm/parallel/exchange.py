"""The two row exchanges of the expert-parallel layer, dense and ragged.

Both deliver the same receive layout, ``[ep * C, H]`` with source rank ``s``'s rows at
``s*C .. s*C + n_s - 1`` and zeros after them, and bring the expert outputs home into the
dispatch layout ``[n, H]`` (rows bound for rank ``d`` at ``rank_start[d] ..``, zeros
elsewhere). They differ in what crosses the wire:

* ``dense``: ``jax.lax.all_to_all`` of a ``[ep, C, H]`` buffer, each chunk zero-padded to
  the static capacity ``C``; runs everywhere.
* ``ragged``: ``jax.lax.ragged_all_to_all`` straight from the dispatch buffer, exactly the
  kept rows per destination (offsets and sizes come from the per-expert row counts); no
  padding is sent, no send buffer is built. Needs backend support (see
  :mod:`te_jax_perm.parallel.a2a_support`).

Rows of the dispatch buffer past the kept rows are never read (they may be uninitialised).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax_perm.core.manual_axes import vary_like


def _a2a_vec(v: jax.Array, axis: str) -> jax.Array:
    """[ep] -> [ep]: element d goes to rank d, which receives one element from every rank."""
    return jax.lax.all_to_all(v[:, None], axis, 0, 0).reshape(-1)


def send_rows(rows: jax.Array, rank_start: jax.Array, sent: jax.Array, recv: jax.Array, cap: int,
              axis: str, mode: str) -> jax.Array:
    """Delivers each destination's chunk of ``rows``.

    Args:
      rows: ``[n, H]`` dispatch buffer, chunk for rank ``d`` at ``rank_start[d]``.
      rank_start: int32 ``[ep]``.
      sent: int32 ``[ep]`` rows sent to each rank (``<= cap``).
      recv: int32 ``[ep]`` rows received from each rank (``all_to_all`` of ``sent``).
      cap: static rows per (source, destination) slot.
      axis: mesh axis name.
      mode: ``"dense"`` or ``"ragged"``.

    Returns:
      ``[ep * cap, H]``: source ``s``'s rows at ``s*cap``, zeros after them.
    """
    ep = sent.shape[0]
    h = rows.shape[1]
    if mode == "ragged":
        me = jax.lax.axis_index(axis).astype(jnp.int32)
        out = _ragged_output((ep * cap, h), rows)
        return jax.lax.ragged_all_to_all(rows, out, rank_start, sent, jnp.full((ep,), me * cap, jnp.int32),
                                         recv, axis_name=axis)
    slot = jnp.arange(cap, dtype=jnp.int32)
    valid = slot[None, :] < sent[:, None]                               # [ep, C]
    src = jnp.where(valid, rank_start[:, None] + slot[None, :], 0)
    send = jnp.where(valid[..., None], rows[src], jnp.zeros((), rows.dtype))
    return jax.lax.all_to_all(send, axis, 0, 0).reshape(ep * cap, h)


def return_rows(back: jax.Array, rank_start: jax.Array, sent: jax.Array, recv: jax.Array, n: int,
                axis: str, mode: str) -> jax.Array:
    """The inverse of :func:`send_rows`: ``[ep * cap, H]`` in receive layout -> ``[n, H]`` home.

    Rows that were not sent (dropped, or past the kept rows) are zero.
    """
    h = back.shape[1]
    ep = sent.shape[0]
    cap = back.shape[0] // ep
    if mode == "ragged":
        out = _ragged_output((n, h), back)
        # Where the rows go on their home rank: that rank's rank_start entry for this rank.
        home_offsets = _a2a_vec(rank_start, axis)
        return jax.lax.ragged_all_to_all(back, out, jnp.arange(ep, dtype=jnp.int32) * cap, recv,
                                         home_offsets, sent, axis_name=axis)
    ret = jax.lax.all_to_all(back.reshape(ep, cap, h), axis, 0, 0)    # [ep(dst), C, H]
    slot = jnp.arange(cap, dtype=jnp.int32)
    valid = slot[None, :] < sent[:, None]
    dst = jnp.where(valid, rank_start[:, None] + slot[None, :], n)
    return jnp.zeros((n, h), back.dtype).at[dst].set(ret, mode="drop")


def _ragged_output(shape: tuple[int, int], operand: jax.Array) -> jax.Array:
    """The zeros ``ragged_all_to_all`` writes into, typed as varying like ``operand``.
    JAX gives the collective's result the varying axes of this buffer, not of the rows it
    receives: from a plain ``jnp.zeros`` the result would claim to be the same on every
    device, and its gradient would then be one device's cotangent on all of them."""
    return vary_like([jnp.zeros(shape, operand.dtype)], [operand])[0]
