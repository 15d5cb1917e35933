"""Value checks: at once for concrete arrays, when the program runs for traced ones.

Traced values are checked only under ``TE_JAX_PERM_CHECKS=1``, through
``jax.debug.callback``: it runs under ``jit``, ``grad`` and ``vmap``, on CPU and GPU, with
no ``checkify`` wrapper around the user's function. A failure there raises
:class:`CheckError`, which JAX reports as a ``JaxRuntimeError`` holding our message.
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
    """Raises :class:`CheckError` with ``problem(*values)`` (NumPy arrays in, ``None`` when
    fine) if it returns a message: now for concrete arrays, else when the program runs."""
    values = [concrete(a) for a in arrays]
    if all(v is not None for v in values):
        _raise_problem(problem, *values)
    elif env.checks():
        jax.debug.callback(functools.partial(_raise_problem, problem), *arrays)


def _raise_problem(problem: Callable[..., "str | None"], *values: Any) -> None:
    if message := problem(*(np.asarray(v) for v in values)):
        raise CheckError(message)
