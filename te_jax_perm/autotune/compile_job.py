"""A picklable description of one Triton compile, and the code that runs it.

The same :func:`compile_job` runs in a pool worker and in-process (the baseline the pool's
compile time is measured against), so both paths compile exactly the same thing.
"""
from __future__ import annotations

import dataclasses
import importlib
import time
from typing import Any, Mapping

from te_jax_perm.core.launch import Launch
from te_jax_perm.core.triton_compile import compile_kernel, launch_spec


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


def make_job(launch: Launch, target: tuple[str, int, int]) -> CompileJob:
    """The compile of ``launch``'s kernel with its config, with pointers assumed 16-byte
    aligned (XLA and torch allocations are), as the ``triton`` backend compiles it too."""
    fn = launch.decl.kernel.fn
    sig, constexprs, attrs = launch_spec(launch)
    config = launch.config
    return CompileJob(fn.__module__, fn.__name__, sig, constexprs, attrs, tuple(target),
                      {"num_warps": config.num_warps, "num_stages": config.num_stages},
                      label=f"{launch.decl.name}:{config}")


def load_kernel(job: CompileJob) -> Any:
    return getattr(importlib.import_module(job.kernel_module), job.kernel_name)


def _compile(job: CompileJob) -> Any:
    return compile_kernel(load_kernel(job), job.signature, job.constexprs, job.attrs, job.target,
                          job.options["num_warps"], job.options["num_stages"])


def compile_job(job: CompileJob) -> dict:
    """Compiles ``job``; returns a small picklable summary including the binary."""
    t0 = time.perf_counter()
    k = _compile(job)
    binary = k.asm.get("cubin") or k.asm.get("hsaco") or b""
    meta = getattr(k, "metadata", None)
    return {"hash": k.hash, "binary": bytes(binary) if isinstance(binary, (bytes, bytearray)) else binary,
            "n_regs": getattr(k, "n_regs", None), "shared": getattr(meta, "shared", None),
            "compile_s": time.perf_counter() - t0}
