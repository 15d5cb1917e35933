"""Value checks: at once for concrete arrays, when the program runs for traced ones.

Shapes and dtypes are checked while tracing. Values are checked where they are known:
concrete (non-traced) arrays at once, before anything casts them; traced ones only in the
checked mode (``TE_JAX_PERM_CHECKS=1``), on the device's values when the program runs,
through ``jax.debug.callback``: it runs under ``jit``, ``grad`` and ``vmap``, on CPU and
GPU, and needs no ``checkify`` wrapper around the user's function. A failed run-time check
raises :class:`CheckError` in the callback, which JAX reports as an error of the
computation (a ``JaxRuntimeError`` whose message holds ours).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

from te_jax_perm.core import env


class CheckError(ValueError):
    """A value breaks an op's contract."""


def concrete(x: Any) -> np.ndarray | None:
    """``x``'s values when they are known while tracing, uncast; ``None`` for a tracer."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def check_values(problem: Callable[..., "str | None"], *arrays: Any) -> None:
    """Raises :class:`CheckError` with ``problem(*values)`` when it returns a message.

    ``problem`` takes NumPy arrays and returns ``None`` when they are fine. Concrete arrays
    are checked now; when any is traced, only in the checked mode, when the program runs.
    """
    values = [concrete(a) for a in arrays]
    if all(v is not None for v in values):
        _raise_problem(problem, *values)
    elif env.checks():
        jax.debug.callback(functools.partial(_raise_problem, problem), *arrays)


def _raise_problem(problem: Callable[..., "str | None"], *values: Any) -> None:
    message = problem(*(np.asarray(v) for v in values))
    if message:
        raise CheckError(message)
