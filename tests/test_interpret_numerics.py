"""Conversions in kernels round as on the GPU, on every kernel backend of this machine.

One small conversion kernel runs over bit patterns that cover every rounding case (ties,
subnormals, overflow, inf, NaN, all patterns of each 8- and 16-bit source) and is checked
bit for bit against NumPy models of the GPU's conversions. On the CPU this checks the
``interpret`` backend; on a GPU the same test checks the compiled kernel, so the two agree.
"""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import triton
import triton.language as tl

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare
from te_jax_perm.core.interpret_backend import FORMATS, decode, encode, round_float
from tests.conftest import routing

F8 = np.dtype(ml_dtypes.float8_e4m3fn)
F8E5 = np.dtype(ml_dtypes.float8_e5m2)
BF16 = np.dtype(ml_dtypes.bfloat16)


@triton.jit
def convert_kernel(x_ptr, N, y_prealloc_ptr, y_ptr, BLOCK: tl.constexpr, RTZ: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + offs, mask=m)
    if RTZ:
        y = x.to(y_ptr.dtype.element_ty, fp_downcast_rounding="rtz")
    else:
        y = x.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + offs, y, mask=m)


convert = declare(KernelDecl(
    name="test_convert", kernel=convert_kernel,
    operands=(Operand("x", ("N",)),),
    outputs=(Output("y", lambda d, p: (d["N"],), lambda t, p: np.dtype(p["dst"])),),
    params=("dst", "rtz"),
    reference=lambda x, dst, rtz: (x.astype(dst),),
    grid=lambda d, p, c: (triton.cdiv(d["N"], c.kw["BLOCK"]),),
    scalars=lambda d, p: {"N": d["N"]},
    constexprs=lambda d, p, c: {"RTZ": p["rtz"]},
    default_config=lambda d, p: Config.make(BLOCK=4096),
))


def _f32_patterns() -> np.ndarray:
    """float32 values hitting every rounding case of the narrower formats."""
    rng = np.random.default_rng(0)
    bits = [rng.integers(0, 2**32, 1 << 15, dtype=np.uint64).astype(np.uint32)]
    # Ties and near-ties at every bf16/fp16/fp8 cut position, over all exponents.
    exps = np.arange(256, dtype=np.uint32) << 23
    for cut in (13, 16, 20, 21):
        half = np.uint32(1 << (cut - 1))
        for low in (half - 1, half, half + 1):
            for odd in (0, 1 << cut):
                bits.append(exps | np.uint32(low) | np.uint32(odd))
    bits.append(np.arange(0, 1 << 12, dtype=np.uint32))             # f32 subnormals
    f = np.concatenate(bits).view(np.float32)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 448.0, 449.0, 464.0, 465.0, 480.0, 57344.0, 61440.0,
                        65504.0, 65520.0, 3.3895314e38, 3.39e38, 2.0**31, -2.0**31, 2.0**31 - 128, 1e10, -1e10,
                        2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 2.0**-24, 2.0**-25], np.float32)
    f = np.concatenate([f, special, -special])
    return np.concatenate([f, -f])


def _all(dtype) -> np.ndarray:
    n = np.dtype(dtype).itemsize * 8
    return np.arange(1 << n, dtype=np.uint64).astype(f"uint{n}").view(dtype)


def _run(x: np.ndarray, dst, rtz: bool, backend: str) -> np.ndarray:
    (y,) = convert(jnp.asarray(x), dst=np.dtype(dst).name, rtz=rtz, backend=backend)
    return np.asarray(y)


def _isnan(a: np.ndarray) -> np.ndarray:
    return np.zeros(a.shape, bool) if np.issubdtype(a.dtype, np.integer) else np.isnan(a.astype(np.float64))


def _assert_bits_equal(got: np.ndarray, want: np.ndarray, x: np.ndarray) -> None:
    """Equal bit patterns, except that any NaN matches any NaN (payloads are not modelled)."""
    want_nan = _isnan(want)
    np.testing.assert_array_equal(_isnan(got), want_nan)
    u = f"uint{got.dtype.itemsize * 8}"
    bad = np.flatnonzero((got.view(u) != want.view(u)) & ~want_nan)
    xu = x.view(f"uint{x.dtype.itemsize * 8}")
    assert bad.size == 0, (f"{bad.size} of {x.size} differ, e.g. x={x[bad[:4]]!r} (bits {xu[bad[:4]]}): "
                           f"got bits {got[bad[:4]].view(u)}, want {want[bad[:4]].view(u)}")


# -- NumPy models of the GPU's conversions -------------------------------------------------
def _bf16_rtz(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.uint32)
    out = (b >> 16).astype(np.uint16).view(BF16)
    return np.where(np.isnan(x), np.array(np.nan, BF16), out)


def _rtne_from_f64(x: np.ndarray, mant: int) -> np.ndarray:
    """float64 values rounded to ``mant`` mantissa bits, to nearest even (normal range)."""
    u = x.astype(np.float64).view(np.uint64)
    drop = np.uint64(52 - mant)
    lsb = (u >> drop) & np.uint64(1)
    return (((u + (np.uint64(1) << (drop - np.uint64(1))) - np.uint64(1) + lsb) >> drop) << drop).view(np.float64)


def _sat_int32(x: np.ndarray) -> np.ndarray:
    t = np.trunc(x.astype(np.float64))
    return np.where(np.isnan(t), 0, np.clip(t, -2**31, 2**31 - 1)).astype(np.int32)


CASES = {
    # name: (source values, destination dtype, rtz, GPU model)
    "f32_to_bf16": (_f32_patterns, BF16, False, lambda x: x.astype(BF16)),
    "f32_to_bf16_rtz": (_f32_patterns, BF16, True, _bf16_rtz),
    "f32_to_f16": (_f32_patterns, np.float16, False, lambda x: x.astype(np.float16)),
    "f32_to_f8e4m3": (_f32_patterns, F8, False, lambda x: np.clip(x, -448, 448).astype(F8)),
    "f32_to_f8e5m2": (_f32_patterns, F8E5, False, lambda x: np.clip(x, -57344, 57344).astype(F8E5)),
    "bf16_to_f8e4m3": (lambda: _all(BF16), F8, False, lambda x: np.clip(x.astype(np.float32), -448, 448).astype(F8)),
    "f16_to_bf16": (lambda: _all(np.float16), BF16, False, lambda x: x.astype(np.float32).astype(BF16)),
    "bf16_to_f16": (lambda: _all(BF16), np.float16, False, lambda x: x.astype(np.float64).astype(np.float16)),
    "bf16_to_f32": (lambda: _all(BF16), np.float32, False, lambda x: x.astype(np.float32)),
    "f8e4m3_to_f32": (lambda: _all(F8), np.float32, False, lambda x: x.astype(np.float32)),
    "f8e4m3_to_bf16": (lambda: _all(F8), BF16, False, lambda x: x.astype(np.float32).astype(BF16)),
    "i32_to_bf16": (lambda: np.concatenate([np.arange(-70000, 70000, 7), (1 << np.arange(31)) + 1,
                                            (1 << 24) + (1 << 16) + np.arange(-3, 4), [-2**31, 2**31 - 1]]
                                           ).astype(np.int32),
                    BF16, False, lambda x: _rtne_from_f64(x.astype(np.float64), 7).astype(BF16)),
    "f32_to_i32": (_f32_patterns, np.int32, False, _sat_int32),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_conversion_matches_the_gpu(case, kernel_backend):
    make, dst, rtz, model = CASES[case]
    x = make()
    got = _run(x, dst, rtz, kernel_backend)
    assert got.dtype == np.dtype(dst)
    with np.errstate(invalid="ignore", over="ignore"):
        want = model(x)
    _assert_bits_equal(got, want, x)


def test_round_float_agrees_with_direct_rounding():
    # The module's rounding, against an independent bit-level RTNE, from float64 sources
    # whose rounding through float32 would round twice.
    rng = np.random.default_rng(1)
    x = rng.standard_normal(1 << 14) * 2.0 ** rng.integers(-100, 100, 1 << 14)
    x = np.concatenate([x, 1.0 + 2.0**-8 + 2.0**-40 * np.arange(1, 5)])
    np.testing.assert_array_equal(round_float(x, FORMATS["bf16"]),
                                  _rtne_from_f64(x, 7).astype(BF16).view(np.uint16))


@pytest.mark.parametrize("name,dtype", [("bf16", BF16), ("fp16", np.float16), ("fp8e4nv", F8), ("fp8e5", F8E5)])
def test_decode_encode_every_bit_pattern(name, dtype):
    fmt = FORMATS[name]
    bits = _all(dtype).view(fmt.storage)
    vals = decode(bits, fmt)
    want = _all(dtype).astype(np.float64)
    np.testing.assert_array_equal(np.isnan(vals), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(vals[ok], want[ok])
    np.testing.assert_array_equal(encode(vals[ok], fmt), bits[ok])
    assert fmt.max == float(ml_dtypes.finfo(dtype).max)


# -- the ops themselves --------------------------------------------------------------------
def _routing(t, e, k, seed):
    rng = np.random.default_rng(seed)
    return routing(rng, t, e, k), rng


def _combine_model(y: np.ndarray, rid: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The weighted combine as the kernel computes it: float32 products added in map-column
    order, then one round to nearest even into bf16."""
    t, e = w.shape
    acc = np.zeros((t, y.shape[1]), np.float32)
    for j in range(e):
        dest, ex = rid[:, j], rid[:, e + j]
        live = (j < rid[:, 2 * e]) & (dest >= 0)
        rows = np.where(live[:, None], y[np.where(live, dest, 0)].astype(np.float32), np.float32(0))
        acc = acc + rows * np.where(live, w[np.arange(t), np.clip(ex, 0, e - 1)], np.float32(0))[:, None]
    return acc.astype(BF16)


@pytest.mark.parametrize("k", [2, 4])
def test_bf16_weighted_combine_rounds_to_nearest_even(kernel_backend, k):
    from te_jax_perm import token_combine, token_dispatch

    T, H, E = 64, 64, 8
    rm, rng = _routing(T, E, k, k)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    p = jnp.asarray(rng.random((T, E)), jnp.float32) * rm
    # The rows and map as any backend builds them: what is checked is the combine's rounding
    # (the interpreter would spend as long again on the dispatch's kernels).
    out, _, rid, _, _ = token_dispatch(x, rm, T * k, probs=p, backend="xla")
    y = np.asarray(token_combine(out, rid, merging_probs=p, backend=kernel_backend))
    want = _combine_model(np.asarray(out), np.asarray(rid), np.asarray(p))
    np.testing.assert_array_equal(y.view(np.uint16), want.view(np.uint16))
    if k == 2:   # two terms: every summation order gives the same float32 sum
        y_xla = np.asarray(token_combine(out, rid, merging_probs=p, backend="xla"))
        np.testing.assert_array_equal(y.view(np.uint16), y_xla.view(np.uint16))


@pytest.mark.parametrize("weighted", [False, True])
def test_fp8_combine_matches_xla(kernel_backend, weighted):
    from te_jax_perm import token_combine, token_dispatch

    T, H, E, k = 16, 32, 4, 2
    rm, rng = _routing(T, E, k, 3)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float8_e4m3fn)
    p = jnp.asarray(rng.random((T, E)), jnp.float32) * rm if weighted else None
    out, _, rid, _, _ = token_dispatch(x, rm, T * k, probs=p, backend="xla")
    got = np.asarray(token_combine(out, rid, merging_probs=p, backend=kernel_backend))
    want = np.asarray(token_combine(out, rid, merging_probs=p, backend="xla"))
    assert got.dtype == want.dtype == F8
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("weighted", [False, True])
def test_fp8_sums_past_the_largest_value_saturate_on_every_backend(kernel_backend, dtype, weighted):
    """Rows whose sum overflows fp8 (and, in e5m2, infinite rows): the kernels store the
    largest finite value (the GPU's saturating conversion), and the xla backend, the
    reference, stores the same bits (its plain cast gave NaN in e4m3fn and inf in e5m2)."""
    from te_jax_perm import token_combine, token_dispatch

    dt = jnp.dtype(dtype)
    big = float(jnp.finfo(dt).max)
    rm = jnp.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1]], bool)
    x = np.full((4, 16), 0.75 * big, np.float32)
    x[1] *= -1
    if dt.name == "float8_e5m2":
        x[2, :4] = np.inf
    x = jnp.asarray(x, dt)
    p = rm * 1.0 if weighted else None
    out, _, rid, _, _ = token_dispatch(x, rm, 8, probs=p, backend="xla")
    got = np.asarray(token_combine(out, rid, merging_probs=p, backend=kernel_backend))
    want = np.asarray(token_combine(out, rid, merging_probs=p, backend="xla"))
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert np.all(np.abs(want.astype(np.float32)) == big)


def test_fp8_dispatch_gradient_matches_xla(kernel_backend):
    from te_jax_perm import token_dispatch

    T, H, E, k = 16, 32, 4, 2
    rm, rng = _routing(T, E, k, 4)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float8_e4m3fn)
    ct = jnp.asarray(rng.standard_normal((T * k, H)), jnp.float8_e4m3fn)

    def grad(backend):
        _, vjp = jax.vjp(lambda v: token_dispatch(v, rm, T * k, backend=backend)[0], x)
        return np.asarray(vjp(ct)[0])

    got, want = grad(kernel_backend), grad("xla")
    assert got.dtype == want.dtype == F8
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# -- bf16 arithmetic: values, not bit patterns -------------------------------------------------
@triton.jit
def bf16_ops_kernel(x_ptr, y_ptr, z_ptr, el_prealloc_ptr, red_prealloc_ptr, scan_prealloc_ptr, el_ptr, red_ptr,
                    scan_ptr, R: tl.constexpr, C: tl.constexpr):
    # No conversions anywhere: every operation below sees bf16 operands.
    offs = tl.arange(0, R * C)
    x, y, z = tl.load(x_ptr + offs), tl.load(y_ptr + offs), tl.load(z_ptr + offs)
    n = R * C
    tl.store(el_ptr + offs, x + y)
    tl.store(el_ptr + n + offs, x - y)
    tl.store(el_ptr + 2 * n + offs, x * y)
    tl.store(el_ptr + 3 * n + offs, x / y)
    tl.store(el_ptr + 4 * n + offs, -x)
    tl.store(el_ptr + 5 * n + offs, tl.maximum(x, y))
    tl.store(el_ptr + 6 * n + offs, tl.fma(x, y, z))
    tl.store(el_ptr + 7 * n + offs, tl.where(x < y, x, y))
    rows = tl.reshape(x, (R, C))
    r = tl.arange(0, R)
    tl.store(red_ptr + r, tl.sum(rows, axis=1))
    tl.store(red_ptr + R + r, tl.max(rows, axis=1))
    tl.store(scan_ptr + offs, tl.reshape(tl.cumsum(rows, axis=1), (R * C,)))


_OPS_R, _OPS_C = 8, 16
bf16_ops = declare(KernelDecl(
    name="test_bf16_ops", kernel=bf16_ops_kernel,
    operands=(Operand("x", ("N",)), Operand("y", ("N",)), Operand("z", ("N",))),
    outputs=(Output("el", lambda d, p: (8, d["N"]), lambda t, p: t["x"]),
             Output("red", lambda d, p: (2, _OPS_R), lambda t, p: t["x"]),
             Output("scan", lambda d, p: (d["N"],), lambda t, p: t["x"])),
    reference=lambda x, y, z: (None, None, None),
    grid=lambda d, p, c: (1,),
    constexprs=lambda d, p, c: {"R": _OPS_R, "C": _OPS_C},
    default_config=lambda d, p: Config.make(),
))


def test_bf16_arithmetic_acts_on_values(kernel_backend):
    """bf16 operands in a kernel's float operators, comparisons and reductions, without a
    conversion: each elementwise result is the exact result rounded once to bf16 (what the
    GPU gives; the interpreter stores bf16 as uint16 and, left alone, computes on the bits),
    sums and scans within a bf16 rounding per add of the exact sum."""
    rng = np.random.default_rng(3)
    n = _OPS_R * _OPS_C
    x, y, z = (rng.standard_normal(n).astype(BF16) for _ in range(3))
    el, red, scan = (np.asarray(a) for a in bf16_ops(jnp.asarray(x), jnp.asarray(y), jnp.asarray(z),
                                                     backend=kernel_backend))
    f = lambda a: a.astype(np.float64)
    rnd = lambda v: v.astype(np.float32).astype(BF16)    # float32 first: harmless double rounding (24 >= 2 * 8 + 2)
    want = [rnd(f(x) + f(y)), rnd(f(x) - f(y)), rnd(f(x) * f(y)), rnd(f(x) / f(y)), -x, np.maximum(x, y),
            rnd(f(x) * f(y) + f(z)), np.where(f(x) < f(y), x, y)]
    for i, w in enumerate(want):
        np.testing.assert_array_equal(el[i].view(np.uint16), w.view(np.uint16), err_msg=f"elementwise op {i}")
    rows = f(x).reshape(_OPS_R, _OPS_C)
    np.testing.assert_array_equal(red[1].view(np.uint16), rows.max(1).astype(BF16).view(np.uint16))
    bound = np.abs(rows).sum(1) * _OPS_C * 2.0 ** -8             # C adds, each off by at most half an ulp
    assert np.all(np.abs(f(red[0]) - rows.sum(1)) <= bound), (red[0], rows.sum(1))
    cum = np.cumsum(rows, 1)
    assert np.all(np.abs(f(scan).reshape(_OPS_R, _OPS_C) - cum) <= bound[:, None]), (scan, cum)
