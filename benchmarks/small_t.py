"""Small-T (decode / small micro-batch) cost of a jitted dispatch -> combine forward+backward
step on the ``triton`` and the ``xla`` backend: wall time against profiler kernel time.

    python3 -m benchmarks.small_t --out DIR [--tokens 16,64,256,1024,4096] [--models deepseek-v3,qwen3]

The routing map is a jit argument (as in training). Wall time: a chain of dependent steps
dispatched asynchronously (each step's input is the previous step's output, donated to it as a
training loop donates its state), per step, median of several chains, beside the host's time
to enqueue them (when the two are equal, the host sets the pace, not the kernels) and the
same step's wall time without donation (XLA then updates the step's CUDA graph for new
buffer addresses on every call). Beside each point, the floor: a jitted step with the same
arguments and results doing one trivial update of each, chained and donated the same way,
about the least any step of that signature takes on this host (the three are chained in
turns, so the host's slow stretches fall on all of them alike). Kernel time: the sum of every kernel
of one step in a ``jax.profiler`` trace (ours and XLA's). Writes ``small_t.json`` and
``small_t.png`` into ``--out``; prints two ``TARGET`` lines: the ``triton`` step's kernel time
is at most the ``xla`` backend's at every T, and at T <= 64 its wall time is within 1.3x its
kernel time (``OUT OF REACH`` where every point that misses it has a floor above 1.3x its
kernel time: no step with those arguments launches that fast on this host).
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

from benchmarks.results_io import write_json
from te_jax_perm.workloads import DEEPSEEK_V3, QWEN3_235B, moe_problem

MODELS = {"deepseek-v3": DEEPSEEK_V3, "qwen3": QWEN3_235B}  # by the names --models takes and the rows carry
TOKENS = (16, 64, 256, 1024, 4096)


def problem(T: int, H: int, E: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """bf16 tokens ``[T, H]``, a top-k routing map ``[T, E]`` and its probs (fp32)."""
    import ml_dtypes
    return moe_problem(T, H, E, k, ml_dtypes.bfloat16, seed)


def make_step(backend: str, k: int) -> Callable:
    """``step(x, rmap, probs) -> (x', probs')``: dispatch, a per-row scale (stand-in for the
    experts), combine, and the gradient of a scalar loss with respect to ``x`` and
    ``probs``; ``x'``/``probs'`` take one small SGD step so that steps chain.

    The stand-in sits between optimization barriers, as the experts' GEMMs would: no
    backend may fold it into the permutation (XLA would fuse a bare scale into its own
    gather and scatter, which it cannot do with a real expert layer)."""
    import jax
    import jax.numpy as jnp
    import te_jax_perm

    def experts(rows):
        rows = jax.lax.optimization_barrier(rows)
        return jax.lax.optimization_barrier(rows * jnp.asarray(1.5, rows.dtype))

    def loss(x, rmap, probs):
        out, _, row_id_map, _, _ = te_jax_perm.token_dispatch(x, rmap, x.shape[0] * k, probs=None, backend=backend)
        y = te_jax_perm.token_combine(experts(out), row_id_map, probs, backend=backend)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    def step(x, rmap, probs):
        gx, gp = jax.grad(loss, argnums=(0, 2))(x, rmap, probs)
        return (x - (1e-3 * gx).astype(x.dtype)), probs - 1e-3 * gp
    return step


def chained_wall(step: Callable, state: Any, chain: int) -> tuple[float, float, Any]:
    """Seconds per step of ``chain`` dependent steps (``state = step(state)``) dispatched
    asynchronously: the wall time, the host's time to enqueue them (equal to the wall time
    when the host, not the GPU, sets the pace), and the last state (a step may donate its
    input, so only the last one is live)."""
    import jax
    t0 = time.perf_counter()
    for _ in range(chain):
        state = step(state)
    t1 = time.perf_counter()
    jax.block_until_ready(state)
    return (time.perf_counter() - t0) / chain, (t1 - t0) / chain, state


def walls_in_turns(steps: dict[str, Callable], x: Any, rmap: Any, probs: Any, chain: int,
                   reps: int) -> dict[str, tuple[list[float], list[float]]]:
    """:func:`chained_wall` of each ``f(x, rmap, probs) -> (x', probs')`` in ``steps``
    (which may donate ``x`` and ``probs``), from fresh copies of them after one call that
    compiles it; one chain of each in turn, ``reps`` times, so that the host's slow
    stretches fall on all of them alike. Per step: the walls and the enqueue times."""
    import jax
    import jax.numpy as jnp
    state = {}
    for name, f in steps.items():
        state[name] = jax.block_until_ready(f(jnp.array(x), rmap, jnp.array(probs)))
    out: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in steps}
    for _ in range(reps):
        for name, f in steps.items():
            wall, enqueue, state[name] = chained_wall(lambda s, f=f: f(s[0], rmap, s[1]), state[name], chain)
            out[name][0].append(wall)
            out[name][1].append(enqueue)
    return out


def measure(backend: str, T: int, H: int, E: int, k: int, chain: int = 50, reps: int = 15,
            trace_steps: int = 10) -> dict[str, Any]:
    import jax
    from benchmarks import trace_stats
    x, rmap, probs = (jax.device_put(a) for a in problem(T, H, E, k))
    step = make_step(backend, k)
    f, kept_f = jax.jit(step, donate_argnums=(0, 2)), jax.jit(step)
    t0 = time.perf_counter()
    jax.block_until_ready(f(jax.numpy.array(x), rmap, jax.numpy.array(probs)))
    compile_s = time.perf_counter() - t0
    timed = walls_in_turns({"donated": f, "kept": kept_f, "floor": jax.jit(trivial_step, donate_argnums=(0, 2))},
                           x, rmap, probs, chain, reps)
    (walls, enqueue), (kept, _), (floor, _) = timed["donated"], timed["kept"], timed["floor"]
    stats = trace_stats.profile(lambda: jax.block_until_ready(kept_f(x, rmap, probs)), trace_steps)
    wall_us = statistics.median(walls) * 1e6
    return {"backend": backend, "T": T, "H": H, "E": E, "k": k, "wall_us": wall_us,
            "wall_us_min": min(walls) * 1e6, "host_enqueue_us": statistics.median(enqueue) * 1e6,
            "wall_us_undonated": statistics.median(kept) * 1e6, "floor_us": statistics.median(floor) * 1e6,
            "kernel_us": stats.kernel_us_per_step,
            "wall_over_kernel": wall_us / stats.kernel_us_per_step if stats.kernel_us_per_step else None,
            "kernels_per_step": sum(stats.kernel_count.values()) / stats.steps,
            "graph_launches_per_step": stats.graph_launches / stats.steps,
            "kernel_launches_per_step": stats.kernel_launches / stats.steps, "compile_s": compile_s,
            # Per kernel name: us per step (where a step's time goes).
            "kernels": {name: ns / stats.steps / 1e3 for name, ns in sorted(stats.kernel_ns.items())}}


def trivial_step(x, rmap, probs):
    """The floor's step: the real step's arguments and results, one trivial update of each."""
    import jax.numpy as jnp
    return x + jnp.asarray(1, x.dtype), probs + 1


def target_lines(rows: list[dict]) -> list[str]:
    """``TARGET`` verdicts: the triton step's kernel time <= the xla backend's at every T;
    at T <= 64 its wall time <= 1.3x its kernel time, ``OUT OF REACH`` where every point
    that misses it has a floor (``floor_us``) above 1.3x its kernel time."""
    by = {(r["model"], r["T"], r["backend"]): r for r in rows if "T" in r}
    vs_xla, overhead = [], []
    for (model, T, backend), r in sorted(by.items()):
        xla = by.get((model, T, "xla"))
        if backend != "triton":
            continue
        if xla:
            vs_xla.append((r["kernel_us"] <= xla["kernel_us"],
                           f"{model} T={T}: {r['kernel_us']:.1f} vs {xla['kernel_us']:.1f}us", False))
        if T <= 64 and r["wall_over_kernel"] is not None:
            bound = 1.3 * r["kernel_us"]
            text = f"{model} T={T}: wall {r['wall_us']:.0f}us = {r['wall_over_kernel']:.2f}x kernel"
            if "floor_us" in r:
                text += f" (floor {r['floor_us']:.0f}us {'>' if r['floor_us'] > bound else '<='} 1.3x kernel {bound:.0f}us)"
            overhead.append((r["wall_over_kernel"] <= 1.3, text, r.get("floor_us", 0.0) > bound))

    # Each check: (met, its text, out of reach if missed).
    def line(name: str, checks: list) -> str:
        ok = bool(checks) and all(met for met, _, _ in checks)
        verdict = "PASS" if ok else "FAIL"
        if not ok and checks and all(met or beyond for met, _, beyond in checks):
            verdict = "OUT OF REACH"
        return f"TARGET {name}: {verdict} :: " + "; ".join(text for _, text, _ in checks)
    return [line("small-T triton kernel <= xla kernel", vs_xla), line("small-T wall <= 1.3x kernel", overhead)]


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in rows if "T" in r]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for backend in sorted({r["backend"] for r in rows}):
            pts = sorted((r["T"], r["wall_us"], r["kernel_us"]) for r in rows
                         if r["model"] == model and r["backend"] == backend)
            if not pts:
                continue
            ts = [p[0] for p in pts]
            line, = ax.plot(ts, [p[1] for p in pts], marker="o", label=f"{backend} wall")
            ax.plot(ts, [p[2] for p in pts], marker="x", linestyle="--", color=line.get_color(),
                    label=f"{backend} kernels")
        floor = sorted((r["T"], r["floor_us"]) for r in rows if r["model"] == model and r["backend"] == "triton"
                       and "floor_us" in r)
        if floor:
            ax.plot([p[0] for p in floor], [p[1] for p in floor], linestyle=":", color="gray",
                    label="floor: a trivial step, same arguments")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens T")
        ax.set_ylabel("us per dispatch+combine fwd+bwd step")
        ax.set_title(model)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.small_t", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for small_t.json and small_t.png")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated token counts T")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated models, of {', '.join(MODELS)}")
    ap.add_argument("--backends", default="triton,xla", help="comma-separated op backends: triton, xla")
    ap.add_argument("--chain", type=int, default=50, help="dependent steps per timed chain")
    ap.add_argument("--reps", type=int, default=15, help="timed chains per point (median taken)")
    a = ap.parse_args(argv)
    bad = ([f"--models: {m!r} is not one of {sorted(MODELS)}" for m in a.models.split(",") if m not in MODELS]
           + [f"--backends: {b!r} is not one of ['triton', 'xla']" for b in a.backends.split(",")
              if b not in ("triton", "xla")]
           + [f"--tokens: {t!r} is not a positive integer" for t in a.tokens.split(",")
              if not t.isdigit() or int(t) < 1]
           + [f"--{n}={v} must be at least 1" for n, v in (("chain", a.chain), ("reps", a.reps)) if v < 1])
    if bad:
        ap.error("; ".join(bad))
    import jax
    os.makedirs(a.out, exist_ok=True)
    device = jax.devices()[0].device_kind
    rows = []
    for model in a.models.split(","):
        m = MODELS[model]
        for T in map(int, a.tokens.split(",")):
            for backend in a.backends.split(","):
                row = {"model": model, "device": device, **measure(backend, T, m.H, m.E, m.k, a.chain, a.reps)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                write_json(os.path.join(a.out, "small_t.json"),
                           {"device": device, "jax": jax.__version__, "rows": rows})
    lines = target_lines(rows)
    print("\n".join(lines))
    write_json(os.path.join(a.out, "small_t.json"),
               {"device": device, "jax": jax.__version__, "rows": rows, "targets": lines})
    try:
        plot(rows, os.path.join(a.out, "small_t.png"))
    except ImportError as e:
        print(f"small_t: no plot ({e})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
