"""Sanitizer sessions: the context manager, the environment switch, and ``check``.

One launch observer is registered (``core.hooks``) while any session is open; each
launch is recorded once and its hazards go to every open session.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Sequence

from absl import logging

from te_jax_perm.core import env, hooks
from te_jax_perm.core.hooks import BufferInfo
from te_jax_perm.sanitize import tracer
from te_jax_perm.sanitize.hazards import HazardError, Report

ENV_VAR = env.SANITIZE


class Session:
    """One open sanitizer scope: collects a :class:`Report`."""

    def __init__(self, raise_first: bool):
        self.raise_first = raise_first
        self.report = Report()


class _Hub:
    """The single launch observer; fans results out to open sessions."""

    def __init__(self):
        self.sessions: list[Session] = []
        self.rec: tracer.LaunchRecord | None = None
        self.lock = threading.RLock()
        # The HazardError the last raising launch raised: inside a jitted function it reaches
        # the caller only as text in XLA's runtime error, and hazard_error gives it back.
        self.raised: HazardError | None = None

    def launch_begin(self, kernel_name: str, buffers: Sequence[BufferInfo], grid: tuple[int, int, int]) -> None:
        raise_first = any(s.raise_first for s in self.sessions)
        self.rec = tracer.LaunchRecord(kernel_name, buffers, tuple(grid), raise_first)
        tracer.begin(self.rec)

    def program_begin(self, pid: tuple[int, int, int]) -> None:
        self.rec.set_pid(pid)

    def launch_end(self) -> None:
        rec, self.rec = self.rec, None
        tracer.end(rec)
        hazards, in_place, summary = tracer.analyse(rec)
        hazards = rec.oob + hazards
        for s in self.sessions:
            s.report.launches.append(summary)
            s.report.extend(hazards)
            s.report.in_place.extend(in_place)
        for h in hazards:
            logging.warning("te_jax_perm sanitizer: %s", h.text())
        if rec.raise_first and (rec.failed or hazards):
            # rec.failed: the tracer raised at the out-of-bounds access, the last one it recorded.
            self.raised = HazardError(rec.oob[-1] if rec.failed else hazards[0])
            if not rec.failed:
                raise self.raised


_hub = _Hub()


def _open(session: Session) -> None:
    with _hub.lock:
        if not _hub.sessions:
            hooks.add_launch_observer(_hub)
        _hub.sessions.append(session)


def _close(session: Session) -> None:
    with _hub.lock:
        _hub.sessions.remove(session)
        if not _hub.sessions:
            hooks.remove_launch_observer(_hub)


@contextlib.contextmanager
def sanitize(raise_on_first: bool = False) -> Iterator[Report]:
    """Sanitizes every kernel launched through the ``interpret`` backend inside the scope.

    Yields a :class:`Report` that fills in as launches run. With ``raise_on_first``, the
    first hazard raises :class:`HazardError` (out-of-bounds accesses at the access; overlaps
    when the launch ends); otherwise all hazards are collected.

    JAX dispatches asynchronously: block on results (``jax.block_until_ready``) inside the
    scope, or use :func:`check`, so that launches run before the scope closes.

    The scope places computations on the first CPU device (``jax.default_device``): the
    interpreter runs kernels on host buffers, also on a machine whose default device is a
    GPU. Arrays already committed to a GPU must be moved (:func:`check` moves its
    arguments).
    """
    import jax

    session = Session(raise_on_first)
    _open(session)
    try:
        with jax.default_device(jax.devices("cpu")[0]):
            yield session.report
    except HazardError:
        raise
    except Exception as e:  # noqa: BLE001 - a hazard raised inside XLA's callback arrives wrapped
        if raise_on_first and session.report.hazards:
            raise HazardError(session.report.hazards[0]) from e
        raise
    finally:
        _close(session)


def hazard_error(err: BaseException) -> HazardError | None:
    """The :class:`HazardError` that ``err`` is or reports, else ``None``.

    A hazard raised while a function you ``jax.jit`` runs reaches you as XLA's
    ``JaxRuntimeError``: the sanitizer runs inside the host callback that executes the
    kernel, and XLA hands an exception raised there on only as text (after its own prefix
    and a traceback), which no code of this library sees on its way to you. That text ends
    with the HazardError's message; given such an error, this returns the HazardError itself
    (with its ``.hazard``)::

        try:
            jax.block_until_ready(jitted(x))
        except Exception as e:
            if (h := hazard_error(e)) is not None:
                raise h from e
            raise

    Inside a ``sanitize(raise_on_first=True)`` scope, and for eager calls, the HazardError
    already arrives as itself.
    """
    if isinstance(err, HazardError):
        return err
    raised = _hub.raised
    if raised is not None and str(raised) in str(err):
        return raised
    return None


def check(fn: Callable[..., Any], *args: Any, raise_on_first: bool = False, **kwargs: Any) -> Report:
    """Runs ``fn(*args, **kwargs)`` to completion under the sanitizer, its array arguments
    moved to the CPU (see :func:`sanitize`); returns the report."""
    import jax

    cpu = jax.devices("cpu")[0]
    on_cpu = lambda v: jax.device_put(v, cpu) if isinstance(v, jax.Array) else v  # noqa: E731
    args, kwargs = jax.tree.map(on_cpu, (args, kwargs))
    with sanitize(raise_on_first) as report:
        jax.block_until_ready(fn(*args, **kwargs))
    return report


_env_session: Session | None = None


def env_session() -> Session | None:
    """Opens (once) the process-wide session requested by ``TE_JAX_PERM_SANITIZE``.

    ``raise`` raises on the first hazard; ``collect`` (or ``1``) logs and collects into
    :func:`env_report`. Called once when ``te_jax_perm`` is imported.
    """
    global _env_session
    mode = env.sanitize()
    if mode is None:
        return None
    if _env_session is None:
        _env_session = Session(mode == "raise")
        _open(_env_session)
    return _env_session


def env_report() -> Report | None:
    """The report of the environment-enabled session, if one is open."""
    return None if _env_session is None else _env_session.report
