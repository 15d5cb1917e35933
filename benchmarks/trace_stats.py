"""Kernel time and launch counts of a jitted function, from a ``jax.profiler`` trace.

The trace's device planes hold one event per kernel executed (graph-launched ones too);
its host planes hold the CUDA API calls that launched them when CUPTI records them
(``cuLaunchKernel`` for a single kernel, ``cuGraphLaunch`` for a command buffer).
"""
from __future__ import annotations

import collections
import dataclasses
import glob
import os
import re
import tempfile
from typing import Any, Callable, Sequence

_GRAPH_LAUNCH = re.compile(r"graph.?launch", re.I)
_KERNEL_LAUNCH = re.compile(r"launch.?kernel", re.I)


@dataclasses.dataclass
class TraceStats:
    steps: int
    kernel_ns: dict[str, float]       # kernel name -> total device time over all steps
    kernel_count: dict[str, int]      # kernel name -> executions over all steps
    graph_launches: int               # CUDA graph launches seen on the host (0 if CUPTI API events absent)
    kernel_launches: int              # single-kernel launches seen on the host
    api_events_seen: bool             # whether the trace holds launch API events at all
    # The device's idle stretches between consecutive kernels of one stream, longest first:
    # (microseconds, kernel before, kernel after). Between calls waited for, the host waits,
    # so the steps - 1 longest are usually those; the rest show a stall inside a step.
    gaps: list[tuple[float, str, str]] = dataclasses.field(default_factory=list)
    # How long at least one kernel ran, over all steps: the union of every kernel's interval on
    # every stream. Below the summed kernel time where kernels ran at the same time (a command
    # buffer's independent kernels on several streams, or one kernel's start overlapping the
    # tail of the one before): kernel time then counts the shared stretch once per kernel.
    busy_ns: float = 0.0
    # From the first kernel's start to the last one's end, over all steps: with the steps
    # enqueued back to back, span - busy is the time the device sat idle inside the run.
    span_ns: float = 0.0

    @property
    def kernel_us_per_step(self) -> float:
        return sum(self.kernel_ns.values()) / self.steps / 1e3

    @property
    def kernels_per_step(self) -> float:
        return sum(self.kernel_count.values()) / self.steps

    @property
    def busy_us_per_step(self) -> float:
        return self.busy_ns / self.steps / 1e3

    @property
    def span_us_per_step(self) -> float:
        return self.span_ns / self.steps / 1e3

    def gaps_json(self) -> list[dict[str, Any]]:
        return [{"us": us, "after": a, "before": b} for us, a, b in self.gaps]

    def count_per_step(self, names: Sequence[str]) -> float:
        return sum(c for k, c in self.kernel_count.items() if matches(k, names)) / self.steps

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "kernel_us_per_step": self.kernel_us_per_step,
                "busy_us_per_step": self.busy_us_per_step, "span_us_per_step": self.span_us_per_step,
                "kernels_per_step": self.kernels_per_step,
                "graph_launches_per_step": self.graph_launches / self.steps,
                "kernel_launches_per_step": self.kernel_launches / self.steps,
                "api_events_seen": self.api_events_seen,
                "largest_gaps_us": self.gaps_json(),
                "kernels": {k: {"count": self.kernel_count[k], "us": v / 1e3} for k, v in sorted(self.kernel_ns.items())}}


def union_ns(intervals: Sequence[tuple[int, int]]) -> float:
    """The length of the union of ``[start, end)`` intervals (ns): time covered at least once."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start >= reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def matches(kernel: str, names: Sequence[str]) -> bool:
    return any(kernel == n or kernel.startswith(n + "_") or kernel.startswith(n + "(") for n in names)


def profile(fn: Callable[[], Any], steps: int, log_dir: str | None = None, back_to_back: bool = False) -> TraceStats:
    """Runs ``fn()`` ``steps`` times under the profiler and returns what the trace shows.
    Each call is waited for (``fn`` must block until its work is done), or with
    ``back_to_back`` the ``steps`` calls are enqueued one after another and waited for once,
    as a training loop runs them (``fn`` returns its outputs without waiting): the device
    then runs hot and its idle stretches are those a loop would see (``timing.back_to_back``:
    one call's outputs live at a time, as six steps' weight gradients held at once would not
    fit a GPU at DeepSeek-V3's size)."""
    import jax

    from benchmarks import timing
    log_dir = log_dir or tempfile.mkdtemp(prefix="te_jax_perm_trace_")
    with jax.profiler.trace(log_dir):
        if back_to_back:
            timing.back_to_back(fn, steps)
        else:
            for _ in range(steps):
                fn()
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        raise RuntimeError(f"the profiler wrote no trace under {log_dir}")
    return parse(paths[-1], steps)


def parse(path: str, steps: int) -> TraceStats:
    from jax.profiler import ProfileData
    data = ProfileData.from_file(path)
    kernel_ns: dict[str, float] = collections.defaultdict(float)
    kernel_count: dict[str, int] = collections.Counter()
    graph = single = 0
    api = False
    gaps: list[tuple[float, str, str]] = []
    busy = 0.0
    bounds: list[int] = []       # each device plane's first kernel start and last kernel end
    for plane in data.planes:
        intervals: list[tuple[int, int]] = []
        device = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            stream = device and line.name.lower().startswith("stream")
            prev = None
            for ev in sorted(line.events, key=lambda e: e.start_ns) if stream else line.events:
                if stream:
                    kernel_ns[ev.name] += ev.duration_ns
                    intervals.append((ev.start_ns, ev.end_ns))
                    kernel_count[ev.name] += 1
                    if prev is not None and ev.start_ns > prev.end_ns:
                        gaps.append(((ev.start_ns - prev.end_ns) / 1e3, prev.name, ev.name))
                    prev = ev if prev is None or ev.end_ns > prev.end_ns else prev
                elif not device:
                    if _GRAPH_LAUNCH.search(ev.name):
                        graph += 1
                        api = True
                    elif _KERNEL_LAUNCH.search(ev.name):
                        single += 1
                        api = True
        if intervals:
            busy += union_ns(intervals)
            bounds += [min(a for a, _ in intervals), max(b for _, b in intervals)]
    gaps.sort(key=lambda g: -g[0])
    return TraceStats(steps, dict(kernel_ns), dict(kernel_count), graph, single, api, gaps[:steps + 8], busy,
                      float(max(bounds) - min(bounds)) if bounds else 0.0)
