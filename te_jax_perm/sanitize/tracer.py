"""Records every memory access the Triton interpreter makes during an observed launch.

The interpreter hands whole address arrays (``uint64`` NumPy arrays) to its builder's
load/store/atomic methods; while a launch is recorded those methods are wrapped on the
``InterpreterBuilder`` class (restored when the last recorded launch ends). Pointer
provenance is tracked by tagging pointer tensors with the region of the kernel argument
they were derived from, so an overrun is charged to the buffer it overran even when it
lands inside a neighbouring buffer. Out-of-bounds lanes are reported and then masked off,
so a buggy kernel cannot corrupt host memory while being sanitized.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from te_jax_perm.sanitize.hazards import OOB, Hazard, HazardError, Pid
from te_jax_perm.sanitize.regions import RegionMap

_TAG = "te_jax_perm.region"


@dataclasses.dataclass
class Access:
    pid: int            # linear program index
    region: int
    kind: str           # "load", "store", "atomic"
    offsets: np.ndarray  # int64 byte offsets of element starts, within the region
    size: int           # bytes per element of the access


class LaunchRecord:
    """Accesses of one launch, per program."""

    def __init__(self, kernel: str, regions: RegionMap, grid: Pid, raise_first: bool):
        self.kernel = kernel
        self.regions = regions
        self.grid = grid
        self.raise_first = raise_first
        self.pid: Pid = (0, 0, 0)
        self.pid_lin = 0
        self.accesses: list[Access] = []
        self.oob: list[Hazard] = []
        self.atomic = False          # inside an atomic op that reuses load/store
        self.forced_tag: int | None = None  # region of a tensor descriptor being accessed
        self.failed = False

    def set_pid(self, pid: Pid) -> None:
        gx, gy, _ = self.grid
        self.pid = pid
        self.pid_lin = pid[0] + gx * (pid[1] + gy * pid[2])

    def pid_of(self, lin: int) -> Pid:
        gx, gy, _ = self.grid
        return (lin % gx, (lin // gx) % gy, lin // (gx * gy))

    def tag_of(self, handle) -> int | None:
        tag = handle.attr.get(_TAG)
        if tag is None and handle.data.size == 1:
            tag = self.regions.by_base.get(int(handle.data.reshape(-1)[0]))
            if tag is not None:
                handle.attr[_TAG] = tag
        return tag

    def record(self, ptrs, mask: np.ndarray | None, kind: str) -> np.ndarray | None:
        """Records the unmasked lanes; returns a mask with out-of-bounds lanes cleared
        when there are any (else ``None``)."""
        addrs = ptrs.data
        full = np.ones(addrs.shape, bool) if mask is None else np.broadcast_to(mask, addrs.shape).astype(bool)
        flat_mask = full.reshape(-1)
        a = addrs.reshape(-1)[flat_mask].astype(np.int64)
        if a.size == 0:
            return None
        size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
        tag = ptrs.attr.get(_TAG)
        if tag is None:
            tag = self.forced_tag
        if tag is None:
            tag = self.tag_of(ptrs) if ptrs.data.size == 1 else None
        if tag is None:
            tag = self.regions.attribute(a)
        reg = self.regions.regions[tag]
        off = a - reg.start
        bad = (off < 0) | (off + size > reg.nbytes)
        if bad.any():
            eoff = np.floor_divide(off[bad], reg.itemsize)
            hz = Hazard(OOB, self.kernel, reg.name, (self.pid,), kind, (int(eoff.min()), int(eoff.max()) + 1),
                        int(np.unique(eoff).size), reg.elements)
            self.oob.append(hz)
            if self.raise_first:
                self.failed = True
                raise HazardError(hz)
            off = off[~bad]
            new_mask = full.copy().reshape(-1)
            new_mask[np.flatnonzero(flat_mask)[bad]] = False
            result = new_mask.reshape(addrs.shape)
        else:
            result = None
        if off.size:
            self.accesses.append(Access(self.pid_lin, tag, "atomic" if self.atomic else kind, off, size))
        return result


_active: list[LaunchRecord] = []
_saved: dict[str, object] = {}


def _current() -> LaunchRecord | None:
    return _active[-1] if _active else None


def _pointer_tag(rec: LaunchRecord, handle, pointer_type: type) -> int | None:
    """Region tag of ``handle`` if it is a pointer tensor (a root kernel argument is tagged
    on first use by its base address), else ``None``."""
    if isinstance(getattr(handle, "dtype", None), pointer_type) and hasattr(handle, "attr"):
        return rec.tag_of(handle)
    return None


def _deriving(orig: Callable) -> Callable:
    """Wraps a builder method so that every pointer tensor it returns carries the region tag
    of the pointer tensors it was computed from (splat, broadcast, addptr, reshape, select,
    bitcast...). Offsets never carry provenance, so ``ptr + <tensor offsets>`` is charged to
    ``ptr``'s buffer wherever the addresses land. Pointers combined from two different
    buffers (a select between them) stay untagged and are attributed by address."""
    import triton.language as tl

    def wrapper(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        rec = _current()
        if rec is None:
            return out
        outs = out if isinstance(out, tuple) else (out,)
        ptr_outs = [o for o in outs if isinstance(getattr(o, "dtype", None), tl.pointer_type) and hasattr(o, "attr")]
        if ptr_outs:
            tags = {t for a in (*args, *kwargs.values()) if (t := _pointer_tag(rec, a, tl.pointer_type)) is not None}
            if len(tags) == 1:
                (tag,) = tags
                for o in ptr_outs:
                    o.attr[_TAG] = tag
        return out

    return wrapper


def _install(cls) -> None:
    orig = {name: fn for name, fn in cls.__dict__.items() if name.startswith("create_") and callable(fn)}
    _saved.update(orig)
    from triton.runtime.interpreter import TensorHandle

    def recorded(name: str, kind: str, ptr_at: int, mask_at: int) -> Callable:
        """``name`` recording its pointer argument's unmasked lanes as ``kind``, with the
        lanes out of bounds (already reported) masked off. Arguments after the mask (cache
        policies, which differ across Triton versions) pass through untouched."""
        def wrapper(self, *args):
            rec = _current()
            if rec is not None:
                mask = args[mask_at]
                new = rec.record(args[ptr_at], mask.data, kind)
                if new is not None:
                    args = args[:mask_at] + (TensorHandle(new, mask.dtype),) + args[mask_at + 1:]
            return orig[name](self, *args)
        return wrapper

    def scoped(name: str, attr: str, value: Callable) -> Callable:
        """``name`` run with the record's ``attr`` set to ``value(rec, *args)``, restored after:
        atomics that reuse loads and stores, descriptor accesses charged to their base."""
        def wrapper(self, *args):
            rec = _current()
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
        rec = _current()
        if rec is not None and rec.record(ptr, None, "atomic") is not None:
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


def _uninstall(cls) -> None:
    for name, fn in _saved.items():
        setattr(cls, name, fn)
    _saved.clear()


def begin(rec: LaunchRecord) -> None:
    from triton.runtime.interpreter import InterpreterBuilder

    if not _active:
        _install(InterpreterBuilder)
    _active.append(rec)


def end(rec: LaunchRecord) -> None:
    from triton.runtime.interpreter import InterpreterBuilder

    _active.remove(rec)
    if not _active:
        _uninstall(InterpreterBuilder)
