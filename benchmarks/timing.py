"""Wall time of jitted steps of milliseconds, whose host dispatch is negligible beside them.

:func:`wall_ms` times calls each waited for; :func:`interleaved_ms` times several steps both
that way and enqueued one after another (as a training loop runs its steps), in turns, so
that a ratio of two of them is taken at the same GPU temperature and clock (a busy GPU's
steps slow down by a few percent over seconds of work). Kernels of microseconds are timed by
the profiler instead (``benchmarks/kernel_timer.py``).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax


def _waited_ms(fn: Callable[..., Any], args: Sequence[Any]) -> float:
    """Wall milliseconds of one call ``fn(*args)``, waited for."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) * 1e3


def back_to_back(fn: Callable[[], Any], calls: int, wait: Callable[[Any], Any] | None = None) -> Any:
    """``calls`` calls of ``fn()`` (at least one) enqueued one after another, the host
    waiting (``wait``, by default ``jax.block_until_ready``) only for the last, which the
    device's stream runs after the others; each call's results are dropped before the next
    is enqueued, so one call's buffers are live at a time. Returns the last call's results."""
    for _ in range(calls - 1):
        fn()
    out = fn()
    (wait or jax.block_until_ready)(out)   # looked up per call, as a test's stand-in is
    return out


def _back_to_back_ms(fn: Callable[..., Any], args: Sequence[Any], calls: int) -> float:
    """Milliseconds per call of ``calls`` calls ``fn(*args)`` enqueued back to back, the host
    waiting only for the last: a training loop's time per step, where the host enqueues a
    step while the device still runs the one before, so the host's per-call cost (argument
    handling, command-buffer updates) overlaps device work instead of adding to it
    (:func:`back_to_back`)."""
    t0 = time.perf_counter()
    back_to_back(lambda: fn(*args), calls)
    return (time.perf_counter() - t0) * 1e3 / calls


def wall_ms(fn: Callable[..., Any], args: Sequence[Any], reps: int) -> list[float]:
    """Wall milliseconds of each of ``reps`` calls ``fn(*args)`` (at least one), each blocked
    until ready, after one untimed call that compiles."""
    jax.block_until_ready(fn(*args))
    return [_waited_ms(fn, args) for _ in range(max(1, reps))]


def median_wall_ms(fn: Callable[..., Any], args: Sequence[Any], reps: int) -> float:
    """The median of :func:`wall_ms`."""
    return statistics.median(wall_ms(fn, args, reps))


def interleaved_ms(fns: dict[str, tuple[Callable[..., Any], Sequence[Any]]], calls: int,
                   rounds: int = 3) -> dict[str, tuple[float, float]]:
    """``name -> (back-to-back ms, waited-for ms)`` per call of each ``fn(*args)``, timed in
    ``rounds`` turns: every turn runs each function's ``calls`` calls back to back once
    (:func:`_back_to_back_ms`) and then ``calls`` calls each waited for, the functions in an
    order rotated by one each turn. Back-to-back: the median over turns; waited for: the
    median of every waited-for call. Sustained load heats a GPU and lowers its clock within
    seconds (steps of one function 3% slower after a few seconds of back-to-back steps on an
    H100), so functions timed one after another would be timed at different clocks; in
    turns each sees the same mix."""
    names = list(fns)
    for fn, args in fns.values():
        jax.block_until_ready(fn(*args))  # compiles, outside the timing
    b2b: dict[str, list[float]] = {n: [] for n in names}
    waited: dict[str, list[float]] = {n: [] for n in names}
    calls = max(1, calls)
    for r in range(max(1, rounds)):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn, args = fns[name]
            b2b[name].append(_back_to_back_ms(fn, args, calls))
            waited[name] += [_waited_ms(fn, args) for _ in range(calls)]
    return {n: (statistics.median(b2b[n]), statistics.median(waited[n])) for n in names}
