"""Our exceptions, given back as themselves after XLA quoted them.

An exception raised in code XLA runs (a kernel's host callback, a custom_partitioning
callback) reaches the caller only as the text of XLA's runtime error, which quotes it as
``<type>: <message>``. :func:`keep` remembers such an exception where it is raised;
:func:`original` finds it again in a runtime error quoting it. JAX's compile step asks
:func:`original` of every runtime error it raises, so a partitioning callback's error
reaches the caller of ``jit`` as itself; an eager ``interpret`` call and the sanitizer's
``hazard_error`` ask it of the runtime errors they see.
"""
from __future__ import annotations

import threading

from jax._src import compiler

# By quoted text, each text's exceptions in the order they were raised; XLA's callbacks may
# run on any thread. A list, not one exception: threads that fail with the same text at once
# (the same bad call from several request threads) must each find one, where one slot would
# hand the first thread's lookup the second's exception and leave the second with none.
_kept: dict[str, list[BaseException]] = {}
_lock = threading.Lock()
_MAX_KEPT = 64


def keep(err: BaseException) -> BaseException:
    """``err``, remembered until a runtime error quoting it is given to :func:`original`."""
    with _lock:
        if sum(map(len, _kept.values())) >= _MAX_KEPT:   # raised but never asked for: forget them
            _kept.clear()
        _kept.setdefault(f"{type(err).__name__}: {err}", []).append(err)
    return err


def original(runtime_error: BaseException, forget: bool = True, traceback: bool = False) -> BaseException | None:
    """The kept exception ``runtime_error`` quotes (with ``forget``, forgotten once found),
    else ``None``; with ``traceback``, it keeps the frames it was raised through (for a
    kernel run by the interpreter, the kernel's own line), else it has none."""
    text = str(runtime_error)
    with _lock:
        quoted = next((q for q in _kept if q in text), None)
        if quoted is None:
            return None
        same = _kept[quoted]
        err = same.pop(0) if forget else same[0]
        if not same:
            del _kept[quoted]
    return err if traceback else err.with_traceback(None)


compiler.register_xla_runtime_error_handler(original)
