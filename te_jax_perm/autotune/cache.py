"""The tuning key, and the results stored under it: one JSON file per key, written atomically.

The key holds exactly what can change the best config: the declaration's bucketed
``key_dims``, its ``key_params``, the operand dtypes and the kernel source, plus backend,
device kind and the Triton/jax versions. A dim or param it does not list never re-tunes.

The directory is ``set_cache_dir(...)``, else ``$TE_JAX_PERM_AUTOTUNE_CACHE``, else
``~/.cache/te_jax_perm/autotune``. Writes go through a temp file and ``os.replace``, so
concurrent processes only see complete files (last writer wins, both valid). When the
directory cannot be written, results are kept in memory for the process (one warning).

A cache file is data from disk: hand-edited, truncated, written by another version, or
corrupted. An entry is used only when it has the shape the tuner writes and every config
in it is one the declaration can produce (a declared config or its default, with the same
constant names, values and types: ``BLOCK=32.0`` is not ``BLOCK=32``); anything else would
put an unknown constexpr, a zero tile or a float into the compiled kernel. A bad entry is
reported once, ignored, and re-tuned when tuning is on.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import json
import math
import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import jax
import numpy as np
import triton
from absl import logging

from te_jax_perm.core import backends, env
from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.launch import Call


# -- the key -----------------------------------------------------------------------------------
def _source_hash(kernel: Any) -> str:
    # Triton parses a kernel's source (and its callees') the first time the kernel is hashed,
    # here by the cache below: under the lock the interpreter's launches parse under, as
    # lowerings in several threads would otherwise parse at once (see ``source_lock``).
    with env.source_lock:
        return _hashed_source(kernel)


@functools.lru_cache(maxsize=None)
def _hashed_source(kernel: Any) -> str:
    # Every lowering of a tunable kernel computes its key: read the source once. Triton's
    # own cache key hashes the source of every jitted function the kernel calls too, so a
    # change to a shared body (not only to the wrapper) invalidates tuned entries.
    src = getattr(kernel, "cache_key", None) or getattr(kernel, "src", None) \
        or inspect.getsource(getattr(kernel, "fn", kernel))
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def versions() -> dict[str, str]:
    return {"jax": jax.__version__, "triton": triton.__version__}


def device_kind(backend: str) -> str:
    """The key's device: :func:`~te_jax_perm.core.backends.device_kind`, one name for the
    Triton interpreter whatever the host."""
    return "cpu-interpreter" if backend == "interpret" else backends.device_kind()


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
        "source": _source_hash(decl.kernel),
    }


def call_key(call: Call) -> dict[str, Any]:
    """The key of a bound call."""
    return make_key(call.decl, call.dims, call.params, call.dtypes, call.backend)


def key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


# -- checking an entry -------------------------------------------------------------------------
_CONFIG_FIELDS = {"constants", "num_warps", "num_stages"}
# Fields the tuner writes as lists of records (counted by record_counts).
LIST_FIELDS = ("ranking", "rejected", "failed", "pruned", "skipped", "not_run")


def record_counts(entry: Mapping[str, Any]) -> dict[str, int]:
    """How many records each of ``entry``'s :data:`LIST_FIELDS` holds, in that order; the
    ranking's counted as ``timed`` (every config it lists was timed)."""
    return {"timed" if f == "ranking" else f: len(entry.get(f, [])) for f in LIST_FIELDS}


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
    if bad := {k: v for k, v in consts.items() if not isinstance(v, (int, str))}:   # bool is an int
        return f"config constants {bad!r} are not integers, booleans or strings"
    for field, low in (("num_warps", 1), ("num_stages", 0)):
        v = cfg_json[field]
        if not _is_int(v) or v < low:
            return f"config {field}={v!r} is not an integer >= {low}"
    return None


def _declared_space(decl: KernelDecl, dims_list: Iterable[Mapping[str, int] | None], params: Mapping[str, Any]
                    ) -> set[str] | None:
    """Canonical configs ``decl`` can run: its configs plus its default at each known dims of
    ``dims_list``; ``None`` when no default could be computed there (dims and params read
    from a file may not suit it), so that configs outside the declared list cannot be judged."""
    space, defaults = {canonical(c.to_json()) for c in decl.configs}, 0
    for dims in (d for d in dims_list if d is not None):
        with contextlib.suppress(Exception):  # noqa: BLE001 - no default at these dims
            space.add(canonical(decl.default_config(dims, params).to_json()))
            defaults += 1
    return space if defaults else None


def entry_problem(entry: Any, decl: KernelDecl | None = None, dims: Mapping[str, int] | None = None,
                  params: Mapping[str, Any] | None = None) -> str | None:
    """Why ``entry`` must not be used, or ``None``: its shape; with ``decl``, each config must
    be one ``decl`` can produce (declared, or its default at ``dims`` or the entry's tuned dims)."""
    if not isinstance(entry, dict):
        return f"the file holds {type(entry).__name__}, not a JSON object"
    if not isinstance(entry.get("key"), dict):
        return "it has no key object"
    for field in LIST_FIELDS:
        if field in entry and not isinstance(entry[field], list):
            return f"{field!r} is {type(entry[field]).__name__}, not a list"
    configs = []
    for item in entry.get("ranking", []):
        if not isinstance(item, list) or len(item) != 2:
            return f"ranking item {item!r} is not a [config, seconds] pair"
        cfg, t = item
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            return f"ranking time {t!r} is not a finite number of seconds"
        configs.append(cfg)
    if entry.get("best") is not None:
        configs.append(entry["best"])
        if configs[:-1] and entry["best"] != configs[0]:
            # The tuner stores its ranking's first as the best; lookups read the ranking.
            return "its best is not the first config of its ranking"
    tuned = entry.get("tuned_dims")
    if tuned is not None and (not isinstance(tuned, dict) or not all(_is_int(v) for v in tuned.values())):
        return f"tuned_dims {tuned!r} is not a mapping of integer dims"
    space = None if decl is None else _declared_space(decl, (dims, tuned), params or {})
    names = set() if decl is None else {frozenset(c.kw) for c in decl.configs}   # declared constant names
    for cfg in configs:
        if why := config_schema_problem(cfg):
            return why
        if names and frozenset(cfg["constants"]) not in names and (space is None or canonical(cfg) not in space):
            unknown = sorted(set(cfg["constants"]) - set().union(*names))
            return (f"config {Config.from_json(cfg)} has constants {sorted(cfg['constants'])}"
                    + (f" (unknown: {unknown})" if unknown else "") + f", not those {decl.name} declares")
        if space is not None and canonical(cfg) not in space:
            return f"config {Config.from_json(cfg)} is not one of {decl.name}'s declared configs or its default"
    return None


# -- the directory -----------------------------------------------------------------------------
_dir_override: str | None = None
# Entries tuned in this process whose file could not be written, by path.
_memory: dict[str, dict] = {}
_unwritable: set[str] = set()             # directories already warned about
_reported: set[tuple[str, str]] = set()   # (path, reason) of bad entries already warned about
_warned_lock = threading.Lock()


def _first_time(seen: set, item: Any) -> bool:
    """Adds ``item`` to ``seen``; whether it was new. The check and the add are one step:
    threads looking up the same bad entry (or storing into the same unwritable directory)
    at once must not both warn."""
    with _warned_lock:
        if item in seen:
            return False
        seen.add(item)
        return True


def set_cache_dir(path: str | os.PathLike | None) -> None:
    """Sets the cache directory for this process (``None``: back to env var/default). It is
    read when a kernel is lowered: a function ``jax.jit`` compiled before keeps the configs
    it picked then."""
    global _dir_override
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path is {type(path).__name__} {path!r:.60}; expected a directory (str or os.PathLike), "
                        "or None for TE_JAX_PERM_AUTOTUNE_CACHE or the default")
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
        # Checked on the descriptor, before Python's file object, which refuses a directory
        # with an error naming the descriptor's number instead of the path.
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None, "not a regular file"
        with open(fd, "rb") as f:
            data = f.read(MAX_ENTRY_BYTES + 1)   # one byte more tells an oversized file
        if len(data) > MAX_ENTRY_BYTES:
            return None, f"more than the {MAX_ENTRY_BYTES} bytes an entry may have"
        return json.loads(data.decode("utf-8")), None
    except FileNotFoundError:
        raise
    except NotADirectoryError:
        return None, _NOT_A_DIRECTORY
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        return None, f"unreadable ({type(e).__name__}: {e})"


def _entry_at(path: Path, decl: KernelDecl | None = None, dims: Mapping[str, int] | None = None,
              params: Mapping[str, Any] | None = None) -> tuple[Any, str | None]:
    """``(entry, why it must not be used)`` at ``path`` (:func:`entry_problem`), this
    process's unwritten entries first; raises ``FileNotFoundError`` when there is none."""
    entry, why = (_memory[str(path)], None) if str(path) in _memory else _read(path)
    return entry, why or entry_problem(entry, decl, dims, params)


def load(key: Mapping[str, Any], decl: KernelDecl | None = None, dims: Mapping[str, int] | None = None,
         params: Mapping[str, Any] | None = None) -> dict | None:
    """The entry for ``key`` if stored and well formed; with ``decl``, only if every config in
    it is one ``decl`` can run at ``dims`` (a bad entry is then logged once and treated as
    missing, so it is re-tuned)."""
    path = entry_path(key)
    try:
        entry, why = _entry_at(path, decl, dims, params)
    except FileNotFoundError:
        return None
    # A digest collision or a hand-edited file must not hand back another key's result.
    if why is None and entry["key"] != json.loads(json.dumps(key)):
        why = _KEY_MISMATCH
    if why is None:
        return entry
    # One report per file; one for the whole cache when its directory is no directory.
    where = str(path.parent) if why == _NOT_A_DIRECTORY else str(path)
    if decl is not None and _first_time(_reported, (where, why)):
        logging.warning("autotune %s: ignoring the cached result in %s: %s; it is re-tuned when tuning is on",
                        decl.name, path, why)
    return None


_KEY_MISMATCH = "its key is not the key this file name stands for"
_NOT_A_DIRECTORY = "the cache directory is not a directory"


def _stands_for(path: Path, key: Any) -> bool:
    """Whether ``path`` is the file name ``key`` is stored under."""
    try:
        return entry_path(key).name == path.name
    except (TypeError, ValueError, KeyError):   # a hand-made key the digest cannot take
        return False


def store(key: Mapping[str, Any], entry: Mapping[str, Any]) -> Path:
    path, full = entry_path(key), {**entry, "key": key}
    try:
        _write(path, full)
        _memory.pop(str(path), None)   # written: the file holds it now
    except OSError as e:
        _memory[str(path)] = json.loads(json.dumps(full))
        if _first_time(_unwritable, str(path.parent)):
            logging.warning("autotune: cannot write the tuning cache in %s (%s); results are kept in memory for "
                            "this process only. Set %s or autotune.set_cache_dir() to a writable directory.",
                            path.parent, e, env.AUTOTUNE_CACHE)
    return path


def _write(path: Path, entry: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        # mkstemp makes the file private (0600); an entry is no secret, and a cache directory
        # shared by the users of a machine must stay readable to all of them.
        os.chmod(tmp, 0o644)
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def format_cache(decls: Mapping[str, KernelDecl] | None = None) -> str:
    """A table of every cached result, bad ones with the reason; with ``decls`` (kernel name
    -> declaration) each entry's configs are checked against its kernel's too."""
    decls, d, bad, paths = decls or {}, cache_dir(), 0, set()
    lines = [f"autotune cache: {d}"]
    if d.exists() and not d.is_dir():
        lines.append("  (not a directory)")
    with contextlib.suppress(OSError):   # an unreadable directory lists nothing
        paths = {p for p in d.glob("*.json") if p.is_file()} if d.is_dir() else set()
    for p in sorted(paths | {Path(m) for m in _memory if Path(m).parent == d}):   # on disk and in memory
        try:
            e, why = _entry_at(p)
        except FileNotFoundError:
            continue   # removed since the listing
        where = "in memory: " if str(p) in _memory else ""
        if why is None and not _stands_for(p, e["key"]):
            why = _KEY_MISMATCH
        kernel = e["key"].get("kernel") if why is None else None
        if isinstance(kernel, str) and (decl := decls.get(kernel)) is not None:
            why = entry_problem(e, decl, params=_literal_params(e["key"]))
        if why:
            bad += 1
            lines.append(f"BAD  [{where}{p.name}]: {why}")
            continue
        k = e["key"]
        lines.append(f"{k.get('kernel')}  backend={k.get('backend')} dims={k.get('dims')} "
                     f"params={k.get('params')} dtypes={k.get('dtypes')} device={k.get('device')}")
        counts = " ".join(f"{name}={n}" for name, n in record_counts(e).items()
                          if name in ("timed", "rejected", "failed", "pruned"))
        lines.append(f"    best={e.get('best')} time_s={e.get('best_time_s')} {counts}  [{where}{p.name}]")
    if len(lines) == 1:
        lines.append("  empty: nothing is tuned here yet (python -m te_jax_perm.autotune --tune_shapes tunes the ops)")
    if bad:
        lines.append(f"{bad} bad entr{'y' if bad == 1 else 'ies'}: ignored when tuning is off, re-tuned when on")
    return "\n".join(lines)


def _literal_params(key: Mapping[str, Any]) -> dict:
    """The key's params (stored as ``repr``) back as values, where they are literals."""
    out, params = {}, key.get("params")
    for name, text in (params.items() if isinstance(params, dict) else ()):
        with contextlib.suppress(ValueError, SyntaxError, TypeError):   # not a literal: left out
            out[name] = ast.literal_eval(text)
    return out
