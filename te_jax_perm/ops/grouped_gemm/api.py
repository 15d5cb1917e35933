"""Grouped matrix multiplication for MoE experts: ``out[rows of group g] = lhs[rows] @ rhs[g]``.

The rows of ``lhs`` are grouped contiguously (group ``g`` holds the next
``group_sizes[g]`` rows), which is exactly the layout ``token_dispatch`` produces with
``tokens_per_expert`` as the group sizes (padded counts when ``align_size`` is set).

Three implementations, one result:

* ``"triton"``: our Triton grouped GEMM (:mod:`te_jax_perm.ops.grouped_gemm.decl`): one
  launch per GEMM whose tile schedule is computed on the device from ``group_sizes``, the
  input gradient reads ``rhs`` transposed in place, the weight gradient reduces each
  group's rows. On a Hopper GPU the forward and input gradient move 128x256 tiles by TMA
  where they fit (:func:`~te_jax_perm.ops.grouped_gemm.decl.mm_for`), and the weight
  gradient of 16-bit operands is warp-specialised
  (:func:`~te_jax_perm.ops.grouped_gemm.decl.wgrad_for`).
  Runs on the op backend in effect (``triton`` on GPUs); :func:`grouped_gemm_triton` names
  the backend (``"interpret"`` on CPU for tests).
* ``"tokamax"``: tokamax's ``ragged_dot`` (Pallas Mosaic GPU kernels for Hopper/Blackwell,
  Pallas Triton elsewhere on GPU). A real grouped GEMM: each row tile multiplies only its
  own group's weights. Optional dependency (``pip install 'te_jax_perm[gemm]'``, Python
  3.12 or newer), imported on first use.
* ``"xla"``: ``jax.lax.ragged_dot_general``. Exact and portable; but XLA:GPU lowers it by
  materialising every group (a masked ``[M, G, K]`` copy and one dot with a ``G*K``
  contraction), so on a GPU it costs G times the FLOPs and memory -- fine on a CPU and for
  small problems, not for real MoE sizes.

The default is ``"triton"`` on a GPU, else ``"xla"``. Every implementation runs under one
custom VJP with the three GEMMs one selector picks (below), so gradients do not depend on
an implementation's own rules: ``dlhs = dout @ rhs[g]^T`` per group (a
grouped GEMM with ``rhs`` transposed) and ``drhs[g] = lhs[rows of g]^T @ dout[rows of g]``
(a grouped GEMM whose contraction is ragged). ``"xla"``, ``"tokamax"`` and the kernels'
``xla`` backend compute the same pure-JAX GEMMs (:mod:`te_jax_perm.ops.grouped_gemm.reference`).
Group sizes are clamped to ``[0, M]`` and their running sum to ``M``; rows past the groups
give zeros in the output and in ``dlhs`` and add nothing to ``drhs``, whatever they hold.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp

from te_jax_perm.core import env, resolve_backend
from te_jax_perm.core.launch import bind_dims
from te_jax_perm.core.manual_axes import like_primal
from te_jax_perm.ops import _checks
from te_jax_perm.ops.grouped_gemm import decl as D
from te_jax_perm.ops.grouped_gemm import reference as R
from te_jax_perm.ops.grouped_gemm.reference import RaggedDot

IMPLS = ("triton", "tokamax", "xla")
# The operand dtypes our grouped GEMM kernels compile for.
KERNEL_DTYPES = frozenset(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


@_checks.keyword_only
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   preferred_element_type: Any = None, impl: str | None = None) -> jax.Array:
    """Multiplies each contiguous group of ``lhs`` rows by its own matrix of ``rhs``.

    Args:
      lhs: ``[M, K]`` rows, grouped: group ``g`` is rows ``sum(group_sizes[:g]) ..`` (next
        ``group_sizes[g]``). Rows past ``sum(group_sizes)`` are ignored.
      rhs: ``[G, K, N]`` one matrix per group (expert weights).
      group_sizes: ``[G]`` integer rows per group, ``sum(group_sizes) <= M`` (not checked:
        it is data; sizes are clamped to fit; concrete sizes must fit int32). Typically ``tokens_per_expert`` from
        ``token_dispatch``.
      preferred_element_type: output dtype (default: the promoted input dtype);
        accumulation is float32 either way.
      impl: ``"triton"``, ``"tokamax"``, ``"xla"`` (any case) or ``None``
        (``te_jax_perm.ops.grouped_gemm.api.default_impl`` for these dtypes: ``"triton"``
        on a GPU for equal bfloat16, float16 or float32 operands, else ``"xla"``).

    Returns:
      ``[M, N]``; rows past ``sum(group_sizes)`` are zero. Differentiable in ``lhs`` and
      ``rhs``.
    """
    lhs, rhs, group_sizes = _operands(lhs, rhs, group_sizes)
    impl = default_impl(lhs.dtype, rhs.dtype) if impl is None else impl.lower() if isinstance(impl, str) else impl
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS} or None")
    if impl == "tokamax":
        _tokamax()  # fail here, with the install hint, rather than inside the VJP trace
    out_dtype = _out_dtype(preferred_element_type) if preferred_element_type is not None else \
        jnp.result_type(lhs.dtype, rhs.dtype)
    if impl == "triton":
        # Our kernels take one operand dtype, and run on the op backend in effect. Mixed
        # operands are promoted (bf16 lhs with fp32 rhs computes in fp32), never rounded to
        # lhs's dtype; the casts sit outside the VJP, so each gradient keeps its operand's dtype.
        dt = jnp.result_type(lhs.dtype, rhs.dtype)
        if dt not in KERNEL_DTYPES:
            raise TypeError(f"impl='triton' computes in float16, bfloat16 or float32; lhs has dtype {lhs.dtype} "
                            f"and rhs {rhs.dtype}, which promote to {dt}; use impl='xla' for these dtypes")
        lhs, rhs, impl = lhs.astype(dt), rhs.astype(dt), resolve_backend(None)
    return _grouped_gemm(lhs, rhs, group_sizes, impl, out_dtype)


def grouped_gemm_triton(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                        backend: str | None = None) -> jax.Array:
    """:func:`grouped_matmul` on our Triton kernels, on a named backend.

    Args:
      lhs: ``[M, K]`` float16/bfloat16/float32, rows grouped contiguously by group.
      rhs: ``[G, K, N]``, same dtype as ``lhs``.
      group_sizes: ``[G]`` integer, the rows of each group in order (may be traced). Sizes
        are clamped to ``[0, M]`` and their running sum to ``M``.
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; default as for every op.

    Returns:
      ``[M, N]`` in ``lhs.dtype`` (float32 accumulation); rows past the last group are zero.
      Differentiable in ``lhs`` and ``rhs``.
    """
    lhs, rhs, group_sizes = _operands(lhs, rhs, group_sizes)
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"lhs has dtype {lhs.dtype} but rhs has {rhs.dtype}; expected equal dtypes")
    return _grouped_gemm(lhs, rhs, group_sizes, resolve_backend(backend), lhs.dtype)


def default_impl(lhs_dtype: Any = jnp.bfloat16, rhs_dtype: Any = jnp.bfloat16) -> str:
    """``"triton"`` on a GPU for equal bf16/fp16/fp32 operands (measured 2-4x faster than
    tokamax's ragged_dot and 4-30x faster than XLA's ``ragged_dot`` at MoE sizes on an
    H100), else ``"xla"``."""
    if jnp.dtype(lhs_dtype) not in KERNEL_DTYPES or jnp.dtype(rhs_dtype) != jnp.dtype(lhs_dtype):
        return "xla"
    return "triton" if jax.default_backend() == "gpu" else "xla"


def tokamax_available() -> bool:
    try:
        _tokamax()
    except ImportError:
        return False
    return True


# tokamax 0.0.17 needs jax >= 0.11.1, released for Python 3.12 and newer only (the `gemm`
# extra in pyproject.toml carries the same marker).
TOKAMAX_PYTHON = (3, 12)


def tokamax_install_hint(python: tuple[int, ...] = tuple(sys.version_info[:2])) -> str:
    """How to get tokamax on this Python, or why it cannot be had."""
    if tuple(python[:2]) < TOKAMAX_PYTHON:
        return (f"it needs Python {'.'.join(map(str, TOKAMAX_PYTHON))} or newer, and this is Python "
                f"{'.'.join(map(str, python[:2]))} (where the 'gemm' extra installs nothing); use impl='triton' "
                "or impl='xla' here")
    return "pip install 'te_jax_perm[gemm]'"


# -- implementation ------------------------------------------------------------------------
def _operands(lhs: Any, rhs: Any, group_sizes: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The one input check of both entry points: ``(lhs, rhs, group_sizes int32)``."""
    # group_sizes as given: jnp.asarray would wrap int64 sizes past int32 before the check.
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), _checks.array_like(group_sizes)
    if lhs.ndim != 2:
        raise ValueError(f"lhs has shape {tuple(lhs.shape)}; expected [M, K]")
    if rhs.ndim != 3:
        raise ValueError(f"rhs has shape {tuple(rhs.shape)}; expected [G, K, N] (one [K, N] matrix per group)")
    if rhs.shape[1] != lhs.shape[1]:
        raise ValueError(f"rhs has shape {tuple(rhs.shape)}; expected [G, {lhs.shape[1]}, N] "
                         f"(K = {lhs.shape[1]} from lhs {tuple(lhs.shape)})")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"group_sizes has shape {tuple(group_sizes.shape)}; expected ({rhs.shape[0]},) "
                         f"(G from rhs {tuple(rhs.shape)})")
    _checks.check_index_values("group_sizes", group_sizes)
    return lhs, rhs, jnp.asarray(group_sizes).astype(jnp.int32)


def _out_dtype(preferred_element_type: Any) -> jnp.dtype:
    """``preferred_element_type`` as a dtype, or an error naming it (NumPy's names nothing)."""
    try:
        return jnp.dtype(preferred_element_type)
    except TypeError as e:
        raise TypeError(f"preferred_element_type={preferred_element_type!r} is not a dtype ({e}); expected e.g. "
                        "jnp.float32 or None") from e


@functools.lru_cache(maxsize=None)
def _tokamax():
    try:
        with env.triton_cache_dir_kept():  # tokamax imports jax-triton, which blanks it
            import tokamax
    except ImportError as e:
        raise ImportError(f"grouped_matmul(impl='tokamax') needs tokamax: {tokamax_install_hint()} ({e})") from e
    return tokamax


def _tokamax_dot(a, b, group_sizes, dims, out_dtype):
    # Mosaic GPU first, then tokamax's Pallas Triton kernel; never its densifying XLA path.
    return _tokamax().ragged_dot_general(a, b, group_sizes, dims, preferred_element_type=out_dtype,
                                         implementation=("mosaic", "triton"))


Gemm = Callable[[jax.Array, jax.Array, jax.Array, Any], jax.Array]


def gemms(impl: str) -> tuple[Gemm, Gemm, Gemm]:
    """The selector: the forward, input-gradient and weight-gradient GEMMs of ``impl``, each
    ``(a, b, group_sizes, out_dtype) -> out``. ``"xla"`` and ``"tokamax"`` are the pure-JAX
    references over that ragged dot; a kernel backend (``"triton"``, ``"interpret"``) runs
    the declared kernels, whose result has ``a``'s dtype."""
    if impl in ("xla", "tokamax"):
        dot: RaggedDot = R.xla_ragged_dot if impl == "xla" else _tokamax_dot
        return tuple(functools.partial(f, dot=dot) for f in (
            R.grouped_gemm_reference, R.grouped_gemm_rhs_t_reference, R.grouped_gemm_wgrad_reference))

    def kernel(pick: Callable[[jax.Array, jax.Array, jax.Array, dict], Any]) -> Gemm:
        def gemm(a, b, group_sizes, out_dtype):
            params = {"elem_bytes": a.dtype.itemsize}
            prim = pick(a, b, group_sizes, params)
            return prim(a, b, group_sizes, backend=impl, **params)[0].astype(out_dtype)
        return gemm

    def row_tile(trans_rhs: bool):
        base = D.grouped_gemm_rhs_t if trans_rhs else D.grouped_gemm
        return lambda a, b, group_sizes, params: D.mm_for(impl, trans_rhs, bind_dims(base.decl, [a, b, group_sizes]),
                                                          params)

    def wgrad(a, b, group_sizes, params):
        return D.wgrad_for(impl, bind_dims(D.grouped_gemm_wgrad.decl, [a, b, group_sizes]), params)
    return kernel(row_tile(False)), kernel(row_tile(True)), kernel(wgrad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, impl: str, out_dtype: Any) -> jax.Array:
    return gemms(impl)[0](lhs, rhs, group_sizes, out_dtype)


def _fwd(lhs, rhs, group_sizes, impl, out_dtype):
    return _grouped_gemm(lhs, rhs, group_sizes, impl, out_dtype), (lhs, rhs, group_sizes)


def _bwd(impl, out_dtype, res, dout):
    del out_dtype
    lhs, rhs, group_sizes = res
    _, dgrad, wgrad = gemms(impl)
    dlhs = dgrad(dout.astype(rhs.dtype), rhs, group_sizes, lhs.dtype)
    drhs = wgrad(lhs, dout.astype(lhs.dtype), group_sizes, rhs.dtype)
    # group_sizes is an integer input: its cotangent is symbolic zero.
    return like_primal(dlhs, lhs), like_primal(drhs, rhs), None


_grouped_gemm.defvjp(_fwd, _bwd)
