"""Extension points of ``core``: config resolution and launch observation.

``core`` imports nothing above it; the packages that extend it register here instead:
the autotuner installs the config resolver (``te_jax_perm`` does it at import, so cached
tuning results are always used), the sanitizer adds a launch observer while a session is
open. Tools that only want to see which kernels a function calls add a call observer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import TYPE_CHECKING, Callable, Iterator, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from te_jax_perm.core.declaration import Config
    from te_jax_perm.core.launch import Call


class ConfigResolver(Protocol):
    """Picks the config of a call that names none (e.g. the tuned one); ``None``: no opinion,
    the declaration's default is used."""

    def __call__(self, call: "Call") -> "Config | None": ...


CallObserver = Callable[["Call"], None]


@dataclasses.dataclass(frozen=True)
class BufferInfo:
    """One buffer a launch passes to its kernel, as launch observers see it."""

    name: str          # operand/output name; preallocs are "<output>.prealloc"
    role: str          # "input", "prealloc" or "output"
    address: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]


class LaunchObserver(Protocol):
    """Sees each launch the ``interpret`` backend runs, program by program."""

    def launch_begin(self, kernel_name: str, buffers: Sequence[BufferInfo], grid: tuple[int, int, int]) -> None: ...
    def program_begin(self, pid: tuple[int, int, int]) -> None: ...
    def launch_end(self) -> None: ...


_lock = threading.RLock()
_resolver: list[ConfigResolver | None] = [None]
_call_observers: list[CallObserver] = []
_launch_observers: list[LaunchObserver] = []


# -- config resolution ------------------------------------------------------------------------
def set_config_resolver(resolver: ConfigResolver | None) -> ConfigResolver | None:
    """Installs ``resolver`` (``None`` removes it); returns the one it replaces."""
    with _lock:
        previous, _resolver[0] = _resolver[0], resolver
    return previous


def config_resolver() -> ConfigResolver | None:
    return _resolver[0]


@contextlib.contextmanager
def using_config_resolver(resolver: ConfigResolver | None) -> Iterator[None]:
    """Within the context, ``resolver`` (``None``: none, defaults only) picks configs."""
    previous = set_config_resolver(resolver)
    try:
        yield
    finally:
        set_config_resolver(previous)


@contextlib.contextmanager
def observe_calls(observer: CallObserver) -> Iterator[CallObserver]:
    """Within the context, ``observer`` sees every call whose config is being chosen
    (at lowering time), in order."""
    with _lock:
        _call_observers.append(observer)
    try:
        yield observer
    finally:
        with _lock:
            _call_observers.remove(observer)


def notify_call(call: "Call") -> None:
    for observer in list(_call_observers):
        observer(call)


def resolve_config(call: "Call") -> "Config | None":
    """The installed resolver's pick for ``call``, if any."""
    resolver = _resolver[0]
    return resolver(call) if resolver is not None else None


# -- launch observation -----------------------------------------------------------------------
def add_launch_observer(observer: LaunchObserver) -> None:
    with _lock:
        _launch_observers.append(observer)


def remove_launch_observer(observer: LaunchObserver) -> None:
    with _lock:
        _launch_observers.remove(observer)


def launch_observers() -> tuple[LaunchObserver, ...]:
    with _lock:
        return tuple(_launch_observers)
