"""CPU smoke of the layer benchmark: it writes a consistent JSON and a PNG, says it is a smoke
run and gives no verdicts; its pure-JAX permutation is the same function as our layer."""
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    assert res["smoke"] is True and res["targets"] == [] and res["copy_GBps"] > 0
    assert (tmp_path / "layer.png").stat().st_size > 10_000
    (row,) = res["layers"]
    assert row["shape"] == "smoke/T37/H16/F32/E4/k3"
    for name in ("ours", "fused"):   # the permutations compute one function
        assert row[f"{name}_vs_pure_jax_max_rel_diff"] < 1e-5, name
        assert row[f"{name}_over_gemm_limit"] == row[f"{name}_ms"] / row["gemm_limit_ms"]
        assert row[f"{name}_over_roofline"] == row[f"{name}_ms"] / row["roofline_ms"]
        assert row[f"pure_jax_over_{name}"] == row["pure_jax_ms"] / row[f"{name}_ms"]
    for key in ("ours_ms", "fused_ms", "pure_jax_ms", "gemm_limit_ms", "roofline_ms"):
        assert row[key] > 0 and row[key.replace("_ms", "_blocking_ms")] > 0, key
    # Peak memory from XLA's buffer assignment: at least the parameters and the input.
    params_bytes = 4 * (16 * 4 + 4 * 16 * 2 * 32 + 4 * 32 * 16) + 4 * 37 * 16
    for name in ("ours", "fused", "pure_jax"):
        assert row[f"{name}_peak_gib"] * 2**30 >= params_bytes, name
    assert len(res["gemm_table"]) == len(layer_bench.CPU_GEMMS)
    assert all("xla_fwd_ms" in r and "dense_fwd_bwd_ms" in r and r["roofline_fwd_ms"] >= r["dense_fwd_ms"]
               for r in res["gemm_table"])
    # Every field of the committed GPU runs' GEMM rows, the grouped GEMM named xla here and
    # triton there (runs whose time budget left the table out have none).
    results = pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
    committed = [t[0] for t in (json.loads(f.read_text()).get("gemm_table") for f in sorted(results.glob("layer_*.json")))
                 if t]
    assert committed
    for row0 in committed:
        for r in res["gemm_table"]:
            assert {k.replace("triton_", "xla_") for k in row0} <= set(r), r
    log = (tmp_path / "layer.log").read_text()
    assert "SMOKE" in log and "TARGET" not in log
    # T*k = 111 rows over 4 experts: no uniform groups, so no batched-dot step.
    assert not any(k.startswith("batched_gemm") for k in row)


def test_batched_gemm_step_is_the_layers_gemms_on_uniform_groups():
    """The batched-dot step: the layer's own weights (no copy), T*k/E rows a group, the same
    GEMM FLOPs as the layer, gradients for rows and both weights; none without uniform groups."""
    from examples import moe_permute as example
    cfg = example.MoEConfig(tokens=16, hidden=8, ffn=4, experts=4, topk=2, dtype="float32")
    params = example.init_params(cfg, jax.random.key(0))
    step, (rows, w_in, w_out) = layer_bench.batched_gemm_step(cfg, params)
    assert rows.shape == (4, 8, 8) and w_in is params["w_in"] and w_out is params["w_out"]
    # Full float32 products: a GPU's default float32 dot rounds its inputs to TF32 (1e-4 apart).
    with jax.default_matmul_precision("float32"):
        loss, (d_rows, d_in, d_out) = step(rows, w_in, w_out)
    assert (d_rows.shape, d_in.shape, d_out.shape) == (rows.shape, w_in.shape, w_out.shape)
    # The forward of group e is rows[e] @ w_in[e] -> SwiGLU -> @ w_out[e].
    h = np.einsum("egh,ehf->egf", np.asarray(rows), np.asarray(w_in))
    y = np.einsum("egf,efh->egh", np.asarray(example.swiglu(jnp.asarray(h))), np.asarray(w_out))
    np.testing.assert_allclose(float(loss), float(np.mean(np.square(y))), rtol=1e-5)
    flops = jax.jit(lambda *a: step(*a)).lower(rows, w_in, w_out).compile().cost_analysis()
    flops = (flops[0] if isinstance(flops, list) else flops)["flops"]
    gemm_flops = layer_bench.layer_gemm_flops(cfg)
    assert gemm_flops <= flops <= 1.2 * gemm_flops, (flops, gemm_flops)   # the GEMMs, and a little SwiGLU
    assert layer_bench.batched_gemm_step(dataclasses.replace(cfg, tokens=15), params) is None
    # In a layer's row (64 tokens, top-2 over 8 experts: 16 rows a group), timed beside the others.
    row = layer_bench.layer_row(layer_bench.CPU_SHAPES[0], "float32", None, "auto", 1, copy_gbps=1.0)
    assert row["batched_gemm_ms"] > 0 and row["batched_gemm_blocking_ms"] > 0
    for limit in ("gemm_limit", "roofline"):
        assert row[f"batched_gemm_over_{limit}"] == row["batched_gemm_ms"] / row[f"{limit}_ms"]
    assert "pure_jax_over_batched_gemm" not in row


def test_layer_bytes_and_roofline():
    """Six GEMMs, each operand read once and each result written once, weights included;
    the roofline is the slower of the FLOP time and those bytes at the copy bandwidth."""
    from examples import moe_permute as example
    cfg = example.MoEConfig(tokens=4, hidden=3, ffn=5, experts=7, topk=2, dtype="bfloat16")
    m, h, f, e = 8, 3, 5, 7
    w_in, w_out = e * h * 2 * f, e * f * h
    want = 2 * ((m * h + w_in + m * 2 * f) + (m * f + w_out + m * h) + (m * h + w_out + m * f)
                + (m * 2 * f + w_in + m * h) + (m * f + m * h + w_out) + (m * h + m * 2 * f + w_in))
    assert layer_bench.layer_gemm_bytes(cfg) == want
    # The permutation: dispatch T -> N rows, combine N -> T, both backwards, and the combine
    # backward's read of the N forward rows (N = T*k = 8 rows of 3 bf16 values).
    assert layer_bench.permutation_bytes(cfg) == 2 * 3 * ((4 + 8) + (8 + 4) + (8 + 4) + (4 + 8 + 8))
    assert layer_bench.roofline_ms(2.0, 3e9, 1000.0) == 3.0     # 3 GB at 1000 GB/s: bytes bound
    assert layer_bench.roofline_ms(5.0, 3e9, 1000.0) == 5.0     # FLOP bound


def test_verdicts_hold_each_model_to_its_limit():
    rows = [{"model": "DeepSeek-V3", "shape": "d", "ours_ms": 2.6, "roofline_ms": 2.0, "gemm_limit_ms": 1.0,
             "ours_over_roofline": 1.3, "ours_over_gemm_limit": 2.6, "pure_jax_ms": 2.86, "pure_jax_over_ours": 1.1,
             "fused_error": "RESOURCE_EXHAUSTED: out of memory"},
            {"model": "Mixtral-8x7B", "shape": "m", "ours_ms": 2.0, "gemm_limit_ms": 1.5, "roofline_ms": 1.5,
             "ours_over_gemm_limit": 1.33, "ours_over_roofline": 1.33, "pure_jax_ms": 2.1, "pure_jax_over_ours": 1.05,
             "fused_ms": 1.8, "fused_over_gemm_limit": 1.2, "fused_over_roofline": 1.2, "pure_jax_over_fused": 1.17}]
    lines = layer_bench.verdicts(rows)
    assert lines == [
        "TARGET PASS d ours: step / roofline 1.30 (2.60 / 2.00 ms; target <= 1.3)",
        "TARGET PASS d ours: 2.60 ms vs pure-JAX permutation 2.86 ms (1.10x; target >= 1.1)",
        "TARGET FAIL d fused: did not run (RESOURCE_EXHAUSTED: out of memory)",
        "TARGET FAIL m ours: step / gemm limit 1.33 (2.00 / 1.50 ms; target <= 1.25)",
        "TARGET FAIL m ours: 2.00 ms vs pure-JAX permutation 2.10 ms (1.05x; target >= 1.1)",
        "TARGET PASS m fused: step / gemm limit 1.20 (1.80 / 1.50 ms; target <= 1.25)",
        "TARGET PASS m fused: 1.80 ms vs pure-JAX permutation 2.10 ms (1.17x; target >= 1.1)"]
    # With a profile, the line says how far a free permutation would get with the same GEMM.
    rows[1].update(ours_profile={"permutation_ms_per_step": 0.25}, pure_jax_over_ours_free_permutation=2.1 / 1.75)
    assert layer_bench.verdicts(rows)[4] == (
        "TARGET FAIL m ours: 2.00 ms vs pure-JAX permutation 2.10 ms (1.05x; 1.20x were te_jax_perm's permutation "
        "kernels (0.25 ms of kernel time) to take none; target >= 1.1)")
    # Where even the best variant's free permutation stays below the target, the miss is
    # out of reach: the pure-JAX step shares everything but the permutation.
    reach = [dict(rows[1], pure_jax_over_ours_free_permutation=1.08, fused_profile={"permutation_ms_per_step": 0.3},
                  fused_ms=2.1, pure_jax_over_fused=1.0, pure_jax_over_fused_free_permutation=f) for f in (1.05, 1.12)]
    out = [layer_bench.verdicts([r])[1::2] for r in reach]
    assert out[0][0] == (
        "TARGET OUT OF REACH m ours: 2.00 ms vs pure-JAX permutation 2.10 ms (1.05x; 1.08x were te_jax_perm's "
        "permutation kernels (0.25 ms of kernel time) to take none; target >= 1.1)")
    assert out[0][1] == (
        "TARGET OUT OF REACH m fused: 2.10 ms vs pure-JAX permutation 2.10 ms (1.00x; 1.05x were te_jax_perm's "
        "permutation kernels (0.30 ms of kernel time) to take none; at most 1.08x with any variant's permutation "
        "free; target >= 1.1)")
    assert out[1][0].startswith("TARGET FAIL m ours")   # the fused layer's bound, 1.12x, is above the target
    # The bounds from a row: 2.0 ms a step of which 0.25 in the permutation; 3e8 bytes at
    # 3000 GB/s are 0.1 ms; the fused layer gets no floor (its permutation moves other bytes).
    row = {"ours_ms": 2.0, "fused_ms": 2.0, "pure_jax_ms": 2.1, "permutation_bytes_per_step": 3e8,
           "ours_profile": {"permutation_ms_per_step": 0.25}, "fused_profile": {"permutation_ms_per_step": 0.25}}
    got = layer_bench.permutation_bounds(row, "ours", 3000.0)
    assert got.keys() == {"pure_jax_over_ours_free_permutation", "permutation_floor_ms",
                          "pure_jax_over_ours_permutation_at_floor"}
    assert np.isclose(got["pure_jax_over_ours_free_permutation"], 2.1 / 1.75)
    assert np.isclose(got["permutation_floor_ms"], 0.1)
    assert np.isclose(got["pure_jax_over_ours_permutation_at_floor"], 2.1 / 1.85)
    assert layer_bench.permutation_bounds(row, "fused", 3000.0).keys() == {"pure_jax_over_fused_free_permutation"}
    assert layer_bench.permutation_bounds({**row, "ours_profile": {}}, "ours", 3000.0) == {}
    # And how far one at the copy's rate would: the permutation's least bytes over it.
    rows[1].update(permutation_bytes_per_step=3e8, permutation_floor_ms=0.1,
                   pure_jax_over_ours_permutation_at_floor=2.1 / 1.85)
    assert layer_bench.verdicts(rows)[4] == (
        "TARGET FAIL m ours: 2.00 ms vs pure-JAX permutation 2.10 ms (1.05x; 1.20x were te_jax_perm's permutation "
        "kernels (0.25 ms of kernel time) to take none, 1.14x were they to move their 0.30 GB at the copy's rate "
        "(0.10 ms); target >= 1.1)")
    # Beside the back-to-back steps, the same ratio over calls each waited for.
    rows[1].update(ours_blocking_ms=2.5, gemm_limit_blocking_ms=2.0, pure_jax_blocking_ms=2.6)
    lines = layer_bench.verdicts(rows)
    assert lines[3] == ("TARGET FAIL m ours: step / gemm limit 1.33 (2.00 / 1.50 ms; target <= 1.25); "
                        "calls waited for: 2.50 / 2.00 ms = 1.25")
    assert lines[4].endswith("; target >= 1.1); calls waited for: 2.60 / 2.50 ms = 1.04")
    # Beside the step's limit, what XLA's batched dot takes for the GEMMs alone.
    rows[1]["batched_gemm_ms"] = 1.65
    assert layer_bench.verdicts(rows)[3].endswith(
        f"calls waited for: 2.50 / 2.00 ms = 1.25; {layer_bench.BATCHED_LABEL}: 1.65 / 1.50 ms = 1.10")
    # With both steps profiled, the ratio of their kernel times too (one clock, no host).
    rows[1]["ours_profile"]["kernel_ms_per_step"] = 1.6
    rows[1]["pure_jax_profile"] = {"kernel_ms_per_step": 1.76}
    assert layer_bench.verdicts(rows)[4].endswith("calls waited for: 2.60 / 2.50 ms = 1.04; "
                                                  "kernel time: 1.76 / 1.60 ms = 1.10")


def test_gemm_verdicts_against_dense_speed_and_roofline():
    rows = [{"M": 8, "K": 4, "N": 4, "G": 8, "triton_fwd_ms": 1.0, "dense_fwd_ms": 0.9,
             "triton_fwd_bwd_ms": 3.0, "dense_fwd_bwd_ms": 2.4},
            {"M": 8, "K": 4, "N": 4, "G": 256, "triton_fwd_ms": 1.3, "dense_fwd_ms": 0.5, "roofline_fwd_ms": 1.0}]
    assert layer_bench.gemm_verdicts(rows) == [
        "TARGET PASS grouped GEMM M=8 K=4 N=4 G=8 fwd: 0.90x the dense speed (1.000 vs 0.900 ms; target >= 0.9)",
        "TARGET FAIL grouped GEMM M=8 K=4 N=4 G=8 fwd_bwd: 0.80x the dense speed (3.000 vs 2.400 ms; target >= 0.85)",
        "TARGET FAIL grouped GEMM M=8 K=4 N=4 G=256 fwd: 1.300 ms / roofline 1.000 ms = 1.30 (target <= 1.2)"]
    # With kernel times on both sides, those decide, and the wall times are quoted beside.
    rows[0].update(triton_fwd_kernel_ms=0.95, dense_fwd_kernel_ms=0.9)
    rows[1].update(triton_fwd_kernel_ms=1.1, roofline_fwd_kernel_ms=1.0)
    lines = layer_bench.gemm_verdicts(rows)
    assert lines[0] == ("TARGET PASS grouped GEMM M=8 K=4 N=4 G=8 fwd: 0.95x the dense speed (0.950 vs 0.900 ms in "
                        "kernel time; wall 1.000 vs 0.900 ms; target >= 0.9)")
    assert lines[1].startswith("TARGET FAIL grouped GEMM M=8 K=4 N=4 G=8 fwd_bwd: 0.80x")  # wall times only
    assert lines[2] == ("TARGET PASS grouped GEMM M=8 K=4 N=4 G=256 fwd: 1.100 ms / roofline 1.000 ms = 1.10 in "
                        "kernel time; wall 1.300 vs 1.000 ms (target <= 1.2)")
    # With the same size measured as one group, each G > 1 line quotes that speed beside.
    rows.append({"M": 8, "K": 4, "N": 4, "G": 1, "triton_fwd_ms": 0.98, "dense_fwd_ms": 0.9,
                 "triton_fwd_kernel_ms": 0.93, "dense_fwd_kernel_ms": 0.88})
    lines = layer_bench.gemm_verdicts(rows)
    assert lines[0] == ("TARGET PASS grouped GEMM M=8 K=4 N=4 G=8 fwd: 0.95x the dense speed (0.950 vs 0.900 ms in "
                        "kernel time; wall 1.000 vs 0.900 ms; on one group 0.95x; target >= 0.9)")
    assert "one group" not in lines[1]       # no fwd_bwd time of the one group
    assert lines[3].startswith("TARGET PASS grouped GEMM M=8 K=4 N=4 G=1 fwd: 0.95x") and "one group" not in lines[3]


def test_profile_counts_our_kernels_by_name():
    names = layer_bench.our_kernel_names()
    assert {"permute_kernel", "unpermute_kernel", "sort_chunks_kernel"} <= set(names)
    assert "accumulate_rows_kernel" not in names          # only the library's kernels
    from benchmarks import trace_stats
    assert trace_stats.matches("permute_kernel_0d1d2d", names) and not trace_stats.matches("gemm_kernel", names)
    # Split in two: the expert GEMMs' kernels and the permutation's.
    gemm, permutation = layer_bench.our_kernel_names(gemm=True), layer_bench.our_kernel_names(gemm=False)
    assert sorted(gemm + permutation) == names and not set(gemm) & set(permutation)
    assert {"grouped_gemm_kernel", "grouped_gemm_wgrad_kernel", "moe_gather_gemm_kernel"} <= set(gemm)
    assert {"permute_kernel", "unpermute_kernel", "sort_chunks_kernel"} <= set(permutation)


@pytest.mark.gpu
def test_gpu_copy_bandwidth_in_kernel_time_is_not_below_wall_time():
    """The roofline's copy speed comes from the profiler's kernel time, which leaves out the
    launch and the host's wait that a wall time holds: never slower than the wall-time copy,
    and within the device's reach (below 10 TB/s read + write)."""
    kernel = layer_bench.copy_bandwidth_gbps(5, 1 << 30, kernel_time=True)
    wall = layer_bench.copy_bandwidth_gbps(5, 1 << 30, kernel_time=False)
    assert 0.97 * wall <= kernel < 10_000, (kernel, wall)


def test_profiles_are_taken_in_turns_and_the_median_round_reported(monkeypatch):
    """Every variant is profiled once a round, in turns, the order reversed every other
    round, so none is always profiled first or while the GPU runs hotter; the round of median
    kernel time after the first is reported; a variant that fails is not retried."""
    order, times = [], {"ours": [10.0, 14.0, 12.0, 13.0], "fused": [11.0, 9.0, 15.0, 16.0]}

    def fake_share(step, args):
        name = step()
        order.append(name)
        if name == "broken":
            raise RuntimeError("no GPU kernel events")
        ms = times[name][sum(n == name for n in order) - 1]
        return {"kernel_ms_per_step": ms, "kernels_per_step": 30.0, "top_kernels_ms_per_step": {"k": ms}}

    monkeypatch.setattr(layer_bench, "kernel_share", fake_share)
    out = layer_bench.profiles_in_turns({n: (lambda n=n: n) for n in ("ours", "fused", "broken")}, ())
    assert order == ["ours", "fused", "broken", "fused", "ours", "ours", "fused", "fused", "ours"]
    # Rounds 2-4: ours 14, 12, 13 -> 13; fused 9, 15, 16 -> 15 (the first round is left out).
    assert out["ours_profile"]["kernel_ms_per_step"] == 13.0 and out["fused_profile"]["kernel_ms_per_step"] == 15.0
    assert out["ours_profile"]["kernel_ms_per_step_rounds"] == [10.0, 14.0, 12.0, 13.0]
    assert out["fused_profile"]["top_kernels_ms_per_step"] == {"k": 15.0}
    assert out["broken_profile"] == {"error": "RuntimeError: no GPU kernel events"}
