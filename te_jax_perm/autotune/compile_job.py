"""A picklable description of one Triton compile, and the code that runs it.

The same :func:`compile_job` runs in a pool worker and in-process (the baseline the pool's
compile time is measured against), so both paths compile exactly the same thing.
"""
from __future__ import annotations

import dataclasses
import importlib
import time
from typing import Any, Mapping, Sequence

import numpy as np

from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.kernel_args import KernelArgs

# np.dtype name -> Triton signature type.
_TRITON_TYPE = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
}


@dataclasses.dataclass(frozen=True)
class CompileJob:
    kernel_module: str
    kernel_name: str
    signature: Mapping[str, str]
    constexprs: Mapping[str, Any]
    attrs: Mapping[tuple[int, ...], Any]
    target: tuple[str, int, int]
    options: Mapping[str, Any]
    label: str = ""
    fault: str | None = None  # test hook: "abort", "segfault", "hang" or "raise"


def triton_type(dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in _TRITON_TYPE:
        raise TypeError(f"no Triton pointer type for dtype {name}")
    return _TRITON_TYPE[name]


def make_job(decl: KernelDecl, avals: Sequence[Any], out_avals: Sequence[Any], params: Mapping[str, Any],
             config: Config, target: tuple[str, int, int], fault: str | None = None) -> CompileJob:
    """The compile of ``decl.kernel`` for one config, with pointers assumed 16-byte aligned
    (XLA and torch allocations are) as jax-triton assumes too."""
    kargs = KernelArgs.build(decl, avals, params, config)
    names = list(decl.kernel.arg_names)
    ptr_types = [triton_type(a.dtype) for a in avals]
    out_types = [triton_type(a.dtype) for a in out_avals]
    positional = ([("*" + t) for t in ptr_types]
                  + [_scalar_type(v) for v in kargs.scalars.values()]
                  + [("*" + t) for t in out_types] * 2)
    if len(positional) + len(kargs.constexprs) != len(names):
        raise TypeError(f"{decl.name}: kernel takes {names}; declaration supplies {len(positional)} positional "
                        f"+ {sorted(kargs.constexprs)} constexprs")
    sig = dict(zip(names[:len(positional)], positional))
    for n in names[len(positional):]:
        if n not in kargs.constexprs:
            raise TypeError(f"{decl.name}: kernel parameter {n!r} is neither positional nor a declared constexpr")
        sig[n] = "constexpr"
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(positional) if t.startswith("*")}
    fn = decl.kernel.fn
    return CompileJob(fn.__module__, fn.__name__, sig, dict(kargs.constexprs), attrs, tuple(target),
                      {"num_warps": config.num_warps, "num_stages": config.num_stages},
                      label=f"{decl.name}:{config}", fault=fault)


def _scalar_type(v: Any) -> str:
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    return "fp32"


def load_kernel(job: CompileJob) -> Any:
    return getattr(importlib.import_module(job.kernel_module), job.kernel_name)


def ast_source(job: CompileJob) -> Any:
    from triton.compiler import ASTSource
    return ASTSource(fn=load_kernel(job), signature=dict(job.signature), constexprs=dict(job.constexprs),
                     attrs=dict(job.attrs))


def gpu_target(job: CompileJob) -> Any:
    from triton.backends.compiler import GPUTarget
    return GPUTarget(*job.target)


def compile_job(job: CompileJob) -> dict:
    """Compiles ``job``; returns a small picklable summary including the binary."""
    import triton
    t0 = time.perf_counter()
    k = triton.compile(ast_source(job), target=gpu_target(job), options=dict(job.options))
    binary = k.asm.get("cubin") or k.asm.get("hsaco") or b""
    meta = getattr(k, "metadata", None)
    return {"hash": k.hash, "binary": bytes(binary) if isinstance(binary, (bytes, bytearray)) else binary,
            "n_regs": getattr(k, "n_regs", None), "shared": getattr(meta, "shared", None),
            "compile_s": time.perf_counter() - t0}


def load_compiled(job: CompileJob) -> Any:
    """The parent's handle on a kernel a worker compiled: a Triton cache hit, no recompile
    (workers and parent share ``TRITON_CACHE_DIR``)."""
    import triton
    return triton.compile(ast_source(job), target=gpu_target(job), options=dict(job.options))
