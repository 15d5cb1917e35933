"""On-disk tuning results: one JSON file per key, written atomically.

The directory is ``set_cache_dir(...)``, else ``$TE_JAX_PERM_AUTOTUNE_CACHE``, else
``~/.cache/te_jax_perm/autotune``. Writers go through a temp file plus ``os.replace``, so
concurrent processes only ever see complete files (last writer wins, both are valid).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from te_jax_perm.autotune.key import key_digest

ENV_VAR = "TE_JAX_PERM_AUTOTUNE_CACHE"
_dir_override: str | None = None


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Sets the cache directory for this process (``None``: back to env var/default)."""
    global _dir_override
    _dir_override = None if path is None else os.fspath(path)


def cache_dir() -> Path:
    d = _dir_override or os.environ.get(ENV_VAR) or os.path.join(Path.home(), ".cache", "te_jax_perm", "autotune")
    return Path(d)


def entry_path(key: Mapping[str, Any]) -> Path:
    return cache_dir() / f"{key['kernel']}-{key_digest(key)}.json"


def load(key: Mapping[str, Any]) -> dict | None:
    path = entry_path(key)
    try:
        with open(path) as f:
            entry = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    # A digest collision or a hand-edited file must not hand back another key's result.
    return entry if entry.get("key") == json.loads(json.dumps(key)) else None


def store(key: Mapping[str, Any], entry: Mapping[str, Any]) -> Path:
    path = entry_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({**entry, "key": key}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def entries() -> Iterator[tuple[Path, dict]]:
    d = cache_dir()
    if not d.is_dir():
        return
    for p in sorted(d.glob("*.json")):
        try:
            with open(p) as f:
                yield p, json.load(f)
        except (json.JSONDecodeError, OSError):
            continue


def format_cache() -> str:
    """A human-readable table of every cached result."""
    lines = [f"autotune cache: {cache_dir()}"]
    for p, e in entries():
        k = e.get("key", {})
        lines.append(f"{k.get('kernel')}  backend={k.get('backend')} dims={k.get('dims')} "
                     f"params={k.get('params')} dtypes={k.get('dtypes')} device={k.get('device')}")
        best = e.get("best")
        lines.append(f"    best={best} time_s={e.get('best_time_s')} "
                     f"timed={len(e.get('ranking', []))} rejected={len(e.get('rejected', []))} "
                     f"failed={len(e.get('failed', []))} pruned={len(e.get('pruned', []))}  [{p.name}]")
    return "\n".join(lines)
