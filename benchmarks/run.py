"""One benchmark sweep: every op, fwd and bwd, at every shape, kernel backend vs xla.

    python3 -m benchmarks.run --out DIR [--budget-s 300] [--shapes DeepSeek,Qwen3] [--ops dispatch]

On a GPU the kernel backend is ``triton`` at real MoE layer shapes (DeepSeek-V3, Qwen3,
gpt-oss, Mixtral); elsewhere it is ``interpret`` (Triton's interpreter) on a tiny smoke
sweep that checks the benchmark runs and judges no targets (``--mode cpu`` forces that
anywhere). Writes ``DIR/bench.json`` (every measurement, derived ratios and, on a GPU, the
performance targets) and ``DIR/bench.png``, and prints one line per measurement (with a
progress count, elapsed time and time left), then the summary and, on a GPU, one line per
target. ``python3 -m benchmarks.report DIR/bench.json`` redraws the chart.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import traceback
from typing import Any

import jax
import numpy as np

from benchmarks import cases as cases_mod
from benchmarks import report
from benchmarks.shapes import CPU_SHAPES, GPU_SHAPES, MoEShape, by_name
from benchmarks.timing import Timing, chain_length, time_fn
from te_jax_perm.progress import Progress

# Guessed bandwidths (bytes/s) only size the timing chains; they never enter a result.
_GUESS_BW = {"triton": 2.5e12, "xla": 0.5e12, "interpret": 1e8}
# A shortlist of copy configs (block, iters, warps) tried on the first shape; the winner is
# the "tuned Triton copy" for the whole run.
_COPY_SHORTLIST = ((4096, 1, 4), (4096, 1, 8), (8192, 1, 8), (2048, 2, 4), (4096, 2, 8), (8192, 2, 8),
                   (4096, 4, 8), (16384, 1, 8))


@dataclasses.dataclass
class Settings:
    on_gpu: bool
    kernel_backend: str
    target_s: float      # wall time one timed chain should take
    reps: int
    max_chain: int


def _settings(mode: str, reps: int | None) -> Settings:
    on_gpu = jax.default_backend() == "gpu" and mode != "cpu"
    if mode == "gpu" and not on_gpu:
        raise SystemExit("--mode gpu: JAX sees no GPU (jax.default_backend() is %r)" % jax.default_backend())
    if on_gpu:
        return Settings(True, "triton", 0.02, reps or 7, 200)
    return Settings(False, "interpret", 0.0, reps or 3, 2)


def _row(shape: MoEShape, op: str, direction: str, backend: str, nbytes: int,
         timing: Timing | None = None, status: str = "ok", **extra: Any) -> dict:
    row = {"shape": shape.name, "model": shape.model, "T": shape.T, "H": shape.H, "E": shape.E, "k": shape.k,
           "dtype": shape.dtype, "op": op, "direction": direction, "backend": backend, "bytes": nbytes,
           "status": status, **extra}
    if timing is not None:
        row.update(median_s=timing.median_s, p10_s=timing.p10_s, p90_s=timing.p90_s, min_s=timing.min_s,
                   spread=timing.spread, n_chain=timing.n_chain, reps=timing.reps, compile_s=timing.compile_s,
                   bandwidth_GBps=nbytes / timing.median_s / 1e9)
    return row


class Runner:
    def __init__(self, st: Settings, deadline: float, log, progress: Progress | None = None):
        self.st, self.deadline, self.log, self.progress = st, deadline, log, progress
        self.rows: list[dict] = []
        self.done = 0

    def over_budget(self) -> bool:
        return time.monotonic() > self.deadline

    def measure(self, shape: MoEShape, op: str, direction: str, backend: str, build, **extra: Any) -> dict:
        if self.over_budget():
            row = _row(shape, op, direction, backend, 0, status="skipped: time budget", **extra)
        else:
            try:
                built = build()
                n = chain_length(built.bytes / _GUESS_BW[backend], self.st.target_s, hi=self.st.max_chain)
                timing = time_fn(built.fn, built.args, n, self.st.reps)
                row = _row(shape, op, direction, backend, built.bytes, timing, **extra)
            except Exception as e:  # one failing op must not end the sweep; the row says why
                row = _row(shape, op, direction, backend, 0, status=f"error: {type(e).__name__}: {e}"[:500], **extra)
                self.log(traceback.format_exc())
        self.rows.append(row)
        self.done += 1
        self.log(report.one_line(row) + (f"  [{self.progress.line(self.done)}]" if self.progress else ""))
        return row


def _tune_copy(runner: Runner, problem: cases_mod.Problem) -> tuple[Any, list[dict]]:
    from te_jax_perm.core import Config

    if not runner.st.on_gpu:
        return None, []
    tried = []
    for block, iters, warps in _COPY_SHORTLIST:
        cfg = Config.make(num_warps=warps, BLOCK=block, ITERS=iters)
        row = runner.measure(problem.shape, "copy", "tune", "triton",
                             lambda: cases_mod.copy_triton(problem, cfg), config=str(cfg))
        runner.rows.pop()  # tuning trials go in their own list, not among the results
        tried.append(row)
    ok = [(r["median_s"], i) for i, r in enumerate(tried) if r["status"] == "ok"]
    if not ok:
        return None, tried
    block, iters, warps = _COPY_SHORTLIST[min(ok)[1]]
    return Config.make(num_warps=warps, BLOCK=block, ITERS=iters), tried


def run(args: argparse.Namespace) -> dict:
    t_start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "bench.log"), "a") if args.log else None

    def log(msg: str) -> None:
        line = msg.rstrip()
        if "\n" not in line:
            print(line, flush=True)
        if log_file:
            log_file.write(line + "\n")
            log_file.flush()

    st = _settings(args.mode, args.reps)
    if args.autotune:
        import te_jax_perm.autotune as at
        at.enable(True)
    shapes = by_name(args.shapes, GPU_SHAPES if st.on_gpu else CPU_SHAPES)
    selected = cases_mod.select(args.ops)
    backends = [b for b in (st.kernel_backend, "xla") if b in args.backends.split(",")]
    n_copy_tune = len(_COPY_SHORTLIST) if st.on_gpu and not args.no_copy_tune and shapes else 0
    total = n_copy_tune + len(shapes) * (2 + len(selected) * len(backends))
    if not st.on_gpu:
        log(report.SMOKE_NOTE)
    log(f"benchmark: {total} measurements ({len(shapes)} shapes; {len(selected)} op directions on "
        f"{' and '.join(backends)}; copies), budget {args.budget_s:.0f}s, on {jax.devices()[0].device_kind}")
    runner = Runner(st, t_start + args.budget_s, log, Progress(total, args.budget_s))
    copy_cfg, copy_trials = None, []
    for si, shape in enumerate(shapes):
        if runner.over_budget():
            log(f"SKIP {shape.name}: time budget")
            for c in selected:
                for b in backends:
                    runner.rows.append(_row(shape, c.op, c.direction, b, 0, status="skipped: time budget"))
            continue
        try:
            problem = cases_mod.Problem.make(shape)
        except Exception as e:
            log(traceback.format_exc())
            runner.rows.append(_row(shape, "problem", "-", "-", 0, status=f"error: {type(e).__name__}: {e}"[:500]))
            continue
        if si == 0 and not args.no_copy_tune:
            copy_cfg, copy_trials = _tune_copy(runner, problem)
        runner.measure(shape, "copy", "fwd", "xla", lambda: cases_mod.copy_xla(problem))
        runner.measure(shape, "copy", "fwd", st.kernel_backend, lambda: cases_mod.copy_triton(problem, copy_cfg),
                       config=str(copy_cfg))
        for c in selected:
            for b in backends:
                runner.measure(shape, c.op, c.direction, b, lambda: c.build(problem, b))
        problem = None  # frees this shape's arrays before the next shape's are made
    result = {
        "meta": _meta(st, args, copy_cfg, time.monotonic() - t_start),
        "copy_tuning": copy_trials,
        "results": runner.rows,
    }
    result.update(report.derive(runner.rows, st.kernel_backend, st.on_gpu))
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump(result, f, indent=1, default=_json_default)
    report.plot(result, os.path.join(args.out, "bench.png"))
    for line in report.summary_lines(result):
        log(line)
    if log_file:
        log_file.close()
    return result


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    return str(o)


def _meta(st: Settings, args: argparse.Namespace, copy_cfg: Any, wall_s: float) -> dict:
    import triton

    dev = jax.devices()[0]
    return {"device": getattr(dev, "device_kind", str(dev)), "platform": jax.default_backend(),
            "kernel_backend": st.kernel_backend, "smoke": not st.on_gpu, "jax": jax.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "autotune": bool(args.autotune),
            "copy_config": str(copy_cfg), "reps": st.reps, "target_chain_s": st.target_s,
            "budget_s": args.budget_s, "wall_s": wall_s, "argv": sys.argv[1:],
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (bench.json, bench.png, bench.log)")
    p.add_argument("--mode", choices=("auto", "gpu", "cpu"), default="auto",
                   help="auto: GPU sweep if JAX sees a GPU, else the CPU smoke sweep (interpret vs xla at tiny "
                        "shapes; checks the benchmark runs, judges no targets)")
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="stop starting new measurements after this many seconds (rest marked skipped)")
    p.add_argument("--shapes", default="", help="comma-separated substrings of shape names (default: all)")
    p.add_argument("--ops", default="", help="comma-separated substrings of op.direction (default: all)")
    p.add_argument("--backends", default="triton,interpret,xla", help="which of kernel backend / xla to run")
    p.add_argument("--reps", type=int, default=None, help="timed chains per measurement (median taken)")
    p.add_argument("--autotune", action="store_true", help="tune kernels on a cache miss (slow first call)")
    p.add_argument("--no-copy-tune", action="store_true", help="skip the copy-kernel config shortlist")
    p.add_argument("--log", action="store_true", help="also append everything to OUT/bench.log")
    a = p.parse_args(argv)
    known = ("triton", "interpret", "xla")
    bad = ([f"--backends: {b!r} is not one of {list(known)}" for b in a.backends.split(",") if b not in known]
           + ([f"--budget-s={a.budget_s} must not be negative"] if a.budget_s < 0 else [])
           + ([f"--reps={a.reps} must be at least 1"] if a.reps is not None and a.reps < 1 else []))
    if bad:
        p.error("; ".join(bad))
    return a


def main(argv: list[str] | None = None) -> int:
    result = run(parse(argv))
    bad = [r for r in result["results"] if r["status"].startswith("error")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
