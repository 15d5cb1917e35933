"""Extension points of ``core``: config resolution and call and launch observation.

``core`` imports nothing above it, so the packages that extend it register here: the
autotuner installs the config resolver (at ``import te_jax_perm``, so cached tuning
results are always used), the sanitizer adds a launch observer while a session is open,
and tools that want to see which kernels a function calls add a call observer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

import jax
import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    from te_jax_perm.core.declaration import Config
    from te_jax_perm.core.launch import Call

# (call) -> the config of a call that names none (e.g. the tuned one), or None: the default.
ConfigResolver = Callable[["Call"], "Config | None"]


@dataclasses.dataclass(frozen=True)
class BufferInfo:
    """One buffer a launch passes to its kernel, as launch observers see it."""

    name: str          # operand/output name; preallocs are "<output>.prealloc"
    role: str          # "input", "prealloc" or "output"
    address: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]
    # An output the kernel must store in full: it does not start as zeros, so a byte no
    # program stores is returned as allocated (memory nobody wrote).
    full_write: bool = False

    @property
    def itemsize(self) -> int:
        return max(1, np.dtype(self.dtype).itemsize)

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


_lock = threading.RLock()
# The installed resolver, as the global value of a JAX user context: jax.jit keys its caches
# on it, so a function lowered under one resolver is lowered again under another.
_resolver = jax.make_user_context(None)
_call_observers: list[Callable[["Call"], None]] = []
# Each has launch_begin(kernel_name, buffers, grid3) and launch_end(); the ``interpret``
# backend calls them around every launch (the program running is the interpreter's grid_idx).
_launch_observers: list[Any] = []


def set_config_resolver(resolver: ConfigResolver | None) -> ConfigResolver | None:
    """Installs ``resolver`` (``None`` removes it) for the process; returns the one it
    replaces. A jitted function called afterwards is lowered again (``jax.jit`` keys its
    cache on the resolver), so its configs are the new resolver's."""
    with _lock:
        previous = _resolver.get_global()
        _resolver.set_global(resolver)
    return previous


@contextlib.contextmanager
def using_config_resolver(resolver: ConfigResolver | None) -> Iterator[None]:
    """Within the context, ``resolver`` (``None``: none, defaults only) picks configs."""
    previous = set_config_resolver(resolver)
    try:
        yield
    finally:
        set_config_resolver(previous)


@contextlib.contextmanager
def observe_calls(observer: Callable[["Call"], None]) -> Iterator[Callable[["Call"], None]]:
    """Within the context, ``observer`` sees every call whose config is being chosen
    (at lowering time), in order. Only lowerings done inside are seen: JAX keeps a
    function's lowering for the same arguments and settings, also across new ``jax.jit``
    wrappers of the same function object, so observe a function not lowered before."""
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
    resolver = _resolver.value
    return resolver(call) if resolver is not None else None


def add_launch_observer(observer: Any) -> None:
    with _lock:
        _launch_observers.append(observer)


def remove_launch_observer(observer: Any) -> None:
    with _lock:
        _launch_observers.remove(observer)


def launch_observers() -> tuple[Any, ...]:
    with _lock:
        return tuple(_launch_observers)
