"""The environment variables the library reads, parsed in one place.

An unknown value is an error naming the variable, the value and what it accepts: a typo
such as ``TE_JAX_PERM_AUTOTUNE=" 1"`` must not silently mean "off".

They are process-level settings, read when an op is traced or lowered (the sanitizer's once,
at import). ``jax.jit`` does not key its cache on them: a function it traced before a
variable changed keeps what it was traced with. The scoped settings that override them
(``use_backend``, ``autotune.autotuning`` and ``autotune.enable``) are in jit's cache key.

Beside them, the process-wide Triton state every backend shares: the line-info switch of
compiles and the lock that kernel-source parses take.
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Mapping

BACKEND = "TE_JAX_PERM_BACKEND"
AUTOTUNE = "TE_JAX_PERM_AUTOTUNE"
SANITIZE = "TE_JAX_PERM_SANITIZE"
AUTOTUNE_CACHE = "TE_JAX_PERM_AUTOTUNE_CACHE"
CHECKS = "TE_JAX_PERM_CHECKS"

BACKEND_VALUES = ("triton", "interpret", "xla")
_SWITCH = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
# None: no sanitizer session; otherwise the session's mode ("on" words collect).
_SANITIZE = {"raise": "raise", "collect": "collect", **{k: "collect" if v else None for k, v in _SWITCH.items()}}


class EnvironmentValueError(ValueError):
    """An environment variable of this library holds a value it does not accept."""


def _lookup(var: str, table: Mapping[str, object]) -> object:
    raw = os.environ.get(var)
    if not raw:
        return None
    if raw.lower() not in table:
        raise EnvironmentValueError(f"{var}={raw!r} is not a value it accepts; use one of "
                                    f"{', '.join(table)} (or leave it unset)")
    return table[raw.lower()]


def backend() -> str | None:
    """``TE_JAX_PERM_BACKEND``: the default backend, or ``None`` for the platform's (read
    when an op is traced)."""
    return _lookup(BACKEND, {b: b for b in BACKEND_VALUES})  # type: ignore[return-value]


def autotune() -> bool:
    """``TE_JAX_PERM_AUTOTUNE``: tune on a cache miss (read when a kernel is lowered)."""
    return bool(_lookup(AUTOTUNE, _SWITCH))


def sanitize() -> str | None:
    """``TE_JAX_PERM_SANITIZE``: ``"raise"``, ``"collect"`` or ``None`` (off); read at
    ``import te_jax_perm``."""
    return _lookup(SANITIZE, _SANITIZE)  # type: ignore[return-value]


def autotune_cache_dir() -> str:
    """``TE_JAX_PERM_AUTOTUNE_CACHE``: where tuning results persist (any path; default
    ``~/.cache/te_jax_perm/autotune``)."""
    return os.environ.get(AUTOTUNE_CACHE) or os.path.join(os.path.expanduser("~"), ".cache", "te_jax_perm", "autotune")


def triton_cache_dir() -> str:
    """Triton's own ``TRITON_CACHE_DIR``, else the directory Triton defaults to: compile
    workers share it with their parent, which then loads their binaries as cache hits."""
    return os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")


def checks() -> bool:
    """``TE_JAX_PERM_CHECKS``: also check traced values against the ops' contracts when the
    program runs (read when an op is traced)."""
    return bool(_lookup(CHECKS, _SWITCH))


def check_all() -> None:
    """Raises on the first variable holding a value it does not accept."""
    for read in (backend, autotune, sanitize, checks):
        read()


@contextlib.contextmanager
def triton_cache_dir_kept() -> Iterator[None]:
    """Puts ``TRITON_CACHE_DIR`` back after the block: jax-triton (imported by tokamax)
    blanks it at import, after which every ``triton.compile`` fails with "Could not create
    or locate cache dir" (and the autotuner's pool hands binaries over that cache)."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved


# Triton's interpreter keeps the grid position in one global builder, and XLA's CPU runtime
# may run independent custom calls on different threads: interpreted launches must not
# interleave. A launch also parses kernel sources (its first one of a kernel), and CPython
# 3.11's parser fails ("AST constructor recursion depth mismatch") when threads parse at
# once: whatever else parses a kernel's source (Triton's cache key, on a kernel's first
# hash; Triton's compiler) holds it too.
source_lock = threading.RLock()

TRITON_LINE_INFO = "TRITON_DISABLE_LINE_INFO"
_line_info_lock = threading.Lock()


@contextlib.contextmanager
def triton_line_info_off() -> Iterator[None]:
    """Compiles in the block carry no source-line debug info, unless the user set Triton's
    ``TRITON_DISABLE_LINE_INFO`` themselves (``=0`` keeps it, e.g. for a profiler's source
    view). Line info does not change the machine code, but it more than doubles the PTX that
    rides in each kernel call's payload, and XLA's Triton call reads that payload on every
    execution: at a few tokens, where the host sets the step's pace, that is measurable.
    Triton reads the variable (and keys its cache on it) during the compile; the lock keeps
    one thread's restore from landing inside another's compile."""
    with _line_info_lock:
        if TRITON_LINE_INFO in os.environ:
            yield
            return
        os.environ[TRITON_LINE_INFO] = "1"
        try:
            yield
        finally:
            os.environ.pop(TRITON_LINE_INFO, None)
