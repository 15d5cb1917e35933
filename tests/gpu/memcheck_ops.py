"""Small memcheck target: every shipped kernel (forward and backward) on the machine's
kernel backend, checked against the NumPy loop reference on the host - no XLA reference
computation, so what compute-sanitizer sees is our kernels plus a little glue. With
``--hostile``: the hostile-input tests (corrupt maps, non-permutation orders, counts that
disagree with the map, short inputs, overflowing sizes), called here on the kernel backend
with each of their parameter sets, in one plain process.

    compute-sanitizer --tool memcheck python3 -m tests.gpu.memcheck_ops [--hostile]
"""
from __future__ import annotations

import importlib
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import te_jax_perm
from tests import numpy_reference as ref
from tests.conftest import routing
from tests.conftest import KERNEL_BACKEND

CASES = [  # T, H, E, k, align, drop
    (1, 64, 4, 1, None, 0), (33, 96, 16, 4, None, 0), (17, 130, 8, 2, 16, 3),
    (64, 72, 8, 8, 32, 0), (7, 64, 1, 1, None, 2),
]


def check_case(t, h, e, k, align, drop, rng) -> None:
    rm = routing(rng, t, e, k)
    x = rng.standard_normal((t, h)).astype(np.float32)
    probs = (rng.random((t, e)) * rm).astype(np.float32)
    n = max(int(rm.sum()) - drop, 0)
    b = KERNEL_BACKEND

    def layer(x, probs):
        out, pp, rid, pad, tpe = te_jax_perm.token_dispatch(x, rm, n, probs=probs, align_size=align, backend=b)
        sorted_out, smap = te_jax_perm.sort_chunks_by_index(
            out, jnp.array([out.shape[0] // 2, out.shape[0] - out.shape[0] // 2], jnp.int32),
            jnp.array([1, 0], jnp.int32), backend=b)
        back, _ = te_jax_perm.sort_chunks_by_map(sorted_out, smap, is_forward=False, backend=b)
        y = te_jax_perm.token_combine(back * 2.0, rid, merging_probs=probs, pad_offsets=pad, backend=b)
        return y, (out, pp)

    (y, (out, pp)), vjp = jax.vjp(layer, jnp.asarray(x), jnp.asarray(probs))
    gx, gp = vjp((jnp.ones_like(y), (jnp.zeros_like(out), jnp.zeros_like(pp))))
    e_out, e_pp, dest, _, _ = ref.dispatch(x, rm, n, probs, align)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(pp), e_pp)
    np.testing.assert_allclose(np.asarray(y), ref.combine(2.0 * e_out, dest, probs), rtol=1e-5, atol=1e-5)
    g_out, g_w = ref.combine_vjp(np.ones((t, h)), 2.0 * e_out, dest, probs)
    e_gx, _ = ref.dispatch_vjp(2.0 * g_out, None, dest)
    np.testing.assert_allclose(np.asarray(gx), e_gx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gp), g_w, rtol=1e-5, atol=1e-4)


# module, test function: the hostile-input tests.
HOSTILE = [
    ("tests.test_ops_memory_safety", name) for name in (
        "test_chunk_sort_overflowing_traced_sizes_truncate_at_the_input_end",
        "test_combine_of_a_short_input_reads_nothing_past_it", "test_corrupt_row_id_maps_stay_inside_the_buffers",
        "test_chunk_sort_by_a_corrupt_map_stays_inside_the_buffers",
        "test_padded_dispatch_combined_without_pad_offsets_returns_the_right_tokens", "test_zero_experts")
] + [
    ("tests.test_chunk_sort", "test_traced_non_permutation_drops_chunks_on_every_backend"),
    ("tests.test_chunk_sort", "test_non_injective_map_keeps_the_first_row_per_destination"),
    ("tests.test_chunk_sort", "test_zero_rows_give_zero_size_results"),
    ("tests.test_permute", "test_row_owner_kernel_matches_its_reference_on_hostile_maps"),
    ("tests.test_permute", "test_permute_ignores_counts_that_disagree_with_the_map"),
    ("tests.test_permute", "test_duplicate_destinations_have_one_writer_on_every_backend"),
    ("tests.test_permute", "test_gathers_add_every_entry_of_a_hostile_map"),
    ("tests.test_dispatch", "test_zero_tokens_give_zero_size_results"),
    ("tests.test_grouped_gemm_triton", "test_values_and_vjp_match_numpy"),
]


def parameter_sets(fn) -> list[dict]:
    """Every keyword set ``fn``'s ``pytest.mark.parametrize`` marks expand to, with the
    backend fixtures bound to the kernel backend."""
    axes = []
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "parametrize":
            names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else mark.args[0]
            axes.append([dict(zip(names, v if len(names) > 1 else (v,))) for v in mark.args[1]])
    fixtures = {"backend": KERNEL_BACKEND, "kernel_backend": KERNEL_BACKEND}
    wanted = fn.__code__.co_varnames[:fn.__code__.co_argcount]
    return [{**{k: v for k, v in fixtures.items() if k in wanted}, **dict(kv for d in combo for kv in d.items())}
            for combo in itertools.product(*axes)]


def run_hostile() -> int:
    calls = 0
    for module, name in HOSTILE:
        fn = getattr(importlib.import_module(module), name)
        for kw in parameter_sets(fn):
            print("MEMCHECK-HOSTILE CALL", name, kw, flush=True)  # names the call if the process dies
            fn(**kw)
            calls += 1
        print("MEMCHECK-HOSTILE OK", name, flush=True)
    return calls


def main(argv: list[str]) -> int:
    if "--hostile" in argv:
        calls = run_hostile()
        print(f"MEMCHECK-HOSTILE PASS: {calls} calls of {len(HOSTILE)} tests on {KERNEL_BACKEND}", flush=True)
        return 0
    rng = np.random.default_rng(0)
    for case in CASES:
        check_case(*case, rng)
        print("MEMCHECK-CASE OK", case, flush=True)
    print(f"MEMCHECK-OPS PASS: {len(CASES)} cases on {KERNEL_BACKEND}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
