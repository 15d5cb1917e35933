"""Small-T (decode / small micro-batch) cost of a jitted dispatch -> combine forward+backward
step: wall time against profiler kernel time, for each way the kernels can be called.

    python3 -m benchmarks.small_t --out DIR [--tokens 16,64,256,1024] [--models deepseek-v3,qwen3]
        [--modes ffi,legacy,jax_triton,xla]

Modes: ``ffi`` / ``legacy`` / ``jax_triton`` are the ``triton`` backend's call modes (the
typed-FFI Triton call, the legacy custom call, jax-triton's call); ``xla`` is the ``xla``
backend. The routing map is a jit argument (as in training). Wall time: a chain of
dependent steps dispatched asynchronously (each step's input is the previous step's
output), per step, median of several chains; kernel time: the sum of every kernel of one
step in a ``jax.profiler`` trace (ours and XLA's). Writes ``small_t.json`` and
``small_t.png`` into ``--out``; prints one ``TARGET`` line (at T <= 64 the ``ffi`` wall
time should be within 1.3x its kernel time and 1.5x faster than ``legacy``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import numpy as np

MODELS = {"deepseek-v3": (7168, 256, 8), "qwen3": (4096, 128, 8)}  # H, E, k
TOKENS = (16, 64, 256, 1024)


def problem(T: int, H: int, E: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bf16 tokens ``[T, H]``, a top-k routing map ``[T, E]`` and its probs (fp32)."""
    import ml_dtypes
    from te_jax_perm.autotune.workloads import moe_problem
    return moe_problem(T, H, E, k, ml_dtypes.bfloat16, seed)


def make_step(backend: str, k: int) -> Callable:
    """``step(x, rmap, probs) -> (x', probs')``: dispatch, a per-row scale (stand-in for the
    experts), combine, and the gradient of a scalar loss with respect to ``x`` and
    ``probs``; ``x'``/``probs'`` take one small SGD step so that steps chain."""
    import jax
    import jax.numpy as jnp
    import te_jax_perm

    def loss(x, rmap, probs):
        out, _, row_id_map, _, _ = te_jax_perm.token_dispatch(x, rmap, x.shape[0] * k, probs=None, backend=backend)
        y = te_jax_perm.token_combine(out * jnp.asarray(1.5, out.dtype), row_id_map, probs, backend=backend)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    def step(x, rmap, probs):
        gx, gp = jax.grad(loss, argnums=(0, 2))(x, rmap, probs)
        return (x - (1e-3 * gx).astype(x.dtype)), probs - 1e-3 * gp
    return step


def call_mode(mode: str):
    """The context lowering ``mode``'s kernels (``xla`` needs none)."""
    import contextlib
    from te_jax_perm.core import triton_backend
    return contextlib.nullcontext() if mode == "xla" else triton_backend.triton_call_mode(mode)


def measure(mode: str, T: int, H: int, E: int, k: int, chain: int = 50, reps: int = 7,
            trace_steps: int = 10) -> dict[str, Any]:
    import jax
    from benchmarks import trace_stats
    jax.clear_caches()  # the call mode is read at lowering
    backend = "xla" if mode == "xla" else "triton"
    x, rmap, probs = (jax.device_put(a) for a in problem(T, H, E, k))
    f = jax.jit(make_step(backend, k))
    with call_mode(mode):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x, rmap, probs))
        compile_s = time.perf_counter() - t0
        walls = []
        for _ in range(reps):
            xs, ps = x, probs
            t0 = time.perf_counter()
            for _ in range(chain):
                xs, ps = f(xs, rmap, ps)
            jax.block_until_ready((xs, ps))
            walls.append((time.perf_counter() - t0) / chain)
        stats = trace_stats.profile(lambda: jax.block_until_ready(f(x, rmap, probs)), trace_steps)
    wall_us = statistics.median(walls) * 1e6
    return {"mode": mode, "T": T, "H": H, "E": E, "k": k, "wall_us": wall_us,
            "wall_us_min": min(walls) * 1e6, "kernel_us": stats.kernel_us_per_step,
            "wall_over_kernel": wall_us / stats.kernel_us_per_step if stats.kernel_us_per_step else None,
            "kernels_per_step": sum(stats.kernel_count.values()) / stats.steps,
            "graph_launches_per_step": stats.graph_launches / stats.steps,
            "kernel_launches_per_step": stats.kernel_launches / stats.steps, "compile_s": compile_s}


def available_modes(wanted: list[str]) -> list[str]:
    from te_jax_perm.core import compat
    modes = []
    for m in wanted:
        if m == "jax_triton" and compat.problems("jax_triton"):
            print(f"small_t: skipping jax_triton: {'; '.join(compat.problems('jax_triton'))}", file=sys.stderr)
            continue
        modes.append(m)
    return modes


def target_line(rows: list[dict]) -> str:
    """``TARGET`` verdict: at T <= 64, ffi wall <= 1.3x its kernel time and >= 1.5x faster than legacy."""
    by = {(r["model"], r["T"], r["mode"]): r for r in rows}
    checks, ok = [], True
    for (model, T, mode), r in sorted(by.items()):
        if mode != "ffi" or T > 64:
            continue
        legacy = by.get((model, T, "legacy"))
        ratio = r["wall_over_kernel"]
        speedup = legacy["wall_us"] / r["wall_us"] if legacy else None
        good = ratio is not None and ratio <= 1.3 and (speedup is None or speedup >= 1.5)
        ok &= good
        checks.append(f"{model} T={T}: wall {r['wall_us']:.0f}us = {ratio:.2f}x kernel"
                      + (f", {speedup:.2f}x faster than legacy" if speedup else ""))
    return f"TARGET small-T ffi: {'MET' if ok and checks else 'MISSED'} :: " + "; ".join(checks)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for mode in sorted({r["mode"] for r in rows}):
            pts = sorted((r["T"], r["wall_us"], r["kernel_us"]) for r in rows if r["model"] == model and r["mode"] == mode)
            if not pts:
                continue
            ts = [p[0] for p in pts]
            line, = ax.plot(ts, [p[1] for p in pts], marker="o", label=f"{mode} wall")
            ax.plot(ts, [p[2] for p in pts], marker="x", linestyle="--", color=line.get_color(),
                    label=f"{mode} kernels")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("us per dispatch+combine fwd+bwd step")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.small_t", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--modes", default="ffi,legacy,jax_triton,xla")
    ap.add_argument("--chain", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    import jax
    os.makedirs(a.out, exist_ok=True)
    modes = available_modes(a.modes.split(","))
    rows = []
    device = jax.devices()[0].device_kind
    for model in a.models.split(","):
        H, E, k = MODELS[model]
        for T in map(int, a.tokens.split(",")):
            for mode in modes:
                row = {"model": model, "device": device, **measure(mode, T, H, E, k, a.chain, a.reps)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(os.path.join(a.out, "small_t.json"), "w") as f:
                    json.dump({"device": device, "jax": jax.__version__, "rows": rows}, f, indent=1)
    line = target_line(rows)
    print(line)
    with open(os.path.join(a.out, "small_t.json"), "w") as f:
        json.dump({"device": device, "jax": jax.__version__, "rows": rows, "target": line}, f, indent=1)
    try:
        plot(rows, os.path.join(a.out, "small_t.png"))
    except ImportError as e:
        print(f"small_t: no plot ({e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
