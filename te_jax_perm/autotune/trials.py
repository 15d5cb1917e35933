"""Identical trials: every candidate starts from the same buffer contents.

The buffers a launch may write are exactly the alias plan's ``written_inputs`` (the same
plan that gives the lowering its ``input_output_aliases``); they are saved before the
first trial, restored before every launch, and restored once more after the last, so
tuning leaves the caller's buffers as one real launch would find them.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np
from absl import logging

from te_jax_perm.autotune.validate import mismatch
from te_jax_perm.core.aliasing import alias_plan
from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.interpret_backend import run_launch
from te_jax_perm.core.launch import bind_call, configure


class Runner(Protocol):
    """Launches one config on a fixed set of buffers: operands then preallocated outputs."""

    def save(self, indices: Sequence[int]) -> None: ...
    def restore(self) -> None: ...
    def launch(self, config: Config) -> float: ...  # seconds
    def outputs(self) -> list[np.ndarray]: ...


@dataclasses.dataclass
class TrialResult:
    config: Config
    time_s: float | None = None
    times_s: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None       # the launch raised
    rejected: str | None = None    # outputs differ from the reference


def run_trials(decl: KernelDecl, runner: Runner, configs: Sequence[Config], expected: Sequence[np.ndarray],
               reps: int = 1, warmup: int = 0,
               on_result: Callable[[TrialResult], None] | None = None,
               deadline: float | None = None, phases: dict | None = None) -> list[TrialResult]:
    """Times each config, checking its outputs on the first and the last timed launch.

    A runner with its own ``mismatch(expected)`` (the GPU one compares on device) checks
    there instead of copying outputs to the host. Past ``deadline`` (``time.monotonic``)
    the remaining configs are not run (the first always is). ``phases`` accumulates launch and validation seconds."""
    phases = phases if phases is not None else {}
    check = getattr(runner, "mismatch", None) or (lambda exp: mismatch(decl, runner.outputs(), exp))
    runner.save(alias_plan(decl).written_inputs)
    results = []
    try:
        for cfg in configs:
            # The first config (the tuner puts the default first) always runs: a result.
            if results and deadline is not None and time.monotonic() > deadline:
                logging.warning("autotune %s: deadline passed; %d of %d configs not run", decl.name,
                                len(configs) - len(results), len(configs))
                break
            res = TrialResult(cfg)
            try:
                for i in range(warmup + reps):
                    t0 = time.perf_counter()
                    runner.restore()
                    dt = runner.launch(cfg)
                    phases["launch_s"] = phases.get("launch_s", 0.0) + time.perf_counter() - t0
                    if i >= warmup or i == 0:
                        # A rejected config keeps its time: logs show when the wrong one was fastest.
                        res.times_s.append(dt)
                    if i == 0 or i == warmup + reps - 1:
                        t0 = time.perf_counter()
                        why = check(expected)
                        phases["validate_s"] = phases.get("validate_s", 0.0) + time.perf_counter() - t0
                        if why:
                            res.rejected = why
                            break
            except Exception as e:  # noqa: BLE001 - a failing launch rejects its config only
                res.error = f"{type(e).__name__}: {e}"
            if res.times_s and not (res.rejected or res.error):
                res.time_s = statistics.median(res.times_s[1:] if warmup else res.times_s)
            results.append(res)
            if on_result:
                on_result(res)
    finally:
        runner.restore()
    return results


class HostRunner:
    """``interpret`` trials: the Triton interpreter on host NumPy buffers."""

    def __init__(self, decl: KernelDecl, inputs: Sequence[np.ndarray], preallocs: Sequence[np.ndarray],
                 params: Mapping[str, Any]):
        self.decl = decl
        self.call = bind_call(decl, inputs, params, "interpret")
        self.buffers = [np.ascontiguousarray(a) for a in inputs] + [np.ascontiguousarray(a) for a in preallocs]
        self.n_in = len(inputs)
        self.saved: dict[int, np.ndarray] = {}

    def save(self, indices: Sequence[int]) -> None:
        self.saved = {i: self.buffers[i].copy() for i in indices}

    def restore(self) -> None:
        for i, snap in self.saved.items():
            np.copyto(self.buffers[i], snap)

    def launch(self, config: Config) -> float:
        launch = configure(self.call, config)
        ins, outs = self.buffers[:self.n_in], self.buffers[self.n_in:]
        t0 = time.perf_counter()
        run_launch(launch, ins, outs, outs)  # each output is its own preallocated buffer
        return time.perf_counter() - t0

    def outputs(self) -> list[np.ndarray]:
        return [b.copy() for b in self.buffers[self.n_in:]]


def log_result(decl: KernelDecl, r: TrialResult, done: int, total: int, best: TrialResult | None) -> None:
    if r.rejected:
        logging.warning("autotune %s: [%d/%d] REJECTED %s: wrong output (%s)", decl.name, done, total, r.config,
                        r.rejected)
    elif r.error:
        logging.warning("autotune %s: [%d/%d] launch failed for %s: %s", decl.name, done, total, r.config, r.error)
    else:
        logging.info("autotune %s: [%d/%d] timed %s: %.3g ms; best so far %s", decl.name, done, total, r.config,
                     1e3 * r.time_s, best.config if best else None)
