"""``interpret`` backend: the real Triton kernel, run by Triton's interpreter on the CPU.

The kernel runs inside a ``buffer_callback`` custom call whose preallocated outputs carry
the same declared aliases as the GPU's, so CPU tests exercise the ``triton`` backend's
aliasing contract. Launch observers (``core.hooks``: the sanitizer) see every buffer
passed to the kernel, around the whole launch.

GPU Triton's conversion numerics: the interpreter converts fp32 to bf16 by truncation and
fp8 with its own bit arithmetic; the GPU rounds to nearest-even and saturates fp8, so
without this a CPU test vouches for nothing on the GPU. :func:`install_numerics` replaces
``cast_impl`` and ``create_fp_to_fp`` (every float conversion; same names and signatures in
Triton 3.6-3.9) with the GPU's:

* float -> narrower float: correctly rounded from the exact value, to nearest even (toward
  zero for ``"rtz"``); overflow gives inf, saturating for fp8 (the GPU's ``.satfinite``);
* float -> wider float: exact; int -> float: correctly rounded (exact below 2**53);
* float -> int: truncation toward zero, saturating at the integer range, NaN -> 0.

NaN payloads are not modelled. Other conversions (fp8 variants not used on NVIDIA GPUs,
int <-> int) keep the interpreter's own behaviour. bf16 dots multiply values, not bits, and
so does all other bf16 arithmetic (operators, comparisons, math functions, sums, scans,
min/max): each operation is rounded once to nearest even, as the GPU rounds one operation.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from te_jax_perm.core import errors, hooks
from te_jax_perm.core.env import source_lock
from te_jax_perm.core.aliasing import preallocate
from te_jax_perm.core.hooks import BufferInfo
from te_jax_perm.core.kernel_args import OPERAND, OUTPUT, kernel_arguments
from te_jax_perm.core.launch import Launch


class HostPointer:
    """Adapter giving a host NumPy buffer the ``data_ptr()``/``dtype`` face Triton expects."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.dtype = array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data


def launch_interpreted(kernel: Any, grid3: tuple[int, int, int], args: Mapping[str, Any],
                       constexprs: Mapping[str, Any], *, name: str,
                       buffers: Sequence[BufferInfo] = ()) -> None:
    """Runs ``kernel`` (a ``@triton.jit`` function) over ``grid3`` (a :class:`Launch`'s, or
    a test's for a kernel with no declaration) with the interpreter; ``args`` maps its
    parameter names to :class:`HostPointer` or Python scalars."""
    from triton.runtime import interpreter as interp  # lazy: keep import cost off xla-only use

    with source_lock:   # also around the set-up: two threads' first launches would both patch
        install_numerics()   # the GPU's rounding, not the interpreter's
        _skip_dropped_overflow_checks(interp)
        observers = hooks.launch_observers()
        for ob in observers:
            ob.launch_begin(name, buffers, grid3)
        try:
            with _interpreted(kernel.fn) as fn:
                call_args = {**{k: interp._implicit_cvt(v) for k, v in args.items()}, **constexprs}
                interp.interpreter_builder.set_grid_dim(*grid3)
                for x, y, z in itertools.product(*(range(g) for g in grid3)):
                    interp.interpreter_builder.set_grid_idx(x, y, z)
                    fn(**call_args)
        finally:
            for ob in observers:
                ob.launch_end()


def _skip_dropped_overflow_checks(interp: Any) -> None:
    """With ``sanitize_overflow`` on (the interpreter's default), every 32-bit integer add,
    subtract and multiply also runs in int64 and compares the result with the int32 range,
    about a quarter of a launch's time here, and then hands the comparison to
    ``device_assert``, which drops it unless ``debug`` is on: off, the same kernel runs the
    same values. With ``debug`` on the checks assert, and stay."""
    options = interp.interpreter_builder.options
    if getattr(options, "sanitize_overflow", False) and not getattr(options, "debug", False):
        interp.interpreter_builder.options = dataclasses.replace(options, sanitize_overflow=False)


_rewritten: dict[Any, Any] = {}
# How many ``_interpreted`` blocks enclose this point (launches run one at a time: the lock).
_depth = 0


def _languages() -> Any:
    """What Triton's ``_patch_lang(fn)`` reads of ``fn`` (its globals), naming both language
    modules: ``triton.language`` (what kernels use) and ``triton.language.core`` (what
    Triton's own helpers, ``tl.sum``, ``tl.max``, ``tl.zeros``..., reach the builtins
    through)."""
    import types

    import triton.language as tl

    return types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})


@contextlib.contextmanager
def _interpreted(fn: Any) -> Iterator[Callable]:
    """``fn``'s interpreter rewrite (made once), the language patched for it in the block.
    The patch also lets it call other ``@triton.jit`` functions (helpers, ``tl.sum``...):
    outside ``TRITON_INTERPRET=1`` their ``__call__`` refuses to run, so it runs their rewrite.
    The outermost block patches both language modules, so a helper runs as it is: patching
    them again would set every attribute to what it already is, at the cost of walking the
    whole language, on every call of every helper in every program."""
    global _depth
    import triton.language as tl
    from triton.runtime import interpreter as interp
    from triton.runtime.jit import JITFunction

    if fn not in _rewritten:
        _rewritten[fn] = interp.InterpretedFunction(fn).rewrite()
    if _depth:
        yield _rewritten[fn]
        return
    scope = interp._patch_lang(_languages())
    # Scalars used as Python ints (loop bounds, ``range``) under NumPy >= 2.4, which refuses
    # Triton 3.6-3.8's ``int(one-element array)``; truth values keep the interpreter's own
    # rule (only a scalar has one), read as a scalar. The scope undoes this with the rest.
    first = lambda t: np.asarray(t.handle.data).reshape(-1)[0]  # noqa: E731
    scope.set_attr(tl.core.tensor, "__index__", lambda self: int(first(self)))
    scope.set_attr(tl.core.tensor, "__bool__", lambda self: bool(first(self)) if self.handle.data.size == 1 else True)
    scope.set_attr(JITFunction, "__call__", _call_nested)
    _depth += 1
    try:
        yield _rewritten[fn]
    finally:
        _depth -= 1
        scope.restore()


def _call_nested(jit_fn: Any, *args: Any, **kwargs: Any) -> Any:
    with _interpreted(jit_fn.fn) as fn:
        return fn(*args, **kwargs)


def run_launch(launch: Launch, operands: Sequence[np.ndarray], preallocs: Sequence[np.ndarray],
               outputs: Sequence[np.ndarray]) -> None:
    """Runs ``launch`` on host buffers (outputs may be the preallocs themselves)."""
    if launch.empty:
        return   # as on the GPU: no program runs, the preallocated buffers are the result
    args = kernel_arguments(launch, operands, preallocs, outputs)
    must_write = {o.name for o, zeroed in zip(launch.decl.outputs, launch.aliases.zeroed) if not zeroed}
    infos = [BufferInfo(a.source, "input" if a.role == OPERAND else a.role, a.value.ctypes.data, a.value.nbytes,
                        a.value.dtype, tuple(a.value.shape), a.role == OUTPUT and a.source in must_write)
             for a in args if a.is_pointer]
    values = {a.name: HostPointer(a.value) if a.is_pointer else a.value for a in args}
    launch_interpreted(launch.decl.kernel, launch.grid3, values, launch.constexprs, name=launch.decl.name,
                       buffers=infos)


def run_eagerly(fn: Callable[..., Any], args: Sequence[jax.Array]) -> Any:
    """``fn(*args)`` for an eager ``interpret`` call, finished: on the first CPU device (the
    interpreter dereferences host pointers), a launch's error raised as itself, with the
    frames it came through (a kernel's failing line among them)."""
    try:
        if jax.default_backend() == "cpu":
            return jax.block_until_ready(fn(*args))
        cpu = jax.devices("cpu")[0]
        with jax.default_device(cpu):
            return jax.block_until_ready(fn(*jax.device_put(tuple(args), cpu)))
    except jax.errors.JaxRuntimeError as e:
        raise errors.original(e, traceback=True) or e from None


def interpret_call(launch: Launch, operands: Sequence[jax.Array]) -> list[jax.Array]:
    """Traceable function emitting one aliased buffer_callback custom call."""
    from jax.experimental.buffer_callback import buffer_callback

    plan = launch.aliases
    preallocs = preallocate(plan, launch.out_avals)   # outside the scope that marks our custom call

    def callback(_ctx, outs, *ins):
        in_arrays = [np.asarray(b) for b in ins]
        try:
            run_launch(launch, in_arrays[:plan.num_operands], in_arrays[plan.num_operands:],
                       [np.asarray(b) for b in outs])
        except Exception as e:
            raise errors.keep(e)   # XLA hands it on as text: run_eagerly and hazard_error give it back

    result_types = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in launch.out_avals]
    with jax.named_scope(f"te_jax_perm.{launch.decl.name}"):
        call = buffer_callback(callback, result_types, input_output_aliases=plan.input_output_aliases)
        return list(call(*operands, *preallocs))


# -- GPU numerics ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """Sign, ``ebits`` exponent and ``nmant`` mantissa bits; ``finite_only`` (float8 e4m3fn):
    no infinities, one NaN per sign (all bits set); the others follow IEEE 754."""

    bits: int
    ebits: int
    nmant: int
    finite_only: bool = False

    @property
    def bias(self) -> int:
        return (1 << (self.ebits - 1)) - 1

    @property
    def emask(self) -> int:
        return (1 << self.ebits) - 1

    @property
    def max(self) -> float:
        if self.finite_only:   # the top exponent is normal; only its all-ones mantissa is NaN
            return (2.0 - 2.0 ** (1 - self.nmant)) * 2.0 ** (self.emask - self.bias)
        return (2.0 - 2.0 ** -self.nmant) * 2.0 ** (self.emask - 1 - self.bias)

    @property
    def storage(self) -> np.dtype:
        return np.dtype(f"uint{self.bits}")


# Triton element type name -> format, for the float types handled here.
FORMATS = {
    "fp16": FloatFormat(16, 5, 10),
    "bf16": FloatFormat(16, 8, 7),
    "fp32": FloatFormat(32, 8, 23),
    "fp8e4nv": FloatFormat(8, 4, 3, finite_only=True),
    "fp8e5": FloatFormat(8, 5, 2),
}
# Formats the GPU converts into with saturation to the largest finite value.
_SATURATING = ("fp8e4nv", "fp8e5")


# The interpreter runs kernels on threads where XLA may have set flush-to-zero and
# denormals-are-zero, which would flush subnormal floats in any float arithmetic or
# float-to-float cast. Decoding and encoding therefore go through integer fields, and
# the float64 arithmetic in between only ever sees normal float64 numbers.
def decode(bits: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """float64 values of raw ``fmt`` bit patterns (exact)."""
    u = bits.view(fmt.storage).astype(np.int64)
    sign = (u >> (fmt.bits - 1)) & 1
    e = (u >> fmt.nmant) & fmt.emask
    m = u & ((1 << fmt.nmant) - 1)
    mag = np.ldexp((m + np.where(e > 0, 1 << fmt.nmant, 0)).astype(np.float64),
                   np.maximum(e, 1) - fmt.bias - fmt.nmant)
    if fmt.finite_only:
        mag = np.where((e == fmt.emask) & (m == (1 << fmt.nmant) - 1), np.nan, mag)
    else:
        mag = np.where(e == fmt.emask, np.where(m == 0, np.inf, np.nan), mag)
    return np.where(sign == 1, -mag, mag)


def encode(x: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """Raw ``fmt`` bits of float64 values that ``fmt`` represents exactly (or inf/NaN)."""
    x = np.asarray(x, np.float64)
    sign = np.signbit(x).astype(np.int64) << (fmt.bits - 1)
    a = np.abs(x)
    finite = np.isfinite(a)
    af = np.where(finite, a, 0.0)
    _, k = np.frexp(af)
    normal = af >= 2.0 ** (1 - fmt.bias)
    e = np.where(normal, k - 1 + fmt.bias, 0)
    m = np.where(normal, np.ldexp(af, fmt.nmant - (k - 1)) - (1 << fmt.nmant),
                 np.ldexp(af, fmt.bias - 1 + fmt.nmant)).astype(np.int64)
    mmask = (1 << fmt.nmant) - 1
    special_m = np.where(np.isnan(a), mmask if fmt.finite_only else 1 << (fmt.nmant - 1), 0)
    e = np.where(finite, e, fmt.emask)
    m = np.where(finite, m, special_m)
    return (sign | (e << fmt.nmant) | m).astype(fmt.storage)


def round_float(x: np.ndarray, fmt: FloatFormat, *, toward_zero: bool = False, saturate: bool = False
                ) -> np.ndarray:
    """Raw ``fmt`` bits of float64 values ``x`` (the exact source values), rounded once.

    Power-of-two scaling is exact and ``np.rint`` rounds half to even, so ``rint(|x|/q)*q``
    with ``q`` the spacing of ``fmt`` at ``|x|`` (held at the smallest normal's spacing
    below it: subnormals) is the correctly rounded magnitude. Overflow gives inf (NaN
    without inf), the largest finite value toward zero, and with ``saturate`` for inf too.
    """
    x = np.asarray(x, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        a = np.abs(x)
        _, k = np.frexp(np.where(np.isfinite(a), a, 0.0))
        q = np.ldexp(1.0, np.maximum(k - 1, 1 - fmt.bias) - fmt.nmant)
        r = (np.trunc if toward_zero else np.rint)(a / q) * q
        huge = np.nan if fmt.finite_only else np.inf
        r = np.where(np.isfinite(a) & (r > fmt.max), fmt.max if saturate or toward_zero else huge, r)
        r = np.where(np.isinf(a), fmt.max if saturate else huge, r)
        r = np.where(np.isnan(a), np.nan, r)
        return encode(np.copysign(r, x), fmt)


def _float_to_int(v: np.ndarray, dst: np.dtype) -> np.ndarray:
    """Truncation toward zero, saturating at ``dst``'s range; NaN -> 0."""
    info = np.iinfo(dst)
    lo, hi = float(info.min), float(info.max)   # hi rounds up to 2**63 / 2**64 for 64-bit types
    with np.errstate(invalid="ignore"):
        t = np.trunc(v)
        out = np.where((t >= lo) & (t < hi), t, 0).astype(dst)
        out = np.where(t >= hi, np.array(info.max, dst), out)
        return np.where(t < lo, np.array(info.min, dst), out)


def convert(data: np.ndarray, src_tt: Any, dst_tt: Any, storage: np.dtype, *, toward_zero: bool = False
            ) -> np.ndarray | None:
    """The GPU's conversion of interpreter data ``data`` from ``src_tt`` to ``dst_tt``, in
    ``dst_tt``'s storage dtype; ``None`` when this module does not handle the pair."""
    src, dst = src_tt.name, dst_tt.name
    sfmt, dfmt = FORMATS.get(src), FORMATS.get(dst)
    # Neither side a float handled here (int <-> int), or one a float that is not (float64,
    # an fp8 variant not used on NVIDIA GPUs): the interpreter's own conversion.
    if (sfmt is None and dfmt is None) or (src.startswith("fp") and sfmt is None) or (
            dst.startswith("fp") and dfmt is None):
        return None
    # A source that is no handled float is an integer (or i1, held as bool).
    vals = decode(data, sfmt) if sfmt is not None else data.astype(np.float64)   # exact below 2**53
    if dfmt is not None:
        out = round_float(vals, dfmt, toward_zero=toward_zero, saturate=dst in _SATURATING)
    elif np.issubdtype(storage, np.integer):
        out = _float_to_int(vals, np.dtype(storage))
    else:
        return None
    return out.view(storage)


@functools.lru_cache(maxsize=None)
def install_numerics() -> None:
    """Makes the interpreter convert as the GPU does (once per process)."""
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    rtz = ir.ROUNDING_MODE.RTZ

    def gpu_conversion(orig: Callable) -> Callable:
        """``orig`` (``cast_impl``, or ``create_fp_to_fp`` with its rounding mode) converting as
        the GPU does wherever :func:`convert` handles the pair."""
        @functools.wraps(orig)
        def wrapper(self, src, dst_type, *rounding_mode):
            toward_zero = rounding_mode == (rtz,)
            # Round-toward-zero into a saturating fp8 type is not a GPU conversion.
            out = None if toward_zero and dst_type.scalar.name in _SATURATING else convert(
                src.data, src.dtype.scalar, dst_type.scalar, interp._get_np_dtype(dst_type), toward_zero=toward_zero)
            if out is None:
                return orig(self, src, dst_type, *rounding_mode)
            return interp.TensorHandle(out, dst_type.scalar)
        return wrapper

    orig_dot = builder.create_dot

    @functools.wraps(orig_dot)
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # The interpreter keeps bf16 as uint16 storage and would multiply the raw bit
        # patterns; tensor cores multiply the bf16 values exactly and accumulate in fp32.
        if _is_bf16(a) or _is_bf16(b):
            out = np.matmul(_values(a), _values(b), dtype=np.float32).astype(d.data.dtype) + d.data
            return interp.TensorHandle(out, d.dtype.scalar)
        return orig_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    builder.cast_impl = gpu_conversion(builder.cast_impl)
    builder.create_fp_to_fp = gpu_conversion(builder.create_fp_to_fp)
    builder.create_dot = create_dot
    _install_bf16_arithmetic(interp)
    if hasattr(interp, "_get_np_dtype"):
        interp._get_np_dtype = _memoized_np_dtype(interp._get_np_dtype)


def _is_bf16(h) -> bool:   # a TensorHandle or a tl.tensor
    return h.dtype.scalar.name == "bf16"


def _values(h) -> np.ndarray:
    """A handle's values: bf16 bit patterns decoded (exactly, to float64), others as stored."""
    return decode(h.data, FORMATS["bf16"]) if _is_bf16(h) else h.data


def _install_bf16_arithmetic(interp: Any) -> None:
    """bf16 arithmetic on values, not bit patterns.

    The interpreter stores bf16 as uint16 and its float operators, math functions, sums,
    scans and min/max reductions would act on those integers (``x * s`` of bf16 tensors
    gives garbage, comparisons order negative numbers backwards). Here every such operation
    with a bf16 operand decodes the values, computes in float64 and rounds the result once
    to bf16, nearest even: the GPU's result for one operation (float64's 53 bits make the
    double rounding harmless), and a single rounding where the GPU rounds each add of a
    bf16 sum in its own order. Selects and ``abs`` move bits and stay as they are."""
    bf16 = FORMATS["bf16"]
    handle = interp.TensorHandle

    def packed(out: np.ndarray) -> np.ndarray:
        out = np.asarray(out)
        return out if out.dtype == np.bool_ else round_float(out.astype(np.float64), bf16).view(np.uint16)

    def on_values(orig: Callable, compute: Callable, result_of: Callable) -> Callable:
        """``orig`` with ``compute(*args)`` in its place when its first operand is bf16 (Triton
        gives a float operator operands of one type)."""
        @functools.wraps(orig)
        def wrapper(self, *args):
            if not _is_bf16(args[0]):
                return orig(self, *args)
            return handle(packed(compute(*args)), result_of(*args).dtype.scalar)
        return wrapper

    b = interp.InterpreterBuilder
    b.binary_op = on_values(b.binary_op, lambda x, y, op: op(_values(x), _values(y)), lambda x, y, op: x)
    b.unary_op = on_values(b.unary_op, lambda x, op: op(_values(x)), lambda x, op: x)
    b.create_fma = on_values(b.create_fma, lambda x, y, z: _values(x) * _values(y) + _values(z), lambda x, y, z: z)
    b.create_rsqrt = on_values(b.create_rsqrt, lambda x: 1 / np.sqrt(_values(x)), lambda x: x)
    b.create_erf = on_values(b.create_erf, lambda x: _erf(_values(x)), lambda x: x)
    orig_ternary = b.ternary_op

    @functools.wraps(orig_ternary)
    def ternary_op(self, cond, x, y, op):
        if op is np.where or not _is_bf16(x):   # a select moves bits
            return orig_ternary(self, cond, x, y, op)
        return handle(packed(op(_values(cond), _values(x), _values(y))), y.dtype.scalar)
    b.ternary_op = ternary_op

    def reduction(orig: Callable, compute: Callable) -> Callable:
        @functools.wraps(orig)
        def wrapper(self, input, *args, **kwargs):
            if not _is_bf16(input):
                return orig(self, input, *args, **kwargs)
            return compute(self, _values(input.handle), input)
        return wrapper

    def to_bf16(self, out, like):
        # ``to_tensor`` casts to the storage dtype: hand it the bits, shaped as it expects.
        bits = packed(out)
        return self.to_tensor(bits if bits.shape else bits.item(), like.dtype)

    reduce_ops, scan_ops = interp.ReduceOps, interp.ScanOps
    reduce_ops.sum = reduction(reduce_ops.sum, lambda self, v, t: to_bf16(
        self, np.sum(v, axis=self.axis, keepdims=self.keep_dims), t))
    orig_min_max = reduce_ops.min_max

    @functools.wraps(orig_min_max)
    def min_max(self, input, val_reduce_op, idx_reduce_op=None):
        import triton.language as tl
        input = input[0] if isinstance(input, tuple) else input
        if not _is_bf16(input):
            return orig_min_max(self, input, val_reduce_op, idx_reduce_op)
        v = _values(input.handle)
        val = None if val_reduce_op is None else to_bf16(
            self, val_reduce_op(v, axis=self.axis, keepdims=self.keep_dims), input)
        if idx_reduce_op is None:
            return val
        idx = self.to_tensor(idx_reduce_op(v, axis=self.axis, keepdims=self.keep_dims), tl.int32)
        return idx if val is None else (val, idx)
    reduce_ops.min_max = min_max
    scan_ops.cumsum = reduction(scan_ops.cumsum, lambda self, v, t: [to_bf16(self, np.cumsum(v, axis=self.axis), t)])
    scan_ops.cumprod = reduction(scan_ops.cumprod,
                                 lambda self, v, t: [to_bf16(self, np.cumprod(v, axis=self.axis), t)])


def _erf(x: np.ndarray) -> np.ndarray:
    import math
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _memoized_np_dtype(orig: Callable) -> Callable:
    """The interpreter's Triton-to-NumPy type lookup, remembered per element type: it builds
    its fixed table anew on every call (about a tenth of an interpreted kernel's time), and a
    block's answer is its element type's."""
    import triton.language as tl
    known: dict = {}

    def np_dtype(tt):
        scalar = tt.element_ty if isinstance(tt, tl.block_type) else tt
        try:
            return known[scalar]
        except KeyError:
            known[scalar] = found = orig(scalar)
            return found
        except TypeError:   # an unhashable type: ask the interpreter
            return orig(tt)
    return np_dtype
