"""Every candidate config of the row-moving and row-id-map kernels, timed on the GPU.

    python3 -m benchmarks.config_sweep --out DIR [--part movers,rowmap] [--shapes ...] [--budget-s 400]

``movers``: at each benchmark shape, every op direction's main kernel (dispatch's
``permute_probs``, combine's ``unpermute_weighted``, and their backwards) under every
config its declaration allows plus a wider warp range, the default among them.
``rowmap``: ``make_row_id_map`` over a grid of token and expert counts, one launch or two,
every block size and warp count. Kernel times from one CUPTI profile per group
(``benchmarks/kernel_timer.py``). Writes ``DIR/sweep_<part>.json``; the default-config
rule and the shipped table are derived from these files.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Callable

import numpy as np

from benchmarks import kernel_timer
from benchmarks.shapes import GPU_SHAPES, OFF_LIST_SHAPES, by_name

# (case, kernel declaration name) pairs of the row movers.
MOVERS = (("token_combine.fwd", "unpermute_weighted"), ("token_dispatch.fwd", "permute_probs"),
          ("token_dispatch.bwd", "permute_bwd_probs"), ("token_combine.bwd", "unpermute_bwd_weighted"))
WARPS = (1, 2, 4, 8)
BLOCK_H = (512, 1024, 2048, 4096, 8192)
# Bytes in flight per thread decide a bandwidth-bound mover's speed: 8 to 128 elements
# (16 to 256 bytes of bf16) per thread per row step spans every config worth having.
PER_THREAD = (8, 128)


def _forced_jit(fn: Callable, args: tuple, name: str, config) -> Callable:
    """``fn`` compiled afresh with ``config`` for kernel ``name`` (defaults for the others).

    JAX caches lowerings per function, and the config is chosen while lowering: caches are
    cleared first, and the resolver must have been consulted for ``name``, or the group's
    timings would all be of one binary."""
    import jax
    from te_jax_perm.core import hooks
    used = []

    def resolve(call):
        if call.decl.name == name:
            used.append(call)
            return config
        return None

    jax.clear_caches()
    with hooks.using_config_resolver(resolve):
        # Compiled ahead: a later cache clear would otherwise re-lower it, with the defaults.
        f = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
        jax.block_until_ready(f(*args))
    if not used:
        raise RuntimeError(f"lowering never chose a config for {name}: the sweep would time one binary")
    return f


def _candidates(decl, dims, params) -> list:
    from te_jax_perm.core import Config
    default = decl.default_config(dims, params)
    out = [default]
    for c in decl.configs:
        for w in WARPS:
            cfg = Config.make(num_warps=w, num_stages=c.num_stages, **c.kw)
            per_thread = c.kw["ROWS"] * c.kw["BLOCK_H"] / (32 * w)
            if (c.kw["BLOCK_H"] in BLOCK_H and PER_THREAD[0] <= per_thread <= PER_THREAD[1] and cfg not in out
                    and not decl.violated(dims, params, cfg)):
                out.append(cfg)
    return out


def _precompile(launches: list) -> dict:
    """Compiles every launch's kernel in the autotuner's worker pool (filling Triton's cache)."""
    from te_jax_perm.autotune.compile_job import make_job
    from te_jax_perm.autotune.pool import get_pool
    from te_jax_perm.core.triton_backend import _lib_and_capability
    cc = _lib_and_capability()[1]
    t0 = time.monotonic()
    results = get_pool().compile_many([make_job(l, ("cuda", cc, 32)) for l in launches])
    return {"compiled": sum(r.ok for r in results), "failed": sum(not r.ok for r in results),
            "compile_s": time.monotonic() - t0}


def sweep_movers(shapes, budget_s: float, calls: int, log) -> list[dict]:
    from benchmarks import cases
    from te_jax_perm.autotune.workloads import record_launches
    from te_jax_perm.core.launch import configure
    rows, t0 = [], time.monotonic()
    # Forward movers at every shape first, so a short budget still covers them.
    order = [(shape, pair) for pairs in (MOVERS[:2], MOVERS[2:]) for shape in shapes for pair in pairs]
    p = None
    for shape, (case_name, kname) in order:
        if time.monotonic() - t0 > budget_s:
            log(f"budget spent: {shape.name} {case_name} not swept")
            continue
        if p is None or p.shape != shape:
            p = None  # free the previous shape's buffers first
            p = cases.Problem.make(shape)
        try:
            case = next(c for c in cases.CASES if c.name == case_name)
            built = case.build(p, "triton")
            call = next(c for c in record_launches(built.fn, built.args) if c.decl.name == kname)
            decl = call.decl
            default = decl.default_config(call.dims, call.params)
            cands = _candidates(decl, call.dims, call.params)
            info = _precompile([configure(call, c) for c in cands])
            items = []
            for cfg in cands:
                f = _forced_jit(built.fn, built.args, kname, cfg)
                items.append((cfg, (lambda f=f: f(*built.args))))
            kfn = decl.kernel.fn.__name__
            times = kernel_timer.measure(items, calls=calls, warmup=1)
            for t in times:
                us = t.per_call_us(lambda n: n.startswith(kfn))
                rows.append({"shape": shape.name, "T": shape.T, "H": shape.H, "E": shape.E, "k": shape.k,
                             "case": case_name, "kernel": kname, "config": t.label.to_json(),
                             "config_str": str(t.label), "is_default": t.label == default, "us": us})
            best = min((r for r in rows if r["shape"] == shape.name and r["kernel"] == kname),
                       key=lambda r: r["us"])
            dflt = next(r for r in rows if r["shape"] == shape.name and r["kernel"] == kname and r["is_default"])
            log(f"{shape.name:40s} {kname:24s} {len(cands):3d} configs ({info['compile_s']:.0f}s compile) "
                f"default {dflt['us']:8.1f} µs {dflt['config_str']} | best {best['us']:8.1f} µs "
                f"{best['config_str']} ({dflt['us'] / best['us']:.3f}x)")
        except Exception:  # one failing group must not end the sweep
            log(f"{shape.name} {case_name}: FAILED\n{traceback.format_exc()}")
    return rows


ROWMAP_T = (16, 64, 256, 1024, 4096, 16384)
ROWMAP_E = (8, 32, 128, 256)
ROWMAP_BT = (1, 2, 4, 8, 16, 32, 64, 128)
ROWMAP_WARPS = (1, 4, 8)


def sweep_rowmap(budget_s: float, calls: int, log) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from benchmarks.workloads import topk_routing
    from te_jax_perm.core import Config
    from te_jax_perm.core.launch import bind_call, configure
    from te_jax_perm.ops.row_id_map import make_row_id_map
    from te_jax_perm.ops.row_id_map_decl import (num_blocks, row_id_map_block_counts, row_id_map_fill,
                                                 row_id_map_fused)
    rows, t0 = [], time.monotonic()
    rng = np.random.default_rng(0)
    # Compile everything first: E and the block size are compiled in, T is not.
    variants = []
    for E in ROWMAP_E:
        for T in ROWMAP_T:
            for bt in ROWMAP_BT:
                nb = num_blocks(T, bt)
                if bt > T or nb > 4096:
                    continue
                for single in (True, False):
                    if not single and nb == 1:
                        continue
                    for w in ROWMAP_WARPS:
                        variants.append((T, E, bt, single, w))
    per_compile = {}
    for (T, E, bt, single, w) in variants:
        rm = jax.ShapeDtypeStruct((T, E), jnp.bool_)
        params = {"block_t": bt, "drop_at": 2**31 - 1}
        cfg = Config.make(num_warps=w)
        if single:
            ls = [configure(bind_call(row_id_map_fused.decl, [rm], params, "triton"), cfg)]
        else:
            counts = jax.ShapeDtypeStruct((num_blocks(T, bt), E), jnp.int32)
            ls = [configure(bind_call(row_id_map_block_counts.decl, [rm], {"block_t": bt}, "triton"), cfg),
                  configure(bind_call(row_id_map_fill.decl, [rm, counts], params, "triton"), cfg)]
        for l in ls:
            per_compile[(l.decl.name, E, bt, w)] = l  # T is runtime: one binary serves every T
    info = _precompile(list(per_compile.values()))
    log(f"rowmap: {len(variants)} variants, {len(per_compile)} binaries ({info})")
    for T in ROWMAP_T:
        for E in ROWMAP_E:
            if time.monotonic() - t0 > budget_s:
                log(f"budget spent: T={T} E={E} not swept")
                continue
            try:
                r = topk_routing(rng, T, E, min(8, E))
                rm = jnp.asarray(r.routing_map)
                items = []
                for (t, e, bt, single, w) in variants:
                    if (t, e) != (T, E):
                        continue
                    cfg = Config.make(num_warps=w)
                    f = _forced_jit(lambda m, bt=bt, single=single: make_row_id_map(
                        m, None, block_tokens=bt, single_pass=single, backend="triton"), (rm,),
                        "row_id_map_fused" if single else "row_id_map_fill", cfg)
                    items.append(((bt, single, w), (lambda f=f: f(rm))))
                times = kernel_timer.measure(items, calls=calls, warmup=1)
                for t in times:
                    bt, single, w = t.label
                    rows.append({"T": T, "E": E, "block_t": bt, "single_pass": single, "num_warps": w,
                                 "us": t.per_call_us(), "kernels": t.by_name()})
                mine = [x for x in rows if x["T"] == T and x["E"] == E]
                best = min(mine, key=lambda x: x["us"])
                log(f"rowmap T={T:6d} E={E:4d}: best {best['us']:7.1f} µs (block_t={best['block_t']}, "
                    f"single={best['single_pass']}, warps={best['num_warps']}) of {len(mine)}")
            except Exception:
                log(f"rowmap T={T} E={E}: FAILED\n{traceback.format_exc()}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--part", default="movers,rowmap")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args(argv)
    import jax
    os.makedirs(args.out, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    parts = args.part.split(",")
    if "movers" in parts:
        rows = sweep_movers(by_name(args.shapes, GPU_SHAPES + OFF_LIST_SHAPES), args.budget_s, args.calls, log)
        with open(os.path.join(args.out, "sweep_movers.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f)
    if "rowmap" in parts:
        rows = sweep_rowmap(args.budget_s, args.calls, log)
        with open(os.path.join(args.out, "sweep_rowmap.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
