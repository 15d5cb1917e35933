"""One process of the command-buffer capture tests: runs a jitted step on the ``triton``
backend under whatever ``XLA_FLAGS`` it was started with, and writes its outputs (``--npz``)
and what the profiler saw (``--json``).

    python3 -m tests.gpu.capture_step --npz OUT.npz --json OUT.json [--step dispatch_combine]
    python3 -m tests.gpu.capture_step --npz OUT.npz --json OUT.json --step expert_gemms --configs tma

Steps: ``dispatch_combine`` (token dispatch -> combine forward and backward), and
``expert_gemms`` (two layers of grouped GEMMs, forward and backward, in a ``lax.scan``),
whose GEMMs run their default configs or (``--configs tma``) the first TMA config each
admits: kernels that build tensor descriptors in global scratch memory.
"""
import argparse
import contextlib
import json
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import small_t, trace_stats
from te_jax_perm.core import hooks


def dispatch_combine(a) -> tuple[Callable, tuple, Callable]:
    """(step, its inputs, next inputs from outputs and inputs)."""
    x, rmap, probs = (jax.device_put(v) for v in small_t.problem(a.tokens, a.hidden, a.experts, a.topk))
    return small_t.make_step("triton", a.topk), (x, rmap, probs), lambda out, args: (out[0], args[1], out[1])


def expert_gemms(a) -> tuple[Callable, tuple, Callable]:
    from te_jax_perm.ops.grouped_gemm.api import grouped_matmul
    t, h, f, g, layers = a.tokens * a.topk, a.hidden, 2 * a.hidden, a.experts, 2
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (t, h), jnp.bfloat16)
    w1 = (jax.random.normal(keys[1], (layers, g, h, f), jnp.float32) * 0.03).astype(jnp.bfloat16)
    w2 = (jax.random.normal(keys[2], (layers, g, f, h), jnp.float32) * 0.03).astype(jnp.bfloat16)
    sizes = np.random.default_rng(0).multinomial(t - 37, np.ones(g) / g)  # uneven, rows past the groups
    sizes[1] = 0
    sizes = jnp.asarray(sizes, jnp.int32)

    def layer(y, w):
        hidden = grouped_matmul(y, w[0], sizes, backend="triton")
        return y + grouped_matmul(jax.nn.gelu(hidden), w[1], sizes, backend="triton"), None

    def loss(x, w1, w2):
        return jnp.mean(jax.lax.scan(layer, x, (w1, w2))[0].astype(jnp.float32) ** 2)

    def step(x, w1, w2):
        dx, d1, d2 = jax.grad(loss, argnums=(0, 1, 2))(x, w1, w2)
        return tuple((v - 1e-2 * d).astype(v.dtype) for v, d in ((x, dx), (w1, d1), (w2, d2)))
    return step, (x, w1, w2), lambda out, args: out


def tma_configs(call) -> Any:
    """The first TMA config the grouped GEMM's kernels admit for ``call`` (None elsewhere:
    the default, e.g. the warp-specialised weight gradient's, whose descriptors are built
    on the device too)."""
    from te_jax_perm.kernels.grouped_gemm import grouped_gemm_kernel, grouped_gemm_wgrad_kernel
    from te_jax_perm.ops.grouped_gemm import decl as D
    # By kernel: on Hopper the row-tile GEMMs run their Hopper declarations of the same kernel.
    pools = {grouped_gemm_kernel: D.TMA_CONFIGS, grouped_gemm_wgrad_kernel: D.WGRAD_TMA_CONFIGS}
    pool = pools.get(call.decl.kernel, ())
    return next((c for c in pool if not call.decl.violated(call.dims, call.params, c)), None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--npz", required=True)
    ap.add_argument("--json", required=True)
    ap.add_argument("--step", choices=("dispatch_combine", "expert_gemms"), default="dispatch_combine")
    ap.add_argument("--configs", choices=("default", "tma"), default="default")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    a = ap.parse_args()
    make, args, advance = {"dispatch_combine": dispatch_combine, "expert_gemms": expert_gemms}[a.step](a)
    ours, configs = set(), {}

    def resolver(call):
        cfg = tma_configs(call)
        configs[call.decl.name] = str(cfg)
        return cfg

    chosen = hooks.using_config_resolver(resolver) if a.configs == "tma" else contextlib.nullcontext()
    with chosen, hooks.observe_calls(lambda call: ours.add(call.decl.kernel.fn.__name__)):
        compiled = jax.jit(make).lower(*args).compile()
    outs = jax.block_until_ready(compiled(*args))
    np.savez(a.npz, *[np.asarray(o).view(np.uint8) for o in jax.tree.leaves(outs)])
    walls = []
    for _ in range(7):
        state = args
        t0 = time.perf_counter()
        for _ in range(50):
            state = advance(compiled(*state), state)
        jax.block_until_ready(state)
        walls.append((time.perf_counter() - t0) / 50)
    stats = trace_stats.profile(lambda: jax.block_until_ready(compiled(*args)), 20)
    report = {"our_kernels": sorted(ours), "our_kernels_per_step": stats.count_per_step(sorted(ours)),
              "configs": configs, "dtypes": [str(o.dtype) for o in jax.tree.leaves(outs)], "wall_us": statistics.median(walls) * 1e6, **stats.to_json()}
    with open(a.json, "w") as fh:
        json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
