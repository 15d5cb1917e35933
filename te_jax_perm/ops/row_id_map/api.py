"""The row-id map: where each (token, routed expert) pair lands in the expert-sorted rows.

Built on device by Triton kernels (see :mod:`te_jax_perm.kernels.row_id_map` for the
layout): one launch for small ``T*E``, else two (per-block counts, then fill); no host
sync, no data-dependent shapes, no XLA ops around the kernels.
"""
from __future__ import annotations

from typing import Any

import jax

from te_jax_perm import _checks
from te_jax_perm.ops.row_id_map.decl import (dispatch_map_fill, dispatch_map_fused, map_plan, row_id_map_block_counts,
                                             row_id_map_fill, row_id_map_fused)
from te_jax_perm.ops.row_id_map.reference import dispatch_map_fused_reference, drop_threshold, num_blocks
from te_jax_perm.ops.tiling import next_pow2, not_pow2


@_checks.keyword_only
def make_row_id_map(routing_map: jax.Array, num_out_tokens: int | None = None, *,
                    block_tokens: int | None = None, single_pass: bool | None = None,
                    backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Builds the row-id map of a routing map, on device.

    Args:
      routing_map: ``[T, E]`` bool or integer 0/1; ``routing_map[t, e]`` routes token ``t``
        to expert ``e``.
      num_out_tokens: static row budget; rows whose expert-sorted destination is
        ``>= num_out_tokens`` are dropped (their map entry is ``-1``). ``None`` keeps all.
      block_tokens: tokens per block (one program each; a power of two; past ``T``, one
        block of all the tokens); ``None`` takes
        :func:`~te_jax_perm.ops.row_id_map.decl.map_plan`'s, measured per (T, E). Results do
        not depend on it.
      single_pass: one launch in which every program reduces the whole routing map
        (``True``), or per-block counts then fill (``False``); ``None`` takes the plan's.
        Results do not depend on it.
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; ``None`` picks the default.

    Returns:
      ``(row_id_map, tokens_per_expert)``: ``row_id_map`` int32 ``[T, 2E+1]`` (layout in
      :mod:`te_jax_perm.kernels.row_id_map`), ``tokens_per_expert`` int32 ``[E]``: rows kept
      per expert after dropping. The map addresses the rows of the whole routing map, also
      when its tokens are sharded over devices: move rows with it through
      :func:`~te_jax_perm.permute_with_mask_map` and
      :func:`~te_jax_perm.unpermute_with_mask_map`, not :func:`~te_jax_perm.token_combine`,
      which under token sharding reads a map per shard, as :func:`~te_jax_perm.token_dispatch`
      builds it.
    """
    routing_map = _checks.routing_map_array("routing_map", routing_map)
    _checks.check_rank("routing_map", routing_map, (2,), "[T, E]")
    drop_at = drop_threshold(num_out_tokens)
    t, e = routing_map.shape
    plan = map_plan(t, e)
    bt = plan.block_tokens if block_tokens is None else _checks.check_static_int("block_tokens", block_tokens, 1)
    if not_pow2("block_tokens", bt):
        raise ValueError(f"block_tokens must be a positive power of two, got {bt}")
    # A block past the tokens is one block of them all: the same result, without a program
    # walking sub-tiles of tokens that do not exist.
    bt = min(bt, next_pow2(t))
    if single_pass is None:
        single_pass = plan.single_pass or num_blocks(t, bt) <= 1
    else:
        single_pass = _checks.check_static_bool("single_pass", single_pass)
    return _build(routing_map, single_pass, bt, row_id_map_fused, row_id_map_fill, backend, drop_at=drop_at)


def _build(routing_map, single_pass: bool, block_t: int, fused, fill, backend, **params) -> tuple:
    """A map writer's outputs: ``fused`` in one launch, or per-block counts then ``fill``."""
    if single_pass:
        return tuple(fused(routing_map, backend=backend, block_t=block_t, **params))
    (counts,) = row_id_map_block_counts(routing_map, backend=backend, block_t=block_t)
    return tuple(fill(routing_map, counts, backend=backend, block_t=block_t, **params))


def checked_routing_map(routing_map: Any) -> jax.Array:
    """``routing_map`` as an array, checked as every op checks it: bool, or an integer dtype
    whose values (where concrete, or under ``TE_JAX_PERM_CHECKS=1``) are all 0 or 1."""
    return _checks.routing_map_array("routing_map", routing_map)


def dispatch_map(routing_map: jax.Array, num_out_tokens: int | jax.Array, align_size: int, num_out_rows: int,
                 backend: str | None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The map :func:`make_row_id_map` builds, for a dispatch into ``num_out_rows`` rows:
    ``(row_id_map, kept, owner)`` with destinations padded to multiples of ``align_size``
    per expert (1: no padding) and ``owner`` int32 ``[num_out_rows]``, each row's one
    writing entry ``t*E + j + 1`` (0: a padding or unused row), as ``row_owner`` computes
    it. Built with the map, so the scatter after it needs no owner pass.

    A traced ``num_out_tokens`` (a budget that depends on the routing) builds the same map
    with XLA ops: the kernels take the budget as a launch scalar, fixed when compiled."""
    if isinstance(num_out_tokens, jax.Array):
        return dispatch_map_fused_reference(routing_map, block_t=max(routing_map.shape[0], 1), drop_at=num_out_tokens,
                                            align=align_size, num_out_rows=num_out_rows)
    plan = map_plan(*routing_map.shape)
    return _build(routing_map, plan.single_pass, plan.block_tokens, dispatch_map_fused, dispatch_map_fill, backend,
                  drop_at=num_out_tokens, align=align_size, num_out_rows=num_out_rows)
