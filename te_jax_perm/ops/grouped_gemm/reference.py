"""Pure-JAX grouped GEMMs, the one computation of every path that is not a Triton kernel:
``grouped_matmul(backend="xla")`` (XLA's ragged dot), ``backend="tokamax"`` (the same with
tokamax's ragged dot in its place) and the kernel declarations' ``xla`` backend; and the float64 NumPy
:func:`grouped_matmul_reference` the tests hold every path to.

Semantics every path shares: group sizes are clamped to ``[0, M]`` and their running sum to
``M``; rows past the last group give zero output rows and zero input-gradient rows and add
nothing to the weight gradient, whatever they hold; floats accumulate in float32 (or wider).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

# lhs [M, K] x rhs [G, K, N] -> [M, N], lhs rows ragged over the groups of rhs.
DIMS_FWD = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
# dout [M, N] x rhs [G, K, N] -> [M, K]: the same grouping, rhs contracted over N.
DIMS_TRANS_RHS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
# lhs [M, K] x dout [M, N] -> [G, K, N]: the contraction over M is ragged, one result per group.
DIMS_RAGGED_CONTRACT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[])

# ``(a, b, group_sizes, dims, out_dtype) -> array``: one ragged dot implementation.
RaggedDot = Callable[[jax.Array, jax.Array, jax.Array, Any, Any], jax.Array]


def xla_ragged_dot(a: jax.Array, b: jax.Array, group_sizes: jax.Array, dims: Any, out_dtype: Any) -> jax.Array:
    """``lax.ragged_dot_general``, floats accumulated in at least float32 before the cast;
    under ``jax.vmap`` too, with any operand unbatched (one weight tensor shared by a
    vmapped batch) and nested (:func:`_folded`). ``group_sizes`` sum to at most the ragged
    dimension (the references clamp them)."""
    out_dtype = jnp.dtype(out_dtype)
    # Not promote_types(out_dtype, float32): JAX promotes float8 with no other dtype.
    wide = jnp.issubdtype(out_dtype, jnp.floating) and out_dtype.itemsize < 4
    acc = jnp.dtype(jnp.float32) if wide else out_dtype

    def plain(a, b, group_sizes):
        return jax.lax.ragged_dot_general(a, b, group_sizes, dims, preferred_element_type=acc).astype(out_dtype)

    # The batching rule lives on a custom_vmap, which JAX cannot transpose: the JVP (linear
    # in a and b) goes through the plain ragged dot, so gradients of a reference work too.
    @jax.custom_jvp
    @jax.custom_batching.custom_vmap
    def dot(a, b, group_sizes):
        return plain(a, b, group_sizes)

    @dot.fun.def_vmap
    def batched(axis_size, in_batched, *args):
        # XLA's own rule batches only when every operand carries the batch, and not twice.
        a, b, group_sizes = (x if is_batched else jnp.broadcast_to(x, (axis_size, *x.shape))
                             for x, is_batched in zip(args, in_batched))
        return _folded(a, b, group_sizes, dims, out_dtype), True

    @dot.defjvp
    def dot_jvp(primals, tangents):
        (a, b, group_sizes), (da, db, _) = primals, tangents
        return dot(a, b, group_sizes), plain(da, b, group_sizes) + plain(a, db, group_sizes)
    return dot(a, b, group_sizes)


def _folded(a: jax.Array, b: jax.Array, group_sizes: jax.Array, dims: Any, out_dtype: Any) -> jax.Array:
    """A batch of ragged dots (every operand with a leading batch axis) as one: the batch's
    rows laid end to end, each element's groups followed by one more, its rows past the
    groups, which multiplies zeros (or, contracted, is dropped)."""
    n, m = a.shape[:2]
    sizes = jnp.concatenate([group_sizes, m - jnp.sum(group_sizes, axis=1, keepdims=True)], axis=1).reshape(-1)
    rows = a.reshape(n * m, *a.shape[2:])
    if dims == DIMS_RAGGED_CONTRACT:  # [n, M, K] x [n, M, N] -> [n, G, K, N]
        out = xla_ragged_dot(rows, b.reshape(n * m, *b.shape[2:]), sizes, dims, out_dtype)
        return out.reshape(n, -1, *out.shape[1:])[:, :-1]
    mats = jnp.concatenate([b, jnp.zeros_like(b[:, :1])], axis=1)  # [n, G + 1, ...]
    out = xla_ragged_dot(rows, mats.reshape(-1, *b.shape[2:]), sizes, dims, out_dtype)
    return out.reshape(n, m, *out.shape[1:])


def clamped_group_sizes(group_sizes: jax.Array, rows: int) -> jax.Array:
    """The group sizes every path actually uses: each in [0, rows], their sum <= rows."""
    sizes = jnp.clip(group_sizes.astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.int32), 0, rows)
    # Summed saturating at rows, as the kernels sum them in int64 and clamp: a plain int32
    # cumsum wraps once G * rows passes 2**31 (32769 groups of 65536 rows) and would end
    # groups before they start. Saturating addition is associative, so the prefix sums take
    # log2(G) whole-array steps, each adding the sum ending `shift` groups earlier (a + min(b,
    # rows - a) never leaves [0, rows]). Shifts by padding, not lax.associative_scan: its
    # concatenations of slices, compiled one by one under an eager shard_map, crash XLA's CPU
    # compiler in jax 0.11.
    ends, shift, n = sizes, 1, sizes.shape[-1]
    while shift < n:
        earlier = jnp.pad(ends[..., :-shift], [(0, 0)] * (ends.ndim - 1) + [(shift, 0)])
        ends, shift = earlier + jnp.minimum(ends, rows - earlier), 2 * shift
    return jnp.diff(ends, prepend=0).astype(jnp.int32)


def zero_past_groups(x: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``x`` with its rows past the groups set to zero (a select: NaNs there do not survive)."""
    rows = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), x, jnp.zeros((), x.dtype))


def grouped_gemm_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype: Any = None,
                           dot: RaggedDot = xla_ragged_dot) -> jax.Array:
    """``lhs [M, K]`` times each group's ``rhs[g]`` of ``rhs [G, K, N]`` -> ``[M, N]`` in
    ``out_dtype`` (default: ``lhs``'s)."""
    sizes = clamped_group_sizes(group_sizes, lhs.shape[0])
    out = dot(lhs, rhs, sizes, DIMS_FWD, lhs.dtype if out_dtype is None else out_dtype)
    return zero_past_groups(out, sizes)


def grouped_gemm_rhs_t_reference(dout: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype: Any = None,
                                 dot: RaggedDot = xla_ragged_dot) -> jax.Array:
    """The input gradient: ``dout [M, N]`` times each ``rhs[g].T`` -> ``[M, K]``."""
    sizes = clamped_group_sizes(group_sizes, dout.shape[0])
    out = dot(dout, rhs, sizes, DIMS_TRANS_RHS, dout.dtype if out_dtype is None else out_dtype)
    return zero_past_groups(out, sizes)


def grouped_gemm_wgrad_reference(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, out_dtype: Any = None,
                                 dot: RaggedDot = xla_ragged_dot) -> jax.Array:
    """The weight gradient: ``out[g] = lhs[rows of g].T @ dout[rows of g]`` -> ``[G, K, N]``."""
    sizes = clamped_group_sizes(group_sizes, lhs.shape[0])
    # dout's rows past the groups are zeroed so that no implementation can read them in.
    return dot(lhs, zero_past_groups(dout, sizes), sizes, DIMS_RAGGED_CONTRACT,
               lhs.dtype if out_dtype is None else out_dtype)


def grouped_matmul_reference(lhs: np.ndarray, rhs: np.ndarray, group_sizes: np.ndarray) -> np.ndarray:
    """NumPy float64 reference: one plain matmul per group (sizes clamped as every path
    clamps them), zeros past the groups."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    start = 0
    for g, n in enumerate(np.asarray(group_sizes)):
        n = min(max(int(n), 0), lhs.shape[0] - start)
        out[start:start + n] = lhs[start:start + n] @ rhs[g]
        start += n
    return out
