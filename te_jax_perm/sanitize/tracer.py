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


def _propagating(orig: Callable, pos: int, also: int | None = None) -> Callable:
    """Wraps a builder method whose result is derived from argument ``pos``: the result
    keeps that argument's region tag (and, for ``also``, only when both agree)."""

    def wrapper(self, *args):
        out = orig(self, *args)
        src = args[pos]
        attr = getattr(src, "attr", None)
        if attr:
            tag = attr.get(_TAG)
            if tag is not None and (also is None or getattr(args[also], "attr", {}).get(_TAG) == tag):
                if hasattr(out, "attr"):
                    out.attr[_TAG] = tag
        return out

    return wrapper


def _install(cls) -> None:
    orig = {name: cls.__dict__[name] for name in (
        "create_masked_load", "create_masked_store", "create_addptr", "create_splat", "create_broadcast",
        "create_expand_dims", "create_reshape", "create_trans", "create_unsplat", "create_select",
        "create_cat", "create_join", "create_atomic_rmw", "create_atomic_cas", "create_atomic_load",
        "create_atomic_store", "create_atomic_poll", "create_descriptor_load", "create_descriptor_store")
        if name in cls.__dict__}
    _saved.update(orig)
    from triton.runtime.interpreter import TensorHandle

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        rec = _current()
        if rec is not None:
            new = rec.record(ptrs, mask.data, "load")
            if new is not None:
                mask = TensorHandle(new, mask.dtype)
        return orig["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        rec = _current()
        if rec is not None:
            new = rec.record(ptrs, mask.data, "store")
            if new is not None:
                mask = TensorHandle(new, mask.dtype)
        return orig["create_masked_store"](self, ptrs, value, mask, cache_policy)

    def addptr(self, ptr, offset):
        out = orig["create_addptr"](self, ptr, offset)
        rec = _current()
        if rec is not None:
            tag = rec.tag_of(ptr)
            if tag is not None:
                out.attr[_TAG] = tag
        return out

    def atomic(name: str) -> Callable:
        def wrapper(self, *args):
            rec = _current()
            if rec is None:
                return orig[name](self, *args)
            prev, rec.atomic = rec.atomic, True
            try:
                return orig[name](self, *args)
            finally:
                rec.atomic = prev
        return wrapper

    def atomic_rmw(self, op, ptr, val, mask, sem, scope):
        rec = _current()
        if rec is not None:
            new = rec.record(ptr, mask.data, "atomic")
            if new is not None:
                mask = TensorHandle(new, mask.dtype)
        return orig["create_atomic_rmw"](self, op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        rec = _current()
        if rec is not None and rec.record(ptr, None, "atomic") is not None:
            # Out of bounds (already reported): do not touch that memory.
            return TensorHandle(np.zeros_like(cmp.data), cmp.dtype.scalar)
        return orig["create_atomic_cas"](self, ptr, cmp, val, sem, scope)

    def descriptor(name: str) -> Callable:
        def wrapper(self, desc, *args):
            rec = _current()
            if rec is None:
                return orig[name](self, desc, *args)
            prev, rec.forced_tag = rec.forced_tag, rec.tag_of(desc.base)
            try:
                return orig[name](self, desc, *args)
            finally:
                rec.forced_tag = prev
        return wrapper

    patched = {
        "create_masked_load": masked_load, "create_masked_store": masked_store, "create_addptr": addptr,
        "create_atomic_rmw": atomic_rmw, "create_atomic_cas": atomic_cas,
        "create_atomic_load": atomic("create_atomic_load"), "create_atomic_store": atomic("create_atomic_store"),
        "create_atomic_poll": atomic("create_atomic_poll"),
        "create_descriptor_load": descriptor("create_descriptor_load"),
        "create_descriptor_store": descriptor("create_descriptor_store"),
        "create_splat": _propagating(orig["create_splat"], 1),
        "create_unsplat": _propagating(orig["create_unsplat"], 0),
        "create_select": _propagating(orig["create_select"], 1, also=2),
        "create_cat": _propagating(orig["create_cat"], 0, also=1),
        "create_join": _propagating(orig["create_join"], 0, also=1),
    }
    for name in ("create_broadcast", "create_expand_dims", "create_reshape", "create_trans"):
        patched[name] = _propagating(orig[name], 0)
    for name, fn in patched.items():
        if name in orig:
            setattr(cls, name, fn)


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
