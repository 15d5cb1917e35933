"""The expert-parallel MoE layer's training step and row exchange, timed per device.

    python3 -m benchmarks.ep_bench [--weak_scaling] [--json_out FILE] [example flags]

The layer, its sizes and flags are ``examples/moe_expert_parallel.py``'s (imported from it;
run the example first for its check against the single-device reference). For each
all-to-all mode this times the compiled fwd+bwd step (median of --steps calls, each blocked
until done), one forward row exchange of the same rows measured on its own, and reports the
rows on the wire; on GPUs also the step's kernel time from a profile, and the exchange
kernels' part of it. With --weak_scaling it also times expert-parallel groups of 1, 2, 4, ...
devices (each copied --data times) at the same tokens and experts per device, and each step
over the 1-device group's step.
"""
from __future__ import annotations

import dataclasses
import os
import re
import statistics
from typing import Any

from absl import flags

from benchmarks import trace_stats
from benchmarks.results_io import write_json
from benchmarks.timing import median_wall_ms, wall_ms
from examples import moe_expert_parallel as example

FLAGS = flags.FLAGS
flags.DEFINE_integer("steps", None, "timed training steps per measurement (default: 10 on GPUs, 2 on CPU)",
                     lower_bound=1)
flags.DEFINE_bool("weak_scaling", False, "also time 1, 2, 4, .. devices at the same tokens per device and "
                  "report each step time over the 1-device one")
flags.DEFINE_string("json_out", None, "also write the results as JSON to this file, and a chart of them "
                    "beside it (the same name ending in .png)")


def routed_and_sent(sz: example.Sizes, rm_host):
    """int32 ``[device, rank in its group]``: the rows each device routes to each rank, and
    those it sends (at most the capacity; the rest are dropped)."""
    import numpy as np

    routed = rm_host.reshape(sz.n_dev, sz.tokens, sz.ep, sz.experts // sz.ep).sum(axis=(1, 3)).astype(np.int32)
    return routed, np.minimum(routed, sz.cap)


def exchange_ms(sz: example.Sizes, mesh, rm_host, mode: str, steps: int) -> float:
    """One forward row exchange of the layer, alone: the same rows, offsets and sizes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from te_jax_perm.parallel.exchange import ragged_slices, send_rows

    ep, cap = sz.ep, sz.cap
    rows_to, sent = routed_and_sent(sz, rm_host)
    rank_start = (np.cumsum(rows_to, 1) - rows_to).astype(np.int32)
    recv = sent.reshape(sz.data, ep, ep).transpose(0, 2, 1).reshape(sz.n_dev, ep)   # from each rank of the group
    shard = NamedSharding(mesh, P(mesh.axis_names))
    rows = jax.device_put(jnp.zeros((sz.n_dev * sz.num_out, sz.hidden), sz.dtype), shard)
    args = [jax.device_put(a.reshape(-1), shard) for a in (rank_start, sent, recv)]
    slices = ragged_slices(tuple(mesh.devices.flat))
    body = lambda r, s0, s, rv: send_rows(r, s0, s, rv, cap, "ep", mode, slices)
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(mesh.axis_names),) * 4, out_specs=P(mesh.axis_names)))
    return median_wall_ms(fn, (rows, *args), steps)


def time_config(sz: example.Sizes, devices, modes: list[str], backend: str, steps: int) -> dict:
    """Each mode's step and exchange times on ``devices`` and its rows on the wire."""
    import jax
    import numpy as np

    mesh = example.make_mesh(sz, devices)
    x, rm, probs, w_in, w_out, rm_host = example.make_problem(sz, mesh, FLAGS.routing)
    args = (x, probs, w_in, w_out, rm, jax.device_put(np.ones((sz.n_dev * sz.tokens,), np.float32), x.sharding))
    _, kept = routed_and_sent(sz, rm_host)
    res: dict[str, Any] = {"devices": sz.n_dev, "experts": sz.experts, "modes": {}}
    for mode in modes:
        compiled, r = example.compiled_step(sz, mesh, mode, backend, args, example.memory_limit(devices[0]))
        times = wall_ms(compiled, args, steps)
        r["step_ms"] = statistics.median(times)
        r["step_ms_min_max"] = (min(times), max(times))
        r["exchange_ms"] = exchange_ms(sz, mesh, rm_host, mode, steps)
        if devices[0].platform == "gpu":
            r.update(step_kernels(lambda: jax.block_until_ready(compiled(*args)), steps, sz.n_dev))
        r["rows_on_wire_per_device"] = ([sz.ep * sz.cap] * sz.n_dev if mode == "dense"
                                        else kept.sum(1).astype(int).tolist())
        res["modes"][mode] = r
        print(f"[{sz.n_dev} devices, a2a={mode}] train step (fwd+bwd) per device: median {r['step_ms']:.2f} ms "
              f"[min {min(times):.2f}, max {max(times):.2f}]; one row exchange alone: {r['exchange_ms']:.2f} ms "
              f"(a training step makes 4: there and back, forward and backward = {4 * r['exchange_ms']:.2f} ms, "
              f"{400 * r['exchange_ms'] / r['step_ms']:.0f}% of the step if none overlaps); rows on the wire per "
              f"device {r['rows_on_wire_per_device']}" + (" (padded to capacity)" if mode == "dense" else " (kept rows)"))
        if "step_kernel_ms" in r:
            print(f"    profiler, per device: kernels {r['step_kernel_ms']:.2f} ms a step, of which the exchanges' "
                  f"{r['exchange_kernel_ms']:.2f} ms; some kernel busy {r['step_busy_ms']:.2f} ms")
    return res


# Kernels of the row exchanges: NCCL's, and XLA's own ragged all-to-all kernel.
_EXCHANGE_KERNEL = re.compile(r"nccl|ragged", re.I)


def step_kernels(step, steps: int, n_dev: int) -> dict[str, float]:
    """The step's device time from a profile of ``steps`` calls, each waited for, per device
    (the devices' sum over ``n_dev``): every kernel's time summed, the exchange kernels' part
    of it, and how long at least one kernel ran (below the sum where kernels overlap)."""
    stats = trace_stats.profile(step, steps)
    per_device_ms = lambda ns: ns / stats.steps / n_dev / 1e6
    top = sorted(stats.kernel_ns.items(), key=lambda kv: -kv[1])[:15]
    return {"step_kernel_ms": per_device_ms(sum(stats.kernel_ns.values())),
            "exchange_kernel_ms": per_device_ms(sum(ns for k, ns in stats.kernel_ns.items()
                                                    if _EXCHANGE_KERNEL.search(k))),
            "step_busy_ms": per_device_ms(stats.busy_ns),
            # Where the time goes: the longest kernels, ms a step per device.
            "top_kernels_ms": [(k, per_device_ms(ns)) for k, ns in top]}


def weak_counts(n: int) -> list[int]:
    """1, 2, 4, ... devices per expert-parallel group (times --data) below ``n``, where
    --weak_scaling asks for them."""
    d = FLAGS.data
    return [d << i for i in range((n // d).bit_length()) if (d << i) < n] if FLAGS.weak_scaling else []


def main(argv: list[str]) -> int:
    del argv
    run = example.setup(weak_counts)
    if isinstance(run, int):
        return run
    sz, steps = run.sz, FLAGS.steps or (10 if run.on_gpu else 2)
    results: dict[str, Any] = {"device": run.devices[0].device_kind, "platform": run.devices[0].platform,
                               "sizes": {**dataclasses.asdict(sz), "cap": sz.cap}, "runs": []}
    try:
        for n in weak_counts(sz.n_dev) + [sz.n_dev]:
            modes = ["dense"] if n == sz.data else run.modes
            results["runs"].append(time_config(example.on_devices(sz, n), run.devices[:n], modes, run.backend, steps))
    except MemoryError as e:
        print(f"WON'T FIT: {e}")
        return example.EXIT_WONT_FIT
    if len(results["runs"]) > 1:
        first = results["runs"][0]
        base = first["modes"]["dense"]["step_ms"]
        for r in results["runs"][1:]:
            for mode, m in r["modes"].items():
                m["weak_scaling_ratio"] = m["step_ms"] / base
                print(f"weak scaling: {r['devices']} devices ({r['experts']} experts), a2a={mode}: "
                      f"{m['step_ms']:.2f} ms per step = {m['weak_scaling_ratio']:.2f}x the {first['devices']}-device "
                      f"step ({base:.2f} ms)")
    if FLAGS.json_out:
        write_json(FLAGS.json_out, results)
        plot(results, os.path.splitext(FLAGS.json_out)[0] + ".png")
    return 0


def plot(results: dict, path: str) -> None:
    """Per device count and exchange: the step's median time, and the time of the four row
    exchanges a step makes had each run alone (``results`` as written by ``--json_out``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    bars = [(f"{r['devices']} dev, E={r['experts']}\n{mode}", m["step_ms"], m.get("step_kernel_ms"),
             4 * m["exchange_ms"]) for r in results["runs"] for mode, m in r["modes"].items()]
    fig, ax = plt.subplots(figsize=(1.6 * len(bars) + 2, 4))
    xs = range(len(bars))
    ax.bar([x - 0.27 for x in xs], [b[1] for b in bars], 0.27, label="train step (fwd+bwd), median wall")
    if all(b[2] is not None for b in bars):
        ax.bar(list(xs), [b[2] for b in bars], 0.27, label="its kernels (profiler)")
    ax.bar([x + 0.27 for x in xs], [b[3] for b in bars], 0.27, label="4 row exchanges, each timed alone")
    for x, b in zip(xs, bars):
        ax.annotate(f"{b[1]:.2f}", (x - 0.27, b[1]), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(xs), [b[0] for b in bars], fontsize=8)
    ax.set_ylabel("ms per device")
    sz = results["sizes"]
    ax.set_title(f"expert-parallel MoE layer on {results['device']}\ntop-{sz['topk']}, T={sz['tokens']} per "
                 f"device, H={sz['hidden']}, F={sz['ffn']}, {sz['dtype']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    from te_jax_perm import cli
    cli.run(main)
