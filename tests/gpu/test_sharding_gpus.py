"""Sharding on real GPUs: the ``triton`` backend's token-sharded, vmapped and ``shard_map``
calls on two or more GPUs give the ``xla`` backend's results on the same mesh, and compile
with the same collectives. The 8-device tests of ``tests/test_sharding.py`` run on virtual
CPU devices, where the kernels run as the ``xla`` backend's JAX: these run the kernels
themselves, in per-device modules partitioned by the rules. Skipped with fewer than two GPUs.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tests.multidevice import collectives_in
from te_jax_perm.workloads import top_k_map

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(GPUS) < 2, reason="needs two or more GPUs")]
T, E, H, F, K = 256, 8, 128, 64, 2


def _problem(seed: int = 0, batch: tuple[int, ...] = ()):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(batch + (T, H)), jnp.float32)
    rm = jnp.asarray(np.stack([top_k_map(rng.standard_normal((T, E)), K) for _ in range(int(np.prod(batch)))])
                     .reshape(batch + (T, E)))
    probs = jnp.asarray(rng.random(batch + (T, E)), jnp.float32) * rm
    dy = jnp.asarray(rng.standard_normal(batch + (T, H)), jnp.float32)
    return x, rm, probs, dy


def _both(step, args, shardings):
    """``step(backend)`` compiled and run for each backend on ``args`` placed by ``shardings``:
    {backend: (results, collectives)}."""
    placed = [jax.device_put(a, s) for a, s in zip(args, shardings)]
    out = {}
    for backend in ("triton", "xla"):
        compiled = jax.jit(step(backend)).lower(*placed).compile()
        out[backend] = (jax.device_get(compiled(*placed)), collectives_in(compiled))
    return out


def _dispatch_combine(backend):
    import te_jax_perm

    def loss(x, p, rm, dy):
        rows, pp, rid, _, _ = te_jax_perm.token_dispatch(x, rm, x.shape[-2] * K, probs=p, backend=backend)
        y = te_jax_perm.token_combine(rows * pp[:, None], rid, merging_probs=p, backend=backend)
        return jnp.sum(y * dy), rows

    def step(x, p, rm, dy):
        (value, rows), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, p, rm, dy)
        return value, rows, grads
    return step


def _assert_same(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("partitioner", [True, False], ids=["shardy", "gspmd"], indirect=True)
@pytest.mark.parametrize("split", ["tokens", "hidden"])
def test_sharded_dispatch_combine_step_matches_xla(partitioner, split):
    """Tokens split over every GPU (each shard dispatches its own tokens), or the hidden
    axis (the rows move slice by slice; the probability gradient's dot products sum over
    all of it): the rows moved, the loss and both gradients equal the xla backend's, with
    its collectives."""
    mesh = Mesh(np.array(GPUS), ("d",))
    x, rm, probs, dy = _problem()
    rows, hidden, whole = (NamedSharding(mesh, P(*s)) for s in (("d",), (None, "d"), ()))
    placed = [rows] * 4 if split == "tokens" else [hidden, whole, whole, hidden]
    got = _both(_dispatch_combine, (x, probs, rm, dy), placed)
    _assert_same(got["triton"][0], got["xla"][0])
    assert got["triton"][1] == got["xla"][1]
    if split == "tokens":
        assert "all-gather" not in got["triton"][1]
    else:
        # Both backends share the split rule: against the unsharded step too (the rows'
        # layout is the unsharded one when the tokens are whole).
        _assert_same(got["triton"][0], jax.device_get(jax.jit(_dispatch_combine("xla"))(x, probs, rm, dy)))


def test_vmapped_token_sharded_dispatch_combine_matches_xla():
    """Two micro-batches, their tokens split over the GPUs, vmapped: per item as unbatched."""
    mesh = Mesh(np.array(GPUS), ("d",))
    x, rm, probs, dy = _problem(1, batch=(2,))
    split = NamedSharding(mesh, P(None, "d"))
    got = _both(lambda b: jax.vmap(_dispatch_combine(b)), (x, probs, rm, dy), [split] * 4)
    _assert_same(got["triton"][0], got["xla"][0])
    assert got["triton"][1] == got["xla"][1]
    assert "all-gather" not in got["triton"][1]


def test_token_sharded_moe_ffn_matches_xla():
    """The fused expert layer with its tokens split over the GPUs and FSDP-split weights:
    loss and every gradient as the xla backend's (within TF32 matmul rounding)."""
    import te_jax_perm
    mesh = Mesh(np.array(GPUS), ("d",))
    x, rm, probs, dy = _problem(2)
    rng = np.random.default_rng(3)
    w_in = jnp.asarray(rng.standard_normal((E, H, 2 * F)) / 8, jnp.float32)
    w_out = jnp.asarray(rng.standard_normal((E, F, H)) / 8, jnp.float32)

    def step(backend):
        loss = lambda x, p, w_in, w_out, rm, dy: jnp.sum(  # noqa: E731
            te_jax_perm.moe_ffn(x, rm, p, w_in, w_out, T * K, backend=backend) * dy)
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))

    split, fsdp = NamedSharding(mesh, P("d")), NamedSharding(mesh, P(None, "d"))
    got = _both(step, (x, probs, w_in, w_out, rm, dy), [split, split, fsdp, fsdp, split, split])
    for g, w in zip(jax.tree.leaves(got["triton"][0]), jax.tree.leaves(got["xla"][0])):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-2, atol=2e-2 * float(np.abs(w).max()))
    assert got["triton"][1] == got["xla"][1]


@pytest.mark.parametrize("partitioner", [True, False], ids=["shardy", "gspmd"], indirect=True)
@pytest.mark.parametrize("manual_gpus", [len(GPUS), 1], ids=["automatic_axis_of_1", "automatic_axis_of_all"])
def test_partly_manual_shard_map_matches_xla(partitioner, manual_gpus):
    """A shard_map manual over one mesh axis of two, the other automatic: the kernels run
    unpartitioned where JAX's custom_partitioning cannot (under GSPMD; under Shardy with the
    automatic axis of size 1), else by their rules; each as the xla backend's."""
    mesh = Mesh(np.array(GPUS).reshape(manual_gpus, len(GPUS) // manual_gpus), ("d0", "d1"))
    x, rm, probs, dy = _problem(4)

    def step(backend):
        def per_shard(*args):
            value, rows, grads = _dispatch_combine(backend)(*args)
            return value[None], rows, grads
        return jax.shard_map(per_shard, mesh=mesh, in_specs=(P("d0"),) * 4,
                             out_specs=(P("d0"), P("d0"), (P("d0"), P("d0"))), axis_names={"d0"})

    got = _both(step, (x, probs, rm, dy), [NamedSharding(mesh, P("d0"))] * 4)
    _assert_same(got["triton"][0], got["xla"][0])
