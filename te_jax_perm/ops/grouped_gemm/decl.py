"""Kernel declarations of the grouped GEMM: the forward, the input gradient (``rhs`` read
transposed in place) and the weight gradient (each group's rows reduced). One launch each,
its tile schedule computed on the device from ``group_sizes``: nothing is densified.

The forward and the input gradient have two kinds of config in one tuning space: one
program per tile with pointer loads (``MM_CONFIGS``, the default), and ``TMA=True`` configs
(``TMA_CONFIGS``), whose ``PROGRAMS`` programs loop over the tiles and move them by tensor
descriptors (TMA on Hopper), for rows of 16-byte multiples (``tma_fits``).

On Hopper the forward and the input gradient run their Hopper declarations
(``grouped_gemm_hopper``, ``grouped_gemm_rhs_t_hopper``, picked by :func:`mm_for`): the same
kernel and tuning space, whose default moves 128x256 tiles by TMA where they fit; and the
weight gradient of 16-bit operands has a warp-specialised kernel with a tuning space of its
own (``grouped_gemm_wgrad_ws``, picked by :func:`wgrad_for`).

Their references are :mod:`te_jax_perm.ops.grouped_gemm.reference`'s; the public API and VJP
are in :mod:`te_jax_perm.ops.grouped_gemm.api`.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import triton

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare
from te_jax_perm.kernels.grouped_gemm import grouped_gemm_kernel, grouped_gemm_wgrad_kernel
from te_jax_perm.kernels.grouped_gemm_ws import grouped_gemm_wgrad_ws_kernel
from te_jax_perm.ops.grouped_gemm.reference import (grouped_gemm_reference, grouped_gemm_rhs_t_reference,
                                                    grouped_gemm_wgrad_reference)
from te_jax_perm.ops.tiling import next_pow2, pow2_bucket

FLOATS = ("float16", "bfloat16", "float32")
# Hopper has 227 KiB of shared memory per block; leave room for the epilogue.
_SMEM_BYTES = 200 * 1024
_HOPPER_SMEM_BYTES = 227 * 1024


def _smem_problem(tile_elems: int, stages: int, elem_bytes: int) -> str | None:
    """Why ``stages`` pipeline stages of ``tile_elems`` operand elements do not fit in shared
    memory, or ``None``."""
    if tile_elems * stages * elem_bytes > _SMEM_BYTES:
        return f"{tile_elems} elements x {stages} stages exceed shared memory"
    return None


def mm_fits(dims, params, config: Config) -> str | None:
    kw = config.kw
    return _smem_problem(kw["BM"] * kw["BK"] + kw["BK"] * kw["BN"], config.num_stages, params["elem_bytes"])


# The TMA path's constants, at the values of a config that leaves them unset (the pointer
# configs: MM_CONFIGS, shared with moe_ffn, and WGRAD_CONFIGS).
_TMA_UNSET = {"TMA": False, "PROGRAMS": 0, "SPLIT_STORE": False}


def _tma_kw(config: Config, keys: tuple[str, ...] = tuple(_TMA_UNSET)) -> dict:
    """``config``'s TMA-path constants named in ``keys``, unset ones at :data:`_TMA_UNSET`'s values."""
    return {k: config.kw.get(k, _TMA_UNSET[k]) for k in keys}


def _tma_problem(config: Config, eb: int, rows: dict, stage_elems: int, out_elems: int,
                 out_eb: int | None = None) -> str | None:
    """What keeps a config off the TMA path, or ``None``: ``PROGRAMS`` or ``SPLIT_STORE``
    set without ``TMA``; or, for a ``TMA=True`` config, no program count, a row or block whose byte
    length is no 16-byte multiple (a tensor descriptor's rule; ``rows`` names each), or
    its pipeline stages (``stage_elems`` operand elements of ``eb`` bytes each) plus the
    output tile it stores from (``out_elems`` of ``out_eb`` bytes, the operands' width by
    default) past shared memory."""
    tma = _tma_kw(config)
    if not tma["TMA"]:
        given = [k for k in ("PROGRAMS", "SPLIT_STORE") if tma[k]]
        return f"{' and '.join(given)} {'is' if len(given) == 1 else 'are'} set only by TMA configs" if given else None
    if tma["PROGRAMS"] < 1:
        return "a TMA config needs PROGRAMS >= 1 (its persistent program count)"
    out_eb = eb if out_eb is None else out_eb
    for name, n in rows.items():
        if n * min(eb, out_eb) % 16:
            return (f"tensor descriptors need rows and blocks of 16-byte multiples; {name}={n} elements of "
                    f"{min(eb, out_eb)} bytes")
    # sm_90 builds storing 4-byte tiles were measured taking up to one more output tile
    # beside the one stored from.
    need = config.num_stages * stage_elems * eb + (2 if out_eb == 4 else 1) * out_elems * out_eb
    if need > _HOPPER_SMEM_BYTES:
        return f"{need} bytes of pipeline stages and output tile exceed shared memory"
    return None


def tma_fits(dims, params, config: Config) -> str | None:
    """:func:`_tma_problem` of a forward or input-gradient config: ``lhs``, ``rhs`` and
    ``out``'s rows, stages of ``[BM, BK]`` and ``[BK, BN]`` tiles, a ``[BM, BN]`` output tile
    of ``out_dtype``."""
    kw = config.kw
    return _tma_problem(config, params["elem_bytes"], {"C": dims["C"], "D": dims["D"], "BK": kw["BK"], "BN": kw["BN"]},
                        kw["BM"] * kw["BK"] + kw["BK"] * kw["BN"],
                        kw["BM"] * kw["BN"] // (2 if _tma_kw(config)["SPLIT_STORE"] else 1),
                        np.dtype(params["out_dtype"]).itemsize)


def wgrad_fits(dims, params, config: Config) -> str | None:
    """A weight-gradient config's :func:`_tma_problem` (row slices of ``lhs`` and ``dout``,
    a ``[BK, BN]`` output block); for a pointer config, whether its pipeline fits in
    shared memory."""
    kw = config.kw
    problem = _tma_problem(config, params["elem_bytes"], {"K": dims["K"], "N": dims["N"], "BK": kw["BK"], "BN": kw["BN"]},
                           kw["BR"] * (kw["BK"] + kw["BN"]), kw["BK"] * kw["BN"])
    if problem or _tma_kw(config)["TMA"]:
        return problem
    return _smem_problem(kw["BR"] * (kw["BK"] + kw["BN"]), config.num_stages, params["elem_bytes"])


def _stages(tile_elems: int, most: int, params) -> int:
    """Pipeline stages for a tile of ``tile_elems`` per stage: ``most``, or fewer where that
    many would not fit in shared memory (fp32 operands take twice the bytes of 16-bit ones)."""
    return max([s for s in range(1, most + 1) if not _smem_problem(tile_elems, s, params["elem_bytes"])]
               or [1])


def short_groups(dims) -> bool:
    """Whether the groups average at most 512 rows (top-8 routing over 128 or 256 experts at
    a few thousand tokens): each group's tiles are then few, and its last, partial row tile or
    its output block's store a large share of the work."""
    return dims["M"] <= 512 * max(dims["G"], 1)


def mm_default(dims, params) -> Config:
    # 128x256 tiles with 8 warps keep Hopper's tensor cores fed when N allows; small
    # problems take 64-row tiles so that short groups waste less.
    wide = dims["D"] >= 256
    bm, bn, bk = 64 if dims["M"] <= 2048 else 128, 256 if wide else 128, 64
    return Config.make(num_warps=8, num_stages=_stages(bm * bk + bk * bn, 3 if wide else 4, params),
                       BM=bm, BN=bn, BK=bk, GROUP_M=8)


def wgrad_default(dims, params) -> Config:
    # Each block reduces one group's rows. With a few hundred rows a group (top-8 routing
    # over 128 or 256 experts) a block is a short reduction followed by a long store, and
    # 128x128 blocks of 32-row slices on 4 warps let three programs share an SM, one
    # storing while the others compute: on an H100 6-11% faster than 128x256 blocks on 8
    # warps at DeepSeek-V3's and Qwen3-235B's projections (256 and 512 rows a group), and
    # 8-17% slower from 1024 rows a group up, where the wider block's reuse wins.
    if short_groups(dims):
        bk, bn, br, warps, most = 128, 128, 32, 4, 4
    else:
        bk, bn, br, warps, most = 128, 128 if dims["N"] < 256 else 256, 64, 8, 3
    return Config.make(num_warps=warps, num_stages=_stages(br * (bk + bn), most, params), BK=bk, BN=bn, BR=br)


def precision(params) -> str:
    # fp32 operands get three TF32 products (about fp32 accuracy on tensor cores): plain
    # TF32 would round the inputs to 10 mantissa bits, a silent loss a fp32 caller does not
    # expect. 16-bit operands are exact in any mode.
    return "tf32x3" if params["elem_bytes"] == 4 else "tf32"


def groups_p2(dims) -> int:
    return next_pow2(dims["G"])


def mm_grid(dims, params, config: Config) -> tuple[int]:
    """Programs of a row-tile GEMM ``[M, C] x [G, C, D]``: enough row tiles for every group's
    rows (each group starts a new tile: ``cdiv(M, BM) + G``) and the rows past them, times
    the column tiles (``group_tile`` in the kernel maps each program to its tile)."""
    return ((triton.cdiv(dims["M"], config.kw["BM"]) + dims["G"] + 1) * triton.cdiv(dims["D"], config.kw["BN"]),)


def gemm_grid(dims, params, config: Config) -> tuple[int]:
    """Programs of the grouped GEMM: ``mm_grid``'s one per tile, or a TMA config's
    ``PROGRAMS`` (the kernel strides over the tiles by that count)."""
    tma = _tma_kw(config)
    return (tma["PROGRAMS"],) if tma["TMA"] else mm_grid(dims, params, config)


def wgrad_grid(dims, params, config: Config) -> tuple[int]:
    """Programs of a weight gradient ``[G, K, N]``: one per [BK, BN] block of each group, or
    a TMA config's ``PROGRAMS`` (the kernel strides over the blocks by that count)."""
    if (tma := _tma_kw(config))["TMA"]:
        return (tma["PROGRAMS"],)
    return (dims["G"] * triton.cdiv(dims["K"], config.kw["BK"]) * triton.cdiv(dims["N"], config.kw["BN"]),)


# The tuning spaces: row-tile GEMMs (forward, input gradient) and weight gradients. The
# fused MoE GEMMs (ops/moe_ffn) tile the same way and share them.
MM_CONFIGS = tuple(Config.make(num_warps=w, num_stages=s, BM=bm, BN=bn, BK=bk, GROUP_M=8)
                   for bm in (64, 128) for bn in (128, 256) for bk in (64, 128)
                   for w in (4, 8) for s in (3, 4))
# Hopper's row-tile default where the pointer default takes 128x256 tiles: the same tiles,
# warps and stages in 132 persistent programs (one per SM of an H100 SXM or an H200) that
# move them by TMA. On an H100, at eight expert-GEMM shapes from Mixtral to DeepSeek-V3
# (G = 8 to 256, routing-like group sizes), 0.82-1.01x the pointer default's forward time and
# 0.90-1.03x its input gradient's.
HOPPER_TMA_MM = Config.make(num_warps=8, num_stages=3, BM=128, BN=256, BK=64, GROUP_M=8, TMA=True, PROGRAMS=132)

# The same tiles stored in two 128 x 128 halves, which frees the shared memory of a fourth
# pipeline stage: the input gradient's Hopper default, and the forward's at a few hundred
# rows a group (``short_groups``). On an H100 (kernel time, both configs in turns), for the
# input gradient 1-6% faster than HOPPER_TMA_MM at six of seven expert-GEMM shapes (Mixtral to
# DeepSeek-V3, G = 8 to 256), 3% slower at 32 groups of 2048 rows with a 2048 reduction; for
# the forward 0.93-0.99x HOPPER_TMA_MM's time at DeepSeek-V3's, gpt-oss-120b's and
# Qwen3-30B-A3B's expert GEMMs (256-512 rows a group) and 1.00-1.01x at Qwen3-235B's (512),
# and 1.00-1.01x from 1024 rows a group up, where the forward keeps whole tiles.
HOPPER_TMA_SPLIT = Config.make(num_warps=8, num_stages=4, **{**HOPPER_TMA_MM.kw, "SPLIT_STORE": True})

# The grouped GEMM's TMA configs, beside MM_CONFIGS in its tuning space. 132 programs:
# one per SM of an H100 SXM or an H200.
TMA_CONFIGS = tuple(Config.make(num_warps=w, num_stages=s, BM=bm, BN=bn, BK=64, GROUP_M=8, TMA=True, PROGRAMS=132)
                    for bm in (64, 128) for bn in (128, 256) for w in (4, 8) for s in (3, 4)) + (HOPPER_TMA_SPLIT,)

WGRAD_CONFIGS = tuple(Config.make(num_warps=w, num_stages=s, BK=bk, BN=bn, BR=br)
                      for bk in (64, 128) for bn in (128, 256) for br in (32, 64)
                      for w in (4, 8) for s in (3, 4))
# The weight gradient's TMA configs, beside WGRAD_CONFIGS in its tuning space (132 programs,
# as TMA_CONFIGS).
WGRAD_TMA_CONFIGS = tuple(Config.make(num_warps=w, num_stages=s, BK=bk, BN=bn, BR=br, TMA=True, PROGRAMS=132)
                          for bk in (64, 128) for bn in (128, 256) for br in (32, 64)
                          for w in (4, 8) for s in (3, 4))


# What every GEMM declaration shares (the fused MoE GEMM's too): one static param (the
# operand width sets the tile budget and the precision), rows bucketed to powers of two in
# tuning keys, and a tolerance instead of bit-exactness (float32 accumulation order differs
# between tilings).
GEMM_SHARED = dict(
    params=("elem_bytes",),
    scalars=lambda dims, params: {"M": dims["M"]},
    key_params=("elem_bytes",),
    key_bucket=pow2_bucket("M"),
    exact=False, rtol=2e-2, atol=2e-2,
)


def _out_dtype_check(dims, params) -> None:
    if params["out_dtype"] not in FLOATS:
        raise ValueError(f"out_dtype={params['out_dtype']!r}; expected one of {FLOATS}")


def _mm_decl(name: str, trans_rhs: bool) -> KernelDecl:
    # Without trans_rhs: lhs [M,C] x rhs [G,C,D]; with it: lhs [M,C] x rhs [G,D,C] (used transposed).
    # The float32 accumulator is stored in ``out_dtype`` (a name of FLOATS): a float32 result
    # of 16-bit operands is never rounded through the operands' dtype.
    rhs_dims = ("G", "D", "C") if trans_rhs else ("G", "C", "D")
    reference = grouped_gemm_rhs_t_reference if trans_rhs else grouped_gemm_reference
    return KernelDecl(
        name=name,
        kernel=grouped_gemm_kernel,
        operands=(Operand("lhs", ("M", "C"), FLOATS), Operand("rhs", rhs_dims, FLOATS),
                  Operand("group_sizes", ("G",), ("int32",))),
        outputs=(Output("out", lambda dims, params: (dims["M"], dims["D"]),
                        lambda dtypes, params: np.dtype(params["out_dtype"])),),
        reference=lambda lhs, rhs, group_sizes, elem_bytes, out_dtype: (
            reference(lhs, rhs, group_sizes, out_dtype=out_dtype),),
        grid=gemm_grid,
        constexprs=lambda dims, params, config: {"C": dims["C"], "D": dims["D"], "G": dims["G"],
                                                  "G_P2": groups_p2(dims), "TRANS_RHS": trans_rhs,
                                                  "PRECISION": precision(params), **_tma_kw(config)},
        configs=MM_CONFIGS + TMA_CONFIGS,
        constraints=(mm_fits, tma_fits),
        key_dims=("M", "C", "D", "G"),
        default_config=mm_default,
        **{**GEMM_SHARED, "params": ("elem_bytes", "out_dtype"), "key_params": ("elem_bytes", "out_dtype"),
           "params_check": _out_dtype_check},
    )


grouped_gemm = declare(_mm_decl("grouped_gemm", trans_rhs=False))
grouped_gemm_rhs_t = declare(_mm_decl("grouped_gemm_rhs_t", trans_rhs=True))

def _hopper_tiles(dims, params, split: bool) -> Config:
    """:data:`HOPPER_TMA_SPLIT` (with ``split``, where it fits) or :data:`HOPPER_TMA_MM`
    where :func:`mm_default` takes 128x256 tiles and ``tma_fits`` admits them (16-byte rows;
    16-bit operands: fp32 stages and tiles exceed shared memory), else :func:`mm_default`."""
    cfg = mm_default(dims, params)
    if any(cfg.kw[k] != HOPPER_TMA_MM.kw[k] for k in ("BM", "BN", "BK")) or tma_fits(dims, params, HOPPER_TMA_MM):
        return cfg
    return HOPPER_TMA_SPLIT if split and tma_fits(dims, params, HOPPER_TMA_SPLIT) is None else HOPPER_TMA_MM


def hopper_mm_default(dims, params) -> Config:
    """The forward's default on Hopper: :func:`_hopper_tiles`, stored in halves at a few
    hundred rows a group (``short_groups``)."""
    return _hopper_tiles(dims, params, split=short_groups(dims))


def hopper_dgrad_default(dims, params) -> Config:
    """The input gradient's default on Hopper: :func:`_hopper_tiles`, stored in halves."""
    return _hopper_tiles(dims, params, split=True)


grouped_gemm_hopper = declare(dataclasses.replace(grouped_gemm.decl, name="grouped_gemm_hopper",
                                                  default_config=hopper_mm_default))
grouped_gemm_rhs_t_hopper = declare(dataclasses.replace(grouped_gemm_rhs_t.decl, name="grouped_gemm_rhs_t_hopper",
                                                        default_config=hopper_dgrad_default))


def on_hopper(backend: str) -> bool:
    """Whether ``backend`` runs on a compute capability 9.0 GPU (imported lazily: the
    CUDA pieces are absent on CPU-only installs)."""
    if backend != "triton":
        return False
    from te_jax_perm.core.triton_backend import compute_capability
    return compute_capability() == 90


def mm_for(backend: str, trans_rhs: bool):
    """The forward (or, with ``trans_rhs``, the input-gradient) kernel for ``backend``: on a
    compute capability 9.0 GPU the Hopper declaration (whose default config decides by the
    dims), elsewhere :data:`grouped_gemm` (or :data:`grouped_gemm_rhs_t`)."""
    if on_hopper(backend):
        return grouped_gemm_rhs_t_hopper if trans_rhs else grouped_gemm_hopper
    return grouped_gemm_rhs_t if trans_rhs else grouped_gemm


grouped_gemm_wgrad = declare(KernelDecl(
    name="grouped_gemm_wgrad",
    kernel=grouped_gemm_wgrad_kernel,
    operands=(Operand("lhs", ("M", "K"), FLOATS), Operand("dout", ("M", "N"), FLOATS),
              Operand("group_sizes", ("G",), ("int32",))),
    outputs=(Output("out", lambda dims, params: (dims["G"], dims["K"], dims["N"]),
                    lambda dtypes, params: dtypes["lhs"]),),
    reference=lambda lhs, dout, group_sizes, elem_bytes: (grouped_gemm_wgrad_reference(lhs, dout, group_sizes),),
    grid=wgrad_grid,
    constexprs=lambda dims, params, config: {"K": dims["K"], "N": dims["N"], "G": dims["G"],
                                              "G_P2": groups_p2(dims), "PRECISION": precision(params),
                                              **_tma_kw(config, ("TMA", "PROGRAMS"))},
    configs=WGRAD_CONFIGS + WGRAD_TMA_CONFIGS,
    constraints=(wgrad_fits,),
    key_dims=("M", "K", "N", "G"),
    default_config=wgrad_default,
    **GEMM_SHARED,
))


# -- Hopper: the warp-specialised weight gradient (kernels/grouped_gemm_ws.py) ---------------------
# The MMA warpgroups hold a [BK, BN] fp32 accumulator of 128 x 256 (128 registers a thread
# on 8 warps): blocks of 128 x 256 or 256 x 128. 132 programs: one per SM of an H100 SXM or
# an H200.
WS_WGRAD_CONFIGS = tuple(Config.make(num_warps=8, num_stages=1, BK=bk, BN=bn, BR=br, STAGES=s, PROGRAMS=132)
                         for bk, bn in ((128, 256), (256, 128)) for br, s in ((64, 3), (32, 5), (32, 6)))
_INT32 = 2**31


def _ws_problem(config: Config, eb: int, rows: dict, tiles_bytes: int) -> str | None:
    """What the warp-specialised weight gradient needs, or ``None``: 16-bit operands, a program
    count and a ring of at least two stages, rows of 16-byte multiples (``rows`` names each
    row length, in elements) for the tensor descriptors, and ``tiles_bytes`` of stages and
    output tile plus the ring's barriers within shared memory."""
    kw = config.kw
    if eb != 2:
        return f"the warp-specialised weight gradient takes 16-bit operands; these have {eb} bytes"
    if kw["PROGRAMS"] < 1 or kw["STAGES"] < 2:
        return f"needs PROGRAMS >= 1 and STAGES >= 2, not {config}"
    for name, n in rows.items():
        if n * eb % 16:
            return f"tensor descriptors need 16-byte rows; {name}={n} elements of {eb} bytes"
    need = tiles_bytes + 2 * 8 * kw["STAGES"]
    if need > _HOPPER_SMEM_BYTES:
        return f"{need} bytes of stages, output tile and epilogue exceed shared memory"
    return None


def ws_wgrad_fits(dims, params, config: Config) -> str | None:
    """What keeps ``config`` from the warp-specialised weight gradient at these dims, or
    ``None``: :func:`_ws_problem`; 8 warps holding a 128 x 256 accumulator; ``K`` a multiple
    of ``BK`` (a block never crosses into the next group's matrix); 32-bit extents."""
    kw, eb = config.kw, params["elem_bytes"]
    m, k, n, g = dims["M"], dims["K"], dims["N"], dims["G"]
    stages = kw["STAGES"] * kw["BR"] * (kw["BK"] + kw["BN"])
    if problem := _ws_problem(config, eb, {"K": k, "N": n}, (stages + kw["BK"] * kw["BN"]) * eb):
        return problem
    if config.num_warps != 8 or kw["BK"] * kw["BN"] != 128 * 256 or kw["BK"] % 128 or kw["BN"] > 256:
        return f"8 warps with a 128x256 or 256x128 block, not {config}"
    if k % kw["BK"]:
        return f"K={k} is no multiple of BK={kw['BK']}"
    if min(m, g) < 1 or m >= _INT32 or g * k >= _INT32 or n >= _INT32:
        return f"needs 1 <= M, G and M, G*K, N < 2**31; M={m}, G={g}, K={k}, N={n}"
    return None


def ws_wgrad_default(dims, params) -> Config:
    # A few hundred rows a group (top-8 routing over 128 or 256 experts): 32-row slices in
    # 6 stages keep more loads in flight through a short reduction; on an H100 8-10% faster
    # than 64-row slices in 3 stages at DeepSeek-V3's and Qwen3-235B's down-projections.
    # From 1024 rows a group up (Mixtral's), 64-row slices were as fast or faster.
    br, stages = (32, 6) if short_groups(dims) else (64, 3)
    return Config.make(num_warps=8, num_stages=1, BK=128, BN=256, BR=br, STAGES=stages, PROGRAMS=132)


grouped_gemm_wgrad_ws = declare(dataclasses.replace(
    grouped_gemm_wgrad.decl,
    name="grouped_gemm_wgrad_ws",
    kernel=grouped_gemm_wgrad_ws_kernel,
    grid=lambda dims, params, config: (config.kw["PROGRAMS"],),
    constexprs=lambda dims, params, config: {"K": dims["K"], "N": dims["N"], "G": dims["G"],
                                              "G_P2": groups_p2(dims), "WARPS": config.num_warps},
    configs=WS_WGRAD_CONFIGS,
    constraints=(ws_wgrad_fits,),
    default_config=ws_wgrad_default,
    interpretable=False,
))


def wgrad_for(backend: str, dims, params):
    """The weight-gradient kernel for ``backend`` at these dims: the warp-specialised one
    on a Hopper GPU (compute capability 9.0) where its default config fits, else
    :data:`grouped_gemm_wgrad`."""
    if not ws_wgrad_fits(dims, params, ws_wgrad_default(dims, params)) and on_hopper(backend):
        return grouped_gemm_wgrad_ws
    return grouped_gemm_wgrad
