"""token_dispatch / token_combine against the independent NumPy reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from jax.test_util import check_grads

import te_jax_perm
from te_jax_perm.workloads import top_k_map
from tests import numpy_reference as ref
from tests.conftest import routing

FIXTURE_OK = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _case(seed, t, h, e, k, mode, budget, with_probs):
    rng = np.random.default_rng(seed)
    rm = routing(rng, t, e, k, mode)
    n = max(0, int(round(rm.sum() * budget)))
    x = rng.standard_normal((t, h)).astype(np.float32)
    probs = rng.random((t, e)).astype(np.float32) if with_probs else None
    return rm, n, x, probs


def _run(backend, rm, n, x, probs, align, w=None):
    def f(x, probs, w):
        out, pp, rid, pad, tpe = te_jax_perm.token_dispatch(x, rm, n, probs=probs, align_size=align, backend=backend)
        back = te_jax_perm.token_combine(out, rid, w, pad, backend=backend)
        return out, pp, rid, pad, tpe, back
    return jax.jit(f)(x, probs, w)


@settings(max_examples=10, **FIXTURE_OK)
@given(t=st.sampled_from([1, 3, 17, 64]), h=st.sampled_from([64, 71, 96]), e=st.integers(1, 16),
       k=st.integers(1, 4), mode=st.sampled_from(["uniform", "hot", "empty", "all_one"]),
       budget=st.sampled_from([1.0, 0.6, 1.3]), align=st.sampled_from([None, 1, 4, 16]),
       with_probs=st.booleans(), weighted=st.booleans(), seed=st.integers(0, 2**16))
def test_dispatch_combine_forward(backend, t, h, e, k, mode, budget, align, with_probs, weighted, seed):
    rm, n, x, probs = _case(seed, t, h, e, k, mode, budget, with_probs)
    w = np.random.default_rng(seed + 1).random((t, e)).astype(np.float32) if weighted else None
    out, pp, rid, pad, tpe, back = _run(backend, rm, n, x, probs, align, w)
    e_out, e_pp, dest, e_pad, e_tpe = ref.dispatch(x, rm, n, probs, align)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(tpe), e_tpe)
    # The map addresses rows of this output, padding included (combine needs nothing else).
    np.testing.assert_array_equal(np.asarray(rid), ref.row_id_map(rm, n, e_pad))
    if with_probs:
        np.testing.assert_array_equal(np.asarray(pp), e_pp)
    else:
        assert pp is None
    if align is None:
        assert pad is None
    else:
        np.testing.assert_array_equal(np.asarray(pad), e_pad)
    np.testing.assert_allclose(np.asarray(back), ref.combine(e_out, dest, w), rtol=1e-5, atol=1e-5)


@settings(max_examples=8, **FIXTURE_OK)
@given(t=st.sampled_from([1, 5, 32]), h=st.sampled_from([64, 67]), e=st.integers(1, 8), k=st.integers(1, 4),
       mode=st.sampled_from(["uniform", "hot", "empty"]), budget=st.sampled_from([1.0, 0.5, 1.25]),
       align=st.sampled_from([None, 4]), seed=st.integers(0, 2**16))
def test_dispatch_and_combine_gradients_match_reference_vjp(backend, t, h, e, k, mode, budget, align, seed):
    rm, n, x, probs = _case(seed, t, h, e, k, mode, budget, True)
    rng = np.random.default_rng(seed + 7)
    _, _, dest, _, _ = ref.dispatch(x, rm, n, probs, align)
    rows = n if align is None else (n + e * (align - 1)) // align * align
    g_out = rng.standard_normal((rows, h)).astype(np.float32)
    g_pp = rng.standard_normal(rows).astype(np.float32)

    def disp(x, p):
        out, pp, *_ = te_jax_perm.token_dispatch(x, rm, n, probs=p, align_size=align, backend=backend)
        return out, pp
    # Each VJP one compiled program (forward and backward), not the forward op by op.
    pullback = lambda f: jax.jit(lambda args, ct: jax.vjp(f, *args)[1](ct))  # noqa: E731
    gx, gp = pullback(disp)((x, probs), (g_out, g_pp))
    e_gx, e_gp = ref.dispatch_vjp(g_out, g_pp, dest)
    np.testing.assert_allclose(np.asarray(gx), e_gx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gp), e_gp, rtol=1e-6, atol=0)

    # combine: gradient w.r.t. expert rows (padded/unused rows get none) and merging probs
    # The map under one jit: eagerly, each of its XLA ops would compile on its own.
    rid, pad = jax.jit(lambda x: te_jax_perm.token_dispatch(x, rm, n, align_size=align, backend="xla")[2:4])(x)
    y = rng.standard_normal((rows, h)).astype(np.float32)
    w = rng.random((t, e)).astype(np.float32)
    g = rng.standard_normal((t, h)).astype(np.float32)
    gy, gw = pullback(lambda y, w: te_jax_perm.token_combine(y, rid, w, pad, backend=backend))((y, w), g)
    e_gy, e_gw = ref.combine_vjp(g, y, dest, w)
    np.testing.assert_allclose(np.asarray(gy), e_gy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(gw), e_gw, rtol=1e-4, atol=1e-4)
    (gy,) = pullback(lambda y: te_jax_perm.token_combine(y, rid, None, pad, backend=backend))((y,), g)
    np.testing.assert_allclose(np.asarray(gy), ref.combine_vjp(g, y, dest)[0], rtol=1e-6, atol=1e-6)


def test_check_grads_numerically(backend):
    rm, n, x, probs = _case(3, 6, 64, 4, 2, "hot", 0.75, True)
    w = np.random.default_rng(4).random((6, 4)).astype(np.float32)

    def f(x, p, w):
        out, pp, rid, pad, _ = te_jax_perm.token_dispatch(x, rm, n, probs=p, align_size=4, backend=backend)
        return te_jax_perm.token_combine(out * pp[:, None], rid, w, pad, backend=backend)
    check_grads(jax.jit(f), (x, probs, w), order=1, modes=("rev",), atol=2e-2, rtol=2e-2, eps=1e-2)


def test_second_order_gradients_are_refused_by_name(backend):
    """The gradients are first-order custom VJPs: differentiating one again raises an error
    naming the op, not JAX's about a primitive or custom_partitioning having no rule."""
    rm, n, x, probs = _case(3, 6, 16, 4, 2, "uniform", 1.0, True)
    out, _, rid, _, _ = te_jax_perm.token_dispatch(x, rm, n, backend=backend)
    combine_grad = jax.grad(lambda y: jnp.sum(te_jax_perm.token_combine(y, rid, backend=backend) ** 2))
    assert combine_grad(out).shape == out.shape
    with pytest.raises(NotImplementedError, match=r"token_combine: the te_jax_perm ops have first-order gradients"):
        jax.grad(lambda y: jnp.sum(combine_grad(y) ** 2))(out)
    dispatch_grad = jax.grad(lambda v: jnp.sum(te_jax_perm.token_dispatch(v, rm, n, backend=backend)[0] ** 2))
    with pytest.raises(NotImplementedError, match=r"token_dispatch: the te_jax_perm ops have first-order gradients"):
        jax.hessian(lambda v: jnp.sum(dispatch_grad(v)))(jnp.asarray(x))


def _second_order_cases(backend):
    """``(op name, f, x)``: each op as a scalar function of one float input."""
    rng = np.random.default_rng(2)
    z = jnp.asarray(rng.standard_normal((10, 4)), jnp.float32)
    p10 = jnp.asarray(rng.random(10), jnp.float32)
    rm = top_k_map(rng.standard_normal((6, 4)), 2)
    rid, tpe = te_jax_perm.make_row_id_map(rm, 12)[:2]
    x6 = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)
    y12 = jnp.asarray(rng.standard_normal((12, 4)), jnp.float32)
    _, chunk_map = te_jax_perm.sort_chunks_by_index(z, [5, 5], [1, 0], backend=backend)
    sq = lambda v: jnp.sum(v ** 2)  # noqa: E731
    cases = [
        ("sort_chunks_by_index", lambda v: sq(te_jax_perm.sort_chunks_by_index(v, [5, 5], [1, 0], backend=backend)[0]), z),
        ("sort_chunks_by_index_with_probs", lambda v: sq(te_jax_perm.sort_chunks_by_index_with_probs(
            z, [5, 5], [1, 0], v, backend=backend)[1]), p10),
        ("sort_chunks_by_map", lambda v: sq(te_jax_perm.sort_chunks_by_map(v, chunk_map, backend=backend)[0]), z),
        ("permute_with_mask_map", lambda v: sq(te_jax_perm.permute_with_mask_map(v, rid, tpe, 12, backend=backend)[0]),
         x6),
        ("unpermute_with_mask_map", lambda v: sq(te_jax_perm.unpermute_with_mask_map(v, rid, backend=backend)), y12),
    ]
    if backend != "xla":  # the xla backend's grouped GEMM is XLA's ragged dot, which takes grad of grad
        w = jnp.asarray(rng.standard_normal((2, 4, 3)), jnp.float32)
        cases.append(("grouped_matmul", lambda v: sq(te_jax_perm.grouped_matmul(v, w, jnp.asarray([4, 5]),
                                                                                backend=backend)), z))
    return cases


def test_every_op_refuses_a_second_differentiation_by_name(backend):
    """Differentiating any op's gradient again raises naming the op: through its forward
    rule (grad of grad), and through its backward rule alone (the VJP of a VJP, taken in
    the cotangent). The ops move rows as bit views, so a second derivative that went through
    would come out zero, silently."""
    for name, f, v in _second_order_cases(backend):
        assert jnp.all(jnp.isfinite(jax.grad(f)(v))), name  # first order works
        with pytest.raises(NotImplementedError, match=f"^{name}: the te_jax_perm ops have first-order gradients"):
            jax.grad(lambda u: jnp.sum(jax.grad(f)(u)))(v)
        _, vjp = jax.vjp(f, v)
        with pytest.raises(NotImplementedError, match=f"^{name}: "):
            jax.grad(lambda c: jnp.sum(vjp(c)[0]))(jnp.float32(1.0))
    if backend == "xla":  # XLA's ragged dot takes grad of grad: sum(2 * a @ W_g^T W_g) in a
        a, w = jnp.ones((6, 3)), jnp.full((2, 3, 2), 0.5)
        f = lambda v: jnp.sum(te_jax_perm.grouped_matmul(v, w, jnp.asarray([3, 3]), backend="xla") ** 2)  # noqa: E731
        np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(jax.grad(f)(v)))(a), np.full((6, 3), 3.0))


@pytest.mark.parametrize("t,e,k,mode", [(1, 1, 1, "uniform"), (1, 4, 4, "uniform"), (9, 1, 1, "uniform"),
                                        (12, 5, 5, "uniform"), (10, 6, 1, "all_one"), (10, 8, 2, "empty")])
@pytest.mark.parametrize("align", [None, 8])
def test_edge_cases(backend, t, e, k, mode, align):
    rm, n, x, probs = _case(11, t, 65, e, k, mode, 1.0, True)
    out, pp, rid, pad, tpe, back = _run(backend, rm, n, x, probs, align)
    e_out, e_pp, dest, _, e_tpe = ref.dispatch(x, rm, n, probs, align)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(pp), e_pp)
    np.testing.assert_array_equal(np.asarray(tpe), e_tpe)
    np.testing.assert_allclose(np.asarray(back), x * rm.sum(1, keepdims=True), rtol=1e-6)


@pytest.mark.parametrize("align", [None, 4])
def test_zero_tokens_give_zero_size_results(backend, align):
    """T=0: empty outputs (padded ones all zero rows), gradients of shape [0, H]."""
    x, rm, w = np.zeros((0, 8), np.float32), np.zeros((0, 3), bool), np.zeros((0, 3), np.float32)
    out, pp, rid, pad, tpe, back = _run(backend, rm, 0, x, w, align, w)
    rows = 0 if align is None else 8
    assert out.shape == (rows, 8) and pp.shape == (rows,) and rid.shape == (0, 7) and back.shape == (0, 8)
    np.testing.assert_array_equal(np.asarray(out), np.zeros((rows, 8)))
    np.testing.assert_array_equal(np.asarray(tpe), np.zeros(3))

    def loss(x, w):
        out, _, rid, pad, _ = te_jax_perm.token_dispatch(x, rm, 0, probs=w, align_size=align, backend=backend)
        return te_jax_perm.token_combine(out, rid, w, pad, backend=backend).sum()
    gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert gx.shape == (0, 8) and gw.shape == (0, 3)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn], ids=lambda d: jnp.dtype(d).name)
def test_token_dtypes_copied_bit_exactly(backend, dtype):
    rm, n, x, _ = _case(5, 19, 72, 6, 2, "uniform", 0.8, False)
    xd = jnp.asarray(x, dtype)
    out, _, rid, pad, _ = jax.jit(lambda x: te_jax_perm.token_dispatch(x, rm, n, align_size=4, backend=backend))(xd)
    e_out, _, dest, _, _ = ref.dispatch(np.asarray(xd), rm, n, None, 4)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), e_out.view(np.uint8))
    if dtype != jnp.float8_e4m3fn:  # combine does math; fp8 is for copies only
        back = te_jax_perm.token_combine(out, rid, None, pad, backend=backend)
        assert back.dtype == dtype
        np.testing.assert_allclose(np.asarray(back, np.float32), ref.combine(e_out.astype(np.float32), dest),
                                   rtol=1e-2, atol=1e-2)

def test_fp8_tokens_dispatch_with_their_block_scales(backend):
    # FP8 training dispatches quantised rows with one float32 scale per block of columns; the
    # scales ride the same row-id map, so every expert row meets its own token's scales.
    rm, n, x, _ = _case(9, 23, 96, 6, 3, "uniform", 0.9, False)
    block = 32
    blocks = x.reshape(23, 96 // block, block)
    scales = (np.abs(blocks).max(axis=-1) / 448.0 + 1e-12).astype(np.float32)      # [T, H/block]
    q = jnp.asarray(blocks / scales[..., None], jnp.float8_e4m3fn).reshape(23, 96)

    @jax.jit
    def dispatch(q, scales):
        out, _, rid, pad, tpe = te_jax_perm.token_dispatch(q, rm, n, align_size=16, backend=backend)
        by_dispatch = te_jax_perm.token_dispatch(scales, rm, n, align_size=16, backend=backend)[0]
        # The dispatch's map addresses the padded rows already: no pad_offsets.
        by_map, _ = te_jax_perm.permute_with_mask_map(scales, rid, tpe, out.shape[0], backend=backend)
        return out, by_dispatch, by_map

    out, by_dispatch, by_map = dispatch(q, jnp.asarray(scales))
    x_deq = (np.asarray(q, np.float32).reshape(23, 96 // block, block) * scales[..., None]).reshape(23, 96)
    e_out, _, _, _, _ = ref.dispatch(x_deq, rm, n, None, 16)
    assert np.any(e_out == 0) and np.any(e_out != 0)      # padding rows and real rows both present
    for s_out in (by_dispatch, by_map):
        assert s_out.shape == (out.shape[0], 96 // block) and s_out.dtype == jnp.float32
        deq = np.asarray(out, np.float32).reshape(-1, 96 // block, block) * np.asarray(s_out)[..., None]
        np.testing.assert_array_equal(deq.reshape(-1, 96), e_out)



def test_batched_input_shape(backend):
    rng = np.random.default_rng(0)
    rm = routing(rng, 10, 4, 2, "uniform").reshape(2, 5, 4)
    x = rng.standard_normal((2, 5, 64)).astype(np.float32)
    p = rng.random((2, 5, 4)).astype(np.float32)
    out, pp, rid, pad, _ = te_jax_perm.token_dispatch(x, rm, 20, probs=p, backend=backend)
    e_out, e_pp, _, _, _ = ref.dispatch(x.reshape(10, 64), rm.reshape(10, 4), 20, p.reshape(10, 4))
    np.testing.assert_array_equal(np.asarray(out), e_out)
    back = te_jax_perm.token_combine(out, rid, p, backend=backend)
    assert back.shape == (10, 64)
    np.testing.assert_allclose(np.asarray(back), x.reshape(10, 64) * (p * rm).sum(-1).reshape(10, 1), rtol=1e-5)


def test_vmap_equals_python_loop(backend):
    rng = np.random.default_rng(2)
    rms = np.stack([routing(rng, 8, 4, 2, m) for m in ("uniform", "hot", "all_one")])
    xs = rng.standard_normal((3, 8, 64)).astype(np.float32)
    ps = rng.random((3, 8, 4)).astype(np.float32)

    def f(x, m, p):
        out, pp, rid, pad, tpe = te_jax_perm.token_dispatch(x, m, 14, probs=p, align_size=2, backend=backend)
        return out, pp, rid, pad, tpe, te_jax_perm.token_combine(out, rid, p, pad, backend=backend)
    grad = jax.grad(lambda x, m, p: (f(x, m, p)[-1] ** 2).sum(), argnums=(0, 2))
    batched = jax.jit(jax.vmap(f))(xs, rms, ps)
    g = jax.jit(jax.vmap(grad))(xs, rms, ps)
    one, one_grad = jax.jit(f), jax.jit(grad)   # the loop's three calls share each compile
    for i in range(3):
        for b, l in zip(batched, one(xs[i], rms[i], ps[i])):
            np.testing.assert_array_equal(np.asarray(b[i]), np.asarray(l))
        gl = one_grad(xs[i], rms[i], ps[i])
        np.testing.assert_allclose(np.asarray(g[0][i]), np.asarray(gl[0]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(g[1][i]), np.asarray(gl[1]), rtol=1e-6)


def test_alias_audit_every_kernel_forward_and_backward(kernel_backend):
    rm, n, x, probs = _case(1, 9, 64, 4, 2, "uniform", 0.9, True)
    w = np.random.default_rng(1).random((9, 4)).astype(np.float32)

    def loss(x, p, w):
        out, pp, rid, pad, _ = te_jax_perm.token_dispatch(x, rm, n, probs=p, align_size=4, backend=kernel_backend)
        a = te_jax_perm.token_combine(out * pp[:, None], rid, w, pad, backend=kernel_backend)
        b = te_jax_perm.token_combine(out, rid, None, pad, backend=kernel_backend)
        return (a * b).sum()

    audit = te_jax_perm.audit_aliases(jax.grad(loss, argnums=(0, 1, 2)), x, probs, w)
    names = {c.kernel for c in audit.ours}
    assert audit.ok, str(audit)
    assert {"dispatch_map_fused", "permute_probs",
            "unpermute_owner", "unpermute_weighted_owner", "permute_bwd_probs", "unpermute_bwd_weighted",
            "permute"} <= names, names
    # Every row owner table comes from a kernel that walks the map anyway (the dispatch's
    # map builder, the combine forwards): none needs a launch of its own.
    assert "row_owner" not in names, names
    for c in audit.ours:
        assert len(c.aliases) == len(c.result_types) >= 1


def test_errors_name_argument_and_shapes():
    x = np.zeros((4, 64), np.float32)
    rm = np.zeros((4, 3), bool)
    with pytest.raises(ValueError, match=r"routing_map has shape \(5, 3\); expected 4 tokens like inp \(4, 64\)"):
        te_jax_perm.token_dispatch(x, np.zeros((5, 3), bool), 4)
    # [B, S] of the map and the tokens must agree, not just B*S.
    with pytest.raises(ValueError, match=r"routing_map has shape \(1, 4, 3\); expected 4 tokens like inp "
                                        r"\(2, 2, 64\) \(i.e. \(2, 2, 'E'\)\)"):
        te_jax_perm.token_dispatch(x.reshape(2, 2, 64), rm.reshape(1, 4, 3), 4)
    with pytest.raises(TypeError, match="inp has dtype int32"):
        te_jax_perm.token_dispatch(x.astype(np.int32), rm, 4)
    with pytest.raises(TypeError, match=r"routing_map has dtype float32; expected bool or an integer dtype "
                                        r"holding 0/1 \(a 0/1 float map: pass routing_map.astype\(bool\); "
                                        r"probabilities: probs > 0\)"):
        te_jax_perm.token_dispatch(x, rm.astype(np.float32), 4)
    with pytest.raises(ValueError, match="num_out_tokens must be >= 0, got -2"):
        te_jax_perm.token_dispatch(x, rm, -2)
    with pytest.raises(ValueError, match="align_size must be >= 1, got 0"):
        te_jax_perm.token_dispatch(x, rm, 4, align_size=0)
    with pytest.raises(ValueError, match=r"probs has shape \(4, 2\); expected \(4, 3\)"):
        te_jax_perm.token_dispatch(x, rm, 4, probs=np.zeros((4, 2), np.float32))
    with pytest.raises(TypeError, match="probs has dtype int32; expected bfloat16, float16 or float32"):
        te_jax_perm.token_dispatch(x, rm, 4, probs=np.zeros((4, 3), np.int32))
    rid = np.zeros((4, 7), np.int32)
    with pytest.raises(ValueError, match=r"merging_probs has shape \(4, 2\); expected \[T=4, E=3\]"):
        te_jax_perm.token_combine(x, rid, np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match=r"row_id_map has shape \(4, 6\); expected \[T, 2\*E\+1\]"):
        te_jax_perm.token_combine(x, np.zeros((4, 6), np.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("t,h,e,k", [(4096, 7168, 256, 8), (8192, 2880, 128, 4)])
def test_real_size_matches_xla(kernel_backend, t, h, e, k):
    rng = np.random.default_rng(0)
    rm = top_k_map(rng.standard_normal((t, e)), k)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    p = jnp.asarray(rng.random((t, e)), jnp.float32)
    # The routing map an argument, as a router's output is in a training step.
    res = [jax.jit(lambda x, rm, p: te_jax_perm.token_dispatch(x, rm, t * k, probs=p, align_size=16, backend=b))(
               x, jnp.asarray(rm), p) for b in ("xla", kernel_backend)]
    for a, b in zip(res[0], res[1]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
