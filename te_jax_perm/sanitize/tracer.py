"""Records every memory access the Triton interpreter makes during an observed launch,
and finds the launch's cross-program hazards.

The interpreter hands whole address arrays to its builder's load/store/atomic methods;
the first recorded launch wraps those methods on ``InterpreterBuilder`` for good (outside
a recorded launch the wrappers only pass the call on). Pointer tensors are tagged with the region of the
kernel argument they derive from, so an overrun is charged to the buffer it overran even
where it lands in a neighbouring one. Out-of-bounds lanes are reported, then masked off,
so a buggy kernel cannot corrupt host memory while being sanitized.

A prealloc and its output are one memory (the declared alias), so they form one region
named by the output; a prealloc XLA did *not* place on its output stays a region of its
own, ``<output>.prealloc``. An input placed on exactly an output's memory joins that
output's region: its loads are then loads of the output's bytes, which is in-place use.

The analysis encodes every accessed byte as ``byte * P + pid`` (``P`` programs), so one
:func:`unique` gives each region's (byte, program) pairs sorted by byte: two programs
storing a byte are adjacent entries, and a load of a byte another program stores is
found by ``searchsorted`` into the stores.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Callable, Iterator, Sequence

import numpy as np

from te_jax_perm.core.hooks import BufferInfo
from te_jax_perm.sanitize.hazards import (IN_PLACE, INPUT_WRITE, OOB, READ_WRITE, UNWRITTEN, WRITE_WRITE, Hazard,
                                          HazardError, LaunchSummary, Pid)

_TAG = "te_jax_perm.region"
# Per launch and hazard class, at most this many (program pair) hazards are recorded.
MAX_PER_CLASS = 16


# -- regions -----------------------------------------------------------------------------------
class RegionMap:
    """The launch's regions (buffers whose role is "input" or "output"), with address ->
    region attribution."""

    def __init__(self, buffers: Sequence[BufferInfo]):
        outputs = {b.name: b for b in buffers if b.role == "output"}
        out_mem = {(b.address, b.nbytes) for b in outputs.values() if b.nbytes}
        regions: list[BufferInfo] = []
        for b in buffers:
            if b.role == "prealloc":
                out = outputs.get(b.name.removesuffix(".prealloc"))
                if out is not None and out.address == b.address:
                    continue
            if b.role == "input" and (b.address, b.nbytes) in out_mem:
                continue
            regions.append(dataclasses.replace(b, role="input" if b.role == "input" else "output"))
        self.regions = regions
        # Base address -> region, preferring non-empty regions when addresses coincide
        # (an empty buffer may sit at any address): the preferred one is assigned last.
        order = sorted(range(len(regions)), key=lambda i: (regions[i].nbytes == 0, regions[i].role == "input"))
        self.by_base = {regions[i].address: i for i in reversed(order)}
        starts = np.asarray([r.address for r in regions], dtype=np.int64)
        ends = starts + np.asarray([r.nbytes for r in regions], dtype=np.int64)
        self._all_idx = np.argsort(starts, kind="stable")           # every region, by address
        self._all_starts = starts[self._all_idx]
        self._live = self._all_idx[ends[self._all_idx] > self._all_starts]   # the non-empty ones
        self._starts, self._ends = starts[self._live], ends[self._live]

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


# -- recording ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Access:
    pid: int            # linear program index
    region: int
    kind: str           # "load", "store", "atomic"
    offsets: np.ndarray  # int64 byte offsets of element starts, within the region
    size: int           # bytes per element of the access


class LaunchRecord:
    """Accesses of one launch, per program."""

    def __init__(self, kernel: str, buffers: Sequence[BufferInfo], grid: Pid, raise_first: bool):
        self.kernel = kernel
        self.regions = RegionMap(buffers)
        self.grid = grid
        self.raise_first = raise_first
        self.accesses: list[Access] = []
        self.oob: list[Hazard] = []
        self.atomic = False          # inside an atomic op that reuses load/store
        self.forced_tag: int | None = None  # region of a tensor descriptor being accessed
        self.failed = False

    def pid_of(self, lin: int) -> Pid:
        return tuple(int(i) for i in np.unravel_index(lin, self.grid, order="F"))

    def tag_of(self, handle) -> int | None:
        tag = handle.attr.get(_TAG)
        if tag is None and handle.data.size == 1:
            tag = self.regions.by_base.get(int(handle.data.reshape(-1)[0]))
            if tag is not None:
                handle.attr[_TAG] = tag
        return tag

    def record(self, pid: Pid, ptrs, mask: np.ndarray | None, kind: str) -> np.ndarray | None:
        """Records program ``pid``'s unmasked lanes; returns a mask with out-of-bounds lanes
        cleared when there are any (else ``None``)."""
        addrs = ptrs.data
        full = np.ones(addrs.shape, bool) if mask is None else np.broadcast_to(mask, addrs.shape).astype(bool)
        flat_mask = full.reshape(-1)
        a = addrs.reshape(-1)[flat_mask].astype(np.int64)
        if a.size == 0:
            return None
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        # The region: the pointer's provenance, else the tensor descriptor's being accessed,
        # else a root argument's (by base address), else attributed by address.
        tag = ptrs.attr.get(_TAG, self.forced_tag)
        tag = self.tag_of(ptrs) if tag is None else tag
        tag = self.regions.attribute(a) if tag is None else tag
        reg = self.regions.regions[tag]
        off = a - reg.address
        bad = (off < 0) | (off + size > reg.nbytes)
        result = None
        if bad.any():
            eoff = np.floor_divide(off[bad], reg.itemsize)
            hz = Hazard(OOB, self.kernel, reg.name, (tuple(pid),), kind, (int(eoff.min()), int(eoff.max()) + 1),
                        int(unique(eoff).size), reg.elements)
            self.oob.append(hz)
            if self.raise_first:
                self.failed = True
                raise HazardError(hz)
            off = off[~bad]
            flat_mask[np.flatnonzero(flat_mask)[bad]] = False   # a view of ``full``, this call's own array
            result = full
        if off.size:
            lin = int(np.ravel_multi_index(tuple(pid), self.grid, order="F"))
            self.accesses.append(Access(lin, tag, "atomic" if self.atomic else kind, off, size))
        return result


_active: list[LaunchRecord] = []


def current() -> LaunchRecord | None:
    """The record of the launch being run, if it is observed."""
    return _active[-1] if _active else None


def _deriving(orig: Callable) -> Callable:
    """Wraps a builder method so that every pointer tensor it returns carries the region tag
    of the pointer tensors it was computed from (splat, broadcast, addptr, reshape, select,
    bitcast...). Offsets never carry provenance, so ``ptr + <tensor offsets>`` is charged to
    ``ptr``'s buffer wherever the addresses land. Pointers combined from two different
    buffers (a select between them) stay untagged and are attributed by address."""
    import triton.language as tl

    def is_pointer(h) -> bool:
        return isinstance(getattr(h, "dtype", None), tl.pointer_type) and hasattr(h, "attr")

    def wrapper(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        rec = current()
        if rec is None:
            return out
        ptr_outs = [o for o in (out if isinstance(out, tuple) else (out,)) if is_pointer(o)]
        if ptr_outs:
            # A root kernel argument is tagged on first use, by its base address.
            tags = {t for a in (*args, *kwargs.values()) if is_pointer(a) and (t := rec.tag_of(a)) is not None}
            if len(tags) == 1:
                for o in ptr_outs:
                    o.attr[_TAG] = next(iter(tags))
        return out

    return wrapper


@functools.lru_cache(maxsize=None)
def _install() -> None:
    from triton.runtime.interpreter import InterpreterBuilder as cls, TensorHandle

    orig = {name: fn for name, fn in cls.__dict__.items() if name.startswith("create_") and callable(fn)}

    def recorded(name: str, kind: str, ptr_at: int, mask_at: int) -> Callable:
        """``name`` recording its pointer argument's unmasked lanes as ``kind`` for the
        program the builder is running, with the lanes out of bounds (already reported)
        masked off. Arguments after the mask (cache policies, which differ across Triton
        versions and come by keyword from tensor descriptor loads) pass through untouched."""
        def wrapper(self, *args, **kwargs):
            rec = current()
            if rec is not None:
                mask = args[mask_at]
                if (new := rec.record(self.grid_idx, args[ptr_at], mask.data, kind)) is not None:
                    args = args[:mask_at] + (TensorHandle(new, mask.dtype),) + args[mask_at + 1:]
            return orig[name](self, *args, **kwargs)
        return wrapper

    def scoped(name: str, attr: str, value: Callable) -> Callable:
        """``name`` run with the record's ``attr`` set to ``value(rec, *args)``, restored after:
        atomics that reuse loads and stores, descriptor accesses charged to their base."""
        def wrapper(self, *args):
            rec = current()
            if rec is None:
                return orig[name](self, *args)
            prev = getattr(rec, attr)
            setattr(rec, attr, value(rec, *args))
            try:
                return orig[name](self, *args)
            finally:
                setattr(rec, attr, prev)
        return wrapper

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        rec = current()
        if rec is not None and rec.record(self.grid_idx, ptr, None, "atomic") is not None:
            # Out of bounds (already reported): do not touch that memory.
            return TensorHandle(np.zeros_like(cmp.data), cmp.dtype.scalar)
        return orig["create_atomic_cas"](self, ptr, cmp, val, sem, scope)

    recording = {
        "create_masked_load": recorded("create_masked_load", "load", 0, 1),
        "create_masked_store": recorded("create_masked_store", "store", 0, 2),
        "create_atomic_rmw": recorded("create_atomic_rmw", "atomic", 1, 3), "create_atomic_cas": atomic_cas,
        **{n: scoped(n, "atomic", lambda rec, *a: True)
           for n in ("create_atomic_load", "create_atomic_store", "create_atomic_poll")},
        **{n: scoped(n, "forced_tag", lambda rec, desc, *a: rec.tag_of(desc.base))
           for n in ("create_descriptor_load", "create_descriptor_store")},
    }
    for name, fn in orig.items():
        setattr(cls, name, recording[name] if name in recording else _deriving(fn))


def begin(rec: LaunchRecord) -> None:
    _install()
    _active.append(rec)


def end() -> LaunchRecord:
    """Ends the current launch's record and returns it."""
    return _active.pop()


# -- analysis ----------------------------------------------------------------------------------
def unique(a: np.ndarray) -> np.ndarray:
    """The sorted distinct values of a 1-D integer array: ``np.unique``'s answer by one sort.
    NumPy 2.4's ``np.unique`` hashes integer arrays instead, some 70 times slower on the
    millions of byte keys a large launch records (3M keys: 5.2 s against 0.07 s)."""
    s = np.sort(a)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if s.size else s


def _keys(rec: LaunchRecord, region: int, kind: str, nprog: int) -> np.ndarray:
    """Sorted unique ``byte * nprog + pid`` of one region's accesses of one kind."""
    parts = [(a.offsets[:, None] + np.arange(a.size, dtype=np.int64)).reshape(-1) * nprog + a.pid
             for a in rec.accesses if a.region == region and a.kind == kind]
    return unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)


def _by_pair(first: np.ndarray, second: np.ndarray, byte: np.ndarray, reg: BufferInfo
             ) -> Iterator[tuple[int, int, tuple[int, int], int]]:
    """Groups conflicting bytes by program pair: (first, second, element range, count)."""
    if byte.size == 0:   # the common case, a clean launch: np.unique(axis=0) costs ms even on nothing
        return
    elem = byte // reg.itemsize
    uniq, inv = np.unique(np.stack([first, second], axis=1), axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    for k, (p, q) in enumerate(uniq):
        e = elem[inv == k]
        yield int(p), int(q), (int(e.min()), int(e.max()) + 1), int(unique(e).size)


def _cross_reads(loads: np.ndarray, stores: np.ndarray, nprog: int):
    """Loads of bytes that some *other* program stores: (reader, writer, byte) arrays."""
    sb, sp = stores // nprog, stores % nprog
    lb, lp = loads // nprog, loads % nprog
    lo = np.searchsorted(sb, lb, side="left")
    n = np.searchsorted(sb, lb, side="right") - lo   # stores of each loaded byte
    if sb.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    first = sp[np.minimum(lo, sb.size - 1)]
    second = sp[np.minimum(lo + 1, sb.size - 1)]
    writer = np.where(first != lp, first, second)
    hit = (n > 1) | ((n == 1) & (first != lp))
    return lp[hit], writer[hit], lb[hit]


def _unwritten(kernel: str, reg: BufferInfo, *written: np.ndarray) -> Hazard | None:
    """The elements of an output that must be stored in full (``full_write``) of which some
    byte is in none of the ``written`` byte offsets (stored, updated atomically), as one
    hazard; ``None`` if there are none."""
    done = np.zeros(reg.nbytes, bool)
    for w in written:
        done[w] = True
    if done.all():
        return None
    elem = unique(np.flatnonzero(~done) // reg.itemsize)
    return Hazard(UNWRITTEN, kernel, reg.name, (), "store", (int(elem[0]), int(elem[-1]) + 1), int(elem.size),
                  reg.elements)


def analyse(rec: LaunchRecord) -> tuple[list[Hazard], list[Hazard], LaunchSummary]:
    """Hazards of the launch as run, ``in_place`` findings for hypothetical aliasing, and
    the launch summary."""
    regions = rec.regions.regions
    nprog = math.prod(rec.grid)
    hazards: list[Hazard] = []
    in_place: list[Hazard] = []
    truncated = 0
    loaded, stored, atomic = {}, {}, {}
    stores = [_keys(rec, i, "store", nprog) for i in range(len(regions))]
    loads = [_keys(rec, i, "load", nprog) for i in range(len(regions))]

    def emit(kind: str, reg: BufferInfo, pairs, access: str, input_name: str | None = None) -> None:
        nonlocal truncated
        into, pairs = in_place if kind == IN_PLACE else hazards, list(pairs)
        truncated += max(0, len(pairs) - MAX_PER_CLASS)
        for p, q, elems, count in pairs[:MAX_PER_CLASS]:
            progs = (rec.pid_of(p),) if q < 0 else (rec.pid_of(p), rec.pid_of(q))
            into.append(Hazard(kind, rec.kernel, reg.name, progs, access, elems, count, reg.elements, input_name))

    for i, (reg, st, ld) in enumerate(zip(regions, stores, loads)):
        stored[reg.name] = int(unique(st // nprog).size)
        loaded[reg.name] = int(unique(ld // nprog).size)
        at = unique(_keys(rec, i, "atomic", nprog) // nprog)
        atomic[reg.name] = int(at.size)
        # Each class from its (possibly empty) conflicting bytes: no bytes, no pairs.
        sb, sp = st // nprog, st % nprog
        if reg.role == "input":
            emit(INPUT_WRITE, reg, _by_pair(sp, np.full_like(sp, -1), sb, reg), "store")
        dup = np.flatnonzero(sb[1:] == sb[:-1])
        emit(WRITE_WRITE, reg, _by_pair(sp[dup], sp[dup + 1], sb[dup], reg), "store")
        emit(READ_WRITE, reg, _by_pair(*_cross_reads(ld, st, nprog), reg), "load")
        if reg.full_write and (gap := _unwritten(rec.kernel, reg, sb, at)) is not None:
            hazards.append(gap)

    # Hypothetical in-place use: input i placed on output j's memory (same shape/dtype),
    # so input i's loads become loads of output j's bytes.
    checked, unsafe = [], []
    for (i, src), (j, dst) in itertools.product(enumerate(regions), repeat=2):
        if src.role != "input" or dst.role != "output" or dst.shape != src.shape or dst.dtype != src.dtype:
            continue
        checked.append((src.name, dst.name))
        r, w, b = _cross_reads(loads[i], stores[j], nprog)
        if r.size:
            unsafe.append((src.name, dst.name))
            emit(IN_PLACE, dst, _by_pair(r, w, b, dst), "load", src.name)

    summary = LaunchSummary(rec.kernel, rec.grid, loaded, stored, atomic, tuple(checked), tuple(unsafe),
                            len(hazards) + len(rec.oob), truncated)
    return hazards, in_place, summary
