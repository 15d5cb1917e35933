"""Grouped GEMM on the GPU: our Triton kernel vs tokamax vs lax.ragged_dot vs the dense limit.

For each grouped-GEMM shape of ``benchmarks/gemm_problems.py`` (MoE expert GEMMs: rows M =
tokens x top-k grouped by expert, K -> N per expert; the layer benchmark's GEMM table takes
its shapes from there too), times in one process: a dense bf16 matmul of the same FLOPs (the
limit), our grouped GEMM forward (default config and a few alternatives), its backward
(input and weight gradients), tokamax's ragged_dot where importable, and lax.ragged_dot
where it fits.
With --tma (the default), also the forward and the input gradient on their default config
and on each persistent TMA config (``decl.TMA_CONFIGS``, Hopper's tensor-memory path) side
by side, each TMA result checked against the default's. Writes grouped_gemm.json into --out.

Usage:

    python3 -m benchmarks.grouped_gemm_bench --out=OUT [--shapes=NAME,...] [--budget_s=300]
        [--nosweep] [--notma] [--tma_all] [--programs=132,...]

--shapes     only the shapes whose names contain one of these (default all)
--budget_s   stop starting new shapes after this many seconds
--nosweep    skip the alternative pointer-path tile configs of the forward (sweep_fwd_ms)
--notma      skip the TMA comparison
--tma_all    time every TMA config of the tuning space the shape admits, not the short list
--programs   persistent program counts to time each TMA config at (default: the config's
             own, 132: one per SM of an H100 SXM or an H200)
--wgrad      also time the weight gradient on every config of its tuning space (pointer and
             TMA), each checked against its default's output, and on a Hopper GPU the
             warp-specialised kernel's configs against its default (``wgrad_comparison``)
--nobatched  skip the comparison with cuBLAS's batched GEMM (``batched_comparison``)
--layouts    also time the forward on its default config at three layouts of the same rows
             (``layout_comparison``): routing-like group sizes, equal groups of whole row
             tiles, and one group holding every row; kernel time from the profiler, each
             layout and the dense dot in turns

Per shape, the batched comparison holds each of the three GEMMs of a training step (forward,
input gradient, weight gradient) to XLA's batched dot (cuBLAS) at uniform group sizes
(``M / G`` rows each): the same FLOPs and the same bytes as the grouped GEMM, so it is the
speed a grouped GEMM could reach with cuBLAS's kernels were the sizes fixed on the host.
``ours_uniform_{fwd,dgrad,wgrad}_ms`` (our default configs at those sizes), ``batched_*_ms``
and ``{fwd,dgrad,wgrad}_over_batched`` (above 1: cuBLAS faster).

Per shape, the layout comparison (``layouts``) gives, per layout, the forward's kernel time
per call over the dense dot's (``dense_over``, below 1: the dense dot faster), the row tiles
its groups take (each group starts a tile, so a group whose size is no multiple of the tile
height ends in a partial tile), the row tiles times the column tiles, and those over the
persistent programs (``waves``): where the routing-like layout is slower than the aligned
one, the difference is the groups' partial tiles, which cost a whole tile of MMA work.

Per shape, the TMA comparison writes ``fwd_default_ms`` / ``dgrad_default_ms`` (the default
config, named in ``default_config``), ``tma_fwd_ms`` / ``tma_dgrad_ms`` ({config: ms, or the
error it raised}), ``tma_max_abs_diff`` ({config: largest difference from the default's
output}) and ``best_tma_fwd_over_default`` / ``best_tma_dgrad_over_default`` (below 1: a
TMA config is faster); where this GPU's default is not the portable one (on Hopper, TMA tiles),
``fwd_default_over_pointer_default`` / ``dgrad_default_over_pointer_default`` (below 1: this
GPU's default is faster).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Sequence

from absl import flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import gemm_problems
from benchmarks.gemm_problems import GemmShape
from benchmarks.results_io import write_json
from benchmarks.shapes import by_name
from benchmarks.timing import median_wall_ms
from te_jax_perm import cli
from te_jax_perm.core import Config
from te_jax_perm.ops.grouped_gemm import decl as D
from te_jax_perm.ops.grouped_gemm.api import grouped_matmul
from te_jax_perm.ops.grouped_gemm.reference import grouped_gemm_reference

_OUT = flags.DEFINE_string("out", "/tmp/grouped_gemm_bench", "Directory for grouped_gemm.json.")
_BUDGET = flags.DEFINE_float("budget_s", 300.0, "Stop starting new shapes after this many seconds.")
_SWEEP = flags.DEFINE_bool("sweep", True, "Also time alternative tile configs of the forward kernel.")
_SHAPES = flags.DEFINE_list("shapes", [], "Only the shapes whose names contain one of these; default all.")
_TMA = flags.DEFINE_bool("tma", True, "Time the forward and input gradient on their TMA configs beside the default.")
_TMA_ALL = flags.DEFINE_bool("tma_all", False, "Every TMA config of the tuning space, not the short list.")
_PROGRAMS = flags.DEFINE_list("programs", [], "Persistent program counts for the TMA configs (default: theirs).")
_WGRAD = flags.DEFINE_bool("wgrad", False, "Time the weight gradient on every config of its tuning space.")
_BATCHED = flags.DEFINE_bool("batched", True, "Hold each GEMM to cuBLAS's batched GEMM at uniform group sizes.")
_LAYOUTS = flags.DEFINE_bool("layouts", False, "Time the forward's default at routing-like, tile-aligned and "
                              "one-group group sizes beside the dense dot (kernel time).")

# The TMA configs timed by default: (BM, BN, warps, stages) of decl.TMA_CONFIGS.
TMA_SHORT = {(128, 256, 8, 3), (128, 128, 8, 4), (128, 128, 4, 4), (64, 256, 8, 3)}
SWEEP = [Config.make(num_warps=w, num_stages=s, BM=bm, BN=bn, BK=bk, GROUP_M=8)
         for (bm, bn, bk, w, s) in [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                                    (64, 256, 64, 8, 4), (128, 256, 64, 8, 4), (128, 128, 128, 8, 3)]]
# The forward's result is checked against the reference on this many rows, all in group 0.
CHECK_ROWS = 4096


def tma_configs(every: bool = False, programs: list[int] | tuple[int, ...] = ()) -> list[Config]:
    """The TMA configs to time: the short list (every one of ``decl.TMA_CONFIGS`` with
    ``every``), each at every count of ``programs`` (default: its own PROGRAMS)."""
    picked = [c for c in D.TMA_CONFIGS
              if every or (c.kw["BM"], c.kw["BN"], c.num_warps, c.num_stages) in TMA_SHORT]
    if not programs:
        return picked
    return [Config.make(c.num_warps, c.num_stages, **{**c.kw, "PROGRAMS": p}) for c in picked for p in programs]


# One fused reduction: a float32 copy of DeepSeek-V3's [256, 7168, 4096] weight gradient
# would not fit beside the two results.
_max_abs_diff = jax.jit(lambda a, b: jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))

# The static params of bf16 GEMMs with bf16 results (the declarations read those they declare).
BF16 = {"elem_bytes": 2, "out_dtype": "bfloat16"}

# The three GEMMs of a training step over ``lhs`` [M, K], ``rhs`` [G, K, N] and ``dout``
# [M, N]: (name, the declaration the library runs on a backend at these dims, its two
# operands, its dims, the batched dot of the same problem on operands whose rows are split
# into [G, M/G, .]).
_STEP_GEMMS = (
    ("fwd", lambda backend, dims: D.mm_for(backend, False), lambda lhs, rhs, dout: (lhs, rhs),
     lambda m, k, n, g: {"M": m, "C": k, "D": n, "G": g}, "gmk,gkn->gmn"),
    ("dgrad", lambda backend, dims: D.mm_for(backend, True), lambda lhs, rhs, dout: (dout, rhs),
     lambda m, k, n, g: {"M": m, "C": n, "D": k, "G": g}, "gmn,gkn->gmk"),
    ("wgrad", lambda backend, dims: D.wgrad_for(backend, dims, BF16), lambda lhs, rhs, dout: (lhs, dout),
     lambda m, k, n, g: {"M": m, "K": k, "N": n, "G": g}, "gmk,gmn->gkn"),
)


def _step_gemms(lhs: jax.Array, rhs: jax.Array, dout: jax.Array, backend: str,
                names: Sequence[str] | None = None) -> list[tuple]:
    """``(name, declaration, operands, dims, batched spec)`` of each GEMM of ``_STEP_GEMMS``
    (those in ``names`` where given) on ``backend``."""
    (m, k), (g, _, n) = lhs.shape, rhs.shape
    return [(what, pick(backend, dims_of(m, k, n, g)), operands_of(lhs, rhs, dout), dims_of(m, k, n, g), spec)
            for what, pick, operands_of, dims_of, spec in _STEP_GEMMS if names is None or what in names]


def _jitted(prim: Any, cfg: Config, backend: str):
    """``prim`` on bf16 operands at ``cfg``, jitted, returning its one output."""
    params = {k: BF16[k] for k in prim.decl.params}  # the weight gradient has no out_dtype
    return jax.jit(lambda *a: prim(*a, backend=backend, config=cfg, **params)[0])


def against_default(prim: Any, args: tuple, dims: dict[str, int], configs: Sequence[Config], backend: str,
                    reps: int, baseline: Any = None) -> tuple[Config, float, dict, dict]:
    """``prim`` (bf16 operands ``args``) on each of ``configs`` it admits at ``dims``,
    against the default config of ``baseline`` (another kernel of the same product;
    default ``prim``): ``(default, default_ms, times, diffs)``, ``times`` {config: ms, or
    the error it raised}, ``diffs`` {config: largest difference from the default's output}."""
    baseline = prim if baseline is None else baseline
    default = baseline.decl.default_config(dims, BF16)
    ours = _jitted(baseline, default, backend)
    default_ms = median_wall_ms(ours, args, reps)
    want = ours(*args)
    times, diffs = {}, {}
    for cfg in configs:
        if prim.decl.violated(dims, BF16, cfg):
            continue
        try:
            f = _jitted(prim, cfg, backend)
            diffs[str(cfg)] = float(_max_abs_diff(f(*args), want))
            times[str(cfg)] = median_wall_ms(f, args, reps)
        except Exception as e:  # a config that fails to compile or launch is a finding, not a crash
            times[str(cfg)] = repr(e)[:300]
    return default, default_ms, times, diffs


def _best_over(times: dict, default_ms: float) -> float | None:
    """The fastest config's time over the default's (``None`` when none ran)."""
    ok = [t for t in times.values() if isinstance(t, float)]
    return min(ok) / default_ms if ok else None


def tma_comparison(lhs: jax.Array, rhs: jax.Array, dout: jax.Array, sizes: jax.Array, configs: Sequence[Config],
                   backend: str = "triton", reps: int = 5) -> dict:
    """The forward and the input gradient, each on its default config and on each of
    ``configs`` the shape admits (:func:`against_default`)."""
    r: dict[str, Any] = {"default_config": {}, "tma_max_abs_diff": {}}
    portable = {"fwd": D.grouped_gemm, "dgrad": D.grouped_gemm_rhs_t}
    for what, prim, operands, dims, _ in _step_gemms(lhs, rhs, dout, backend, ("fwd", "dgrad")):
        default, r[f"{what}_default_ms"], r[f"tma_{what}_ms"], diffs = against_default(
            portable[what], (*operands, sizes), dims, configs, backend, reps, baseline=prim)
        r["default_config"][what] = f"{prim.decl.name} {default}"
        pointer = D.mm_default(dims, BF16)
        if (prim, default) != (portable[what], pointer):
            # This GPU's default (on Hopper: TMA tiles) against the portable one.
            ms = median_wall_ms(_jitted(portable[what], pointer, backend), (*operands, sizes), reps)
            r[f"{what}_default_over_pointer_default"] = r[f"{what}_default_ms"] / ms
        r["tma_max_abs_diff"].update({f"{what} {c}": d for c, d in diffs.items()})
        if (best := _best_over(r[f"tma_{what}_ms"], r[f"{what}_default_ms"])) is not None:
            r[f"best_tma_{what}_over_default"] = best
    return r


def wgrad_comparison(lhs: jax.Array, dout: jax.Array, sizes: jax.Array, configs: Sequence[Config],
                     backend: str = "triton", reps: int = 3) -> dict:
    """The weight gradient on its default config and on each of ``configs`` the shape
    admits (pointer and TMA; :func:`against_default`): ``wgrad_default_ms``, ``wgrad_ms``,
    ``wgrad_max_abs_diff`` and ``best_wgrad_over_default``; where the library runs another
    kernel on this GPU (the warp-specialised one on Hopper), that kernel's the same way
    (``wgrad_ws_*``) and its default's time over the pointer default's."""
    dims = {"M": lhs.shape[0], "K": lhs.shape[1], "N": dout.shape[1], "G": sizes.shape[0]}
    default, default_ms, times, diffs = against_default(D.grouped_gemm_wgrad, (lhs, dout, sizes), dims, configs,
                                                        backend, reps)
    r: dict[str, Any] = {"wgrad_default_config": str(default), "wgrad_default_ms": default_ms, "wgrad_ms": times,
                         "wgrad_max_abs_diff": diffs}
    if (best := _best_over(times, default_ms)) is not None:
        r["best_wgrad_over_default"] = best
    picked = D.wgrad_for(backend, dims, BF16)
    if picked is not D.grouped_gemm_wgrad:  # the kernel this GPU runs by default, on its own configs
        ws_default, r["wgrad_ws_default_ms"], r["wgrad_ws_ms"], r["wgrad_ws_max_abs_diff"] = against_default(
            picked, (lhs, dout, sizes), dims, picked.decl.configs, backend, reps)
        r["wgrad_ws_default_config"] = str(ws_default)
        r["wgrad_ws_default_over_pointer_default"] = r["wgrad_ws_default_ms"] / default_ms
    return r


def batched_comparison(lhs: jax.Array, rhs: jax.Array, dout: jax.Array, backend: str = "triton",
                       reps: int = 5) -> dict:
    """Each GEMM of a training step at uniform group sizes (``M / G`` rows each; ``{}`` when
    ``G`` does not divide ``M``), ours on its default config and XLA's batched dot (cuBLAS on
    a GPU) of the same operands reshaped to ``[G, M/G, .]``: ``ours_uniform_<gemm>_ms``,
    ``batched_<gemm>_ms``, ``<gemm>_over_batched`` and ``batched_max_abs_diff`` (ours vs
    batched, per GEMM)."""
    m, g = lhs.shape[0], rhs.shape[0]
    if m % g:
        return {}
    sizes = jnp.full((g,), m // g, jnp.int32)
    split = lambda x: x.reshape(g, m // g, x.shape[1]) if x.ndim == 2 else x   # noqa: E731 - rhs is [G, ., .]
    r: dict[str, Any] = {"batched_max_abs_diff": {}}
    for what, prim, (a, b), dims, spec in _step_gemms(lhs, rhs, dout, backend):
        ours = _jitted(prim, prim.decl.default_config(dims, BF16), backend)
        got = ours(a, b, sizes)
        # The batched result in our layout (rows joined back, or [G, K, N] as it is).
        batched = jax.jit(lambda x, y, spec=spec, shape=got.shape: jnp.einsum(spec, split(x), split(y)).reshape(shape))
        r["batched_max_abs_diff"][what] = float(_max_abs_diff(got, batched(a, b)))
        del got
        r[f"ours_uniform_{what}_ms"] = median_wall_ms(ours, (a, b, sizes), reps)
        r[f"batched_{what}_ms"] = median_wall_ms(batched, (a, b), reps)
        r[f"{what}_over_batched"] = r[f"ours_uniform_{what}_ms"] / r[f"batched_{what}_ms"]
    return r


LAYOUTS = ("routing", "aligned", "one_group")


def layout_sizes(layout: str, m: int, g: int, tile_rows: int) -> np.ndarray:
    """``g`` group sizes summing to ``m``: ``routing`` as ``gemm_problems.group_sizes`` draws
    them; ``aligned``, equal groups of whole ``tile_rows``-row tiles (the last group takes
    what is left); ``one_group``, every row in group 0."""
    if layout == "routing":
        return gemm_problems.group_sizes(m, g)
    sizes = np.zeros(g, np.int32)
    if layout == "one_group":
        sizes[0] = m
    elif layout == "aligned":
        sizes[:] = m // g // tile_rows * tile_rows
        sizes[-1] = m - sizes[:-1].sum()
    else:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    return sizes


def row_tiles(sizes: np.ndarray, m: int, tile_rows: int) -> int:
    """The row tiles of the row-tile GEMMs' schedule: each group's rows in whole tiles from
    its first row, then the rows past every group."""
    return int(sum(-(-int(s) // tile_rows) for s in sizes) + -(-(m - int(sum(sizes))) // tile_rows))


def layout_comparison(lhs: jax.Array, rhs: jax.Array, dense_rhs: jax.Array, backend: str = "triton",
                      rounds: int = 3, steps: int = 3) -> dict:
    """The forward on its default config at each of :data:`LAYOUTS` and the dense dot,
    profiled in turns (``rounds`` rounds of ``steps`` calls each, the order rotated): per
    layout ``kernel_us`` (each round's kernel time per call), ``dense_over`` (the dense dot's
    fastest round over this layout's), ``row_tiles``, ``tiles`` and ``waves`` (tiles over the
    default's persistent programs, where it has a count)."""
    from benchmarks import trace_stats
    (m, k), (g, _, n) = lhs.shape, rhs.shape
    dims = {"M": m, "C": k, "D": n, "G": g}
    prim = D.mm_for(backend, False)
    cfg = prim.decl.default_config(dims, BF16)
    bm, bn, programs = cfg.kw["BM"], cfg.kw["BN"], cfg.kw.get("PROGRAMS")
    fwd = _jitted(prim, cfg, backend)
    dense = jax.jit(gemm_problems.dense_dot)
    r: dict[str, Any] = {"config": str(cfg), "kernel": prim.decl.name}
    calls = {"dense": lambda: dense(lhs, dense_rhs)}
    for layout in LAYOUTS:
        sizes = layout_sizes(layout, m, g, bm)
        tiles = row_tiles(sizes, m, bm) * -(-n // bn)
        r[layout] = {"row_tiles": row_tiles(sizes, m, bm), "tiles": tiles,
                     "waves": tiles / programs if programs else None, "kernel_us": []}
        calls[layout] = lambda s=jnp.asarray(sizes): fwd(lhs, rhs, s)
    r["dense"] = {"kernel_us": []}
    names = list(calls)
    for name in names:
        jax.block_until_ready(calls[name]())
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:
            stats = trace_stats.profile(lambda f=calls[name]: jax.block_until_ready(f()), steps)
            r[name]["kernel_us"].append(stats.kernel_us_per_step)
    best = {name: min(r[name]["kernel_us"]) for name in names}
    for layout in LAYOUTS:
        r[layout]["dense_over"] = best["dense"] / best[layout] if best[layout] else None
    return r


def shape_row(shape: GemmShape, *, backend: str = "triton", reps: int = 10, sweep: Sequence[Config] = (),
              tma: Sequence[Config] | None = (), tokamax: Any = None,
              wgrad: Sequence[Config] = (), batched: bool = True,
              layouts: bool = False) -> dict[str, Any]:
    """One shape's times, bf16: the dense dot, our forward (checked against the reference)
    and backward on ``backend``; the forward on each of ``sweep``'s configs; the default and
    ``tma`` configs compared (:func:`tma_comparison`; skipped when ``tma`` is None); the
    ``tokamax`` module's ragged_dot where given; lax.ragged_dot where its dense copy fits."""
    m, k, n, g = shape.M, shape.K, shape.N, shape.G
    ops = gemm_problems.operands(shape, jnp.bfloat16, cotangent=True)
    lhs, rhs, sizes, dout = ops.lhs, ops.rhs, ops.group_sizes, ops.dout
    few = min(reps, 5)
    r: dict[str, Any] = {"M": m, "K": k, "N": n, "G": g}
    r["dense_ms"] = median_wall_ms(jax.jit(gemm_problems.dense_dot), (lhs, ops.dense_rhs), reps)
    fwd = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, backend=backend))
    r["ours_fwd_ms"] = median_wall_ms(fwd, (lhs, rhs, sizes), reps)
    rows = min(m, CHECK_ROWS)
    one_group = jnp.zeros_like(sizes).at[0].set(rows)
    ref = jax.jit(grouped_gemm_reference)(lhs[:rows], rhs, one_group)
    ours = fwd(lhs[:rows], rhs, one_group)
    r["check_max_abs_err"] = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - ref.astype(jnp.float32))))
    fb = jax.jit(lambda a, b, s, d: jax.vjp(lambda x, y: grouped_matmul(x, y, s, backend=backend), a, b)[1](d))
    r["ours_bwd_ms"] = median_wall_ms(fb, (lhs, rhs, sizes, dout), reps)
    if sweep:
        r["sweep_fwd_ms"] = {}
        for cfg in sweep:
            if D.grouped_gemm.decl.violated({"M": m, "C": k, "D": n, "G": g}, BF16, cfg):
                continue
            f = _jitted(D.grouped_gemm, cfg, backend)
            try:
                r["sweep_fwd_ms"][str(cfg)] = median_wall_ms(f, (lhs, rhs, sizes), few)
            except Exception as e:  # a config that fails to compile is a finding, not a crash
                r["sweep_fwd_ms"][str(cfg)] = repr(e)[:200]
    if tma is not None:
        r.update(tma_comparison(lhs, rhs, dout, sizes, tma, backend=backend, reps=few))
    if wgrad:
        r.update(wgrad_comparison(lhs, dout, sizes, wgrad, backend=backend, reps=min(reps, 3)))
    if batched:
        r.update(batched_comparison(lhs, rhs, dout, backend=backend, reps=few))
    if layouts:
        r["layouts"] = layout_comparison(lhs, rhs, ops.dense_rhs, backend=backend)
    if tokamax is not None:
        try:
            tf = jax.jit(lambda a, b, s: tokamax.ragged_dot(a, b, s))
            r["tokamax_fwd_ms"] = median_wall_ms(tf, (lhs, rhs, sizes), reps)
            tb = jax.jit(lambda a, b, s, d: jax.vjp(lambda x, y: tokamax.ragged_dot(x, y, s), a, b)[1](d))
            r["tokamax_bwd_ms"] = median_wall_ms(tb, (lhs, rhs, sizes, dout), reps)
        except Exception as e:
            r["tokamax_error"] = repr(e)[:300]
    if m * g * k * 2 < 4e9:   # XLA:GPU's ragged_dot builds a masked [M, G, K] copy of lhs
        r["lax_ragged_dot_fwd_ms"] = median_wall_ms(jax.jit(jax.lax.ragged_dot), (lhs, rhs, sizes), min(reps, 3))
    r["dense_tflops"] = shape.tflops(r["dense_ms"])
    r["ours_fwd_tflops"] = shape.tflops(r["ours_fwd_ms"])
    r["ours_fwd_over_dense"] = r["ours_fwd_ms"] / r["dense_ms"]
    r["ours_bwd_over_2dense"] = r["ours_bwd_ms"] / (2 * r["dense_ms"])
    return r


def main(argv: list[str]) -> None:
    del argv
    shapes = by_name(",".join(_SHAPES.value), gemm_problems.SHAPES)
    os.makedirs(_OUT.value, exist_ok=True)
    results = {"device": str(jax.devices()[0].device_kind), "shapes": {}}
    try:
        import tokamax
    except Exception as e:  # optional: only compared where importable
        tokamax = None
        logging.info("tokamax not importable (%s); skipping it", e)
    tma = tma_configs(_TMA_ALL.value, [int(p) for p in _PROGRAMS.value]) if _TMA.value else None
    t_start = time.time()
    for shape in shapes:
        if time.time() - t_start > _BUDGET.value:
            logging.warning("budget spent; skipping %s", shape.name)
            continue
        wgrad = D.grouped_gemm_wgrad.decl.configs if _WGRAD.value else ()
        r = shape_row(shape, sweep=SWEEP if _SWEEP.value else (), tma=tma, tokamax=tokamax, wgrad=wgrad,
                      batched=_BATCHED.value, layouts=_LAYOUTS.value)
        results["shapes"][shape.name] = r
        print(shape.name, json.dumps(r), flush=True)
        write_json(os.path.join(_OUT.value, "grouped_gemm.json"), results)


if __name__ == "__main__":
    cli.run(main)
