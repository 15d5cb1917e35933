"""Which config a launch uses: an explicit one, the autotuner's pick, or the default.

The autotuner registers itself here (``set_config_resolver``) so that ``core`` does not
import it; without a resolver the declaration's default config is used.
"""
from __future__ import annotations

import importlib
import os
from typing import Any, Callable, Mapping, Sequence

from absl import logging

from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.shapes import bind_dims

AUTOTUNE_ENV_VAR = "TE_JAX_PERM_AUTOTUNE"

Resolver = Callable[[KernelDecl, Sequence[Any], Mapping[str, Any], str], "Config | None"]
_resolver: Resolver | None = None


def set_config_resolver(resolver: Resolver | None) -> None:
    global _resolver
    _resolver = resolver


def autotune_env_enabled() -> bool:
    """Whether ``TE_JAX_PERM_AUTOTUNE`` asks for tuning on a cache miss."""
    return os.environ.get(AUTOTUNE_ENV_VAR, "").lower() in ("1", "true", "yes", "on")


def select_config(decl: KernelDecl, avals: Sequence[Any], params: Mapping[str, Any], backend: str,
                  explicit: Config | None) -> Config:
    dims = bind_dims(decl, avals)
    if explicit is not None:
        return explicit
    if _resolver is None and autotune_env_enabled():
        # The env var alone must enable tuning; importing the autotuner installs its resolver.
        importlib.import_module("te_jax_perm.autotune")
    if _resolver is not None:
        cfg = _resolver(decl, avals, params, backend)
        if cfg is not None:
            return cfg
    cfg = decl.default_config(dims, params)
    why = decl.violated(dims, params, cfg)
    if why:
        raise ValueError(f"{decl.name}: default {cfg} violates its own constraint for {dict(dims)}: {why}")
    logging.vlog(1, "%s: default config %s for %s", decl.name, cfg, dict(dims))
    return cfg
