"""Lower-level permute/unpermute primitives and their kernel declarations (issue 3)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import te_jax_perm
from te_jax_perm.core import Config
from te_jax_perm.ops import permute as P
from tests import numpy_reference as ref


def _setup(seed=0, t=11, h=67, e=5, k=2, mode="skew", budget=1.0):
    rng = np.random.default_rng(seed)
    rm = ref.routing(rng, t, e, k, mode)
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


def test_kept_per_expert_recovered_from_map():
    rm, n, _, _ = _setup(budget=0.7)
    rid, kept = te_jax_perm.make_row_id_map(rm, n, backend="xla")
    np.testing.assert_array_equal(np.asarray(P.kept_per_expert(rid)), np.asarray(kept))


# Configs that change ROWS (token ranges per program) and BLOCK_H (loop over H): all exact.
_SOME_CONFIGS = [Config.make(num_warps=2, BLOCK_H=32, ROWS=1), Config.make(num_warps=4, BLOCK_H=64, ROWS=4),
                 Config.make(num_warps=4, BLOCK_H=128, ROWS=2)]


@pytest.mark.parametrize("cfg", _SOME_CONFIGS, ids=str)
def test_every_kernel_config_matches_reference(kernel_backend, cfg):
    rm, n, x, p = _setup(t=9, h=67, budget=0.8)
    rid, kept = te_jax_perm.make_row_id_map(rm, n, backend="xla")
    e_out, e_pp, dest, e_pad, _ = ref.dispatch(x, rm, n, p, 4)
    pad = jnp.asarray(e_pad, jnp.int32)
    ss, sc = P._segments(kept, pad)
    rows = e_out.shape[0]
    for b in ("xla", kernel_backend):
        out, pp = P.permute_rows_probs(x, rid, pad, ss, sc, p, backend=b, config=cfg if b != "xla" else None,
                                       num_out_rows=rows, padded=True)
        np.testing.assert_array_equal(np.asarray(out), e_out)
        np.testing.assert_array_equal(np.asarray(pp), e_pp)
        (y,) = P.unpermute_rows_weighted(out, rid, pad, p, backend=b, config=cfg if b != "xla" else None,
                                        padded=True)
        np.testing.assert_allclose(np.asarray(y), ref.combine(e_out, dest, p), rtol=1e-5, atol=1e-6)


def test_declarations_prune_bad_configs():
    d = {"T": 4, "H": 64, "E": 2, "W": 5}
    decl = P.permute_rows.decl
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
