"""Autotuner benchmark: pool vs in-process compile time, and tuned vs default-config time.

    # GPU (H100): the real MoE sizes of te_jax_perm/workloads.py in priority order, bf16, within 280 s
    python benchmarks/autotune_bench.py --out=/tmp/autotune_bench --budget-s=280
    # CPU (compile time for sm_90 + interpreter tuning at a small shape)
    python benchmarks/autotune_bench.py --small --dtype=float32 --out=/tmp/autotune_bench

Writes ``compile_time.json`` and ``tuning.json`` (plus ``e2e.json`` on GPU) under ``--out``;
``tuning.json`` and ``e2e.json`` are rewritten after every row, so a killed run still reports.
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

from benchmarks.results_io import write_json


def compile_time(launches, target, max_configs: int, workers: int) -> dict:
    """Compiles the same jobs in-process (sequentially) and in the pool; fresh caches for both."""
    from te_jax_perm.autotune import tuner
    from te_jax_perm.autotune.pool import CompilePool, compile_job, make_job
    from te_jax_perm.core import configure
    jobs, warm = [], []
    for ln in launches:
        valid, _ = tuner.candidates(ln.decl, ln.dims, ln.params)
        for c in valid:
            jobs.append(make_job(configure(ln, c), target))
        # Warm-up jobs (distinct binaries: num_warps=1) so neither side pays LLVM start-up in the figure.
        c1 = dataclasses.replace(valid[0], num_warps=1)
        warm.append(make_job(configure(ln, c1), target))
    jobs = jobs[:max_configs]
    root = tempfile.mkdtemp(prefix="autotune_bench_")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "inproc")
    compile_job(warm[0])
    t0 = time.perf_counter()
    for j in jobs:
        compile_job(j)
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

    from benchmarks.timing import wall_ms
    ts = [ms / 1e3 for ms in wall_ms(jax.jit(fn), args, reps)]
    return {"median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "reps": reps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for compile_time.json, tuning.json and e2e.json")
    ap.add_argument("--small", action="store_true", help="the small shapes (CPU: interpreter tuning)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="dtype of the tuned rows")
    ap.add_argument("--max-configs", type=int, default=48, help="configs in the compile-time comparison")
    ap.add_argument("--workers", type=int, default=0,
                    help="compile-pool processes in the compile-time comparison (0: the pool's own choice)")
    ap.add_argument("--skip-tuning", action="store_true", help="only the compile-time comparison")
    ap.add_argument("--skip-e2e", action="store_true",
                    help="no end-to-end (tuned vs default step) part on a GPU")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget for the whole run; results are written as they come")
    ap.add_argument("--e2e-s", type=float, default=60.0, help="part of --budget-s kept for the end-to-end part")
    ap.add_argument("--shapes", default=None, help="comma-separated model:T filters, e.g. deepseek-v3:8192,qwen3")
    ap.add_argument("--max-candidates", type=int, default=24, help="configs tried per kernel (default kept)")
    ap.add_argument("--reps", type=int, default=None, help="timed launches per config")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    end = None if a.budget_s is None else t_start + a.budget_s
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    import jax
    from te_jax_perm import autotune
    from te_jax_perm import workloads
    from te_jax_perm.autotune.__main__ import record_launches, shape_list, tune_shapes
    from te_jax_perm.core import hooks
    try:   # checked before anything is written or compiled
        shapes = shape_list(a.small, a.shapes)
    except ValueError as e:
        ap.error(str(e))
    os.makedirs(a.out, exist_ok=True)
    gpu = jax.default_backend() == "gpu"
    backend = "triton" if gpu else "interpret"
    dtype = np.dtype(a.dtype)   # "bfloat16" too: importing jax registers ml_dtypes' types
    autotune.set_cache_dir(os.path.join(a.out, "cache"))

    # 1. Compile time: the kernels of dispatch+combine at the first shape.
    model, H, E, k, T = shapes[0]
    args = workloads.moe_problem(T, H, E, k, dtype)
    with autotune.autotuning(False):
        launches = record_launches(workloads.moe_step(backend, k), args)
    if gpu:
        from te_jax_perm.autotune.tuner import device_target
        target = device_target()
    else:
        target = ("cuda", 90, 32)
    ct = compile_time(launches, target, a.max_configs, a.workers or None)
    ct.update(model=model, T=T)
    print(json.dumps({"compile_time": ct}), flush=True)
    write_json(os.path.join(a.out, "compile_time.json"), ct)
    if a.skip_tuning:
        return 0

    # 2. Tuned vs default per kernel (same trial harness, CUDA events on GPU), written after
    # every (kernel, shape) so a killed run still reports what it finished.
    t0 = time.perf_counter()
    rows: list[dict] = []
    tuning_path = os.path.join(a.out, "tuning.json")

    def on_row(r: dict) -> None:
        rows.append(r)
        print(json.dumps(r), flush=True)
        write_json(tuning_path, {"backend": backend, "tuning_wall_s": time.perf_counter() - t0, "rows": rows,
                                "done": False})

    budget = None
    if end is not None:
        budget = max(0.0, end - time.monotonic() - (0.0 if a.skip_e2e or not gpu else a.e2e_s))
    opts = autotune.TuneOptions(max_candidates=a.max_candidates or None, reps=a.reps)
    tune_shapes(backend, a.small, a.dtype, budget, a.shapes, opts, on_row=on_row)
    write_json(tuning_path, {"backend": backend, "tuning_wall_s": time.perf_counter() - t0, "rows": rows,
                            "done": True, "budget_s": budget})

    # 3. End to end on GPU: dispatch+combine jitted with tuned configs vs defaults, for the
    # shapes whose kernels were all tuned to completion.
    if gpu and not a.skip_e2e:
        tuned_shapes = {(r["model"], r["T"]) for r in rows}
        partial = {(r["model"], r["T"]) for r in rows if not r["complete"]}
        e2e = []
        for model, H, E, k, T in shapes:
            if (model, T) not in tuned_shapes or (model, T) in partial:
                continue
            if end is not None and time.monotonic() > end:
                print(json.dumps({"e2e": "budget spent", "next": [model, T]}), flush=True)
                break
            args = [jax.device_put(x) for x in workloads.moe_problem(T, H, E, k, dtype)]
            with autotune.autotuning(False):
                tuned = time_jitted(workloads.moe_step(backend, k), args)
            with hooks.using_config_resolver(None):
                default = time_jitted(workloads.moe_step(backend, k), args)
            row = {"model": model, "T": T, "H": H, "E": E, "k": k, "tuned": tuned, "default": default,
                   "speedup": default["median_s"] / tuned["median_s"]}
            print(json.dumps(row), flush=True)
            e2e.append(row)
            write_json(os.path.join(a.out, "e2e.json"), e2e)
    print(json.dumps({"total_wall_s": time.monotonic() - t_start}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
