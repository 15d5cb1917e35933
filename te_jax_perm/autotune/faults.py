"""Fault injection for tests: make chosen configs abort, segfault or hang in the compile
worker, exactly as a compiler crash would."""
from __future__ import annotations

import contextlib
from typing import Iterator

from te_jax_perm.core.declaration import Config

FAULT_KINDS = ("abort", "segfault", "hang", "raise")
_faults: dict[tuple[str, Config], str] = {}


@contextlib.contextmanager
def inject_compile_fault(kernel_name: str, config: Config, kind: str = "abort") -> Iterator[None]:
    """While active, compiling ``config`` of kernel ``kernel_name`` fails with ``kind``."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {kind!r}")
    _faults[(kernel_name, config)] = kind
    try:
        yield
    finally:
        _faults.pop((kernel_name, config), None)


def fault_for(kernel_name: str, config: Config) -> str | None:
    return _faults.get((kernel_name, config))
