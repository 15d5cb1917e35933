"""Tuning-cache entries checked before any config in them reaches a launch.

A cache file is data from disk: hand-edited, truncated, written by another version of the
library, or corrupted. An entry is used only when it has the shape the tuner writes and
every config in it is one the declaration can produce: one of its declared configs or its
default config, with the same constant names, values and types (``BLOCK=32.0`` is not
``BLOCK=32``). Anything else would put an unknown constexpr, a zero or non-power-of-two
tile, or a float where the kernel expects an int into the compiled kernel.
"""
from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping

from te_jax_perm.core.declaration import Config, KernelDecl

_CONFIG_FIELDS = {"constants", "num_warps", "num_stages"}
# Fields the tuner writes as lists of records (counted by --print_cache).
LIST_FIELDS = ("ranking", "rejected", "failed", "pruned", "skipped", "not_run")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def canonical(cfg_json: Any) -> str:
    """One string per config, distinguishing ``32`` from ``32.0`` and ``True``."""
    return json.dumps(cfg_json, sort_keys=True)


def config_schema_problem(cfg_json: Any) -> str | None:
    """Why ``cfg_json`` is not a config as :meth:`Config.to_json` writes it, or ``None``."""
    if not isinstance(cfg_json, dict) or set(cfg_json) != _CONFIG_FIELDS:
        return f"config {cfg_json!r} does not have exactly the fields {sorted(_CONFIG_FIELDS)}"
    consts = cfg_json["constants"]
    if not isinstance(consts, dict) or not all(isinstance(k, str) for k in consts):
        return f"config constants {consts!r} are not a mapping of names"
    bad = {k: v for k, v in consts.items() if not isinstance(v, (int, str))}   # bool is an int
    if bad:
        return f"config constants {bad!r} are not integers, booleans or strings"
    for field, low in (("num_warps", 1), ("num_stages", 0)):
        v = cfg_json[field]
        if not _is_int(v) or v < low:
            return f"config {field}={v!r} is not an integer >= {low}"
    return None


def declared_space(decl: KernelDecl, dims_list: Iterable[Mapping[str, int] | None], params: Mapping[str, Any]
                   ) -> set[str] | None:
    """Canonical configs ``decl`` can run: its configs plus its default at each of
    ``dims_list``; ``None`` when no default could be computed there (dims and params read
    from a file may not suit it), so that configs outside the declared list cannot be judged."""
    space, defaults = {canonical(c.to_json()) for c in decl.configs}, 0
    for dims in dims_list:
        try:
            space.add(canonical(decl.default_config(dims, params).to_json()))
            defaults += 1
        except Exception:  # noqa: BLE001 - no default at these dims
            continue
    return space if defaults else None


def entry_problem(entry: Any, decl: KernelDecl | None = None, space: set[str] | None = None) -> str | None:
    """Why ``entry`` must not be used, or ``None``.

    Without ``decl`` only the entry's shape is checked; with it, the constant names of each
    config too; with ``space`` (from :func:`declared_space`), each config must be in it.
    """
    if not isinstance(entry, dict):
        return f"the file holds {type(entry).__name__}, not a JSON object"
    if not isinstance(entry.get("key"), dict):
        return "it has no key object"
    for field in LIST_FIELDS:
        if field in entry and not isinstance(entry[field], list):
            return f"{field!r} is {type(entry[field]).__name__}, not a list"
    ranking = entry.get("ranking", [])
    configs = []
    for item in ranking:
        if not isinstance(item, list) or len(item) != 2:
            return f"ranking item {item!r} is not a [config, seconds] pair"
        cfg, t = item
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            return f"ranking time {t!r} is not a finite number of seconds"
        configs.append(cfg)
    if entry.get("best") is not None:
        configs.append(entry["best"])
    dims = entry.get("tuned_dims")
    if dims is not None and (not isinstance(dims, dict) or not all(_is_int(v) for v in dims.values())):
        return f"tuned_dims {dims!r} is not a mapping of integer dims"
    for cfg in configs:
        why = config_schema_problem(cfg)
        if why:
            return why
        if decl is not None:
            names = {frozenset(c.kw) for c in decl.configs}
            if names and frozenset(cfg["constants"]) not in names and (space is None or canonical(cfg) not in space):
                unknown = sorted(set(cfg["constants"]) - set().union(*names))
                return (f"config {Config.from_json(cfg)} has constants {sorted(cfg['constants'])}"
                        + (f" (unknown: {unknown})" if unknown else "") + f", not those {decl.name} declares")
        if space is not None and canonical(cfg) not in space:
            return f"config {Config.from_json(cfg)} is not one of {decl.name}'s declared configs or its default"
    return None
