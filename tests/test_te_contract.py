"""TransformerEngine's JAX permutation contracts, against our independent NumPy reference.

``transformer_engine.jax.permutation`` users switch with one import, so its public
``token_dispatch`` / ``token_combine`` / ``sort_chunks_by_index`` contracts are ours:
signatures and return arity, probabilities in the tokens' dtype (bf16 included) with
``permuted_probs`` and gradients in that dtype, the padded buffer size
``((num_out_tokens + E*(A-1)) // A) * A``, values within TE's dtype tolerances, and the
sharded semantics (each token shard dispatches its own tokens, ``num_out_tokens`` divided
across the shards, no collectives), checked on 8 virtual CPU devices in a subprocess.

Single-device tests run on ``xla`` and on this machine's kernel backend (``interpret`` on
CPU, ``triton`` on a GPU).
"""
import inspect
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax_perm
from te_jax_perm.workloads import top_k_map
from tests import numpy_reference as ref
from tests.conftest import BACKENDS_HERE, routing
from tests.multidevice import (collectives, multidevice, run_module_on_8_devices,
                               shardy_all_gspmd_some)

# (num_tokens, num_experts, hidden_size, topk): TE's L0 cases, scaled down for the interpreter.
CASES = [(32, 5, 32, 3), (24, 8, 40, 8)]
PADDED_CASES = [(32, 5, 32, 3, 8), (24, 8, 40, 8, 16)]
DTYPES = [jnp.float32, jnp.bfloat16]


def _contract_matrix(cases, padded):
    """(backend, with_probs, dtype, case): the whole matrix on ``xla`` and on a GPU's
    ``triton``. The interpreter (1-2 s a kernel launch here) runs half of it, chosen so that
    every pair of (case, dtype, with_probs) values still runs, and so that the unpadded and
    the padded test run complementary halves: together they launch the kernels of every
    (case, dtype, with_probs) combination once. Kernel numerics on the interpreter are
    covered again by test_dispatch.py and test_permute.py."""
    full = [(p, d, c) for p in (True, False) for d in DTYPES for c in cases]
    out = []
    for b in BACKENDS_HERE:
        for p, d, c in full:
            odd = (p + (d == jnp.bfloat16) + (c == cases[1])) % 2   # a 2-level orthogonal array
            if b == "interpret" and odd == padded:
                continue
            out.append(pytest.param(b, p, d, *c, id="-".join([b, str(p), jnp.dtype(d).name, *map(str, c)])))
    return out


def te_tols(dtype) -> dict:
    """TE's test tolerances: rtol = eps**(2/3), atol = max(ulp(1), eps**(2/3))."""
    finfo = jnp.finfo(dtype)
    relaxed = math.pow(float(finfo.eps), 2 / 3)
    one = np.asarray(1, dtype)
    ulp = float(np.nextafter(one, np.asarray(np.inf, dtype)).astype(np.float64) - 1.0)
    return {"rtol": relaxed, "atol": max(ulp, relaxed)}


def close(actual, desired, dtype):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(desired, np.float64), **te_tols(dtype))


def _routing(t, e, k, seed=42):
    return routing(np.random.default_rng(seed), t, e, k, "uniform").astype(np.int32)


def _inputs(t, e, h, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.uniform(-1, 1, (t, h)), dtype)
    probs = jnp.asarray(rng.uniform(0.1, 1.0, (t, e)), dtype)
    return x, probs


def _merging(rm, dtype, seed=1):
    w = np.random.default_rng(seed).uniform(0.1, 1.0, rm.shape) * rm
    return jnp.asarray(w / np.maximum(w.sum(axis=1, keepdims=True), 1e-8), dtype)


def _uniform(rm, dtype):
    return jnp.asarray(rm / np.maximum(rm.sum(axis=1, keepdims=True), 1.0), dtype)


# -- signatures and arity ----------------------------------------------------------------------
@pytest.mark.parametrize("fn,params", [
    ("token_dispatch", ["inp", "routing_map", "num_out_tokens", "probs", "align_size"]),
    ("token_combine", ["inp", "row_id_map", "merging_probs", "pad_offsets"]),
    ("sort_chunks_by_index", ["inp", "split_sizes", "sorted_indices"]),
])
def test_signatures_are_te_plus_keyword_only(fn, params):
    sig = inspect.signature(getattr(te_jax_perm, fn))
    positional = [p.name for p in sig.parameters.values() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert positional == params
    assert sig.parameters["backend"].kind == inspect.Parameter.KEYWORD_ONLY


# -- token_dispatch / token_combine ----------------------------------------------------------
@pytest.mark.parametrize("backend,with_probs,dtype,t,e,h,k", _contract_matrix(CASES, padded=False))
def test_dispatch_and_combine(backend, t, e, h, k, dtype, with_probs):
    rm = _routing(t, e, k)
    n = int(rm.sum())
    x, probs = _inputs(t, e, h, dtype)
    probs = probs if with_probs else None
    out, pp, rid, pad, tpe = te_jax_perm.token_dispatch(x, rm, n, probs=probs, backend=backend)
    xf, pf = np.asarray(x, np.float64), None if probs is None else np.asarray(probs, np.float64)
    e_out, e_pp, dest, _, e_tpe = ref.dispatch(xf, rm.astype(bool), n, pf, None)
    assert out.shape == (n, h) and out.dtype == dtype and rid.shape == (t, 2 * e + 1) and pad is None
    close(out, e_out, dtype)
    np.testing.assert_array_equal(np.asarray(rid)[:, -1], rm.sum(axis=1))
    np.testing.assert_array_equal(np.asarray(tpe), e_tpe)
    if with_probs:
        assert pp.shape == (n,) and pp.dtype == dtype  # permuted_probs in the probs' dtype
        close(pp, e_pp, dtype)
    else:
        assert pp is None

    # Dispatch backward, through TE's loss sum(out**2) + sum(pp**2).
    def loss(x, p):
        o, q, *_ = te_jax_perm.token_dispatch(x, rm, n, probs=p, backend=backend)
        return jnp.sum(o.astype(jnp.float32) ** 2) + (jnp.sum(q.astype(jnp.float32) ** 2) if q is not None else 0.0)

    val, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1) if with_probs else 0))(x, probs)
    e_gx, e_gp = ref.dispatch_vjp(2 * e_out, None if e_pp is None else 2 * e_pp, dest)
    close(val, np.sum(e_out ** 2) + (np.sum(e_pp ** 2) if with_probs else 0.0), dtype)
    gx, gp = grads if with_probs else (grads, None)
    assert gx.dtype == dtype
    close(gx, e_gx, dtype)
    if with_probs:
        assert gp.dtype == dtype
        close(gp, e_gp, dtype)

    # Combine forward and backward with merging probs in the tokens' dtype.
    w = _merging(rm, dtype)
    combined = te_jax_perm.token_combine(out, rid, w, backend=backend)
    assert combined.shape == (t, h) and combined.dtype == dtype
    y = np.asarray(out, np.float64)
    close(combined, ref.combine(y, dest, np.asarray(w, np.float64)), dtype)
    g = 2 * np.asarray(combined, np.float64)
    gy, gw = jax.jit(jax.grad(lambda y, w: jnp.sum(te_jax_perm.token_combine(y, rid, w, backend=backend)
                                                   .astype(jnp.float32) ** 2), argnums=(0, 1)))(out, w)
    e_gy, e_gw = ref.combine_vjp(g, y, dest, np.asarray(w, np.float64))
    assert gy.dtype == dtype and gw.dtype == dtype  # merging_probs' gradient in their dtype
    close(gy, e_gy, dtype)
    close(gw, e_gw, dtype)

    # Round trip with uniform merging probs is the identity.
    uniform = _uniform(rm, dtype)
    back = jax.jit(lambda x: te_jax_perm.token_combine(
        *(lambda o: (o[0], o[2]))(te_jax_perm.token_dispatch(x, rm, n, backend=backend)), uniform, backend=backend))(x)
    close(back, np.asarray(x, np.float64), dtype)


@pytest.mark.parametrize("backend,with_probs,dtype,t,e,h,k,align", _contract_matrix(PADDED_CASES, padded=True))
def test_dispatch_and_combine_with_padding(backend, t, e, h, k, align, dtype, with_probs):
    rm = _routing(t, e, k)
    n = int(rm.sum())
    worst = ((n + e * (align - 1)) // align) * align  # TE's buffer size
    x, probs = _inputs(t, e, h, dtype)
    probs = probs if with_probs else None
    out, pp, rid, pad, tpe = te_jax_perm.token_dispatch(x, rm, n, probs=probs, align_size=align, backend=backend)
    assert out.shape == (worst, h)
    assert (pp.shape == (worst,) and pp.dtype == dtype) if with_probs else pp is None
    assert pad.shape == (e,) and tpe.shape == (e,)
    assert all(int(c) % align == 0 for c in np.asarray(tpe))
    xf = np.asarray(x, np.float64)
    e_out, e_pp, dest, e_pad, e_tpe = ref.dispatch(xf, rm.astype(bool), n, None if probs is None else
                                                   np.asarray(probs, np.float64), align)
    close(out, e_out, dtype)
    np.testing.assert_array_equal(np.asarray(pad), e_pad)
    np.testing.assert_array_equal(np.asarray(tpe), e_tpe)

    def loss(x, p):
        o, q, *_ = te_jax_perm.token_dispatch(x, rm, n, probs=p, align_size=align, backend=backend)
        return jnp.sum(o.astype(jnp.float32) ** 2) + (jnp.sum(q.astype(jnp.float32) ** 2) if q is not None else 0.0)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1) if with_probs else 0))(x, probs)
    for gr, like in zip(grads if with_probs else (grads,), (x, probs)):
        assert gr.shape == like.shape and not np.isnan(np.asarray(gr, np.float32)).any()

    w = _merging(rm, dtype)
    combined = te_jax_perm.token_combine(out, rid, w, pad, backend=backend)
    assert combined.shape == (t, h)
    close(combined, ref.combine(np.asarray(out, np.float64), dest, np.asarray(w, np.float64)), dtype)
    gy = jax.jit(jax.grad(lambda y: jnp.sum(te_jax_perm.token_combine(y, rid, w, pad, backend=backend)
                                            .astype(jnp.float32) ** 2)))(out)
    assert gy.shape == out.shape and not np.isnan(np.asarray(gy, np.float32)).any()

    uniform = _uniform(rm, dtype)

    def roundtrip(x, with_offsets):
        o, _, r, p, _ = te_jax_perm.token_dispatch(x, rm, n, align_size=align, backend=backend)
        return te_jax_perm.token_combine(o, r, uniform, p if with_offsets else None, backend=backend)

    for with_offsets in (True, False):  # the map carries the padding: pad_offsets are optional
        close(jax.jit(roundtrip, static_argnums=1)(x, with_offsets), xf, dtype)
    g = jax.jit(jax.grad(lambda x: jnp.sum(roundtrip(x, True).astype(jnp.float32) ** 2)))(x)
    close(g, 2 * xf, dtype)


# -- sort_chunks_by_index ------------------------------------------------------------------
@pytest.mark.parametrize("num_splits,total,h", [(8, 256, 24), (16, 300, 40)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sort_chunks_by_index(backend, num_splits, total, h, dtype):
    rng = np.random.default_rng(42)
    sizes = rng.integers(10, total // num_splits, num_splits)
    sizes[-1] = total - sizes[:-1].sum()
    order = rng.permutation(num_splits)
    x = jnp.asarray(rng.uniform(-1, 1, (total, h)), dtype)
    res = te_jax_perm.sort_chunks_by_index(x, jnp.asarray(sizes, jnp.int32), jnp.asarray(order, jnp.int32),
                                           backend=backend)
    assert len(res) == 2  # TE's arity: (output, row_id_map)
    out, row_map = res
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    src = np.concatenate([np.arange(starts[c], starts[c] + sizes[c]) for c in order])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x)[src])
    np.testing.assert_array_equal(np.asarray(row_map)[src], np.arange(total))
    loss = lambda x: jnp.sum(te_jax_perm.sort_chunks_by_index(
        x, jnp.asarray(sizes, jnp.int32), jnp.asarray(order, jnp.int32), backend=backend)[0].astype(jnp.float32) ** 2)
    val, g = jax.jit(jax.value_and_grad(loss))(x)
    close(val, np.sum(np.asarray(x, np.float64) ** 2), dtype)
    close(g, 2 * np.asarray(x, np.float64), dtype)
    # [B, S, H] inputs are flattened, as in TE.
    out3, _ = te_jax_perm.sort_chunks_by_index(x.reshape(4, total // 4, h), jnp.asarray(sizes, jnp.int32),
                                               jnp.asarray(order, jnp.int32), backend=backend)
    np.testing.assert_array_equal(np.asarray(out3), np.asarray(out))


def test_sort_chunks_probs_variant_keeps_te_arity_separate(backend):
    x = jnp.arange(20, dtype=jnp.float32).reshape(10, 2)
    p = jnp.arange(10, dtype=jnp.bfloat16)
    sizes, order = jnp.asarray([3, 7], jnp.int32), jnp.asarray([1, 0], jnp.int32)
    out, pp, row_map = te_jax_perm.sort_chunks_by_index_with_probs(x, sizes, order, p, backend=backend)
    assert pp.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(pp, np.float32), np.r_[3:10, 0:3])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(te_jax_perm.sort_chunks_by_index(
        x, sizes, order, backend=backend)[0]))


# -- sharded semantics (8 virtual CPU devices) -----------------------------------------------
@pytest.mark.slow
def test_in_8_device_subprocess():
    run_module_on_8_devices(__file__)


# (mesh shape, mesh axes, token axes): TE's n4_dp2_tp2 and n8_dp2_fsdp2_tp2, tokens over dp
# (TE's own tests) and over dp and fsdp together.
MESHES = [((2, 2), ("dp", "tpsp"), "dp"), ((2, 2, 2), ("dp", "fsdp", "tpsp"), "dp"),
          ((2, 2, 2), ("dp", "fsdp", "tpsp"), ("dp", "fsdp"))]


@multidevice
# GSPMD: TE's own mesh unpadded, and the padded layout over two token axes.
@pytest.mark.parametrize("partitioner,mesh_shape,mesh_axes,token_axes,align", shardy_all_gspmd_some(
    [(*m, a) for a in (None, 8) for m in MESHES],
    [f"{a}-{i}" for a in (None, 8) for i in ("dp2_tp2", "dp2_fsdp2_tp2", "dpfsdp4_tp2")], gspmd=(0, 5)),
    indirect=["partitioner"])
def test_token_sharded_dispatch_and_combine_are_local(partitioner, mesh_shape, mesh_axes, token_axes, align):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from te_jax_perm.ops.permute.api import local_budget

    t, e, h, k = 64, 4, 32, 2
    rm = _routing(t, e, k)
    x, probs = _inputs(t, e, h, jnp.float32)
    devices = np.asarray(jax.devices()[:int(np.prod(mesh_shape))]).reshape(mesh_shape)
    mesh = Mesh(devices, mesh_axes)
    shards = int(np.prod([mesh.shape[a] for a in (token_axes if isinstance(token_axes, tuple) else (token_axes,))]))
    if align is None:
        n = t * k  # TE: global num_out_tokens, divided by the partitioner
    else:  # TE's distributed test: room for each shard's worst-case padding
        tl = t // shards
        n = ((tl * k + e * (align - 1)) // align) * align * shards
    uniform = _uniform(rm, jnp.float32)
    sh = NamedSharding(mesh, P(token_axes, None))
    xs, rms, ps, us = (jax.device_put(a, sh) for a in (x, rm, probs, uniform))

    def layer(x, rm, p, u):
        out, pp, rid, pad, _ = te_jax_perm.token_dispatch(x, rm, n, probs=p, align_size=align, backend="xla")
        return out, pp, rid, te_jax_perm.token_combine(out, rid, u, pad, backend="xla")

    def loss(x, p):
        out, pp, _, back = layer(x, rms, p, us)
        return jnp.sum(out ** 2) + jnp.sum(pp ** 2) + jnp.sum(back ** 2)

    grad = jax.grad(loss, argnums=(0, 1))  # one function: its run reuses the compile checked here
    assert collectives(layer, xs, rms, ps, us) == []
    assert collectives(grad, xs, ps) == []
    out, pp, rid, back = jax.jit(layer)(xs, rms, ps, us)
    gx, gp = jax.jit(grad)(xs, ps)
    assert out.sharding.spec[0] == token_axes and rid.sharding.spec[0] == token_axes

    rows = out.shape[0] // shards
    tl = t // shards
    for i in range(shards):
        tok = slice(i * tl, (i + 1) * tl)
        budget = local_budget(n, shards, rows, e, align)
        xi, pi = np.asarray(x)[tok].astype(np.float64), np.asarray(probs)[tok].astype(np.float64)
        e_out, e_pp, dest, e_pad, _ = ref.dispatch(xi, rm[tok].astype(bool), budget, pi, align)
        block = slice(i * rows, (i + 1) * rows)
        used = e_out.shape[0]
        assert used <= rows
        np.testing.assert_array_equal(np.asarray(out)[block][:used], e_out.astype(np.float32))
        assert not np.asarray(out)[block][used:].any() and not np.asarray(pp)[block][used:].any()
        np.testing.assert_array_equal(np.asarray(pp)[block][:used], e_pp.astype(np.float32))
        np.testing.assert_array_equal(np.asarray(rid)[tok], ref.row_id_map(rm[tok].astype(bool), budget, e_pad))
        np.testing.assert_allclose(np.asarray(back)[tok], xi, rtol=1e-5, atol=1e-5)  # every row kept here
        g_out, g_pp = 2 * e_out, 2 * e_pp
        gb = ref.combine_vjp(2 * xi, e_out, dest, np.asarray(uniform)[tok])[0]
        e_gx, e_gp = ref.dispatch_vjp(g_out + np.pad(gb, ((0, g_out.shape[0] - gb.shape[0]), (0, 0))), g_pp, dest)
        np.testing.assert_allclose(np.asarray(gx)[tok], e_gx, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(gp)[tok], e_gp, rtol=1e-5, atol=1e-5)


def _fitting_prefix(rm: np.ndarray, budget: int, align: int, rows: int) -> int:
    """The most rows (a prefix of the expert-major order, at most ``budget``) whose padded
    layout fits ``rows`` rows, found by trying every length."""
    for m in range(min(budget, int(rm.sum())), -1, -1):
        if sum(ref.dispatch_layout(rm, m, align)[1]) <= rows:
            return m
    return 0


@multidevice
@pytest.mark.parametrize("routing,n", [("one_expert", 32), ("topk", 64), ("topk", 40), ("skewed", 64)])
def test_padded_shards_drop_only_rows_their_layout_cannot_fit(routing, n):
    """Four token shards, each with a quarter of the padded buffer: fewer rows than its
    worst-case padding needs, so what it keeps depends on its routing. Every shard keeps the
    longest expert-major prefix (within its share of ``num_out_tokens``) whose padded layout
    fits its rows: all of them where the routing leaves room (one expert: 8 aligned rows in
    14), fewer where it does not."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    t, e, h, align, shards = 32, 4, 8, 8, 4
    rng = np.random.default_rng(5)
    if routing == "one_expert":
        rm = np.zeros((t, e), np.int32)
        rm[:, 0] = 1
    else:
        logits = rng.standard_normal((t, e))
        if routing == "skewed":
            logits[:, 1] += 3.0
        rm = top_k_map(logits, 2).astype(np.int32)
    x, probs = _inputs(t, e, h, jnp.float32)
    mesh = Mesh(np.asarray(jax.devices()[:shards]), ("dp",))
    sh = NamedSharding(mesh, P("dp", None))
    f = jax.jit(lambda x, rm, p: te_jax_perm.token_dispatch(x, rm, n, probs=p, align_size=align, backend="xla"))
    out, pp, rid, _, tpe = f(*(jax.device_put(a, sh) for a in (x, jnp.asarray(rm), probs)))
    rows, tl = out.shape[0] // shards, t // shards
    kept_total = 0
    for i in range(shards):
        tok = slice(i * tl, (i + 1) * tl)
        m = _fitting_prefix(rm[tok].astype(bool), min(n // shards, rows), align, rows)
        kept_total += m
        xi, pi = np.asarray(x)[tok], np.asarray(probs)[tok]
        e_out, e_pp, dest, e_pad, e_tpe = ref.dispatch(xi, rm[tok].astype(bool), m, pi, align)
        used = int(e_tpe.sum())        # the padded layout; the reference's buffer has worst-case room
        assert used <= rows
        block = slice(i * rows, (i + 1) * rows)
        np.testing.assert_array_equal(np.asarray(out)[block][:used], e_out[:used])
        assert not np.asarray(out)[block][used:].any()
        np.testing.assert_array_equal(np.asarray(pp)[block][:used], e_pp[:used])
        np.testing.assert_array_equal(np.asarray(rid)[tok], ref.row_id_map(rm[tok].astype(bool), m, e_pad))
    assert int((np.asarray(rid)[:, :e] >= 0).sum()) == kept_total
    # tokens_per_expert: every shard's kept rows summed, then padded up once (the
    # unsharded layout, as TransformerEngine pads the summed counts).
    r = np.asarray(rid)
    kept = np.bincount([r[i, e + j] for i in range(t) for j in range(r[i, 2 * e]) if r[i, j] >= 0], minlength=e)
    np.testing.assert_array_equal(np.asarray(tpe), -(-kept // align) * align)
    if routing == "one_expert":
        assert kept_total == t     # every shard's 8 rows fit its 14
    if routing == "topk":
        assert 0 < kept_total < 2 * t


# (tokens sharded over, T, num_out_tokens, extra tokens appended inside the jitted function,
# what does not divide). gcd(T, R) is the factor the Shardy rule shares between T and R:
# with it not divisible by the shard count, Shardy splits a mesh axis in a way no
# PartitionSpec names, which once failed in JAX's decoding as an IndivisibleError.
INDIVISIBLE = [
    ("dp", 2, 8, 15, 0, "expert-sorted rows (15)"),            # gcd 1: T and R share no divisor
    ("dp", 4, 12, 18, 0, "expert-sorted rows (18)"),           # gcd 6, not divisible by 4
    ("dp", 4, 8, 2, 0, "expert-sorted rows (2)"),              # gcd 2 < 4 shards
    ("dp", 8, 16, 12, 0, "expert-sorted rows (12)"),           # gcd 4 < 8 shards
    (("dp", "fsdp"), 4, 8, 6, 0, "expert-sorted rows (6)"),    # gcd 2 against two mesh axes of 2
    ("dp", 2, 8, 16, 1, "tokens (9)"),                  # T indivisible, reached by propagation
    ("dp", 4, 8, 16, 2, "tokens (10)"),                 # T indivisible, gcd(10, 16) = 2
]


@multidevice
@pytest.mark.parametrize("token_axes,shards,t,n,extra,what", INDIVISIBLE,
                         ids=["coprime", "gcd6_4", "gcd2_4", "gcd4_8", "two_axes", "t9_2", "t10_4"])
@pytest.mark.parametrize("op", ["dispatch", "combine", "grad"])
def test_sizes_not_divisible_by_token_shards_raise_our_value_error(partitioner, token_axes, shards, t, n, extra,
                                                                  what, op):
    """Under jit, a token or row count the token shards do not divide raises our ValueError
    (op, size, shard count, what to choose), never XLA's runtime error or IndivisibleError."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    names = token_axes if isinstance(token_axes, tuple) else (token_axes,)
    mesh = Mesh(np.asarray(jax.devices()[:shards]).reshape((2,) * len(names) if len(names) > 1 else (shards,)),
                names)
    rm = _routing(t, 4, 2)
    x, _ = _inputs(t, 4, 16, jnp.float32)
    sh = NamedSharding(mesh, P(token_axes, None))

    def dispatch(x, rm):
        if extra:  # T indivisible: an array no device_put would shard, sharded by propagation
            x, rm = jnp.concatenate([x, x[:extra]]), jnp.concatenate([rm, rm[:extra]])
        return te_jax_perm.token_dispatch(x, rm, n, backend="xla")

    f = {"dispatch": lambda x, rm: dispatch(x, rm)[0],
         "combine": lambda x, rm: te_jax_perm.token_combine(*(lambda o: (o[0], o[2]))(dispatch(x, rm)),
                                                            backend="xla"),
         "grad": jax.grad(lambda x, rm: jnp.sum(dispatch(x, rm)[0]))}[op]
    axes = token_axes if isinstance(token_axes, tuple) else repr(token_axes).strip("'")
    with pytest.raises(ValueError, match=rf"token_dispatch: its {re.escape(what)} do not divide into the {shards} "
                                         rf"token shards of mesh axes {re.escape(str(axes))}; choose sizes "
                                         rf"divisible by {shards}"):
        jax.jit(f)(jax.device_put(x, sh), jax.device_put(rm, sh))


@multidevice
def test_combine_rows_not_divisible_by_token_shards_raise_our_value_error(partitioner):
    """token_combine on its own: rows from an unsharded dispatch (18 of them), its map
    sharded over 4 token shards (12 tokens)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    mesh = Mesh(np.asarray(jax.devices()[:4]), ("dp",))
    rm = _routing(12, 4, 2)
    x, _ = _inputs(12, 4, 16, jnp.float32)
    out, _, rid, _, _ = te_jax_perm.token_dispatch(x, rm, 18, backend="xla")
    with pytest.raises(ValueError, match=r"^token_combine: its expert-sorted rows \(18\) do not divide into the 4 token "
                                         r"shards of mesh axes dp; choose sizes divisible by 4"):
        jax.jit(lambda o, r: te_jax_perm.token_combine(o, r, backend="xla"))(
            out, jax.device_put(rid, NamedSharding(mesh, P("dp", None))))

