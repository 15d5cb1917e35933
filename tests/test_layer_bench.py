"""CPU smoke of the layer benchmark: it writes a consistent JSON and a PNG, says it is a smoke
run and gives no verdicts; its pure-JAX permutation is the same function as our layer."""
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import layer_bench


def test_sort_rows_vjp_is_the_inverse_gather():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((7, 3)), jnp.float32)
    order = jnp.asarray([3, 0, 6, 1, 5, 2, 4], jnp.int32)
    ct = jnp.asarray(np.random.default_rng(1).standard_normal((7, 3)), jnp.float32)
    got = jax.vjp(lambda x: layer_bench.sort_rows(x, order), x)[1](ct)[0]
    want = jax.vjp(lambda x: x[order], x)[1](ct)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_cpu_smoke_run_writes_json_and_png(tmp_path):
    assert layer_bench.main(["--out", str(tmp_path), "--mode", "cpu", "--steps", "1", "--shapes", "T37"]) == 0
    res = json.loads((tmp_path / "layer.json").read_text())
    assert res["smoke"] is True and res["targets"] == []
    assert (tmp_path / "layer.png").stat().st_size > 10_000
    (row,) = res["layers"]
    assert row["shape"] == "smoke/T37/H16/F32/E4/k3"
    assert row["ours_vs_pure_jax_max_rel_diff"] < 1e-5       # the two permutations compute one function
    for key in ("ours_ms", "pure_jax_ms", "gemm_limit_ms", "step_over_gemm_limit", "pure_jax_over_ours"):
        assert row[key] > 0, key
    assert row["step_over_gemm_limit"] == row["ours_ms"] / row["gemm_limit_ms"]
    assert len(res["gemm_table"]) == len(layer_bench.CPU_GEMMS)
    assert all("xla_fwd_ms" in r and "dense_fwd_bwd_ms" in r for r in res["gemm_table"])
    log = (tmp_path / "layer.log").read_text()
    assert "SMOKE" in log and "TARGET" not in log


def test_verdicts_judge_only_the_target_models():
    rows = [{"model": "DeepSeek-V3", "shape": "d", "step_over_gemm_limit": 1.4, "ours_ms": 2.0, "pure_jax_ms": 3.0,
             "pure_jax_over_ours": 1.5},
            {"model": "Mixtral-8x7B", "shape": "m", "step_over_gemm_limit": 3.0, "ours_ms": 2.0, "pure_jax_ms": 1.0,
             "pure_jax_over_ours": 0.5}]
    lines = layer_bench.verdicts(rows)
    assert lines[0].startswith("TARGET PASS d: step / GEMM limit 1.40")
    assert lines[1].startswith("TARGET PASS d: ours")
    assert lines[2].startswith("TARGET FAIL m: ours")    # slower than pure JAX fails at any shape
    assert len(lines) == 3                               # no GEMM-limit verdict for Mixtral


def test_profile_counts_our_kernels_by_name():
    names = layer_bench.our_kernel_names()
    assert {"permute_kernel", "unpermute_kernel", "sort_chunks_kernel"} <= set(names)
    assert "accumulate_rows_kernel" not in names          # only the library's kernels
    from benchmarks import trace_stats
    assert trace_stats.matches("permute_kernel_0d1d2d", names) and not trace_stats.matches("gemm_kernel", names)
