"""Device kernel times of many labelled functions, JAX and PyTorch alike, from one profile.

CUPTI (through PyTorch's profiler) records every kernel the process runs, XLA's
graph-launched ones included, so one profile times our custom calls, XLA's glue kernels
and TransformerEngine's PyTorch kernels side by side on the same device. Labels are told
apart by a tiny marker kernel launched, with the device idle, before each label's calls:
the kernels between two markers belong to the label in between.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Sequence

from benchmarks import timing

MARKER = "bench_marker_kernel"


@dataclasses.dataclass
class KernelTimes:
    """One label's kernels: every kernel execution, in order, and the calls made."""

    label: Any
    calls: int
    kernels: list[tuple[str, float]]   # (kernel name, µs)

    def per_call_sums(self, name_filter: Callable[[str], bool] | None = None) -> list[float]:
        """Each call's summed kernel time, in call order; ``[]`` when there are no kernels or
        they do not split evenly by call (then only their mean is known)."""
        ks = [us for n, us in self.kernels if name_filter is None or name_filter(n)]
        if not ks or self.calls <= 0 or len(ks) % self.calls:
            return []
        per = len(ks) // self.calls
        return [sum(ks[i * per:(i + 1) * per]) for i in range(self.calls)]

    def per_call_us(self, name_filter: Callable[[str], bool] | None = None) -> float:
        """Median over calls of the summed kernel time of a call (kernels split evenly by call)."""
        if sums := self.per_call_sums(name_filter):
            return statistics.median(sums)
        ks = [us for n, us in self.kernels if name_filter is None or name_filter(n)]
        return sum(ks) / self.calls if ks and self.calls > 0 else float("nan")

    def spread_pct(self) -> float | None:
        """The calls' interquartile range over their median, in percent: how far apart two
        measurements of the same work land in this run (``None`` below four even calls)."""
        sums = self.per_call_sums()
        if len(sums) < 4:
            return None
        q1, _, q3 = statistics.quantiles(sums, n=4)
        return 100 * (q3 - q1) / statistics.median(sums)

    def by_name(self) -> dict[str, float]:
        """Kernel name -> µs per call (summed over the label's calls, divided by calls)."""
        out: dict[str, float] = {}
        for n, us in self.kernels:
            out[n] = out.get(n, 0.0) + us / self.calls
        return out

    def count_per_call(self) -> float:
        return len(self.kernels) / self.calls if self.calls else 0.0


def _marker():
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def bench_marker_kernel(p):
        tl.store(p, tl.load(p) + 1)

    buf = torch.zeros(1, dtype=torch.int32, device="cuda")

    def launch() -> None:
        torch.cuda.synchronize()
        bench_marker_kernel[(1,)](buf)
        torch.cuda.synchronize()

    return launch


def wait_for(out: Any) -> None:
    """Waits until ``out`` (JAX arrays or torch tensors) and all queued PyTorch work are done."""
    import jax
    import torch

    leaves = jax.tree.leaves(out)
    if any(isinstance(x, jax.Array) for x in leaves):
        jax.block_until_ready(out)
    torch.cuda.synchronize()


def wall_us(items: Sequence[tuple[Any, Callable[[], Any]]], calls: int = 10, reps: int = 5) -> list[float]:
    """Each label's wall time per call, in µs: ``calls`` calls enqueued back to back and
    waited for once (as a loop calling the op sees it: host dispatch and launch gaps
    included), median over ``reps`` rounds. The labels take turns within each round, so a
    slow stretch of the host or a clock change falls on all of them alike."""
    import time
    per: list[list[float]] = [[] for _ in items]
    for _ in range(reps):
        for i, (_, fn) in enumerate(items):
            wait_for(fn())
            t0 = time.perf_counter()
            timing.back_to_back(fn, calls, wait=wait_for)
            per[i].append((time.perf_counter() - t0) / calls * 1e6)
    return [statistics.median(w) for w in per]


def measure(items: Sequence[tuple[Any, Callable[[], Any]]], calls: int = 10, warmup: int = 2,
            rounds: int = 1) -> list[KernelTimes]:
    """Runs each ``(label, fn)``: ``warmup`` calls unprofiled, then ``calls`` calls in one
    profile; returns each label's kernels. ``fn()`` may return JAX arrays or torch tensors.
    With ``rounds`` > 1, that many profiles, the labels' order reversed every other one, and
    each label's calls of every round together (:func:`merged`): no label is always timed
    first, or always right after the same other label."""
    if rounds > 1:
        return merged([profile_once(items if r % 2 == 0 else list(items)[::-1], calls, warmup)
                       for r in range(rounds)])
    return profile_once(items, calls, warmup)


def merged(runs: Sequence[Sequence[KernelTimes]]) -> list[KernelTimes]:
    """One :class:`KernelTimes` per label over several runs of the same labels (in the first
    run's order): the calls of every run, their kernels in run order."""
    by_label: dict[Any, KernelTimes] = {}
    for run in runs:
        for t in run:
            if t.label in by_label:
                m = by_label[t.label]
                by_label[t.label] = KernelTimes(t.label, m.calls + t.calls, m.kernels + t.kernels)
            else:
                by_label[t.label] = KernelTimes(t.label, t.calls, list(t.kernels))
    return [by_label[t.label] for t in runs[0]]


def profile_once(items: Sequence[tuple[Any, Callable[[], Any]]], calls: int, warmup: int) -> list[KernelTimes]:
    """:func:`measure`'s one profile: the labels in the order given."""
    from torch.profiler import ProfilerActivity, profile

    marker = _marker()
    marker()  # compile outside the profile
    for _, fn in items:
        for _ in range(warmup):
            wait_for(fn())
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _, fn in items:
            marker()
            timing.back_to_back(fn, calls, wait=wait_for)
        marker()
    events = []
    for e in prof.events():
        if getattr(e, "device_type", None) is not None and str(e.device_type).endswith("CUDA"):
            events.append((e.time_range.start, e.name, e.time_range.elapsed_us()))
    events.sort()
    groups: list[list[tuple[str, float]]] = []
    current: list[tuple[str, float]] | None = None
    for _, name, us in events:
        if MARKER in name:
            if current is not None:
                groups.append(current)
            current = []
        elif current is not None and not name.startswith(("Memcpy HtoD", "Memcpy DtoH")):
            current.append((name, us))  # kernels, memsets and device copies count; host transfers do not
    if len(groups) != len(items):
        raise RuntimeError(f"profile shows {len(groups)} marked groups for {len(items)} labels: "
                           "the profiler did not record every kernel")
    return [KernelTimes(label, calls, g) for (label, _), g in zip(items, groups)]
