"""Comparing a candidate's outputs with the declared reference."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from te_jax_perm.core.declaration import KernelDecl

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _floating(dtype: np.dtype) -> bool:
    return np.issubdtype(dtype, np.floating) or dtype.name.startswith(("bfloat", "float"))


def mismatch(decl: KernelDecl, got: Sequence[Any], want: Sequence[Any], xp: Any = np) -> str | None:
    """None when ``got`` matches; otherwise which output differs and how. ``xp`` is the
    array module the outputs live in (``numpy`` on the host, ``jax.numpy`` on a device,
    where a large output is compared without a copy to the host)."""
    for o, g, w in zip(decl.outputs, got, want):
        g, w = xp.asarray(g), xp.asarray(w)
        dtype = np.dtype(w.dtype)
        if g.shape != w.shape or np.dtype(g.dtype) != dtype:
            return f"{o.name}: shape/dtype {g.shape} {g.dtype} != reference {w.shape} {w.dtype}"
        if decl.exact or not _floating(dtype):
            if _floating(dtype):  # bitwise: NaN payloads and signed zeros count
                g, w = g.view(_UINT[dtype.itemsize]), w.view(_UINT[dtype.itemsize])
            n = int(xp.sum(g != w))
            if n:
                return f"{o.name}: {n} of {g.size} elements differ bitwise from the reference"
        else:
            gf, wf = g.astype(np.float32), w.astype(np.float32)
            ok = xp.isclose(gf, wf, rtol=decl.rtol, atol=decl.atol, equal_nan=True)
            bad = int(xp.sum(~ok))
            if bad:
                i = tuple(int(x) for x in np.unravel_index(int(xp.argmin(ok.astype(np.int8))), ok.shape))
                return (f"{o.name}: {bad} of {g.size} elements outside rtol={decl.rtol} "
                        f"atol={decl.atol}; e.g. at {i}: {float(gf[i])} vs {float(wf[i])}")
    return None
