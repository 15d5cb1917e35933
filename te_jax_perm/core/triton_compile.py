"""Compiling a launch's kernel with Triton's own compiler, cached per specialisation.

The ``triton`` backend and the autotuner's compile workers both compile through
:func:`compile_kernel`, so a tuned binary is exactly the one the backend launches.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import numpy as np

from te_jax_perm.core.kernel_args import SCALAR, kernel_arguments, signature
from te_jax_perm.core.launch import Launch

# -- Triton version shims ----------------------------------------------------------------------
# Triton >= 3.3 takes per-argument attributes keyed by argument-index tuples
# ({(i,): [["tt.divisibility", 16]]}); every release this library supports (3.6 and later)
# does, as does the metadata below (``name``, ``shared``, ``num_warps``, ``num_ctas``,
# ``global_scratch_size``/``_align``; ``profile_scratch_size`` from 3.5 on).
DIVISIBILITY = [["tt.divisibility", 16]]


def _metadata(compiled: Any, field: str, default: Any) -> Any:
    return getattr(compiled.metadata, field, default)


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """What XLA's Triton call needs of a compiled kernel."""

    name: str                 # the PTX entry point
    num_warps: int
    num_ctas: int
    shared_mem_bytes: int
    ptx: str
    compute_capability: int
    global_scratch_size: int   # bytes of on-device scratch the kernel needs (0: none)
    global_scratch_align: int


def compile_kernel(kernel: Any, sig: Mapping[str, str], constexprs: Mapping[str, Any],
                   attrs: Mapping[tuple[int, ...], Any], target: tuple[str, Any, int],
                   num_warps: int, num_stages: int) -> Any:
    """``triton.compile`` of ``kernel`` (a ``@triton.jit`` function); returns Triton's
    compiled kernel (``.asm``, ``.metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    source = ASTSource(fn=kernel, signature=dict(sig), constexprs=dict(constexprs), attrs=dict(attrs))
    return triton.compile(source, target=GPUTarget(*target), options={"num_warps": num_warps,
                                                                       "num_stages": num_stages})


def specialisation(value: Any) -> str | None:
    """How a runtime scalar is compiled, as Triton's launcher does it: an integer 1 becomes a
    constant (``"one"``); one divisible by 16 carries that fact (``"div16"``: ``row * E``
    offsets keep 16-byte alignment, loads vectorise); anything else is ``None``. The values
    are the call's static scalars, so the binary never meets another value."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return None
    if int(value) == 1:
        return "one"
    return "div16" if int(value) % 16 == 0 else None


def launch_spec(launch: Launch) -> tuple[dict[str, str], dict[str, Any], dict[tuple[int, ...], Any]]:
    """(signature, constexprs, attrs) of ``launch``: pointers are 16-byte aligned (XLA's
    allocations are) and integer scalars are specialised (:func:`specialisation`)."""
    sig, constexprs, attrs = signature(launch), dict(launch.constexprs), {}
    # Constexprs follow every runtime argument, so argument i is kernel parameter i.
    for i, a in enumerate(kernel_arguments(launch, launch.avals, launch.out_avals, launch.out_avals)):
        kind = "div16" if a.is_pointer else specialisation(a.value) if a.role == SCALAR else None
        if kind == "one":
            sig[a.name], constexprs[a.name] = "constexpr", 1
        elif kind == "div16":
            attrs[(i,)] = DIVISIBILITY
    return sig, constexprs, attrs


def compiled_for(launch: Launch, compute_capability: int) -> CompiledKernel:
    """The compiled kernel of ``launch`` for a CUDA device of ``compute_capability`` (e.g.
    90), compiled once per (kernel, signature, constexprs, warps, stages, device)."""
    sig, constexprs, attrs = launch_spec(launch)
    return compile_cached(launch.decl.kernel, tuple(sig.items()), tuple(constexprs.items()), tuple(attrs),
                          launch.config.num_warps, launch.config.num_stages, int(compute_capability))


@functools.lru_cache(maxsize=1024)
def compile_cached(kernel: Any, sig: tuple, constexprs: tuple, aligned: tuple, num_warps: int, num_stages: int,
                   cc: int) -> CompiledKernel:
    """:func:`compiled_for`'s cache (``cache_info()`` counts the compiles); ``aligned``: the
    argument positions known 16-byte divisible."""
    attrs = {position: DIVISIBILITY for position in aligned}
    compiled = compile_kernel(kernel, dict(sig), dict(constexprs), attrs, ("cuda", cc, 32), num_warps, num_stages)
    if _metadata(compiled, "profile_scratch_size", 0):
        raise NotImplementedError(f"{kernel.fn.__name__}: compiled with Triton's profiling instrumentation "
                                  "(profile scratch memory), which XLA's Triton call cannot provide; unset "
                                  "the Triton instrumentation options")
    return CompiledKernel(
        name=compiled.metadata.name, num_warps=num_warps, num_ctas=_metadata(compiled, "num_ctas", 1),
        shared_mem_bytes=compiled.metadata.shared, ptx=compiled.asm["ptx"], compute_capability=cc,
        global_scratch_size=_metadata(compiled, "global_scratch_size", 0) or 0,
        global_scratch_align=_metadata(compiled, "global_scratch_align", 1) or 1)
