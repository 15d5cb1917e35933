"""The grouped-GEMM problems both GEMM benchmarks time: ``grouped_gemm_bench`` (kernel
configs, TMA, tokamax) and ``layer_bench``'s GEMM table (the targets against the dense dot
and the roofline). One table of shapes, their operands, and the dense dot of the same FLOPs
that a grouped GEMM is held to.

The operands are drawn a slice at a time (:func:`random_normal`): a one-shot draw of
DeepSeek-V3's expert weights ([256, 7168, 4096] bf16, 14 GiB) holds 28 GiB of float32
beside them, more than an 80 GB GPU has left.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from te_jax_perm.workloads import DEEPSEEK_V3, MIXTRAL_8X7B, QWEN3_235B, MoEModel


@dataclasses.dataclass(frozen=True)
class GemmShape:
    """``[M, K]`` rows in ``G`` contiguous groups, each group's rows times its own ``[K, N]``."""

    name: str
    M: int
    K: int
    N: int
    G: int

    @property
    def flops(self) -> float:
        """FLOPs of the forward: those of one dense ``[M, K] x [K, N]`` dot."""
        return 2.0 * self.M * self.K * self.N

    def tflops(self, ms: float, gemms: int = 1) -> float:
        """TFLOP/s of ``gemms`` GEMMs of this size in ``ms`` milliseconds."""
        return gemms * self.flops / ms / 1e9

    def bytes_fwd(self, dtype: Any) -> float:
        """Bytes the forward moves at least: ``lhs`` read and the output written once, and
        every group's weights read once."""
        m, k, n, g = self.M, self.K, self.N, self.G
        return float(jnp.dtype(dtype).itemsize * (m * k + g * k * n + m * n))


def _expert_gemms(label: str, model: MoEModel, T: int) -> tuple[GemmShape, GemmShape]:
    """The two expert GEMMs of ``model``'s layer at ``T`` tokens: M = T*k rows; the
    up-projection's N = 2F (gate and up fused), the down-projection's K = F."""
    m = T * model.k
    return (GemmShape(f"{label}_up_T{T}", m, model.H, 2 * model.F, model.E),
            GemmShape(f"{label}_down_T{T}", m, model.F, model.H, model.E))


# Expert GEMMs of MoE layers at T = 8192 tokens, generic ones at 8 and 32 groups (one of
# them at DeepSeek-V3's hidden size), and the first of those as one group: the grouped
# kernel run as a dense GEMM, the speed its tiles reach with no group boundary.
SHAPES = (
    *_expert_gemms("deepseek_v3", DEEPSEEK_V3, 8192),
    *_expert_gemms("qwen3", QWEN3_235B, 8192),
    *_expert_gemms("mixtral", MIXTRAL_8X7B, 8192),
    GemmShape("g1_16384x4096x4096", 16384, 4096, 4096, 1),
    GemmShape("g8_16384x4096x4096", 16384, 4096, 4096, 8),
    GemmShape("g32_32768x4096x2048", 32768, 4096, 2048, 32),
    GemmShape("g32_65536x7168x2048", 65536, 7168, 2048, 32),
)
# CPU smoke runs: small enough for the Triton interpreter, sizes that do not divide tiles.
CPU_SHAPES = (
    GemmShape("cpu_g4_96x32x24", 96, 32, 24, 4),
    GemmShape("cpu_g8_64x16x16", 64, 16, 16, 8),
)


def named(*names: str) -> tuple[GemmShape, ...]:
    """The shapes of ``SHAPES`` and ``CPU_SHAPES`` with these names, in this order."""
    table = {s.name: s for s in SHAPES + CPU_SHAPES}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise KeyError(f"no GEMM shapes named {unknown}; the shapes are {sorted(table)}")
    return tuple(table[n] for n in names)


def group_sizes(m: int, g: int) -> np.ndarray:
    """Routing-like group sizes, the same in every run: a multinomial draw of ``m`` rows over
    ``g`` equally likely groups."""
    return np.random.default_rng(m + g).multinomial(m, np.full(g, 1.0 / g)).astype(np.int32)


# The most bytes of float32 (and of the generator's 32-bit random bits) one slice may draw:
# one expert's [7168, 4096] weights (117 MB) at a time.
SLICE_BYTES = 1 << 27


def slice_rows(shape: Sequence[int], slice_bytes: int = SLICE_BYTES) -> int:
    """How many entries of the leading axis :func:`random_normal` draws at once: the most
    that divide it and keep the slice's float32 within ``slice_bytes`` (at least one)."""
    lead, row_bytes = shape[0], 4 * math.prod(shape[1:])
    divisors = {d for i in range(1, math.isqrt(lead) + 1) if lead % i == 0 for d in (i, lead // i)}
    return max([d for d in divisors if d * row_bytes <= slice_bytes] or [1])


def random_normal(key: jax.Array, shape: Sequence[int], dtype: Any, scale: float = 1.0,
                  slice_bytes: int = SLICE_BYTES) -> jax.Array:
    """Normal values of standard deviation ``scale``, ``shape`` and ``dtype``, drawn in
    float32 and cast, a slice of the leading axis at a time (:func:`slice_rows`), each slice
    from its own key: no float32 array nor random bits of the whole shape ever exist, only
    the result and one slice. Every slice, so every group of a weight tensor, holds values of
    its own. (Drawn in bf16 directly, the values would take at most 256 levels: a bf16
    uniform has 8 random bits.)"""
    shape = tuple(int(d) for d in shape)
    if not shape or 0 in shape:
        return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
    rows = slice_rows(shape, slice_bytes)
    return _draw(jax.random.split(key, shape[0] // rows), shape, jnp.dtype(dtype), float(scale), rows)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _draw(keys: jax.Array, shape: tuple[int, ...], dtype: Any, scale: float, rows: int) -> jax.Array:
    def one(key):
        return (jax.random.normal(key, (rows, *shape[1:]), jnp.float32) * scale).astype(dtype)
    # A loop over the slices: the draws of two slices are never live at once.
    return jax.lax.map(one, keys).reshape(shape)


@dataclasses.dataclass(frozen=True)
class Operands:
    """One problem's device arrays."""

    lhs: jax.Array             # [M, K], standard normal
    rhs: jax.Array             # [G, K, N], scaled by 1/sqrt(K): outputs of about unit size
    group_sizes: jax.Array     # int32 [G], summing to M
    dense_rhs: jax.Array       # [K, N], rhs[0]: the weights of the dense dot
    dout: jax.Array | None     # [M, N] output cotangent, standard normal, where asked for


def operands(shape: GemmShape, dtype: Any, cotangent: bool = False) -> Operands:
    """The operands of ``shape`` in ``dtype`` (the same in every run), with an output
    cotangent if ``cotangent``."""
    m, k, n, g = shape.M, shape.K, shape.N, shape.G
    k_lhs, k_rhs, k_dout = jax.random.split(jax.random.key(0), 3)
    rhs = random_normal(k_rhs, (g, k, n), dtype, scale=1 / math.sqrt(k))
    return Operands(lhs=random_normal(k_lhs, (m, k), dtype), rhs=rhs, group_sizes=jnp.asarray(group_sizes(m, g)),
                    dense_rhs=rhs[0], dout=random_normal(k_dout, (m, n), dtype) if cotangent else None)


def dense_dot(lhs: jax.Array, dense_rhs: jax.Array) -> jax.Array:
    """What a grouped GEMM is held to: one dense dot of the same FLOPs, every row times one
    group's weights (``Operands.dense_rhs``), with no grouping to schedule."""
    return lhs @ dense_rhs
