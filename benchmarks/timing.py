"""Device-side timing of a jitted function: a chain of ``n`` dependent calls per dispatch.

One host dispatch runs ``fn`` ``n`` times inside a single jit (a loop). Each call's first
argument gets one element rewritten (to its own value) from one element of the previous
call's output, a true data dependency, so XLA can neither CSE the calls nor hoist them out
of the loop (``optimization_barrier`` alone does not survive XLA's pipeline). The first
argument is donated, so the one-element update happens in place and no extra copy of it is
made; the cost is a couple of tiny kernels per call (microseconds), which only ever makes
an op look slower. The figure per call is (wall time of the chain, blocked until ready) /
n; we report the median over ``reps`` chains and the spread.

For steps of milliseconds, whose host dispatch is negligible beside them, :func:`wall_ms`
times plain calls instead, each waited for; :func:`interleaved_ms` times several steps both
that way and enqueued one after another (as a training loop runs its steps), in turns, so
that a ratio of two of them is taken at the same GPU temperature and clock (a busy GPU's
steps slow down by a few percent over seconds of work).
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    min_s: float
    n_chain: int
    reps: int
    compile_s: float

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative spread of the per-call time."""
        return (self.p90_s - self.p10_s) / self.median_s if self.median_s > 0 else math.inf


def _one_element(tree: Any) -> jax.Array:
    leaf = next(x for x in jax.tree.leaves(tree) if x.size)
    return leaf.reshape(-1)[0]


def _depend(tree: Any, dep: jax.Array) -> Any:
    """``tree`` unchanged in value, its first non-empty leaf computed from ``dep``."""
    leaves, treedef = jax.tree.flatten(tree)
    i = next(i for i, x in enumerate(leaves) if x.size)
    leaves[i] = _depend_leaf(leaves[i], dep)
    return jax.tree.unflatten(treedef, leaves)


def _depend_leaf(x: jax.Array, dep: jax.Array) -> jax.Array:
    """``x`` unchanged in value, but computed from ``dep`` (``dep != dep`` only for NaN)."""
    first = (0,) * x.ndim
    nan = dep != dep
    return x.at[first].set(jnp.where(nan, jnp.zeros((), x.dtype), x[first]))


def chain(fn: Callable[..., Any], n: int) -> Callable[..., Any]:
    """jit of ``fn`` applied ``n`` times, call ``i+1`` data-dependent on call ``i``.

    ``fn``'s first argument (an array or a pytree of arrays, one non-empty) is donated.
    """
    if n < 1:
        raise ValueError(f"chain length n={n} must be >= 1")

    def run(first, *rest):
        def body(_, carry):
            first, out = carry
            first = _depend(first, _one_element(out))
            return first, fn(first, *rest)

        # A loop (not an unrolled chain) keeps XLA from fusing across calls and compiles the
        # op once; the static trip count lets XLA run it without per-iteration host syncs.
        # Returning ``first`` gives the donated buffer its own output to alias, so it is
        # never aliased to (and copied for) an op output of the same shape.
        return jax.lax.fori_loop(0, n - 1, body, (first, fn(first, *rest)))

    return jax.jit(run, donate_argnums=0)


def chain_length(est_s: float, target_s: float, lo: int = 2, hi: int = 50) -> int:
    """How many calls make one timed chain last about ``target_s``."""
    return max(lo, min(hi, math.ceil(target_s / max(est_s, 1e-9))))


def time_fn(fn: Callable[..., Any], args: Sequence[Any], n: int, reps: int, warmup: int = 1) -> Timing:
    """Times ``fn(*args)`` per call (args already on the device); see the module doc."""
    run = chain(fn, n)
    first, rest = args[0], tuple(args[1:])

    def once() -> float:
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, first))  # the donated argument, outside the timing
        t0 = time.perf_counter()
        jax.block_until_ready(run(fresh, *rest))
        return time.perf_counter() - t0

    with warnings.catch_warnings():
        # CPU cannot donate; the figure is then a little pessimistic, which is fine for smoke.
        warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
        compile_s = once()
        for _ in range(warmup):
            once()
        per_call = sorted(once() / n for _ in range(reps))
    q = statistics.quantiles(per_call, n=10, method="inclusive") if len(per_call) > 1 else per_call * 9
    return Timing(statistics.median(per_call), q[0], q[-1], per_call[0], n, reps, compile_s)


def _waited_ms(fn: Callable[..., Any], args: Sequence[Any]) -> float:
    """Wall milliseconds of one call ``fn(*args)``, waited for."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return (time.perf_counter() - t0) * 1e3


def back_to_back(fn: Callable[[], Any], calls: int) -> Any:
    """``calls`` calls of ``fn()`` enqueued one after another, the host waiting only for the
    last (which the device's stream runs after the others); each call's results are dropped
    before the next is enqueued, so one call's buffers are live at a time. Returns the last
    call's results."""
    for _ in range(calls - 1):
        fn()
    return jax.block_until_ready(fn())


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
