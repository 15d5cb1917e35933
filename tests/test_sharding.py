"""Sharding rules under jit on 8 virtual CPU devices: results equal the unsharded run and the
compiled module holds no collective the rule does not call for.

XLA_FLAGS must be set before jax starts, so the real tests run in a subprocess (the driver
test below); in the ordinary single-device run they are skipped.
"""
import dataclasses
import functools

import numpy as np
import pytest

from tests.multidevice import (MULTI, collectives, collectives_in, multidevice, run_module_on_8_devices,  # noqa: E402,F401
                               shardy_all_gspmd_some)
from te_jax_perm.workloads import top_k_map



@pytest.mark.slow
def test_in_8_device_subprocess():
    run_module_on_8_devices(__file__)


if MULTI:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from te_jax_perm.core import declare
    from te_jax_perm.core import Partitioning
    from tests.example_kernels import gather_rows

    MESH = Mesh(np.array(jax.devices()), ("d",))
    # The row gather out[r] = src[idx[r]] is local along R (given all of src) and along H.
    GATHER = declare(dataclasses.replace(gather_rows.decl, name="sharding_test_gather_rows",
                                         partitioning=Partitioning(outputs=(("R", "H"),), local=("R", "H"))))


def _put(x, *spec):
    return _put_on(MESH, x, *spec)


def _put_on(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


@multidevice
@pytest.mark.parametrize("spec", [("d",), (None, "d")], ids=["rows", "hidden"])
def test_declared_local_axes_partition_without_collectives(partitioner, spec):
    rng = np.random.default_rng(0)
    src = jnp.asarray(rng.standard_normal((16, 24)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 16, 32), jnp.int32)
    f = lambda s, i: GATHER(s, i, backend="xla")[0]
    args = (_put(src), _put(idx, "d")) if spec == ("d",) else (_put(src, *spec), _put(idx))
    out = jax.jit(f)(*args)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(src)[np.asarray(idx)])
    assert out.sharding.spec == P(*spec)
    assert collectives(f, *args) == []


@multidevice
def test_undeclared_axis_is_replicated(partitioner):
    # src's rows are not local (any output row may read any of them): the rule gathers them.
    rng = np.random.default_rng(1)
    src = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 16, 32), jnp.int32)
    f = lambda s, i: GATHER(s, i, backend="xla")[0]
    out = jax.jit(f)(_put(src, "d"), _put(idx, "d"))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(src)[np.asarray(idx)])
    assert "all-gather" in collectives(f, _put(src, "d"), _put(idx, "d"))


def _group_dispatch_combine(x, routing_map, probs, backend):
    """Per routing group: dispatch by expert, scale rows, combine back."""
    from te_jax_perm.ops.permute.api import permute_with_mask_map, unpermute_with_mask_map
    from te_jax_perm.ops.row_id_map.api import make_row_id_map
    n = x.shape[0] * 2
    rid, kept = make_row_id_map(routing_map, num_out_tokens=n, backend=backend)
    rows, _ = permute_with_mask_map(x, rid, kept, n, backend=backend)
    return unpermute_with_mask_map(rows * 2, rid, merging_probs=probs, tokens_per_expert=kept, backend=backend), rows


@multidevice
def test_vmapped_dispatch_combine_is_shard_local(partitioner):
    """Tokens sharded by routing group (one group per device): each device permutes its own."""
    g, t, e, h = 8, 12, 4, 16
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((g, t, h)), jnp.float32)
    rm = top_k_map(rng.standard_normal((g, t, e)), 2)
    probs = jnp.asarray(rng.random((g, t, e)), jnp.float32)
    f = jax.vmap(lambda *a: _group_dispatch_combine(*a, backend="xla"))
    want = jax.jit(f)(x, rm, probs)
    args = (_put(x, "d"), _put(rm, "d"), _put(probs, "d"))
    got = jax.jit(f)(*args)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
        assert a.sharding.spec[0] == "d"
    assert collectives(f, *args) == []


@multidevice
def test_vmapped_chunk_sort_is_shard_local_and_differentiable(partitioner):
    from te_jax_perm.ops.chunk_sort.api import sort_chunks_by_index
    g, n, h, c = 8, 20, 8, 5
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((g, n, h)), jnp.float32)
    sizes = jnp.asarray([rng.multinomial(n - 2, np.ones(c) / c) for _ in range(g)], jnp.int32)
    order = jnp.asarray([rng.permutation(c) for _ in range(g)], jnp.int32)
    f = jax.vmap(lambda a, s, o: sort_chunks_by_index(a, s, o, backend="xla")[0])
    loss = lambda a, s, o: (f(a, s, o) * jnp.arange(h, dtype=jnp.float32)).sum()
    args = (_put(x, "d"), _put(sizes, "d"), _put(order, "d"))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(*args)), np.asarray(jax.jit(f)(x, sizes, order)))
    gs = jax.jit(jax.grad(loss))(*args)
    np.testing.assert_array_equal(np.asarray(gs), np.asarray(jax.jit(jax.grad(loss))(x, sizes, order)))
    assert collectives(f, *args) == []
    assert collectives(jax.grad(loss), *args) == []


@multidevice
def test_interpret_backend_under_multi_device_jit_is_correct():
    """The interpreter's host callback cannot live in a per-shard module (a JAX limitation);
    it lowers unpartitioned instead: same results, operands gathered."""
    rng = np.random.default_rng(4)
    src = jnp.asarray(rng.standard_normal((8, 8)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, 8, 16), jnp.int32)
    out = jax.jit(lambda s, i: GATHER(s, i, backend="interpret")[0])(_put(src), _put(idx, "d"))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(src)[np.asarray(idx)])


@multidevice
def test_single_device_module_has_no_partitioning_call():
    src = jnp.ones((4, 8), jnp.float32)
    idx = jnp.zeros((4,), jnp.int32)
    txt = jax.jit(lambda s, i: GATHER(s, i, backend="xla")[0]).lower(src, idx).as_text()
    assert "CustomSPMDPartitioning" not in txt


@multidevice
def test_dim_splits_reads_whole_axis_and_part_axis_splits():
    """What the token rule's callbacks read off an operand's sharding: the mesh axes and the
    number of pieces per dimension; a split along part of a mesh axis (which Shardy can
    choose when a size does not divide, and no PartitionSpec names) keeps its piece count."""
    from jax._src.lib import xla_client as xc
    from jax._src.sharding_impls import GSPMDSharding
    from te_jax_perm.ops.token_split import dim_splits

    mesh = Mesh(np.asarray(jax.devices()[:4]), ("dp",))
    whole = NamedSharding(mesh, P("dp"))
    assert dim_splits(mesh, whole, 2) == [("dp", 4), (None, 1)]
    assert dim_splits(mesh, GSPMDSharding(list(mesh.devices.flat), whole._to_xla_hlo_sharding(2)), 2) == [("dp", 4),
                                                                                                   (None, 1)]
    half = xc.HloSharding.iota_tile([2, 1, 2], subgroup_types=[xc.OpSharding.Type.REPLICATED])
    assert dim_splits(mesh, GSPMDSharding(list(mesh.devices.flat), half), 2) == [(None, 2), (None, 1)]
    two = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("dp", "fsdp"))
    assert dim_splits(two, NamedSharding(two, P(None, ("dp", "fsdp"))), 2) == [(None, 1), (("dp", "fsdp"), 4)]


@multidevice
def test_token_sharded_dispatch_counts_globally_and_shard_map_runs_the_experts_per_shard(partitioner):
    """Under jit with tokens sharded, each shard dispatches its own tokens: the output is one
    expert-grouped block per shard, while ``tokens_per_expert`` counts over every shard (as
    TransformerEngine's), so it does not describe the rows as a whole. The documented way to
    run the experts on such rows: dispatch, grouped GEMM and combine per shard in shard_map,
    which equals the dense layer."""
    import te_jax_perm
    t, e, h, f, k = 32, 4, 8, 6, 2
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    rm = top_k_map(rng.standard_normal((t, e)), k)
    probs = jnp.asarray(rng.random((t, e)), jnp.float32) * rm
    w = jnp.asarray(rng.standard_normal((e, h, f)), jnp.float32)
    dense = jnp.einsum("te,th,ehf->tf", probs, x, w)

    counts = jax.jit(lambda x, rm: te_jax_perm.token_dispatch(x, rm, t * k, backend="xla")[4])(
        _put(x, "d"), _put(rm, "d"))
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(rm).sum(0))   # all shards' rows

    def local(x, rm, p):
        rows, _, rid, _, local_counts = te_jax_perm.token_dispatch(x, rm, x.shape[0] * k, backend="xla")
        return te_jax_perm.token_combine(te_jax_perm.grouped_matmul(rows, w, local_counts, backend="xla"), rid, p,
                                         backend="xla")
    layer = jax.jit(jax.shard_map(local, mesh=MESH, in_specs=(P("d"), P("d"), P("d")), out_specs=P("d")))
    np.testing.assert_allclose(np.asarray(layer(_put(x, "d"), _put(rm, "d"), _put(probs, "d"))), np.asarray(dense),
                               rtol=1e-5, atol=1e-5)


@multidevice
def test_token_sharded_dispatch_of_a_second_array_follows_the_first(partitioner):
    """FP8 rows and their block scales dispatched with the same routing map under token
    sharding: each scale row lands beside its token's row, padding included."""
    import te_jax_perm
    t, e, h, k, block = 32, 8, 16, 2, 8   # 64 + 8 * 3 padded rows: 11 a shard
    rng = np.random.default_rng(8)
    rm = jnp.asarray(top_k_map(rng.standard_normal((t, e)), k))
    scales = jnp.asarray(rng.random((t, h // block)) + 0.5, jnp.float32)
    q = jnp.asarray(rng.standard_normal((t, h)), jnp.float8_e4m3fn)

    def both(q, s, rm):
        rows = te_jax_perm.token_dispatch(q, rm, t * k, align_size=4, backend="xla")[0]
        return rows, te_jax_perm.token_dispatch(s, rm, t * k, align_size=4, backend="xla")[0]
    rows, s_rows = jax.jit(both)(_put(q, "d"), _put(scales, "d"), _put(rm, "d"))
    deq = lambda r, s: np.asarray(r, np.float32).reshape(r.shape[0], -1, block) * np.asarray(s)[..., None]
    x_deq = jnp.asarray(deq(q, scales).reshape(t, h))
    want = jax.jit(lambda x, rm: te_jax_perm.token_dispatch(x, rm, t * k, align_size=4, backend="xla")[0])(
        _put(x_deq, "d"), _put(rm, "d"))
    np.testing.assert_array_equal(deq(rows, s_rows).reshape(-1, h), np.asarray(want))
    assert np.asarray(want).any()


def _moe_problem(t, e, h, f, k, seed=6):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    rm = jnp.asarray(top_k_map(rng.standard_normal((t, e)), k))
    probs = jnp.asarray(rng.random((t, e)), jnp.float32) * rm
    w_in = jnp.asarray(rng.standard_normal((e, h, 2 * f)) / 3, jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((e, f, h)) / 3, jnp.float32)
    dy = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    return x, rm, probs, w_in, w_out, dy


def _compiled(f, *args):
    """``f`` compiled for ``args``: called for results and read for collectives, one compile."""
    return jax.jit(f).lower(*args).compile()


@multidevice
# align 2 leaves each shard room for its padded layout, align 4 does not (it runs unpadded).
# GSPMD runs the case with drops and padding in one (every shard's budget and padded layout).
@pytest.mark.parametrize("partitioner,drop,align",
                         shardy_all_gspmd_some([(0, None), (16, None), (12, 2), (0, 4)],
                                               ["all", "drop", "drop_align_fits", "align_unpadded"], gspmd=(2,)),
                         indirect=["partitioner"])
def test_token_sharded_moe_ffn_runs_each_shard_locally(partitioner, drop, align):
    """moe_ffn with tokens sharded: every shard runs the layer on its own tokens with its
    share of num_out_tokens, as the per-shard call in shard_map does, forward and gradients;
    the forward has no collective and the backward only the weight gradients' all-reduce."""
    import te_jax_perm
    t, e, h, f, k = 32, 4, 8, 6, 2
    shards = len(jax.devices())
    x, rm, probs, w_in, w_out, dy = _moe_problem(t, e, h, f, k)
    n = t * k - drop

    def loss(fn):
        return lambda x, p, wi, wo, rm, dy: jnp.sum(fn(x, rm, p, wi, wo) * dy)

    sharded = lambda x, rm, p, wi, wo: te_jax_perm.moe_ffn(x, rm, p, wi, wo, n, align_size=align, backend="xla")
    per_shard = jax.shard_map(lambda x, rm, p, wi, wo: te_jax_perm.moe_ffn(x, rm, p, wi, wo, n // shards,
                                                                          align_size=align, backend="xla"),
                              mesh=MESH, in_specs=(P("d"), P("d"), P("d"), P(), P()), out_specs=P("d"))
    args = (_put(x, "d"), _put(rm, "d"), _put(probs, "d"), _put(w_in), _put(w_out))
    fwd = _compiled(sharded, *args)   # run and read for collectives: one compile
    y = fwd(*args)
    assert y.sharding.spec == P("d")
    np.testing.assert_allclose(np.asarray(y), np.asarray(jax.jit(per_shard)(*args)), rtol=1e-5, atol=1e-5)
    if drop == 0 and align is None:   # nothing dropped: the sharded layer is the whole layer
        np.testing.assert_allclose(np.asarray(y), np.asarray(sharded(x, rm, probs, w_in, w_out)),
                                   rtol=1e-5, atol=1e-5)
    grad = lambda fn: jax.grad(loss(fn), argnums=(0, 1, 2, 3))
    gargs = (args[0], args[2], args[3], args[4], args[1], _put(dy, "d"))
    bwd = _compiled(grad(sharded), *gargs)
    for got, want in zip(bwd(*gargs), jax.jit(grad(per_shard))(*gargs)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert collectives_in(fwd) == []
    assert collectives_in(bwd) == ["all-reduce"]


@multidevice
@pytest.mark.parametrize("batched", [False, True], ids=["unbatched", "vmapped"])
def test_combine_probability_gradient_sums_over_a_split_hidden_axis(partitioner, batched):
    """token_combine's merging_probs gradient is a dot product over the whole hidden axis:
    with the hidden axis split (tokens replicated, or split along the other mesh axis) it
    equals the unsharded gradient (each hidden slice's partial sum was returned as the
    whole), as do the rows' gradients."""
    import te_jax_perm
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("t", "h"))
    put = functools.partial(_put_on, mesh)
    x, rm, probs, _, _, dy = _moe_problem(32, 4, 8, 6, 2, seed=11)
    b = (None,) if batched else ()
    if batched:
        x, rm, probs, dy = (jnp.stack([a, a[::-1]]) for a in (x, rm, probs, dy))

    def loss(x, p, rm, dy):
        def one(x, p, rm, dy):
            rows, _, rid, _, _ = te_jax_perm.token_dispatch(x, rm, 64, backend="xla")
            return jnp.sum(te_jax_perm.token_combine(rows, rid, merging_probs=p, backend="xla") * dy)
        return (jax.vmap(one) if batched else one)(x, p, rm, dy).sum()
    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    want = grad(x, probs, rm, dy)
    for tok in (None, "t"):
        got = grad(put(x, *b, tok, "h"), put(probs, *b, tok), put(rm, *b, tok), put(dy, *b, tok, "h"))
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)


def _all_reduced_shapes(hlo: str) -> list[tuple[int, ...]]:
    """The shapes of the arrays a compiled module's text all-reduces."""
    import re
    shapes = []
    for line in hlo.splitlines():
        if " all-reduce(" in line or " all-reduce-start(" in line:
            result = line.split("=", 1)[1].split(" all-reduce", 1)[0]
            shapes += [tuple(int(d) for d in m.split(",") if d) for m in re.findall(r"\[([\d,]*)\]", result)]
    return shapes


# Weights split as FSDP splits them, along mesh axes that also shard the tokens (or not):
# (mesh shape, mesh axes, token axes, w_in's spec, w_out's spec).
_FSDP_CASES = {
    "hidden_over_tokens": ((8,), ("d",), "d", (None, "d", None), (None, None, "d")),
    "experts_over_one_of_two": ((4, 2), ("data", "fsdp"), ("data", "fsdp"), ("fsdp", None, None),
                                (None, None, ("data", "fsdp"))),
    "over_a_non_token_axis": ((4, 2), ("data", "tp"), "data", (None, None, "tp"), (None, "tp", None)),
}


@multidevice
@pytest.mark.parametrize("partitioner,case", shardy_all_gspmd_some([(c,) for c in _FSDP_CASES], list(_FSDP_CASES),
                                                                   gspmd=(0,)), indirect=["partitioner"])
def test_token_sharded_moe_ffn_reduce_scatters_fsdp_weight_gradients(partitioner, case):
    """Weights split along a dimension by token mesh axes (FSDP) get their gradients
    reduce-scattered there and split like the weight: no all-reduce of a whole weight's
    gradient, only of a scattered piece over the token axes that split no dimension of it.
    A weight split by an axis that does not shard the tokens keeps the all-reduce. The
    gradients equal the unsharded layer's."""
    import te_jax_perm
    shape, names, tok, spec_in, spec_out = _FSDP_CASES[case]
    mesh = Mesh(np.array(jax.devices()).reshape(shape), names)
    put = functools.partial(_put_on, mesh)
    t, e, h, f, k = 32, 4, 8, 8, 2
    x, rm, probs, w_in, w_out, dy = _moe_problem(t, e, h, f, k, seed=8)
    grad = jax.grad(lambda x, p, wi, wo, rm, dy: jnp.sum(te_jax_perm.moe_ffn(x, rm, p, wi, wo, t * k,
                                                                             backend="xla") * dy),
                    argnums=(0, 1, 2, 3))
    args = (put(x, tok), put(probs, tok), put(w_in, *spec_in), put(w_out, *spec_out), put(rm, tok), put(dy, tok))
    # As a training step asks: each gradient split like its primal.
    step = jax.jit(grad, out_shardings=tuple(a.sharding for a in args[:4])).lower(*args).compile()
    got = step(*args)
    for g, want in zip(got, jax.jit(grad)(x, probs, w_in, w_out, rm, dy)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-5)
    hlo = step.as_text()
    reduced = _all_reduced_shapes(hlo)
    if case == "over_a_non_token_axis":
        assert w_in.shape in reduced and w_out.shape in reduced, reduced
        return
    assert "reduce-scatter(" in hlo or "reduce-scatter-start(" in hlo, "no reduce-scatter in the module"
    assert w_in.shape not in reduced and w_out.shape not in reduced, reduced
    if case == "experts_over_one_of_two":   # w_in's piece still summed over "data"; w_out's not at all
        assert reduced == [(e // 2, h, 2 * f)], reduced
    else:
        assert reduced == [], reduced


@multidevice
def test_ops_inside_shard_map_with_its_type_check_on():
    """Inside ``jax.shard_map`` with its default ``check_vma=True`` every op runs and
    differentiates: results vary along the mesh axes their operands vary along, and each
    gradient has its primal's type, the replicated weights' summed over the shards. Loss and
    every gradient equal those of the same function with the check off, and of the whole
    batch run unsharded (each token's rows stay in its shard)."""
    import te_jax_perm
    t, e, h, f, k = 32, 4, 8, 6, 2
    x, rm, probs, w_in, w_out, dy = _moe_problem(t, e, h, f, k, seed=7)
    w = w_in[..., :h]
    order = jnp.asarray([1, 0, 3, 2, 4], jnp.int32)

    def layer(x, rm, p, w, wi, wo):   # every op on the backend in effect (use_backend below)
        rows, pp, rid, pad, tpe = te_jax_perm.token_dispatch(x, rm, x.shape[0] * k, probs=p)
        y = te_jax_perm.grouped_matmul(rows, w, tpe) * pp[:, None]
        sizes = jnp.concatenate([tpe, jnp.asarray([rows.shape[0]], jnp.int32) - tpe.sum(keepdims=True)])
        moved, smap = te_jax_perm.sort_chunks_by_index(y, sizes, order)
        back, _ = te_jax_perm.sort_chunks_by_map(moved, smap, is_forward=False)
        out = te_jax_perm.token_combine(back, rid, pad_offsets=pad)
        out = out + te_jax_perm.token_combine(rows, rid, merging_probs=p)
        return out + te_jax_perm.moe_ffn(x, rm, p, wi, wo, x.shape[0] * k)

    def loss(fn):
        return lambda x, p, w, wi, wo, rm, dy: jnp.sum(fn(x, rm, p, w, wi, wo) * dy)

    specs = dict(mesh=MESH, in_specs=(P("d"), P("d"), P("d"), P(), P(), P()), out_specs=P("d"))
    checked = jax.shard_map(layer, **specs)
    unchecked = jax.shard_map(layer, check_vma=False, **specs)
    whole = (x, probs, w, w_in, w_out, rm, dy)
    sharded = (_put(x, "d"), _put(probs, "d"), _put(w), _put(w_in), _put(w_out), _put(rm, "d"), _put(dy, "d"))
    # The whole batch on unsharded operands (sharded ones would have the dispatch count tokens
    # per expert over every shard while grouping the rows per shard), on the xla backend; the
    # interpreter, slow, runs the checked shard_map only.
    runs = ((checked, sharded, "xla"), (unchecked, sharded, "xla"), (checked, sharded, "interpret"),
            (layer, whole, "xla"))
    results = []
    for fn, args, b in runs:
        with te_jax_perm.use_backend(b):
            results.append(jax.jit(jax.value_and_grad(loss(fn), argnums=(0, 1, 2, 3, 4)))(*args))
    for other in results[1:]:
        for got, want in zip(jax.tree.leaves(results[0]), jax.tree.leaves(other)):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@multidevice
def test_token_sharded_moe_ffn_names_an_indivisible_token_count(partitioner):
    """36 tokens (32 sharded 8 ways, 4 more appended inside the program, sharded by
    propagation) do not divide into 8 shards: our error, naming the op and the sizes."""
    import te_jax_perm
    x, rm, probs, w_in, w_out, _ = _moe_problem(32, 4, 8, 6, 2)

    def f(x, rm, p):
        x, rm, p = (jnp.concatenate([a, a[:4]]) for a in (x, rm, p))
        return te_jax_perm.moe_ffn(x, rm, p, w_in, w_out, 72, backend="xla")
    with pytest.raises(ValueError, match=r"^moe_ffn: its tokens \(36\) do not divide into the 8 token shards "
                                         r"of mesh axes d; choose sizes divisible by 8"):
        jax.jit(f)(_put(x, "d"), _put(rm, "d"), _put(probs, "d"))


@multidevice
def test_tokens_split_along_an_automatic_axis_of_a_partly_manual_shard_map_raise_our_error(partitioner):
    """Inside a shard_map manual over "d0" only, tokens split along the automatic "d1" too:
    our error naming the op and what to do (was a KeyError inside JAX's sharding parser).
    Shardy only: GSPMD runs the ops unpartitioned there (the test below)."""
    import te_jax_perm
    if not partitioner:
        pytest.skip("GSPMD gathers the tokens along the automatic axis here: the test below")
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("d0", "d1"))
    x, rm, probs, w_in, w_out, _ = _moe_problem(64, 4, 8, 6, 2)
    f = jax.jit(jax.shard_map(lambda x, rm, p: te_jax_perm.moe_ffn(x, rm, p, w_in, w_out, 32, backend="xla"),
                              mesh=mesh, in_specs=(P("d0"),) * 3, out_specs=P("d0"), axis_names={"d0"}))
    both = NamedSharding(mesh, P(("d0", "d1")))
    with pytest.raises(ValueError, match=r"^moe_ffn: its tokens \(16\) .* partly manual shard_map"):
        f(*(jax.device_put(v, both) for v in (x, rm, probs)))


@multidevice
@pytest.mark.parametrize("partitioner,mesh_shape,split", [
    (False, (4, 2), ("d0",)), (False, (4, 2), (("d0", "d1"),)), (False, (8, 1), ("d0",)),
    (True, (8, 1), ("d0",)), (True, (4, 2), ("d0",))],
    ids=["gspmd-tokens_on_the_manual_axis", "gspmd-tokens_on_both", "gspmd-automatic_axis_of_1",
         "shardy-automatic_axis_of_1", "shardy-tokens_on_the_manual_axis"], indirect=["partitioner"])
def test_partly_manual_shard_map_runs_each_manual_shard_as_its_own_calls(partitioner, mesh_shape, split):
    """Inside a shard_map manual over "d0" only, each d0 shard's dispatch, combine, chunk sort,
    grouped GEMM and moe_ffn, forward and gradients, equal the same calls on that shard's
    tokens alone. Where JAX's custom_partitioning fails there (under GSPMD it aborted the
    process; under Shardy with the automatic axis of size 1 it raised), the ops run without
    it (tokens split along the automatic d1 too are gathered along it); under Shardy with
    d1 of 2 devices, by their rules."""
    import te_jax_perm
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("d0", "d1"))
    x, rm, probs, w_in, w_out, dy = _moe_problem(16 * mesh_shape[0], 4, 8, 6, 2)

    def layer(x, rm, p, w_in, w_out, dy):
        rows, pp, rid, _, tpe = te_jax_perm.token_dispatch(x, rm, 32, probs=p, backend="xla")
        h = te_jax_perm.grouped_matmul(rows, w_in[..., :8], tpe, backend="xla")
        split = jnp.full((4,), 8, jnp.int32)
        h = te_jax_perm.sort_chunks_by_index(h, split, jnp.array([3, 1, 0, 2], jnp.int32), backend="xla")[0]
        y = te_jax_perm.token_combine(h * pp[:, None], rid, merging_probs=p, backend="xla")
        z = te_jax_perm.moe_ffn(x, rm, p, w_in, w_out, 32, backend="xla")
        return jnp.sum(y * dy) + jnp.sum(z * dy)

    step = jax.value_and_grad(layer, argnums=(0, 2, 3, 4))

    def per_shard(x, rm, p, dy):
        loss, grads = step(x, rm, p, w_in, w_out, dy)
        return loss[None], *grads   # the weights' gradients summed over the shards (shard_map's transpose)

    f = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("d0"),) * 4,
                              out_specs=(P("d0"),) * 3 + (P(),) * 2, axis_names={"d0"}))
    got = f(*(_put_on(mesh, v, *split) for v in (x, rm, probs, dy)))
    want = [step(*(v[16 * i:16 * (i + 1)] for v in (x, rm, probs)), w_in, w_out, dy[16 * i:16 * (i + 1)])
            for i in range(mesh_shape[0])]
    np.testing.assert_allclose(got[0], [w[0] for w in want], rtol=1e-5)
    for j in range(2):
        np.testing.assert_allclose(got[1 + j], np.concatenate([w[1][j] for w in want]), rtol=1e-5, atol=1e-5)
    for j in range(2, 4):
        np.testing.assert_allclose(got[1 + j], sum(w[1][j] for w in want), rtol=1e-5, atol=1e-5)


@multidevice
def test_interpret_backend_in_a_partly_manual_shard_map_runs_or_names_gspmd(partitioner):
    """The interpret backend's host callback in a shard_map manual over "d0" only: Shardy
    runs it (each d0 shard's chunk sort on its own rows); under GSPMD XLA's partitioner
    aborted the process on it (as JAX refuses its own callbacks there), so it raises our
    error when the program is lowered, naming the kernel, the axes and what to do."""
    import te_jax_perm
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("d0", "d1"))
    x = jnp.arange(16 * 4, dtype=jnp.float32).reshape(16, 4)
    sort = lambda x: te_jax_perm.sort_chunks_by_index(x, jnp.array([1, 3], jnp.int32),  # noqa: E731
                                                      jnp.array([1, 0], jnp.int32), backend="interpret")[0]
    f = jax.jit(jax.shard_map(sort, mesh=mesh, in_specs=P("d0"), out_specs=P("d0"), axis_names={"d0"}))
    if not partitioner:
        with pytest.raises(ValueError, match=r"^chunk_sort_plan: backend 'interpret' runs a host callback, .* "
                                             r"manual over mesh axes \['d0'\] only \(automatic axes \['d1'\] .* "
                                             r"or backend 'xla'"):
            f(_put_on(mesh, x, "d0"))
        return
    want = np.concatenate([np.asarray(x[i:i + 4])[[1, 2, 3, 0]] for i in range(0, 16, 4)])
    np.testing.assert_array_equal(np.asarray(f(_put_on(mesh, x, "d0"))), want)


@multidevice
@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_partly_manual_shard_map_traced_under_shardy_and_lowered_under_gspmd_raises(backend):
    """A program traced under Shardy inside a shard_map manual over "d0" only (where the ops
    run partitioned, and the interpret backend's callback may run) and lowered after
    jax_use_shardy_partitioner was turned off: our ValueError at lowering, naming the op
    (XLA aborted the process there, as the choice was made at trace time)."""
    import te_jax_perm
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("d0", "d1"))
    x, rm, _, _, _, _ = _moe_problem(32, 4, 8, 6, 2)

    def body(x, rm):
        rows, _, rid, _, _ = te_jax_perm.token_dispatch(x, rm, 32, backend=backend)
        return te_jax_perm.token_combine(rows, rid, backend=backend)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d0"),) * 2, out_specs=P("d0"), axis_names={"d0"}))
    args = [_put_on(mesh, v, "d0") for v in (x, rm)]
    old = jax.config.jax_use_shardy_partitioner
    try:
        jax.config.update("jax_use_shardy_partitioner", True)
        traced = f.trace(*args)
        jax.config.update("jax_use_shardy_partitioner", False)
        message = (r"^token_dispatch: traced to run per token shard .*\(jax_use_shardy_partitioner changed"
                   if backend == "xla" else r"^\w+: backend 'interpret' runs a host callback")
        with pytest.raises(ValueError, match=message):
            traced.lower()
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)


def _dispatch_combine_layer(x, rm, p):
    """Dispatch with probs, scale the rows, combine: every output of both ops returned."""
    import te_jax_perm
    rows, pp, rid, pad, tpe = te_jax_perm.token_dispatch(x, rm, x.shape[0] * 2, probs=p, backend="xla")
    return te_jax_perm.token_combine(rows * pp[:, None], rid, merging_probs=p, backend="xla"), rows, pp, rid, tpe


@multidevice
@pytest.mark.parametrize("batch_axis", [None, "b"], ids=["batch_replicated", "batch_sharded"])
def test_vmapped_token_sharded_dispatch_combine_runs_each_shard_locally(partitioner, batch_axis):
    """vmap over micro-batches whose tokens are sharded: each item is dispatched per token
    shard exactly as the unbatched call is (same rows, same counts), with the unbatched
    call's collectives only; the batch axis stays split where it arrives split."""
    b, t, e, h = 2, 32, 4, 8
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("b", "d"))
    put = functools.partial(_put_on, mesh)
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((b, t, h)), jnp.float32)
    rm = jnp.asarray(np.stack([top_k_map(rng.standard_normal((t, e)), 2) for _ in range(b)]))
    probs = jnp.asarray(rng.random((b, t, e)), jnp.float32) * rm
    f = jax.vmap(_dispatch_combine_layer)
    loss = lambda x, p, rm: jnp.sum(f(x, rm, p)[0] * jnp.arange(h, dtype=jnp.float32))  # noqa: E731
    args = (put(x, batch_axis, "d"), put(rm, batch_axis, "d"), put(probs, batch_axis, "d"))
    fwd = _compiled(f, *args)
    got = fwd(*args)
    item_args = [(put(x[i], "d"), put(rm[i], "d"), put(probs[i], "d")) for i in range(b)]
    per_item = [jax.jit(_dispatch_combine_layer)(*a) for a in item_args]
    for j, out in enumerate(got):
        np.testing.assert_array_equal(np.asarray(out), np.stack([np.asarray(r[j]) for r in per_item]))
    assert got[0].sharding.spec[:2] == (batch_axis, "d")
    # The round trip does not depend on the rows' layout: it equals the unsharded run.
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(jax.jit(f)(x, rm, probs)[0]), rtol=1e-6, atol=1e-6)
    bwd = _compiled(jax.grad(loss, argnums=(0, 1)), args[0], args[2], args[1])
    for g, want in zip(bwd(args[0], args[2], args[1]), jax.jit(jax.grad(loss, argnums=(0, 1)))(x, probs, rm)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-6, atol=1e-6)
    # As unbatched: only tokens_per_expert, counted over every shard, is all-reduced.
    assert collectives_in(fwd) == ["all-reduce"] == collectives(_dispatch_combine_layer, *item_args[0])
    assert collectives_in(bwd) == []


@multidevice
def test_vmapped_token_sharded_moe_ffn_sums_only_weight_gradients(partitioner):
    """moe_ffn vmapped over micro-batches with tokens sharded, shared weights and weights
    per item: forward shard-local, backward summing only the weights' gradients, results
    and gradients those of the unsharded run (nothing is dropped)."""
    import te_jax_perm
    b, t, e, h, f, k = 2, 32, 4, 8, 6, 2
    items = [_moe_problem(t, e, h, f, k, seed=10 + i) for i in range(b)]
    x, rm, probs, w_in, w_out, dy = (jnp.stack(a) for a in zip(*items))
    layer = lambda x, rm, p, wi, wo: te_jax_perm.moe_ffn(x, rm, p, wi, wo, t * k, backend="xla")  # noqa: E731
    for w_axis in (None, 0):   # weights shared by the items, then one set per item
        fn = jax.vmap(layer, in_axes=(0, 0, 0, w_axis, w_axis))
        wi, wo = (w_in[0], w_out[0]) if w_axis is None else (w_in, w_out)
        grad = jax.grad(lambda x, p, wi, wo, rm, dy: jnp.sum(fn(x, rm, p, wi, wo) * dy), argnums=(0, 1, 2, 3))
        args = (_put(x, None, "d"), _put(probs, None, "d"), _put(wi), _put(wo), _put(rm, None, "d"),
                _put(dy, None, "d"))
        fwd = _compiled(fn, args[0], args[4], args[1], args[2], args[3])
        np.testing.assert_allclose(np.asarray(fwd(args[0], args[4], args[1], args[2], args[3])),
                                   np.asarray(jax.jit(fn)(x, rm, probs, wi, wo)), rtol=1e-5, atol=1e-5)
        bwd = _compiled(grad, *args)
        for g, want in zip(bwd(*args), jax.jit(grad)(x, probs, wi, wo, rm, dy)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-5)
        assert collectives_in(fwd) == []
        assert collectives_in(bwd) == ["all-reduce"]


@multidevice
def test_vmapped_moe_ffn_reduce_scatters_gradients_of_shared_fsdp_weights(partitioner):
    """moe_ffn vmapped over micro-batches that share weights split by the token axis (FSDP):
    each item's weight gradient is reduce-scattered as the unbatched layer's is, not
    all-reduced whole; the gradients equal the unsharded run's and come out split like the
    weights."""
    import te_jax_perm
    b, t, e, h, f, k = 2, 16, 8, 8, 6, 2
    items = [_moe_problem(t, e, h, f, k, seed=20 + i) for i in range(b)]
    x, rm, probs, _, _, dy = (jnp.stack(a) for a in zip(*items))
    w_in, w_out = items[0][3], items[0][4]
    fn = jax.vmap(lambda x, rm, p, wi, wo: te_jax_perm.moe_ffn(x, rm, p, wi, wo, t * k, backend="xla"),
                  in_axes=(0, 0, 0, None, None))
    grad = jax.grad(lambda x, p, wi, wo, rm, dy: jnp.sum(fn(x, rm, p, wi, wo) * dy), argnums=(0, 1, 2, 3))
    args = (_put(x, None, "d"), _put(probs, None, "d"), _put(w_in, "d"), _put(w_out, "d"), _put(rm, None, "d"),
            _put(dy, None, "d"))
    bwd = _compiled(grad, *args)
    got = bwd(*args)
    for g, want in zip(got, jax.jit(grad)(x, probs, w_in, w_out, rm, dy)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert [g.sharding.spec[0] for g in got[2:]] == ["d", "d"]
    assert collectives_in(bwd) == ["all-gather", "reduce-scatter"]
