"""Expert-parallel MoE layer on 8 virtual CPU devices against the dense single-device
reference: forward, gradients, dropped rows, skewed routing, an expert with no tokens,
gated activations, and data-parallel copies of the expert-parallel group.
Runs in a subprocess (XLA_FLAGS must precede jax start-up).

XLA:CPU has no ragged all-to-all, so on CPU the ragged exchange runs on an emulation of
``jax.lax.ragged_all_to_all`` (its documented semantics, built from ``all_to_all``, and its
typing rule: the result varies like the ``output`` buffer): that checks our offsets, sizes
and types; the real collective is checked by the GPU test."""

import numpy as np
import pytest

from tests.multidevice import multidevice, run_module_on_8_devices, without_cpu_devices  # noqa: E402,F401


@pytest.mark.slow
def test_in_8_device_subprocess():
    run_module_on_8_devices(__file__)


import dataclasses  # noqa: E402
import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from te_jax_perm.ops.moe_ffn.reference import ACTIVATIONS  # noqa: E402
from te_jax_perm.parallel import EPConfig, ep_moe_layer, ep_moe_local, reference_moe_layer  # noqa: E402
from te_jax_perm.parallel import exchange  # noqa: E402
from te_jax_perm.parallel.a2a_support import ragged_all_to_all_supported, resolve_a2a  # noqa: E402
from te_jax_perm.core.manual_axes import varying_axes  # noqa: E402
from te_jax_perm.workloads import top_k_map

EP, T, H, F = 8, 12, 16, 8


def _problem(n_dev, t, e, k, routing, seed, gated=ACTIVATIONS[EPConfig().activation][1]):
    """Tokens, routing and expert weights; by default weights for the layer's default activation."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((n_dev * t, e))
    if routing == "skewed":      # expert 0 takes every token (half of all routed rows at k=2)
        logits[:, 0] += 100.0
    if routing == "empty":       # expert e-1 receives no token
        logits[:, e - 1] -= 100.0
    rm = top_k_map(logits, k)
    probs = jnp.asarray(jax.nn.softmax(jnp.asarray(logits), -1), jnp.float32)
    x = jnp.asarray(rng.standard_normal((n_dev * t, H)), jnp.float32)
    w_in = jnp.asarray(rng.standard_normal((e, H, 2 * F if gated else F)) * 0.2, jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((e, F, H)) * 0.2, jnp.float32)
    return x, rm, probs, w_in, w_out


def _fwd_and_grads(fn, args, ct):
    out, vjp = jax.vjp(fn, *args)
    return out, vjp(ct)


def _check(e, k, routing, num_out_tokens, capacity, backend="xla", a2a="dense", seed=0, devices=None,
           t=T, rtol=1e-5, atol=1e-5, data=(), activation=None, fsdp=()):
    """Compares output and all four gradients with the reference; returns the compiled HLO.
    ``data``: ``(axis, size)`` pairs of data axes, the mesh ``[*sizes, ep]`` copying the
    group along them; ``fsdp``: the data axes splitting the weights; ``activation``: ``None``
    tells neither the layer nor the reference, so that both run their defaults."""
    devices = jax.devices()[:EP] if devices is None else devices
    n_dev = len(devices)
    copies = int(np.prod([size for _, size in data]))
    ep = n_dev // copies
    mesh = Mesh(np.array(devices).reshape(*(size for _, size in data), ep), (*(name for name, _ in data), "ep"))
    act = {} if activation is None else {"activation": activation}
    x, rm, probs, w_in, w_out = _problem(n_dev, t, e, k, routing, seed,
                                         gated=ACTIVATIONS[activation or EPConfig().activation][1])
    cfg = EPConfig(num_out_tokens=num_out_tokens, capacity=capacity, backend=backend, a2a=a2a,
                   data_axes=tuple(name for name, _ in data), fsdp_axes=fsdp, **act)
    layer = lambda x, p, a, b: ep_moe_layer(x, rm, p, a, b, mesh=mesh, cfg=cfg)
    ref = lambda x, p, a, b: reference_moe_layer(x, rm, p, a, b, ep=ep, data=copies, num_out_tokens=num_out_tokens,
                                                 capacity=capacity, **act)
    return _matches_reference(layer, ref, (x, probs, w_in, w_out), seed + 1, rtol, atol, 10 * rtol)


def _matches_reference(layer, ref, args, ct_seed, rtol, atol, grad_rtol):
    """``layer``'s output and its gradients in all of ``args`` (x, probs, w_in, w_out) against
    ``ref``'s, for one random cotangent; returns the layer's compiled HLO."""
    ct = jnp.asarray(np.random.default_rng(ct_seed).standard_normal(args[0].shape), jnp.float32)
    # One compile per side: forward and gradients in the same program.
    compiled = jax.jit(lambda *a: _fwd_and_grads(layer, a, ct)).lower(*args).compile()
    got, g = compiled(*args)
    want, gr = jax.jit(lambda *a: _fwd_and_grads(ref, a, ct))(*args)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)
    for name, a, b in zip(("x", "probs", "w_in", "w_out"), g, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=grad_rtol, atol=atol, err_msg=name)
    return compiled.as_text()


@multidevice
@pytest.mark.parametrize("e,k,routing", [(8, 2, "uniform"), (16, 3, "skewed"), (16, 3, "empty")])
def test_forward_and_gradients_match_single_device(e, k, routing):
    hlo = _check(e, k, routing, None, None)
    assert "all-to-all" in hlo           # asked for
    assert "all-gather" not in hlo       # not asked for


@multidevice
def test_the_exchange_is_probed_on_one_expert_parallel_group(monkeypatch):
    """On a (data, ep) mesh rows cross devices only within an expert-parallel group: the
    ragged exchange's probe runs on one group's ep devices, not on every device of the mesh."""
    from te_jax_perm.parallel import a2a_support
    probed = []
    monkeypatch.setattr(a2a_support, "probe", lambda devices: probed.append(devices) or False)
    a2a_support.forget_probes()
    try:
        devices = np.array(jax.devices()[:EP]).reshape(2, EP // 2)
        mesh = Mesh(devices, ("data", "ep"))
        x, rm, probs, w1, w2 = _problem(EP, T, 8, 2, "uniform", 0)
        cfg = EPConfig(data_axes=("data",), backend="xla", a2a="auto")
        jax.eval_shape(lambda *a: ep_moe_layer(*a, mesh=mesh, cfg=cfg), x, rm, probs, w1, w2)
    finally:
        a2a_support.forget_probes()
    assert [list(d) for d in probed] == [list(devices[0])]


@multidevice
@pytest.mark.parametrize("num_out_tokens,capacity,routing",
                         [(T * 2, None, "skewed"), (T * 2, 3, "uniform"), (7, 2, "skewed"), (T * 2, 1, "empty"),
                          (T * 2, 0, "uniform")])   # capacity 0: nothing crosses, zero-row sorts
def test_dropped_rows_follow_the_reference_rule(num_out_tokens, capacity, routing):
    _check(8, 2, routing, num_out_tokens, capacity, seed=3)


@multidevice
@pytest.mark.parametrize("activation", ["gelu", "gelu_glu", "relu"])
def test_every_activation_matches_the_reference(activation):
    # Besides the default (silu_glu, every other test's): gated ones read w_in as [E, H, 2F],
    # gate columns first, plain ones as [E, H, F]; drops on, so padding rows pass through
    # the activation too.
    _check(8, 2, "skewed", T * 2, 3, seed=4, activation=activation)


def _replica_groups(hlo: str, op: str) -> set[tuple[tuple[int, ...], ...]]:
    """The device groups of every ``op`` in a compiled module's text, as listed
    (``{{0,1},{2,3}}``), in XLA's iota form (``[2,2]<=[4]``, ``[2,2]<=[2,2]T(1,0)``) or by
    mesh axes (``mesh['a'=2,'b'=2] {'b'}``, devices numbered in mesh order), whichever this
    XLA prints."""
    found = set()
    for line in hlo.splitlines():
        m = re.search(r"replica_groups=(\{[{}0-9,]*\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?"
                      r"|mesh\[[^\]]*\] \{[^}]*\})", line)
        if m is None or not re.search(rf"[ =]{op}(-start)?\(", line):
            continue
        g = m.group(1)
        if g.startswith("{"):
            found.add(tuple(tuple(int(v) for v in grp.split(",")) for grp in re.findall(r"\{([0-9,]+)\}", g)))
            continue
        if g.startswith("mesh"):
            axes = [(n, int(v)) for n, v in re.findall(r"'(\w+)'=(\d+)", g)]
            over = re.findall(r"'(\w+)'", g[g.index("{"):])
            order = [i for i, (n, _) in enumerate(axes) if n not in over] + [
                i for i, (n, _) in enumerate(axes) if n in over]
            ids = np.arange(int(np.prod([v for _, v in axes]))).reshape([v for _, v in axes]).transpose(order)
            found.add(tuple(map(tuple, ids.reshape(-1, int(np.prod([v for n, v in axes if n in over]))).tolist())))
            continue
        shape, dims, perm = (None if t is None else [int(v) for v in t.split(",")] for t in
                             re.fullmatch(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", g).groups())
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        found.add(tuple(map(tuple, (ids if perm is None else ids.transpose(perm)).reshape(shape).tolist())))
    return found


def test_replica_groups_read_in_both_forms():
    listed = "%a = f32[2]{0} all-to-all(f32[2]{0} %x), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dim=0"
    iota = "%b = f32[2]{0} all-reduce(f32[2]{0} %y), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%s"
    assert _replica_groups(listed, "all-to-all") == {((0, 1, 2, 3), (4, 5, 6, 7))}
    assert _replica_groups(iota, "all-reduce") == {((0, 4), (1, 5), (2, 6), (3, 7))}
    assert _replica_groups(listed + "\n" + iota, "all-reduce") == {((0, 4), (1, 5), (2, 6), (3, 7))}
    by_axis = "%c = f32[2]{0} all-reduce(f32[2]{0} %z), channel_id=3, replica_groups=mesh['data'=2,'ep'=4] {'AXIS'}, x"
    assert _replica_groups(by_axis.replace("AXIS", "ep"), "all-reduce") == {((0, 1, 2, 3), (4, 5, 6, 7))}
    assert _replica_groups(by_axis.replace("AXIS", "data"), "all-reduce") == {((0, 4), (1, 5), (2, 6), (3, 7))}


@multidevice
@pytest.mark.parametrize("routing,num_out_tokens,capacity", [("uniform", None, None), ("skewed", T * 2, 3)])
def test_data_parallel_copies_of_the_group(routing, num_out_tokens, capacity):
    """2 data copies of a 4-device group: each copy's tokens follow their own drop rules,
    rows cross only inside a copy, and the weights' gradients are summed over the copies."""
    hlo = _check(8, 2, routing, num_out_tokens, capacity, seed=9, data=(("data", 2),), activation="silu_glu")
    collective = "\n".join(line for line in hlo.splitlines() if "replica_groups" in line)
    assert _replica_groups(hlo, "all-to-all") == {((0, 1, 2, 3), (4, 5, 6, 7))}, collective
    assert _replica_groups(hlo, "all-reduce") == {((0, 4), (1, 5), (2, 6), (3, 7))}, collective
    assert "all-gather" not in hlo


@multidevice
@pytest.mark.parametrize("routing,num_out_tokens,capacity", [("uniform", None, None), ("skewed", T * 2, 3)])
def test_fsdp_weights_are_gathered_and_their_gradients_reduce_scattered(routing, num_out_tokens, capacity):
    """The weights split along H over the data axis as well: gathered for the GEMMs, their
    gradients reduce-scattered back inside each data group's column of devices, never
    all-reduced."""
    hlo = _check(8, 2, routing, num_out_tokens, capacity, seed=10, data=(("data", 2),), activation="silu_glu",
                 fsdp=("data",))
    collective = "\n".join(line for line in hlo.splitlines() if "replica_groups" in line)
    data_groups = {((0, 4), (1, 5), (2, 6), (3, 7))}
    assert _replica_groups(hlo, "all-to-all") == {((0, 1, 2, 3), (4, 5, 6, 7))}, collective
    assert _replica_groups(hlo, "all-gather") == data_groups, collective
    assert _replica_groups(hlo, "reduce-scatter") == data_groups, collective
    assert _replica_groups(hlo, "all-reduce") == set(), collective


@multidevice
def test_weights_split_over_one_data_axis_and_copied_over_another():
    """A (data, fsdp, ep) mesh: tokens over all three axes, the weights split over "fsdp" and
    copied over "data"; rows dropping on both budgets."""
    hlo = _check(8, 2, "skewed", 10, 3, seed=12, t=8, data=(("data", 2), ("fsdp", 2)), activation="silu_glu",
                 fsdp=("fsdp",))
    assert _replica_groups(hlo, "reduce-scatter") == {((0, 2), (1, 3), (4, 6), (5, 7))}


@multidevice
def test_interpret_backend_small():
    # Real Triton kernels (interpreted), with poisoned 'empty' outputs: rows past the kept
    # ones must never be read.
    _check(8, 2, "skewed", 20, 4, backend="interpret", seed=5)


# -- ragged exchange -----------------------------------------------------------------------
def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                *, axis_name, axis_index_groups=None):
    """``jax.lax.ragged_all_to_all`` as documented, any number of slices per peer (the
    offsets and sizes are peer-major), from dense collectives. The real collective's result
    has the varying axes of ``output``, whatever ``operand`` varies along; a result that
    wrongly claims to be the same on every device gets one device's cotangent on all of them
    (values right, gradients wrong). The emulation's result would vary either way, so it
    refuses such an ``output`` instead."""
    del axis_index_groups
    if missing := varying_axes(operand) - varying_axes(output):
        raise AssertionError(f"ragged_all_to_all output varies along {set(varying_axes(output))}, operand also "
                             f"along {set(missing)}; expected output typed as varying like operand")
    ep = jax.lax.axis_size(axis_name)
    m = output.shape[0]
    in_off, size, out_off = (a.reshape(ep, -1, 1) for a in (input_offsets, send_sizes, output_offsets))
    pos = jnp.arange(m, dtype=jnp.int32)[None, None, :]                 # receiver rows
    hit = (pos >= out_off) & (pos < out_off + size)                    # [ep, slices, M]
    # Slices to one peer do not overlap: at most one holds each receiver row.
    src = jnp.clip(jnp.where(hit, in_off + pos - out_off, 0).sum(1), 0, operand.shape[0] - 1)  # [ep, M]
    valid = hit.any(1)
    buf = jnp.where(valid[..., None], operand[src], jnp.zeros((), operand.dtype))
    # recv_sizes must be what each peer sends this device, slice by slice (XLA's one-shot
    # kernel ignores them, its NCCL path relies on them): anything else poisons the result.
    told = jax.lax.all_to_all(send_sizes.reshape(ep, -1), axis_name, 0, 0).reshape(-1)
    buf = jnp.where((told != recv_sizes).any(), jnp.nan, buf)
    buf = jax.lax.all_to_all(buf, axis_name, 0, 0)                      # [ep(src), M, H]
    mask = jax.lax.all_to_all(valid, axis_name, 0, 0)
    return jnp.where(mask.any(0)[:, None], buf.sum(0), output)


@pytest.fixture
def emulated_ragged(monkeypatch):
    # The support probe then finds ragged working: its cached answer must not outlive the test.
    from te_jax_perm.parallel.a2a_support import forget_probes
    forget_probes()
    monkeypatch.setattr(exchange.jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    yield
    forget_probes()


def _exchange_case(ep, seed=3, cap=9, h=5):
    """Random chunk sizes for ``ep`` devices (some empty, some full, the rest cut at odd
    places) and rows and loss weights for :func:`_exchange_both_ways`, as numpy arrays."""
    rng = np.random.default_rng(seed)
    sent = rng.integers(0, cap + 1, (ep, ep)).astype(np.int32)
    sent[0, :] = cap
    sent[:, 1] = 0
    n = int(sent.sum(1).max()) + 2                                     # spare rows past the chunks
    return dict(cap=cap, n=n, sent=sent, rank_start=(np.cumsum(sent, 1) - sent).astype(np.int32),
                x=rng.standard_normal((ep, n, h)).astype(np.float32),
                w_out=rng.standard_normal((ep, ep * cap, h)).astype(np.float32),
                w_home=rng.standard_normal((ep, n, h)).astype(np.float32))


def _exchange_both_ways(devices, mode, case, slices=1):
    """Rows out by ``send_rows`` and home again (doubled) by ``return_rows`` over
    ``devices``, with the gradient of ``sum(out * w_out) + sum(home * w_home)``; numpy
    ``[ep, ...]`` arrays back, and the program's jaxpr as text."""
    from jax.sharding import PartitionSpec as P
    from te_jax_perm.parallel.exchange import return_rows, send_rows
    cap, n = case["cap"], case["n"]

    def body(x, s0, s, r, wo, wh):
        x, wo, wh = x[0], wo[0], wh[0]

        def f(x):
            out = send_rows(x, s0, s, r, cap, "ep", mode, slices)
            home = return_rows(out * 2.0, s0, s, r, n, "ep", mode, slices)
            return (out * wo).sum() + (home * wh).sum(), (out, home)
        (_, (out, home)), g = jax.value_and_grad(f, has_aux=True)(x)
        return out[None], home[None], g[None]

    mesh = Mesh(np.array(devices), ("ep",))
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 6, out_specs=(P("ep"),) * 3))
    args = (case["x"], case["rank_start"].reshape(-1), case["sent"].reshape(-1),
            np.ascontiguousarray(case["sent"].T).reshape(-1), case["w_out"], case["w_home"])
    return [np.asarray(a) for a in fn(*args)], str(jax.make_jaxpr(fn)(*args))


@multidevice
def test_dense_exchange_moves_rows_and_gradients_as_numpy_says():
    """Source s's chunk for destination d lands at d's rows s*cap.., zeros after it; home
    again, at the rows it left; rows not sent (spare rows past the chunks) stay zero and
    get no gradient. Both ways and in the gradient the rows are gathered, never scattered
    (XLA's scatters were the dense exchange's slowest part on GPUs)."""
    ep = 4
    c = _exchange_case(ep)
    (out, home, grad), jaxpr = _exchange_both_ways(jax.devices()[:ep], "dense", c)
    assert " gather[" in jaxpr and "scatter" not in jaxpr
    cap, x = c["cap"], c["x"]
    want_out, want_home, want_grad = np.zeros_like(out), np.zeros_like(home), np.zeros_like(grad)
    for s in range(ep):
        for d in range(ep):
            rows = slice(c["rank_start"][s, d], c["rank_start"][s, d] + c["sent"][s, d])
            slots = slice(s * cap, s * cap + c["sent"][s, d])
            want_out[d, slots] = x[s, rows]
            want_home[s, rows] = 2 * x[s, rows]
            want_grad[s, rows] = c["w_out"][d, slots] + 2 * c["w_home"][s, rows]
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(home, want_home)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-6, atol=1e-6)


@multidevice
@pytest.mark.parametrize("slices", [1, 2, 4, 256])
def test_ragged_exchange_in_slices_moves_what_the_dense_one_moves(emulated_ragged, slices):
    """However many slices each destination's rows go in (one row each, several rows with a
    short last one, one slice for all), the ragged exchange delivers the dense exchange's
    rows there and back, and the same gradient."""
    devices = jax.devices()[:4]
    case = _exchange_case(len(devices))
    want, _ = _exchange_both_ways(devices, "dense", case)
    for got, w in zip(_exchange_both_ways(devices, "ragged", case, slices)[0], want):
        np.testing.assert_array_equal(got, w)


@multidevice
@pytest.mark.parametrize("e,k,routing,num_out_tokens,capacity",
                         [(16, 3, "empty", None, None), (8, 2, "skewed", 15, 3)])
def test_ragged_exchange_matches_reference(emulated_ragged, monkeypatch, e, k, routing, num_out_tokens, capacity):
    assert ragged_all_to_all_supported(tuple(jax.devices()[:EP]))     # probed now, not recorded below
    slices = []

    def recorded(operand, output, input_offsets, *args, **kw):
        slices.append(input_offsets.shape[0] // EP)
        return _emulated_ragged_all_to_all(operand, output, input_offsets, *args, **kw)
    monkeypatch.setattr(exchange.jax.lax, "ragged_all_to_all", recorded)
    hlo = _check(e, k, routing, num_out_tokens, capacity, a2a="ragged", seed=7)
    assert "all-to-all" in hlo
    # The layer's devices are all this process's: each destination's rows go in as many
    # slices as XLA's one-shot kernel wants, or as the capacity has rows.
    cap = EPConfig(num_out_tokens=num_out_tokens, capacity=capacity).sizes(T, e, e // EP)[1]
    assert slices and set(slices) == {min(exchange.SLICES_PER_PEER, cap)}


def test_ragged_slices_are_one_per_destination_across_processes():
    class Device:
        def __init__(self, process_index):
            self.process_index = process_index
    assert exchange.ragged_slices(jax.devices()[:1]) == exchange.SLICES_PER_PEER > 1
    assert exchange.ragged_slices([Device(0), Device(0)]) == exchange.SLICES_PER_PEER
    assert exchange.ragged_slices([Device(0), Device(1)]) == 1


@multidevice
def test_layouts_the_layer_cannot_split_are_named_before_shard_map():
    x, rm, probs, w1, w2 = _problem(EP, T, 16, 2, "uniform", 0)
    mesh = Mesh(np.array(jax.devices()[:EP]), ("ep",))
    mesh2 = Mesh(np.array(jax.devices()[:EP]).reshape(2, 4), ("data", "ep"))
    bad = [((x[:-1], rm[:-1], probs[:-1], w1, w2, mesh, EPConfig()),
            r"x has shape \(95, 16\); expected \[tokens, H\] with its rows split evenly into 8 token shards"),
           ((x[:-4], rm[:-4], probs[:-4], w1, w2, mesh2, EPConfig(data_axes=("data",))),
            r"x has shape \(92, 16\); .* 8 token shards: ep = 4 \(mesh axis 'ep'\) times the data axes \('data',\)"),
           ((x, rm, probs[:, :8], w1, w2, mesh, EPConfig()), r"probs has shape \(96, 8\); expected \(96, 16\)"),
           ((x, rm[:, :12], probs[:, :12], w1[:12], w2[:12], mesh, EPConfig()),
            "E = 12 experts, which the ep = 8 ranks of mesh axis 'ep' cannot split evenly"),
           ((x, rm, probs, w1[:, :, :4], w2, mesh, EPConfig()), r"w_out has shape \(16, 8, 16\); expected \[E=16, F=2"),
           ((x, rm, probs, w1, w2, mesh, EPConfig(activation="gelu")),
            r"w_out has shape \(16, 8, 16\), which fits w_in \(16, 16, 16\) as a gated activation's weights"),
           ((x, rm, probs, w1, w2, mesh, EPConfig(activation="swish")),
            r"EPConfig.activation='swish'; expected one of \('silu_glu'"),
           ((x, rm, probs, w1, w2, Mesh(np.array(jax.devices()[:EP]), ("data",)), EPConfig()),
            r"mesh has axes \('data',\); EPConfig.axis = 'ep' is not one of them"),
           ((x, rm, probs, w1, w2, mesh2, EPConfig(data_axes=("batch",))),
            r"EPConfig.data_axes = \('batch',\); expected distinct axes of the mesh \('data', 'ep'\) other than"),
           ((x, rm, probs, w1, w2, mesh2, EPConfig(data_axes=("ep",))), r"EPConfig.data_axes = \('ep',\)"),
           ((x, rm, probs, w1, w2, mesh2, EPConfig(fsdp_axes=("data", "data"))),
            r"EPConfig.fsdp_axes = \('data', 'data'\); expected distinct axes"),
           ((x, rm, probs, w1, w2, mesh2, EPConfig(fsdp_axes=("data",))),
            r"EPConfig.fsdp_axes = \('data',\); expected axes of EPConfig.data_axes = \(\)"),
           ((x[:, :15], rm, probs, w1[:, :15], w2[:, :, :15], mesh2, EPConfig(data_axes="data", fsdp_axes="data")),
            r"x has H = 15 columns, which the 2 pieces of EPConfig.fsdp_axes = \('data',\) cannot split evenly"),
           ((x, rm, probs, w1, w2, mesh, EPConfig(capacity=-1)), r"EPConfig.capacity = -1; expected None or an int >= 0"),
           ((x, jnp.asarray(rm, jnp.int32) * 3, probs, w1, w2, mesh, EPConfig()),
            r"routing_map holds values other than 0 and 1 \(e.g. \[3\]\)"),
           ((x, rm, probs, w1, w2, mesh, EPConfig(a2a="ragged")), "ragged_all_to_all does not run on these cpu devices")]
    bad += [((x, rm, probs, w1, w2, mesh, EPConfig(backend="cuda")),
             r"unknown EPConfig.backend='cuda'; expected one of \('triton', 'interpret', 'xla'\) or None"),
            ((x, rm, probs, w1, w2, mesh, EPConfig(gemm="cublas")),
             r"unknown EPConfig.gemm='cublas'; expected one of \('triton', 'interpret', 'xla', 'tokamax'\) or None")]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            ep_moe_layer(*args[:6], cfg=args[6])
    for v in (2.5, True):   # the wrong type: TypeError, as the ops raise for sizes
        with pytest.raises(TypeError, match=rf"EPConfig.num_out_tokens = {v}; expected None or an int >= 0"):
            ep_moe_layer(x, rm, probs, w1, w2, mesh=mesh, cfg=EPConfig(num_out_tokens=v))
    # Types: dtypes as moe_ffn takes them (integer probs gave an all-zero layer), a mesh.
    for args, message in [((x, rm, jnp.asarray(probs, jnp.int32), w1, w2, mesh),
                           "probs has dtype int32; expected bfloat16, float16 or float32"),
                          ((jnp.asarray(x, jnp.int32), rm, probs, w1, w2, mesh),
                           "x has dtype int32; expected float16, bfloat16 or float32"),
                          ((x, rm, probs, jnp.asarray(w1, jnp.float8_e4m3fn), w2, mesh),
                           "w_in has dtype float8_e4m3fn; expected float16, bfloat16 or float32"),
                          ((x, rm, probs, w1, w2, None), "mesh is NoneType None; expected a jax.sharding.Mesh")]:
        with pytest.raises(TypeError, match=message):
            ep_moe_layer(*args, cfg=EPConfig())


@multidevice
def test_arguments_the_layer_cannot_take_are_named():
    """Arrays come as the ops take them (lists too); what is not one, a cfg that is not an
    EPConfig, and sizes past int32 row indices raise naming the argument, not JAX's or
    Python's error about an attribute or an overflow."""
    x, rm, probs, w1, w2 = _problem(EP, T, 16, 2, "uniform", 0)
    mesh = Mesh(np.array(jax.devices()[:EP]), ("ep",))
    cfg = EPConfig(a2a="dense")
    want = ep_moe_layer(x, rm, probs, w1, w2, mesh=mesh, cfg=cfg)
    got = ep_moe_layer(np.asarray(x).tolist(), rm, np.asarray(probs).tolist(), w1, w2, mesh=mesh, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for args, message in [((x, rm, None, w1, w2, cfg), "probs is NoneType None; expected an array"),
                          ((x, rm, probs, None, w2, cfg), "w_in is NoneType None; expected an array"),
                          ((x, rm, probs, w1, w2, None), "cfg is NoneType None; expected a te_jax_perm.parallel.EPConfig"),
                          ((x, rm, probs, w1, w2, {"a2a": "dense"}), "cfg is dict")]:
        with pytest.raises(TypeError, match=message):
            ep_moe_layer(*args[:5], mesh=mesh, cfg=args[5])
    for field, message in [("capacity", r"EPConfig.capacity = 1099511627776 makes a receive buffer of ep \* capacity = "
                                        r"8 \* 1099511627776 = 8796093022208 rows per device; expected at most 2\*\*31 - 1"),
                           ("num_out_tokens", r"EPConfig.num_out_tokens = 1099511627776 makes 1099511627776 dispatch rows "
                                              r"per device; expected at most 2\*\*31 - 1")]:
        with pytest.raises(ValueError, match=message):
            ep_moe_layer(x, rm, probs, w1, w2, mesh=mesh, cfg=EPConfig(a2a="dense", **{field: 2**40}))


@pytest.mark.parametrize("field", ["data_axes", "fsdp_axes"])
@pytest.mark.parametrize("given", [None, 5, ("data", 5)])
def test_axes_that_are_not_axis_names_are_named(field, given):
    x, rm, probs, w1, w2 = _problem(1, T, 4, 2, "uniform", 0)
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    with pytest.raises(TypeError, match=rf"EPConfig.{field} = {re.escape(repr(given))}; expected a mesh axis name "
                                        r"or a tuple of them \(\(\) for none\)"):
        ep_moe_layer(x, rm, probs, w1, w2, mesh=mesh, cfg=EPConfig(a2a="dense", **{field: given}))


def test_the_reference_names_what_it_cannot_take():
    """The dense reference checks its arguments as the layer does: unchecked, a map of 2s
    was read bitwise (no row kept) and shapes failed inside its einsums."""
    x, rm, probs, w1, w2 = _problem(1, T, 4, 2, "uniform", 0)
    for kw, args, error, message in [
            (dict(ep=0), (), ValueError, "ep must be >= 1, got 0"),
            (dict(ep=2.0), (), TypeError, "ep must be a static Python int, got float 2.0"),
            (dict(ep=3), (), ValueError, "routing_map has E = 4 experts, which the ep = 3 ranks cannot split"),
            # Its own arguments named, not the layer's EPConfig fields.
            (dict(ep=1, activation="silu"), (), ValueError, r"but activation='silu' is not gated"),
            (dict(ep=2, capacity=2**31 - 1), (), ValueError, r"^capacity = 2147483647 makes a receive buffer"),
            (dict(ep=1, data=5), (), ValueError, r"x has shape \(12, 16\); expected \[tokens, H\] with its rows split "
                                                 r"evenly into data \* ep = 5 \* 1 token shards"),
            (dict(ep=1, num_out_tokens=2.5), (), TypeError, "num_out_tokens must be a static Python int, got float 2.5"),
            (dict(ep=1, capacity=-1), (), ValueError, "capacity must be >= 0, got -1"),
            (dict(ep=1, activation="swish"), (), ValueError, r"activation='swish'; expected one of \('silu_glu'"),
            (dict(ep=1), (x, rm, probs, w1[:3], w2), ValueError, r"w_in has shape \(3, 16, \d+\); expected \[E=4, H=16"),
            (dict(ep=1), (x, jnp.asarray(rm, jnp.int32) * 2, probs, w1, w2), ValueError,
             r"routing_map holds values other than 0 and 1 \(e.g. \[2\]\)"),
            (dict(ep=1), (x, rm, jnp.asarray(probs, jnp.int32), w1, w2), TypeError,
             "probs has dtype int32; expected bfloat16, float16 or float32")]:
        with pytest.raises(error, match=message):
            reference_moe_layer(*(args or (x, rm, probs, w1, w2)), **kw)


def test_the_layer_defaults_to_moe_ffns_activation_and_takes_its_weights(on_cpu):
    """One default activation for the one layer, single-device or expert-parallel: weights
    made for moe_ffn's default go into ep_moe_layer (and its reference) without naming it."""
    import inspect
    import te_jax_perm
    default = inspect.signature(te_jax_perm.moe_ffn).parameters["activation"].default
    assert EPConfig().activation == default == "silu_glu"
    assert inspect.signature(reference_moe_layer).parameters["activation"].default == default
    x, rm, probs, w1, w2 = _problem(1, T, 4, 2, "uniform", 0, gated=True)
    assert w1.shape == (4, H, 2 * F)
    want = te_jax_perm.moe_ffn(x, rm, probs, w1, w2, T * 2, backend="xla")
    # On the CPU device: float32 matmuls there are not rounded to TF32 as a GPU's may be.
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("ep",))
    got = ep_moe_layer(x, rm, probs, w1, w2, mesh=mesh, cfg=EPConfig(backend="xla", a2a="dense"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(reference_moe_layer(x, rm, probs, w1, w2, ep=1)), np.asarray(want),
                               rtol=1e-5, atol=1e-5)


def test_the_layer_takes_its_meshs_default_backend(on_cpu, monkeypatch):
    """A CPU mesh on a host whose default JAX device is a GPU: with no backend named, the
    layer's ops and GEMMs take the CPU's default (``xla``), not the GPU's kernels, which
    cannot lower for CPU devices. Here JAX's default backend is made to read "gpu"."""
    from te_jax_perm.core import backends
    x, rm, probs, w1, w2 = _problem(1, T, 4, 2, "uniform", 0)
    want = reference_moe_layer(x, rm, probs, w1, w2, ep=1)
    monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(backends, "default_platform", lambda: "gpu")   # not the on_cpu block's
    assert backends.default_backend() == "triton" and backends.default_backend("cpu") == "xla"
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("ep",))
    got = ep_moe_layer(x, rm, probs, w1, w2, mesh=mesh, cfg=EPConfig(a2a="dense"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with backends.use_backend("xla"):   # a scope the caller set still wins over the mesh's default
        assert backends.resolve_backend(None, "gpu") == "xla"


class _FakeGpu:
    """A device as JAX lists one, for a host whose default devices are GPUs."""
    platform, device_kind, process_index = "gpu", "NVIDIA H200", 0

    def __init__(self, i):
        self.id = i


def test_ep_moe_local_follows_the_platform_of_the_users_mesh(on_cpu, monkeypatch):
    """ep_moe_local inside the user's shard_map over a CPU mesh, on a host whose default
    JAX devices are GPUs (faked: jax.default_backend and jax.devices() read "gpu"): the
    ragged-exchange probe runs on CPU devices, not on the host's first GPUs, and ops with no
    backend named take the CPU's default (xla), as ep_moe_layer's do for its mesh."""
    from jax.sharding import AbstractMesh
    from te_jax_perm.core import backends
    from te_jax_perm.parallel import a2a_support
    x, rm, probs, w1, w2 = _problem(1, T, 4, 2, "uniform", 0)
    want = reference_moe_layer(x, rm, probs, w1, w2, ep=1)
    cpu = jax.devices("cpu")[:1]
    mesh = Mesh(np.array(cpu), ("ep",))
    probed = []
    # The fake probe finds ragged working on GPUs only: had it been asked about the host's
    # GPUs, the CPU program would hold a ragged all-to-all XLA:CPU cannot compile.
    monkeypatch.setattr(a2a_support, "probe", lambda devices: probed.append(devices) or devices[0].platform == "gpu")
    a2a_support.forget_probes()
    real_devices = jax.devices
    try:
        monkeypatch.setattr(backends.jax, "default_backend", lambda: "gpu")
        monkeypatch.setattr(jax, "devices", lambda backend=None: real_devices(backend) if backend else
                            [_FakeGpu(i) for i in range(8)])
        # Each on its own (the exchange with the backend named, the backend with the
        # exchange named), then both left to the layer.
        for cfg in (EPConfig(backend="xla"), EPConfig(a2a="dense"), EPConfig()):
            probed.clear()
            a2a_support.forget_probes()
            got = jax.jit(_local_on(mesh, cfg))(x, rm, probs, w1, w2)
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
            assert [[d.platform for d in devices] for devices in probed] == ([] if cfg.a2a == "dense" else [["cpu"]])
        # An abstract mesh made without devices (a shard_map over jax.sharding.AbstractMesh)
        # tells nothing: JAX's default devices are the guess, and no platform is claimed.
        # Traced only: the program would not compile for the CPU.
        a2a_support.forget_probes()
        monkeypatch.setattr(jax.sharding, "get_abstract_mesh", lambda: AbstractMesh((1,), ("ep",)))
        jax.eval_shape(_local_on(mesh, EPConfig(backend="xla")), x, rm, probs, w1, w2)
        assert [d.platform for d in probed[-1]] == ["gpu"]
    finally:
        a2a_support.forget_probes()


def _local_on(mesh, cfg):
    """``ep_moe_local`` as a user calls it: inside their own ``shard_map`` over ``"ep"``,
    tokens and experts split over it."""
    from jax.sharding import PartitionSpec as P
    return jax.shard_map(lambda *a: ep_moe_local(*a, cfg=cfg), mesh=mesh, in_specs=(P("ep"),) * 5,
                         out_specs=P("ep"))


def _check_local(devices, a2a, check_vma, backend="xla", t=T, rtol=1e-4, atol=1e-5):
    """``ep_moe_local`` inside the user's own ``shard_map`` over ``devices``: output and all
    four gradients against the reference."""
    from jax.sharding import PartitionSpec as P
    n = len(devices)
    mesh = Mesh(np.array(devices), ("ep",))
    x, rm, probs, w_in, w_out = _problem(n, t, 2 * n, 3, "skewed", 13)
    cfg = EPConfig(num_out_tokens=2 * t, capacity=t // 2, a2a=a2a, backend=backend)
    local = jax.shard_map(lambda x, rm, p, a, b: ep_moe_local(x, rm, p, a, b, cfg=cfg), mesh=mesh,
                          in_specs=(P("ep"),) * 5, out_specs=P("ep"), check_vma=check_vma)
    layer = lambda x, p, a, b: local(x, rm, p, a, b)
    ref = lambda x, p, a, b: reference_moe_layer(x, rm, p, a, b, ep=n, num_out_tokens=2 * t, capacity=t // 2)
    with jax.default_matmul_precision("highest"):
        _matches_reference(layer, ref, (x, probs, w_in, w_out), 14, rtol, atol, rtol)


@multidevice
@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("a2a", ["dense", "ragged"])
def test_ep_moe_local_in_a_users_shard_map_matches_the_reference(emulated_ragged, a2a, check_vma):
    """Output and all four gradients, whether the user's shard_map checks varying axes or
    not (unchecked, no value is typed as varying, and the exchange must not depend on it)."""
    _check_local(jax.devices()[:EP], a2a, check_vma)


@pytest.mark.gpu
@pytest.mark.parametrize("check_vma", [True, False])
def test_gpu_ep_moe_local_in_a_users_shard_map(check_vma):
    """On every GPU of the machine (>= 2): the probe runs while the user's shard_map is
    traced, and the ragged exchange it finds works gives the reference's gradients."""
    devs = jax.devices()
    if len(devs) < 2:
        pytest.skip("needs at least 2 GPUs")
    _check_local(devs, "ragged", check_vma, backend="triton", t=32, atol=1e-4)


def test_ep_moe_local_names_what_it_cannot_take_on_one_device():
    """ep_moe_local checks its per-device arguments as ep_moe_layer checks its own: here on a
    one-device mesh, where this device's share is the whole."""
    cfg = EPConfig(a2a="dense")
    gated = ACTIVATIONS[cfg.activation][1]
    x, rm, probs, w1, w2 = _problem(1, T, 4, 2, "uniform", 0, gated=gated)
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    want = ep_moe_layer(x, rm, probs, w1, w2, mesh=mesh, cfg=cfg)
    np.testing.assert_array_equal(np.asarray(_local_on(mesh, cfg)(x, rm, probs, w1, w2)), np.asarray(want))
    plain = "gelu" if gated else "silu_glu"     # the other kind of activation than the default's
    bad = [((x[:, 0], rm, probs, w1, w2), cfg, r"x has shape \(12,\); expected \[T, H\], this device's tokens"),
           ((x, rm[:, :3], probs, w1, w2), cfg, r"probs has shape \(12, 4\); expected \(12, 3\) \(routing_map's\)"),
           ((x, rm, probs, w1[:, :8], w2), cfg, r"w_in has shape \(4, 8, \d+\); expected \[E_local=4, H=16, "),
           ((x, rm, probs, w1, w2[:, :3]), cfg, r"w_out has shape \(4, 3, 16\); expected \[E_local=4, F=8, H=16\]"),
           ((x, rm, probs, w1, w2), dataclasses.replace(cfg, activation=plain),
            r"w_out has shape \(4, 8, 16\), which fits w_in \(4, 16, \d+\) as a \w+ activation's weights, but "
            r"EPConfig.activation='\w+' is"),
           ((x, rm, probs, w1, w2), dataclasses.replace(cfg, activation="swish"),
            r"EPConfig.activation='swish'; expected one of \('silu_glu'"),
           ((x, rm, probs, w1, w2), dataclasses.replace(cfg, capacity=-1),
            r"EPConfig.capacity = -1; expected None or an int >= 0"),
           ((x, rm, probs, w1, w2), dataclasses.replace(cfg, num_out_tokens=2**40),
            r"EPConfig.num_out_tokens = 1099511627776 makes 1099511627776 dispatch rows per device"),
           ((x, rm, probs, w1, w2), dataclasses.replace(cfg, backend="cuda"),
            r"unknown EPConfig.backend='cuda'; expected one of \('triton', 'interpret', 'xla'\) or None"),
           ((x, rm, probs, w1, w2), dataclasses.replace(cfg, gemm="cublas"), r"unknown EPConfig.gemm='cublas'"),
           ((x, rm, probs, w1, w2), dataclasses.replace(cfg, a2a="sparse"),
            r"EPConfig.a2a = 'sparse'; expected 'dense', 'ragged' or 'auto'")]
    if not ragged_all_to_all_supported(tuple(mesh.devices.flat)):    # XLA:CPU's collectives lack it
        bad.append(((x, rm, probs, w1, w2), dataclasses.replace(cfg, a2a="ragged"),
                    f"ragged_all_to_all does not run on these {jax.devices()[0].platform} devices"))
    for args, c, message in bad:
        with pytest.raises(ValueError, match=message):
            _local_on(mesh, c)(*args)
    with pytest.raises(TypeError, match=r"EPConfig.capacity = 2.5; expected None or an int >= 0"):
        _local_on(mesh, dataclasses.replace(cfg, capacity=2.5))(x, rm, probs, w1, w2)
    for args, c, message in [((x, rm, jnp.asarray(probs, jnp.int32), w1, w2), cfg,
                              "probs has dtype int32; expected bfloat16, float16 or float32"),
                             ((jnp.asarray(x, jnp.int32), rm, probs, w1, w2), cfg,
                              "x has dtype int32; expected float16, bfloat16 or float32"),
                             ((x, rm, probs, jnp.asarray(w1, jnp.float8_e4m3fn), w2), cfg,
                              "w_in has dtype float8_e4m3fn; expected float16, bfloat16 or float32"),
                             ((x, jnp.asarray(rm, jnp.float32), probs, w1, w2), cfg,
                              "routing_map has dtype float32; expected bool or an integer dtype"),
                             ((x, rm, probs, w1, w2), None, "cfg is NoneType None; expected a te_jax_perm.parallel.EPConfig")]:
        with pytest.raises(TypeError, match=message):
            _local_on(mesh, c)(*args)
    with pytest.raises(TypeError, match="probs is NoneType None; expected an array"):
        ep_moe_local(x, rm, None, w1, w2, cfg=cfg)
    # Outside shard_map the axis is not bound: named, not JAX's "unbound axis name".
    with pytest.raises(ValueError, match=r"EPConfig.axis = 'ep' is not a mesh axis bound here; expected a call "
                                         r"inside jax.shard_map"):
        ep_moe_local(x, rm, probs, w1, w2, cfg=cfg)


@multidevice
def test_ep_moe_local_checks_each_devices_share_of_the_experts():
    """On 8 devices: weights given whole where each device takes its E / ep experts, and an
    E the ranks cannot split, named in ep_moe_local's terms."""
    from jax.sharding import PartitionSpec as P
    cfg = EPConfig(a2a="dense")
    x, rm, probs, w1, w2 = _problem(EP, T, 16, 2, "uniform", 0, gated=ACTIVATIONS[cfg.activation][1])
    mesh = Mesh(np.array(jax.devices()[:EP]), ("ep",))
    np.testing.assert_array_equal(np.asarray(_local_on(mesh, cfg)(x, rm, probs, w1, w2)),
                                  np.asarray(ep_moe_layer(x, rm, probs, w1, w2, mesh=mesh, cfg=cfg)))
    whole = jax.shard_map(lambda *a: ep_moe_local(*a, cfg=cfg), mesh=mesh, in_specs=(P("ep"),) * 3 + (P(), P()),
                          out_specs=P("ep"))
    with pytest.raises(ValueError, match=r"w_in has shape \(16, 16, \d+\); expected \[E_local=2, H=16, \w+\] "
                                         r"\(E_local from routing_map's E = 16 over the ep = 8 ranks of mesh axis 'ep'"):
        whole(x, rm, probs, w1, w2)
    with pytest.raises(ValueError, match="routing_map has E = 12 experts, which the ep = 8 ranks of mesh axis 'ep' "
                                         "cannot split evenly"):
        whole(x, rm[:, :12], probs[:, :12], w1[:12], w2[:12])
    with pytest.raises(ValueError, match=r"EPConfig.capacity = 1099511627776 makes a receive buffer of ep \* capacity"
                                         r" = 8 \* 1099511627776"):
        _local_on(mesh, dataclasses.replace(cfg, capacity=2**40))(x, rm, probs, w1, w2)


@multidevice
def test_auto_falls_back_to_dense_where_ragged_is_unsupported():
    devs = tuple(jax.devices()[:EP])
    assert jax.default_backend() == "cpu"
    assert not ragged_all_to_all_supported(devs)       # XLA:CPU: "not supported by ThunkEmitter"
    assert resolve_a2a("auto", devs) == "dense"
    with pytest.raises(ValueError, match="EPConfig.a2a = 'ragged', but ragged_all_to_all does not run on these cpu"):
        resolve_a2a("ragged", devs)
    with pytest.raises(ValueError, match="a2a"):
        resolve_a2a("sparse", devs)


def test_resolve_a2a_refuses_ragged_where_it_does_not_run(monkeypatch):
    """One place decides the exchange: resolve_a2a refuses a ragged exchange on devices
    without one, naming EPConfig.a2a, what it was and what runs instead; both layer entries
    raise it before they trace any op."""
    from te_jax_perm.parallel import a2a_support, ep_moe
    devs = tuple(jax.devices("cpu")[:1])
    monkeypatch.setattr(a2a_support, "probe", lambda devices: False)
    a2a_support.forget_probes()
    try:
        with pytest.raises(ValueError, match=r"^EPConfig.a2a = 'ragged', but ragged_all_to_all does not run on these "
                                             r"cpu devices; expected 'auto' \(ragged where it runs\) or 'dense'$"):
            resolve_a2a("ragged", devs)
        assert resolve_a2a("auto", devs) == resolve_a2a("dense", devs) == "dense"

        def traced(*args, **kwargs):
            raise AssertionError("an op of the layer was traced before the exchange mode was checked")

        x, rm, probs, w1, w2 = _problem(1, T, 4, 2, "uniform", 0)
        mesh = Mesh(np.array(devs), ("ep",))
        cfg = EPConfig(a2a="ragged", backend="xla")
        monkeypatch.setattr(ep_moe, "make_row_id_map", traced)
        for call in (lambda: ep_moe_layer(x, rm, probs, w1, w2, mesh=mesh, cfg=cfg),
                     lambda: _local_on(mesh, cfg)(x, rm, probs, w1, w2)):
            with pytest.raises(ValueError, match="EPConfig.a2a = 'ragged', but ragged_all_to_all does not run"):
                call()
    finally:
        a2a_support.forget_probes()


def test_several_processes_build_the_same_exchange_unprobed(monkeypatch):
    """Under several JAX processes no probe runs (it could not reach other processes'
    devices, nor promise each process the same answer): "auto" is dense everywhere,
    "ragged" is taken as asked, and a wrong mode is still named."""
    from te_jax_perm.parallel import a2a_support
    monkeypatch.setattr(a2a_support, "probe", lambda devices: pytest.fail("probed under several processes"))
    monkeypatch.setattr(a2a_support.jax, "process_count", lambda: 2)
    a2a_support.forget_probes()
    devs = tuple(jax.devices()[:1])
    assert [resolve_a2a(m, devs) for m in ("auto", "ragged", "dense")] == ["dense", "ragged", "dense"]
    with pytest.raises(ValueError, match="EPConfig.a2a = 'sparse'; expected"):
        resolve_a2a("sparse", devs)


def test_forget_probes_lets_auto_see_a_new_probe_answer(monkeypatch):
    from te_jax_perm.parallel import a2a_support
    devs = tuple(jax.devices()[:1])
    try:
        for works, mode in [(False, "dense"), (True, "ragged")]:
            monkeypatch.setattr(a2a_support, "probe", lambda devices, works=works: works)
            a2a_support.forget_probes()
            assert resolve_a2a("auto", devs) == mode
    finally:
        a2a_support.forget_probes()


@multidevice
def test_probe_accepts_a_correct_ragged_collective_inside_jit_and_other_meshes(emulated_ragged):
    """Asked while a jit is traced, or with another mesh in context (a larger one set with
    jax.set_mesh, or a shard_map's being traced), the probe still runs its own program."""
    from jax.sharding import PartitionSpec as P
    from te_jax_perm.parallel.a2a_support import probe
    devs = tuple(jax.devices()[:4])
    assert probe(devs)
    seen = []
    jax.jit(lambda x: seen.append(probe(devs)) or x)(jnp.ones(2))
    big = Mesh(np.array(jax.devices()[:EP]).reshape(2, 4), ("data", "ep"))
    with jax.set_mesh(big):
        seen.append(probe(devs))
        jax.jit(lambda x: seen.append(probe(devs)) or x)(jnp.ones(2))
    jax.shard_map(lambda x: seen.append(probe(devs)) or x, mesh=big, in_specs=P("ep"), out_specs=P("ep"))(
        jnp.ones(8))
    assert seen == [True] * 4


@multidevice
@pytest.mark.parametrize("broken", ["rows", "gradient"])
def test_probe_refuses_a_collective_with_wrong_rows_or_a_wrong_gradient(monkeypatch, broken):
    """Rows off by one, or right rows whose gradient never reaches the sender: either way
    "auto" falls back to the dense exchange rather than train on wrong values."""
    from te_jax_perm.parallel import a2a_support

    def collective(*args, **kw):
        y = _emulated_ragged_all_to_all(*args, **kw)
        return y + 1 if broken == "rows" else jax.lax.stop_gradient(y)
    monkeypatch.setattr(exchange.jax.lax, "ragged_all_to_all", collective)
    devs = tuple(jax.devices()[:4])
    a2a_support.forget_probes()
    try:
        assert not a2a_support.probe(devs)
        assert resolve_a2a("auto", devs) == "dense"
    finally:
        a2a_support.forget_probes()


@pytest.mark.gpu
@pytest.mark.parametrize("slices", [1, 4, 256])
def test_gpu_ragged_exchange_in_slices_moves_what_the_dense_one_moves(slices):
    """XLA's real ragged all-to-all, its rows in 1, 4 or 256 slices per destination, against
    the dense exchange on every GPU of the machine (>= 2)."""
    devs = jax.devices()
    if len(devs) < 2:
        pytest.skip("needs at least 2 GPUs")
    case = _exchange_case(len(devs), cap=600, h=40)
    want, _ = _exchange_both_ways(devs, "dense", case)
    for got, w in zip(_exchange_both_ways(devs, "ragged", case, slices)[0], want):
        np.testing.assert_array_equal(got, w)


@pytest.mark.gpu
@pytest.mark.parametrize("a2a", ["dense", "ragged"])
def test_gpu_all_devices(a2a):
    """On every GPU of the machine (>= 2), the real kernels and the real collectives."""
    devs = jax.devices()
    if len(devs) < 2:
        pytest.skip("needs at least 2 GPUs")
    if a2a == "ragged" and not ragged_all_to_all_supported(devs):
        pytest.fail(f"ragged_all_to_all does not work on {devs[0].device_kind} x{len(devs)}")
    for routing, n_out, cap in [("uniform", None, None), ("skewed", 40, 9), ("empty", 48, 12)]:
        with jax.default_matmul_precision("highest"):   # TF32 would swamp the comparison
            _check(4 * len(devs), 2, routing, n_out, cap, backend="triton", a2a=a2a, seed=11,
                   devices=devs, t=32, rtol=1e-4, atol=1e-4)


# -- the memory pre-check and the example that uses it --------------------------------------
import json  # noqa: E402
import os  # noqa: E402
import pathlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from te_jax_perm.parallel.memory import GIB, ep_working_set, fits  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
EP_EXAMPLE = ROOT / "examples" / "moe_expert_parallel.py"


def test_working_set_counts_weights_activations_and_capacity():
    kw = dict(tokens=4096, hidden=4096, ffn=2048, experts=32, ep=4, num_out_tokens=4096 * 8, gated=False)
    ws = ep_working_set(**kw, dtype="bfloat16")
    el = 32 // 4
    weights = el * 2 * 4096 * 2048 * 2
    assert ws.parts["expert weights"] == ws.parts["weight gradients"] == weights
    gated = ep_working_set(**{**kw, "gated": True}, dtype="bfloat16")     # w_in [E, H, 2F]
    assert gated.parts["expert weights"] == weights * 3 // 2 and gated.parts["transposed weight copy"] == weights
    # The layer's default activation (SwiGLU) is gated, and so is the estimate's default.
    assert ep_working_set(**{k: v for k, v in kw.items() if k != "gated"}, dtype="bfloat16") == gated
    assert gated.parts["grouped rows and FFN"] > ws.parts["grouped rows and FFN"]
    split = ep_working_set(**kw, dtype="bfloat16", fsdp=4)        # a quarter kept, whole ones gathered per step
    assert split.parts["expert weights"] == weights // 4 and split.parts["gathered weights"] == weights
    assert split.parts["weight gradients"] == weights + weights // 4 and "gathered weights" not in ws.parts
    assert ws.total > 3 * weights
    # Dense exchange buffers grow with the capacity; ragged ones send no padding buffer.
    small = ep_working_set(**kw, capacity=4096, dtype="bfloat16")
    assert small.parts["exchange buffers"] * 8 == ws.parts["exchange buffers"]
    assert ep_working_set(**kw, dtype="bfloat16", a2a="ragged").total < ws.total
    assert ep_working_set(**kw, dtype="float32").total > 1.5 * ws.total   # the float32 FFN parts stay
    ok, msg = fits(ws, int(ws.total / 0.9) + 1)
    assert ok and "fits in" in msg
    ok, msg = fits(ws, ws.total)
    assert not ok and "does NOT fit" in msg and f"{ws.total / GIB:.1f} GiB" in msg
    assert fits(ws, None)[0]      # unknown device memory (CPU): not checked


def _run_example(*args, bench: bool = False):
    """The example (or, with ``bench``, ``benchmarks.ep_bench``) in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # The example's --cpu_devices decides the device count, not this process's.
    env["XLA_FLAGS"] = without_cpu_devices()
    env.pop("TE_JAX_PERM_BACKEND", None)
    env["JAX_PLATFORMS"] = "cpu"  # these runs are about virtual CPU devices, also on a GPU machine
    cmd = [sys.executable, "-m", "benchmarks.ep_bench"] if bench else [sys.executable, str(EP_EXAMPLE)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


def test_example_exits_with_a_message_when_the_layer_cannot_fit():
    # DeepSeek-V3-sized experts on 2 devices against a 16 GiB device: refused before anything is built.
    proc = _run_example("--cpu_devices=2", "--tokens=4096", "--hidden=7168", "--ffn=2048", "--experts=256",
                        "--topk=8", "--dtype=bfloat16", "--device_memory_gib=16")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "does NOT fit" in proc.stdout and "WON'T FIT: not compiling" in proc.stdout
    assert "compile" not in proc.stdout.split("WON'T FIT")[0].split("memory check")[0]


def test_example_runs_when_the_layer_fits():
    # Two data copies of a 2-device group, the weights split over them, SwiGLU experts (the
    # example's default activation).
    proc = _run_example("--cpu_devices=4", "--data=2", "--fsdp", "--tokens=48", "--hidden=32", "--ffn=32", "--experts=8",
                        "--check_tokens=32", "--device_memory_gib=1")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "x4 as 2 data copies of 2 (weights split over them): E=8 (4 per device)" in out and "silu_glu" in out
    assert "fits in 90% of the device's 1.0 GiB" in out
    assert "vs single-device reference on 32 tokens" in out and "-> ok" in out
    assert "train step" not in out      # timing is the benchmark's
    assert "--backend=interpret" in out
    assert out.strip().splitlines()[-1].startswith("PASS: expert-parallel layer on 4 cpu devices (2 data copies)")


def test_benchmark_times_the_example_layer_and_weak_scales(tmp_path):
    """benchmarks/ep_bench.py on the example's layer and flags: the step and one exchange
    timed per mode at 1, 2 and 4 devices, each over the 1-device step, written as JSON and
    charted beside it."""
    out_json = tmp_path / "ep.json"
    proc = _run_example("--cpu_devices=4", "--tokens=48", "--hidden=32", "--ffn=32", "--experts=8",
                        "--device_memory_gib=1", "--weak_scaling", "--steps=1", f"--json_out={out_json}", bench=True)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "memory check (1 device)" in out and "memory check (4 devices)" in out
    assert "weak scaling: 4 devices (8 experts)" in out and "one row exchange alone" in out
    runs = json.loads(out_json.read_text())["runs"]
    assert [r["devices"] for r in runs] == [1, 2, 4] and runs[0]["experts"] == 2
    assert all(m["step_ms"] > 0 and m["exchange_ms"] > 0 for r in runs for m in r["modes"].values())
    assert all("weak_scaling_ratio" in m for r in runs[1:] for m in r["modes"].values())
    assert (tmp_path / "ep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_example_takes_its_default_activation_from_the_layer():
    """The example's --activation default (and its Sizes') is EPConfig's, not a copy of it:
    with EPConfig's default changed before the example is imported, the example's follows."""
    code = "\n".join([
        "import dataclasses",
        "import te_jax_perm.parallel as parallel",
        "from te_jax_perm.parallel import ep_moe",
        "Other = dataclasses.make_dataclass('Other', [('activation', str, 'relu')], bases=(ep_moe.EPConfig,),",
        "                                   frozen=True)",
        "parallel.EPConfig = ep_moe.EPConfig = Other",
        "from examples import moe_expert_parallel as example",
        "print(example.FLAGS['activation'].default, example.Sizes(1, 1, 1, 1, 1, 1, 'float32', None).activation)"])
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["relu", "relu"]


def test_example_helpshort_explains_every_flag():
    import re
    example = {"cpu_devices", "devices", "tokens", "hidden", "ffn", "experts", "topk", "dtype", "routing",
               "capacity", "backend", "gemm", "a2a", "check_tokens", "device_memory_gib", "data", "fsdp", "activation"}
    # The benchmark's own flags are its --helpshort; the example's, which it takes too, are in --helpfull.
    for bench, how, want in ((False, "--helpshort", example), (True, "--helpshort", {"steps", "weak_scaling", "json_out"}),
                             (True, "--helpfull", example)):
        proc = _run_example(how, bench=bench)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 0, text
        names = re.findall(r"^  --(?:\[no\])?(\w+):(.*)$", text[text.index("flags:"):], re.M)
        assert {n for n, _ in names} >= want, (bench, text)
        assert all(len(h.strip()) > 10 for _, h in names), names
