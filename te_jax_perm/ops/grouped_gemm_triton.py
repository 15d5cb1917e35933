"""``grouped_gemm_triton``: the MoE expert matmul as a Triton grouped GEMM, with its VJP.

``lhs [M, K]`` holds rows grouped by expert (``token_dispatch``'s output layout),
``rhs [G, K, N]`` one matrix per expert, ``group_sizes [G]`` int32 the rows of each expert
(``tokens_per_expert``). Unlike XLA:GPU's ``lax.ragged_dot`` lowering, nothing is densified:
each expert's rows are multiplied by its matrix only, in one launch whose tile schedule is
computed on the device from ``group_sizes``.

Semantics (all backends): group sizes are clamped to ``[0, M]`` and their running sum to
``M``; rows past the last group give zero rows; the result has ``lhs``'s dtype and is
accumulated in float32. The ``xla`` backend is ``lax.ragged_dot`` on the clamped sizes.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import triton

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare
from te_jax_perm.kernels.grouped_gemm import grouped_gemm_kernel, grouped_gemm_wgrad_kernel

_FLOATS = ("float16", "bfloat16", "float32")
# Hopper has 227 KiB of shared memory per block; leave room for the epilogue.
_SMEM_BYTES = 200 * 1024


def clamped_group_sizes(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group sizes every backend actually uses: each in [0, rows], their sum <= rows."""
    sizes = jnp.clip(group_sizes.astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.int32), 0, rows)
    ends = jnp.minimum(jnp.cumsum(sizes), rows)
    return jnp.diff(ends, prepend=0).astype(jnp.int32)


def _ragged_dot(lhs, rhs, group_sizes):
    sizes = clamped_group_sizes(group_sizes, lhs.shape[0])
    return jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32).astype(lhs.dtype)


def grouped_gemm_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Pure-JAX ``grouped_gemm``: ``lhs [M,K]``, ``rhs [G,K,N]`` -> ``[M,N]``."""
    return _ragged_dot(lhs, rhs, group_sizes)


def grouped_gemm_rhs_t_reference(dout: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Pure-JAX input gradient: ``dout [M,N]`` times each ``rhs[g].T`` -> ``[M,K]``."""
    return _ragged_dot(dout, jnp.swapaxes(rhs, 1, 2), group_sizes)


def grouped_gemm_wgrad_reference(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array,
                                 num_groups: int) -> jax.Array:
    """Pure-JAX weight gradient: ``out[g] = lhs[rows of g].T @ dout[rows of g]`` -> ``[G,K,N]``."""
    sizes = clamped_group_sizes(group_sizes, lhs.shape[0])
    rhs0 = jnp.zeros((num_groups, lhs.shape[1], dout.shape[1]), jnp.float32)
    _, vjp = jax.vjp(lambda r: jax.lax.ragged_dot(lhs.astype(jnp.float32), r, sizes), rhs0)
    (grad,) = vjp(dout.astype(jnp.float32))
    return grad.astype(lhs.dtype)


def _smem_fits(tile_elems: int, stages: int, elem_bytes: int) -> bool:
    return tile_elems * stages * elem_bytes <= _SMEM_BYTES


def _mm_fits(dims, params, config: Config) -> str | None:
    kw = config.kw
    need = (kw["BM"] * kw["BK"] + kw["BK"] * kw["BN"])
    if not _smem_fits(need, config.num_stages, params["elem_bytes"]):
        return f"{need} elements x {config.num_stages} stages exceed shared memory"
    return None


def _wgrad_fits(dims, params, config: Config) -> str | None:
    kw = config.kw
    need = kw["BR"] * (kw["BK"] + kw["BN"])
    if not _smem_fits(need, config.num_stages, params["elem_bytes"]):
        return f"{need} elements x {config.num_stages} stages exceed shared memory"
    return None


def _stages(tile_elems: int, most: int, params) -> int:
    """Pipeline stages for a tile of ``tile_elems`` per stage: ``most``, or fewer where that
    many would not fit in shared memory (fp32 operands take twice the bytes of 16-bit ones)."""
    return max([s for s in range(1, most + 1) if _smem_fits(tile_elems, s, params["elem_bytes"])] or [1])


def _mm_default(dims, params) -> Config:
    # 128x256 tiles with 8 warps keep Hopper's tensor cores fed when N allows; small
    # problems take 64-row tiles so that short groups waste less.
    wide = dims["D"] >= 256
    bm, bn, bk = 64 if dims["M"] <= 2048 else 128, 256 if wide else 128, 64
    return Config.make(num_warps=8, num_stages=_stages(bm * bk + bk * bn, 3 if wide else 4, params),
                       BM=bm, BN=bn, BK=bk, GROUP_M=8)


def _wgrad_default(dims, params) -> Config:
    bk, bn, br = 128, 128 if dims["N"] < 256 else 256, 64
    return Config.make(num_warps=8, num_stages=_stages(br * (bk + bn), 3, params), BK=bk, BN=bn, BR=br)


def _precision(params) -> str:
    # fp32 operands get three TF32 products (about fp32 accuracy on tensor cores): plain
    # TF32 would round the inputs to 10 mantissa bits, a silent loss a fp32 caller does not
    # expect. 16-bit operands are exact in any mode.
    return "tf32x3" if params["elem_bytes"] == 4 else "tf32"


def _g_p2(dims) -> int:
    return triton.next_power_of_2(max(dims["G"], 1))


# What both GEMM declarations share: one static param (the operand width sets the tile
# budget and the precision), rows bucketed to powers of two in tuning keys, and a tolerance
# instead of bit-exactness (float32 accumulation order differs between tilings).
_SHARED = dict(
    params=("elem_bytes",),
    scalars=lambda dims, params: {"M": dims["M"]},
    key_params=("elem_bytes",),
    key_bucket=lambda name, v: triton.next_power_of_2(v) if name == "M" else v,
    exact=False, rtol=2e-2, atol=2e-2,
)


def _mm_decl(name: str, trans_rhs: bool) -> KernelDecl:
    # Without trans_rhs: lhs [M,C] x rhs [G,C,D]; with it: lhs [M,C] x rhs [G,D,C] (used transposed).
    rhs_dims = ("G", "D", "C") if trans_rhs else ("G", "C", "D")
    reference = grouped_gemm_rhs_t_reference if trans_rhs else grouped_gemm_reference
    return KernelDecl(
        name=name,
        kernel=grouped_gemm_kernel,
        operands=(Operand("lhs", ("M", "C"), _FLOATS), Operand("rhs", rhs_dims, _FLOATS),
                  Operand("group_sizes", ("G",), ("int32",))),
        outputs=(Output("out", lambda dims, params: (dims["M"], dims["D"]),
                        lambda dtypes, params: dtypes["lhs"]),),
        reference=lambda lhs, rhs, group_sizes, elem_bytes: (reference(lhs, rhs, group_sizes),),
        grid=lambda dims, params, config: (
            (triton.cdiv(dims["M"], config.kw["BM"]) + dims["G"] + 1) * triton.cdiv(dims["D"], config.kw["BN"]),),
        constexprs=lambda dims, params, config: {"C": dims["C"], "D": dims["D"], "G": dims["G"],
                                                  "G_P2": _g_p2(dims), "TRANS_RHS": trans_rhs,
                                                  "PRECISION": _precision(params)},
        configs=tuple(Config.make(num_warps=w, num_stages=s, BM=bm, BN=bn, BK=bk, GROUP_M=8)
                      for bm in (64, 128) for bn in (128, 256) for bk in (64, 128)
                      for w in (4, 8) for s in (3, 4)),
        constraints=(_mm_fits,),
        key_dims=("M", "C", "D", "G"),
        default_config=_mm_default,
        **_SHARED,
    )


_grouped_gemm = declare(_mm_decl("grouped_gemm", trans_rhs=False))
_grouped_gemm_rhs_t = declare(_mm_decl("grouped_gemm_rhs_t", trans_rhs=True))

_grouped_gemm_wgrad = declare(KernelDecl(
    name="grouped_gemm_wgrad",
    kernel=grouped_gemm_wgrad_kernel,
    operands=(Operand("lhs", ("M", "K"), _FLOATS), Operand("dout", ("M", "N"), _FLOATS),
              Operand("group_sizes", ("G",), ("int32",))),
    outputs=(Output("out", lambda dims, params: (dims["G"], dims["K"], dims["N"]),
                    lambda dtypes, params: dtypes["lhs"]),),
    reference=lambda lhs, dout, group_sizes, elem_bytes: (
        grouped_gemm_wgrad_reference(lhs, dout, group_sizes, group_sizes.shape[0]),),
    grid=lambda dims, params, config: (
        dims["G"] * triton.cdiv(dims["K"], config.kw["BK"]) * triton.cdiv(dims["N"], config.kw["BN"]),),
    constexprs=lambda dims, params, config: {"K": dims["K"], "N": dims["N"], "G": dims["G"],
                                              "G_P2": _g_p2(dims), "PRECISION": _precision(params)},
    configs=tuple(Config.make(num_warps=w, num_stages=s, BK=bk, BN=bn, BR=br)
                  for bk in (64, 128) for bn in (128, 256) for br in (32, 64)
                  for w in (4, 8) for s in (3, 4)),
    constraints=(_wgrad_fits,),
    key_dims=("M", "K", "N", "G"),
    default_config=_wgrad_default,
    **_SHARED,
))


def _check(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> None:
    if lhs.ndim != 2 or rhs.ndim != 3 or group_sizes.ndim != 1:
        raise ValueError(f"grouped_gemm_triton: expected lhs [M,K], rhs [G,K,N], group_sizes [G]; got lhs "
                         f"{lhs.shape}, rhs {rhs.shape}, group_sizes {group_sizes.shape}")
    if rhs.shape[1] != lhs.shape[1] or rhs.shape[0] != group_sizes.shape[0]:
        raise ValueError(f"grouped_gemm_triton: rhs has shape {rhs.shape}; expected (G={group_sizes.shape[0]}, "
                         f"K={lhs.shape[1]}, N) to match group_sizes {group_sizes.shape} and lhs {lhs.shape}")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"grouped_gemm_triton: lhs has dtype {lhs.dtype} but rhs has {rhs.dtype}; expected equal dtypes")


def grouped_gemm_triton(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                 backend: str | None = None) -> jax.Array:
    """Grouped matmul: ``out[rows of g] = lhs[rows of g] @ rhs[g]``.

    Args:
      lhs: ``[M, K]`` float16/bfloat16/float32, rows grouped contiguously by group.
      rhs: ``[G, K, N]``, same dtype as ``lhs``.
      group_sizes: ``[G]`` int32, the rows of each group in order (may be traced). Sizes
        are clamped to ``[0, M]`` and their running sum to ``M``.
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; default as for every op.

    Returns:
      ``[M, N]`` in ``lhs.dtype`` (float32 accumulation); rows past the last group are zero.
      Differentiable in ``lhs`` and ``rhs``.
    """
    lhs, rhs, group_sizes = jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(group_sizes)
    _check(lhs, rhs, group_sizes)
    return _grouped_gemm_vjp(lhs, rhs, group_sizes.astype(jnp.int32), backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_gemm_vjp(lhs, rhs, group_sizes, backend):
    return _fwd_only(lhs, rhs, group_sizes, backend)


def _fwd_only(lhs, rhs, group_sizes, backend):
    (out,) = _grouped_gemm(lhs, rhs, group_sizes, backend=backend, elem_bytes=lhs.dtype.itemsize)
    return out


def _fwd(lhs, rhs, group_sizes, backend):
    return _fwd_only(lhs, rhs, group_sizes, backend), (lhs, rhs, group_sizes)


def _bwd(backend, res, dout):
    lhs, rhs, group_sizes = res
    dout = dout.astype(lhs.dtype)
    nbytes = lhs.dtype.itemsize
    (dlhs,) = _grouped_gemm_rhs_t(dout, rhs, group_sizes, backend=backend, elem_bytes=nbytes)
    (drhs,) = _grouped_gemm_wgrad(lhs, dout, group_sizes, backend=backend, elem_bytes=nbytes)
    return dlhs, drhs, None


_grouped_gemm_vjp.defvjp(_fwd, _bwd)
