"""make_row_id_map against the independent NumPy reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import te_jax_perm
from tests import numpy_reference as ref
from tests.conftest import routing


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.sampled_from([1, 2, 7, 33, 64]), e=st.integers(1, 16), k=st.integers(1, 4),
       mode=st.sampled_from(["uniform", "hot", "empty", "all_one"]), budget=st.sampled_from([None, 0.5, 1.0, 1.5]),
       block=st.sampled_from([None, 1, 4, 16]), int_map=st.booleans(), single=st.sampled_from([None, True, False]),
       seed=st.integers(0, 2**16))
def test_row_id_map_matches_reference(backend, t, e, k, mode, budget, block, int_map, single, seed):
    rm = routing(np.random.default_rng(seed), t, e, k, mode)
    routed = int(rm.sum())
    n = None if budget is None else int(routed * budget)
    m = rm.astype(np.int32) if int_map else rm
    rid, kept = jax.jit(lambda x: te_jax_perm.make_row_id_map(x, n, block_tokens=block, single_pass=single,
                                                                    backend=backend))(m)
    expected = ref.row_id_map(rm, routed if n is None else n)
    np.testing.assert_array_equal(np.asarray(rid), expected)
    _, exp_kept, _, _ = ref.dispatch_layout(rm, routed if n is None else n, None)
    np.testing.assert_array_equal(np.asarray(kept), exp_kept)
    assert rid.dtype == jnp.int32 and kept.dtype == jnp.int32


@pytest.mark.parametrize("single", [True, False])
def test_row_id_map_large_xla_and_kernel_agree(kernel_backend, single):
    # Many blocks (more than one reduction chunk of the counts at E=37 -> 64: CH=128 rows of
    # blocks with block_tokens=1, so 150 tokens), E not a power of two, a bool map, entries
    # dropped (750 routed, 500 kept).
    rm = routing(np.random.default_rng(1), 150, 37, 5, "hot")
    out = [te_jax_perm.make_row_id_map(rm, 500, block_tokens=1 if b != "xla" else 8, single_pass=single, backend=b)
           for b in ("xla", kernel_backend)]
    np.testing.assert_array_equal(np.asarray(out[0][0]), np.asarray(out[1][0]))
    np.testing.assert_array_equal(np.asarray(out[0][1]), np.asarray(out[1][1]))
    np.testing.assert_array_equal(np.asarray(out[0][0]), ref.row_id_map(rm, 500))


@pytest.mark.parametrize("t,e,launches", [(64, 8, 1), (1024, 8, 1), (8192, 16, 2), (8192, 256, 2), (4096, 128, 2)])
def test_row_id_map_is_only_its_kernels(t, e, launches, kernel_backend):
    """One launch for small T*E (as the measured plan says), two otherwise, and no XLA ops around them (no bool cast,
    no scans or clips for tokens_per_expert): only the preallocations (poisoned on CPU,
    AllocateBuffer custom calls on GPU)."""
    import re
    fn = lambda rm: te_jax_perm.make_row_id_map(rm, t, backend=kernel_backend)
    spec = jax.ShapeDtypeStruct((t, e), jnp.bool_)
    assert len(te_jax_perm.audit_aliases(fn, spec).ours) == launches
    hlo = jax.jit(fn).lower(spec).as_text()
    ops = re.findall(r"= (stablehlo\.[a-z_]+)", hlo[hlo.index("func.func public @main"):])
    assert set(ops) <= {"stablehlo.custom_call", "stablehlo.constant", "stablehlo.broadcast_in_dim",
                        "stablehlo.bitcast_convert"}, ops


@pytest.mark.parametrize("block", [16, 2**20])
def test_a_block_past_the_tokens_is_one_block_of_them_all(block, kernel_backend):
    """block_tokens beyond the tokens launches one block of the tokens rounded up to a
    power of two (the same map; no program walks tokens that do not exist)."""
    from te_jax_perm.core import hooks

    rm = routing(np.random.default_rng(0), 8, 4, 2)
    blocks = []
    with hooks.observe_calls(lambda call: blocks.append(call.params["block_t"])):
        got = jax.jit(lambda r: te_jax_perm.make_row_id_map(r, 12, block_tokens=block, backend=kernel_backend))(rm)
    assert blocks == [8]
    np.testing.assert_array_equal(np.asarray(got[0]), ref.row_id_map(rm, 12))


@pytest.mark.gpu
def test_row_id_map_real_size(kernel_backend):
    rm = routing(np.random.default_rng(2), 4096, 256, 8, "uniform")
    rid, _ = jax.jit(lambda m: te_jax_perm.make_row_id_map(m, backend=kernel_backend))(rm)
    rid_x, _ = jax.jit(lambda m: te_jax_perm.make_row_id_map(m, backend="xla"))(rm)
    np.testing.assert_array_equal(np.asarray(rid), np.asarray(rid_x))


@pytest.mark.parametrize("bad,match", [
    (np.zeros((4,), bool), r"routing_map has shape \(4,\)"),
    (np.zeros((4, 3), np.float32), "routing_map has dtype float32"),
])
def test_row_id_map_errors(bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        te_jax_perm.make_row_id_map(bad)


def test_row_id_map_negative_budget():
    with pytest.raises(ValueError, match="num_out_tokens must be >= 0, got -1"):
        te_jax_perm.make_row_id_map(np.ones((2, 2), bool), -1)


def test_map_plan_is_the_measured_one_and_keeps_block_counts():
    """At a measured (T, E) the plan is the fastest one measured; elsewhere it keeps the
    nearest measured plan's number of blocks (tokens per block a power of two, at most 128)."""
    from te_jax_perm.ops.row_id_map import decl as D
    for (t, e), (single, bt, warps) in D.MAP_PLANS.items():
        assert D.map_plan(t, e) == D.MapPlan(single or -(-t // bt) <= 1, bt, warps)
    for t, e in [(1, 1), (3, 7), (100, 200), (8192, 64), (65536, 384), (10**6, 8)]:
        plan = D.map_plan(t, e)
        assert plan.block_tokens & (plan.block_tokens - 1) == 0 and 1 <= plan.block_tokens <= D.MAX_BLOCK_TOKENS
        assert plan.num_warps in (1, 2, 4, 8)


def test_map_plans_are_the_committed_sweeps_fastest():
    """The plan table restates no guess: each entry is the fastest variant (one launch or two,
    tokens per block, warps) that the committed sweep measured at its (T, E)."""
    import json
    import pathlib
    from te_jax_perm.ops.row_id_map import decl as D
    sweep = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "sweep_rowmap_H100.json"
    best = {}
    for r in json.loads(sweep.read_text())["rows"]:
        key = (r["T"], r["E"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    assert {k: (r["single_pass"], r["block_t"], r["num_warps"]) for k, r in best.items()} == D.MAP_PLANS


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=st.sampled_from([1, 7, 33]), e=st.integers(1, 9), k=st.integers(1, 3),
       mode=st.sampled_from(["uniform", "hot", "empty"]), budget=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
       align=st.sampled_from([1, 2, 4, 16]), block=st.sampled_from([1, 4, 64]), single=st.booleans(),
       extra_rows=st.sampled_from([-3, 0, 5]), seed=st.integers(0, 2**16))
def test_dispatch_map_is_the_padded_map_and_its_row_owners(kernel_backend, t, e, k, mode, budget, align, block,
                                                          single, extra_rows, seed):
    # The dispatch's map build against the three steps it replaces: the plain map, its
    # destinations shifted by the padding, and row_owner of the result; also with fewer
    # output rows than the padded layout needs (owner entries past the buffer are dropped).
    from te_jax_perm.ops.permute import decl as movers
    from te_jax_perm.ops.row_id_map import decl as M, reference as R
    rm = routing(np.random.default_rng(seed), t, e, k, mode)
    n = int(rm.sum() * budget)
    rows = max(0, n + e * (align - 1) + extra_rows)
    kw = dict(backend=kernel_backend, block_t=block, drop_at=n, align=align, num_out_rows=rows)
    if single:
        rid, kept, owner = M.dispatch_map_fused(rm, **kw)
    else:
        (counts,) = M.row_id_map_block_counts(rm, backend=kernel_backend, block_t=block)
        rid, kept, owner = M.dispatch_map_fill(rm, counts, **kw)
    # The expected values each under one jit: eagerly, each of their XLA ops compiles alone.
    plain, want_kept = jax.jit(lambda r: te_jax_perm.make_row_id_map(r, n, backend="xla"))(rm)
    dest, ex = np.asarray(plain)[:, :e], np.asarray(plain)[:, e:2 * e]
    pad = np.asarray(R.pad_offsets_of(np.asarray(want_kept), align, np))
    want = np.asarray(plain).copy()
    want[:, :e] = np.where(dest >= 0, dest + pad[np.clip(ex, 0, e - 1)], dest)
    np.testing.assert_array_equal(np.asarray(rid), want)
    np.testing.assert_array_equal(np.asarray(kept), np.asarray(want_kept))
    (want_owner,) = jax.jit(lambda m: movers.row_owner(m, np.zeros(e, np.int32), backend="xla", num_out_rows=rows,
                                                       padded=False))(want)
    np.testing.assert_array_equal(np.asarray(owner), np.asarray(want_owner))


def test_dispatch_map_rejects_rows_past_int32():
    from te_jax_perm.ops.row_id_map import decl as M
    rm = np.ones((4, 8), bool)
    with pytest.raises(ValueError, match="align_size = 2147483647"):
        M.dispatch_map_fused(rm, backend="xla", block_t=4, drop_at=32, align=2**31 - 1, num_out_rows=32)


def test_a_closed_over_routing_map_is_not_folded_at_compile_time():
    """A NumPy routing map closed over by a jitted function is a constant of the program:
    XLA would build the xla backend's row-id map from it while compiling (a minute at
    4096 x 256 on a CPU). Such a map reaches the ops behind an optimisation barrier, which
    XLA does not fold through; a map passed as an argument gets none."""
    rm = routing(np.random.default_rng(0), 16, 4, 2, "uniform")
    ops = {"make_row_id_map": lambda m: te_jax_perm.make_row_id_map(m, 32, backend="xla")[0],
           "token_dispatch": lambda m: te_jax_perm.token_dispatch(jnp.ones((16, 8)), m, 32, backend="xla")[0]}
    for name, op in ops.items():
        closed = jax.jit(lambda: op(rm)).lower().as_text()
        passed = jax.jit(op).lower(jnp.asarray(rm)).as_text()
        assert "optimization_barrier" in closed, name
        assert "optimization_barrier" not in passed, name
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda: op(rm))()), np.asarray(op(rm)), err_msg=name)
