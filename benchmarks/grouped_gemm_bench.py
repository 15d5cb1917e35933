"""Grouped GEMM on the GPU: our Triton kernel vs tokamax vs lax.ragged_dot vs the dense limit.

For each MoE expert-GEMM shape (rows M = tokens x top-k grouped by expert, K -> N per
expert), times in one process: a dense bf16 matmul of the same FLOPs (the limit), our
grouped GEMM forward (default config and a few alternatives), its backward (input and
weight gradients), tokamax's ragged_dot where importable, and lax.ragged_dot where it fits.
Writes grouped_gemm.json into --out.
"""
from __future__ import annotations

import json
import os
import time

from absl import flags, logging
import jax
import jax.numpy as jnp
import numpy as np

from te_jax_perm import cli
from te_jax_perm.core import Config
from te_jax_perm.ops.grouped_gemm import decl as D
from te_jax_perm.ops.grouped_gemm.api import grouped_gemm_triton
from te_jax_perm.ops.grouped_gemm.reference import grouped_gemm_reference

_OUT = flags.DEFINE_string("out", "/tmp/grouped_gemm_bench", "Directory for grouped_gemm.json.")
_BUDGET = flags.DEFINE_float("budget_s", 300.0, "Stop starting new shapes after this many seconds.")
_SWEEP = flags.DEFINE_bool("sweep", True, "Also time alternative tile configs of the forward kernel.")

# (name, M, K, N, G): up-projection uses N = 2 x ffn (gate and up fused), down-projection K = ffn.
SHAPES = [
    ("deepseek_v3_up_T8192", 65536, 7168, 4096, 256),
    ("deepseek_v3_down_T8192", 65536, 2048, 7168, 256),
    ("qwen3_up_T8192", 65536, 4096, 3072, 128),
    ("qwen3_down_T8192", 65536, 1536, 4096, 128),
    ("mixtral_up_T8192", 16384, 4096, 28672, 8),
    ("g8_16384x4096x4096", 16384, 4096, 4096, 8),
    ("g32_32768x4096x2048", 32768, 4096, 2048, 32),
]
SWEEP = [Config.make(num_warps=w, num_stages=s, BM=bm, BN=bn, BK=bk, GROUP_M=8)
         for (bm, bn, bk, w, s) in [(128, 256, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
                                    (64, 256, 64, 8, 4), (128, 256, 64, 8, 4), (128, 128, 128, 8, 3)]]


def _time_ms(fn, *args, reps: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def _group_sizes(m: int, g: int, rng) -> np.ndarray:
    # Routing-like sizes: a multinomial draw over equally likely experts.
    return rng.multinomial(m, np.full(g, 1.0 / g)).astype(np.int32)


def main(argv):
    del argv
    os.makedirs(_OUT.value, exist_ok=True)
    rng = np.random.default_rng(0)
    results = {"device": str(jax.devices()[0].device_kind), "shapes": {}}
    try:
        import tokamax  # noqa: F401
    except Exception as e:  # optional: only compared where importable
        tokamax = None
        logging.info("tokamax not importable (%s); skipping it", e)
    t_start = time.time()
    for name, m, k, n, g in SHAPES:
        if time.time() - t_start > _BUDGET.value:
            logging.warning("budget spent; skipping %s", name)
            continue
        r = {"M": m, "K": k, "N": n, "G": g}
        key = jax.random.PRNGKey(0)
        lhs = jax.random.normal(key, (m, k), jnp.bfloat16)
        # Drawn in bf16 directly: a float32 draw of DeepSeek-V3's [256, 7168, 4096] needs 28 GiB.
        rhs = jax.random.normal(key, (g, k, n), jnp.bfloat16) * jnp.bfloat16(1 / np.sqrt(k))
        dout = jax.random.normal(key, (m, n), jnp.bfloat16)
        sizes = jnp.asarray(_group_sizes(m, g, rng))
        flops = 2.0 * m * k * n
        r["dense_ms"] = _time_ms(jax.jit(lambda a, b: a @ b), lhs, rhs[0])
        fwd = jax.jit(lambda a, b, s: grouped_gemm_triton(a, b, s, backend="triton"))
        r["ours_fwd_ms"] = _time_ms(fwd, lhs, rhs, sizes)
        ref = jax.jit(grouped_gemm_reference)(lhs[:4096], rhs, jnp.minimum(sizes, 0).at[0].set(4096))
        ours = fwd(lhs[:4096], rhs, jnp.minimum(sizes, 0).at[0].set(4096))
        r["check_max_abs_err"] = float(jnp.max(jnp.abs(ours.astype(jnp.float32) - ref.astype(jnp.float32))))
        fb = jax.jit(lambda a, b, s, d: jax.vjp(lambda x, y: grouped_gemm_triton(x, y, s, backend="triton"), a, b)[1](d))
        r["ours_bwd_ms"] = _time_ms(fb, lhs, rhs, sizes, dout)
        if _SWEEP.value:
            r["sweep_fwd_ms"] = {}
            for cfg in SWEEP:
                if D.grouped_gemm.decl.violated({"M": m, "C": k, "D": n, "G": g}, {"elem_bytes": 2}, cfg):
                    continue
                f = jax.jit(lambda a, b, s, cfg=cfg: D.grouped_gemm(a, b, s, backend="triton", config=cfg,
                                                                    elem_bytes=2)[0])
                try:
                    r["sweep_fwd_ms"][str(cfg)] = _time_ms(f, lhs, rhs, sizes, reps=5)
                except Exception as e:  # a config that fails to compile is a finding, not a crash
                    r["sweep_fwd_ms"][str(cfg)] = repr(e)[:200]
        if tokamax is not None:
            try:
                tf = jax.jit(lambda a, b, s: tokamax.ragged_dot(a, b, s))
                r["tokamax_fwd_ms"] = _time_ms(tf, lhs, rhs, sizes)
                tb = jax.jit(lambda a, b, s, d: jax.vjp(lambda x, y: tokamax.ragged_dot(x, y, s), a, b)[1](d))
                r["tokamax_bwd_ms"] = _time_ms(tb, lhs, rhs, sizes, dout)
            except Exception as e:
                r["tokamax_error"] = repr(e)[:300]
        if m * g * k * 2 < 4e9:
            r["lax_ragged_dot_fwd_ms"] = _time_ms(jax.jit(jax.lax.ragged_dot), lhs, rhs, sizes, reps=3)
        r["dense_tflops"] = flops / r["dense_ms"] / 1e9
        r["ours_fwd_tflops"] = flops / r["ours_fwd_ms"] / 1e9
        r["ours_fwd_over_dense"] = r["ours_fwd_ms"] / r["dense_ms"]
        r["ours_bwd_over_2dense"] = r["ours_bwd_ms"] / (2 * r["dense_ms"])
        results["shapes"][name] = r
        print(name, json.dumps(r), flush=True)
        with open(os.path.join(_OUT.value, "grouped_gemm.json"), "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    cli.run(main)
