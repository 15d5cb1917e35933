"""Kernel declarations of the row movers between token rows and expert-sorted rows.

Eight kernels over two bodies (see :mod:`te_jax_perm.kernels.permute`): the scatters
``permute``, ``permute_probs`` and ``unpermute_bwd_weighted``; the gathers ``unpermute``,
``unpermute_weighted`` and ``permute_bwd_probs``, and the first two's ``_owner`` variants
that also fill the row owner table; and ``row_owner``, the writer of each output row. Their
references are in :mod:`te_jax_perm.ops.permute.reference`; the public API and VJP rules in
:mod:`te_jax_perm.ops.permute.api`.
"""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from te_jax_perm.core import Config, KernelDecl, Operand, Output, Partitioning, declare
from te_jax_perm.kernels import permute as K
from te_jax_perm.ops.permute import reference as R
from te_jax_perm.ops.row_id_map.reference import (check_entry_ids, pad_offsets_of, row_id_map_reference,
                                                   row_owner_reference)
from te_jax_perm.ops.tiling import (MAX_TILE, lanes, next_pow2, not_pow2, pow2_at_most, pow2_bucket,
                                    tile_too_large)
from te_jax_perm.ops.tuned_defaults import tabled

FILL_ROWS = 16  # output rows per zero-fill program (only rows no token writes are touched)


# -- configs shared by all row-moving kernels ------------------------------------------
def whole_row(dims) -> int:
    """The tile width holding a whole row (a power of two, at most 8192 columns)."""
    return min(lanes(dims["H"]), 8192)


def _default_config(dims, params) -> Config:
    """Whole rows per program (up to 8192 elements: 16 KB of bf16, so H=7168 is one step),
    ~8192 elements per program so each thread keeps four 16-byte vectors in flight, and
    enough warps for that: 8 warps at H in {2880, 4096, 7168} (bf16: 2 rows of 4096 lanes,
    or 1 row of 8192 lanes; masked lanes past H move no bytes). Dtype-agnostic: fp32 rows
    double the bytes per thread, still well within registers (checked in the PTX test)."""
    block_h = whole_row(dims)
    rows = min(max(1, 8192 // block_h), 4, pow2_at_most(dims["T"]))
    return Config.make(num_warps=max(1, min(8, rows * block_h // 1024)), BLOCK_H=block_h, ROWS=rows)


_CONFIGS = tuple(Config.make(num_warps=w, num_stages=s, BLOCK_H=bh, ROWS=r)
                 for bh in (64, 128, 256, 512, 1024, 2048, 4096, 8192) for r in (1, 2, 4)
                 for w in (1, 2, 4, 8) for s in (1, 2, 3, 4) if r * bh <= MAX_TILE and 16 * w <= r * bh)


def _block_h_ok(dims, params, config) -> str | None:
    bh = config.kw["BLOCK_H"]
    if why := not_pow2("BLOCK_H", bh):
        return why
    if bh > 2 * lanes(dims["H"]):
        return f"BLOCK_H={bh} is over twice the row width H={dims['H']} (all-masked lanes)"
    return tile_too_large(config.kw["ROWS"], bh)


def _rows_ok(dims, params, config) -> str | None:
    # Programs own the disjoint token ranges [pid*ROWS, pid*ROWS+ROWS) by construction;
    # ROWS beyond the token count would only add idle iterations.
    r = config.kw["ROWS"]
    if r < 1:
        return f"ROWS={r} must be >= 1"
    if r > 1 and r > dims["T"]:
        return f"ROWS={r} exceeds the token count T={dims['T']}"
    return None


# Every mover's constraints: what its declaration checks, and what a table entry must meet.
_CONSTRAINTS = (_block_h_ok, _rows_ok)


def _map_check(dims, params) -> None:
    if dims["W"] != 2 * dims["E"] + 1:
        raise ValueError(f"row_id_map has {dims['W']} columns; expected 2*E+1 = {2 * dims['E'] + 1} for "
                         f"E={dims['E']} experts (from pad_offsets)")


# Programs a mover wants at least: below this (small T, whole rows) an H100 leaves most of
# its 132 multiprocessors' load slots idle, and slicing rows into columns wins (H100 sweeps
# at T = 64 and 256: 1.1-1.7x).
MIN_PROGRAMS = 1024


def _small_t_slices(dims, cfg: Config) -> Config:
    """``cfg`` with rows cut into column slices when whole rows give under MIN_PROGRAMS
    programs, down to 256 columns, with a warp per 512 columns."""
    if _row_programs(dims, cfg) >= MIN_PROGRAMS or cfg.kw["BLOCK_H"] <= 256:
        return cfg
    want = max(256, pow2_at_most(max(1, dims["H"] * dims["T"] // MIN_PROGRAMS)))
    return Config.make(num_warps=max(1, min(4, want // 512)), num_stages=cfg.num_stages, BLOCK_H=want, ROWS=1)


def _gather_default_config(dims, params) -> Config:
    """Gathers (combine forward, dispatch backward) at a row width the table lacks: one
    token's whole row (H up to 8192) per program on 4 warps, within 1.5% of the best
    whole- or half-row tile at any warp count in an H100 sweep at all eleven benchmark
    shapes (H = 2048 to 7168, top-1 to top-8). At small T, column slices
    (:func:`_small_t_slices`)."""
    return _small_t_slices(dims, Config.make(num_warps=4, num_stages=1, BLOCK_H=whole_row(dims), ROWS=1))


def _scatter_default_config(dims, params) -> Config:
    """Scatters (dispatch forward) at a row width the table lacks: :func:`_default_config`,
    sliced at small T."""
    return _small_t_slices(dims, _default_config(dims, params))


def _weighted_scatter_default_config(dims, params) -> Config:
    """Combine backward at a row width the table lacks: one token's whole row per program
    (its weight gradient is a dot product over the row), 4 warps, 8 from H = 6144: the best
    of every tile shape, warp and stage count (within 0.1%) in an H100 sweep at H = 2048,
    2880 (4 warps) and 6144 (8 warps; 4 are 5% slower); at H = 5120, 8 warps were 6% slower
    than 4 and at 7168 1% faster."""
    return Config.make(num_warps=8 if dims["H"] >= 6144 else 4, num_stages=1, BLOCK_H=whole_row(dims), ROWS=1)


def _token_programs(dims, config) -> int:
    """Programs along the tokens: one per ROWS tokens (grid axis 0, before any fill programs)."""
    return -(-dims["T"] // config.kw["ROWS"])


def _row_programs(dims, config) -> int:
    """Programs that own token rows: ROWS tokens each, one per column slice."""
    return _token_programs(dims, config) * _slices(dims, config)


def _tabled(name: str, rule: Callable, programs: Callable = _row_programs) -> Callable:
    """``name``'s default from the shipped table of tuned defaults (at the token count T),
    where its config is valid here and fills the GPU, else ``rule``."""
    return tabled(name, rule, "T", _CONSTRAINTS, programs)


def _common(default_config=_default_config, params_check=_map_check, configs=_CONFIGS, **kw: Any) -> dict:
    return dict(configs=configs, constraints=_CONSTRAINTS, default_config=default_config,
                key_dims=("T", "H"), key_bucket=pow2_bucket("T"), key_params=("padded",), params_check=params_check, **kw)


# -- valid autotuning operands ----------------------------------------------------------
# Random ints are not a row-id map; trial operands come from a real map of top-k routing,
# with padding and drops as the params ask, so every candidate config can be validated.
def _np_layout(t: int, e: int, rows: int, padded: bool, rng: np.random.Generator):
    """A row-id map, pad offsets and row owners whose rows fit in ``rows`` output rows."""
    k = min(e, 4)
    top = np.argsort(rng.random((t, e)), axis=1)[:, :k]
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, top, True, axis=1)
    align = 4 if padded and rows > e * 3 else 1
    rid, kept = row_id_map_reference(rm, rows - e * (align - 1), xp=np)
    pad = pad_offsets_of(kept, align, xp=np)
    owner = np.asarray(row_owner_reference(rid, pad, num_out_rows=rows, padded=padded)[0])
    return rid, pad, owner


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _permute_example(with_probs: bool):
    def make(dims, params, dtypes, rng):
        t, h, e = dims["T"], dims["H"], dims["E"]
        rid, pad, owner = _np_layout(t, e, params["num_out_rows"], params["padded"], rng)
        ops = (_rand(rng, (t, h), dtypes["inp"]), rid, pad, owner)
        return ops + ((rng.random((t, e)).astype(dtypes["probs"]),) if with_probs else ())
    return make


def _unpermute_bwd_weighted_example(dims, params, dtypes, rng):
    t, h, e, n = dims["T"], dims["H"], dims["E"], dims["N"]
    rid, pad, owner = _np_layout(t, e, n, params["padded"], rng)
    return (_rand(rng, (t, h), dtypes["grad"]), rid, pad, owner,
            rng.random((t, e)).astype(dtypes["merging_probs"]), _rand(rng, (n, h), dtypes["fwd_inp"]))


def _unpermute_example(extra: str | None):
    def make(dims, params, dtypes, rng):
        t, h, e, n = dims["T"], dims["H"], dims["E"], dims["N"]
        rid, pad, _ = _np_layout(t, e, n, params["padded"], rng)
        ops = (_rand(rng, (n, h), dtypes["inp"]), rid, pad)
        if extra == "merging_probs":
            ops += (rng.random((t, e)).astype(dtypes[extra]),)
        elif extra == "grad_permuted_probs":
            ops += (rng.random(n).astype(dtypes[extra]),)
        return ops
    return make


# -- declarations ----------------------------------------------------------------------
# No dtype kind on the tokens: the row movers get them as unsigned-integer bit patterns
# (ops/_bits.py) and the summing kernels as floats; the public functions check token dtypes.
_X = Operand("inp", ("T", "H"))
_RID = Operand("row_id_map", ("T", "W"), ("int32",))
_PAD = Operand("pad_offsets", ("E",), ("int32",))
# The scatters' writer of each output row (``row_owner``'s table, or the dispatch map's or a
# combine forward's, all built from the same map): taken as given. A table of another map
# keeps every access inside the buffers but can leave a row to an entry that does not
# address it, so neither that entry nor the zero fill writes it; checking each row's owner
# against the map adds dependent map loads to every zero-fill program (on an H200 the
# dispatch forward took up to 1.4x its time at 1024 tokens, 1.7x padded), and the ops
# always pass their map's own table.
_OWNER = Operand("owner", ("R",), ("int32",))
# Probabilities in bf16, fp16 or fp32: loaded in their dtype, combined in fp32.
PROB_DTYPES = ("bfloat16", "float16", "float32")
_TE_PROBS = lambda name: Operand(name, ("T", "E"), PROB_DTYPES)  # noqa: E731


def _grad_probs(like: str) -> Output:
    """Gradient of [T, E] probabilities, in the dtype of operand ``like`` (the probs' dtype).
    The kernel stores each token's whole row of E (zeros where it has no entry)."""
    return Output("grad_probs", lambda dims, params: (dims["T"], dims["E"]), lambda dtypes, params: dtypes[like])


def _grad_lanes(dims, prob_grads: bool) -> int:
    """E_LANES: lanes of the store that zeroes a token's E probability gradients before its
    entries are written; 1 where the kernel has none, so it compiles one binary for every E."""
    return lanes(dims["E"]) if prob_grads else 1


def _slices(dims, config) -> int:
    """Programs along a row: one per BLOCK_H columns (grid axis 1), and one where rows have
    no columns: the slice-0 programs also write the values without a column axis (permuted
    probabilities and their gradients), which would otherwise be left as allocated."""
    return max(1, -(-dims["H"] // config.kw["BLOCK_H"]))


def _scatter_fill_grid(dims, rows: int, config, split: bool = True) -> tuple[int, int]:
    """Token programs first, then one zero-fill program per FILL_ROWS output rows; each
    ``split`` over the row's column slices."""
    return (_token_programs(dims, config) + -(-rows // FILL_ROWS), _slices(dims, config) if split else 1)


def _scatter_constexprs(prob_grads: bool):
    def constexprs(dims, params, config):
        # H is compiled in (16-byte vector rows, see kernels/permute.py); it is an exact key dim.
        fill_h = min(lanes(dims["H"]), 8192 // FILL_ROWS)
        out = {"H": dims["H"], "PADDED": params["padded"], "FILL_ROWS": FILL_ROWS, "FILL_H": fill_h,
               "E_LANES": _grad_lanes(dims, prob_grads)}
        if prob_grads:
            # The combine backward loads a token's gradient row once for all its rows when one
            # tile holds the row and there are rows to share it (at top-1 holding it only
            # costs registers).
            out["GRAD_ONCE"] = config.kw["BLOCK_H"] >= dims["H"] and several_rows_per_token(dims)
        return out
    return constexprs


def _owner_check(dims, params) -> None:
    _map_check(dims, params)
    check_entry_ids("row_id_map", dims["T"], dims["E"])


def _scatter_check(dims, params) -> None:
    """A scatter's owner table has one entry per output row."""
    _owner_check(dims, params)
    rows = dims["N"] if "N" in dims else params["num_out_rows"]
    if dims["R"] != rows:
        raise ValueError(f"owner has {dims['R']} rows; expected one per output row ({rows})")


# Map columns per row_owner step: 8 covers top-8 routing in one step.
OWNER_BLOCK_K = 8


def _owner_default_config(dims, params) -> Config:
    """About 128 map entries per program, one per thread of 4 warps: ``BLOCK_T`` tokens of
    about ``num_out_rows / T`` entries each (their top-k). In an H100 sweep of 8-64 tokens,
    1-4 warps and 1-4 stages this was the best config at k = 1, 2, 4 and at DeepSeek-V3's
    k = 8 (1.04-1.45x faster than 32 tokens on 2 warps); at Qwen3-235B's k = 8, 8 tokens
    were best (1.6x)."""
    k = max(1, params["num_out_rows"] // max(dims["T"], 1))
    return Config.make(num_warps=4, BLOCK_T=max(8, min(64, next_pow2(max(1, 128 // k)))))


row_owner = declare(KernelDecl(
    name="row_owner", kernel=K.row_owner_kernel,
    operands=(_RID, _PAD),
    outputs=(Output("owner", lambda dims, params: (params["num_out_rows"],), lambda dtypes, params: jnp.int32,
                    init="zeros"),),
    params=("num_out_rows", "padded"), reference=row_owner_reference,
    grid=lambda dims, params, config: (-(-dims["T"] // config.kw["BLOCK_T"]),),
    scalars=lambda dims, params: {"T": dims["T"], "E": dims["E"], "N": params["num_out_rows"]},
    constexprs=lambda dims, params, config: {"PADDED": params["padded"], "BLOCK_K": OWNER_BLOCK_K},
    configs=tuple(Config.make(num_warps=w, BLOCK_T=bt) for bt in (8, 16, 32, 64) for w in (1, 2, 4)),
    default_config=_owner_default_config,
    key_dims=("T", "E"), key_bucket=pow2_bucket("T"), key_params=("padded",), params_check=_owner_check,
    example_inputs=lambda dims, params, dtypes, rng: _np_layout(
        dims["T"], dims["E"], params["num_out_rows"], params["padded"], rng)[:2],
    # Not token-local: rows go anywhere; the owner table comes out whole.
))


def _permute_decl(name: str, kernel, with_probs: bool):
    """``permute`` / ``permute_probs``: token rows (and probs) to ``num_out_rows`` expert-sorted rows."""
    outputs = (Output("out", lambda dims, params: (params["num_out_rows"], dims["H"]),
                      lambda dtypes, params: dtypes["inp"]),)
    operands = (_X, _RID, _PAD, _OWNER)
    if with_probs:
        operands += (_TE_PROBS("probs"),)
        outputs += (Output("permuted_probs", lambda dims, params: (params["num_out_rows"],),
                           lambda dtypes, params: dtypes["probs"]),)
    # Each H-slice of a row moves independently, so a kernel that only moves (and sums)
    # rows is shard-local along H; never along tokens (rows go anywhere). Outputs without H
    # (permuted probs, their gradients) come out whole and identical on every H-shard.
    part = Partitioning(outputs=(("R", "H"), ("R",))[:len(outputs)], local=("H",))
    return declare(KernelDecl(
        name=name, kernel=kernel, operands=operands, outputs=outputs,
        params=("num_out_rows", "padded"), reference=R.permute_rows_reference,
        grid=lambda dims, params, config: _scatter_fill_grid(dims, params["num_out_rows"], config),
        scalars=lambda dims, params: {"T": dims["T"], "E": dims["E"], "N_OUT": params["num_out_rows"]},
        constexprs=_scatter_constexprs(False), example_inputs=_permute_example(with_probs), partitioning=part,
        **_common(default_config=_tabled(name, _scatter_default_config), params_check=_scatter_check)))


permute = _permute_decl("permute", K.permute_kernel, False)
permute_probs = _permute_decl("permute_probs", K.permute_probs_kernel, True)

unpermute_bwd_weighted = declare(KernelDecl(
    name="unpermute_bwd_weighted", kernel=K.unpermute_bwd_weighted_kernel,
    operands=(Operand("grad", ("T", "H")), _RID, _PAD, _OWNER, _TE_PROBS("merging_probs"),
              Operand("fwd_inp", ("N", "H"))),
    outputs=(Output("grad_inp", lambda dims, params: (dims["N"], dims["H"]), lambda dtypes, params: dtypes["fwd_inp"]),
             _grad_probs("merging_probs")),
    params=("padded",), reference=R.unpermute_bwd_weighted_reference,
    grid=lambda dims, params, config: _scatter_fill_grid(dims, dims["N"], config, split=False),
    scalars=lambda dims, params: {"T": dims["T"], "E": dims["E"], "N_OUT": dims["N"]},
    constexprs=_scatter_constexprs(True), exact=False, rtol=1e-5, atol=1e-5,
    # Not H-local: grad_probs is a dot product over all of H (replicated).
    example_inputs=_unpermute_bwd_weighted_example,
    # One program per ROWS tokens walks the whole row (no column slices).
    **_common(default_config=_tabled("unpermute_bwd_weighted", _weighted_scatter_default_config, _token_programs),
              params_check=_scatter_check)))


def several_rows_per_token(dims) -> bool:
    """Whether the expert-sorted side has at least two rows per token (``N >= 2T``): where a
    gather keeps two row loads in flight per program (faster at top-4 and top-8, 4-5% slower
    at top-1) and the combine backward loads a gradient row once for all its rows."""
    return dims["N"] >= 2 * max(dims["T"], 1)


# The row_owner table of a gather's map, filled by the gather itself (its ``_owner``
# variants): rows no entry names stay zero, the entries take their max.
_GATHER_OWNER = Output("owner", lambda dims, params: (dims["N"],), lambda dtypes, params: jnp.int32, init="zeros")


def _with_owner(reference):
    """The reference of a gather's ``_owner`` variant: its outputs and the map's row owners."""
    def owner_reference(y, rid, pad, *rest, padded):
        return (*reference(y, rid, pad, *rest, padded=padded),
                *row_owner_reference(rid, pad, num_out_rows=y.shape[0], padded=padded))
    return owner_reference


def _unpermute_decl(name, kernel, extra_ops, extra_outs, reference=R.unpermute_rows_reference, table=None):
    """A gather: each token's rows summed (fp32) into ``out [T, H]``; ``extra_outs`` ending in
    the owner table make the ``_owner`` variant of the gather ``table`` (whose tuned defaults
    it shares: the atomics add nothing a tile choice would weigh)."""
    extra = extra_ops[0].name if extra_ops else None
    owner = bool(extra_outs) and extra_outs[-1] is _GATHER_OWNER
    # Sums over a token's rows, slice by slice of H: H-local (grad_probs and the owner table
    # have no H axis; every H-shard computes the whole table).
    part = Partitioning(outputs=(("T", "H"),) + tuple(("N",) if o is _GATHER_OWNER else ("T", "E")
                                                      for o in extra_outs), local=("H",))
    return declare(KernelDecl(
        name=name, kernel=kernel,
        operands=(Operand("inp", ("N", "H")), _RID, _PAD, *extra_ops),
        outputs=(Output("out", lambda dims, params: (dims["T"], dims["H"]), lambda dtypes, params: dtypes["inp"]),
                 *extra_outs),
        params=("padded",), reference=_with_owner(reference) if owner else reference,
        grid=lambda dims, params, config: (_token_programs(dims, config), _slices(dims, config)),
        # N: rows of inp, the bound every row read is checked against.
        scalars=lambda dims, params: {"T": dims["T"], "E": dims["E"], "N": dims["N"]},
        constexprs=lambda dims, params, config: {"H": dims["H"], "PADDED": params["padded"],
                                                 "E_LANES": _grad_lanes(dims, bool(extra_outs) and not owner),
                                                 "TWO_IN_FLIGHT": several_rows_per_token(dims),
                                                 **({"BLOCK_K": OWNER_BLOCK_K} if owner else {})},
        exact=False, rtol=1e-2, atol=1e-2, example_inputs=_unpermute_example(extra), partitioning=part,
        **_common(default_config=_tabled(table or name, _gather_default_config),
                  params_check=_owner_check if owner else _map_check)))


unpermute = _unpermute_decl("unpermute", K.unpermute_kernel, (), ())
unpermute_weighted = _unpermute_decl("unpermute_weighted", K.unpermute_weighted_kernel, (_TE_PROBS("merging_probs"),), ())
# The combine forward under differentiation: its backward reads the owner table these fill.
unpermute_owner = _unpermute_decl("unpermute_owner", K.unpermute_owner_kernel, (), (_GATHER_OWNER,),
                                  table="unpermute")
unpermute_weighted_owner = _unpermute_decl("unpermute_weighted_owner", K.unpermute_weighted_owner_kernel,
                                           (_TE_PROBS("merging_probs"),), (_GATHER_OWNER,),
                                           table="unpermute_weighted")
permute_bwd_probs = _unpermute_decl(
    "permute_bwd_probs", K.permute_bwd_probs_kernel, (Operand("grad_permuted_probs", ("N",), PROB_DTYPES),),
    (_grad_probs("grad_permuted_probs"),), reference=R.permute_bwd_probs_reference)
