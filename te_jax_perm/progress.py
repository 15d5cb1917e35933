"""Progress of a long run of similar steps (tuning, benchmarking): count, elapsed, time left.

The estimate assumes the steps left cost what the steps done cost on average, and never
exceeds what is left of a time budget (the run stops starting steps when the budget ends).
"""
from __future__ import annotations

import time
from typing import Callable


def duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"``, ``"1h02m"``."""
    s = int(round(max(0.0, seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Progress:
    """``total`` steps of work; :meth:`line` after ``done`` of them (fractions allowed)."""

    def __init__(self, total: float, budget_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.budget_s, self.clock = total, budget_s, clock
        self.start = clock()

    def left_s(self, done: float) -> float | None:
        """Estimated seconds left after ``done`` steps (``None`` before the first step)."""
        elapsed = self.clock() - self.start
        if done <= 0:
            return None if self.budget_s is None else self.budget_s - elapsed
        left = elapsed / done * max(0.0, self.total - done)
        if self.budget_s is not None:
            left = min(left, max(0.0, self.budget_s - elapsed))
        return left

    def line(self, done: float, count: str | None = None) -> str:
        """``"12/56, 31s elapsed, about 1m20s left"``; ``count`` replaces the ``"12/56"``."""
        elapsed = self.clock() - self.start
        left = self.left_s(done)
        tail = "" if left is None or done >= self.total else f", about {duration(left)} left"
        return f"{count or f'{done:g}/{self.total:g}'}, {duration(elapsed)} elapsed{tail}"
