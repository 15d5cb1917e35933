"""The row-id map: where each (token, routed expert) pair lands in the expert-sorted rows.

Built on device by Triton kernels (see :mod:`te_jax_perm.kernels.row_id_map` for the
layout): one launch for small ``T*E``, else two (per-block counts, then fill); no host
sync, no data-dependent shapes, no XLA ops around the kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import triton

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare
from te_jax_perm.kernels import row_id_map as K
from te_jax_perm.ops import _checks

NO_DROP = 2**31 - 1  # drop threshold meaning "keep every routed row"

# One launch while every program can afford to reduce the whole routing map (T*E bytes)
# itself: below this a second launch costs more than the redundant reads.
FUSED_MAX_ENTRIES = 1 << 17

# Blocks per map: enough programs for ~2 per SM (132 SMs on an H100); more blocks make
# every fill program's reduction of the [NB, E] counts longer.
_TARGET_BLOCKS = 256

_WARPS = tuple(Config.make(num_warps=w) for w in (1, 2, 4, 8))
_ROUTING = Operand("routing_map", ("T", "E"), ("int", "bool"))


def _block_e(e: int) -> int:
    return triton.next_power_of_2(max(e, 1))


def default_block_tokens(num_tokens: int, num_experts: int) -> int:
    """Tokens per block: about ``_TARGET_BLOCKS`` blocks, at most 128 tokens, a power of two."""
    return min(128, triton.next_power_of_2(max(1, -(-num_tokens // _TARGET_BLOCKS))))


def _sub_tokens(block_t: int, num_experts: int) -> int:
    """Tokens per sub-tile of the count/fill loops: ~2K routing entries in registers."""
    return max(1, min(block_t, 2048 // _block_e(num_experts)))


def _num_blocks(t: int, block_t: int) -> int:
    return -(-t // block_t)


def _tile_constexprs(d, p, c) -> dict:
    # E is compiled in (an exact key dim): routing rows become vector loads.
    return {"E": d["E"], "BLOCK_T": p["block_t"], "BLOCK_E": _block_e(d["E"]),
            "SUB": _sub_tokens(p["block_t"], d["E"])}


def _fill_constexprs(d, p, c) -> dict:
    # CH: rows of the reduced matrix per chunk, ~8K int32 counts or ~16K routing bytes;
    # from E and block_t only, so the binary does not depend on T.
    be = _block_e(d["E"])
    ch = max(1, 8192 // be) if "NB" in d else max(1, min(16384 // be, 32 * p["block_t"]))
    return {**_tile_constexprs(d, p, c), "CH": ch}


def _pow2(name: str, v: int) -> str | None:
    return None if v > 0 and v & (v - 1) == 0 else f"{name}={v} is not a power of two"


def _block_sums(m: jax.Array, block_t: int) -> jax.Array:
    t, e = m.shape
    nb = _num_blocks(t, block_t)
    return jnp.pad(m, ((0, nb * block_t - t), (0, 0))).reshape(nb, block_t, e).sum(axis=1, dtype=jnp.int32)


def _routed(rm: jax.Array) -> jax.Array:
    return (rm != 0).astype(jnp.int32)


# -- pass 1 of two: per-block expert counts ---------------------------------------------
def _counts_ref(rm, *, block_t):
    return (_block_sums(_routed(rm), block_t),)


block_counts = declare(KernelDecl(
    name="row_id_map_block_counts", kernel=K.block_counts_kernel,
    operands=(_ROUTING,),
    outputs=(Output("counts", lambda d, p: (_num_blocks(d["T"], p["block_t"]), d["E"]), lambda t, p: jnp.int32),),
    params=("block_t",),
    reference=_counts_ref,
    grid=lambda d, p, c: (_num_blocks(d["T"], p["block_t"]),),
    scalars=lambda d, p: {"T": d["T"]},
    constexprs=_tile_constexprs,
    configs=_WARPS,
    default_config=lambda d, p: Config.make(num_warps=4),
    key_dims=("E",),
    key_params=("block_t",),
))


# -- the fill: every token's row, and tokens_per_expert ------------------------------------
def _map_from_counts(rm, counts, block_t, drop_at):
    t, e = rm.shape
    m = _routed(rm)
    nb = _num_blocks(t, block_t)
    within = (jnp.cumsum(jnp.pad(m, ((0, nb * block_t - t), (0, 0))).reshape(nb, block_t, e), axis=1)
              .reshape(-1, e)[:t] - m)
    totals = counts.sum(axis=0, dtype=jnp.int32)
    prefix = jnp.cumsum(counts, axis=0, dtype=jnp.int32) - counts
    start = jnp.cumsum(totals) - totals
    dest = start[None, :] + prefix[jnp.arange(t) // block_t] + within
    routed = m > 0
    cnt = m.sum(axis=1, dtype=jnp.int32)
    rank_r = jnp.cumsum(m, axis=1) - m
    rank_n = jnp.cumsum(1 - m, axis=1) - (1 - m)
    col = jnp.where(routed, rank_r, cnt[:, None] + rank_n)
    order = jnp.argsort(col, axis=1)
    vd = jnp.where(routed & (dest < drop_at), dest, -1).astype(jnp.int32)
    ve = jnp.where(routed, jnp.arange(e, dtype=jnp.int32)[None, :], -1)
    rid = jnp.concatenate([jnp.take_along_axis(vd, order, 1), jnp.take_along_axis(ve, order, 1),
                           cnt[:, None]], axis=1)
    kept = jnp.clip(drop_at - start, 0, totals).astype(jnp.int32)
    return rid, kept


def _fill_ref(rm, counts, *, block_t, drop_at):
    return _map_from_counts(rm, counts, block_t, drop_at)


def _fused_ref(rm, *, block_t, drop_at):
    return _map_from_counts(rm, _block_sums(_routed(rm), block_t), block_t, drop_at)


def _example_routing(d, dtypes, rng):
    rm = rng.random((d["T"], d["E"])) < 0.3
    return rm if dtypes["routing_map"] == np.bool_ else rm.astype(dtypes["routing_map"])


def _fill_examples(d, p, dtypes, rng):
    rm = _example_routing(d, dtypes, rng)
    nb = d["NB"]
    m = np.pad(rm != 0, ((0, nb * p["block_t"] - d["T"]), (0, 0))).astype(np.int32)
    return rm, m.reshape(nb, p["block_t"], d["E"]).sum(axis=1).astype(np.int32)


def _fill_params_check(d, p) -> None:
    nb = _num_blocks(d["T"], p["block_t"])
    if d["NB"] != nb:
        raise ValueError(f"counts has {d['NB']} rows; expected cdiv(T={d['T']}, block_t={p['block_t']}) = {nb}")


_MAP_OUTPUTS = (Output("row_id_map", lambda d, p: (d["T"], 2 * d["E"] + 1), lambda t, p: jnp.int32),
                Output("tokens_per_expert", lambda d, p: (d["E"],), lambda t, p: jnp.int32))
# At least one program: program 0 writes tokens_per_expert even when T == 0.
_MAP_GRID = lambda d, p, c: (max(1, _num_blocks(d["T"], p["block_t"])),)  # noqa: E731
_MAP_SCALARS = lambda d, p: {"T": d["T"], "N": p["drop_at"]}  # noqa: E731

# What the two map writers (two-pass fill, one-pass fused) share: outputs, grid, scalars,
# compile-time constants and search space.
_MAP_WRITER = dict(outputs=_MAP_OUTPUTS, params=("block_t", "drop_at"), grid=_MAP_GRID, scalars=_MAP_SCALARS,
                   constexprs=_fill_constexprs, configs=_WARPS, key_dims=("E",), key_params=("block_t",))

fill_map = declare(KernelDecl(
    name="row_id_map_fill", kernel=K.fill_map_kernel,
    operands=(_ROUTING, Operand("counts", ("NB", "E"), ("int32",))),
    reference=_fill_ref,
    # 8 warps: the [SUB, 256] sub-tiles fit without spills at E=256 (sm_90 ptxas).
    default_config=lambda d, p: Config.make(num_warps=8),
    params_check=_fill_params_check,
    example_inputs=_fill_examples,
    **_MAP_WRITER,
))

fused_map = declare(KernelDecl(
    name="row_id_map_fused", kernel=K.fused_map_kernel,
    operands=(_ROUTING,),
    reference=_fused_ref,
    default_config=lambda d, p: Config.make(num_warps=4 if _block_e(d["E"]) <= 32 else 8),
    example_inputs=lambda d, p, dtypes, rng: (_example_routing(d, dtypes, rng),),
    **_MAP_WRITER,
))


def make_row_id_map(routing_map: jax.Array, num_out_tokens: int | None = None, *,
                    block_tokens: int | None = None, single_pass: bool | None = None,
                    backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Builds the row-id map of a routing map, on device.

    Args:
      routing_map: ``[T, E]`` bool or integer 0/1; ``routing_map[t, e]`` routes token ``t``
        to expert ``e``.
      num_out_tokens: static row budget; rows whose expert-sorted destination is
        ``>= num_out_tokens`` are dropped (their map entry is ``-1``). ``None`` keeps all.
      block_tokens: tokens per block (one program each; a power of two); the default
        suits the GPU. Results do not depend on it.
      single_pass: one launch in which every program reduces the whole routing map
        (``True``), or per-block counts then fill (``False``); ``None`` picks one launch
        while ``T*E <= FUSED_MAX_ENTRIES``. Results do not depend on it.
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
    if single_pass is None:
        single_pass = t * e <= FUSED_MAX_ENTRIES or _num_blocks(t, bt) <= 1
    if single_pass:
        rid, kept = fused_map(routing_map, backend=backend, block_t=bt, drop_at=drop_at)
    else:
        (counts,) = block_counts(routing_map, backend=backend, block_t=bt)
        rid, kept = fill_map(routing_map, counts, backend=backend, block_t=bt, drop_at=drop_at)
    return rid, kept
