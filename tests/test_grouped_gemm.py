"""grouped_matmul: values and VJP against lax.ragged_dot and a NumPy per-group reference,
with empty groups, rows past the groups, and the padded groups token_dispatch produces; the
Triton grouped GEMM (each backend, each config of its space, the persistent TMA configs in
Triton's interpreter and compiled for sm_90) with the group sizes clamped as documented."""
import collections
import contextlib
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

import te_jax_perm
from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare, hooks
from te_jax_perm.kernels.grouped_gemm import group_bounds, row_schedule, schedule_tile
from te_jax_perm.ops.grouped_gemm import decl as D
from te_jax_perm.ops.grouped_gemm.api import BACKENDS, KERNEL_BACKENDS, grouped_matmul, tokamax_available
from te_jax_perm.ops.grouped_gemm.reference import clamped_group_sizes, grouped_matmul_reference
from te_jax_perm.workloads import top_k_map
from tests.conftest import ON_GPU, compiled_for_sm90

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
# The static params of the row-tile GEMM declarations: operand width and output dtype.
BF16, F32 = {"elem_bytes": 2, "out_dtype": "bfloat16"}, {"elem_bytes": 4, "out_dtype": "float32"}


def _problem(m, k, n, sizes, dtype, seed=0, tail=np.nan):
    """lhs [m, k] with ``tail`` in the rows past sum(sizes), rhs [G, k, n], dout [m, n]."""
    rng = np.random.default_rng(seed)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    lhs[int(np.sum(sizes)):] = tail
    rhs = (rng.standard_normal((len(sizes), k, n)) / np.sqrt(k)).astype(np.float32)
    dout = rng.standard_normal((m, n)).astype(np.float32)
    cast = lambda a: jnp.asarray(a, dtype)
    return cast(lhs), cast(rhs), jnp.asarray(sizes, jnp.int32), dout


def _reference_grads(lhs, rhs, sizes, dout):
    """Per group: dlhs rows = dout rows @ rhs[g]^T, drhs[g] = lhs rows^T @ dout rows; float64,
    group sizes clamped to [0, M] and their running sum to M."""
    lhs, rhs, dout = (np.asarray(a, np.float64) for a in (lhs, rhs, dout))
    dlhs, drhs = np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, n in enumerate(np.asarray(sizes)):
        rows = slice(start, start + int(min(max(int(n), 0), lhs.shape[0] - start)))
        dlhs[rows] = dout[rows] @ rhs[g].T
        drhs[g] = lhs[rows].T @ dout[rows]
        start = rows.stop
    return dlhs, drhs


@pytest.fixture(autouse=True)
def _highest_precision():
    # XLA:GPU multiplies float32 in TF32 by default; the float32 cases compare to float64
    # NumPy at float32 tolerances, so the XLA implementation must use full precision.
    with jax.default_matmul_precision("highest"):
        yield


def _close(got, want, dtype, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.abs(want).max(), 1.0) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL[dtype] * scale, err_msg=what)


SIZES = [
    [5, 0, 9, 3],               # an empty group in the middle, 3 rows past the groups
    [0, 0, 16, 0],              # one group takes everything, M exactly covered
    [0, 0, 0],                  # no rows in any group: all zeros
    [1, 2, 3, 4, 5, 1],         # many small groups
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sizes", SIZES)
def test_values_match_numpy_and_ragged_dot(sizes, dtype):
    m = 16 if sum(sizes) == 16 else sum(sizes) + 3
    lhs, rhs, gs, _ = _problem(m, 24, 12, sizes, dtype)
    out = grouped_matmul(lhs, rhs, gs, preferred_element_type=jnp.float32, backend="xla")
    assert out.shape == (m, 12) and out.dtype == jnp.float32
    clean = jnp.nan_to_num(lhs)
    _close(out, grouped_matmul_reference(clean, rhs, gs), dtype, "vs numpy")
    _close(out, jax.lax.ragged_dot(clean, rhs, gs, preferred_element_type=jnp.float32), dtype,
           "vs lax.ragged_dot")
    assert np.all(np.asarray(out)[sum(sizes):] == 0), "rows past the groups must be zero"
    assert grouped_matmul(lhs, rhs, gs, backend="xla").dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sizes", SIZES)
def test_vjp_matches_numpy_and_ragged_dot(sizes, dtype):
    m = sum(sizes) + 5
    lhs, rhs, gs, dout = _problem(m, 16, 8, sizes, dtype, seed=1)
    _, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, preferred_element_type=jnp.float32, backend="xla"),
                     lhs, rhs)
    dlhs, drhs = vjp(jnp.asarray(dout))
    assert dlhs.dtype == lhs.dtype and drhs.dtype == rhs.dtype
    assert np.all(np.isfinite(np.asarray(dlhs, np.float32))) and np.all(np.isfinite(np.asarray(drhs, np.float32))), \
        "garbage (NaN) rows past the groups leaked into the gradients"
    want_dlhs, want_drhs = _reference_grads(jnp.nan_to_num(lhs), rhs, gs, dout.astype(np.asarray(lhs).dtype))
    _close(dlhs, want_dlhs, dtype, "dlhs vs numpy")
    _close(drhs, want_drhs, dtype, "drhs vs numpy")
    assert np.all(np.asarray(dlhs, np.float32)[sum(sizes):] == 0)
    clean = jnp.nan_to_num(lhs)
    _, vjp_ref = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, gs, preferred_element_type=jnp.float32), clean, rhs)
    ref_dlhs, ref_drhs = vjp_ref(jnp.asarray(dout))
    _close(drhs, ref_drhs, dtype, "drhs vs lax.ragged_dot")
    _close(np.asarray(dlhs, np.float32)[:sum(sizes)], np.asarray(ref_dlhs, np.float32)[:sum(sizes)], dtype,
           "dlhs vs lax.ragged_dot")


def test_second_order_shapes_under_jit_and_grad_of_a_two_layer_ffn():
    """The expert FFN shape (up, activation, down) trains under jit: grads match lax.ragged_dot."""
    lhs, w1, gs, _ = _problem(30, 8, 12, [7, 0, 11, 6], "float32", seed=2, tail=0.0)
    w2 = jnp.asarray(np.random.default_rng(3).standard_normal((4, 12, 8)), jnp.float32)

    def ffn(mm):
        return lambda x, a, b: jnp.sum(jnp.tanh(mm(jax.nn.silu(mm(x, a)), b)))

    ours = ffn(lambda x, w: grouped_matmul(x, w, gs, backend="xla"))
    ref = ffn(lambda x, w: jax.lax.ragged_dot(x, w, gs))
    got = jax.jit(jax.grad(ours, (0, 1, 2)))(lhs, w1, w2)
    want = jax.grad(ref, (0, 1, 2))(lhs, w1, w2)
    for g, w, name in zip(got, want, ("x", "w1", "w2")):
        _close(g, w, "float32", name)


def test_vmap_with_shared_weights_nested_and_over_the_weights(backend):
    """A vmapped batch of row blocks sharing one weight tensor (XLA's ragged dot has no rule
    for an unbatched operand), gradients included; vmap nested; and vmap over the weights
    alone: each equals the blocks one by one, on each backend of this machine."""
    rng = np.random.default_rng(4)
    lhs = jnp.asarray(rng.standard_normal((3, 12, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, 8, 5)), jnp.float32)
    gs = jnp.asarray([[3, 4, 2, 3], [0, 6, 6, 0], [12, 0, 0, 0]], jnp.int32)
    mm = lambda x, w, g: grouped_matmul(x, w, g, backend=backend)  # noqa: E731
    one_by_one = jnp.stack([mm(lhs[i], w, gs[i]) for i in range(3)])
    _close(jax.vmap(mm, in_axes=(0, None, 0))(lhs, w, gs), one_by_one, "float32", "shared weights")
    _close(jax.vmap(jax.vmap(mm, in_axes=(0, None, 0)), in_axes=(0, None, 0))(lhs[None], w, gs[None])[0],
           one_by_one, "float32", "nested")
    _close(jax.vmap(mm, in_axes=(None, 0, None))(lhs[0], jnp.stack([w, 2 * w]), gs[0])[1], 2 * one_by_one[0],
           "float32", "batched weights")
    batched = lambda x, w: jnp.sum(jax.vmap(mm, in_axes=(0, None, 0))(x, w, gs) ** 2)  # noqa: E731
    looped = lambda x, w: sum(jnp.sum(mm(x[i], w, gs[i]) ** 2) for i in range(3))  # noqa: E731
    for got, want, name in zip(jax.jit(jax.grad(batched, (0, 1)))(lhs, w), jax.grad(looped, (0, 1))(lhs, w),
                               ("dlhs", "drhs")):
        _close(got, want, "float32", name)


@pytest.mark.parametrize("align", [None, 8])
def test_padded_groups_from_token_dispatch(align):
    """Group sizes from tokens_per_expert (padded with align_size): dispatch -> grouped GEMM ->
    combine equals each token's sum over its experts of prob * (x @ w[e]); the padding rows and
    the rows past the groups stay zero."""
    rng = np.random.default_rng(4)
    t, h, n, e, k = 21, 16, 8, 5, 2
    logits = rng.standard_normal((t, e))
    logits[:, 3] -= 100.0                      # expert 3 gets no token: an empty (padded: 0) group
    rm = top_k_map(logits, k)
    probs = np.where(rm, rng.random((t, e)), 0.0).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((e, h, n)), jnp.float32)
    rows, _, rid, pad_offsets, tpe = te_jax_perm.token_dispatch(x, jnp.asarray(rm), t * k, align_size=align,
                                                                backend="xla")
    if align:
        assert np.all(np.asarray(tpe) % align == 0)
    assert int(np.sum(tpe)) <= rows.shape[0]
    y = grouped_matmul(rows, w, tpe, backend="xla")
    assert np.all(np.asarray(y)[int(np.sum(tpe)):] == 0)
    out = te_jax_perm.token_combine(y, rid, merging_probs=jnp.asarray(probs), pad_offsets=pad_offsets,
                                    backend="xla")
    want = np.einsum("te,teh->th", probs, np.einsum("th,ehn->ten", np.asarray(x), np.asarray(w)))
    _close(out, want, "float32", "dispatch -> grouped GEMM -> combine")

    def loss(x, w):
        r, _, rid, pad, tpe = te_jax_perm.token_dispatch(x, jnp.asarray(rm), t * k, align_size=align, backend="xla")
        return jnp.sum(te_jax_perm.token_combine(grouped_matmul(r, w, tpe, backend="xla"), rid,
                                                 merging_probs=jnp.asarray(probs), pad_offsets=pad,
                                                 backend="xla") ** 2)

    def dense_loss(x, w):
        return jnp.sum(jnp.einsum("te,ten->tn", probs, jnp.einsum("th,ehn->ten", x, w)) ** 2)

    for g, r, name in zip(jax.grad(loss, (0, 1))(x, w), jax.grad(dense_loss, (0, 1))(x, w), ("x", "w")):
        _close(g, r, "float32", f"grad {name}")


def test_kernels_promote_mixed_operand_dtypes_instead_of_rounding_rhs(kernel_backend):
    """bf16 lhs with fp32 rhs: our kernels compute in fp32 (the promoted dtype), as the
    other backends do; rounding rhs to bf16 would be off by ~1e-3 relative here.
    Gradients come back in each operand's dtype."""
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.standard_normal((12, 16)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, 16, 8)), jnp.float32)
    sizes = jnp.asarray([5, 4, 3], jnp.int32)
    want = grouped_matmul_reference(np.asarray(lhs, np.float32), np.asarray(rhs), np.asarray(sizes))
    got = grouped_matmul(lhs, rhs, sizes, backend=kernel_backend)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    gl, gr = jax.grad(lambda a, b: jnp.sum(grouped_matmul(a, b, sizes, backend=kernel_backend)),
                      argnums=(0, 1))(lhs, rhs)
    assert (gl.dtype, gr.dtype) == (jnp.bfloat16, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_operands_take_xla_and_mixed_ones_name_both(dtype):
    """float8 operands (no kernel of ours) take XLA's ragged dot, accumulated in float32 and
    rounded once to float8; float8 with another dtype has no promotion, and the error names
    both operands."""
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((6, 8)), dtype)
    rhs = jnp.asarray(rng.standard_normal((2, 8, 4)), dtype)
    sizes = jnp.asarray([2, 3])
    out = grouped_matmul(lhs, rhs, sizes)
    assert out.dtype == dtype
    want = grouped_matmul(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes, backend="xla").astype(dtype)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
    with pytest.raises(TypeError, match=rf"lhs has dtype {jnp.dtype(dtype).name} and rhs float32, which JAX "
                                        "does not promote"):
        grouped_matmul(lhs, rhs.astype(jnp.float32), sizes)


@pytest.mark.parametrize("name", [*KERNEL_BACKENDS, "Interpret"])
@pytest.mark.parametrize("lhs_dtype,rhs_dtype,promoted", [("int8", "int8", "int8"), ("int8", "int32", "int32")])
def test_a_named_kernel_backend_refuses_dtypes_it_has_no_kernel_for(name, lhs_dtype, rhs_dtype, promoted):
    """Asked for our kernels by name, operands that promote to no kernel dtype raise, naming
    the backend and the way out; the same call on backend='xla' computes exactly."""
    lhs = jnp.arange(4 * 16, dtype=lhs_dtype).reshape(4, 16) % 5
    rhs = jnp.ones((1, 16, 8), rhs_dtype)
    with pytest.raises(TypeError, match=rf"backend='{name.lower()}' computes in float16, bfloat16 or float32; "
                                        rf"lhs has dtype {lhs_dtype} and rhs {rhs_dtype}, which promote to "
                                        rf"{promoted}; use backend='xla'"):
        grouped_matmul(lhs, rhs, jnp.asarray([4]), backend=name)
    out = grouped_matmul(lhs, rhs, jnp.asarray([4]), backend="xla")
    assert out.dtype == jnp.dtype(promoted)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(lhs, np.int64).sum(1, keepdims=True).repeat(8, 1))


def test_errors_name_the_argument():
    lhs, rhs, gs, _ = _problem(8, 4, 3, [2, 2], "float32", tail=0.0)
    with pytest.raises(ValueError, match=r"lhs has shape \(8, 4, 1\)"):
        grouped_matmul(lhs[..., None], rhs, gs)
    with pytest.raises(ValueError, match=r"rhs has shape \(2, 5, 3\); expected \[G, 4, N\]"):
        grouped_matmul(lhs, jnp.zeros((2, 5, 3)), gs)
    with pytest.raises(ValueError, match=r"group_sizes has shape \(3,\); expected \(2,\)"):
        grouped_matmul(lhs, rhs, jnp.array([1, 1, 1], jnp.int32))
    with pytest.raises(TypeError, match="group_sizes has dtype float32"):
        grouped_matmul(lhs, rhs, jnp.array([1.0, 1.0]))
    with pytest.raises(ValueError, match=r"^unknown backend='cublas'; expected one of "
                                         r"\('triton', 'interpret', 'xla', 'tokamax'\) or None$"):
        grouped_matmul(lhs, rhs, gs, backend="cublas")
    with pytest.raises(TypeError, match=r"^backend must be a string, got int 1; expected one of "):
        grouped_matmul(lhs, rhs, gs, backend=1)
    for name in ("xla", "tokamax"):  # every name its backend= takes gets the hint
        with pytest.raises(TypeError, match="grouped_matmul takes at most 3 positional arguments, got 4: preferred_"
                                            f"element_type and backend are keyword-only; pass backend='{name}'$"):
            grouped_matmul(lhs, rhs, gs, name)
    with pytest.raises(TypeError, match="preferred_element_type and backend are keyword-only$"):
        grouped_matmul(lhs, rhs, gs, "float32")   # a dtype's name: no backend hint
    # backend names in any case, as for every op
    np.testing.assert_array_equal(grouped_matmul(lhs, rhs, gs, backend="XLA"),
                                  grouped_matmul(lhs, rhs, gs, backend="xla"))


def test_backend_names_are_the_op_backends_and_tokamax():
    assert BACKENDS == (*te_jax_perm.BACKENDS, "tokamax")
    assert set(KERNEL_BACKENDS) == {"triton", "interpret"}


def _kernels_of_default_backend(lhs, rhs, gs) -> set[str]:
    """Our kernels in the lowered program of ``grouped_matmul(lhs, rhs, gs)`` with no
    ``backend=``, traced now (a new function each time: jit would reuse an earlier trace made
    under another backend): empty when it runs none."""
    return {c.kernel for c in te_jax_perm.audit_aliases(lambda a, b: grouped_matmul(a, b, gs), lhs, rhs).ours}


def test_default_backend_follows_use_backend_and_falls_back_to_xla_for_int8(on_cpu):
    """backend=None is the op backend in effect: XLA's ragged dot by default on a CPU, our
    kernels under use_backend('interpret') (the result theirs); operands they have no kernel
    for run XLA's ragged dot there rather than raise."""
    lhs, rhs, gs, _ = _problem(12, 16, 8, [5, 0, 4], "float32", tail=0.0)
    int8 = (jnp.asarray(lhs * 4, jnp.int8), jnp.asarray(rhs * 4, jnp.int8))
    if not ON_GPU:   # a GPU machine's default is the triton backend (the test below)
        assert _kernels_of_default_backend(lhs, rhs, gs) == set()
    with te_jax_perm.use_backend("interpret"):
        assert _kernels_of_default_backend(lhs, rhs, gs) == {"grouped_gemm"}
        np.testing.assert_array_equal(np.asarray(grouped_matmul(lhs, rhs, gs)),
                                      np.asarray(grouped_matmul(lhs, rhs, gs, backend="interpret")))
        assert _kernels_of_default_backend(*int8, gs) == set()
        out = grouped_matmul(*int8, gs)
        assert out.dtype == jnp.int8
        np.testing.assert_array_equal(np.asarray(out), np.asarray(grouped_matmul(*int8, gs, backend="xla")))
    with te_jax_perm.use_backend("xla"):
        assert _kernels_of_default_backend(lhs, rhs, gs) == set()


@pytest.mark.gpu
def test_default_backend_on_a_gpu_runs_our_kernels():
    """backend=None on a GPU machine: the triton backend, our grouped GEMM kernels (and XLA's
    ragged dot for operands they have no kernel for)."""
    lhs, rhs, gs, _ = _problem(12, 16, 8, [5, 0, 4], "float32", tail=0.0)
    kernels = _kernels_of_default_backend(lhs, rhs, gs)
    assert kernels and all(k.startswith("grouped_gemm") for k in kernels), kernels
    assert _kernels_of_default_backend(jnp.asarray(lhs * 4, jnp.int8), jnp.asarray(rhs * 4, jnp.int8), gs) == set()


@pytest.mark.parametrize("lhs_dtype,rhs_dtype,out_dtype", [("float32", "float32", None),
                                                          ("bfloat16", "bfloat16", "float32"),
                                                          ("bfloat16", "float32", None)])
def test_interpret_and_xla_give_the_same_values_and_gradients(on_cpu, lhs_dtype, rhs_dtype, out_dtype):
    """Our kernels in Triton's interpreter and XLA's ragged dot, one call apart: the same
    output (dtype included) and the same gradients in each operand's dtype, with an empty
    group and NaN rows past the groups. Equal to float32 rounding for float32 operands; with
    a bfloat16 operand the gradients round at different points (XLA's weight gradient of
    mixed operands takes dout in bf16, our kernels compute mixed operands in float32)."""
    rng = np.random.default_rng(11)
    lhs = rng.standard_normal((40, 24)).astype(np.float32)
    lhs[33:] = np.nan
    lhs, rhs = jnp.asarray(lhs, lhs_dtype), jnp.asarray(rng.standard_normal((3, 24, 16)) / 5, rhs_dtype)
    gs = jnp.asarray([10, 0, 23], jnp.int32)
    dout = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)

    def run(backend):
        f = lambda a, b: grouped_matmul(a, b, gs, preferred_element_type=out_dtype, backend=backend)  # noqa: E731
        out, vjp = jax.vjp(f, lhs, rhs)
        return (out, *vjp(dout.astype(out.dtype)))

    ours, xla = run("interpret"), run("xla")
    precision = "bfloat16" if "bfloat16" in (lhs_dtype, rhs_dtype) else "float32"
    for got, want, name in zip(ours, xla, ("out", "dlhs", "drhs")):
        assert got.dtype == want.dtype, name
        assert np.all(np.isfinite(np.asarray(got, np.float32))), name
        _close(got, want, precision, name)
    assert not np.asarray(ours[0], np.float32)[33:].any() and not np.asarray(ours[1], np.float32)[33:].any()


def test_a_64_bit_result_type_is_taken_as_jnp_dot_takes_it(backend):
    """Without jax_enable_x64, preferred_element_type=float64 gives float32 on every backend,
    called eagerly or under jit, as jnp.dot gives it (called eagerly, XLA's ragged dot failed
    to lower, its 32-bit result typed 64-bit)."""
    if jax.config.jax_enable_x64:
        pytest.skip("64-bit types are on")
    lhs, rhs, gs, _ = _problem(12, 16, 8, [5, 0, 4], "float32", tail=0.0)
    f = lambda a, b: grouped_matmul(a, b, gs, preferred_element_type=jnp.float64, backend=backend)  # noqa: E731
    with_grads = lambda a, b: (f(a, b), *jax.grad(lambda a, b: f(a, b).sum(), (0, 1))(a, b))  # noqa: E731
    want = grouped_matmul(lhs, rhs, gs, backend=backend)
    for results in (with_grads(lhs, rhs), jax.jit(with_grads)(lhs, rhs)):
        assert [r.dtype for r in results] == [jnp.float32] * 3
        np.testing.assert_array_equal(np.asarray(results[0]), np.asarray(want))


@pytest.mark.parametrize("out_dtype", ["float32", "float16", "float8_e4m3fn"])
def test_result_dtype_is_rounded_once_from_the_accumulator(kernel_backend, out_dtype):
    """bf16 operands with ``preferred_element_type`` float32: our kernels store the float32
    accumulator itself (as XLA's ragged dot returns it), not its bf16 rounding widened; a
    narrower or other float dtype is rounded once from the accumulator, as XLA rounds it.
    Sizes with 128x256 tiles and more than 2048 rows: Hopper's default tiles where they fit."""
    rng = np.random.default_rng(4)
    m, k, n, sizes = 2200, 64, 256, [1000, 0, 900]
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, k, n)) / 8, jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    got = grouped_matmul(lhs, rhs, gs, preferred_element_type=out_dtype, backend=kernel_backend)
    want = grouped_matmul(lhs, rhs, gs, preferred_element_type=out_dtype, backend="xla")
    assert got.dtype == want.dtype == jnp.dtype(out_dtype)
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    exact = np.asarray(jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs), np.float32)
    if out_dtype == "float32":
        # Sums of exact bf16 products differ by the order of float32 additions only; the
        # bf16 rounding the check guards against is hundreds of times that.
        np.testing.assert_allclose(g, exact, rtol=0, atol=2e-5 * np.abs(exact).max())
        assert np.abs(np.asarray(exact.astype(jnp.bfloat16), np.float32) - exact).max() > 1e-3 * np.abs(exact).max()
    else:
        # Rounded once: equal to XLA's result but where the float32 sums straddle a
        # rounding boundary of the narrow dtype (a handful of elements).
        assert np.mean(g != w) < 0.01, np.mean(g != w)
    assert not g[1900:].any()


def test_missing_tokamax():
    if tokamax_available():
        pytest.skip("tokamax is installed")
    lhs, rhs, gs, _ = _problem(8, 4, 3, [2, 2], "float32", tail=0.0)
    with pytest.raises(ImportError, match=r"^grouped_matmul\(backend='tokamax'\) needs tokamax: "):
        grouped_matmul(lhs, rhs, gs, backend="TokaMax")


def test_tokamax_hint_says_what_is_true_on_each_python():
    from te_jax_perm.ops.grouped_gemm.api import tokamax_install_hint
    old = tokamax_install_hint((3, 11))
    assert "Python 3.12 or newer" in old and "Python 3.11" in old and "installs nothing" in old
    assert "backend='triton'" in old and "pip install" not in old
    assert tokamax_install_hint((3, 12)) == tokamax_install_hint((3, 13)) == "pip install 'te_jax_perm[gemm]'"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "tokamax"])
@pytest.mark.parametrize("sizes", [[300, 0, 1000, 700, 48], [0, 2048, 0, 0, 0]])
def test_gpu_grouped_gemm_matches_reference(backend, sizes):
    """The GPU grouped GEMMs, bf16, with NaN garbage past the groups: forward and VJP."""
    if backend == "tokamax" and not tokamax_available():
        pytest.skip("tokamax is not installed")
    m = (sum(sizes) + 200 + 63) // 64 * 64  # tokamax's Mosaic kernel needs M in whole 64-row tiles
    lhs, rhs, gs, dout = _problem(m, 256, 384, sizes, "bfloat16", seed=5)
    if backend == "triton":  # on Hopper: the forward and the input gradient on TMA tiles
        _assert_hopper_defaults(m, 256, 384, 5)
    f = jax.jit(lambda a, b, d: jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend=backend), a, b)[1](d))
    out = jax.jit(lambda a, b: grouped_matmul(a, b, gs, backend=backend))(lhs, rhs)
    clean = jnp.nan_to_num(lhs)
    _close(out, grouped_matmul_reference(clean, rhs, gs), "bfloat16", f"{backend} forward")
    dlhs, drhs = f(lhs, rhs, jnp.asarray(dout, jnp.bfloat16))
    want_dlhs, want_drhs = _reference_grads(clean, rhs, gs, np.asarray(jnp.asarray(dout, jnp.bfloat16), np.float32))
    _close(dlhs, want_dlhs, "bfloat16", f"{backend} dlhs")
    _close(drhs, want_drhs, "bfloat16", f"{backend} drhs")


# -- the Triton grouped GEMM on each backend ------------------------------------------------
@triton.jit
def _schedule_probe_kernel(group_sizes_ptr, M, out_prealloc_ptr, out_ptr, G: tl.constexpr, G_P2: tl.constexpr,
                           NUM_N: tl.constexpr, BM: tl.constexpr, GROUP_M: tl.constexpr):
    """Writes tile ``t``'s ``(group or -1, first row, column tile)`` of the row-tile GEMMs'
    schedule (one program per tile, as the pointer kernel runs it)."""
    t = tl.program_id(0)
    g_idx, starts, ends, tiles, tile_ends, total, used = row_schedule(group_sizes_ptr, M, G, G_P2, BM)
    g, is_group_tile, row0, _, tile_n = schedule_tile(t, M, NUM_N, g_idx, starts, ends, tiles, tile_ends, total,
                                                      used, G, BM, GROUP_M)
    tl.store(out_ptr + t * 3, tl.where(is_group_tile, g, -1).to(tl.int32))
    tl.store(out_ptr + t * 3 + 1, row0.to(tl.int32))
    tl.store(out_ptr + t * 3 + 2, tile_n.to(tl.int32))


def _no_reference(*args, **kwargs):
    raise NotImplementedError("the schedule probe runs on the interpret backend only")


def _probe_programs(d, p):
    """As many programs as the pointer kernel's grid launches (one per column tile here)."""
    return D.mm_grid({"M": p["m"], "G": d["G"], "D": p["num_n"]}, {}, Config.make(BM=p["bm"], BN=1))[0]


_schedule_probe = declare(KernelDecl(
    name="test_grouped_gemm_schedule_probe",
    kernel=_schedule_probe_kernel,
    operands=(Operand("group_sizes", ("G",), ("int32",)),),
    outputs=(Output("tiles", lambda d, p: (_probe_programs(d, p), 3), lambda t, p: jnp.int32),),
    params=("m", "bm", "num_n", "group_m"),
    reference=_no_reference,
    grid=lambda d, p, c: (_probe_programs(d, p),),
    scalars=lambda d, p: {"M": p["m"]},
    constexprs=lambda d, p, c: {"G": d["G"], "G_P2": triton.next_power_of_2(d["G"]), "NUM_N": p["num_n"],
                                "BM": p["bm"], "GROUP_M": p["group_m"]},
    default_config=lambda d, p: Config.make(num_warps=1),
))


def test_row_tile_schedule_runs_group_by_group_and_covers_every_tile_once():
    """The row-tile GEMMs' schedule: every (row tile, column tile) of every group exactly
    once, each group's tiles consecutive (the tiles reading one block of a group's weights
    run together, so it comes from DRAM once), ``group_m`` of a group's row tiles at a time
    column by column, then tiles over the rows past the groups."""
    sizes, m, bm, num_n, group_m = [300, 0, 1000, 130, 48, 5, 0], 1600, 64, 3, 4
    tiles = np.asarray(_schedule_probe(jnp.asarray(sizes, jnp.int32), backend="interpret", m=m, bm=bm,
                                       num_n=num_n, group_m=group_m)[0])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    want = []  # group by group; bands of group_m row tiles; in a band, column by column
    for g, (start, size) in enumerate(zip(starts, sizes)):
        rows = list(range(start, start + size, bm))
        for band in range(0, len(rows), group_m):
            want += [(g, r, n) for n in range(num_n) for r in rows[band:band + group_m]]
    assert [tuple(t) for t in tiles[:len(want)]] == want
    used = sum(sizes)
    fills = {(int(r), int(n)) for g, r, n in tiles[len(want):] if r < m}
    assert (tiles[len(want):, 0] == -1).all()
    assert fills == {(r, n) for r in range(used, m, bm) for n in range(num_n)}


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
    out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend=backend), lhs, rhs)
    # TF32 tensor cores on GPU: the tolerance covers 10-bit mantissas over K <= 64 terms.
    tol = dict(rtol=2e-2, atol=5e-2)
    np.testing.assert_allclose(np.asarray(out), grouped_matmul_reference(lhs, rhs, sizes), **tol)
    dlhs, drhs = vjp(dout)
    ref_dlhs, ref_drhs = _reference_grads(lhs, rhs, sizes, dout)
    np.testing.assert_allclose(np.asarray(dlhs), ref_dlhs, **tol)
    np.testing.assert_allclose(np.asarray(drhs), ref_drhs, **tol)


def test_bf16_under_jit_with_traced_sizes(backend):
    rng = np.random.default_rng(7)
    lhs = jnp.asarray(rng.standard_normal((96, 64)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((4, 64, 128)) / 8, jnp.bfloat16)
    sizes = jnp.asarray([30, 0, 50, 10], jnp.int32)
    out = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, backend=backend))(lhs, rhs, sizes)
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
        key = cfg.constants
        if key in seen or D.grouped_gemm.decl.violated({"M": 150, "C": 64, "D": 128, "G": 3}, F32, cfg):
            continue  # warps/stages don't change the tiling or the path; pruned configs never run
        seen.add(key)
        (out,) = D.grouped_gemm(lhs, rhs, sizes, backend=kernel_backend, config=cfg, **F32)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-2, atol=5e-2, err_msg=str(cfg))


def test_every_weight_gradient_config_is_correct_on_the_kernel_backend(kernel_backend):
    # Programs walk the side with fewer tiles first: at K = 192, N = 384 the configs of the
    # space cover fewer K tiles (BK=128, BN=128), fewer N tiles (BK=64, BN=256) and as many
    # of each, so a block written twice or never under either order shows up here.
    rng = np.random.default_rng(5)
    lhs = rng.standard_normal((150, 192)).astype(np.float32)
    dout = rng.standard_normal((150, 384)).astype(np.float32)
    sizes = np.asarray([70, 0, 60], np.int32)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    ref = np.stack([lhs[a:b].T @ dout[a:b] for a, b in zip(starts[:-1], starts[1:])])
    dims = {"M": 150, "K": 192, "N": 384, "G": 3}
    seen = set()
    for cfg in D.grouped_gemm_wgrad.decl.configs:
        if cfg.constants in seen or D.grouped_gemm_wgrad.decl.violated(dims, {"elem_bytes": 4}, cfg):
            continue
        seen.add(cfg.constants)
        (out,) = D.grouped_gemm_wgrad(lhs, dout, sizes, backend=kernel_backend, config=cfg, elem_bytes=4)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-2, atol=5e-2, err_msg=str(cfg))
    assert {-(-192 // c["BK"]) < -(-384 // c["BN"]) for c in map(dict, seen)} == {True, False}


def test_shape_errors_name_the_argument(kernel_backend):
    with pytest.raises(ValueError, match=r"rhs has shape \(2, 8, 4\); expected \[G, 16, N\]"):
        grouped_matmul(jnp.zeros((4, 16)), jnp.zeros((2, 8, 4)), jnp.zeros((3,), jnp.int32), backend=kernel_backend)
    with pytest.raises(ValueError, match=r"group_sizes has shape \(3,\); expected \(2,\)"):
        grouped_matmul(jnp.zeros((4, 8)), jnp.zeros((2, 8, 4)), jnp.zeros((3,), jnp.int32), backend=kernel_backend)


def test_clamped_group_sizes():
    got = clamped_group_sizes(jnp.asarray([-3, 7, 2, 100], jnp.int32), 17)
    np.testing.assert_array_equal(np.asarray(got), [0, 7, 2, 8])


@pytest.mark.parametrize("groups", [1, 2, 3, 5, 17, 256, 40000])
@pytest.mark.parametrize("rows", [0, 1, 17, 65536, 2**31 - 1])
def test_clamped_group_sizes_match_a_saturating_int64_sum(groups, rows):
    """Every group count (powers of two and not) and row count up to int32's largest, with
    sums far past 2**31: each size clipped to [0, rows], their running sum capped at rows."""
    sizes = np.random.default_rng(groups * 31 + rows % 97).integers(-5, rows + 10, groups).clip(
        np.iinfo(np.int32).min, np.iinfo(np.int32).max).astype(np.int32)
    ends = np.minimum(np.cumsum(np.clip(sizes.astype(np.int64), 0, rows)), rows)
    want = np.diff(ends, prepend=0)
    np.testing.assert_array_equal(np.asarray(clamped_group_sizes(jnp.asarray(sizes), rows)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(clamped_group_sizes, static_argnums=1)(jnp.asarray(sizes), rows)), want)


@triton.jit
def _bounds_probe_kernel(group_sizes_ptr, M, out_prealloc_ptr, out_ptr, G: tl.constexpr, G_P2: tl.constexpr):
    """Writes each group's row count as the kernels bound it (``group_bounds``)."""
    g_idx, starts, ends = group_bounds(group_sizes_ptr, M, G, G_P2)
    tl.store(out_ptr + g_idx, (ends - starts).to(tl.int32), mask=g_idx < G)


_bounds_probe = declare(KernelDecl(
    name="test_grouped_gemm_bounds_probe",
    kernel=_bounds_probe_kernel,
    operands=(Operand("group_sizes", ("G",), ("int32",)),),
    outputs=(Output("sizes", lambda d, p: (d["G"],), lambda t, p: jnp.int32),),
    params=("m",),
    reference=lambda group_sizes, *, m: (clamped_group_sizes(group_sizes, m),),
    grid=lambda d, p, c: (1,),
    scalars=lambda d, p: {"M": p["m"]},
    constexprs=lambda d, p, c: {"G": d["G"], "G_P2": triton.next_power_of_2(d["G"])},
    default_config=lambda d, p: Config.make(num_warps=1),
))


@pytest.mark.parametrize("m,sizes", [(65536, [65536] * 32769), (2**20, [2**30, -5] + [2**20 - 3] * 2049 + [7])],
                         ids=["all_full", "mixed"])
def test_group_sizes_summing_past_int32_are_clamped_as_the_kernels_clamp_them(kernel_backend, m, sizes):
    """Clamped sizes summing past 2**31 (G * M does at 32769 groups of 65536 rows): the
    kernels sum them in int64 and clamp the ends to M, so the first groups take the rows
    and the rest are empty; the references, which every xla path bounds its groups by, give
    the same sizes rather than ends wrapped past int32 (which would give one late group
    2**31 - M rows and a negative total, every row then past the groups)."""
    gs = np.asarray(sizes, np.int32)
    ends = np.minimum(np.cumsum(np.clip(gs.astype(np.int64), 0, m)), m)
    want = np.diff(ends, prepend=0)
    for b in ("xla", kernel_backend):
        np.testing.assert_array_equal(np.asarray(_bounds_probe(gs, backend=b, m=m)[0]), want, err_msg=b)


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("m,c,d", [(60, 64, 512), (4096, 4096, 3072), (65536, 2048, 7168), (16, 7168, 128)])
def test_default_configs_meet_their_own_constraints(elem_bytes, m, c, d):
    # fp32 operands double a tile's shared-memory bytes: the default must still fit.
    mm = {"elem_bytes": elem_bytes, "out_dtype": "float32" if elem_bytes == 4 else "bfloat16"}
    for decl, dims, params in ((D.grouped_gemm.decl, {"M": m, "C": c, "D": d, "G": 8}, mm),
                               (D.grouped_gemm_rhs_t.decl, {"M": m, "C": d, "D": c, "G": 8}, mm),
                               (D.grouped_gemm_wgrad.decl, {"M": m, "K": c, "N": d, "G": 8},
                                {"elem_bytes": elem_bytes})):
        cfg = decl.default_config(dims, params)
        assert [why for check in decl.constraints if (why := check(dims, params, cfg))] == [], (decl.name, cfg)


# -- the persistent TMA configs ---------------------------------------------------------------
def _tma(programs: int, bm: int = 16, bn: int = 16, bk: int = 16) -> Config:
    """A TMA config with tiles small enough for the interpreter: several tiles per group, so
    that a tile of one group ending inside the next would overwrite rows already written."""
    return Config.make(num_warps=4, num_stages=2, BM=bm, BN=bn, BK=bk, GROUP_M=2, TMA=True, PROGRAMS=programs)


@contextlib.contextmanager
def _tma_for_row_tile_gemms(cfg: Config):
    """Every forward and input-gradient launch traced inside runs ``cfg`` (the weight
    gradient keeps its default). Matched by kernel: on Hopper they run the Hopper
    declarations of the same kernel; and the block must have lowered at least one."""
    used = []

    def resolve(call):
        if call.decl.kernel is D.grouped_gemm.decl.kernel:
            used.append(call.decl.name)
            return cfg
        return None

    with hooks.using_config_resolver(resolve):
        jax.clear_caches()  # the resolver runs at lowering time
        try:
            yield
        finally:
            jax.clear_caches()
    assert used, f"no forward or input-gradient launch was lowered with {cfg}"


@pytest.fixture
def descriptor_count(monkeypatch):
    """Counts what the interpreter does with tensor descriptors, by builder method:
    ``create_make_tensor_descriptor`` (3 per program on the TMA path) and
    ``create_descriptor_load`` (2 per K step of a group's tile)."""
    from triton.runtime.interpreter import InterpreterBuilder
    made = collections.Counter()
    for name in ("create_make_tensor_descriptor", "create_descriptor_load"):
        def counting(self, *args, _name=name, _orig=getattr(InterpreterBuilder, name), **kwargs):
            made[_name] += 1
            return _orig(self, *args, **kwargs)
        monkeypatch.setattr(InterpreterBuilder, name, counting)
    return made


def _group_blocks(m: int, sizes, rows: int) -> int:
    """Blocks of ``rows`` rows the groups' clamped rows split into, each group's separately:
    the TMA forward's row tiles inside the groups (the tiles past them load nothing), the
    TMA weight gradient's row slices per output block."""
    clamped = np.asarray(clamped_group_sizes(jnp.asarray(sizes, jnp.int32), m))
    return int(sum(-(-int(n) // rows) for n in clamped))


@pytest.mark.parametrize("programs", [1, 2, 5])
@pytest.mark.parametrize("m,k,n,sizes", CASES + [(52, 24, 40, [20, 12, 3, 17])])
def test_tma_configs_values_and_vjp_match_numpy(on_cpu, descriptor_count, m, k, n, sizes, programs):
    """The TMA path in Triton's interpreter, forward and VJP (its input gradient on the TMA
    path too), hostile group sizes included. The output buffers start poisoned, so a tile
    the schedule skips fails; with 2 and 5 programs a group's last, partial tile runs after
    the next group's first (another program), so a store that did not end at the group's
    last row would overwrite rows already written. One descriptor triple per program, built
    before its tile loop; each group tile's K steps load exactly once: the schedule has no
    group tile twice."""
    rng = np.random.default_rng(m * 7 + k)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    rhs = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    dout = rng.standard_normal((m, n)).astype(np.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    with _tma_for_row_tile_gemms(_tma(programs)):
        out, vjp = jax.vjp(lambda a, b: grouped_matmul(a, b, gs, backend="interpret"), lhs, rhs)
        dlhs, drhs = vjp(dout)
    tol = dict(rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out), grouped_matmul_reference(lhs, rhs, sizes), **tol)
    ref_dlhs, ref_drhs = _reference_grads(lhs, rhs, sizes, dout)
    np.testing.assert_allclose(np.asarray(dlhs), ref_dlhs, **tol)
    np.testing.assert_allclose(np.asarray(drhs), ref_drhs, **tol)
    # Forward and input gradient: 3 descriptors a program; per group tile and column tile,
    # an lhs and a weight load per K step (forward: n/16 column tiles, k/16 K steps; the
    # input gradient the other way round).
    assert descriptor_count["create_make_tensor_descriptor"] == 2 * 3 * programs
    loads = 2 * 2 * _group_blocks(m, sizes, 16) * -(-n // 16) * -(-k // 16)
    assert descriptor_count["create_descriptor_load"] == loads


def _tma_wgrad(programs: int, br: int = 8) -> Config:
    """A TMA weight-gradient config small enough for the interpreter: several blocks per
    group matrix and several row slices per group, most groups ending inside a slice."""
    return Config.make(num_warps=4, num_stages=2, BK=16, BN=16, BR=br, TMA=True, PROGRAMS=programs)


@pytest.mark.parametrize("programs", [1, 2, 5])
@pytest.mark.parametrize("m,k,n,sizes", CASES + [(52, 24, 40, [20, 12, 3, 17])])
def test_tma_wgrad_matches_numpy(on_cpu, descriptor_count, m, k, n, sizes, programs):
    """The weight gradient's TMA path in Triton's interpreter, hostile group sizes included,
    NaN in both operands' rows past the groups: every group's matrix (empty groups' zeros
    included) matches the reference, so a partial last slice reads no row past its group,
    and a block the schedule skipped would keep the output's poison. One descriptor triple
    per program; each block loads both operands once per row slice of its group."""
    rng = np.random.default_rng(m * 5 + n)
    lhs = rng.standard_normal((m, k)).astype(np.float32)
    dout = rng.standard_normal((m, n)).astype(np.float32)
    used = int(np.asarray(clamped_group_sizes(jnp.asarray(sizes, jnp.int32), m)).sum())
    lhs[used:], dout[used:] = np.nan, np.nan
    gs = jnp.asarray(sizes, jnp.int32)
    cfg = _tma_wgrad(programs)
    (got,) = D.grouped_gemm_wgrad(jnp.asarray(lhs), jnp.asarray(dout), gs, backend="interpret", config=cfg,
                                  elem_bytes=4)
    rhs = np.zeros((len(sizes), k, n), np.float32)
    want = _reference_grads(np.nan_to_num(lhs), rhs, sizes, np.nan_to_num(dout))[1]
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert descriptor_count["create_make_tensor_descriptor"] == 3 * programs
    blocks = -(-k // 16) * -(-n // 16)
    assert descriptor_count["create_descriptor_load"] == 2 * blocks * _group_blocks(m, sizes, 8)


def test_split_store_writes_whole_tiles_in_two_halves(on_cpu, monkeypatch):
    """Hopper's input-gradient default stores a whole 128x256 tile as two 128x128 halves:
    through the interpreter, on tiles wholly inside a group (stored by descriptor) and on a
    group's partial last tile (masked), the result equals the reference, the rows past the
    groups are zero, and every whole tile took two descriptor stores."""
    from triton.runtime.interpreter import InterpreterBuilder
    stores = collections.Counter()
    orig = InterpreterBuilder.create_descriptor_store

    def counting(self, *args, **kwargs):
        stores["n"] += 1
        return orig(self, *args, **kwargs)
    monkeypatch.setattr(InterpreterBuilder, "create_descriptor_store", counting)
    rng = np.random.default_rng(5)
    m, c, d, sizes = 420, 64, 256, [300, 0, 100]    # whole tiles: rows 0-255 of group 0
    dout = jnp.asarray(rng.standard_normal((m, c)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, d, c)) / 8, jnp.bfloat16)
    cfg = Config.make(8, 4, **{**D.HOPPER_TMA_SPLIT.kw, "PROGRAMS": 4})
    assert cfg.kw["SPLIT_STORE"] and D.grouped_gemm_rhs_t.decl.violated({"M": m, "C": c, "D": d, "G": 3},
                                                                        BF16, cfg) is None
    (got,) = D.grouped_gemm_rhs_t(dout, rhs, jnp.asarray(sizes, jnp.int32), backend="interpret", config=cfg,
                                  **BF16)
    got = np.asarray(got, np.float32)
    want = grouped_matmul_reference(np.asarray(dout, np.float32),
                                    np.swapaxes(np.asarray(rhs, np.float32), 1, 2), sizes)
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=5e-2)
    assert not got[400:].any()
    assert stores["n"] == 2 * 2    # group 0's two whole 128-row tiles, one column tile each


def test_tma_configs_of_the_space_in_bf16_under_jit(on_cpu, descriptor_count):
    """Every TMA config of the tuning space, as the tuner would run it (132 programs, full
    tiles), bf16 with traced sizes: the rows past the groups come out zero, not poison."""
    rng = np.random.default_rng(11)
    lhs = jnp.asarray(rng.standard_normal((200, 64)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((3, 64, 256)) / 8, jnp.bfloat16)
    sizes = [90, 0, 70]
    ref = grouped_matmul_reference(np.asarray(lhs, np.float32), np.asarray(rhs, np.float32), sizes)
    dims, params = {"M": 200, "C": 64, "D": 256, "G": 3}, BF16
    ran = set()
    for cfg in D.TMA_CONFIGS:
        if cfg.constants in ran or D.grouped_gemm.decl.violated(dims, params, cfg):
            continue
        ran.add(cfg.constants)
        f = jax.jit(lambda a, b, s, cfg=cfg: D.grouped_gemm(a, b, s, backend="interpret", config=cfg,
                                                            **BF16)[0])
        out = np.asarray(f(lhs, rhs, jnp.asarray(sizes, jnp.int32)), np.float32)
        np.testing.assert_allclose(out, ref, rtol=2e-2, atol=5e-2, err_msg=str(cfg))
        assert not out[160:].any(), cfg
    assert len(ran) == 5 and descriptor_count  # BM x BN, and 128 x 256 stored in halves, each on the TMA path


def test_tma_configs_are_pruned_where_descriptors_cannot_run():
    """Rows that are not 16-byte multiples (an odd bf16 width), or a TMA config without
    programs, are pruned before they compile; the pointer configs run there."""
    decl, cfg = D.grouped_gemm.decl, D.TMA_CONFIGS[0]
    assert decl.violated({"M": 64, "C": 64, "D": 128, "G": 2}, BF16, cfg) is None
    assert "C=36" in decl.violated({"M": 64, "C": 36, "D": 128, "G": 2}, BF16, cfg)
    assert "D=20" in D.grouped_gemm_rhs_t.decl.violated({"M": 64, "C": 64, "D": 20, "G": 2}, BF16, cfg)
    no_programs = Config.make(num_warps=4, num_stages=2, BM=64, BN=128, BK=64, GROUP_M=8, TMA=True, PROGRAMS=0)
    assert "PROGRAMS" in decl.violated({"M": 64, "C": 64, "D": 128, "G": 2}, BF16, no_programs)
    # fp32 128x256 tiles: 4 stages plus the output tile overflow shared memory.
    big = Config.make(num_warps=8, num_stages=4, BM=128, BN=256, BK=64, GROUP_M=8, TMA=True, PROGRAMS=132)
    assert "shared memory" in (decl.violated({"M": 64, "C": 64, "D": 256, "G": 2}, F32, big) or "")
    for default in (decl.default_config({"M": 4096, "C": 4096, "D": 4096, "G": 8}, BF16),
                    D.grouped_gemm_rhs_t.decl.default_config({"M": 4096, "C": 4096, "D": 4096, "G": 8}, BF16)):
        assert "TMA" not in default.kw  # the default stays the pointer path until measured


def _sm90_compiled(decl, dims, dtype, cfg, out_dtype=None):
    """``decl``'s kernel at ``cfg``, compiled here for sm_90 as the ``triton`` backend would,
    its result stored in ``out_dtype`` (default: ``dtype``)."""
    from te_jax_perm.core import bind_call
    shapes = {"lhs": ("M", "C"), "rhs": tuple(op.dims for op in decl.operands if op.name == "rhs")[0],
              "group_sizes": ("G",)}
    avals = [jax.ShapeDtypeStruct(tuple(dims[d] for d in shapes[op.name]), "int32" if op.name == "group_sizes"
                                  else dtype) for op in decl.operands]
    params = {"elem_bytes": np.dtype(dtype).itemsize, "out_dtype": np.dtype(out_dtype or dtype).name}
    return compiled_for_sm90(bind_call(decl, avals, params, "triton"), cfg)


# -- the warp-specialised weight gradient (Hopper; kernels/grouped_gemm_ws.py) ---------------
def test_ws_wgrad_configs_compile_for_sm90_to_warp_partitions():
    """At DeepSeek-V3's up-projection every config compiles for sm_90: 12 warps (8 MMA
    warps and a loader warpgroup), asynchronous warpgroup MMAs, TMA loads and a TMA store of
    descriptors built in the call's workspace, within Hopper's shared memory."""
    from te_jax_perm.core.launch import bind_call
    avals = [jax.ShapeDtypeStruct((65536, 7168), jnp.bfloat16), jax.ShapeDtypeStruct((65536, 4096), jnp.bfloat16),
             jax.ShapeDtypeStruct((256,), jnp.int32)]
    call = bind_call(D.grouped_gemm_wgrad_ws.decl, avals, {"elem_bytes": 2}, "triton")
    for cfg in D.WS_WGRAD_CONFIGS:
        assert D.grouped_gemm_wgrad_ws.decl.violated(call.dims, call.params, cfg) is None, cfg
        k = compiled_for_sm90(call, cfg)
        assert k.num_warps == 12 and k.global_scratch_size >= 3 * 128, (cfg, k.num_warps, k.global_scratch_size)
        assert "wgmma.mma_async" in k.ptx and "mbarrier.try_wait" in k.ptx, cfg
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", k.ptx), cfg
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", k.ptx), cfg
        assert k.shared_mem_bytes <= 227 * 1024, (cfg, k.shared_mem_bytes)


def test_ws_wgrad_constraints_and_selection(monkeypatch):
    """The warp-specialised weight gradient refuses, by reason, what its kernel does not
    handle, and is picked only on the triton backend of a compute capability 9.0 GPU."""
    from te_jax_perm.core import triton_backend
    decl, cfg, dims = D.grouped_gemm_wgrad_ws.decl, D.WS_WGRAD_CONFIGS[0], {"M": 4096, "K": 1024, "N": 768, "G": 8}
    assert decl.violated(dims, {"elem_bytes": 2}, cfg) is None
    assert "16-bit" in decl.violated(dims, {"elem_bytes": 4}, cfg)
    assert "multiple of BK" in decl.violated({**dims, "K": 1000}, {"elem_bytes": 2}, cfg)
    assert "16-byte rows" in decl.violated({**dims, "N": 770 - 1}, {"elem_bytes": 2}, cfg)
    assert "1 <= M, G" in decl.violated({**dims, "M": 0}, {"elem_bytes": 2}, cfg)
    assert "2**31" in decl.violated({**dims, "G": 2**21, "K": 1024}, {"elem_bytes": 2}, cfg)
    assert "8 warps" in decl.violated(dims, {"elem_bytes": 2}, Config.make(4, 1, **cfg.kw))
    assert "shared memory" in decl.violated(dims, {"elem_bytes": 2}, Config.make(8, 1, **{**cfg.kw, "STAGES": 4}))
    for cc, backend, want in [(90, "triton", D.grouped_gemm_wgrad_ws), (100, "triton", D.grouped_gemm_wgrad),
                              (80, "triton", D.grouped_gemm_wgrad), (90, "interpret", D.grouped_gemm_wgrad)]:
        monkeypatch.setattr(triton_backend, "compute_capability", lambda: cc)
        assert D.wgrad_for(backend, dims, {"elem_bytes": 2}) is want, (cc, backend)
    monkeypatch.setattr(triton_backend, "compute_capability", lambda: 90)
    assert D.wgrad_for("triton", dims, {"elem_bytes": 4}) is D.grouped_gemm_wgrad  # fp32: the pointer kernel


def test_hopper_row_tile_default_and_selection(monkeypatch):
    """On Hopper the forward and input gradient default to TMA 128x256 tiles where the
    portable default takes 128x256 tiles and descriptors fit, else to the portable default;
    the input gradient's, and the forward's at a few hundred rows a group, stored in halves;
    their Hopper declarations are picked only on the triton backend of a 9.0 GPU."""
    from te_jax_perm.core import triton_backend
    big, bf16 = {"M": 8192, "C": 4096, "D": 2048, "G": 8}, BF16   # 1024 rows a group
    assert D.hopper_mm_default(big, bf16) == D.HOPPER_TMA_MM and D.HOPPER_TMA_MM in D.TMA_CONFIGS
    assert D.grouped_gemm_hopper.decl.default_config(big, bf16) == D.HOPPER_TMA_MM
    # The input gradient: the same tiles stored in halves, with a fourth stage.
    assert D.grouped_gemm_rhs_t_hopper.decl.default_config(big, bf16) == D.HOPPER_TMA_SPLIT
    # The forward at 512 rows a group or fewer (one row over: whole tiles again), as the
    # weight gradient's defaults switch at the same size.
    short = {**big, "G": 16}
    assert D.short_groups(short) and not D.short_groups({**short, "M": 8193})
    assert D.grouped_gemm_hopper.decl.default_config(short, bf16) == D.HOPPER_TMA_SPLIT
    assert D.hopper_mm_default({**short, "M": 8193}, bf16) == D.HOPPER_TMA_MM
    wgrad_short, wgrad_big = ({"M": 8192, "K": 4096, "N": 2048, "G": g} for g in (16, 8))
    assert D.wgrad_default(wgrad_short, bf16) != D.wgrad_default(wgrad_big, bf16)
    assert D.ws_wgrad_default(wgrad_short, bf16) != D.ws_wgrad_default(wgrad_big, bf16)
    assert D.HOPPER_TMA_SPLIT in D.TMA_CONFIGS and D.HOPPER_TMA_SPLIT.kw["SPLIT_STORE"]
    assert D.grouped_gemm_rhs_t.decl.violated(big, bf16, D.HOPPER_TMA_SPLIT) is None
    assert D.grouped_gemm_rhs_t.decl.violated(big, bf16, Config.make(8, 4, **D.HOPPER_TMA_MM.kw))  # no room unsplit
    for dims, params in [(big, F32),                            # fp32 stages exceed shared memory
                         ({**big, "M": 2048}, bf16),              # 64-row tiles
                         ({**big, "D": 192}, bf16),               # 128-column tiles
                         ({**big, "C": 4100}, bf16)]:             # rows of no 16-byte multiple
        assert D.hopper_mm_default(dims, params) == D.mm_default(dims, params), (dims, params)
        assert not D.hopper_mm_default(dims, params).kw.get("TMA", False)
        assert D.hopper_dgrad_default(dims, params) == D.mm_default(dims, params), (dims, params)
        assert D.hopper_mm_default({**dims, "G": 64}, params) == D.mm_default(dims, params), (dims, params)
    for name in ("grouped_gemm", "grouped_gemm_rhs_t"):  # the same kernel and tuning space
        base, hopper = getattr(D, name).decl, getattr(D, name + "_hopper").decl
        assert (hopper.kernel, hopper.configs, hopper.operands) == (base.kernel, base.configs, base.operands)
    for cc, backend, hop in [(90, "triton", True), (100, "triton", False), (80, "triton", False),
                             (90, "interpret", False), (90, "xla", False)]:
        monkeypatch.setattr(triton_backend, "compute_capability", lambda: cc)
        want = (D.grouped_gemm_hopper, D.grouped_gemm_rhs_t_hopper) if hop else (D.grouped_gemm, D.grouped_gemm_rhs_t)
        got = tuple(D.mm_for(backend, t) for t in (False, True))
        assert got == want, (cc, backend)


def test_ws_wgrad_is_refused_by_the_interpreter_by_name():
    lhs, dout, sizes = jnp.ones((64, 128), jnp.bfloat16), jnp.ones((64, 256), jnp.bfloat16), jnp.asarray([64])
    with pytest.raises(Exception, match="grouped_gemm_wgrad_ws: backend 'interpret' cannot run this kernel"):
        D.grouped_gemm_wgrad_ws(lhs, dout, sizes, backend="interpret", elem_bytes=2)
    # ... and its xla backend is the weight gradient's reference
    out = D.grouped_gemm_wgrad_ws(lhs, dout, sizes, backend="xla", elem_bytes=2)[0]
    np.testing.assert_allclose(np.asarray(out, np.float32), np.full((1, 128, 256), 64.0))


@pytest.mark.gpu
def test_gpu_default_row_tile_gemms_on_hostile_sizes():
    """The forward and input gradient as ``grouped_matmul`` runs them on this GPU, on their
    default config (on Hopper, 128x256 TMA tiles in 132 persistent programs), at the sizes
    the warp-specialised weight-gradient test takes: NaN garbage past the groups, empty
    groups, partial last tiles, sizes negative or near 2**31; forward and VJP (in the
    hostile memcheck list)."""
    m, k, n = WS_DIMS
    _assert_hopper_defaults(m, k, n, 5)
    f = jax.jit(lambda a, b, s, d: jax.vjp(lambda a, b: grouped_matmul(a, b, s, backend="triton"), a, b)[1](d))
    for sizes in WS_SIZES:
        (lhs, rhs, gs, dout), (want, want_dlhs, want_drhs) = _hostile_problem(sizes, seed=9)
        out = jax.jit(lambda a, b, s: grouped_matmul(a, b, s, backend="triton"))(lhs, rhs, gs)
        _close(out, want, "bfloat16", f"forward {sizes}")
        dlhs, drhs = f(lhs, rhs, gs, dout)
        _close(dlhs, want_dlhs, "bfloat16", f"input gradient {sizes}")
        _close(drhs, want_drhs, "bfloat16", f"weight gradient {sizes}")


def _assert_hopper_defaults(m: int, k: int, n: int, g: int) -> None:
    """Asserts what ``grouped_matmul`` runs at ``[m, k] x [g, k, n]`` on this GPU: on Hopper,
    where these sizes make it so, the forward on TMA 128x256 tiles (stored in halves at a
    few hundred rows a group) and the input gradient on the same tiles stored in halves;
    elsewhere the portable kernels on their defaults."""
    from te_jax_perm.core import triton_backend
    hopper, bf16 = triton_backend.compute_capability() == 90, BF16
    fwd_dims, dgrad_dims = {"M": m, "C": k, "D": n, "G": g}, {"M": m, "C": n, "D": k, "G": g}
    fwd, dgrad = D.mm_for("triton", False), D.mm_for("triton", True)
    assert fwd is (D.grouped_gemm_hopper if hopper else D.grouped_gemm), fwd.decl.name
    want_fwd = D.HOPPER_TMA_SPLIT if D.short_groups(fwd_dims) else D.HOPPER_TMA_MM
    assert (fwd.decl.default_config(fwd_dims, bf16) == want_fwd) == hopper, fwd.decl.name
    assert (dgrad.decl.default_config(dgrad_dims, bf16) == D.HOPPER_TMA_SPLIT) == hopper, dgrad.decl.name


def _skip_unless_hopper():
    from te_jax_perm.core import triton_backend
    if triton_backend.compute_capability() != 90:
        pytest.skip("the warp-specialised weight gradient is for compute capability 9.0")


WS_SIZES = [[300, 0, 1000, 700, 48], [0, 2048, 0, 0, 0], [-5, 2**31 - 1, 2**31 - 1, 7, 9], [63, 1, 65, 0, 0],
            [0, 0, 0, 0, 0]]
WS_DIMS = (2304, 512, 384)  # M, K, N: D past a 256-column tile's edge in the forward


def _hostile_problem(sizes, seed):
    """bf16 ``(lhs, rhs, group_sizes, dout)`` at :data:`WS_DIMS` with NaN garbage past the
    groups, and the float64 references ``(out, dlhs, drhs)`` (garbage rows read as zeros)."""
    lhs, rhs, gs, dout = _problem(*WS_DIMS, sizes, "bfloat16", seed=seed)
    dout = jnp.asarray(dout, jnp.bfloat16)
    clean, rhs32 = np.nan_to_num(np.asarray(lhs, np.float32)), np.asarray(rhs, np.float32)
    want_dlhs, want_drhs = _reference_grads(clean, rhs32, np.asarray(sizes), np.asarray(dout, np.float32))
    return (lhs, rhs, gs, dout), (grouped_matmul_reference(clean, rhs32, sizes), want_dlhs, want_drhs)


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [132, 5])
def test_gpu_ws_wgrad_matches_reference(programs):
    """Every warp-specialised config on this GPU (Hopper only), bf16 with NaN garbage in the
    rows past the groups, empty and partial-slice groups, hostile sizes, N past a block's
    edge, and a program count that leaves programs many blocks each. (One process per
    program count: the GPU suite runs it under memcheck.)"""
    _skip_unless_hopper()
    m, k, n = 2304, 512, 384
    for sizes in WS_SIZES:
        lhs, _, gs, dout = _problem(m, k, n, sizes, "bfloat16", seed=7)
        dout = jnp.asarray(dout, jnp.bfloat16)
        clean = np.nan_to_num(np.asarray(lhs, np.float32))
        _, want = _reference_grads(clean, np.zeros((len(sizes), k, n)), np.asarray(sizes),
                                   np.asarray(dout, np.float32))
        for cfg in D.WS_WGRAD_CONFIGS:
            cfg = Config.make(cfg.num_warps, cfg.num_stages, **{**cfg.kw, "PROGRAMS": programs})
            got = jax.jit(lambda a, d, s: D.grouped_gemm_wgrad_ws(a, d, s, backend="triton", config=cfg,
                                                                  elem_bytes=2)[0])(lhs, dout, gs)
            assert np.isfinite(np.asarray(got, np.float32)).all(), (sizes, cfg)
            _close(got, want, "bfloat16", f"{sizes} {cfg}")


@pytest.mark.parametrize("dtype,out_dtype", [("bfloat16", "bfloat16"), ("float32", "float32"),
                                             ("bfloat16", "float32")])
@pytest.mark.parametrize("decl", [D.grouped_gemm.decl, D.grouped_gemm_rhs_t.decl], ids=lambda d: d.name)
def test_tma_configs_compile_to_tma_for_sm90(decl, dtype, out_dtype):
    """At DeepSeek-V3's up-projection, the TMA configs that ``tma_fits`` admits compile for
    sm_90 to tensor-map loads and stores from descriptors built on the device (which need
    global scratch), within Hopper's 227 KiB of shared memory, also where a float32 result
    of bf16 operands doubles the output tile; the default config has none of it."""
    dims = {"M": 65536, "C": 7168, "D": 4096, "G": 256}
    params = {"elem_bytes": np.dtype(dtype).itemsize, "out_dtype": out_dtype}
    admitted = [c for c in D.TMA_CONFIGS if not decl.violated(dims, params, c)]
    assert admitted
    for cfg in [c for c in admitted if c.num_warps == 8]:  # warps do not change shared memory
        k = _sm90_compiled(decl, dims, dtype, cfg, out_dtype)
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global", k.ptx), cfg  # lhs
        assert re.search(r"cp\.async\.bulk\.tensor\.3d\.shared::\w+\.global", k.ptx), cfg  # weights
        assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", k.ptx), cfg  # whole tiles' store
        assert "tensormap.replace" in k.ptx and k.global_scratch_size > 0, cfg
        assert "wgmma.mma_async" in k.ptx, cfg
        assert k.shared_mem_bytes <= 227 * 1024, (cfg, k.shared_mem_bytes)
    default = _sm90_compiled(decl, dims, dtype, decl.default_config(dims, params), out_dtype)
    assert "cp.async.bulk.tensor" not in default.ptx and default.global_scratch_size == 0


def test_benchmark_tma_comparison_runs_and_checks_each_config(on_cpu):
    """benchmarks/grouped_gemm_bench.py's TMA comparison, on the interpreter: every config
    timed beside the default for the forward and the input gradient, its output checked
    against the default's; and its short list is admitted at every benchmark shape."""
    from benchmarks.gemm_problems import SHAPES
    from benchmarks.grouped_gemm_bench import tma_comparison, tma_configs
    for s in SHAPES:
        for decl, dims in ((D.grouped_gemm.decl, {"M": s.M, "C": s.K, "D": s.N, "G": s.G}),
                           (D.grouped_gemm_rhs_t.decl, {"M": s.M, "C": s.N, "D": s.K, "G": s.G})):
            assert not [c for c in tma_configs() if decl.violated(dims, BF16, c)], (decl.name, dims)
    assert len(tma_configs(True, [100, 132])) == 2 * len(D.TMA_CONFIGS)
    rng = np.random.default_rng(5)
    lhs = jnp.asarray(rng.standard_normal((40, 32)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((2, 32, 48)) / 6, jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((40, 48)), jnp.bfloat16)
    r = tma_comparison(lhs, rhs, dout, jnp.asarray([25, 9], jnp.int32), [_tma(2), _tma(3, bn=32)],
                       backend="interpret", reps=1)
    for what in ("fwd", "dgrad"):
        assert r[f"{what}_default_ms"] > 0 and len(r[f"tma_{what}_ms"]) == 2, r
        assert all(isinstance(t, float) for t in r[f"tma_{what}_ms"].values()), r
        assert r[f"best_tma_{what}_over_default"] > 0
    assert len(r["tma_max_abs_diff"]) == 4 and max(r["tma_max_abs_diff"].values()) < 0.1, r
    assert not [k for k in r if k.endswith("_over_pointer_default")], r  # the portable default ran


def test_benchmark_times_a_device_default_against_the_portable_one(on_cpu, monkeypatch):
    """Where the device's default config is not the portable default (as Hopper's is not),
    the TMA comparison also times the portable one and writes the ratio; here the portable
    default is made a TMA config so that the two differ on the CPU."""
    from benchmarks import grouped_gemm_bench as B
    monkeypatch.setattr(D, "mm_default", lambda dims, params: _tma(2))
    rng = np.random.default_rng(6)
    lhs = jnp.asarray(rng.standard_normal((40, 32)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((2, 32, 48)) / 6, jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((40, 48)), jnp.bfloat16)
    r = B.tma_comparison(lhs, rhs, dout, jnp.asarray([25, 9], jnp.int32), [], backend="interpret", reps=1)
    assert "TMA=True" not in r["default_config"]["fwd"], r
    assert r["fwd_default_over_pointer_default"] > 0 and r["dgrad_default_over_pointer_default"] > 0, r


def test_benchmark_wgrad_comparison_runs_and_checks_each_config(on_cpu):
    """benchmarks/grouped_gemm_bench.py's weight-gradient comparison, on the interpreter: a
    pointer and a TMA config timed beside the default, each output checked against the
    default's; a config the shape does not admit is skipped, not timed."""
    from benchmarks.grouped_gemm_bench import wgrad_comparison
    rng = np.random.default_rng(8)
    lhs = jnp.asarray(rng.standard_normal((40, 32)), jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((40, 48)), jnp.bfloat16)
    pointer = Config.make(num_warps=4, num_stages=2, BK=16, BN=16, BR=16)
    odd = Config.make(num_warps=4, num_stages=2, BK=12, BN=16, BR=8, TMA=True, PROGRAMS=2)  # 24-byte blocks
    r = wgrad_comparison(lhs, dout, jnp.asarray([25, 9], jnp.int32), [pointer, _tma_wgrad(3), odd],
                         backend="interpret", reps=1)
    assert r["wgrad_default_ms"] > 0 and set(r["wgrad_ms"]) == {str(pointer), str(_tma_wgrad(3))}, r
    assert all(isinstance(t, float) for t in r["wgrad_ms"].values()), r
    assert max(r["wgrad_max_abs_diff"].values()) < 0.1 and r["best_wgrad_over_default"] > 0, r


def _device_only(field: str) -> bool:
    """A grouped_gemm_bench field a CPU run cannot write: tokamax's (not installed here), or
    one a Hopper GPU adds (its own default's against the portable one)."""
    return field.startswith("tokamax") or field.endswith("_over_pointer_default")


def test_benchmark_row_writes_every_field_of_the_committed_results(on_cpu):
    """benchmarks/grouped_gemm_bench.py's row of one shape, on the interpreter at a CPU
    shape: every field the committed GPU results hold (bar those only a GPU writes), the
    forward checked against the reference, a sweep config and a TMA config timed."""
    from benchmarks.gemm_problems import CPU_SHAPES
    from benchmarks.grouped_gemm_bench import shape_row
    sweep = Config.make(num_warps=4, num_stages=2, BM=16, BN=16, BK=16, GROUP_M=2)
    r = shape_row(CPU_SHAPES[0], backend="interpret", reps=1, sweep=[sweep], tma=[_tma(2)])
    committed = set()
    for device in ("H100", "H200"):
        path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results",
                            f"grouped_gemm_{device}.json")
        with open(path) as f:
            committed.update(k for row in json.load(f)["shapes"].values() for k in row if not _device_only(k))
    assert committed <= set(r), committed - set(r)
    assert r["check_max_abs_err"] < 0.1 and max(r["tma_max_abs_diff"].values()) < 0.1, r
    assert isinstance(r["sweep_fwd_ms"][str(sweep)], float) and len(r["tma_fwd_ms"]) == 1, r
    assert r["ours_fwd_over_dense"] == r["ours_fwd_ms"] / r["dense_ms"]
    # Each GEMM of the step held to the batched dot of the same problem: equal results.
    assert set(r["batched_max_abs_diff"]) == {"fwd", "dgrad", "wgrad"}, r
    assert max(r["batched_max_abs_diff"].values()) < 0.1, r
    assert r["wgrad_over_batched"] == r["ours_uniform_wgrad_ms"] / r["batched_wgrad_ms"]


def test_batched_comparison_needs_groups_of_one_size(on_cpu):
    """No uniform sizes exist where the groups do not divide the rows: no comparison."""
    from benchmarks.grouped_gemm_bench import batched_comparison
    lhs, rhs, _, dout = _problem(10, 16, 8, [3, 3, 4], "bfloat16", seed=1)
    assert batched_comparison(jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16),
                              jnp.asarray(dout, jnp.bfloat16), backend="interpret", reps=1) == {}


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [132, 3])
@pytest.mark.parametrize("sizes", [[300, 0, 1000, 700, 48], [0, 2048, 0, 0, 0], [-5, 2**31 - 1, 2**31 - 1, 7, 9]])
def test_gpu_tma_wgrad_matches_reference(sizes, programs):
    """The weight gradient's TMA configs compiled for this GPU, bf16, NaN in both operands'
    rows past the groups and hostile sizes: each config the shape admits matches the
    reference (a group's partial last row slice reads nothing past its group)."""
    m, k, n = 2304, 256, 384
    lhs, _, gs, dout = _problem(m, k, n, sizes, "bfloat16", seed=7)
    used = int(np.asarray(clamped_group_sizes(gs, m)).sum())
    dout[used:] = np.nan
    dout = jnp.asarray(dout, jnp.bfloat16)
    clean = lambda a: np.nan_to_num(np.asarray(a, np.float32))
    want = _reference_grads(clean(lhs), np.zeros((len(sizes), k, n), np.float32), gs, clean(dout))[1]
    dims, params = {"M": m, "K": k, "N": n, "G": len(sizes)}, {"elem_bytes": 2}
    ran = 0
    for cfg in D.WGRAD_TMA_CONFIGS:
        if cfg.num_warps != 8 or D.grouped_gemm_wgrad.decl.violated(dims, params, cfg):
            continue
        cfg = Config.make(cfg.num_warps, cfg.num_stages, **{**cfg.kw, "PROGRAMS": programs})
        got = jax.jit(lambda a, d, s, cfg=cfg: D.grouped_gemm_wgrad(a, d, s, backend="triton", config=cfg,
                                                                    elem_bytes=2)[0])(lhs, dout, gs)
        _close(got, want, "bfloat16", str(cfg))
        ran += 1
    assert ran >= 8


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [132, 3])
@pytest.mark.parametrize("sizes", [[300, 0, 1000, 700, 48], [0, 2048, 0, 0, 0], [-5, 2**31 - 1, 2**31 - 1, 7, 9]])
def test_gpu_tma_configs_match_reference(sizes, programs):
    """The TMA configs compiled for this GPU (descriptors built on the device, in the global
    scratch, the workspace the call brings), bf16 with NaN garbage past the groups and
    hostile sizes: forward and VJP, the input gradient on its TMA config too."""
    m = 2304
    lhs, rhs, gs, dout = _problem(m, 256, 384, sizes, "bfloat16", seed=6)
    dims = {"M": m, "C": 256, "D": 384, "G": len(sizes)}
    cfg = next(c for c in D.TMA_CONFIGS if not D.grouped_gemm.decl.violated(dims, BF16, c)
               and not D.grouped_gemm_rhs_t.decl.violated({**dims, "C": 384, "D": 256}, BF16, c))
    cfg = Config.make(cfg.num_warps, cfg.num_stages, **{**cfg.kw, "PROGRAMS": programs})
    clean = jnp.nan_to_num(lhs)
    with _tma_for_row_tile_gemms(cfg):
        mm = lambda a, b: grouped_matmul(a, b, gs, backend="triton")  # noqa: E731
        out = jax.jit(mm)(lhs, rhs)
        dlhs, drhs = jax.jit(lambda a, b, d: jax.vjp(mm, a, b)[1](d))(lhs, rhs, jnp.asarray(dout, jnp.bfloat16))
    _close(out, grouped_matmul_reference(clean, rhs, gs), "bfloat16", f"{cfg} forward")
    want_dlhs, want_drhs = _reference_grads(clean, rhs, gs, np.asarray(jnp.asarray(dout, jnp.bfloat16), np.float32))
    _close(dlhs, want_dlhs, "bfloat16", f"{cfg} dlhs")
    _close(drhs, want_drhs, "bfloat16", f"{cfg} drhs")


@pytest.mark.parametrize("m, g, tile", [(16384, 8, 128), (32768, 32, 128), (100, 3, 16), (7, 4, 16)])
def test_layouts_hold_every_row_and_count_the_tiles_of_the_schedule(m, g, tile):
    """benchmarks/grouped_gemm_bench.py's group layouts: each sums to the rows; the aligned
    groups' boundaries fall on whole tiles; the row tiles counted are the schedule's (a
    partial tile per group whose size is no multiple of the tile, none for empty groups)."""
    from benchmarks.grouped_gemm_bench import LAYOUTS, layout_sizes, row_tiles
    for layout in LAYOUTS:
        sizes = layout_sizes(layout, m, g, tile)
        assert sizes.shape == (g,) and sizes.sum() == m and (sizes >= 0).all(), (layout, sizes)
        assert row_tiles(sizes, m, tile) == sum(int(np.ceil(s / tile)) for s in sizes), (layout, sizes)
    assert (np.cumsum(layout_sizes("aligned", m, g, tile))[:-1] % tile == 0).all()
    assert list(layout_sizes("one_group", m, g, tile)) == [m] + [0] * (g - 1)
    # Rows past every group take tiles of their own.
    assert row_tiles(np.array([tile + 1, 0]), 3 * tile, tile) == 2 + 2
    with pytest.raises(ValueError, match="layout 'sorted'"):
        layout_sizes("sorted", m, g, tile)


def test_layout_comparison_times_each_layout_and_the_dense_dot_in_turns(on_cpu, monkeypatch):
    """The layout comparison on the interpreter at a CPU shape: each layout's call runs the
    forward over that layout's group sizes; every layout and the dense dot are profiled
    once a round, the order rotated by one each round; the ratio to the dense dot is taken
    from each one's fastest round; the tiles of the default config's schedule beside them."""
    from benchmarks import grouped_gemm_bench as B, trace_stats
    from benchmarks.gemm_problems import CPU_SHAPES, dense_dot, operands
    from te_jax_perm.ops.grouped_gemm.reference import grouped_gemm_reference
    shape = CPU_SHAPES[0]
    ops = operands(shape, "bfloat16")
    bm = D.mm_for("interpret", False).decl.default_config(
        {"M": shape.M, "C": shape.K, "D": shape.N, "G": shape.G}, BF16).kw["BM"]
    # The dense dot on group 1's weights: its result differs from the one-group layout's.
    dense_rhs = ops.rhs[1]
    want = {"dense": np.asarray(dense_dot(ops.lhs, dense_rhs), np.float32)}
    for layout in B.LAYOUTS:
        sizes = jnp.asarray(B.layout_sizes(layout, shape.M, shape.G, bm))
        want[layout] = np.asarray(grouped_gemm_reference(ops.lhs, ops.rhs, sizes), np.float32)
    fake_us = {"dense": 10.0, "routing": 20.0, "aligned": 12.5, "one_group": 12.5}
    order = []

    def profile(fn, steps):
        got = np.asarray(fn(), np.float32)
        name = min(want, key=lambda n: float(np.abs(want[n] - got).max()))
        assert np.abs(want[name] - got).max() < 0.1, name
        order.append(name)
        return trace_stats.TraceStats(steps=steps, kernel_ns={"k": fake_us[name] * 1e3 * steps},
                                      kernel_count={"k": steps}, graph_launches=0, kernel_launches=steps,
                                      api_events_seen=True)
    monkeypatch.setattr(trace_stats, "profile", profile)
    r = B.layout_comparison(ops.lhs, ops.rhs, dense_rhs, backend="interpret", rounds=2, steps=1)
    assert order == ["dense", "routing", "aligned", "one_group", "routing", "aligned", "one_group", "dense"], order
    for layout in B.LAYOUTS:
        assert r[layout]["kernel_us"] == [fake_us[layout]] * 2
        assert r[layout]["dense_over"] == 10.0 / fake_us[layout]
        assert r[layout]["row_tiles"] == B.row_tiles(B.layout_sizes(layout, shape.M, shape.G, bm), shape.M, bm)
    assert r["dense"]["kernel_us"] == [10.0, 10.0] and r["kernel"] == "grouped_gemm"
    assert r["one_group"]["row_tiles"] <= r["aligned"]["row_tiles"] <= r["routing"]["row_tiles"]
