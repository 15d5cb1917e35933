"""Tuning trials: their inputs, identical runs of each candidate, and the reference check.

The buffers a launch may write are exactly the operands the alias plan aliases to outputs
(the plan that gives the lowering its aliases); they are saved before the first trial, restored
before every launch and once after the last, so every candidate starts from the same
contents and tuning leaves the caller's buffers as one real launch would. Outputs are
compared with the declared reference, so a fast but wrong (e.g. racy) config is rejected.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from absl import logging

from te_jax_perm.core.aliasing import alias_plan
from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.interpret_backend import run_launch
from te_jax_perm.core.launch import bind_call, configure


# -- inputs ------------------------------------------------------------------------------------
def make_inputs(decl: KernelDecl, dims: Mapping[str, int], params: Mapping[str, Any],
                dtypes: Sequence[Any], seed: int = 0) -> list[np.ndarray]:
    """Fresh random operands of the traced shapes and dtypes: ``decl.example_inputs``, else
    integers drawn from ``[0, smallest dim)``, valid indices into any axis of any operand."""
    rng = np.random.default_rng(seed)
    dtypes = [np.dtype(dt) for dt in dtypes]
    shapes = [tuple(dims[d] for d in op.dims) for op in decl.operands]
    if decl.example_inputs is not None:
        named = {op.name: dt for op, dt in zip(decl.operands, dtypes)}
        arrays = [np.asarray(a) for a in decl.example_inputs(dims, params, named, rng)]
        for op, a, want, dt in zip(decl.operands, arrays, shapes, dtypes):
            if a.shape != want or a.dtype != dt:
                raise ValueError(f"{decl.name}: example_inputs gave {op.name!r} shape {a.shape} dtype {a.dtype}; "
                                 f"expected {want} {dt}")
        return arrays
    hi = max(1, min(dims.values())) if dims else 1
    arrays = []
    for shape, dt in zip(shapes, dtypes):
        if dt == np.bool_ or np.issubdtype(dt, np.integer):
            arrays.append(rng.integers(0, 2 if dt == np.bool_ else hi, shape).astype(dt))
        else:
            arrays.append(rng.standard_normal(shape).astype(np.float32).astype(dt))
    return arrays


def initial_prealloc(zeroed: bool, shape: tuple[int, ...], dtype: Any, seed: int = 1) -> np.ndarray:
    """An output buffer's contents before a launch (``zeroed`` from the alias plan); random
    bytes otherwise, so a config that skips elements it must write fails its check."""
    dtype = np.dtype(dtype)
    if zeroed:
        return np.zeros(shape, dtype)
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape).copy()


# -- the reference check -----------------------------------------------------------------------
def mismatch(decl: KernelDecl, got: Sequence[Any], want: Sequence[Any], xp: Any = np) -> str | None:
    """None when ``got`` matches; otherwise which output differs and how. Integer outputs
    and those of ``decl.exact`` kernels match bitwise; other float outputs match when every
    element is within ``decl.atol + decl.rtol * max|want|`` of the reference. ``xp`` is the
    array module the outputs live in (``numpy`` on the host, ``jax.numpy`` on a device,
    where a large output is compared without a copy to the host)."""
    for o, g, w in zip(decl.outputs, got, want):
        g, w = xp.asarray(g), xp.asarray(w)
        dtype = np.dtype(w.dtype)
        if g.shape != w.shape or np.dtype(g.dtype) != dtype:
            return f"{o.name}: shape/dtype {g.shape} {g.dtype} != reference {w.shape} {w.dtype}"
        floating = dtype.name.startswith(("float", "bfloat"))   # NumPy's and ml_dtypes' floats
        if decl.exact or not floating:
            if floating:  # bitwise: NaN payloads and signed zeros count
                bits = np.dtype(f"uint{8 * dtype.itemsize}")
                g, w = g.view(bits), w.view(bits)
            if n := int(xp.sum(g != w)):
                return f"{o.name}: {n} of {g.size} elements differ bitwise from the reference"
        else:
            # Against the reference's largest magnitude, not each element's own: a sum taken in
            # another order (a dot product over thousands of terms) differs by rounding of the
            # size of its terms, and an element that cancels to near zero keeps that rounding,
            # which an element-wise test calls wrong (a faster config refused for it). A
            # misplaced, unwritten or twice-written element is off by about the data's size.
            gf, wf = g.astype(np.float32), w.astype(np.float32)
            scale = float(xp.max(xp.abs(xp.where(xp.isfinite(wf), wf, 0)))) if wf.size else 0.0
            with np.errstate(invalid="ignore", over="ignore"):   # inf - inf: NaN, judged below
                ok = ((xp.abs(gf - wf) <= decl.atol + decl.rtol * scale)
                      | (gf == wf) | (xp.isnan(gf) & xp.isnan(wf)))   # infinities of one sign, NaNs
            if bad := int(xp.sum(~ok)):
                i = tuple(int(x) for x in np.unravel_index(int(xp.argmin(ok.astype(np.int8))), ok.shape))
                return (f"{o.name}: {bad} of {g.size} elements outside rtol={decl.rtol} of the "
                        f"reference's largest magnitude {scale:.4g} plus atol={decl.atol}; "
                        f"e.g. at {i}: {float(gf[i])} vs {float(wf[i])}")
    return None


# -- running the trials ------------------------------------------------------------------------
@contextlib.contextmanager
def timed(phases: dict[str, float], name: str) -> Iterator[None]:
    """Adds the block's wall time to ``phases[name]`` (the tuner's per-phase breakdown)."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0


@dataclasses.dataclass
class TrialResult:
    config: Config
    time_s: float | None = None
    times_s: list[float] = dataclasses.field(default_factory=list)
    error: str | None = None       # the launch raised
    rejected: str | None = None    # outputs differ from the reference


def run_trials(decl: KernelDecl, runner: "HostRunner", configs: Sequence[Config], expected: Sequence[np.ndarray],
               reps: int = 1, warmup: int = 0, deadline: float | None = None, phases: dict | None = None
               ) -> list[TrialResult]:
    """Times each config, checking its outputs on the first and the last timed launch; logs
    each result as it comes.

    ``runner`` (:class:`HostRunner`, :class:`GpuRunner`) launches configs on fixed buffers,
    operands then preallocs: ``save(indices)``, ``restore()``, ``launch(config)`` (seconds)
    and ``mismatch(expected)``. Past ``deadline`` (``time.monotonic``) the remaining configs
    are not run (the first always is). ``phases`` accumulates launch and validation seconds."""
    phases = phases if phases is not None else {}
    runner.save(tuple(alias_plan(decl).input_output_aliases))
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
                    with timed(phases, "launch_s"):
                        runner.restore()
                        dt = runner.launch(cfg)
                    if i >= warmup or i == 0:
                        # A rejected config keeps its time: logs show when the wrong one was fastest.
                        res.times_s.append(dt)
                    if i == 0 or i == warmup + reps - 1:
                        with timed(phases, "validate_s"):
                            res.rejected = runner.mismatch(expected)
                        if res.rejected:
                            break
            except Exception as e:  # noqa: BLE001 - a failing launch rejects its config only
                res.error = f"{type(e).__name__}: {e}"
            if res.times_s and not (res.rejected or res.error):
                res.time_s = statistics.median(res.times_s[1:] if warmup else res.times_s)
            results.append(res)
            where = (decl.name, len(results), len(configs), cfg)
            if res.rejected:
                logging.warning("autotune %s: [%d/%d] REJECTED %s: wrong output (%s)", *where, res.rejected)
            elif res.error:
                logging.warning("autotune %s: [%d/%d] launch failed for %s: %s", *where, res.error)
            else:
                best = min((r for r in results if r.time_s is not None), key=lambda r: r.time_s)
                logging.info("autotune %s: [%d/%d] timed %s: %.3g ms; best so far %s", *where, 1e3 * res.time_s,
                             best.config)
    finally:
        runner.restore()
    return results


class HostRunner:
    """``interpret`` trials: the Triton interpreter on host NumPy buffers. ``buffers`` holds
    the operands, then the preallocated outputs (so an alias plan's operand index is a
    buffer index); ``save`` keeps copies of the written ones, ``restore`` puts them back."""

    backend, reps, warmup = "interpret", 1, 0   # reps and warmup: the tuner's defaults

    def __init__(self, decl: KernelDecl, inputs: Sequence[np.ndarray], preallocs: Sequence[np.ndarray],
                 params: Mapping[str, Any]):
        self.decl, self.n_in = decl, len(inputs)
        self.call = bind_call(decl, inputs, params, self.backend)
        self.buffers = [self._put(a) for a in (*inputs, *preallocs)]
        self.saved: dict[int, Any] = {}

    _put = staticmethod(np.ascontiguousarray)   # a buffer the kernel can run on
    _copy = staticmethod(np.array)

    def save(self, indices: Sequence[int]) -> None:
        self.saved = {i: self._copy(self.buffers[i]) for i in indices}

    def restore(self) -> None:
        for i, snap in self.saved.items():
            self.buffers[i] = self._copy(snap)

    def launch(self, config: Config) -> float:
        launch = configure(self.call, config)
        ins, outs = self.buffers[:self.n_in], self.buffers[self.n_in:]
        t0 = time.perf_counter()
        run_launch(launch, ins, outs, outs)  # each output is its own preallocated buffer
        return time.perf_counter() - t0

    def outputs(self) -> list[np.ndarray]:
        return [np.array(b) for b in self.buffers[self.n_in:]]

    def mismatch(self, expected: Sequence[np.ndarray]) -> str | None:
        return mismatch(self.decl, self.outputs(), expected)


class GpuRunner(HostRunner):
    """``triton`` trials: each candidate a jitted ``triton_call`` of its launch on device
    buffers, the very custom call (compiled kernel, arguments, aliases) a lowered program
    runs. The preallocated outputs are donated to each trial and written in place, as in
    production; this runner keeps their initial contents and restores them before every
    launch itself (never relying on XLA to copy a buffer for it).

    Time per launch is taken on the device: a chain of ``chain`` dependent launches (each
    writes the buffers the next is handed) minus a single launch, over ``chain - 1``, so the
    host's dispatch and synchronisation cost cancels out. A chain holds at least
    ``min_chain_s`` of device work (it grows, up to ``max_chain`` launches, for small
    kernels): the host's jitter on a loaded machine is tens of microseconds, and a shorter
    chain would drown a few-microsecond kernel in it.
    """

    backend, reps, warmup = "triton", 15, 1
    min_chain_s, max_chain = 1e-3, 256
    _put = staticmethod(jax.device_put)
    _copy = staticmethod(jax.numpy.copy)

    def __init__(self, decl: KernelDecl, inputs: Sequence[np.ndarray], preallocs: Sequence[np.ndarray],
                 params: Mapping[str, Any], chain: int = 16):
        super().__init__(decl, inputs, preallocs, params)
        self.chain = chain
        self._exes: dict[tuple[Config, int], Callable] = {}
        self._expected: tuple[int, list[Any]] | None = None

    def restore(self) -> None:
        super().restore()
        jax.block_until_ready(self.buffers)

    def _exe(self, config: Config, n: int) -> Callable:
        """``n`` dependent launches of ``config``, the preallocs donated; compiled once."""
        if (config, n) not in self._exes:
            from te_jax_perm.core.triton_backend import triton_call
            launch = configure(self.call, config)

            def run(operands, buffers):
                for _ in range(n):
                    buffers = triton_call(launch, operands, buffers)
                return buffers

            jit = jax.jit(run, donate_argnums=1)
            self._exes[(config, n)] = jit.lower(self.buffers[:self.n_in], self.buffers[self.n_in:]).compile()
        return self._exes[(config, n)]

    def _timed(self, exe: Callable, buffers: list) -> tuple[float, list]:
        t0 = time.perf_counter()
        out = jax.block_until_ready(exe(self.buffers[:self.n_in], buffers))
        return time.perf_counter() - t0, list(out)

    def launch(self, config: Config) -> float:
        """One launch on the current buffers (its outputs are kept for checking); returns the
        device time of a launch, from a chain of launches on a copy of the same buffers."""
        spare = jax.block_until_ready([self._copy(b) for b in self.buffers[self.n_in:]])
        t1, self.buffers[self.n_in:] = self._timed(self._exe(config, 1), self.buffers[self.n_in:])
        while True:
            tn, spare = self._timed(self._exe(config, self.chain), spare)
            extra = tn - t1
            if extra >= self.min_chain_s or self.chain >= self.max_chain:
                return max(extra, 0.0) / (self.chain - 1)
            # Long enough next time (every later config keeps the longer chain too).
            grow = math.ceil(2 * self.min_chain_s / extra) if extra > 0 else 4
            self.chain = min(self.max_chain, self.chain * max(2, grow))

    def mismatch(self, expected: Sequence[np.ndarray]) -> str | None:
        """The reference comparison on the device: a 100+ MB output is compared where it lies."""
        if self._expected is None or self._expected[0] != id(expected):
            self._expected = (id(expected), [jax.device_put(w) for w in expected])
        return mismatch(self.decl, self.buffers[self.n_in:], self._expected[1], xp=jax.numpy)


RUNNERS = {r.backend: r for r in (HostRunner, GpuRunner)}   # the backends that can be tuned
