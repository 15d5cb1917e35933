"""Grouped matrix multiplication for MoE experts: ``out[rows of group g] = lhs[rows] @ rhs[g]``.

The rows of ``lhs`` are grouped contiguously (group ``g`` holds the next
``group_sizes[g]`` rows), which is exactly the layout ``token_dispatch`` produces with
``tokens_per_expert`` as the group sizes (padded counts when ``align_size`` is set).

Three implementations, one result:

* ``"triton"``: our Triton grouped GEMM (:mod:`te_jax_perm.ops.grouped_gemm_triton`): one
  launch per GEMM whose tile schedule is computed on the device from ``group_sizes``, the
  input gradient reads ``rhs`` transposed in place, the weight gradient reduces each
  group's rows. Runs on the ``triton`` backend on GPUs (``interpret`` on CPU for tests).
* ``"tokamax"``: tokamax's ``ragged_dot`` (Pallas Mosaic GPU kernels for Hopper/Blackwell,
  Pallas Triton elsewhere on GPU). A real grouped GEMM: each row tile multiplies only its
  own group's weights. Optional dependency (``pip install 'te_jax_perm[gemm]'``, Python
  3.12 or newer), imported on first use.
* ``"xla"``: ``jax.lax.ragged_dot_general``. Exact and portable; but XLA:GPU lowers it by
  materialising every group (a masked ``[M, G, K]`` copy and one dot with a ``G*K``
  contraction), so on a GPU it costs G times the FLOPs and memory -- fine on a CPU and for
  small problems, not for real MoE sizes.

The default is ``"triton"`` on a GPU, else ``"xla"``. ``"tokamax"`` and ``"xla"`` run under
the same custom VJP (below), so gradients do not depend on the implementation's own rules:
``dlhs = dout @ rhs[g]^T`` per group (a grouped GEMM with ``rhs`` transposed) and
``drhs[g] = lhs[rows of g]^T @ dout[rows of g]`` (a grouped GEMM whose contraction is ragged).
Rows past ``sum(group_sizes)`` give zeros in the output and in ``dlhs`` and add nothing to
``drhs``, whatever they hold.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from te_jax_perm.core import env

IMPLS = ("triton", "tokamax", "xla")

# lhs [M, K] x rhs [G, K, N] -> [M, N], lhs rows ragged over the groups of rhs.
_DIMS_FWD = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
# dout [M, N] x rhs [G, K, N] -> [M, K]: the same grouping, rhs contracted over N.
_DIMS_TRANS_RHS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
# lhs [M, K] x dout [M, N] -> [G, K, N]: the contraction over M is ragged, one result per group.
_DIMS_RAGGED_CONTRACT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   preferred_element_type: Any = None, impl: str | None = None) -> jax.Array:
    """Multiplies each contiguous group of ``lhs`` rows by its own matrix of ``rhs``.

    Args:
      lhs: ``[M, K]`` rows, grouped: group ``g`` is rows ``sum(group_sizes[:g]) ..`` (next
        ``group_sizes[g]``). Rows past ``sum(group_sizes)`` are ignored.
      rhs: ``[G, K, N]`` one matrix per group (expert weights).
      group_sizes: ``[G]`` integer rows per group, ``sum(group_sizes) <= M`` (not checked:
        it is data). Typically ``tokens_per_expert`` from ``token_dispatch``.
      preferred_element_type: output dtype (default: the promoted input dtype);
        accumulation is float32 either way.
      impl: ``"triton"``, ``"tokamax"``, ``"xla"`` or ``None`` (:func:`default_impl` for
        these dtypes).

    Returns:
      ``[M, N]``; rows past ``sum(group_sizes)`` are zero. Differentiable in ``lhs`` and
      ``rhs``.
    """
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    _check(lhs, rhs, group_sizes)
    impl = default_impl(lhs.dtype, rhs.dtype) if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; expected one of {IMPLS} or None")
    if impl == "tokamax":
        _tokamax()  # fail here, with the install hint, rather than inside the VJP trace
    out_dtype = jnp.dtype(preferred_element_type) if preferred_element_type is not None else \
        jnp.result_type(lhs.dtype, rhs.dtype)
    if impl == "triton":
        from te_jax_perm.ops.grouped_gemm_triton import grouped_gemm_triton
        out = grouped_gemm_triton(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32))
        return out.astype(out_dtype)
    return _grouped_matmul(impl, out_dtype, lhs, rhs, group_sizes.astype(jnp.int32))


def grouped_matmul_reference(lhs: np.ndarray, rhs: np.ndarray, group_sizes: np.ndarray) -> np.ndarray:
    """NumPy float64 reference: one plain matmul per group, zeros past the groups."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, n in enumerate(np.asarray(group_sizes)):
        out[start:start + n] = lhs[start:start + n] @ rhs[g]
        start += int(n)
    return out


def default_impl(lhs_dtype: Any = jnp.bfloat16, rhs_dtype: Any = jnp.bfloat16) -> str:
    """``"triton"`` on a GPU for equal bf16/fp16/fp32 operands (measured 2-4x faster than
    tokamax's ragged_dot and 4-30x faster than XLA's ``ragged_dot`` at MoE sizes on an
    H100), else ``"xla"``."""
    floats = {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)}
    if jnp.dtype(lhs_dtype) not in floats or jnp.dtype(rhs_dtype) != jnp.dtype(lhs_dtype):
        return "xla"
    return "triton" if jax.default_backend() == "gpu" else "xla"


def tokamax_available() -> bool:
    try:
        _tokamax()
    except ImportError:
        return False
    return True


# -- implementation ------------------------------------------------------------------------
def _check(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> None:
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
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(f"group_sizes has dtype {group_sizes.dtype}; expected an integer dtype")


@functools.lru_cache(maxsize=None)
def _tokamax():
    try:
        with env.triton_cache_dir_kept():  # tokamax imports jax-triton, which blanks it
            import tokamax
    except ImportError as e:
        raise ImportError(f"grouped_matmul(impl='tokamax') needs tokamax: {tokamax_install_hint()} ({e})") from e
    return tokamax


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


def _ragged(impl: str) -> Callable[..., jax.Array]:
    """``ragged_dot_general(lhs, rhs, group_sizes, dims, out_dtype)`` of one implementation."""
    if impl == "tokamax":
        tk = _tokamax()
        # Mosaic GPU first, then tokamax's Pallas Triton kernel; never its densifying XLA path.
        return lambda a, b, gs, dims, dt: tk.ragged_dot_general(
            a, b, gs, dims, preferred_element_type=dt, implementation=("mosaic", "triton"))
    return lambda a, b, gs, dims, dt: jax.lax.ragged_dot_general(
        a, b, gs, dims, preferred_element_type=dt)


def _zero_past_groups(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), x, jnp.zeros((), x.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _grouped_matmul(impl: str, out_dtype: Any, lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array):
    out = _ragged(impl)(lhs, rhs, group_sizes, _DIMS_FWD, out_dtype)
    return _zero_past_groups(out, group_sizes)


def _fwd(impl, out_dtype, lhs, rhs, group_sizes):
    return _grouped_matmul(impl, out_dtype, lhs, rhs, group_sizes), (lhs, rhs, group_sizes)


def _bwd(impl, out_dtype, res, dout):
    del out_dtype
    lhs, rhs, group_sizes = res
    ragged = _ragged(impl)
    # Rows past the groups must not reach drhs even if an implementation read them.
    dout = _zero_past_groups(dout, group_sizes)
    dlhs = ragged(dout.astype(rhs.dtype), rhs, group_sizes, _DIMS_TRANS_RHS, lhs.dtype)
    drhs = ragged(lhs, dout.astype(lhs.dtype), group_sizes, _DIMS_RAGGED_CONTRACT, rhs.dtype)
    # group_sizes is an integer input: its cotangent is symbolic zero.
    return _zero_past_groups(dlhs, group_sizes), drhs, None


_grouped_matmul.defvjp(_fwd, _bwd)
