"""The config resolver (``core.hooks``): cached winners always, tuning on a miss when enabled.

``te_jax_perm`` installs it when imported, so a warm cache is used with no opt-in.
Tuning on a miss is enabled by ``TE_JAX_PERM_AUTOTUNE=1``, :func:`enable` or the
:func:`autotuning` context; disabled, a miss falls back to the default config.
Any tuner failure is logged and falls back to the default: tuning never breaks a call.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Sequence

from absl import logging

from te_jax_perm.autotune import cache
from te_jax_perm.autotune.tuner import TuneOptions, stats, tune_call
from te_jax_perm.core import env, hooks
from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.launch import Call, bind_call

TUNABLE_BACKENDS = ("interpret", "triton")
_enabled: list[bool] = []
_options = TuneOptions()


def enabled() -> bool:
    if _enabled:
        return _enabled[-1]
    return env.autotune()


def enable(on: bool = True, options: TuneOptions | None = None) -> None:
    """Turns tuning-on-miss on or off for this process (overrides the env var)."""
    global _options
    _enabled[:] = [on]
    if options is not None:
        _options = options


@contextlib.contextmanager
def autotuning(on: bool = True) -> Iterator[None]:
    """Within the context, kernels traced with no explicit config are tuned on a cache miss."""
    _enabled.append(on)
    try:
        yield
    finally:
        _enabled.pop()


def pick(decl: KernelDecl, entry: Mapping[str, Any], dims: Mapping[str, int], params: Mapping[str, Any]
         ) -> Config | None:
    """The fastest cached config that is valid for these exact dims (a key bucket spans
    several shapes, and a constraint may rule the winner out for some of them)."""
    for cfg_json, _t in entry.get("ranking", []):
        cfg = Config.from_json(cfg_json)
        if decl.violated(dims, params, cfg) is None:
            return cfg
    return None


def resolve(decl: KernelDecl, avals: Sequence[Any], params: Mapping[str, Any], backend: str) -> Config | None:
    """The config a call of ``decl`` on operands shaped like ``avals`` would use (``None``:
    the default)."""
    return resolve_call(bind_call(decl, avals, params, backend))


def resolve_call(call: Call) -> Config | None:
    """The config resolver the autotuner installs in ``core.hooks``."""
    decl = call.decl
    if call.backend not in TUNABLE_BACKENDS or not decl.configs:
        return None
    try:
        key = cache.make_key(decl, call.dims, call.params, call.dtypes, call.backend)
        entry = cache.load_valid(decl, key, call.dims, call.params)
        if entry is not None:
            stats["cache_hits"] += 1
        elif enabled():
            entry = tune_call(call, _options).entry
        if entry is None:
            return None
        cfg = pick(decl, entry, call.dims, call.params)
        logging.vlog(1, "autotune %s: using %s for %s", decl.name, cfg, dict(call.dims))
        return cfg
    except Exception as e:  # noqa: BLE001 - never let tuning fail the user's computation
        logging.warning("autotune %s: tuning failed (%s: %s); using the default config", decl.name,
                        type(e).__name__, e)
        return None


def install() -> None:
    """Makes :func:`resolve_call` the config resolver (``te_jax_perm`` does this at import)."""
    hooks.set_config_resolver(resolve_call)
