"""``triton`` backend: the Triton kernel as an XLA custom call on CUDA, via jax-triton.

jax-triton is imported lazily: it cannot even be imported without a CUDA jaxlib.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Sequence

import jax

from te_jax_perm.core.aliasing import preallocate
from te_jax_perm.core.kernel_args import OUTPUT, kernel_arguments
from te_jax_perm.core.launch import Launch


def triton_call(launch: Launch, operands: Sequence[jax.Array]) -> list[jax.Array]:
    jt = _jax_triton()
    decl, plan, config = launch.decl, launch.aliases, launch.config
    preallocs = preallocate(plan, launch.out_avals)
    if launch.empty:
        return preallocs  # the preallocated buffers already hold the result
    out_shape = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in launch.out_avals]
    # jax-triton appends the output pointers itself; it numbers aliases over array
    # arguments only (scalars sit between operands and preallocs in the kernel signature).
    args = kernel_arguments(launch, operands, preallocs, out_shape)
    with jax.named_scope(f"te_jax_perm.{decl.name}"):
        outs = jt.triton_call(
            *[a.value if a.is_pointer else _scalar(a.value) for a in args if a.role != OUTPUT],
            kernel=decl.kernel, out_shape=out_shape, grid=launch.grid,
            name=f"te_jax_perm.{decl.name}",
            num_warps=config.num_warps, num_stages=config.num_stages,
            input_output_aliases=plan.input_output_aliases,
            **launch.constexprs)
    return list(outs)


@functools.lru_cache(maxsize=None)
def _jax_triton():
    # jax-triton (0.3.x) blanks TRITON_CACHE_DIR at import, which breaks every later
    # triton.compile in the process (the autotuner's pool hands binaries to the parent
    # through that cache). It compiles without Triton's file cache itself, so we put the
    # user's setting back.
    saved = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton
    if saved is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = saved
    return jax_triton


def _scalar(v: Any) -> Any:
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        return int(v)
    return float(v)
