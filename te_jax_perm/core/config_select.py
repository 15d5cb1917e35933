"""Which config a launch uses: an explicit one, the installed resolver's pick, or the default."""
from __future__ import annotations

from absl import logging

from te_jax_perm.core import hooks
from te_jax_perm.core.declaration import Config
from te_jax_perm.core.launch import Call


def select_config(call: Call, explicit: Config | None) -> Config:
    hooks.notify_call(call)
    if explicit is not None:
        return explicit
    picked = hooks.resolve_config(call)
    if picked is not None:
        return picked
    decl = call.decl
    cfg = decl.default_config(call.dims, call.params)
    why = decl.violated(call.dims, call.params, cfg)
    if why:
        raise ValueError(f"{decl.name}: default {cfg} violates its own constraint for {dict(call.dims)}: {why}")
    logging.vlog(1, "%s: default config %s for %s", decl.name, cfg, dict(call.dims))
    return cfg
