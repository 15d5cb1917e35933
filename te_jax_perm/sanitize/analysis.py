"""Cross-program hazards of one recorded launch, computed with vectorised set operations.

Every access is expanded to the bytes it touches and encoded as ``byte * P + pid`` (``P``
programs), so one ``np.unique`` gives each region's (byte, program) pairs sorted by byte:
two programs storing a byte are adjacent entries; a program loading a byte another
program stores is found by ``searchsorted`` into the stores.
"""
from __future__ import annotations

from typing import Iterator

import numpy as np

from te_jax_perm.sanitize.hazards import IN_PLACE, INPUT_WRITE, READ_WRITE, WRITE_WRITE, Hazard, LaunchSummary
from te_jax_perm.sanitize.regions import Region
from te_jax_perm.sanitize.tracer import LaunchRecord

# Per launch and hazard class, at most this many (program pair) hazards are recorded.
MAX_PER_CLASS = 16


def _keys(rec: LaunchRecord, region: int, kind: str, nprog: int) -> np.ndarray:
    """Sorted unique ``byte * nprog + pid`` of one region's accesses of one kind."""
    parts = []
    for a in rec.accesses:
        if a.region == region and a.kind == kind:
            b = (a.offsets[:, None] + np.arange(a.size, dtype=np.int64)).reshape(-1)
            parts.append(b * nprog + a.pid)
    if not parts:
        return np.zeros(0, np.int64)
    return np.unique(np.concatenate(parts))


def _by_pair(first: np.ndarray, second: np.ndarray, byte: np.ndarray, reg: Region
             ) -> Iterator[tuple[int, int, tuple[int, int], int]]:
    """Groups conflicting bytes by program pair: (first, second, element range, count)."""
    elem = byte // reg.itemsize
    pair = np.stack([first, second], axis=1)
    uniq, inv = np.unique(pair, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    for k, (p, q) in enumerate(uniq):
        e = elem[inv == k]
        yield int(p), int(q), (int(e.min()), int(e.max()) + 1), int(np.unique(e).size)


def _cross_reads(loads: np.ndarray, stores: np.ndarray, nprog: int):
    """Loads of bytes that some *other* program stores: (reader, writer, byte) arrays."""
    sb, sp = stores // nprog, stores % nprog
    lb, lp = loads // nprog, loads % nprog
    lo = np.searchsorted(sb, lb, side="left")
    hi = np.searchsorted(sb, lb, side="right")
    n = hi - lo
    if sb.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = sp[np.minimum(lo, sb.size - 1)]
    second = sp[np.minimum(lo + 1, sb.size - 1)]
    writer = np.where(first != lp, first, second)
    hit = (n > 1) | ((n == 1) & (first != lp))
    return lp[hit], writer[hit], lb[hit]


def analyse(rec: LaunchRecord) -> tuple[list[Hazard], list[Hazard], LaunchSummary]:
    """Hazards of the launch as run, ``in_place`` findings for hypothetical aliasing, and
    the launch summary."""
    regions = rec.regions.regions
    gx, gy, gz = rec.grid
    nprog = gx * gy * gz
    hazards: list[Hazard] = []
    in_place: list[Hazard] = []
    truncated = 0
    loaded, stored, atomic = {}, {}, {}
    stores = {i: _keys(rec, i, "store", nprog) for i in range(len(regions))}
    loads = {i: _keys(rec, i, "load", nprog) for i in range(len(regions))}

    def emit(kind: str, reg: Region, pairs, access: str, input_name: str | None = None) -> None:
        nonlocal truncated
        into = in_place if kind == IN_PLACE else hazards
        for n, (p, q, elems, count) in enumerate(pairs):
            if n >= MAX_PER_CLASS:
                truncated += 1
                continue
            progs = (rec.pid_of(p),) if q < 0 else (rec.pid_of(p), rec.pid_of(q))
            into.append(Hazard(kind, rec.kernel, reg.name, progs, access, elems, count, reg.elements, input_name))

    for i, reg in enumerate(regions):
        st, ld = stores[i], loads[i]
        stored[reg.name] = int(np.unique(st // nprog).size)
        loaded[reg.name] = int(np.unique(ld // nprog).size)
        atomic[reg.name] = int(np.unique(_keys(rec, i, "atomic", nprog) // nprog).size)
        if st.size and reg.role == "input":
            sb, sp = st // nprog, st % nprog
            emit(INPUT_WRITE, reg, _by_pair(sp, np.full_like(sp, -1), sb, reg), "store")
        sb, sp = st // nprog, st % nprog
        dup = np.flatnonzero(sb[1:] == sb[:-1])
        if dup.size:
            emit(WRITE_WRITE, reg, _by_pair(sp[dup], sp[dup + 1], sb[dup], reg), "store")
        r, w, b = _cross_reads(ld, st, nprog)
        if r.size:
            emit(READ_WRITE, reg, _by_pair(r, w, b, reg), "load")

    # Hypothetical in-place use: input i placed on output j's memory (same shape/dtype),
    # so input i's loads become loads of output j's bytes.
    checked, unsafe = [], []
    for i, src in enumerate(regions):
        if src.role != "input":
            continue
        for j, dst in enumerate(regions):
            if dst.role != "output" or dst.shape != src.shape or dst.dtype != src.dtype:
                continue
            checked.append((src.name, dst.name))
            r, w, b = _cross_reads(loads[i], stores[j], nprog)
            if r.size:
                unsafe.append((src.name, dst.name))
                emit(IN_PLACE, dst, _by_pair(r, w, b, dst), "load", src.name)

    summary = LaunchSummary(rec.kernel, rec.grid, loaded, stored, atomic, tuple(checked), tuple(unsafe),
                            len(hazards) + len(rec.oob), truncated)
    return hazards, in_place, summary
