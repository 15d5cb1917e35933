"""Autotuner benchmark: pool vs in-process compile time, and tuned vs default-config time.

    # GPU machine (H100): all shapes.md sizes, bf16
    python benchmarks/autotune_bench.py --out=/tmp/autotune_bench
    # CPU (compile time for sm_90 + interpreter tuning at a small shape)
    python benchmarks/autotune_bench.py --small --dtype=float32 --out=/tmp/autotune_bench

Writes ``compile_time.json`` and ``tuning.json`` (plus ``e2e.json`` on GPU) under ``--out``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _np_dtype(name: str) -> np.dtype:
    import ml_dtypes
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def compile_time(launches, target, max_configs: int, workers: int) -> dict:
    """Compiles the same jobs in-process (sequentially) and in the pool; fresh caches for both."""
    from te_jax_perm.autotune import compile_job, space
    from te_jax_perm.autotune.pool import CompilePool
    from te_jax_perm.core.shapes import output_avals
    jobs, warm = [], []
    for ln in launches:
        valid, _ = space.candidates(ln.decl, __import__("te_jax_perm.core.shapes", fromlist=["x"]).bind_dims(
            ln.decl, ln.avals), ln.params)
        outs = output_avals(ln.decl, ln.avals, ln.params)
        for c in valid:
            jobs.append(compile_job.make_job(ln.decl, ln.avals, outs, ln.params, c, target))
        # Warm-up jobs (distinct binaries: num_warps=1) so neither side pays LLVM start-up in the figure.
        c1 = dataclasses.replace(valid[0], num_warps=1)
        warm.append(compile_job.make_job(ln.decl, ln.avals, outs, ln.params, c1, target))
    jobs = jobs[:max_configs]
    root = tempfile.mkdtemp(prefix="autotune_bench_")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "inproc")
    compile_job.compile_job(warm[0])
    t0 = time.perf_counter()
    for j in jobs:
        compile_job.compile_job(j)
    inproc = time.perf_counter() - t0
    pool = CompilePool(workers=workers, cache_dir=os.path.join(root, "pool"))
    t0 = time.perf_counter()
    pool.wait_ready()
    startup = time.perf_counter() - t0
    pool.compile_many((warm * pool.size)[:pool.size])
    t0 = time.perf_counter()
    res = pool.compile_many(jobs)
    pooled = time.perf_counter() - t0
    pool.close()
    return {"target": list(target), "configs": len(jobs), "pool_workers": pool.size,
            "in_process_s": inproc, "pool_s": pooled, "pool_over_in_process": pooled / inproc,
            "pool_startup_s": startup, "pool_failed": sum(not r.ok for r in res),
            "cpu_count": os.cpu_count()}


def time_jitted(fn, args, reps: int = 30) -> dict:
    import jax
    f = jax.jit(fn)
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "reps": reps}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-configs", type=int, default=48)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--skip-tuning", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    import jax
    from te_jax_perm import autotune
    from te_jax_perm.autotune import workloads
    from te_jax_perm.autotune.__main__ import tune_shapes
    from te_jax_perm.core import config_select
    gpu = jax.default_backend() == "gpu"
    backend = "triton" if gpu else "interpret"
    dtype = _np_dtype(a.dtype)
    autotune.set_cache_dir(os.path.join(a.out, "cache"))

    # 1. Compile time: the kernels of dispatch+combine at the first shape.
    model, H, E, k, Ts = (workloads.SMALL_SHAPES if a.small else workloads.MOE_SHAPES)[0]
    args = workloads.moe_problem(Ts[0], H, E, k, dtype)
    with autotune.autotuning(False):
        launches = workloads.record_launches(workloads.moe_step(backend, k), args)
    if gpu:
        from te_jax_perm.autotune.tuner import _device_target
        target = _device_target()
    else:
        target = ("cuda", 90, 32)
    ct = compile_time(launches, target, a.max_configs, a.workers or None)
    print(json.dumps({"compile_time": ct}))
    with open(os.path.join(a.out, "compile_time.json"), "w") as f:
        json.dump(ct, f, indent=1)
    if a.skip_tuning:
        return 0

    # 2. Tuned vs default per kernel (same trial harness, CUDA events on GPU).
    t0 = time.perf_counter()
    rows = tune_shapes(backend, a.small, a.dtype)
    for r in rows:
        if r["best_time_s"] and r["default_time_s"]:
            r["speedup_vs_default"] = r["default_time_s"] / r["best_time_s"]
        print(json.dumps(r))
    with open(os.path.join(a.out, "tuning.json"), "w") as f:
        json.dump({"backend": backend, "tuning_wall_s": time.perf_counter() - t0, "rows": rows}, f, indent=1)

    # 3. End to end on GPU: dispatch+combine jitted with tuned configs vs defaults.
    if gpu:
        e2e = []
        resolver = config_select._resolver
        for model, H, E, k, Ts in (workloads.SMALL_SHAPES if a.small else workloads.MOE_SHAPES):
            for T in Ts:
                args = [jax.device_put(x) for x in workloads.moe_problem(T, H, E, k, dtype)]
                with autotune.autotuning(False):
                    tuned = time_jitted(workloads.moe_step(backend, k), args)
                config_select.set_config_resolver(None)
                try:
                    default = time_jitted(workloads.moe_step(backend, k), args)
                finally:
                    config_select.set_config_resolver(resolver)
                row = {"model": model, "T": T, "H": H, "E": E, "k": k, "tuned": tuned, "default": default,
                       "speedup": default["median_s"] / tuned["median_s"]}
                print(json.dumps(row))
                e2e.append(row)
        with open(os.path.join(a.out, "e2e.json"), "w") as f:
            json.dump(e2e, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
