"""The alias plan: which custom-call operands are preallocated output buffers.

Both the lowerings (``input_output_aliases`` / ``operand_output_aliases``) and the
autotuner (which buffers to save and restore between trials, how to fill them) read this
one plan, so they cannot drift apart. It is also the one reader of ``Output.init``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp

from te_jax_perm.core.declaration import KernelDecl
from te_jax_perm.core.uninitialized import uninitialized


@dataclasses.dataclass(frozen=True)
class AliasPlan:
    num_operands: int
    num_outputs: int
    zeroed: tuple[bool, ...]   # per output: starts as zeros (init="zeros"), else unspecified

    @property
    def input_output_aliases(self) -> dict[int, int]:
        """Custom-call operand index -> output index (preallocs follow the operands)."""
        return {self.num_operands + i: i for i in range(self.num_outputs)}

    @property
    def written_inputs(self) -> tuple[int, ...]:
        """Operand indices a launch may modify: exactly the aliased ones."""
        return tuple(self.input_output_aliases)


@functools.lru_cache(maxsize=None)
def alias_plan(decl: KernelDecl) -> AliasPlan:
    return AliasPlan(len(decl.operands), len(decl.outputs), tuple(o.init == "zeros" for o in decl.outputs))


def preallocate(plan: AliasPlan, out_avals: Sequence[jax.core.ShapedArray]) -> list[jax.Array]:
    """Output buffers to pass as aliased operands.

    Zeroed outputs start as zeros; the others are uninitialised on GPU (no memset: the
    kernel writes every element) and poisoned on CPU, so a kernel that breaks its "writes
    every element" promise fails its tests (core/uninitialized.py).
    """
    return [jnp.zeros(aval.shape, aval.dtype) if zeroed else uninitialized(aval.shape, aval.dtype)
            for zeroed, aval in zip(plan.zeroed, out_avals)]
