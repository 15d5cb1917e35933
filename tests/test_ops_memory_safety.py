"""No value of any input makes an op's kernel access memory outside its buffers.

Inputs that could reach a kernel out of bounds or return a silent wrong answer: chunk sizes whose int32 sum overflows, a combine given fewer rows than its
map addresses, corrupt row-id maps, a padded dispatch combined without its pad offsets, zero
experts, rows without columns, dtypes Triton cannot hold, and bit patterns that value moves would change. Each
runs on ``xla`` and the kernel backend; on ``interpret`` under the hazard sanitizer, which
reports any access outside a buffer.
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax_perm
from te_jax_perm.sanitize import OOB, sanitize
from tests import numpy_reference as ref
from tests.conftest import routing


@contextlib.contextmanager
def clean(backend, kinds=None):
    """Under the sanitizer on ``interpret``: no hazard (of ``kinds``, default all) may be
    reported. A no-op on other backends."""
    if backend != "interpret":
        yield
        return
    with sanitize() as report:
        yield
    assert report.launches, "no kernel launch was observed"
    if kinds is None:
        assert not report, report.text()
    else:
        assert not [h for k in kinds for h in report.of_kind(k)], report.text()


def np_chunk_sort(x, sizes, order):
    """Output chunk j = input chunk order[j], chunks truncated where the input ends (exact ints)."""
    n = x.shape[0]
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(sizes, np.int64), 0)), n)
    starts = np.concatenate([[0], ends[:-1]])
    src = np.concatenate([np.arange(starts[c], ends[c]) for c in order]).astype(np.int64)
    out = np.zeros_like(x)
    out[:len(src)] = x[src]
    row_map = np.full(n, -1, np.int32)
    row_map[src] = np.arange(len(src))
    return out, row_map


# -- 1. chunk sizes whose int32 sum overflows ---------------------------------------------
@pytest.mark.parametrize("sizes", [[2**30, 2**30], [2**31 - 1, 5], [3, 2**31 - 1, 2**31 - 1], [4, -7, 2**31 - 1]])
@pytest.mark.parametrize("order", [[0, 1], [1, 0]])
def test_chunk_sort_overflowing_traced_sizes_truncate_at_the_input_end(backend, sizes, order):
    order = (order + [2])[:len(sizes)] if len(sizes) == 3 else order
    n, h = 10, 3
    x = jnp.asarray(np.random.default_rng(0).standard_normal((n, h)), jnp.float32)
    want, want_map = np_chunk_sort(np.asarray(x), sizes, order)
    f = jax.jit(lambda x, s, o: te_jax_perm.sort_chunks_by_index(x, s, o, backend=backend))
    with clean(backend):
        out, row_map = f(x, jnp.asarray(sizes, jnp.int32), jnp.asarray(order, jnp.int32))
        g = jax.jit(jax.grad(lambda x, s, o: jnp.sum(f(x, s, o)[0] * 2.0)))(
            x, jnp.asarray(sizes, jnp.int32), jnp.asarray(order, jnp.int32))
        jax.block_until_ready((out, row_map, g))
    np.testing.assert_array_equal(np.asarray(row_map), want_map)
    np.testing.assert_array_equal(np.asarray(out), want)
    np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(np.where((want_map >= 0)[:, None], 2.0, 0.0), g.shape))


# -- 2. combine given fewer rows than its map addresses; corrupt maps ----------------------
def _dispatched(t=8, e=4, k=2, h=16, seed=0):
    rng = np.random.default_rng(seed)
    rm = routing(rng, t, e, k, "uniform")
    x = rng.standard_normal((t, h)).astype(np.float32)
    w = rng.random((t, e)).astype(np.float32)
    out, _, rid, _, _ = te_jax_perm.token_dispatch(x, rm, int(rm.sum()), backend="xla")
    return rm, np.asarray(out), np.asarray(rid), w


def _traced_combine(inp, row_id_map, merging_probs, backend):
    return jax.jit(lambda a, r, w: te_jax_perm.token_combine(a, r, w, backend=backend))(inp, row_id_map, merging_probs)


def test_combine_of_a_short_input_reads_nothing_past_it(backend):
    """A traced map built for 16 rows, 13 given: rows the input lacks contribute nothing
    (a concrete map raises, see test_input_checks.py)."""
    rm, out, rid, w = _dispatched()
    short = out[:13]
    dest = ref.dispatch_layout(rm, int(rm.sum()), None)[0]
    dest = np.where(dest < 13, dest, -1)
    with clean(backend):
        y, pull = jax.vjp(lambda a, b: _traced_combine(a, rid, b, backend), short, w)
        g = np.ones(y.shape, np.float32)
        gy, gw = pull(g)
        jax.block_until_ready((y, gy, gw))
    np.testing.assert_allclose(np.asarray(y), ref.combine(short, dest, w), rtol=1e-6, atol=1e-6)
    e_gy, e_gw = ref.combine_vjp(g, short, dest, w)
    np.testing.assert_allclose(np.asarray(gy), e_gy, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gw), e_gw, rtol=1e-5, atol=1e-5)


def test_corrupt_row_id_maps_stay_inside_the_buffers(backend):
    """Traced maps with destinations past the buffer or negative, expert ids outside [0, E),
    routed counts above E or negative: every such entry is absent, on every backend alike. (The backward
    scatter of a map with holes may race on the rows it leaves unwritten - an undefined
    value, never an access outside a buffer.)"""
    rm, out, rid, w = _dispatched()
    e = rm.shape[1]
    bad = rid.copy()
    bad[0, 0] = 10**6            # destination far past the rows
    bad[1, 0] = -5               # negative destination
    bad[2, e] = 7 * e            # expert id past E
    bad[3, e + 1] = -3           # negative expert id
    bad[4, 2 * e] = 2**31 - 1    # routed count far past E
    bad[5, 2 * e] = -2           # negative routed count
    results = {}
    for b in ("xla", backend):
        with clean(b):
            y, pull = jax.block_until_ready(
                jax.vjp(lambda a, c: _traced_combine(a, bad, c, b), out, w))
        with clean(b, kinds=(OOB,)):
            gy, gw = jax.block_until_ready(pull(np.ones(y.shape, np.float32)))
        results[b] = (y, gw)
    for a, c in zip(results["xla"], results[backend]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=1e-6, atol=1e-6)
    untouched = slice(6, None)  # tokens whose map rows were left valid combine as before
    np.testing.assert_allclose(np.asarray(results["xla"][0])[untouched],
                               np.asarray(te_jax_perm.token_combine(out, rid, w, backend="xla"))[untouched],
                               rtol=1e-6)


def test_chunk_sort_by_a_corrupt_map_stays_inside_the_buffers(backend):
    x = jnp.arange(24, dtype=jnp.float32).reshape(8, 3)
    bad = jnp.asarray([7, 10**6, -9, 0, 2**31 - 1, 1, 2, 3], jnp.int32)
    for forward in (True, False):
        f = lambda b: jax.jit(lambda x, m: te_jax_perm.sort_chunks_by_map(x, m, is_forward=forward, backend=b))
        with clean(backend):
            got = jax.block_until_ready(f(backend)(x, bad))
        want = f("xla")(x, bad)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


# -- 3. a padded dispatch combined without its pad offsets ---------------------------------
def test_padded_dispatch_combined_without_pad_offsets_returns_the_right_tokens(backend):
    rng = np.random.default_rng(7)
    t, e, h, align = 8, 4, 16, 4
    rm = routing(rng, t, e, 2, "hot")
    x = rng.standard_normal((t, h)).astype(np.float32)
    w = rng.random((t, e)).astype(np.float32)
    n = int(rm.sum())
    out, _, rid, pad, _ = te_jax_perm.token_dispatch(x, rm, n, align_size=align, backend=backend)
    _, _, dest, _, _ = ref.dispatch(x, rm, n, None, align)
    want = ref.combine(np.asarray(out), dest, w)
    for offsets in (pad, None):
        got = te_jax_perm.token_combine(out, rid, w, offsets, backend=backend)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"pad_offsets has shape \(3,\); expected \[E=4\]"):
        te_jax_perm.token_combine(out, rid, w, pad[:3], backend=backend)


# -- 8. zero experts; dtypes Triton cannot hold -------------------------------------------
def test_zero_experts(backend):
    x = np.ones((4, 8), np.float32)
    rm = np.zeros((4, 0), bool)
    out, pp, rid, pad, tpe = te_jax_perm.token_dispatch(x, rm, 0, backend=backend)
    assert out.shape == (0, 8) and rid.shape == (4, 1) and tpe.shape == (0,)
    np.testing.assert_array_equal(np.asarray(rid), np.zeros((4, 1), np.int32))
    np.testing.assert_array_equal(np.asarray(te_jax_perm.token_combine(out, rid, backend=backend)), np.zeros((4, 8)))
    rid2, kept = te_jax_perm.make_row_id_map(rm, backend=backend)
    assert rid2.shape == (4, 1) and kept.shape == (0,)


def test_rows_without_columns_still_move_their_probabilities(backend):
    """H = 0: no row has a column, yet the permuted probabilities, the probabilities'
    gradients and the combine's weight gradient are values every backend writes (a kernel
    whose programs were all column slices would leave them as allocated)."""
    rng = np.random.default_rng(3)
    rm = routing(rng, 8, 4, 2, "uniform")
    n = int(rm.sum())
    p = (rng.random((8, 4)) * rm).astype(np.float32)
    x, y = np.zeros((8, 0), np.float32), np.zeros((n, 0), np.float32)

    def step(b):
        def f(p, w, x, y):
            _, pp, rid, _, _ = te_jax_perm.token_dispatch(x, rm, n, probs=p, backend=b)
            combined = te_jax_perm.token_combine(y, rid, merging_probs=w, backend=b)
            _, cp, _ = te_jax_perm.sort_chunks_by_index_with_probs(
                x, jnp.asarray([3, 5]), jnp.asarray([1, 0]), p[:, 0], backend=b)
            return jnp.sum(pp * jnp.arange(n)) + jnp.sum(cp * jnp.arange(8)) + jnp.sum(combined), (pp, cp)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(p, p, x, y)

    with clean(backend):
        got = jax.block_until_ready(step(backend))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(step("xla"))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("dtype", [jnp.complex64, jnp.bool_, jnp.int8, jnp.uint16, jnp.float8_e5m2])
def test_chunk_sort_moves_any_dtype(backend, dtype):
    rng = np.random.default_rng(1)
    raw = rng.standard_normal((9, 5)) * 4
    x = jnp.asarray(raw + 1j * raw[::-1] if dtype == jnp.complex64 else raw).astype(dtype)
    sizes, order = [2, 4, 3], [2, 0, 1]
    out, _ = te_jax_perm.sort_chunks_by_index(x, jnp.asarray(sizes), jnp.asarray(order), backend=backend)
    assert out.dtype == x.dtype
    want, _ = np_chunk_sort(np.asarray(x), sizes, order)
    np.testing.assert_array_equal(np.asarray(out), want)


# -- row moves carry bits: every bf16 pattern, NaN payloads included -----------------------
def _all_bf16_patterns():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16).reshape(256, 256)
    return bits, jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)


def test_dispatch_moves_every_bf16_bit_pattern_exactly(backend):
    bits, x = _all_bf16_patterns()
    t, e = x.shape[0], 4
    rm = np.zeros((t, e), bool)
    rm[np.arange(t), np.arange(t) % e] = True
    rm[np.arange(t), (np.arange(t) + 1) % e] = True
    out, _, rid, _, _ = te_jax_perm.token_dispatch(x, rm, 2 * t, backend=backend)
    got = np.asarray(jax.lax.bitcast_convert_type(out, jnp.uint16))
    dest = ref.dispatch_layout(rm, 2 * t, None)[0]
    for ex in range(e):
        tok = np.nonzero(dest[:, ex] >= 0)[0]
        np.testing.assert_array_equal(got[dest[tok, ex]], bits[tok])


def test_chunk_sort_moves_every_bf16_bit_pattern_exactly(backend):
    bits, x = _all_bf16_patterns()
    sizes, order = [100, 56, 100], [2, 0, 1]
    out, row_map = te_jax_perm.sort_chunks_by_index(x, jnp.asarray(sizes), jnp.asarray(order), backend=backend)
    want, _ = np_chunk_sort(bits, sizes, order)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(out, jnp.uint16)), want)
    back, _ = te_jax_perm.sort_chunks_by_map(out, row_map, is_forward=False, backend=backend)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(back, jnp.uint16)), bits)
