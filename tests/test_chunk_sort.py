"""Chunk sort: forward/backward against an independent NumPy reference, transforms, aliasing.

Includes a regression test for an undeclared alias (the backward inverse sort written into a
buffer XLA was free to share with the incoming gradient).
"""
import contextlib
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import te_jax_perm
from te_jax_perm.core import Config
from te_jax_perm.ops.chunk_sort import decl as cs
from te_jax_perm.sanitize import sanitize
from tests.conftest import KERNEL_BACKEND


# -- independent NumPy reference ------------------------------------------------------
def np_sort_chunks(x, sizes, order):
    """Output chunk j = input chunk order[j]; rows past sum(sizes) are zero."""
    x = np.asarray(x)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    out = np.zeros_like(x)
    pieces = [x[starts[c]:starts[c] + sizes[c]] for c in order]
    cat = np.concatenate(pieces) if pieces else x[:0]
    out[:len(cat)] = cat
    return out


def np_source_rows(n, sizes, order):
    """src[j] = input row that lands in output row j, or -1."""
    return np_sort_chunks(np.arange(1, n + 1), sizes, order) - 1


def np_grad(w, n, sizes, order):
    """d/dx sum(sort(x) * w): the inverse sort of w, zero for unmapped input rows."""
    src = np_source_rows(n, sizes, order)
    g = np.zeros((n,) + w.shape[1:], w.dtype)
    g[src[src >= 0]] = w[src >= 0]
    return g


CASES = [  # (N, H, sizes, order)
    (1, 1, [1], [0]),                        # N=1, C=1
    (1, 5, [0, 1], [1, 0]),
    (7, 3, [7], [0]),                        # C=1 covering everything
    (10, 5, [3, 0, 4, 2], [2, 0, 3, 1]),     # empty chunk, one unmapped tail row
    (13, 37, [2, 5, 0, 6], [3, 1, 2, 0]),    # odd H, exact cover
    (16, 8, [0, 0, 0], [2, 1, 0]),           # nothing mapped: all zero
    (24, 20, [3, 3, 3, 3, 3, 3], [0, 3, 1, 4, 2, 5]),  # (rank, expert) -> (expert, rank), EP=2 x 3
    # Wide rows under the default config: one masked 4096-column tile; two column steps.
    (5, 2880, [2, 2], [1, 0]),
    (3, 5000, [1, 2], [1, 0]),
]


def sort3(x, sizes, order, probs=None, backend=None):
    """``(output, permuted_probs or None, row_id_map)`` from whichever public op fits."""
    if probs is None:
        out, row_map = te_jax_perm.sort_chunks_by_index(x, sizes, order, backend=backend)
        return out, None, row_map
    return te_jax_perm.sort_chunks_by_index_with_probs(x, sizes, order, probs, backend=backend)


def _inputs(n, h, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, h)), dtype)
    p = jnp.asarray(rng.random(n), jnp.float32)
    return x, p


@pytest.mark.parametrize("n,h,sizes,order", CASES)
@pytest.mark.parametrize("with_probs", [False, True])
def test_forward_matches_numpy(backend, n, h, sizes, order, with_probs):
    x, p = _inputs(n, h)
    out, pp, row_map = sort3(
        x, jnp.array(sizes, jnp.int32), jnp.array(order, jnp.int32), p if with_probs else None, backend=backend)
    np.testing.assert_array_equal(np.asarray(out), np_sort_chunks(x, sizes, order))
    if with_probs:
        np.testing.assert_array_equal(np.asarray(pp), np_sort_chunks(p, sizes, order))
    else:
        assert pp is None
    src = np_source_rows(n, sizes, order)
    expect_map = np.full(n, -1, np.int32)
    expect_map[src[src >= 0]] = np.nonzero(src >= 0)[0]
    np.testing.assert_array_equal(np.asarray(row_map), expect_map)


@pytest.mark.parametrize("n,h,sizes,order", CASES)
@pytest.mark.parametrize("with_probs", [False, True])
def test_backward_matches_numpy(backend, n, h, sizes, order, with_probs):
    x, p = _inputs(n, h, seed=1)
    rng = np.random.default_rng(2)
    w = rng.standard_normal((n, h)).astype(np.float32)
    v = rng.standard_normal(n).astype(np.float32)
    ss, si = jnp.array(sizes, jnp.int32), jnp.array(order, jnp.int32)

    def loss(x, p):
        out, pp, _ = sort3(x, ss, si, p, backend=backend)
        return jnp.sum(out * w) + (jnp.sum(pp * v) if pp is not None else 0.0)

    if with_probs:
        gx, gp = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, p)
    else:
        gx = jax.jit(jax.grad(lambda x: loss(x, None)))(x)
    np.testing.assert_array_equal(np.asarray(gx), np_grad(w, n, sizes, order))
    if with_probs:
        np.testing.assert_array_equal(np.asarray(gp), np_grad(v, n, sizes, order))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int32, jnp.float8_e4m3fn])
def test_dtypes_copy_exactly(backend, dtype):
    n, h, sizes, order = 12, 9, [4, 1, 5], [1, 2, 0]
    x = jnp.asarray(np.random.default_rng(3).integers(-50, 50, (n, h)), dtype)
    out, _, _ = sort3(x, jnp.array(sizes), jnp.array(order), backend=backend)
    assert out.dtype == dtype
    expected = np_sort_chunks(np.asarray(x).view(np.uint8) if dtype == jnp.float8_e4m3fn else x, sizes, order)
    got = np.asarray(out).view(np.uint8) if dtype == jnp.float8_e4m3fn else np.asarray(out)
    np.testing.assert_array_equal(got, expected)


def test_traced_split_sizes_under_jit_and_round_trip(backend):
    n, h = 20, 6
    x, p = _inputs(n, h, seed=4)

    @jax.jit
    def fwd_back(x, p, sizes, order):
        out, pp, row_map = sort3(x, sizes, order, p, backend=backend)
        back, pb = te_jax_perm.sort_chunks_by_map(out, row_map, pp, is_forward=False, backend=backend)
        return out, back, pb

    # Alternate shapes of the chunk split quickly in one process: a compiled kernel reused
    # with another value baked into it would fault here.
    for sizes, order in [([5, 5, 5, 5], [3, 2, 1, 0]), ([0, 19, 0, 1], [1, 3, 0, 2]), ([20, 0, 0, 0], [0, 1, 2, 3])]:
        out, back, pb = fwd_back(x, p, jnp.array(sizes), jnp.array(order))
        np.testing.assert_array_equal(np.asarray(out), np_sort_chunks(x, sizes, order))
        mapped = np.arange(n) < sum(sizes)
        np.testing.assert_array_equal(np.asarray(back), np.where(mapped[:, None], x, 0))
        np.testing.assert_array_equal(np.asarray(pb), np.where(mapped, p, 0))


def test_traced_oversized_splits_are_truncated(backend):
    """Traced sizes summing past N: chunks truncated where the input ends, nothing out of bounds."""
    n, h = 10, 4
    x, _ = _inputs(n, h, seed=5)
    sizes, order = [4, 9, 3], [2, 1, 0]
    out, _, row_map = jax.jit(lambda x, s, o: sort3(x, s, o, backend=backend))(
        x, jnp.array(sizes), jnp.array(order))
    # Effective sizes [4, 6, 0]: the same as an exact split with those sizes.
    np.testing.assert_array_equal(np.asarray(out), np_sort_chunks(x, [4, 6, 0], order))
    assert sorted(np.asarray(row_map).tolist()) == list(range(n))


def test_zero_rows_give_zero_size_results(backend):
    x, p = _inputs(0, 4)
    out, pp, row_map = jax.jit(lambda x, p: sort3(x, jnp.array([0, 0]), jnp.array([1, 0]), p, backend=backend))(x, p)
    assert out.shape == (0, 4) and pp.shape == (0,) and row_map.shape == (0,)
    gx = jax.jit(jax.grad(lambda x: sort3(x, jnp.array([0]), jnp.array([0]), backend=backend)[0].sum()))(x)
    assert gx.shape == (0, 4)
    back, _ = te_jax_perm.sort_chunks_by_map(x, row_map, is_forward=False, backend=backend)
    assert back.shape == (0, 4)


def test_vmap(backend):
    b, n, h = 3, 9, 5
    xs = jnp.asarray(np.random.default_rng(6).standard_normal((b, n, h)), jnp.float32)
    sizes = jnp.array([[2, 3, 4], [0, 9, 0], [1, 1, 1]], jnp.int32)
    orders = jnp.array([[2, 0, 1], [1, 0, 2], [0, 2, 1]], jnp.int32)
    f = lambda x, s, o: te_jax_perm.sort_chunks_by_index(x, s, o, backend=backend)[0]
    out = jax.jit(jax.vmap(f))(xs, sizes, orders)
    for i in range(b):
        np.testing.assert_array_equal(np.asarray(out[i]),
                                      np_sort_chunks(xs[i], np.asarray(sizes[i]), np.asarray(orders[i])))
    # vmap of grad: each batch member gets its own inverse sort.
    g = jax.jit(jax.vmap(jax.grad(lambda x, s, o: jnp.sum(f(x, s, o) * jnp.arange(n * h).reshape(n, h)))))(
        xs, sizes, orders)
    for i in range(b):
        w = np.arange(n * h, dtype=np.float32).reshape(n, h)
        np.testing.assert_array_equal(np.asarray(g[i]), np_grad(w, n, np.asarray(sizes[i]), np.asarray(orders[i])))


def np_placed(c, order):
    """The chunks a traced order places, in output order: each valid index at its first use."""
    placed = []
    for o in order:
        if 0 <= o < c and o not in placed:
            placed.append(o)
    return placed


def np_row_map(n, sizes, order):
    src = np_source_rows(n, sizes, order)
    expect = np.full(n, -1, np.int32)
    expect[src[src >= 0]] = np.nonzero(src >= 0)[0]
    return expect


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 3, 1], [0, -1, 1], [2, 2, 2], [-5, 7, 3], [1, 2, 1]])
def test_traced_non_permutation_drops_chunks_on_every_backend(backend, order):
    """Repeated or out-of-range traced indices place nothing: every output row is written
    once (the interpreter's poisoned outputs would show a row nobody wrote), dropped chunks'
    rows map to -1 and get zero gradient, and the backends agree."""
    n, h, sizes = 10, 5, [2, 3, 4]
    x, p = _inputs(n, h, seed=12)
    w = np.random.default_rng(13).standard_normal((n, h)).astype(np.float32)
    keep = np_placed(3, order)

    @jax.jit
    def run(x, p, s, o):
        (out, pp, row_map), pull = jax.vjp(lambda x, p: sort3(x, s, o, p, backend=backend), x, p)
        return out, pp, row_map, pull((jnp.asarray(w), jnp.ones(n), np.zeros(n, jax.dtypes.float0)))

    with (sanitize() if backend == "interpret" else contextlib.nullcontext()) as report:
        out, pp, row_map, (gx, gp) = jax.block_until_ready(run(x, p, jnp.array(sizes), jnp.array(order)))
    assert not report, report.text()
    np.testing.assert_array_equal(np.asarray(out), np_sort_chunks(x, sizes, keep))
    np.testing.assert_array_equal(np.asarray(pp), np_sort_chunks(p, sizes, keep))
    np.testing.assert_array_equal(np.asarray(row_map), np_row_map(n, sizes, keep))
    np.testing.assert_array_equal(np.asarray(gx), np_grad(w, n, sizes, keep))
    np.testing.assert_array_equal(np.asarray(gp), np_grad(np.ones(n, np.float32), n, sizes, keep))


def test_non_injective_map_keeps_the_first_row_per_destination(backend):
    """sort_chunks_by_map with a map naming output rows twice, or none: the first input row
    naming a row is moved there, the others go nowhere; both directions and their gradients
    write every row once and agree across backends."""
    n, h = 8, 3
    x = jnp.arange(n * h, dtype=jnp.float32).reshape(n, h) + 1
    bad = np.array([2, 2, 0, -1, 9, 1, 1, 5], np.int32)
    kept = np.array([2, -1, 0, -1, -1, 1, -1, 5])       # the map as the ops read it
    fwd = np.zeros((n, h), np.float32)
    fwd[kept[kept >= 0]] = np.asarray(x)[kept >= 0]
    inv = np.where((kept >= 0)[:, None], np.asarray(x)[np.maximum(kept, 0)], 0)
    g = np.arange(n * h, dtype=np.float32).reshape(n, h)
    for forward, want, want_grad in ((True, fwd, np.where((kept >= 0)[:, None], g[np.maximum(kept, 0)], 0)),
                                     (False, inv, None)):
        f = lambda x: te_jax_perm.sort_chunks_by_map(x, jnp.asarray(bad), is_forward=forward, backend=backend)[0]
        out, pull = jax.vjp(jax.jit(f), x)
        np.testing.assert_array_equal(np.asarray(out), want)
        (gx,) = pull(jnp.asarray(g))
        if want_grad is None:  # the inverse's gradient scatters rows back: row i to kept[i]
            want_grad = np.zeros((n, h), np.float32)
            want_grad[kept[kept >= 0]] = g[kept >= 0]
        np.testing.assert_array_equal(np.asarray(gx), want_grad)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_map_kernel_property(data):
    """The Triton map kernel (interpreted on CPU, compiled on GPU) agrees with the xla
    reference and NumPy, for any order a traced value may hold (repeats across and within
    the kernel's tiles of 4 positions, indices out of range)."""
    c = data.draw(st.integers(1, 9))
    n = data.draw(st.integers(1, 40))
    sizes = data.draw(st.lists(st.integers(0, 12), min_size=c, max_size=c))
    order = data.draw(st.one_of(st.permutations(list(range(c))),
                                st.lists(st.integers(-2, c + 1), min_size=c, max_size=c)))
    traced = sum(sizes) > n or sorted(order) != list(range(c))  # only traced values may be invalid
    make = lambda b, cfg=None: (lambda s, o: cs.chunk_maps(s, o, backend=b, config=cfg, num_tokens=n))
    args = (jnp.array(sizes, jnp.int32), jnp.array(order, jnp.int32))
    kernel = make(KERNEL_BACKEND, Config.make(BLOCK_N=16))
    got = [np.asarray(m) for m in (jax.jit(kernel) if traced else kernel)(*args)]
    ref = [np.asarray(m) for m in jax.jit(make("xla"))(*args)]
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])
    if sum(sizes) <= n:
        np.testing.assert_array_equal(got[0], np_row_map(n, sizes, np_placed(c, order)))
        np.testing.assert_array_equal(got[1], np_source_rows(n, sizes, np_placed(c, order)))


@pytest.mark.parametrize("cfg", [Config.make(ROWS=1, BLOCK_H=16), Config.make(ROWS=4, BLOCK_H=16),
                                 Config.make(ROWS=8, BLOCK_H=64)])
def test_move_kernel_configs(cfg):
    """Row tiles that straddle N and column loops over an odd H; sources out of range."""
    n, h = 11, 37
    x, p = _inputs(n, h, seed=7)
    src_map = jnp.array([4, -1, 10, 0, 11, 2**31 - 1, 3, 3, -7, 9, 1], jnp.int32)
    got = cs.sort_chunks_probs(x, src_map, p, backend=KERNEL_BACKEND, config=cfg)
    ref = cs.sort_chunks_probs(x, src_map, p, backend="xla")
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_map_kernel_many_chunks():
    """64 chunk lanes, several sorted-order tiles and row blocks (EP=8 x 5 local experts)."""
    rng = np.random.default_rng(11)
    c, n = 40, 300
    sizes = rng.multinomial(n - 7, np.full(c, 1.0 / c)).astype(np.int32)
    order = np.array([r * 5 + e for e in range(5) for r in range(8)], np.int32)
    got = np.asarray(te_jax_perm.make_chunk_sort_map(jnp.asarray(sizes), jnp.asarray(order), n, backend=KERNEL_BACKEND))
    src = np_source_rows(n, sizes, order)
    expect = np.full(n, -1, np.int32)
    expect[src[src >= 0]] = np.nonzero(src >= 0)[0]
    np.testing.assert_array_equal(got, expect)


@pytest.mark.parametrize("cfg", [Config.make(BLOCK_N=16), Config.make(BLOCK_N=64, num_warps=2)])
def test_map_kernel_configs(cfg):
    sizes, order = [5, 0, 7, 3, 9, 1], [5, 3, 1, 0, 4, 2]
    args = (jnp.array(sizes, jnp.int32), jnp.array(order, jnp.int32))
    got = cs.chunk_maps(*args, backend=KERNEL_BACKEND, config=cfg, num_tokens=30)
    ref = cs.chunk_maps(*args, backend="xla", num_tokens=30)
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    # The plan kernel writes the plan the reference describes, scratch rows included.
    plan = cs.chunk_sort_plan(*args, backend=KERNEL_BACKEND, num_tokens=30)[0]
    np.testing.assert_array_equal(np.asarray(plan), np.asarray(cs.chunk_sort_plan(*args, backend="xla",
                                                                                  num_tokens=30)[0]))


def test_movers_take_the_shipped_table_where_it_has_the_row_width(monkeypatch):
    """Both row movers read the swept kernel's (``sort_chunks_probs``) entries at the row
    width H and the nearest row count N; an entry invalid here, or a width the table lacks,
    gets the rule."""
    from te_jax_perm.ops import tuned_defaults as TD
    a = Config.make(num_warps=4, BLOCK_H=1024, ROWS=2)
    b = Config.make(num_warps=8, num_stages=2, BLOCK_H=4096, ROWS=1)
    table = {"sort_chunks_probs": {"2880": {"1024": a.to_json(), "32768": b.to_json()}, "64": {"8": b.to_json()}}}
    for decl in (cs.sort_chunks.decl, cs.sort_chunks_probs.decl):
        assert decl.default_config.rows_dim == decl.key_dims[0] == "N"
        pick = lambda n, h=2880: decl.default_config({"N": n, "H": h}, {})  # noqa: E731
        monkeypatch.setattr(TD, "device_table", lambda: {})
        rule = {(n, h): pick(n, h) for n, h in ((8, 64), (32768, 4096))}
        monkeypatch.setattr(TD, "device_table", lambda: table)
        assert pick(512) == a and pick(4096) == a and pick(16384) == b and pick(10 ** 6) == b
        # 4096 columns for rows of 64 break the declared constraint: the rule's.
        assert pick(8, 64) == rule[8, 64] != b
        assert pick(32768, 4096) == rule[32768, 4096]


@pytest.mark.parametrize("decl", [cs.chunk_sort_plan.decl, cs.chunk_sort_map.decl, cs.sort_chunks.decl, cs.sort_chunks_probs.decl], ids=lambda d: d.name)
def test_default_config_valid_for_real_shapes(decl):
    """Default configs satisfy the declared constraints across the benchmark shapes (incl. H=2880, 7168)."""
    for n in (1, 7, 4096, 16384):
        for h in (1, 37, 2880, 4096, 7168):
            for c in (1, 3, 8, 256, 1024, cs.MAX_CHUNKS):
                maps = decl in (cs.chunk_sort_plan.decl, cs.chunk_sort_map.decl)
                dims = ({"C": c, "P": 9} if maps else {"N": n, "H": h})
                params = {"num_tokens": n} if maps else {}
                cfg = decl.default_config(dims, params)
                assert decl.violated(dims, params, cfg) is None, (dims, cfg)
    assert all(isinstance(c, Config) for c in decl.configs) and decl.configs
    assert set(decl.key_dims) <= ({"C"} if decl in (cs.chunk_sort_plan.decl, cs.chunk_sort_map.decl) else {"N", "H"})


# -- aliasing ---------------------------------------------------------------------------
def _ours(audit, name):
    calls = [c for c in audit.ours if c.kernel == name]
    assert calls, str(audit)
    return calls


def test_alias_audit_forward_and_backward(kernel_backend):
    n, h = 12, 8
    x, p = _inputs(n, h)
    ss, si = jnp.array([4, 8]), jnp.array([1, 0])
    fwd = lambda x, p: sort3(x, ss, si, p, backend=kernel_backend)[:2]
    audit = te_jax_perm.audit_aliases(fwd, x, p)
    assert audit.ok, str(audit)
    _ours(audit, "chunk_sort_plan")
    _ours(audit, "chunk_sort_map")
    _ours(audit, "sort_chunks_probs")
    loss = lambda x, p: jnp.sum(fwd(x, p)[0] ** 2) + jnp.sum(fwd(x, p)[1])
    audit_bwd = te_jax_perm.audit_aliases(jax.grad(loss, argnums=(0, 1)), x, p)
    assert audit_bwd.ok, str(audit_bwd)
    # forward + backward both present
    assert len(_ours(audit_bwd, "sort_chunks_probs")) >= 2


def test_lesson1_backward_with_donated_gradient(kernel_backend):
    """Regression for an output XLA could place in the incoming gradient's memory.

    The backward inverse sort reads row ``map[i]`` of the incoming gradient and writes row
    ``i``: if its output shared the gradient's memory, programs would overwrite rows others
    have not read yet. Here the gradient buffer is donated (XLA may reuse it for anything)
    and the call runs in one process among other calls of other shapes; the result must be
    exact, and the backward custom call's output must be aliased to its preallocated
    operand, never to the gradient operand.
    """
    n, h = 40, 24
    sizes, order = [7, 0, 13, 9, 11], [4, 2, 0, 3, 1]  # every mapped row moves: dst != src
    ss, si = jnp.array(sizes), jnp.array(order)
    x, _ = _inputs(n, h, seed=8)

    def vjp_fn(x, g):
        _, pull = jax.vjp(lambda x: te_jax_perm.sort_chunks_by_index(x, ss, si, backend=kernel_backend)[0], x)
        return pull(g)[0]

    bwd = jax.jit(vjp_fn, donate_argnums=(1,))

    # The backward's custom call: inputs (g, row_map, prealloc); its result must alias the
    # prealloc (operand 2), of which XLA then cannot hand out the gradient's memory.
    audit = te_jax_perm.audit_aliases(bwd, x, jnp.zeros((n, h), jnp.float32))
    assert audit.ok, str(audit)
    moves = _ours(audit, "sort_chunks")
    num_operands = len(cs.sort_chunks.decl.operands)
    for call in moves:
        assert call.aliases == {0: num_operands}, str(audit)
        assert call.aliases[0] != 0

    rng = np.random.default_rng(9)
    for it in range(6):
        g_np = rng.standard_normal((n, h)).astype(np.float32)
        expect = np_grad(g_np, n, sizes, order)
        got = np.asarray(bwd(x, jnp.asarray(g_np)))  # the fresh gradient array is donated
        np.testing.assert_array_equal(got, expect)
        # Interleave other calls and shapes in the same process.
        m = 8 + it
        y, _ = _inputs(m, 5, seed=it)
        other = te_jax_perm.sort_chunks_by_index(y, jnp.array([m - 3, 3]), jnp.array([1, 0]), backend=kernel_backend)[0]
        np.testing.assert_array_equal(np.asarray(other), np_sort_chunks(y, [m - 3, 3], [1, 0]))


# -- errors -----------------------------------------------------------------------------
def test_errors():
    x = jnp.zeros((10, 4))
    with pytest.raises(ValueError, match="sorted_indices.*shape \\(2,\\).*expected \\(3,\\)"):
        te_jax_perm.sort_chunks_by_index(x, jnp.array([1, 2, 3]), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="not a permutation"):
        te_jax_perm.sort_chunks_by_index(x, jnp.array([1, 2, 3]), jnp.array([0, 0, 1]))
    with pytest.raises(ValueError, match="not a permutation"):
        te_jax_perm.sort_chunks_by_index(x, jnp.array([1, 2, 3]), jnp.array([0, 1, 3]))
    with pytest.raises(TypeError, match="split_sizes.*dtype float32"):
        te_jax_perm.sort_chunks_by_index(x, jnp.array([1.0, 2.0]), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="split_sizes.*shape \\(1, 2\\).*rank 1"):
        te_jax_perm.sort_chunks_by_index(x, jnp.array([[1, 2]]), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="inp has shape \\(10,\\).*expected \\[N, H\\]"):
        te_jax_perm.sort_chunks_by_index(jnp.zeros(10), jnp.array([1]), jnp.array([0]))
    with pytest.raises(ValueError, match="probs has shape \\(9,\\).*expected \\(10,\\)"):
        te_jax_perm.sort_chunks_by_index_with_probs(x, jnp.array([1]), jnp.array([0]), jnp.zeros(9))
    with pytest.raises(ValueError, match="sum\\(split_sizes\\) = 11 exceeds.*10"):
        te_jax_perm.sort_chunks_by_index(x, jnp.array([5, 6]), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="negative"):
        te_jax_perm.sort_chunks_by_index(x, jnp.array([5, -1]), jnp.array([0, 1]))
    with pytest.raises(ValueError, match="at most 2048 chunks"):
        te_jax_perm.make_chunk_sort_map(jnp.zeros(2049, jnp.int32), jnp.arange(2049), 10)
    with pytest.raises(ValueError, match="at least one chunk"):
        te_jax_perm.sort_chunks_by_index(x, jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32))
    with pytest.raises(ValueError, match="row_id_map.*expected \\(10,\\) int32"):
        te_jax_perm.sort_chunks_by_map(x, jnp.zeros(9, jnp.int32))
    # Shape errors also fire at trace time under jit (sizes traced).
    with pytest.raises(ValueError, match="sorted_indices"):
        jax.jit(lambda s, o: te_jax_perm.sort_chunks_by_index(x, s, o)[0])(jnp.array([1, 2]), jnp.array([0]))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), h=st.integers(1, 9000), n=st.one_of(st.integers(1, 8), st.integers(1, 1 << 20)))
def test_default_configs_satisfy_their_declaration_whatever_the_table_holds(data, h, n):
    """A table entry of any declared config, at this width or another, never makes a row
    mover's default break a constraint its declaration states: it gives way to the rule."""
    from te_jax_perm.ops import tuned_defaults as TD
    decl = cs.sort_chunks_probs.decl
    entry = data.draw(st.sampled_from(decl.configs))
    width = data.draw(st.sampled_from([h, 2880, 4096]))
    table = {"sort_chunks_probs": {str(width): {str(data.draw(st.sampled_from([1, 64, 8192, 65536]))): entry.to_json()}}}
    with unittest.mock.patch.object(TD, "device_table", lambda: table):
        for d in (cs.sort_chunks.decl, decl):
            cfg = d.default_config({"N": n, "H": h}, {})
            assert d.violated({"N": n, "H": h}, {}, cfg) is None, (n, h, cfg)
