"""Expert-parallel MoE layer on 8 virtual CPU devices against the dense single-device
reference: forward, gradients, dropped rows, skewed routing, an expert with no tokens.
Runs in a subprocess (XLA_FLAGS must precede jax start-up)."""
import os
import subprocess
import sys

import numpy as np
import pytest

MULTI = os.environ.get("TE_JAX_PERM_MULTIDEVICE") == "1"
multidevice = pytest.mark.skipif(not MULTI, reason="runs in the 8-device subprocess")


def test_in_8_device_subprocess():
    if MULTI:
        pytest.skip("already in the 8-device subprocess")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "TE_JAX_PERM_MULTIDEVICE": "1", "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__)],
                       env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout, r.stdout[-2000:]


if MULTI:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from te_jax_perm.parallel import EPConfig, ep_moe_layer, reference_moe_layer

EP, T, H, F = 8, 12, 16, 8


def _problem(e, k, routing, seed):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((EP * T, e))
    if routing == "skewed":      # expert 0 takes every token (half of all routed rows at k=2)
        logits[:, 0] += 100.0
    if routing == "empty":       # expert e-1 receives no token
        logits[:, e - 1] -= 100.0
    top = np.argsort(-logits, 1)[:, :k]
    rm = np.zeros((EP * T, e), bool)
    np.put_along_axis(rm, top, True, 1)
    probs = jnp.asarray(jax.nn.softmax(jnp.asarray(logits), -1), jnp.float32)
    x = jnp.asarray(rng.standard_normal((EP * T, H)), jnp.float32)
    w1 = jnp.asarray(rng.standard_normal((e, H, F)) * 0.2, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, F, H)) * 0.2, jnp.float32)
    return x, rm, probs, w1, w2


def _check(e, k, routing, num_out_tokens, capacity, backend="xla", seed=0):
    mesh = Mesh(np.array(jax.devices()[:EP]), ("ep",))
    x, rm, probs, w1, w2 = _problem(e, k, routing, seed)
    cfg = EPConfig(num_out_tokens=num_out_tokens, capacity=capacity, backend=backend)
    layer = lambda x, p, a, b: ep_moe_layer(x, rm, p, a, b, mesh=mesh, cfg=cfg)
    ref = lambda x, p, a, b: reference_moe_layer(x, rm, p, a, b, ep=EP, num_out_tokens=num_out_tokens,
                                                 capacity=capacity)
    got, want = jax.jit(layer)(x, probs, w1, w2), ref(x, probs, w1, w2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    ct = jnp.asarray(np.random.default_rng(seed + 1).standard_normal(want.shape), jnp.float32)
    loss = lambda fn: (lambda *a: (fn(*a) * ct).sum())
    g = jax.jit(jax.grad(loss(layer), argnums=(0, 1, 2, 3)))(x, probs, w1, w2)
    gr = jax.grad(loss(ref), argnums=(0, 1, 2, 3))(x, probs, w1, w2)
    for name, a, b in zip(("x", "probs", "w1", "w2"), g, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5, err_msg=name)
    return jax.jit(layer).lower(x, probs, w1, w2).compile().as_text()


@multidevice
@pytest.mark.parametrize("routing", ["uniform", "skewed", "empty"])
@pytest.mark.parametrize("e,k", [(8, 2), (16, 3)])
def test_forward_and_gradients_match_single_device(routing, e, k):
    hlo = _check(e, k, routing, None, None)
    assert "all-to-all" in hlo           # asked for
    assert "all-gather" not in hlo       # not asked for


@multidevice
@pytest.mark.parametrize("num_out_tokens,capacity", [(T * 2, None), (T * 2, 3), (7, 2), (T * 2, 1)])
@pytest.mark.parametrize("routing", ["uniform", "skewed"])
def test_dropped_rows_follow_the_reference_rule(num_out_tokens, capacity, routing):
    _check(8, 2, routing, num_out_tokens, capacity, seed=3)


@multidevice
def test_interpret_backend_small():
    _check(8, 2, "uniform", None, 4, backend="interpret", seed=5)
