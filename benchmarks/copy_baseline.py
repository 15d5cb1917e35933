"""``device_copy``: a Triton copy kernel declared through the framework.

Not a permutation: it is the cudaMemcpy-class baseline that the benchmarks divide every
permutation's bandwidth by, launched through exactly the same custom-call path as the real
ops, so framework overheads show up in both.

The kernel: a flat, vectorised device-to-device copy.

Each program copies ``ITERS`` consecutive tiles of ``BLOCK`` elements, so one config can
trade program count against bytes in flight. Offsets are int64: a 1D view of a large
activation easily exceeds 2**31 elements.

Only the program holding the ragged end masks its accesses: ``N`` arrives at run time
without divisibility hints, so a mask ``offs < N`` cannot be proven constant over a
16-byte vector and would force element-wise loads/stores on every program.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare
from te_jax_perm.core import Partitioning
from te_jax_perm.ops.tiling import next_pow2


@triton.jit
def device_copy_kernel(src_ptr, N, dst_prealloc_ptr, dst_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                       EVEN: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    if EVEN or base + BLOCK * ITERS <= N:
        for i in tl.static_range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs))
    else:
        for i in tl.static_range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < N
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def _tile(dims, config: Config) -> int:
    return config.kw["BLOCK"] * config.kw["ITERS"]


def _fits_warps(dims, params, config: Config) -> str | None:
    # Fewer elements than threads would leave lanes idle and masks everywhere.
    if config.kw["BLOCK"] < 32 * config.num_warps:
        return f"BLOCK={config.kw['BLOCK']} < 32*num_warps={32 * config.num_warps}"
    return None


def _default(dims, params) -> Config:
    # 1024 elements a program on 4 warps (16 bytes a lane in bf16): of every config, with and
    # without an evict-first hint on the load, the fastest copy of 1.2 and 4.0 GB of bf16 on
    # an H200, moving bytes 1.01-1.02x as fast as torch's copy_; 4096 elements on 8 warps with
    # the hint moved them 0.92-0.93x as fast, which would flatter every share of the copy's rate.
    block = min(1024, max(32, next_pow2(dims["N"])))  # at least one element per lane
    return Config.make(num_warps=max(1, min(4, block // 256)), BLOCK=block, ITERS=1)


device_copy_primitive = declare(KernelDecl(
    name="device_copy",
    kernel=device_copy_kernel,
    operands=(Operand("src", ("N",)),),
    outputs=(Output("dst", lambda dims, params: (dims["N"],), lambda dtypes, params: dtypes["src"]),),
    reference=lambda src: (jnp.array(src, copy=True),),
    grid=lambda dims, params, config: (triton.cdiv(dims["N"], _tile(dims, config)),),
    scalars=lambda dims, params: {"N": dims["N"]},
    constexprs=lambda dims, params, config: {"EVEN": dims["N"] % _tile(dims, config) == 0},
    configs=tuple(Config.make(num_warps=w, BLOCK=b, ITERS=i)
                  for b in (1024, 2048, 4096, 8192) for i in (1, 2, 4) for w in (4, 8)),
    constraints=(_fits_warps,),
    key_dims=("N",),
    default_config=_default,
    partitioning=Partitioning(outputs=(("N",),), local=("N",)),  # elementwise
))

CONFIGS = device_copy_primitive.decl.configs


def device_copy(x: jax.Array, backend: str | None = None, config: Config | None = None) -> jax.Array:
    """Copies ``x`` (any shape, any dtype) into a new buffer of the same shape and dtype.

    The copy runs as one flat kernel over ``x.size`` elements; ``config`` picks the tile
    (see ``CONFIGS``), otherwise the framework's configured or default choice is used.
    """
    x = jnp.asarray(x)
    if x.size == 0:
        return jnp.empty_like(x)
    (flat,) = device_copy_primitive(x.reshape(-1), backend=backend, config=config)
    return flat.reshape(x.shape)
