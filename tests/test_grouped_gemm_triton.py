"""grouped_gemm_triton against the float64 NumPy per-group reference (sizes clamped as documented):
values, VJP, edge group sizes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax_perm.ops.grouped_gemm import decl as D
from te_jax_perm.ops.grouped_gemm.api import grouped_gemm_triton
from te_jax_perm.ops.grouped_gemm.reference import clamped_group_sizes, grouped_matmul_reference


def _np_grads(lhs, rhs, sizes, dout):
    m = lhs.shape[0]
    dlhs = np.zeros(lhs.shape)
    drhs = np.zeros(rhs.shape)
    start = 0
    for g, n in enumerate(sizes):
        n = int(min(max(int(n), 0), m - start))
        rows = slice(start, start + n)
        dlhs[rows] = dout[rows].astype(np.float64) @ rhs[g].astype(np.float64).T
        drhs[g] = lhs[rows].astype(np.float64).T @ dout[rows].astype(np.float64)
        start += n
    return dlhs, drhs


CASES = [
    # (M, K, N, group sizes): empty groups, rows past the last group, sizes summing past M,
    # negative sizes, int32-overflowing sums, a single group, ragged K/N not multiple of any tile.
    (40, 32, 48, [10, 0, 25]),
    (33, 16, 16, [40, 5]),
    (17, 16, 32, [-3, 7, 2, 100]),
    (64, 64, 64, [64]),
    (24, 24, 40, [0, 0, 0]),
    (20, 16, 16, [5, 2**31 - 1, 2**31 - 1, -2**31]),  # sums that overflow int32
]


@pytest.mark.parametrize("m,k,n,sizes", CASES)
def test_values_and_vjp_match_numpy(backend, m, k, n, sizes):
    rng = np.random.default_rng(m * 100 + k)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    dout = rng.standard_normal((m, n)).astype(np.float32)
    gs = np.asarray(sizes, np.int32)
    out, vjp = jax.vjp(lambda a, b: grouped_gemm_triton(a, b, gs, backend=backend), lhs, rhs)
    # TF32 tensor cores on GPU: the tolerance covers 10-bit mantissas over K <= 64 terms.
    tol = dict(rtol=2e-2, atol=5e-2)
    np.testing.assert_allclose(np.asarray(out), grouped_matmul_reference(lhs, rhs, sizes), **tol)
    dlhs, drhs = vjp(dout)
    ref_dlhs, ref_drhs = _np_grads(lhs, rhs, sizes, dout)
    np.testing.assert_allclose(np.asarray(dlhs), ref_dlhs, **tol)
    np.testing.assert_allclose(np.asarray(drhs), ref_drhs, **tol)


def test_bf16_under_jit_with_traced_sizes(backend):
    rng = np.random.default_rng(7)
    lhs = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((4, 64, 128)) / 8, jnp.bfloat16)
    sizes = jnp.asarray([30, 0, 50, 10], jnp.int32)
    out = jax.jit(lambda a, b, s: grouped_gemm_triton(a, b, s, backend=backend))(lhs, rhs, sizes)
    assert out.dtype == jnp.bfloat16 and out.shape == (96, 128)
    ref = grouped_matmul_reference(np.asarray(lhs, np.float32), np.asarray(rhs, np.float32), [30, 0, 50, 10])
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=2e-2, atol=5e-2)
    assert not np.asarray(out[90:]).any()  # rows past the groups are zeros, not poison


def test_every_config_of_the_space_is_correct_on_the_kernel_backend(kernel_backend):
    # Each candidate the autotuner may pick must give the same result (tiles that overlap or
    # skip rows would show up here), at a shape where several tiles cover each group.
    rng = np.random.default_rng(3)
    lhs = rng.standard_normal((150, 64)).astype(np.float32)
    rhs = rng.standard_normal((3, 64, 128)).astype(np.float32)
    sizes = np.asarray([70, 1, 60], np.int32)
    ref = grouped_matmul_reference(lhs, rhs, sizes)
    seen = set()
    for cfg in D.grouped_gemm.decl.configs:
        key = (cfg.kw["BM"], cfg.kw["BN"], cfg.kw["BK"])
        if key in seen or D.grouped_gemm.decl.violated({"M": 150, "C": 64, "D": 128, "G": 3}, {"elem_bytes": 4}, cfg):
            continue  # warps/stages don't change the tiling; pruned configs never run
        seen.add(key)
        (out,) = D.grouped_gemm(lhs, rhs, sizes, backend=kernel_backend, config=cfg, elem_bytes=4)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-2, atol=5e-2, err_msg=str(cfg))


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"rhs has shape \(2, 8, 4\); expected \[G, 16, N\]"):
        grouped_gemm_triton(jnp.zeros((4, 16)), jnp.zeros((2, 8, 4)), jnp.zeros((3,), jnp.int32))
    with pytest.raises(TypeError, match="lhs has dtype float32 but rhs has bfloat16"):
        grouped_gemm_triton(jnp.zeros((4, 8)), jnp.zeros((1, 8, 4), jnp.bfloat16), jnp.zeros((1,), jnp.int32))


def test_clamped_group_sizes():
    got = clamped_group_sizes(jnp.asarray([-3, 7, 2, 100], jnp.int32), 17)
    np.testing.assert_array_equal(np.asarray(got), [0, 7, 2, 8])


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("m,c,d", [(60, 64, 512), (4096, 4096, 3072), (65536, 2048, 7168), (16, 7168, 128)])
def test_default_configs_meet_their_own_constraints(elem_bytes, m, c, d):
    # fp32 operands double a tile's shared-memory bytes: the default must still fit.
    params = {"elem_bytes": elem_bytes}
    for decl, dims in ((D.grouped_gemm.decl, {"M": m, "C": c, "D": d, "G": 8}),
                       (D.grouped_gemm_rhs_t.decl, {"M": m, "C": d, "D": c, "G": 8}),
                       (D.grouped_gemm_wgrad.decl, {"M": m, "K": c, "N": d, "G": 8})):
        cfg = decl.default_config(dims, params)
        assert [why for check in decl.constraints if (why := check(dims, params, cfg))] == [], (decl.name, cfg)
