"""Grouped matrix multiplication for MoE experts: ``out[rows of group g] = lhs[rows] @ rhs[g]``.

The rows of ``lhs`` are grouped contiguously (group ``g`` holds the next
``group_sizes[g]`` rows), which is exactly the layout ``token_dispatch`` produces with
``tokens_per_expert`` as the group sizes (padded counts when ``align_size`` is set).

``backend=`` picks the implementation, as for every op, with one more name; one result:

* ``"triton"`` / ``"interpret"``: our Triton grouped GEMM
  (:mod:`te_jax_perm.ops.grouped_gemm.decl`) compiled for the GPU / in Triton's interpreter
  on the CPU: one launch per GEMM whose tile schedule is computed on the device from
  ``group_sizes``, the input gradient reads ``rhs`` transposed in place, the weight gradient
  reduces each group's rows. On a Hopper GPU the forward and input gradient move 128x256
  tiles by TMA where they fit (:func:`~te_jax_perm.ops.grouped_gemm.decl.mm_for`), and the
  weight gradient of 16-bit operands is warp-specialised
  (:func:`~te_jax_perm.ops.grouped_gemm.decl.wgrad_for`). The kernels compute in float16,
  bfloat16 or float32.
* ``"xla"``: ``jax.lax.ragged_dot_general``, any dtype. Exact and portable; but XLA:GPU
  lowers it by materialising every group (a masked ``[M, G, K]`` copy and one dot with a
  ``G*K`` contraction), so on a GPU it costs G times the FLOPs and memory -- fine on a CPU
  and for small problems, not for real MoE sizes.
* ``"tokamax"``: tokamax's ``ragged_dot`` (Pallas Mosaic GPU kernels for Hopper/Blackwell,
  Pallas Triton elsewhere on GPU). A real grouped GEMM: each row tile multiplies only its
  own group's weights. Optional dependency (``pip install 'te_jax_perm[gemm]'``, Python
  3.12 or newer), imported on first use.

The default is the op backend in effect (:func:`te_jax_perm.resolve_backend`: ``"triton"``
on a GPU, else ``"xla"``, unless :func:`te_jax_perm.use_backend` or ``TE_JAX_PERM_BACKEND``
says otherwise), or ``"xla"`` for operands the kernels do not compute in. Every
implementation runs under one custom VJP with the three GEMMs one selector picks (below), so
gradients do not depend on an implementation's own rules: ``dlhs = dout @ rhs[g]^T`` per group
(a grouped GEMM with ``rhs`` transposed) and ``drhs[g] = lhs[rows of g]^T @ dout[rows of g]``
(a grouped GEMM whose contraction is ragged). ``"xla"`` and ``"tokamax"`` compute the same
pure-JAX GEMMs (:mod:`te_jax_perm.ops.grouped_gemm.reference`).
Group sizes are clamped to ``[0, M]`` and their running sum to ``M``; rows past the groups
give zeros in the output and in ``dlhs`` and add nothing to ``drhs``, whatever they hold.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp

from te_jax_perm.core import BACKENDS as OP_BACKENDS
from te_jax_perm.core import check_backend_name, env, resolve_backend
from te_jax_perm.core.launch import bind_dims
from te_jax_perm.core.manual_axes import like_primal
from te_jax_perm import _checks
from te_jax_perm.ops.grouped_gemm import decl as D
from te_jax_perm.ops.grouped_gemm import reference as R
from te_jax_perm.ops.grouped_gemm.reference import RaggedDot

# The names ``grouped_matmul(backend=...)`` accepts: the op backends, and tokamax's ragged dot.
BACKENDS = (*OP_BACKENDS, "tokamax")
# The op backends that run our kernels; every other name runs a pure-JAX ragged dot.
KERNEL_BACKENDS = tuple(b for b in OP_BACKENDS if b != "xla")
# The operand dtypes our grouped GEMM kernels compile for.
KERNEL_DTYPES = frozenset(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))


@_checks.keyword_only(backends=BACKENDS)
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   preferred_element_type: Any = None, backend: str | None = None) -> jax.Array:
    """Multiplies each contiguous group of ``lhs`` rows by its own matrix of ``rhs``.

    Args:
      lhs: ``[M, K]`` rows, grouped: group ``g`` is rows ``sum(group_sizes[:g]) ..`` (next
        ``group_sizes[g]``). Rows past ``sum(group_sizes)`` are ignored.
      rhs: ``[G, K, N]`` one matrix per group (expert weights).
      group_sizes: ``[G]`` integer rows per group, ``sum(group_sizes) <= M`` (not checked:
        it is data; sizes are clamped to fit; concrete sizes must fit int32). Typically ``tokens_per_expert`` from
        ``token_dispatch``.
      preferred_element_type: output dtype (default: the promoted input dtype);
        accumulation is float32 either way, and every backend converts the float32
        accumulator to it once (a float32 result of bfloat16 operands is not rounded to
        bfloat16 on the way).
      backend: ``"triton"``, ``"interpret"``, ``"xla"``, ``"tokamax"`` (any case) or
        ``None``: the op backend in effect (:func:`te_jax_perm.resolve_backend`), or
        ``"xla"`` where that runs our kernels and ``lhs`` and ``rhs`` promote to a dtype
        other than float16, bfloat16 or float32. Our kernels (``"triton"``,
        ``"interpret"``) compute in the promoted dtype (bfloat16 ``lhs`` with float32 ``rhs``
        computes in float32) and raise ``TypeError`` for any other when named here.

    Returns:
      ``[M, N]``; rows past ``sum(group_sizes)`` are zero. Differentiable in ``lhs`` and
      ``rhs``; each gradient has its operand's dtype.
    """
    lhs, rhs, group_sizes = _operands(lhs, rhs, group_sizes)
    dt = _operand_dtype(lhs.dtype, rhs.dtype)
    out_dtype = _out_dtype(preferred_element_type) if preferred_element_type is not None else dt
    backend = _chosen_backend(backend, lhs.dtype, rhs.dtype)
    if backend in KERNEL_BACKENDS:
        # Our kernels take one operand dtype. Mixed operands are promoted, never rounded to
        # lhs's dtype; the casts sit outside the VJP, so each gradient keeps its operand's dtype.
        lhs, rhs = lhs.astype(dt), rhs.astype(dt)
    return _grouped_gemm(lhs, rhs, group_sizes, backend, out_dtype)


def _operand_dtype(lhs_dtype: Any, rhs_dtype: Any) -> jnp.dtype:
    """The dtype both operands promote to, or an error naming both (JAX promotes float8
    with no other dtype, and its error names neither operand)."""
    try:
        return jnp.result_type(lhs_dtype, rhs_dtype)
    except jax.dtypes.TypePromotionError as e:
        raise TypeError(f"lhs has dtype {jnp.dtype(lhs_dtype).name} and rhs {jnp.dtype(rhs_dtype).name}, which JAX "
                        f"does not promote to one dtype ({e}); expected operands of one dtype, or dtypes that "
                        "promote") from None


def _chosen_backend(backend: str | None, lhs_dtype: Any, rhs_dtype: Any) -> str:
    """The implementation ``grouped_matmul`` runs for ``backend=``, checked here, before
    tracing: an unknown name, a backend unavailable here, missing tokamax, or a named kernel
    backend for dtypes it has no kernel for."""
    dt = _operand_dtype(lhs_dtype, rhs_dtype)
    if backend is None:
        chosen = resolve_backend(None)
        # Nobody asked for the kernels: dtypes they do not compute in take XLA's ragged dot.
        return "xla" if chosen in KERNEL_BACKENDS and dt not in KERNEL_DTYPES else chosen
    name = check_backend_name(backend, BACKENDS, optional=True)
    if name == "tokamax":
        _tokamax()  # fail here, with the install hint, rather than inside the VJP trace
        return name
    if name in KERNEL_BACKENDS and dt not in KERNEL_DTYPES:
        raise TypeError(f"backend={name!r} computes in float16, bfloat16 or float32; lhs has dtype "
                        f"{jnp.dtype(lhs_dtype)} and rhs {jnp.dtype(rhs_dtype)}, which promote to {dt}; "
                        "use backend='xla' for these dtypes")
    return resolve_backend(name)


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
                f"{'.'.join(map(str, python[:2]))} (where the 'gemm' extra installs nothing); use backend='triton' "
                "or backend='xla' here")
    return "pip install 'te_jax_perm[gemm]'"


# -- implementation ------------------------------------------------------------------------
def _operands(lhs: Any, rhs: Any, group_sizes: Any) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``grouped_matmul``'s input check: ``(lhs, rhs, group_sizes int32)``."""
    # group_sizes as given: jnp.asarray would wrap int64 sizes past int32 before the check.
    lhs, rhs = _checks.array("lhs", lhs), _checks.array("rhs", rhs)
    group_sizes = _checks.array_like("group_sizes", group_sizes)
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
    """``preferred_element_type`` as a dtype JAX computes in (64-bit ones are 32-bit unless
    ``jax_enable_x64`` is on, as ``jnp.dot`` takes them: XLA's ragged dot would otherwise
    fail to lower on a 64-bit result it computed in 32 bits), or an error naming it (NumPy's
    names nothing)."""
    if hasattr(preferred_element_type, "shape") and not isinstance(preferred_element_type, (type, jnp.dtype)):
        # NumPy reads an array (or a scalar) as its dtype: an array passed here by mistake
        # would set the result dtype without a word.
        raise TypeError(f"preferred_element_type is {type(preferred_element_type).__name__} of shape "
                        f"{tuple(preferred_element_type.shape)}, not a dtype; expected e.g. jnp.float32 or None")
    try:
        return jax.dtypes.canonicalize_dtype(jnp.dtype(preferred_element_type))
    except TypeError as e:
        raise TypeError(f"preferred_element_type={preferred_element_type!r} is not a dtype ({e}); expected e.g. "
                        "jnp.float32 or None") from e


@functools.lru_cache(maxsize=None)
def _tokamax():
    try:
        with env.triton_cache_dir_kept():  # tokamax imports jax-triton, which blanks it
            import tokamax
    except ImportError as e:
        raise ImportError(f"grouped_matmul(backend='tokamax') needs tokamax: {tokamax_install_hint()} ({e})") from e
    return tokamax


def _tokamax_dot(a, b, group_sizes, dims, out_dtype):
    # Mosaic GPU first, then tokamax's Pallas Triton kernel; never its densifying XLA path.
    return _tokamax().ragged_dot_general(a, b, group_sizes, dims, preferred_element_type=out_dtype,
                                         implementation=("mosaic", "triton"))


Gemm = Callable[[jax.Array, jax.Array, jax.Array, Any], jax.Array]


def gemms(backend: str) -> tuple[Gemm, Gemm, Gemm]:
    """The selector: the forward, input-gradient and weight-gradient GEMMs of ``backend``, each
    ``(a, b, group_sizes, out_dtype) -> out``. ``"xla"`` and ``"tokamax"`` are the pure-JAX
    references over that ragged dot; a kernel backend (``"triton"``, ``"interpret"``) runs
    the declared kernels: the row-tile ones store their float32 accumulator in
    ``out_dtype`` (where it is one of theirs), the weight gradient in ``a``'s dtype."""
    if backend in ("xla", "tokamax"):
        dot: RaggedDot = R.xla_ragged_dot if backend == "xla" else _tokamax_dot
        return tuple(functools.partial(f, dot=dot) for f in (
            R.grouped_gemm_reference, R.grouped_gemm_rhs_t_reference, R.grouped_gemm_wgrad_reference))

    def kernel(pick: Callable[[jax.Array, jax.Array, jax.Array, dict], Any], stores_out_dtype: bool) -> Gemm:
        def gemm(a, b, group_sizes, out_dtype):
            params = {"elem_bytes": a.dtype.itemsize}
            if stores_out_dtype:
                # Another dtype (float8, say) is converted from the stored float32
                # accumulator: rounded once, as the xla backend rounds it.
                wanted = jnp.dtype(out_dtype)
                params["out_dtype"] = (wanted if wanted in KERNEL_DTYPES else jnp.dtype(jnp.float32)).name
            prim = pick(a, b, group_sizes, params)
            # The kernels have no derivative rules: a gradient differentiated again is
            # refused by name (the xla and tokamax GEMMs above take grad of grad).
            return _checks.first_order("grouped_matmul", lambda a, b, s: prim(a, b, s, backend=backend, **params)[0])(
                a, b, group_sizes).astype(out_dtype)
        return gemm

    def row_tile(trans_rhs: bool):
        return lambda a, b, group_sizes, params: D.mm_for(backend, trans_rhs)

    def wgrad(a, b, group_sizes, params):
        return D.wgrad_for(backend, bind_dims(D.grouped_gemm_wgrad.decl, [a, b, group_sizes]), params)
    # The row-tile kernels store the float32 accumulator in the dtype asked for; the weight
    # gradient's result always has its operands' dtype.
    return kernel(row_tile(False), True), kernel(row_tile(True), True), kernel(wgrad, False)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped_gemm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, backend: str, out_dtype: Any) -> jax.Array:
    return gemms(backend)[0](lhs, rhs, group_sizes, out_dtype)


def _fwd(lhs, rhs, group_sizes, backend, out_dtype):
    return _grouped_gemm(lhs, rhs, group_sizes, backend, out_dtype), (lhs, rhs, group_sizes)


def _bwd(backend, out_dtype, res, dout):
    del out_dtype
    lhs, rhs, group_sizes = res
    _, dgrad, wgrad = gemms(backend)
    dlhs = dgrad(dout.astype(rhs.dtype), rhs, group_sizes, lhs.dtype)
    drhs = wgrad(lhs, dout.astype(lhs.dtype), group_sizes, rhs.dtype)
    # group_sizes is an integer input: its cotangent is symbolic zero.
    return like_primal(dlhs, lhs), like_primal(drhs, rhs), None


_grouped_gemm.defvjp(_fwd, _bwd)
