"""Kernel declarations of the row-id map build: per-block counts, fill, and the fused one-pass;
and the dispatch's variants of the last two, which also pad and name each row's writer.

Their pure-JAX references (the ``xla`` backend) are in :mod:`te_jax_perm.ops.row_id_map.reference`.
"""
from __future__ import annotations

import dataclasses
import math
import jax.numpy as jnp
import numpy as np

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare
from te_jax_perm.kernels import row_id_map as K
from te_jax_perm._checks import INT32_MAX
from te_jax_perm.ops.row_id_map import reference as R
from te_jax_perm.ops.row_id_map.reference import block_sums, check_entry_ids, num_blocks, padded_extent, routed
from te_jax_perm.ops.tiling import lanes, pow2_at_most

# How the map is built, by token and expert count: one launch or two, tokens per block,
# warps. Each entry is the fastest of every variant measured on an H100 at that (T, E)
# (``python3 -m benchmarks.config_sweep --part rowmap``; the measurements are in
# benchmarks/results/sweep_rowmap_H100.json, and a test holds the table to them). One launch
# wins only while every program can afford to reduce the whole routing map itself (small
# T*E); otherwise two launches with about 128-512 blocks balance each fill program's
# reduction of the [NB, E] counts against parallelism.
MAP_PLANS = {
    (16, 8): (True, 1, 1), (16, 32): (True, 1, 1), (16, 128): (True, 1, 1), (16, 256): (False, 1, 4),
    (64, 8): (True, 2, 1), (64, 32): (True, 2, 1), (64, 128): (False, 1, 4), (64, 256): (False, 2, 4),
    (256, 8): (True, 16, 4), (256, 32): (False, 4, 4), (256, 128): (False, 4, 4), (256, 256): (False, 8, 4),
    (1024, 8): (True, 32, 4), (1024, 32): (False, 8, 4), (1024, 128): (False, 8, 4), (1024, 256): (False, 8, 4),
    (4096, 8): (False, 32, 4), (4096, 32): (False, 16, 4), (4096, 128): (False, 32, 4), (4096, 256): (False, 32, 4),
    (16384, 8): (False, 32, 4), (16384, 32): (False, 16, 4), (16384, 128): (False, 128, 4),
    (16384, 256): (False, 64, 4),
}
MAX_BLOCK_TOKENS = 128

_WARPS = tuple(Config.make(num_warps=w) for w in (1, 2, 4, 8))
_ROUTING = Operand("routing_map", ("T", "E"), ("int", "bool"))


@dataclasses.dataclass(frozen=True)
class MapPlan:
    single_pass: bool
    block_tokens: int
    num_warps: int


def map_plan(num_tokens: int, num_experts: int) -> MapPlan:
    """The build of the nearest measured (T, E) in log2 distance, keeping its number of
    blocks, so unseen sizes get the plan of their neighbourhood. Of equally near ones the
    plan with the fewest blocks wins: each fill program reduces blocks x E counts."""
    lt, le = math.log2(max(num_tokens, 1)), math.log2(max(num_experts, 1))

    def rank(item):
        (t0, e0), (_, bt0, _) = item
        return abs(math.log2(t0) - lt) + abs(math.log2(e0) - le), num_blocks(t0, bt0)

    (t0, _), (single, bt0, warps) = min(MAP_PLANS.items(), key=rank)
    bt = min(MAX_BLOCK_TOKENS, pow2_at_most(max(1, num_tokens // num_blocks(t0, bt0))))
    return MapPlan(single or num_blocks(num_tokens, bt) <= 1, bt, warps)


def _sub_tokens(block_t: int, num_experts: int) -> int:
    """Tokens per sub-tile of the count/fill loops: ~2K routing entries in registers."""
    return max(1, min(block_t, 2048 // lanes(num_experts)))


def _tile_constexprs(dims, params, config) -> dict:
    # E is compiled in (an exact key dim): routing rows become vector loads.
    e = dims["E"]
    return {"E": e, "BLOCK_T": params["block_t"], "BLOCK_E": lanes(e), "SUB": _sub_tokens(params["block_t"], e)}


def _fill_constexprs(dims, params, config) -> dict:
    # CH: rows of the reduced matrix per chunk, ~8K int32 counts or ~16K routing bytes;
    # from E and block_t only, so the binary does not depend on T.
    be = lanes(dims["E"])
    ch = max(1, 8192 // be) if "NB" in dims else max(1, min(16384 // be, 32 * params["block_t"]))
    return {**_tile_constexprs(dims, params, config), "CH": ch}


# -- autotuning trial operands ---------------------------------------------------------------
def _example_routing(dims, dtypes, rng):
    rm = rng.random((dims["T"], dims["E"])) < 0.3
    return rm if dtypes["routing_map"] == np.bool_ else rm.astype(dtypes["routing_map"])


def _fill_examples(dims, params, dtypes, rng):
    rm = _example_routing(dims, dtypes, rng)
    return rm, block_sums(routed(rm, np), params["block_t"], np)


def _fill_params_check(dims, params) -> None:
    nb = num_blocks(dims["T"], params["block_t"])
    if dims["NB"] != nb:
        raise ValueError(f"counts has {dims['NB']} rows; expected cdiv(T={dims['T']}, block_t={params['block_t']}) "
                         f"= {nb}")


def _dispatch_params_check(dims, params) -> None:
    if "NB" in dims:
        _fill_params_check(dims, params)
    check_entry_ids("routing_map", dims["T"], dims["E"])
    # Padded rows are int32 too.
    align = params["align"]
    if align < 1 or padded_extent(params["drop_at"], dims["E"], align) > INT32_MAX:
        raise ValueError(f"align_size = {align} with a budget of {params['drop_at']} rows and E = {dims['E']}: "
                         f"expected align_size >= 1 and at most 2**31 - 1 padded rows")


def _plan_warps(dims, params) -> Config:
    """Every map kernel's default: the warps of the build :func:`map_plan` picks."""
    return Config.make(num_warps=map_plan(dims["T"], dims["E"]).num_warps)


# -- declarations ------------------------------------------------------------------------------
row_id_map_block_counts = declare(KernelDecl(
    name="row_id_map_block_counts", kernel=K.row_id_map_block_counts_kernel,
    operands=(_ROUTING,),
    outputs=(Output("counts", lambda dims, params: (num_blocks(dims["T"], params["block_t"]), dims["E"]),
                    lambda dtypes, params: jnp.int32),),
    params=("block_t",),
    reference=R.row_id_map_block_counts_reference,
    grid=lambda dims, params, config: (num_blocks(dims["T"], params["block_t"]),),
    scalars=lambda dims, params: {"T": dims["T"]},
    constexprs=_tile_constexprs,
    configs=_WARPS,
    default_config=_plan_warps,
    key_dims=("E",),
    key_params=("block_t",),
))

# What the two map writers (two-pass fill, one-pass fused) share: outputs, grid, scalars,
# compile-time constants, search space and default.
_MAP_WRITER = dict(
    outputs=(Output("row_id_map", lambda dims, params: (dims["T"], 2 * dims["E"] + 1),
                    lambda dtypes, params: jnp.int32),
             Output("tokens_per_expert", lambda dims, params: (dims["E"],), lambda dtypes, params: jnp.int32)),
    params=("block_t", "drop_at"),
    # At least one program: program 0 writes tokens_per_expert even when T == 0.
    grid=lambda dims, params, config: (max(1, num_blocks(dims["T"], params["block_t"])),),
    scalars=lambda dims, params: {"T": dims["T"], "N": params["drop_at"]},
    constexprs=_fill_constexprs, configs=_WARPS, default_config=_plan_warps, key_dims=("E",),
    key_params=("block_t",))

row_id_map_fill = declare(KernelDecl(
    name="row_id_map_fill", kernel=K.row_id_map_fill_kernel,
    operands=(_ROUTING, Operand("counts", ("NB", "E"), ("int32",))),
    reference=R.row_id_map_fill_reference,
    params_check=_fill_params_check,
    example_inputs=_fill_examples,
    **_MAP_WRITER,
))

row_id_map_fused = declare(KernelDecl(
    name="row_id_map_fused", kernel=K.row_id_map_fused_kernel,
    operands=(_ROUTING,),
    reference=R.row_id_map_fused_reference,
    example_inputs=lambda dims, params, dtypes, rng: (_example_routing(dims, dtypes, rng),),
    **_MAP_WRITER,
))

# The dispatch's map: the same build, destinations padded (``align`` > 1) and each of the
# ``num_out_rows`` output rows' writing entry stored in ``owner`` (the row_owner table of
# the map, which the scatter needs), so no owner pass runs after it.
_DISPATCH_MAP = dict(
    _MAP_WRITER,
    outputs=_MAP_WRITER["outputs"] + (Output("owner", lambda dims, params: (params["num_out_rows"],),
                                             lambda dtypes, params: jnp.int32, init="zeros"),),
    params=("block_t", "drop_at", "align", "num_out_rows"),
    scalars=lambda dims, params: {"T": dims["T"], "N": params["drop_at"], "ALIGN": params["align"],
                                  "R": params["num_out_rows"]},
    params_check=_dispatch_params_check)

# The two-pass fills take ``counts`` as given (the public ops pass the block counts their
# first pass just wrote: checking them would copy the routing map to the host): counts that
# are not the map's give a map with rows out of place and shared, never a row outside the
# buffers (hostile counts run under the sanitizer in the tests).
dispatch_map_fill = declare(KernelDecl(
    name="dispatch_map_fill", kernel=K.dispatch_map_fill_kernel,
    operands=(_ROUTING, Operand("counts", ("NB", "E"), ("int32",))),
    reference=R.dispatch_map_fill_reference, example_inputs=_fill_examples, **_DISPATCH_MAP))

dispatch_map_fused = declare(KernelDecl(
    name="dispatch_map_fused", kernel=K.dispatch_map_fused_kernel,
    operands=(_ROUTING,),
    reference=R.dispatch_map_fused_reference,
    example_inputs=lambda dims, params, dtypes, rng: (_example_routing(dims, dtypes, rng),),
    **_DISPATCH_MAP))
