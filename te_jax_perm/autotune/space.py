"""The search space of one launch: declared configs minus those a constraint rules out.

Pruning happens before anything compiles, so an invalid (e.g. racy) tiling can never be
timed, let alone picked; every pruned config is logged with the constraint's reason.
"""
from __future__ import annotations

from typing import Any, Mapping

from absl import logging

from te_jax_perm.core.declaration import Config, KernelDecl


def candidates(decl: KernelDecl, dims: Mapping[str, int], params: Mapping[str, Any]
               ) -> tuple[list[Config], list[tuple[Config, str]]]:
    """Returns ``(valid, pruned)``; ``pruned`` pairs each config with the reason.

    The default config is always a candidate (if valid), so tuning can only improve on it.
    """
    space = list(dict.fromkeys(decl.configs))
    default = decl.default_config(dims, params)
    if default not in space:
        space.append(default)
    valid, pruned = [], []
    for cfg in space:
        why = decl.violated(dims, params, cfg)
        if why:
            pruned.append((cfg, why))
            logging.info("autotune %s: pruned %s for %s: %s", decl.name, cfg, dict(dims), why)
        else:
            valid.append(cfg)
    return valid, pruned
