"""The alias plan, and the preallocated output buffers it aliases.

The lowerings (``input_output_aliases``) and the autotuner (which buffers to save and
restore between trials, how to fill them) read this one plan, so they cannot drift apart.
It is also the one reader of ``Output.init``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.extend  # noqa: F401  (jax.extend is not imported by `import jax`)
import jax.ffi
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from te_jax_perm.core.declaration import KernelDecl


@dataclasses.dataclass(frozen=True)
class AliasPlan:
    num_operands: int
    num_outputs: int
    zeroed: tuple[bool, ...]   # per output: starts as zeros (init="zeros"), else unspecified

    @property
    def input_output_aliases(self) -> dict[int, int]:
        """Custom-call operand index -> output index (preallocs follow the operands)."""
        return {self.num_operands + i: i for i in range(self.num_outputs)}


@functools.lru_cache(maxsize=None)
def alias_plan(decl: KernelDecl) -> AliasPlan:
    return AliasPlan(len(decl.operands), len(decl.outputs), tuple(o.init == "zeros" for o in decl.outputs))


def preallocate(plan: AliasPlan, out_avals: Sequence[jax.core.ShapedArray]) -> list[jax.Array]:
    """Output buffers to pass as aliased operands: zeroed ones as zeros, the others
    :func:`uninitialized`."""
    return [jnp.zeros(aval.shape, aval.dtype) if zeroed else uninitialized(aval.shape, aval.dtype)
            for zeroed, aval in zip(plan.zeroed, out_avals)]


# -- uninitialised buffers -------------------------------------------------------------------
# ``jnp.empty`` is zero-filled, a full extra write of every output: at real MoE sizes the
# dispatch output is ~k times its input, so the memset alone would cap dispatch near half
# the copy bandwidth. On GPUs XLA's ``AllocateBuffer`` custom call yields a buffer without
# touching it. On CPU the buffer is poisoned instead, so a kernel that leaves an element of
# an ``init="empty"`` output unwritten gives visibly wrong results in tests, not lucky zeros.
uninitialized_p = Primitive("te_jax_perm_uninitialized")
uninitialized_p.def_abstract_eval(lambda *, shape, dtype: jax.core.ShapedArray(shape, dtype))
uninitialized_p.def_impl(lambda *, shape, dtype: jnp.zeros(shape, dtype))


def _poison(shape, dtype) -> jax.Array:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return jnp.ones(shape, dtype)
    # All-ones bytes: NaN for floats, -1 for signed ints - never a plausible result.
    bits = jnp.full(shape + (dtype.itemsize,), 0xFF, jnp.uint8)
    return jax.lax.bitcast_convert_type(bits if dtype.itemsize > 1 else bits[..., 0], dtype)


# The result type comes from ctx.avals_out.
mlir.register_lowering(uninitialized_p, lambda ctx, **_: jax.ffi.ffi_lowering("AllocateBuffer", api_version=1)(ctx),
                       platform="cuda")
mlir.register_lowering(uninitialized_p, mlir.lower_fun(_poison, multiple_results=False))


def uninitialized(shape: tuple[int, ...], dtype) -> jax.Array:
    """A buffer of ``shape``/``dtype`` whose contents are unspecified."""
    return uninitialized_p.bind(shape=tuple(int(s) for s in shape), dtype=np.dtype(dtype))
