"""Sanitizer sessions: the context manager, the environment switch, and ``check``.

One launch observer is registered (``core.hooks``) while any session is open; each
launch is recorded once and its hazards go to every open session.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

import jax
from absl import logging

from te_jax_perm import _checks
from te_jax_perm.core import env, errors, hooks
from te_jax_perm.core.hooks import BufferInfo
from te_jax_perm.sanitize import tracer
from te_jax_perm.sanitize.hazards import HazardError, Report

ENV_VAR = env.SANITIZE


class _Hub:
    """The single launch observer; fans each launch's results out to the open sessions,
    each a ``(raise_first, Report)`` pair."""

    def __init__(self):
        self.sessions: list[tuple[bool, Report]] = []
        self.lock = threading.RLock()

    def launch_begin(self, kernel_name: str, buffers: Sequence[BufferInfo], grid: tuple[int, int, int]) -> None:
        tracer.begin(tracer.LaunchRecord(kernel_name, buffers, tuple(grid), any(r for r, _ in self.sessions)))

    def launch_end(self) -> None:
        rec = tracer.end()
        hazards, in_place, summary = tracer.analyse(rec)
        hazards = rec.oob + hazards
        for _, report in self.sessions:
            report.launches.append(summary)
            report.hazards.extend(hazards)
            report.in_place.extend(in_place)
        for h in hazards:
            logging.warning("te_jax_perm sanitizer: %s", h.text())
        if rec.raise_first and hazards and not rec.failed:   # failed: raised at the out-of-bounds access
            raise HazardError(hazards[0])

    def open(self, raise_first: bool) -> tuple[bool, Report]:
        with self.lock:
            if not self.sessions:
                hooks.add_launch_observer(self)
            self.sessions.append((raise_first, Report()))
            return self.sessions[-1]

    def close(self, session: tuple[bool, Report]) -> None:
        with self.lock:
            # By identity: two sessions' empty reports compare equal.
            self.sessions = [s for s in self.sessions if s is not session]
            if not self.sessions:
                hooks.remove_launch_observer(self)


_hub = _Hub()


@contextlib.contextmanager
def sanitize(raise_on_first: bool = False) -> Iterator[Report]:
    """Sanitizes every kernel launched through the ``interpret`` backend inside the scope.

    Yields a :class:`Report` that fills in as launches run; with ``raise_on_first`` the
    first hazard raises :class:`HazardError` (out of bounds at the access, overlaps when the
    launch ends). Block on results inside the scope (JAX dispatches asynchronously), or use
    :func:`check`. Computations go to the first CPU device, as the interpreter runs on host
    buffers; arrays committed to a GPU must be moved (:func:`check` moves its arguments).
    While open, the scope sees the launches of every thread in the process, not only this
    one's: a kernel runs in XLA's host callback, which need not run on the calling thread.
    """
    # A string ("no") or None would otherwise be read by its truth value.
    session = _hub.open(_checks.check_static_bool("sanitize: raise_on_first", raise_on_first))
    report = session[1]
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            yield report
    except Exception as e:  # noqa: BLE001 - a hazard raised inside XLA's callback arrives wrapped
        if raise_on_first and report.hazards and not isinstance(e, HazardError):
            raise HazardError(report.hazards[0]) from e
        raise
    finally:
        _hub.close(session)


def hazard_error(err: BaseException) -> HazardError | None:
    """The :class:`HazardError` that ``err`` is or reports, else ``None``.

    A hazard raised while a function you ``jax.jit`` runs reaches you as XLA's
    ``JaxRuntimeError``: the sanitizer runs in the host callback that executes the kernel,
    and XLA hands an exception raised there on only as text, ending with the HazardError's
    message. Given such an error this returns the HazardError itself (with its ``.hazard``).
    Inside a ``sanitize(raise_on_first=True)`` scope, and for eager calls, it already
    arrives as itself.
    """
    found = err if isinstance(err, HazardError) else errors.original(err, forget=False)
    return found if isinstance(found, HazardError) else None


def check(fn: Callable[..., Any], *args: Any, raise_on_first: bool = False, **kwargs: Any) -> Report:
    """Runs ``fn(*args, **kwargs)`` to completion under the sanitizer, its array arguments
    moved to the CPU (see :func:`sanitize`); returns the report."""
    cpu = jax.devices("cpu")[0]
    on_cpu = lambda v: jax.device_put(v, cpu) if isinstance(v, jax.Array) else v  # noqa: E731
    args, kwargs = jax.tree.map(on_cpu, (args, kwargs))
    with sanitize(raise_on_first) as report:
        jax.block_until_ready(fn(*args, **kwargs))
    return report


_env_session: list[tuple[bool, Report]] = []


def env_session() -> None:
    """Opens (once) the process-wide session ``TE_JAX_PERM_SANITIZE`` asks for (at
    ``import te_jax_perm``): ``raise`` raises on the first hazard; ``collect`` (or ``1``)
    logs and collects into :func:`env_report`."""
    mode = env.sanitize()
    if mode is not None and not _env_session:
        _env_session.append(_hub.open(mode == "raise"))


def env_report() -> Report | None:
    """The report of the environment-enabled session, if one is open."""
    return _env_session[0][1] if _env_session else None
