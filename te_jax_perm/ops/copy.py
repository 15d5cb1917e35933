"""``device_copy``: a Triton copy kernel declared through the framework.

Not a permutation: it is the cudaMemcpy-class baseline that the benchmarks divide every
permutation's bandwidth by (see shared/perf.md), launched through exactly the same
custom-call path as the real ops, so framework overheads show up in both.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import triton

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare
from te_jax_perm.core.sharding import Partitioning
from te_jax_perm.kernels.copy import copy_kernel

_TILE_BYTES = 16  # one 128-bit vector per thread per tile row keeps loads fully coalesced


def _tile(d, c: Config) -> int:
    return c.kw["BLOCK"] * c.kw["ITERS"]


def _fits_warps(d, p, c: Config) -> str | None:
    # Fewer elements than threads would leave lanes idle and masks everywhere.
    if c.kw["BLOCK"] < 32 * c.num_warps:
        return f"BLOCK={c.kw['BLOCK']} < 32*num_warps={32 * c.num_warps}"
    return None


def _default(d, p) -> Config:
    n = max(d["N"], 1)
    block = min(4096, max(32, triton.next_power_of_2(n)))  # at least one element per lane
    return Config.make(num_warps=max(1, min(8, block // 512)), BLOCK=block, ITERS=1)


_copy = declare(KernelDecl(
    name="device_copy",
    kernel=copy_kernel,
    operands=(Operand("src", ("N",)),),
    outputs=(Output("dst", lambda d, p: (d["N"],), lambda t, p: t["src"]),),
    reference=lambda src: (jnp.array(src, copy=True),),
    grid=lambda d, p, c: (triton.cdiv(d["N"], _tile(d, c)),),
    scalars=lambda d, p: {"N": d["N"]},
    constexprs=lambda d, p, c: {"EVEN": d["N"] % _tile(d, c) == 0},
    configs=tuple(Config.make(num_warps=w, BLOCK=b, ITERS=i)
                  for b in (1024, 2048, 4096, 8192) for i in (1, 2, 4) for w in (4, 8)),
    constraints=(_fits_warps,),
    key_dims=("N",),
    default_config=_default,
    partitioning=Partitioning(outputs=(("N",),), local=("N",)),  # elementwise
))

CONFIGS = _copy.decl.configs


def device_copy(x: jax.Array, backend: str | None = None, config: Config | None = None) -> jax.Array:
    """Copies ``x`` (any shape, any dtype) into a new buffer of the same shape and dtype.

    The copy runs as one flat kernel over ``x.size`` elements; ``config`` picks the tile
    (see ``CONFIGS``), otherwise the framework's configured or default choice is used.
    """
    x = jnp.asarray(x)
    if x.size == 0:
        return jnp.empty_like(x)
    (flat,) = _copy(x.reshape(-1), backend=backend, config=config)
    return flat.reshape(x.shape)
