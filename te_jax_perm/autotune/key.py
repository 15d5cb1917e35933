"""The tuning key: exactly what can change the best config, and nothing more.

From the declaration: the bucketed ``key_dims``, the ``key_params``, the operand dtypes
and the kernel source; from the environment: backend, device kind and the Triton/jax
versions. A dim or param the declaration does not list never forces a re-tune.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
import json
from typing import Any, Mapping, Sequence

import numpy as np

from te_jax_perm.core.declaration import KernelDecl


def kernel_source_hash(decl: KernelDecl) -> str:
    return _source_hash(decl.kernel)


@functools.lru_cache(maxsize=None)
def _source_hash(kernel: Any) -> str:
    # Every lowering of a tunable kernel computes its key: read the source once. Triton's
    # own cache key hashes the source of every jitted function the kernel calls too, so a
    # change to a shared body (not only to the wrapper) invalidates tuned entries.
    src = getattr(kernel, "cache_key", None) or getattr(kernel, "src", None) \
        or inspect.getsource(getattr(kernel, "fn", kernel))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def versions() -> dict[str, str]:
    import jax
    import triton
    return {"jax": jax.__version__, "triton": triton.__version__}


def device_kind(backend: str) -> str:
    if backend == "interpret":
        return "cpu-interpreter"
    import jax
    return jax.devices()[0].device_kind


def make_key(decl: KernelDecl, dims: Mapping[str, int], params: Mapping[str, Any],
             dtypes: Sequence[Any], backend: str) -> dict[str, Any]:
    """The key as a JSON-able dict; ``dtypes`` are the operand dtypes in order."""
    return {
        "kernel": decl.name,
        "backend": backend,
        "dims": {d: int(decl.key_bucket(d, int(dims[d]))) for d in decl.key_dims},
        "params": {p: repr(params[p]) for p in decl.key_params},
        "dtypes": {op.name: np.dtype(dt).name for op, dt in zip(decl.operands, dtypes)},
        "device": device_kind(backend),
        "versions": versions(),
        "source": kernel_source_hash(decl),
    }


def key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
