"""Lower-level permute/unpermute primitives and their kernel declarations."""
import functools
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import te_jax_perm
from te_jax_perm.core import Config
from te_jax_perm.ops.permute import decl as D
from tests import numpy_reference as ref
from tests.conftest import compiled_for_sm90, routing


def _setup(seed=0, t=11, h=67, e=5, k=2, mode="hot", budget=1.0):
    rng = np.random.default_rng(seed)
    rm = routing(rng, t, e, k, mode)
    n = int(rm.sum() * budget)
    x = rng.standard_normal((t, h)).astype(np.float32)
    p = rng.random((t, e)).astype(np.float32)
    return rm, n, x, p


@pytest.mark.parametrize("align", [None, 4])
@pytest.mark.parametrize("budget", [1.0, 0.5, 1.5])
def test_permute_unpermute_lower_level(backend, align, budget):
    rm, n, x, p = _setup(budget=budget)
    rid, kept = te_jax_perm.make_row_id_map(rm, n, backend=backend)
    e_out, e_pp, dest, e_pad, _ = ref.dispatch(x, rm, n, p, align)
    pad = None if align is None else jnp.asarray(e_pad, jnp.int32)
    rows = e_out.shape[0]
    out, pp = te_jax_perm.permute_with_mask_map(x, rid, kept, rows, probs=p, pad_offsets=pad, backend=backend)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(pp), e_pp)
    out2, none = te_jax_perm.permute_with_mask_map(x, rid, kept, rows, pad_offsets=pad, backend=backend)
    assert none is None
    np.testing.assert_array_equal(np.asarray(out2), e_out)
    back = te_jax_perm.unpermute_with_mask_map(out, rid, p, pad, backend=backend)
    np.testing.assert_allclose(np.asarray(back), ref.combine(e_out, dest, p), rtol=1e-5, atol=1e-6)
    # tokens_per_expert given or recovered from the map: same backward
    g = np.random.default_rng(1).standard_normal(back.shape).astype(np.float32)
    for tpe in (None, kept):
        _, vjp = jax.vjp(lambda y, w: te_jax_perm.unpermute_with_mask_map(y, rid, w, pad, tpe, backend=backend),
                         out, p)
        gy, gw = vjp(g)
        e_gy, e_gw = ref.combine_vjp(g, e_out, dest, p)
        np.testing.assert_allclose(np.asarray(gy), e_gy, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(gw), e_gw, rtol=1e-4, atol=1e-5)


def _hostile_map(seed, t, e, n):
    """(row-id map, pad offsets): duplicate destinations (within a token and across
    tokens), rows past ``n`` and negative, expert ids outside [0, E), routed counts above E
    and negative."""
    rng = np.random.default_rng(seed)
    rid = np.full((t, 2 * e + 1), -1, np.int32)
    rid[:, 2 * e] = rng.integers(-1, e + 2, t)
    rid[:, :e] = rng.integers(-2, n + 3, (t, e))
    rid[:, e:2 * e] = rng.integers(-1, e + 1, (t, e))
    # Certain, not left to chance: token 0's first two entries name row 2 (and token 1's
    # first names it too), both with an expert in range and counted.
    rid[:2, 2 * e] = e
    rid[0, :2] = rid[1, 0] = 2
    rid[:2, e:e + 2] = [[0, 1], [1, 0]]
    return rid, rng.integers(0, 3, e).astype(np.int32)


@pytest.mark.parametrize("t,e,n", [(9, 4, 12), (7, 20, 40)], ids=["E4", "E20"])
def test_row_owner_kernel_matches_its_reference_on_hostile_maps(kernel_backend, t, e, n):
    """Duplicate destinations, out-of-range rows and expert ids, negative counts: the
    kernel and the reference name the same one writer per row (the highest entry). At
    E = 20 routed counts exceed one step of map columns, so later steps run too."""
    rid, pad = _hostile_map(5, t, e, n)
    rng = np.random.default_rng(5)
    y = rng.standard_normal((n, 24)).astype(np.float32)
    w = rng.random((t, e)).astype(np.float32)
    for padded in (False, True):
        got = [np.asarray(D.row_owner(rid, pad, backend=b, num_out_rows=n, padded=padded)[0])
               for b in ("xla", kernel_backend)]
        np.testing.assert_array_equal(got[1], got[0])
        assert (got[0] > 0).any() and (got[0] == 0).any()
        # The combine forward's _owner variants fill the same table beside their sums.
        kw = dict(backend=kernel_backend, padded=padded)
        for plain, with_owner in (((D.unpermute(y, rid, pad, **kw)), D.unpermute_owner(y, rid, pad, **kw)),
                                  (D.unpermute_weighted(y, rid, pad, w, **kw),
                                   D.unpermute_weighted_owner(y, rid, pad, w, **kw))):
            np.testing.assert_array_equal(np.asarray(with_owner[1]), got[0])
            np.testing.assert_array_equal(np.asarray(with_owner[0]), np.asarray(plain[0]))


@pytest.mark.parametrize("counts", ["routed", "zeros", "huge"])
def test_permute_ignores_counts_that_disagree_with_the_map(kernel_backend, counts):
    """The rows written are derived from the map on the device: the pre-drop routed counts
    (what TransformerEngine reports), zeros or nonsense give the same, fully written output."""
    rm, n, x, p = _setup(budget=0.6)
    rid, kept = te_jax_perm.make_row_id_map(rm, n, backend="xla")
    e_out, e_pp, _, e_pad, _ = ref.dispatch(x, rm, n, p, 4)
    pad = jnp.asarray(e_pad, jnp.int32)
    tpe = {"routed": rm.sum(0), "zeros": 0 * rm.sum(0), "huge": rm.sum(0) * 1000}[counts].astype(np.int32)
    for b in ("xla", kernel_backend):
        out, pp = te_jax_perm.permute_with_mask_map(x, rid, tpe, e_out.shape[0], probs=p, pad_offsets=pad, backend=b)
        np.testing.assert_array_equal(np.asarray(out), e_out)
        np.testing.assert_array_equal(np.asarray(pp), e_pp)


@pytest.mark.parametrize("n", [5, 8], ids=["grad_row_per_entry", "grad_row_once"])
def test_duplicate_destinations_have_one_writer_on_every_backend(kernel_backend, n):
    """A map sending two tokens to one row: the later token writes it, on every backend,
    forward and backward (combine gradient rows and weights), and no row is left unwritten;
    with fewer than two rows per token and with more (where the combine backward loads each
    gradient row once for all its rows)."""
    t, e, h = 4, 2, 8
    assert D.unpermute_bwd_weighted.decl.constexprs(
        {"T": t, "H": h, "N": n, "E": e}, {"padded": False},
        D.unpermute_bwd_weighted.decl.default_config({"T": t, "H": h, "N": n, "E": e, "W": 2 * e + 1, "R": n},
                                                     {"padded": False}))["GRAD_ONCE"] == (n >= 2 * t)
    rid = np.full((t, 2 * e + 1), -1, np.int32)
    for tok, (dests, experts) in enumerate([([0, 1], [0, 1]), ([0, 2], [0, 1]), ([3, -1], [1, -1]), ([1, 4], [0, 1])]):
        k = sum(d >= 0 for d in dests)
        rid[tok, :k], rid[tok, e:e + k], rid[tok, 2 * e] = dests[:k], experts[:k], k
    x = np.arange(t * h, dtype=np.float32).reshape(t, h) + 1
    w = np.random.default_rng(0).random((t, e)).astype(np.float32)
    kept = np.zeros(e, np.int32)
    def run(b):
        # One jitted program per backend: eager, the xla backend's ops each launch (and,
        # under the GPU memcheck, each instrument) a program of their own.
        def f(x, w):
            out, _ = te_jax_perm.permute_with_mask_map(x, rid, kept, n, backend=b)
            _, vjp = jax.vjp(lambda y, ww: te_jax_perm.unpermute_with_mask_map(y, rid, ww, backend=b), out, w)
            return (out, *vjp(jnp.ones((t, h), jnp.float32)))
        return [np.asarray(a) for a in jax.jit(f)(x, w)]

    outs = [run(b) for b in ("xla", kernel_backend)]
    for got, want in zip(outs[1], outs[0]):
        np.testing.assert_array_equal(got, want)
    out = outs[0][0]
    np.testing.assert_array_equal(out[0], x[1])  # row 0: tokens 0 and 1 -> token 1
    np.testing.assert_array_equal(out[1], x[3])  # row 1: tokens 0 and 3 -> token 3
    assert np.isfinite(out).all()


@pytest.mark.parametrize("n", [12, 40], ids=["one_row_in_flight", "two_rows_in_flight"])
@pytest.mark.parametrize("padded", [False, True])
def test_gathers_add_every_entry_of_a_hostile_map(backend, padded, n):
    """Combine forward (weighted or not) and dispatch backward (rows and probability
    gradients) add a row once per map entry naming it, whatever else names it: each
    backend agrees with a NumPy loop, also under vmap, and writes every output element, with
    one row load in flight per program and (from four rows per token) two.
    (One backend per test: the kernel backend's run is also a hostile case under the GPU
    memcheck, where the xla backend's eager loops would only take time.)"""
    t, e, h = 9, 4, 24
    assert D.several_rows_per_token({"N": n, "T": t}) == (n >= 18)
    rids = np.stack([_hostile_map(seed, t, e, n)[0] for seed in (6, 7)])
    pad = _hostile_map(6, t, e, n)[1]
    rng = np.random.default_rng(6)
    y = rng.standard_normal((n, h)).astype(np.float32)
    w = rng.random((t, e)).astype(np.float32)
    gpp = rng.standard_normal(n).astype(np.float32)
    want = []
    for rid in rids:
        rows, gp = ref.map_gather(y, rid, pad if padded else None, gpp=gpp)
        want.append((rows, ref.map_gather(y, rid, pad if padded else None, w)[0], rows, gp))

    def gathers(rid):
        kw = dict(backend=backend, padded=padded)
        return (*D.unpermute(y, rid, pad, **kw), *D.unpermute_weighted(y, rid, pad, w, **kw),
                *D.permute_bwd_probs(y, rid, pad, gpp, **kw))

    got = [[np.asarray(a) for a in gathers(rids[0])], [np.asarray(a)[1] for a in jax.vmap(gathers)(rids)]]
    for outs, expected in zip(got, want):
        assert all(np.isfinite(a).all() for a in outs)  # the interpreter's outputs start as NaN
        for a, x in zip(outs, expected):
            np.testing.assert_allclose(a, x, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(outs[3], expected[3])  # copies of gpp


# The combine backward's two ways through a row: a token per program in 16-column steps,
# the gradient row loaded per column; two tokens a program in one 32-column tile, the row
# loaded once where the map has two rows per token (at E = 20).
_COMBINE_BWD_CONFIGS = [Config.make(num_warps=2, BLOCK_H=16, ROWS=1), Config.make(num_warps=2, BLOCK_H=32, ROWS=2)]


@pytest.mark.parametrize("cfg", _COMBINE_BWD_CONFIGS, ids=str)
@pytest.mark.parametrize("t,e,n", [(9, 4, 12), (7, 20, 40)], ids=["E4", "E20"])
def test_combine_backward_through_a_hostile_map(kernel_backend, cfg, t, e, n):
    """Duplicate rows and experts within a token and across tokens, rows and experts out of
    range, routed counts above E and negative: every config writes each row once (by its
    owner) and each token's row of weight gradients (the later entry's where one expert is
    named twice), as a NumPy loop over the entries does, and as the xla backend does."""
    rid, pad = _hostile_map(11, t, e, n)
    rng = np.random.default_rng(11)
    g = rng.standard_normal((t, 24)).astype(np.float32)
    y = rng.standard_normal((n, 24)).astype(np.float32)
    w = rng.random((t, e)).astype(np.float32)
    dup = [(tok, int(x)) for tok in range(t) for x in set(rid[tok, e:2 * e]) if (rid[tok, e:2 * e] == x).sum() > 1]
    assert dup  # experts named twice by one token: which gradient is kept is checked
    for padded in (False, True):
        (owner,) = D.row_owner(rid, pad, backend="xla", num_out_rows=n, padded=padded)
        want = ref.map_scatter_weighted(g, y, rid, pad if padded else None, w)
        for b in ("xla", kernel_backend):
            got = D.unpermute_bwd_weighted(g, rid, pad, owner, w, y, backend=b, padded=padded,
                                           config=None if b == "xla" else cfg)
            for a, x in zip(got, want):
                a = np.asarray(a)
                assert np.isfinite(a).all()  # the interpreter's outputs start as NaN
                np.testing.assert_allclose(a, x, rtol=1e-5, atol=1e-5)


def test_gathers_through_a_malformed_map_by_hand(kernel_backend):
    """The public combine and dispatch backward through a small traced map, on every
    backend: a row named twice by one token and once by another, rows past the input and
    negative, a routed count above E and a negative one; of two entries naming one expert,
    the later gives its probability gradient."""
    e = 2
    rid = np.array([[1, 1, 0, 1, 2],     # row 1 twice
                    [1, 9, 1, 0, 2],     # row 1 again; row 9 past the 4 rows
                    [-3, 2, 0, 0, 7],    # count 7 > E: both columns; a negative row
                    [0, 3, 1, 1, 2],     # expert 1 twice: row 3's gradient wins
                    [0, 0, 0, 0, -1]],   # negative count: nothing
                   np.int32)
    y = np.arange(1, 9, dtype=np.float32).reshape(4, 2)
    w = np.array([[0.5, 0.25], [2, 4], [1, 3], [0.5, 2], [9, 9]], np.float32)
    gpp = np.array([10, 20, 30, 40], np.float32)
    rows = [[6, 8], [3, 4], [5, 6], [8, 10], [0, 0]]
    for b in ("xla", kernel_backend):
        combine = jax.jit(lambda y, r, w: te_jax_perm.unpermute_with_mask_map(y, r, w, backend=b))
        np.testing.assert_array_equal(np.asarray(combine(y, rid, None)), rows)
        np.testing.assert_array_equal(np.asarray(combine(y, rid, w)), [[2.25, 3], [12, 16], [5, 6], [16, 20], [0, 0]])

        def dispatch_bwd(r):
            f = lambda x, p: te_jax_perm.permute_with_mask_map(x, r, jnp.zeros(e, jnp.int32), 4, probs=p,  # noqa: E731
                                                               backend=b)
            return jax.vjp(f, jnp.zeros((5, 2), jnp.float32), jnp.zeros((5, e), jnp.float32))[1]((y, gpp))

        gx, gp = jax.jit(dispatch_bwd)(rid)
        np.testing.assert_array_equal(np.asarray(gx), rows)
        np.testing.assert_array_equal(np.asarray(gp), [[20, 20], [0, 20], [30, 0], [0, 40], [0, 0]])


# Configs that change ROWS (token ranges per program) and BLOCK_H (loop over H): all exact.
_SOME_CONFIGS = [Config.make(num_warps=2, BLOCK_H=32, ROWS=1), Config.make(num_warps=4, BLOCK_H=64, ROWS=4),
                 Config.make(num_warps=4, BLOCK_H=128, ROWS=2)]


@pytest.mark.parametrize("cfg", _SOME_CONFIGS, ids=str)
def test_every_kernel_config_matches_reference(kernel_backend, cfg):
    rm, n, x, p = _setup(t=9, h=67, budget=0.8)
    rid, kept = te_jax_perm.make_row_id_map(rm, n, backend="xla")
    e_out, e_pp, dest, e_pad, _ = ref.dispatch(x, rm, n, p, 4)
    pad = jnp.asarray(e_pad, jnp.int32)
    rows = e_out.shape[0]
    (owner,) = D.row_owner(rid, pad, backend="xla", num_out_rows=rows, padded=True)
    for b in ("xla", kernel_backend):
        out, pp = D.permute_probs(x, rid, pad, owner, p, backend=b, config=cfg if b != "xla" else None,
                                  num_out_rows=rows, padded=True)
        np.testing.assert_array_equal(np.asarray(out), e_out)
        np.testing.assert_array_equal(np.asarray(pp), e_pp)
        (y,) = D.unpermute_weighted(out, rid, pad, p, backend=b, config=cfg if b != "xla" else None,
                                        padded=True)
        np.testing.assert_allclose(np.asarray(y), ref.combine(e_out, dest, p), rtol=1e-5, atol=1e-6)


def test_declarations_prune_bad_configs():
    d = {"T": 4, "H": 64, "E": 2, "W": 5}
    decl = D.permute.decl
    assert decl.violated(d, {}, Config.make(BLOCK_H=96, ROWS=1))  # not a power of two
    assert decl.violated(d, {}, Config.make(BLOCK_H=4096, ROWS=1))  # far wider than H
    assert decl.violated(d, {}, Config.make(BLOCK_H=64, ROWS=8))  # more rows than tokens
    assert decl.violated(d, {}, Config.make(BLOCK_H=64, ROWS=0))
    assert decl.violated(d, {}, decl.default_config(d, {})) is None
    big = {"T": 16384, "H": 7168, "E": 256, "W": 513}
    valid = [c for c in decl.configs if decl.violated(big, {}, c) is None]
    assert decl.default_config(big, {}) in decl.configs and len(valid) > 10


def test_lower_level_errors():
    rid = np.zeros((4, 7), np.int32)
    x = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match=r"row_id_map has shape \(4, 7\); expected \[T=3, 2E\+1\]"):
        te_jax_perm.permute_with_mask_map(x[:3], rid, np.zeros(3, np.int32), 8)
    with pytest.raises(ValueError, match=r"tokens_per_expert has shape \(2,\); expected \[E=3\]"):
        te_jax_perm.permute_with_mask_map(x, rid, np.zeros(2, np.int32), 8)
    with pytest.raises(ValueError, match=r"pad_offsets has shape \(4,\); expected \[E=3\]"):
        te_jax_perm.permute_with_mask_map(x, rid, np.zeros(3, np.int32), 8, pad_offsets=np.zeros(4, np.int32))
    with pytest.raises(TypeError, match="row_id_map has dtype int64; expected int32"):
        te_jax_perm.unpermute_with_mask_map(x, np.zeros((4, 7), np.int64))


# -- code generation ------------------------------------------------------------------------
def _sm90_ptx(decl, dims, params, dtypes):
    """PTX of ``decl``'s kernel at its default config for sm_90, compiled here (no GPU
    needed) exactly as the ``triton`` backend compiles it (same specialisation)."""
    from te_jax_perm.core import bind_call
    avals = [jax.ShapeDtypeStruct(tuple(dims[d] for d in op.dims), dtypes[op.name]) for op in decl.operands]
    call = bind_call(decl, avals, params, "triton")
    return compiled_for_sm90(call, decl.default_config(call.dims, call.params)).ptx


def _row_kernels():
    from benchmarks.copy_baseline import device_copy_primitive
    from te_jax_perm.ops.chunk_sort import decl as cs
    idx = {"row_id_map": "int32", "pad_offsets": "int32", "owner": "int32"}
    rows = {"T": 4096, "E": 256, "W": 513, "N": 4096 * 8, "R": 4096 * 8}
    scatter = {"num_out_rows": 4096 * 8, "padded": True}
    return [
        ("permute", D.permute.decl, rows, scatter, {**idx, "inp": "bfloat16"}),
        ("permute_probs", D.permute_probs.decl, rows, scatter, {**idx, "inp": "bfloat16", "probs": "float32"}),
        ("unpermute_bwd_weighted", D.unpermute_bwd_weighted.decl, rows, {"padded": True},
         {**idx, "grad": "bfloat16", "merging_probs": "float32", "fwd_inp": "bfloat16"}),
        ("unpermute", D.unpermute.decl, rows, {"padded": False}, {**idx, "inp": "bfloat16"}),
        ("unpermute_weighted", D.unpermute_weighted.decl, rows, {"padded": True},
         {**idx, "inp": "bfloat16", "merging_probs": "float32"}),
        ("unpermute_weighted_owner", D.unpermute_weighted_owner.decl, rows, {"padded": True},
         {**idx, "inp": "bfloat16", "merging_probs": "float32"}),
        ("permute_bwd_probs", D.permute_bwd_probs.decl, rows, {"padded": True},
         {**idx, "inp": "bfloat16", "grad_permuted_probs": "float32"}),
        ("sort_chunks_probs", cs.sort_chunks_probs.decl, {"N": 8192}, {},
         {"inp": "bfloat16", "src_map": "int32", "probs": "float32"}),
        # An odd element count: only the ragged last program may mask.
        ("device_copy", device_copy_primitive.decl, {"N": 8192 * 7 + 3}, {}, {"src": "bfloat16"}),
    ]


@pytest.mark.parametrize("h", [7168, 2880])
@pytest.mark.parametrize("case", _row_kernels(), ids=lambda c: c[0])
def test_row_kernels_vectorise_for_sm90(case, h):
    """Every row-moving kernel compiles to 16-byte loads and stores of bf16 rows, also at
    H=2880 (a multiple of 16 but not of 128): H is compiled in (the copy is flat: N * H)."""
    import re
    name, decl, dims, params, dtypes = case
    dims = {**dims, "H": h} if "H" in decl.kernel.arg_names else {"N": dims["N"] * h}
    ptx = _sm90_ptx(decl, dims, params, dtypes)
    assert re.search(r"ld\.global[\w.:]*\.v4\.b32", ptx), "row loads are not 16-byte vectors"
    assert re.search(r"st\.global[\w.:]*\.v4\.b32", ptx), "row stores are not 16-byte vectors"
    if name != "device_copy":  # the copy's ragged last program alone masks element-wise
        # No element-wise (2-byte) row accesses left behind, e.g. in a zero fill.
        assert not re.search(r"(ld|st)\.global[\w.:]*\.(b16|u16)\b", ptx), "2-byte row accesses remain"


def test_kernels_fuse_multiply_adds_whatever_tritons_default(monkeypatch):
    """The combine forward's weighted sum compiles to fused multiply-adds (one rounding, as
    measured and tested) also where Triton's own default turns fusion off."""
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    idx = {"row_id_map": "int32", "pad_offsets": "int32", "owner": "int32"}
    # A row width no other test compiles: the compile cache cannot answer with another's PTX.
    dims = {"T": 512, "E": 64, "W": 129, "N": 512 * 4, "R": 512 * 4, "H": 1040}
    ptx = _sm90_ptx(D.unpermute_weighted.decl, dims, {"padded": True},
                    {**idx, "inp": "bfloat16", "merging_probs": "float32"})
    assert "fma.rn.f32" in ptx and "mul.rn.f32" not in ptx


@pytest.mark.parametrize("n", [1, 2048, 3 * 1024 + 5])
def test_device_copy_full_and_ragged_tiles(kernel_backend, n):
    """Unmasked full tiles, then one masked ragged program (n not a multiple of the tile)."""
    from benchmarks.copy_baseline import device_copy
    x = np.random.default_rng(n).standard_normal(n).astype(jnp.bfloat16)
    for cfg in (None, Config.make(num_warps=4, BLOCK=1024, ITERS=2)):
        np.testing.assert_array_equal(np.asarray(device_copy(x, backend=kernel_backend, config=cfg)), x)


def test_numpy_row_id_map_reference_matches_make_row_id_map():
    """The NumPy run of ``row_id_map_reference`` (autotuning trial operands) is the map the
    kernels build, and the independent loop reference's."""
    from te_jax_perm.ops.row_id_map.reference import row_id_map_reference
    rng = np.random.default_rng(3)
    rm = routing(rng, 13, 6, 3, "hot")
    for drop_at in (int(rm.sum()), 7, 0):
        rid, kept = te_jax_perm.make_row_id_map(rm, drop_at, backend="xla")
        e_rid, e_kept = row_id_map_reference(rm, drop_at, xp=np)
        assert isinstance(e_rid, np.ndarray) and e_rid.dtype == np.int32 and e_kept.dtype == np.int32
        np.testing.assert_array_equal(np.asarray(rid), e_rid)
        np.testing.assert_array_equal(np.asarray(kept), e_kept)
        np.testing.assert_array_equal(e_rid, ref.row_id_map(rm, drop_at))


_EXAMPLE_DECLS = [(D.row_owner, {"num_out_rows": 40, "padded": True}),
                  (D.permute, {"num_out_rows": 40, "padded": True}),
                  (D.permute_probs, {"num_out_rows": 23, "padded": False}),
                  (D.unpermute_bwd_weighted, {"padded": True}),
                  (D.unpermute, {"padded": False}),
                  (D.unpermute_weighted, {"padded": True}),
                  (D.unpermute_weighted_owner, {"padded": True}),
                  (D.permute_bwd_probs, {"padded": True})]


@pytest.mark.parametrize("prim,params", _EXAMPLE_DECLS, ids=[p.decl.name for p, _ in _EXAMPLE_DECLS])
def test_example_inputs_are_valid_operands(kernel_backend, prim, params):
    """Autotuning trial operands: the right shapes, a real map, kernel == reference on them."""
    decl = prim.decl
    dims = {"T": 9, "H": 40, "E": 5, "W": 11, "N": 40, "R": params.get("num_out_rows", 40)}
    dtypes = {o.name: np.dtype(np.float32) for o in decl.operands}
    dtypes.update({o.name: np.dtype(np.int32) for o in decl.operands if o.dtypes == ("int32",)})
    ops = decl.example_inputs(dims, params, dtypes, np.random.default_rng(0))
    for op, a in zip(decl.operands, ops):
        assert a.shape == tuple(dims[d] for d in op.dims) and a.dtype == dtypes[op.name], op.name
    rid = ops[[o.name for o in decl.operands].index("row_id_map")]
    assert (rid[:, :5] >= 0).any() and (rid[:, 10] == (rid[:, 5:10] >= 0).sum(axis=1)).all()
    cfg = Config.make(num_warps=2, BLOCK_H=32, ROWS=2) if "BLOCK_H" in decl.kernel.arg_names else None
    got = prim(*ops, backend=kernel_backend, config=cfg, **params)
    want = prim(*ops, backend="xla", **params)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


# -- sharding: row movers are shard-local along H -------------------------------------------
_SHARD_SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as PS
import te_jax_perm
from benchmarks.copy_baseline import device_copy
from tests import numpy_reference as ref
from tests.conftest import routing

mesh = Mesh(np.array(jax.devices()), ("d",))
rng = np.random.default_rng(0)
rm = routing(rng, 12, 4, 2, "uniform")
x = rng.standard_normal((12, 64)).astype(np.float32)
p = rng.random((12, 4)).astype(np.float32)
rid, kept = te_jax_perm.make_row_id_map(rm, backend="xla")
n = int(rm.sum())
hs = NamedSharding(mesh, PS(None, "d"))

def layer(x, p):
    y, _ = te_jax_perm.permute_with_mask_map(x, rid, kept, n, backend="xla")
    z = te_jax_perm.unpermute_with_mask_map(y, rid, p, backend="xla")
    s, _ = te_jax_perm.sort_chunks_by_map(y, jnp.arange(n, dtype=jnp.int32)[::-1], backend="xla")
    return z, s

def collectives(f, *args):
    txt = jax.jit(f).lower(*args).compile().as_text()
    return [c for c in ("all-gather", "all-to-all", "collective-permute", "all-reduce") if c in txt]

xs = jax.device_put(x, hs)
assert not collectives(layer, xs, p), collectives(layer, xs, p)
outs = jax.jit(layer)(xs, p)
for o, w in zip(outs, jax.jit(layer)(x, p)):
    np.testing.assert_allclose(np.asarray(o), np.asarray(w), rtol=1e-6)
assert all(o.sharding.spec[1] == "d" for o in outs), [o.sharding for o in outs]
# The copy is elementwise: local along its flat axis.
flat = jax.device_put(np.arange(64, dtype=np.float32), NamedSharding(mesh, PS("d")))
cp = lambda v: device_copy(v, backend="xla")
assert not collectives(cp, flat), collectives(cp, flat)
np.testing.assert_array_equal(np.asarray(jax.jit(cp)(flat)), np.arange(64))
print("SHARD_OK")
"""


def test_row_movers_shard_local_along_h():
    """On 4 virtual CPU devices, H-sharded tokens go through permute, unpermute, chunk sort
    and copy with no collective, stay H-sharded, and equal the unsharded run."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    from tests.multidevice import with_cpu_devices
    env = {**os.environ, "XLA_FLAGS": with_cpu_devices(4), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", _SHARD_SCRIPT], env=env, cwd=root, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "SHARD_OK" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


# -- the xla references: exact at the edges, O(N*H) memory ------------------------------------
@pytest.mark.parametrize("t,e,k,budget,align", [(1, 1, 1, 1.0, None), (1, 3, 2, 1.0, 4), (7, 1, 1, 0.5, 2),
                                                (9, 4, 2, 0.0, None), (9, 4, 2, 0.0, 4), (13, 6, 3, 0.6, 4)])
def test_xla_references_match_numpy_at_edges(t, e, k, budget, align):
    """T=1, E=1, every row dropped (num_out_rows 0, or only padding), drops with padding:
    forward and backward of both directions equal the loop reference (data movement exactly)."""
    rng = np.random.default_rng(t * 100 + e)
    rm = routing(rng, t, e, k, "uniform")
    n = int(rm.sum() * budget)
    x = rng.standard_normal((t, 24)).astype(np.float32)
    p = rng.random((t, e)).astype(np.float32)
    rid, kept = te_jax_perm.make_row_id_map(rm, n, backend="xla")
    e_out, e_pp, dest, e_pad, _ = ref.dispatch(x, rm, n, p, align)
    pad = None if align is None else jnp.asarray(e_pad, jnp.int32)
    rows = e_out.shape[0]

    def dispatch(x, p):
        return te_jax_perm.permute_with_mask_map(x, rid, kept, rows, probs=p, pad_offsets=pad, backend="xla")

    (out, pp), vjp = jax.vjp(dispatch, x, p)
    np.testing.assert_array_equal(np.asarray(out), e_out)
    np.testing.assert_array_equal(np.asarray(pp), e_pp)
    g_out = rng.standard_normal(out.shape).astype(np.float32)
    g_pp = rng.standard_normal(pp.shape).astype(np.float32)
    gx, gp = vjp((g_out, g_pp))
    e_gx, e_gp = ref.dispatch_vjp(g_out, g_pp, dest)
    np.testing.assert_allclose(np.asarray(gx), e_gx, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(gp), e_gp)  # a copy of one scalar per entry

    def combine(y, w):
        return te_jax_perm.unpermute_with_mask_map(y, rid, w, pad, kept, backend="xla")

    back, vjp = jax.vjp(combine, out, p)
    np.testing.assert_allclose(np.asarray(back), ref.combine(e_out, dest, p), rtol=1e-6, atol=1e-6)
    g = rng.standard_normal(back.shape).astype(np.float32)
    gy, gw = vjp(g)
    e_gy, e_gw = ref.combine_vjp(g, e_out, dest, p)
    np.testing.assert_allclose(np.asarray(gy), e_gy, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gw), e_gw, rtol=1e-5, atol=1e-5)


def _memory_cases():
    t, e, k, h = 512, 64, 4, 256
    rng = np.random.default_rng(0)
    rm = jnp.asarray(routing(rng, t, e, k, "uniform"))
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    p = jnp.asarray(rng.random((t, e)), jnp.float32)
    y, pp, rid, _, _ = te_jax_perm.token_dispatch(x, rm, t * k, probs=p, backend="xla")

    def dispatch(x, w, rm):
        return te_jax_perm.token_dispatch(x, rm, t * k, probs=w, backend="xla")[:2]

    def combine(y, w, rid):
        return te_jax_perm.token_combine(y, rid, w, backend="xla")

    def dispatch_bwd(x, w, rm, gy, gp):
        return jax.vjp(lambda x, w: dispatch(x, w, rm), x, w)[1]((gy, gp))

    def combine_bwd(y, w, rid, g):
        return jax.vjp(lambda y, w: combine(y, w, rid), y, w)[1](g)

    return {"dispatch": (dispatch, (x, p, rm)), "dispatch_bwd": (dispatch_bwd, (x, p, rm, y, pp)),
            "combine": (combine, (y, p, rid)), "combine_bwd": (combine_bwd, (y, p, rid, x))}


@pytest.mark.parametrize("case", ["dispatch", "dispatch_bwd", "combine", "combine_bwd"])
def test_xla_references_need_no_token_expert_row_tensor(case):
    """The xla backend (CPU default, GPU baseline) must not build [T, E, H] tensors: at
    T=512, E=64, H=256 one is 32 MB, 16x the largest operand (N*H*4 = 2 MB); at DeepSeek-V3
    sizes it is 60 GB. Compiled scratch must stay within a few operand sizes."""
    f, args = _memory_cases()[case]
    compiled = jax.jit(f).lower(*args).compile()
    mem = compiled.memory_analysis()
    if mem is None or not hasattr(mem, "temp_size_in_bytes"):
        pytest.skip("this backend reports no memory analysis")
    outs = jax.eval_shape(f, *args)
    largest = max(a.size * a.dtype.itemsize for a in jax.tree_util.tree_leaves((args, outs)))
    assert mem.temp_size_in_bytes < 4 * largest, (mem.temp_size_in_bytes, largest)


def test_default_configs_read_the_table_at_the_nearest_token_count_and_slice_small_t(monkeypatch):
    """The table's entry measured nearest this token count, within 32x of it and holding at
    least TD.MIN_WARPS warps of work here; else the rule."""
    from te_jax_perm.core import Config
    from te_jax_perm.ops import tuned_defaults as TD
    from te_jax_perm.ops.permute import decl as D
    assert (TD.ROWS_WINDOW, TD.MIN_WARPS) == (32, 1024)
    a = Config.make(num_warps=4, BLOCK_H=256, ROWS=1)   # 16 slices of a 4096-wide row
    b = Config.make(num_warps=4, num_stages=2, BLOCK_H=4096, ROWS=2)
    monkeypatch.setattr(TD, "device_table", lambda: {"unpermute_weighted": {"4096": {"64": a.to_json(), "8192": b.to_json()}}})
    pick = lambda t, h=4096: D.unpermute_weighted.decl.default_config({"T": t, "H": h, "N": t, "E": 8, "W": 17},
                                                                        {"padded": False})
    assert pick(16) == a and pick(512) == a and pick(1024) == b and pick(100000) == b
    monkeypatch.setattr(TD, "device_table", lambda: {})
    rule = {t: pick(t) for t in (128, 255, 500, 300000)}
    # An entry serves row counts within ROWS_WINDOW (32x) of its own; beyond, the rule.
    c = Config.make(num_warps=8, BLOCK_H=1024, ROWS=2)  # 4 slices: 4096 warps at 256 tokens
    monkeypatch.setattr(TD, "device_table", lambda: {"unpermute_weighted": {"4096": {"8192": c.to_json()}}})
    assert pick(256) == c and pick(8192 * 32) == c
    assert pick(255) == rule[255] != c and pick(128) == rule[128] != c and pick(300000) == rule[300000] != c
    # ... and only where its programs hold MIN_WARPS warps: b has 4 warps per 2 tokens.
    monkeypatch.setattr(TD, "device_table", lambda: {"unpermute_weighted": {"4096": {"8192": b.to_json()}}})
    assert pick(512) == b and pick(500) == rule[500] != b
    # ... unless measured within 2x of this token count: b measured at 300 tokens (600 warps).
    monkeypatch.setattr(TD, "device_table", lambda: {"unpermute_weighted": {"4096": {"300": b.to_json()}}})
    assert pick(300) == b and pick(500) == b and pick(600) == b and pick(128) == rule[128] != b
    # ROWS=2 is not valid for one token: the rule's whole row, cut into slices at small T.
    monkeypatch.setattr(TD, "device_table", lambda: {"unpermute_weighted": {"4096": {"8192": b.to_json()}}})
    one = pick(1)
    assert one.kw["ROWS"] == 1 and one.kw["BLOCK_H"] == 256
    # A width the table lacks: whole rows at large T, slices with ~MIN_PROGRAMS programs at small T.
    assert pick(8192, 5120).kw["BLOCK_H"] == 8192
    small = pick(64, 5120)
    assert small.kw["BLOCK_H"] == 256 and 64 * -(-5120 // 256) >= D.MIN_PROGRAMS
    # The weighted scatter keeps whole rows (its weight gradient is a dot over the row).
    ws = D.unpermute_bwd_weighted.decl.default_config({"T": 16, "H": 5120, "N": 64, "E": 8, "W": 17, "R": 64},
                                                     {"padded": False})
    assert ws.kw["BLOCK_H"] == 8192 and ws.num_warps == 4
    monkeypatch.setattr(TD, "device_table", lambda: {})
    dims = lambda h: {"T": 8192, "H": h, "N": 8192, "E": 8, "W": 17, "R": 8192}  # noqa: E731
    assert [D.unpermute_bwd_weighted.decl.default_config(dims(h), {"padded": False}).num_warps
            for h in (2048, 5120, 6144, 7168)] == [4, 4, 8, 8]
    # Both gathers share one rule (whole rows, 4 warps), sliced at small T.
    for gather in (D.permute_bwd_probs, D.unpermute_weighted):
        g = gather.decl.default_config(dims(5120), {"padded": False})
        assert (g.kw["BLOCK_H"], g.kw["ROWS"], g.num_warps) == (8192, 1, 4)
        assert gather.decl.default_config({**dims(5120), "T": 64}, {"padded": False}).kw["BLOCK_H"] == 256


def test_defaults_come_from_the_devices_own_table_else_the_first_shipped(monkeypatch):
    from te_jax_perm.ops import tuned_defaults as TD
    from te_jax_perm.ops.permute import decl as D
    shipped = TD.shipped_tables()
    assert "NVIDIA H100 80GB HBM3" in shipped
    movers = {"permute_probs", "unpermute_weighted", "permute_bwd_probs", "unpermute_bwd_weighted"}
    # The first device's table covers every mover; later devices' tables only what they re-measured.
    assert set(next(iter(shipped.values()))) == movers
    assert all(set(t) <= movers | {"sort_chunks_probs"} for t in shipped.values())
    # Each tabled default looks its entries up by its declaration's first key dim, the row
    # count the sweeps record.
    for name in movers:
        decl = getattr(D, name).decl
        assert decl.default_config.rows_dim == decl.key_dims[0] == "T", name
    # A fresh cache of merged tables, so the fake tables never reach other tests.
    monkeypatch.setattr(TD, "merged_table", functools.lru_cache(maxsize=8)(TD.merged_table.__wrapped__))
    monkeypatch.setattr(TD, "shipped_tables", lambda: {"GPU A": {"k": {"64": {"8": "a8", "16": "a16"}}},
                                                      "GPU B": {"k": {"64": {"8": "b8"}, "128": {"8": "b"}}}})
    monkeypatch.setattr(TD, "device_kind", lambda: "GPU B")
    assert TD.device_table() == {"k": {"64": {"8": "b8", "16": "a16"}, "128": {"8": "b"}}}
    monkeypatch.setattr(TD, "device_kind", lambda: "cpu")
    assert TD.device_table() == {"k": {"64": {"8": "a8", "16": "a16"}}}


@pytest.mark.parametrize("e", [2, 8, 256])
def test_the_unread_pad_operand_stays_a_constant_buffer(e):
    """Unpadded launches pass a ``pad`` operand no kernel reads; XLA must keep it a constant
    of the program, not rewrite it into a broadcast or iota kernel launched on every call."""
    from te_jax_perm.ops.permute.api import unread_pad
    f = jax.jit(lambda x: x + jax.lax.optimization_barrier(jnp.asarray(unread_pad(e))))
    hlo = f.lower(jnp.zeros((e,), jnp.int32)).compile().as_text()
    assert "iota(" not in hlo and "broadcast(" not in hlo, hlo


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 9000), t=st.one_of(st.integers(1, 8), st.integers(1, 1 << 20)), e=st.sampled_from([1, 8, 64, 256]),
       kind=st.sampled_from(["NVIDIA H100 80GB HBM3", "NVIDIA H200", "cpu", "another sm_90 GPU"]),
       near_table=st.booleans())
def test_default_configs_satisfy_their_declaration_on_every_device(h, t, e, kind, near_table):
    """Whatever the device's shipped table holds and whatever the shape, a mover's default
    config passes every constraint its declaration states (a table entry that would break
    one at this shape gives way to the rule). ``near_table`` draws H from the table's widths."""
    from te_jax_perm.ops import tuned_defaults as TD
    merged = TD.merged_table.__wrapped__(kind)
    widths = sorted({int(w) for by_h in merged.values() for w in by_h})
    if near_table and widths:
        h = widths[h % len(widths)]
    n = max(1, t * min(e, 8))
    dims = {"T": t, "H": h, "N": n, "E": e, "W": 2 * e + 1, "R": n}
    with unittest.mock.patch.object(TD, "device_table", lambda: merged):
        for name in ("permute_probs", "unpermute_weighted", "permute_bwd_probs", "unpermute_bwd_weighted"):
            decl = getattr(D, name).decl
            cfg = decl.default_config(dims, {"padded": False, "num_out_rows": n})
            assert decl.violated(dims, {"padded": False, "num_out_rows": n}, cfg) is None, (name, dims, cfg)
