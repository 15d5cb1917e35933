"""On-disk tuning results: one JSON file per key, written atomically.

The directory is ``set_cache_dir(...)``, else ``$TE_JAX_PERM_AUTOTUNE_CACHE``, else
``~/.cache/te_jax_perm/autotune``. Writers go through a temp file plus ``os.replace``, so
concurrent processes only ever see complete files (last writer wins, both are valid).
When the directory cannot be written, results are kept in memory for the rest of the
process (with one warning) rather than thrown away.

Files are checked before use (:func:`load_valid`, see ``entry_check``): an unreadable or
malformed entry, or one with a config the declaration cannot produce, is reported once,
ignored, and re-tuned when tuning is on.
"""
from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

from absl import logging

from te_jax_perm.autotune import entry_check
from te_jax_perm.autotune.key import key_digest
from te_jax_perm.core import env
from te_jax_perm.core.declaration import KernelDecl

_dir_override: str | None = None
# Entries tuned in this process whose file could not be written, by path.
_memory: dict[str, dict] = {}
_unwritable: set[str] = set()             # directories already warned about
_reported: set[tuple[str, str]] = set()   # (path, reason) of bad entries already warned about


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Sets the cache directory for this process (``None``: back to env var/default)."""
    global _dir_override
    _dir_override = None if path is None else os.fspath(path)


def cache_dir() -> Path:
    return Path(_dir_override or env.autotune_cache_dir())


def entry_path(key: Mapping[str, Any]) -> Path:
    return cache_dir() / f"{key['kernel']}-{key_digest(key)}.json"


# Entries are a few kilobytes; anything far larger is not one of ours.
MAX_ENTRY_BYTES = 1 << 20


def _read(path: Path) -> tuple[Any, str | None]:
    """``(parsed JSON, None)``, or ``(None, why it cannot be parsed)``. Only a regular file
    of at most :data:`MAX_ENTRY_BYTES` is read: opening a FIFO blocks until a writer comes
    and a device such as ``/dev/zero`` never ends, and either would hang every lowering."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise
    except OSError as e:
        return None, f"unreadable ({type(e).__name__}: {e})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, "not a regular file"
        if st.st_size > MAX_ENTRY_BYTES:
            return None, f"{st.st_size} bytes, more than the {MAX_ENTRY_BYTES} an entry may have"
        with os.fdopen(fd, "rb") as f:
            fd = -1
            data = f.read(MAX_ENTRY_BYTES + 1)
        if len(data) > MAX_ENTRY_BYTES:
            return None, f"more than the {MAX_ENTRY_BYTES} bytes an entry may have"
        return json.loads(data.decode("utf-8")), None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"unreadable ({type(e).__name__}: {e})"
    finally:
        if fd >= 0:
            os.close(fd)


def _entry_at(path: Path) -> tuple[Any, str | None]:
    """``(entry, why it cannot be used)`` at ``path`` (this process's unwritten entries first),
    its shape checked; raises ``FileNotFoundError`` when there is none."""
    if str(path) in _memory:
        return _memory[str(path)], None
    entry, why = _read(path)
    return entry, why or entry_check.entry_problem(entry)


def _lookup(key: Mapping[str, Any]) -> tuple[Path, Any, str | None]:
    """``(path, entry, problem)``; ``entry`` is ``None`` when there is no entry at all."""
    path = entry_path(key)
    try:
        entry, why = _entry_at(path)
    except FileNotFoundError:
        return path, None, None
    # A digest collision or a hand-edited file must not hand back another key's result.
    if why is None and entry["key"] != json.loads(json.dumps(key)):
        why = "its key is not the key this file name stands for"
    return path, entry, why


def load(key: Mapping[str, Any]) -> dict | None:
    """The entry for ``key`` if one is stored and well formed (not checked against a
    declaration: use :func:`load_valid` before using its configs)."""
    _, entry, why = _lookup(key)
    return None if why else entry


def load_valid(decl: KernelDecl, key: Mapping[str, Any], dims: Mapping[str, int], params: Mapping[str, Any]
               ) -> dict | None:
    """The entry for ``key`` if every config in it is one ``decl`` can run, else ``None``
    (a bad entry is logged once, then treated as missing so that it is re-tuned)."""
    path, entry, why = _lookup(key)
    if entry is None and why is None:
        return None
    if why is None:
        space = entry_check.declared_space(decl, (dims, entry.get("tuned_dims")), params)
        why = entry_check.entry_problem(entry, decl, space)
    if why is None:
        return entry
    if (str(path), why) not in _reported:
        _reported.add((str(path), why))
        logging.warning("autotune %s: ignoring the cached result in %s: %s; it is re-tuned when tuning is on",
                        decl.name, path, why)
    return None


def store(key: Mapping[str, Any], entry: Mapping[str, Any]) -> Path:
    path = entry_path(key)
    full = {**entry, "key": key}
    try:
        _write(path, full)
    except OSError as e:
        _memory[str(path)] = json.loads(json.dumps(full))
        if str(path.parent) not in _unwritable:
            _unwritable.add(str(path.parent))
            logging.warning("autotune: cannot write the tuning cache in %s (%s); results are kept in memory for "
                            "this process only. Set %s or autotune.set_cache_dir() to a writable directory.",
                            path.parent, e, env.AUTOTUNE_CACHE)
        return path
    _memory.pop(str(path), None)
    return path


def _write(path: Path, entry: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def entries() -> Iterator[tuple[Path, Any, str | None]]:
    """Every entry in the cache directory and in memory: ``(path, entry, problem)``, with
    ``problem`` the reason a file cannot be used (its shape only, not its configs)."""
    d = cache_dir()
    paths = set()
    try:
        paths = {p for p in d.glob("*.json") if p.is_file()} if d.is_dir() else set()
    except OSError:
        pass
    for p in sorted(paths | {Path(m) for m in _memory if Path(m).parent == d}):
        try:
            entry, why = _entry_at(p)
        except FileNotFoundError:
            continue   # removed since the listing
        yield p, entry, why


def format_cache(decls: Mapping[str, KernelDecl] | None = None) -> str:
    """A human-readable table of every cached result; malformed entries are listed as bad
    with the reason. With ``decls`` (kernel name -> declaration) each entry's configs are
    also checked against its kernel's declared configs."""
    decls = decls or {}
    lines = [f"autotune cache: {cache_dir()}"]
    if cache_dir().exists() and not cache_dir().is_dir():
        lines.append("  (not a directory)")
    bad = 0
    for p, e, why in entries():
        where = "in memory: " if str(p) in _memory else ""
        decl = decls.get(e["key"].get("kernel")) if why is None else None
        if decl is not None:
            space = entry_check.declared_space(decl, (e.get("tuned_dims"),), _literal_params(e["key"]))
            why = entry_check.entry_problem(e, decl, space)
        if why:
            bad += 1
            lines.append(f"BAD  [{where}{p.name}]: {why}")
            continue
        k = e["key"]
        lines.append(f"{k.get('kernel')}  backend={k.get('backend')} dims={k.get('dims')} "
                     f"params={k.get('params')} dtypes={k.get('dtypes')} device={k.get('device')}")
        counts = " ".join(f"{name}={len(e.get(field, []))}" for name, field in (
            ("timed", "ranking"), ("rejected", "rejected"), ("failed", "failed"), ("pruned", "pruned")))
        lines.append(f"    best={e.get('best')} time_s={e.get('best_time_s')} {counts}  [{where}{p.name}]")
    if len(lines) == 1:
        lines.append("  empty: nothing is tuned here yet (python -m te_jax_perm.autotune --tune_shapes tunes the ops)")
    if bad:
        lines.append(f"{bad} bad entr{'y' if bad == 1 else 'ies'}: ignored when tuning is off, re-tuned when on")
    return "\n".join(lines)


def _literal_params(key: Mapping[str, Any]) -> dict:
    """The key's params (stored as ``repr``) back as values, where they are literals."""
    import ast

    out = {}
    params = key.get("params")
    for name, text in (params.items() if isinstance(params, dict) else ()):
        try:
            out[name] = ast.literal_eval(text)
        except (ValueError, SyntaxError, TypeError):
            continue
    return out
