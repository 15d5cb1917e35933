"""Memory regions of one launch, and attribution of addresses to them.

A prealloc and its output are one memory (the declared alias), so they form one region
named by the output; a prealloc that XLA did *not* place on its output's memory stays a
region of its own, named ``<output>.prealloc``. An input that XLA (or a caller) placed on
exactly an output's memory is merged into that output's region too: its loads are then
loads of the output's bytes, which is what in-place use means.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from te_jax_perm.core.hooks import BufferInfo


@dataclasses.dataclass(frozen=True)
class Region:
    name: str
    role: str            # "input" or "output"
    start: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return max(1, np.dtype(self.dtype).itemsize)

    @property
    def elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class RegionMap:
    """The launch's regions, with address -> region attribution."""

    def __init__(self, buffers: Sequence[BufferInfo]):
        outputs = {b.name: b for b in buffers if b.role == "output"}
        out_mem = {(b.address, b.nbytes) for b in outputs.values() if b.nbytes}
        regions: list[Region] = []
        for b in buffers:
            if b.role == "prealloc":
                out = outputs.get(b.name.removesuffix(".prealloc"))
                if out is not None and out.address == b.address:
                    continue
            if b.role == "input" and (b.address, b.nbytes) in out_mem:
                continue
            role = "input" if b.role == "input" else "output"
            regions.append(Region(b.name, role, int(b.address), int(b.nbytes), np.dtype(b.dtype), tuple(b.shape)))
        self.regions = regions
        # Base address -> region, preferring non-empty regions when addresses coincide
        # (an empty buffer may sit at any address).
        self.by_base: dict[int, int] = {}
        for i in sorted(range(len(regions)), key=lambda i: (regions[i].nbytes == 0, regions[i].role == "input")):
            self.by_base.setdefault(regions[i].start, i)
        live = [i for i, r in enumerate(regions) if r.nbytes > 0]
        live.sort(key=lambda i: regions[i].start)
        self._live = np.asarray(live, dtype=np.int64)
        self._starts = np.asarray([regions[i].start for i in live], dtype=np.int64)
        self._ends = np.asarray([regions[i].start + regions[i].nbytes for i in live], dtype=np.int64)
        order = sorted(range(len(regions)), key=lambda i: regions[i].start)
        self._all_idx = np.asarray(order, dtype=np.int64)
        self._all_starts = np.asarray([regions[i].start for i in order], dtype=np.int64)

    def attribute(self, addrs: np.ndarray) -> int:
        """Region a pointer tensor whose provenance is unknown derives from.

        The region holding most of the lanes; if none holds any, the nearest region base
        at or below the lowest address (where an overrunning pointer came from).
        """
        if self._starts.size:
            j = np.searchsorted(self._starts, addrs, side="right") - 1
            inside = (j >= 0) & (addrs < self._ends[np.maximum(j, 0)])
            if inside.any():
                return int(self._live[np.bincount(j[inside]).argmax()])
        k = int(np.searchsorted(self._all_starts, addrs.min(), side="right")) - 1
        return int(self._all_idx[max(k, 0)])
