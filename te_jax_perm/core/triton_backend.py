"""``triton`` backend: the Triton kernel as an XLA custom call on CUDA, via jax-triton.

jax-triton is imported lazily: it cannot even be imported without a CUDA jaxlib.
"""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Sequence

import jax

from te_jax_perm.core.aliasing import alias_plan, preallocate
from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.kernel_args import KernelArgs


def triton_call(decl: KernelDecl, operands: Sequence[jax.Array], params: Mapping[str, Any],
                config: Config, out_avals: Sequence[jax.core.ShapedArray]) -> list[jax.Array]:
    jt = _jax_triton()
    kargs = KernelArgs.build(decl, [o.aval for o in operands], params, config)
    preallocs = preallocate(decl, out_avals)
    if any(g == 0 for g in kargs.grid):
        # CUDA rejects empty grids; the preallocated buffers already hold the result.
        return preallocs
    plan = alias_plan(decl)
    out_shape = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in out_avals]
    # jax-triton numbers aliases over array arguments only; scalars sit between the
    # operands and the preallocs in the kernel signature but not in the custom call.
    scalars = [_scalar(v) for v in kargs.scalars.values()]
    with jax.named_scope(f"te_jax_perm.{decl.name}"):
        outs = jt.triton_call(
            *operands, *scalars, *preallocs,
            kernel=decl.kernel, out_shape=out_shape, grid=kargs.grid,
            name=f"te_jax_perm.{decl.name}",
            num_warps=config.num_warps, num_stages=config.num_stages,
            input_output_aliases=plan.input_output_aliases,
            **kargs.constexprs)
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
