"""te_jax_perm: MoE token permutation primitives for JAX, as Triton kernels behind aliased
XLA custom calls. Public names are loaded lazily so that importing the package stays cheap
and imports no GPU-only module."""
from __future__ import annotations

import importlib
from typing import Any

from te_jax_perm.core.audit import audit_aliases
from te_jax_perm.core.backends import BACKENDS, BackendUnavailableError, resolve_backend, use_backend

_LAZY = {
    # the TE-compatible high-level API
    "token_dispatch": "te_jax_perm.ops.permute.api",
    "token_combine": "te_jax_perm.ops.permute.api",
    "sort_chunks_by_index": "te_jax_perm.ops.chunk_sort.api",
    "sort_chunks_by_index_with_probs": "te_jax_perm.ops.chunk_sort.api",
    # lower-level primitives
    "make_row_id_map": "te_jax_perm.ops.row_id_map.api",
    "permute_with_mask_map": "te_jax_perm.ops.permute.api",
    "unpermute_with_mask_map": "te_jax_perm.ops.permute.api",
    "make_chunk_sort_map": "te_jax_perm.ops.chunk_sort.api",
    "sort_chunks_by_map": "te_jax_perm.ops.chunk_sort.api",
    # routing formats: top-k indices <-> routing maps
    "topk_to_routing_map": "te_jax_perm.ops.routing",
    "routing_map_to_topk": "te_jax_perm.ops.routing",
    # expert GEMMs over the dispatched rows
    "grouped_matmul": "te_jax_perm.ops.grouped_gemm.api",
    # the expert layer with dispatch and combine fused into the expert GEMMs
    "moe_ffn": "te_jax_perm.ops.moe_ffn.api",
    # sanitizer and autotuner entry points
    "sanitize": "te_jax_perm.sanitize",
    "autotune": "te_jax_perm.autotune",
    "parallel": "te_jax_perm.parallel",
}

__all__ = ["BACKENDS", "BackendUnavailableError", "audit_aliases", "resolve_backend", "use_backend", *_LAZY]


def _activate() -> None:
    """The one place the environment switches plug-ins on (``core.hooks`` is where they plug in).

    Unknown values of the library's environment variables raise here, at import. Cached
    tuning results are always used: the autotuner's resolver is installed unconditionally
    (it tunes on a cache miss only when asked to). ``TE_JAX_PERM_SANITIZE`` opens the
    process-wide sanitizer session.
    """
    from te_jax_perm.core import env
    env.check_all()
    from te_jax_perm.autotune.tuner import resolve_call
    from te_jax_perm.core import hooks
    hooks.set_config_resolver(resolve_call)
    if env.sanitize() is not None:
        from te_jax_perm.sanitize import session
        session.env_session()


_activate()


def __dir__() -> list[str]:
    # The lazy names are not in the module's namespace until first used.
    return sorted(__all__)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module = importlib.import_module(_LAZY[name])
        value = module if module.__name__.endswith("." + name) else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'te_jax_perm' has no attribute {name!r}")
