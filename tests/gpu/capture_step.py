"""One process of the command-buffer capture test: runs the jitted dispatch -> combine
forward+backward step on the ``triton`` backend under whatever ``XLA_FLAGS`` it was started
with, and writes its outputs (``--npz``) and what the profiler saw (``--json``).

    python3 -m tests.gpu.capture_step --npz OUT.npz --json OUT.json [--tokens 64]
"""
import argparse
import json
import statistics
import time

import jax
import numpy as np

from benchmarks import small_t, trace_stats
from te_jax_perm.core import hooks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--npz", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    a = ap.parse_args()
    x, rmap, probs = (jax.device_put(v) for v in small_t.problem(a.tokens, a.hidden, a.experts, a.topk))
    f = jax.jit(small_t.make_step("triton", a.topk))
    ours = set()
    with hooks.observe_calls(lambda call: ours.add(call.decl.kernel.fn.__name__)):
        compiled = f.lower(x, rmap, probs).compile()
    outs = jax.block_until_ready(compiled(x, rmap, probs))
    np.savez(a.npz, *[np.asarray(o).view(np.uint8) for o in jax.tree.leaves(outs)])
    walls = []
    for _ in range(7):
        xs, ps = x, probs
        t0 = time.perf_counter()
        for _ in range(50):
            xs, ps = compiled(xs, rmap, ps)
        jax.block_until_ready((xs, ps))
        walls.append((time.perf_counter() - t0) / 50)
    stats = trace_stats.profile(lambda: jax.block_until_ready(compiled(x, rmap, probs)), 20)
    report = {"our_kernels": sorted(ours), "our_kernels_per_step": stats.count_per_step(sorted(ours)),
              "wall_us": statistics.median(walls) * 1e6, **stats.to_json()}
    with open(a.json, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
