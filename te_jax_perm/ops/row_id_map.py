"""The row-id map: where each (token, routed expert) pair lands in the expert-sorted rows.

Built on device by three Triton kernels (see :mod:`te_jax_perm.kernels.row_id_map` for the
layout): no host sync, no data-dependent shapes.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare
from te_jax_perm.kernels import row_id_map as K
from te_jax_perm.ops import _checks

NO_DROP = 2**31 - 1  # drop threshold meaning "keep every routed row"

_WARPS = tuple(Config.make(num_warps=w) for w in (1, 2, 4, 8))


def _block_e(e: int) -> int:
    return triton.next_power_of_2(max(e, 1))


def default_block_tokens(num_tokens: int, num_experts: int) -> int:
    """Tokens per block of the count/fill passes: a tile of ~16K routing entries."""
    bt = max(1, min(128, 16384 // _block_e(num_experts)))
    return min(bt, triton.next_power_of_2(max(num_tokens, 1)))


def _sub_tokens(block_t: int, num_experts: int) -> int:
    """Tokens per sub-tile of the count/fill passes: ~2K routing entries in registers."""
    return max(1, min(block_t, 2048 // _block_e(num_experts)))


def _tile_constexprs(d, p, c) -> dict:
    # E is compiled in (an exact key dim): routing rows become 16-byte vector loads.
    return {"E": d["E"], "BLOCK_T": p["block_t"], "BLOCK_E": _block_e(d["E"]),
            "SUB": _sub_tokens(p["block_t"], d["E"])}


def _pow2(name: str, v: int) -> str | None:
    return None if v > 0 and v & (v - 1) == 0 else f"{name}={v} is not a power of two"


def _padded_blocks(m: jax.Array, block_t: int) -> jax.Array:
    t, e = m.shape
    nb = -(-t // block_t)
    return jnp.pad(m, ((0, nb * block_t - t), (0, 0))).reshape(nb, block_t, e)


# -- pass 1: per-block expert counts ---------------------------------------------------
def _counts_ref(rm, *, block_t):
    return (_padded_blocks((rm != 0).astype(jnp.int32), block_t).sum(axis=1, dtype=jnp.int32),)


block_counts = declare(KernelDecl(
    name="row_id_map_block_counts", kernel=K.block_counts_kernel,
    operands=(Operand("routing_map", ("T", "E"), ("int",)),),
    outputs=(Output("counts", lambda d, p: (-(-d["T"] // p["block_t"]), d["E"]), lambda t, p: jnp.int32),),
    params=("block_t",),
    reference=_counts_ref,
    grid=lambda d, p, c: (-(-d["T"] // p["block_t"]),),
    scalars=lambda d, p: {"T": d["T"]},
    constexprs=_tile_constexprs,
    configs=_WARPS,
    default_config=lambda d, p: Config.make(num_warps=4),
    key_dims=("E",),
    key_params=("block_t",),
))


# -- pass 2: exclusive scan of the counts over blocks ----------------------------------
def _scan_ref(counts):
    return (jnp.cumsum(counts, axis=0, dtype=jnp.int32) - counts, counts.sum(axis=0, dtype=jnp.int32))


block_scan = declare(KernelDecl(
    name="row_id_map_block_scan", kernel=K.block_scan_kernel,
    operands=(Operand("counts", ("NB", "E"), ("int32",)),),
    outputs=(Output("prefix", lambda d, p: (d["NB"], d["E"]), lambda t, p: jnp.int32),
             Output("totals", lambda d, p: (d["E"],), lambda t, p: jnp.int32)),
    reference=_scan_ref,
    grid=lambda d, p, c: (-(-d["E"] // c.kw["EC"]),),
    scalars=lambda d, p: {"NB": d["NB"], "E": d["E"]},
    configs=tuple(Config.make(num_warps=w, EC=ec, CH=ch) for ec in (16, 32, 64, 128)
                  for ch in (8, 16, 32, 64) for w in (1, 4)),
    constraints=(lambda d, p, c: _pow2("EC", c.kw["EC"]) or _pow2("CH", c.kw["CH"]),),
    # Narrow expert groups: more programs walk the blocks in parallel (E=256: 16 programs,
    # 4 steps of 64 blocks at T=16384).
    default_config=lambda d, p: Config.make(num_warps=4, EC=min(16, _block_e(d["E"])),
                                            CH=min(64, _block_e(d["NB"]))),
    key_dims=("NB", "E"),
))


# -- pass 3: write each token's row ----------------------------------------------------
def _fill_ref(rm, prefix, totals, *, block_t, drop_at):
    t, e = rm.shape
    m = (rm != 0).astype(jnp.int32)
    mb = _padded_blocks(m, block_t)
    within = (jnp.cumsum(mb, axis=1) - mb).reshape(-1, e)[:t]
    start = jnp.cumsum(totals) - totals
    block_of = jnp.arange(t) // block_t
    dest = start[None, :] + prefix[block_of] + within
    routed = m > 0
    cnt = m.sum(axis=1, dtype=jnp.int32)
    rank_r = jnp.cumsum(m, axis=1) - m
    rank_n = jnp.cumsum(1 - m, axis=1) - (1 - m)
    col = jnp.where(routed, rank_r, cnt[:, None] + rank_n)
    order = jnp.argsort(col, axis=1)
    vd = jnp.where(routed & (dest < drop_at), dest, -1).astype(jnp.int32)
    ve = jnp.where(routed, jnp.arange(e, dtype=jnp.int32)[None, :], -1)
    return (jnp.concatenate([jnp.take_along_axis(vd, order, 1), jnp.take_along_axis(ve, order, 1),
                             cnt[:, None]], axis=1),)


fill_map = declare(KernelDecl(
    name="row_id_map_fill", kernel=K.fill_map_kernel,
    operands=(Operand("routing_map", ("T", "E"), ("int",)), Operand("prefix", ("NB", "E"), ("int32",)),
              Operand("totals", ("E",), ("int32",))),
    outputs=(Output("row_id_map", lambda d, p: (d["T"], 2 * d["E"] + 1), lambda t, p: jnp.int32),),
    params=("block_t", "drop_at"),
    reference=_fill_ref,
    grid=lambda d, p, c: (-(-d["T"] // p["block_t"]),),
    scalars=lambda d, p: {"T": d["T"], "N": p["drop_at"]},
    constexprs=_tile_constexprs,
    configs=_WARPS,
    # 8 warps: 114 registers at E=256 (4 warps: 222), no spills (sm_90 ptxas).
    default_config=lambda d, p: Config.make(num_warps=8),
    key_dims=("E",),
    key_params=("block_t",),
))


def make_row_id_map(routing_map: jax.Array, num_out_tokens: int | None = None, *,
                    block_tokens: int | None = None, backend: str | None = None
                    ) -> tuple[jax.Array, jax.Array]:
    """Builds the row-id map of a routing map, on device.

    Args:
      routing_map: ``[T, E]`` bool or integer 0/1; ``routing_map[t, e]`` routes token ``t``
        to expert ``e``.
      num_out_tokens: static row budget; rows whose expert-sorted destination is
        ``>= num_out_tokens`` are dropped (their map entry is ``-1``). ``None`` keeps all.
      block_tokens: tokens per block of the count/fill passes (a power of two); the
        default suits the GPU. Results do not depend on it.
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; ``None`` picks the default.

    Returns:
      ``(row_id_map, tokens_per_expert)``: ``row_id_map`` int32 ``[T, 2E+1]`` (layout in
      :mod:`te_jax_perm.kernels.row_id_map`), ``tokens_per_expert`` int32 ``[E]``: rows kept
      per expert after dropping.
    """
    routing_map = jnp.asarray(routing_map)
    _checks.check_rank("routing_map", routing_map, (2,), "[T, E]")
    _checks.check_routing_dtype("routing_map", routing_map)
    drop_at = NO_DROP if num_out_tokens is None else _checks.check_static_int("num_out_tokens", num_out_tokens, 0)
    t, e = routing_map.shape
    bt = default_block_tokens(t, e) if block_tokens is None else block_tokens
    if _pow2("block_tokens", bt):
        raise ValueError(f"block_tokens must be a positive power of two, got {bt}")
    if routing_map.dtype == jnp.bool_:
        routing_map = routing_map.astype(jnp.int8)  # kernels cannot load bool pointers portably
    (counts,) = block_counts(routing_map, backend=backend, block_t=bt)
    prefix, totals = block_scan(counts, backend=backend)
    (rid,) = fill_map(routing_map, prefix, totals, backend=backend, block_t=bt, drop_at=drop_at)
    start = jnp.cumsum(totals) - totals
    kept = jnp.clip(drop_at - start, 0, totals).astype(jnp.int32)
    return rid, kept
