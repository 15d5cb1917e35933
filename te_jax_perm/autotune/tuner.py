"""Tuning one kernel for one launch shape: prune, compile in isolation, time identical
trials, reject wrong outputs, and persist the result under the tuning key.

Pruning happens before anything compiles, so an invalid (e.g. racy) tiling can never be
timed, let alone picked; every pruned config is logged (verbosity 1) with the reason.

The config resolver (``core.hooks``) uses cached winners always (``te_jax_perm`` installs
it when imported, so a warm cache needs no opt-in) and tunes on a miss when enabled
(``TE_JAX_PERM_AUTOTUNE=1``, :func:`enable` or :func:`autotuning`); otherwise a miss gets
the default config. Any tuner failure is logged and falls back to the default: tuning
never breaks a call.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np
from absl import logging

from te_jax_perm import _checks
from te_jax_perm.autotune import cache
from te_jax_perm.autotune.pool import get_pool, make_job
from te_jax_perm.autotune.trials import RUNNERS, initial_prealloc, make_inputs, run_trials, timed
from te_jax_perm.core import env, resolve_backend
from te_jax_perm.core.backends import default_platform
from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.launch import Call, bind_call, configure

# Process-wide counters; tests and the CLI use them to prove a warm cache does no work.
stats: collections.Counter = collections.Counter()
_stats_lock = threading.Lock()


def _count(name: str, n: int = 1) -> None:
    # ``stats[name] += n`` reads and then writes: two threads (tuning different keys, or
    # hitting the cache at once) could read the same count, and one increment would be lost.
    with _stats_lock:
        stats[name] += n

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class TuneOptions:
    """``compile_target``: ``("cuda", 90, 32)``-style target to compile candidates for in the
    worker pool; ``"auto"`` = the GPU's own target on ``triton`` and none on ``interpret``."""

    reps: int | None = None          # timed launches per config (default: 1 interpret, 15 triton)
    warmup: int | None = None        # default: 0 interpret, 1 triton
    max_candidates: int | None = None  # cap on valid configs tried (the default is always kept)
    deadline: float | None = None    # time.monotonic(); configs left at this point are not run
    compile_target: Any = AUTO
    compile_timeout_s: float | None = None
    force: bool = False              # re-tune even on a cache hit
    seed: int = 0

    def __post_init__(self):
        # Counts read as given: 1.5 timed launches failed every config inside the tuning (each
        # logged as a failure) and a negative cap cut the candidates without a word.
        for name in ("reps", "warmup", "max_candidates"):
            if getattr(self, name) is not None:
                _checks.check_static_int(f"TuneOptions.{name}", getattr(self, name), 0)


@dataclasses.dataclass
class TuneResult:
    key: dict
    entry: dict
    cached: bool

    @property
    def best(self) -> Config | None:
        b = self.entry.get("best")
        return Config.from_json(b) if b else None


def declaration(kernel: Any, name: str = "kernel") -> KernelDecl:
    """The ``KernelDecl`` of ``kernel``: a declared op (``op.decl``) or the declaration itself,
    so every tuning entry point takes what ``declare`` returned as well as what it was given."""
    decl = getattr(kernel, "decl", kernel)
    if not isinstance(decl, KernelDecl):
        raise TypeError(f"{name} is {type(kernel).__name__} {kernel!r}; expected a declared kernel (what "
                        "core.declare returns) or its KernelDecl")
    return decl


def candidates(kernel: Any, dims: Mapping[str, int], params: Mapping[str, Any]
               ) -> tuple[list[Config], list[tuple[Config, str]]]:
    """``(valid, pruned)`` configs of ``kernel`` (a declared op or its ``KernelDecl``) at
    ``dims``, ``pruned`` with each reason; the default config is always a candidate (if
    valid), so tuning can only improve on it."""
    decl = declaration(kernel)
    valid, pruned = [], []
    for cfg in dict.fromkeys((*decl.configs, decl.default_config(dims, params))):
        why = decl.violated(dims, params, cfg)
        if why:
            pruned.append((cfg, why))
            logging.vlog(1, "autotune %s: pruned %s for %s: %s", decl.name, cfg, dict(dims), why)
        else:
            valid.append(cfg)
    return valid, pruned


def cap(valid: Sequence[Config], default: Config, limit: int | None, name: str = ""
        ) -> tuple[list[Config], list[Config]]:
    """At most ``limit`` of ``valid``: the default first (so a run stopped early still has
    the baseline), then evenly spaced picks over the declared order (which sweeps the
    tile/warp grid), so a capped search still spans the space. Returns ``(kept, skipped)``."""
    rest = [c for c in valid if c != default]
    head = [default] if default in valid else []
    if limit is None or len(valid) <= limit:
        return head + rest, []
    n = max(0, limit - len(head))
    picks = sorted({round(i * (len(rest) - 1) / max(1, n - 1)) for i in range(n)}) if n and rest else []
    kept = head + [rest[i] for i in picks]
    skipped = [c for c in rest if c not in kept]
    logging.vlog(1, "autotune %s: %d candidates over the cap of %d, skipped: %s", name, len(skipped), limit,
                 ", ".join(str(c) for c in skipped))
    return kept, skipped


def tuning_backend(backend: str | None = None) -> str:
    """The backend tuning runs on: ``backend`` (any case; an unavailable one is named), or
    with ``None`` the kernels of where JAX places computations (``default_platform``):
    ``"triton"`` on a GPU, ``"interpret"`` elsewhere (the ``"xla"`` backend, a CPU's
    default for the ops, has no configs). Trials place their buffers where JAX places
    computations, so ``"triton"`` under a non-GPU default device (a ``with
    jax.default_device(cpu):`` block on a GPU machine) is refused rather than failing every
    config."""
    platform = default_platform()
    chosen = resolve_backend(backend if backend is not None else "triton" if platform == "gpu" else "interpret")
    if chosen == "triton" and platform != "gpu":
        raise ValueError(f"autotune: backend={backend!r} tunes GPU kernels, but JAX places computations on "
                         f"{platform!r} here (jax.default_device); expected a GPU default device, or "
                         "backend='interpret' to tune the interpreter's kernels on the CPU")
    return chosen


def tune(kernel: Any, shapes: Sequence[Any], params: Mapping[str, Any] | None = None,
         backend: str | None = None, options: TuneOptions = TuneOptions()) -> TuneResult:
    """Tunes ``kernel`` (a declared op or its ``KernelDecl``) for operands of ``shapes``
    (arrays, ShapeDtypeStructs or ``(shape, dtype)`` pairs) and static ``params`` on
    :func:`tuning_backend` ``(backend)``; returns the cached result if present."""
    decl = declaration(kernel)
    avals = [_aval(i, s) for i, s in enumerate(shapes)]
    return tune_call(bind_call(decl, avals, dict(params or {}), tuning_backend(backend)), options)


def _aval(i: int, s: Any) -> Any:
    """``shapes[i]`` of :func:`tune` as a shaped value, or an error naming it (unpacked into
    ``jax.ShapeDtypeStruct`` unchecked, a bare shape fails naming no argument)."""
    if hasattr(s, "shape") and hasattr(s, "dtype"):
        return s
    try:
        shape, dtype = s
        return jax.ShapeDtypeStruct(shape, dtype)
    except (TypeError, ValueError):
        raise TypeError(f"tune: shapes[{i}] is {s!r}; expected an array, a jax.ShapeDtypeStruct or a (shape, dtype) "
                        "pair, e.g. ((16, 96), np.float32)") from None


def _checked_options(options: Any) -> TuneOptions:
    """``options`` when it is a :class:`TuneOptions`; a dict or ``None`` would fail later,
    inside a tuning, naming no argument."""
    if not isinstance(options, TuneOptions):
        raise TypeError(f"options is {type(options).__name__} {options!r:.60}; expected a "
                        "te_jax_perm.autotune.TuneOptions")
    return options


def tune_call(call: Call, options: TuneOptions = TuneOptions()) -> TuneResult:
    """Tunes one bound call (see :func:`tune`)."""
    options = _checked_options(options)
    if call.backend not in RUNNERS:
        raise ValueError(f"autotune: backend={call.backend!r} has no kernel configs to tune; expected one of "
                         f"{tuple(sorted(RUNNERS))}")
    key = cache.call_key(call)
    entry = None if options.force else cached(call, key)
    if entry is not None:
        return TuneResult(key, entry, cached=True)
    with _key_lock(key):
        # Threads that miss the same key at once (a server's first requests) tune it once:
        # the others wait here and then find the winner's result in the cache.
        entry = None if options.force else cached(call, key)
        if entry is not None:
            return TuneResult(key, entry, cached=True)
        return _tune(call, key, options)


# Key digest -> [its lock, how many threads hold or wait for it]. An entry lives only while
# some thread uses it: a long-running process tunes many shapes, and a lock kept per key
# would pile up. Dropping it loses nothing, since a thread that comes later finds the
# finished result in the cache (stored before the lock was released).
_key_locks: dict[str, list] = {}
_key_locks_lock = threading.Lock()


@contextlib.contextmanager
def _key_lock(key: Mapping[str, Any]) -> Iterator[None]:
    """Holds the lock of ``key`` in this process while the block runs."""
    digest = cache.key_digest(key)
    with _key_locks_lock:
        held = _key_locks.setdefault(digest, [threading.Lock(), 0])
        held[1] += 1
    try:
        with held[0]:
            yield
    finally:
        with _key_locks_lock:
            held[1] -= 1
            if not held[1]:
                del _key_locks[digest]


def tunings_in_flight() -> int:
    """How many tuning keys threads of this process are tuning, or waiting to tune, now."""
    with _key_locks_lock:
        return len(_key_locks)


def _tune(call: Call, key: Mapping[str, Any], options: TuneOptions) -> TuneResult:
    """Tunes ``call`` under ``key``, whatever the cache holds."""
    decl, dims, params, backend = call.decl, call.dims, call.params, call.backend
    _count("tunes")
    t_start = time.perf_counter()
    phases: dict[str, float] = {}
    valid, pruned = candidates(decl, dims, params)
    default = decl.default_config(dims, params)
    valid, skipped = cap(valid, default, options.max_candidates, decl.name)
    n_candidates = len(valid) + len(pruned) + len(skipped)  # for the summary line
    logging.vlog(1, "autotune %s: tuning %d configs for dims %s params %s (%d pruned)", decl.name, len(valid),
                 dict(dims), params, len(pruned))

    with timed(phases, "compile_s"):
        valid, failed = _compile_stage(call, valid, options)

    # Inputs and the reference once per (kernel, shape); every trial reuses them.
    with timed(phases, "inputs_s"):
        inputs = make_inputs(decl, dims, params, call.dtypes, seed=options.seed)
        preallocs = [initial_prealloc(zeroed, a.shape, a.dtype, seed=options.seed + 1 + i)
                     for i, (zeroed, a) in enumerate(zip(call.aliases.zeroed, call.out_avals))]
    with timed(phases, "reference_s"):
        expected = _reference(decl, inputs, params)
    with timed(phases, "to_device_s"):
        runner = RUNNERS[backend](decl, inputs, preallocs, params)

    with timed(phases, "trials_s"):
        results = run_trials(decl, runner, valid, expected, reps=options.reps or runner.reps,
                             warmup=runner.warmup if options.warmup is None else options.warmup,
                             deadline=options.deadline, phases=phases)
    _count("trials", len(results))
    complete = len(results) == len(valid)
    ok = sorted((r for r in results if r.time_s is not None), key=lambda r: r.time_s)
    rejected = [[r.config.to_json(), r.rejected, min(r.times_s) if r.times_s else None] for r in results if r.rejected]
    failed += [(r.config, r.error) for r in results if r.error]
    default_time = next((r.time_s for r in results if r.config == default), None)
    entry = {
        "best": ok[0].config.to_json() if ok else None,
        "best_time_s": ok[0].time_s if ok else None,
        "default": default.to_json(),
        "default_time_s": default_time,
        "ranking": [[r.config.to_json(), r.time_s] for r in ok],
        "rejected": rejected,
        "failed": [[c.to_json(), why] for c, why in failed],
        "pruned": [[c.to_json(), why] for c, why in pruned],
        "skipped": [c.to_json() for c in skipped],
        "not_run": [c.to_json() for c in valid[len(results):]],
        "complete": complete,
        "tuned_dims": dict(dims),
        "tuning_s": time.perf_counter() - t_start,
        "phases_s": phases,
    }
    # One line per tuned kernel; the per-config detail (pruning reasons, phases) is at verbosity 1.
    counts = (f"{n_candidates} candidates, {len(pruned)} pruned by constraints, "
              + (f"{len(skipped)} over the cap, " if skipped else "")
              + f"{len(failed)} failed, {len(rejected)} rejected (wrong output), {len(ok)} timed")
    if not ok:
        logging.error("autotune %s %s: %s; no config produced the reference output, using the default %s",
                      decl.name, dict(dims), counts, default)
    else:
        logging.info("autotune %s %s: %s; best %s %.3g ms (default %s) in %.1fs", decl.name, dict(dims), counts,
                     ok[0].config, 1e3 * ok[0].time_s,
                     "%.3g ms" % (1e3 * default_time) if default_time else "not timed", entry["tuning_s"])
    logging.vlog(1, "autotune %s: phases %s", decl.name, {k: round(v, 3) for k, v in phases.items()})
    if complete:
        cache.store(key, entry)
    else:  # cut short by the deadline: reported, never cached as if it were a full search
        logging.warning("autotune %s: %d configs not run before the deadline; result not cached", decl.name,
                        len(entry["not_run"]))
    return TuneResult(key, entry, cached=False)


def cached(call: Call, key: Mapping[str, Any]) -> dict | None:
    """The cached entry of ``call`` under ``key`` if there is a usable one (a cache hit)."""
    entry = cache.load(key, call.decl, call.dims, call.params)
    if entry is not None:
        _count("cache_hits")
        logging.vlog(1, "autotune %s: cache hit for %s", call.decl.name, key["dims"])
    return entry


def _compile_stage(call, valid, options):
    # All candidates in one parallel batch, before any trial: a config whose compile
    # crashes or hangs is dropped here, in a worker, never in this process.
    target = options.compile_target
    if target == AUTO:
        target = device_target() if call.backend == "triton" else None
    if target is None:
        return valid, []
    pool = get_pool()
    if options.compile_timeout_s is not None:
        pool.timeout_s = options.compile_timeout_s
    jobs = [make_job(configure(call, c), tuple(target)) for c in valid]
    _count("compiles", len(jobs))
    kept, failed = [], []
    for c, r in zip(valid, pool.compile_many(jobs)):
        if r.ok:
            kept.append(c)
            logging.vlog(1, "autotune %s: compiled %s (%.2fs, %s regs)", call.decl.name, c,
                         r.info.get("compile_s", 0), r.info.get("n_regs"))
        else:
            failed.append((c, r.error.strip().splitlines()[-1] if r.error else "failed"))
    return kept, failed


def device_target() -> tuple[str, int, int]:
    """The compile target of this process's GPU, as the ``triton`` backend compiles for it
    (asked of jaxlib, not of Triton's driver, which would import torch)."""
    from te_jax_perm.core.triton_backend import compute_capability
    return ("cuda", compute_capability(), 32)


def _reference(decl: KernelDecl, inputs: Sequence[np.ndarray], params: Mapping[str, Any]) -> list[np.ndarray]:
    # Tuning may run inside a lowering rule: evaluate eagerly rather than stage into it. One
    # jitted call (not op-by-op dispatch, which compiles and syncs every op on GPU).
    with jax.ensure_compile_time_eval():
        outs = jax.jit(lambda *ops: decl.run_reference(ops, params))(*[jax.numpy.asarray(a) for a in inputs])
        return [np.asarray(o) for o in outs]


# -- the config resolver -----------------------------------------------------------------------
# One JAX user context holds the setting, so jax.jit keys its caches on it: a function jitted
# with tuning off and called again with it on is lowered again, and tunes its misses. Its
# global value is enable()'s setting (None: TE_JAX_PERM_AUTOTUNE's); an autotuning() block
# sets the calling thread's own value, which wins while the block is open. So an enable()
# inside a block outlasts the block, and the block's exit restores the block outside it.
# A block holds for its own thread: a module global would let one request thread's block
# decide whether another thread tunes, and two threads' blocks closing out of order would
# leave one's setting behind for the whole process.
_setting = jax.make_user_context(None)
_options = TuneOptions()


def enabled() -> bool:
    """Whether a kernel lowered now in this thread with no explicit config is tuned on a
    cache miss: the innermost :func:`autotuning` block's setting, else :func:`enable`'s,
    else ``TE_JAX_PERM_AUTOTUNE``'s."""
    on = _setting.value
    return env.autotune() if on is None else bool(on)


def enable(on: bool = True, options: TuneOptions | None = None) -> None:
    """Turns tuning-on-miss on or off for this process (overrides the env var); inside an
    :func:`autotuning` block, the block's setting holds until it exits. A jitted function
    called after the setting changes is lowered again (``jax.jit`` keys its cache on it)."""
    global _options
    on = _checks.check_static_bool("enable: on", on)
    if options is not None:
        options = _checked_options(options)
    _setting.set_global(on)
    if options is not None:
        _options = options


@contextlib.contextmanager
def autotuning(on: bool = True) -> Iterator[None]:
    """Within the context, kernels traced with no explicit config are tuned on a cache miss
    (``on=False``: not tuned). The block holds for the thread that opens it; other threads,
    and threads started inside it, keep their own setting. A jitted function called inside
    a block whose setting differs from the one it was lowered with is lowered again
    (``jax.jit`` keys its cache on it), so its misses are tuned."""
    with _setting(_checks.check_static_bool("autotuning: on", on)):
        yield


def pick(decl: KernelDecl, entry: Mapping[str, Any], dims: Mapping[str, int], params: Mapping[str, Any]
         ) -> Config | None:
    """The fastest cached config that is valid for these exact dims (a key bucket spans
    several shapes, and a constraint may rule the winner out for some of them)."""
    ranked = (Config.from_json(cfg_json) for cfg_json, _t in entry.get("ranking", []))
    return next((cfg for cfg in ranked if decl.violated(dims, params, cfg) is None), None)


def resolve(decl: KernelDecl, avals: Sequence[Any], params: Mapping[str, Any], backend: str) -> Config | None:
    """The config a call of ``decl`` on operands shaped like ``avals`` would use (``None``:
    the default)."""
    return resolve_call(bind_call(decl, avals, params, backend))


def resolve_call(call: Call) -> Config | None:
    """The config resolver the autotuner installs in ``core.hooks``."""
    decl = call.decl
    if call.backend not in RUNNERS or not decl.configs:
        return None
    try:
        entry = cached(call, cache.call_key(call))
        if entry is None and enabled():
            entry = tune_call(call, _options).entry
        if entry is None:
            return None
        cfg = pick(decl, entry, call.dims, call.params)
        logging.vlog(1, "autotune %s: using %s for %s", decl.name, cfg, dict(call.dims))
        return cfg
    except Exception as e:  # noqa: BLE001 - never let tuning fail the user's computation
        logging.warning("autotune %s: tuning failed (%s: %s); using the default config", decl.name,
                        type(e).__name__, e)
        return None

