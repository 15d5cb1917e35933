"""Comparing a candidate's outputs with the declared reference."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from te_jax_perm.core.declaration import KernelDecl


def mismatch(decl: KernelDecl, got: Sequence[np.ndarray], want: Sequence[np.ndarray]) -> str | None:
    """None when ``got`` matches; otherwise which output differs and how."""
    for o, g, w in zip(decl.outputs, got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"{o.name}: shape/dtype {g.shape} {g.dtype} != reference {w.shape} {w.dtype}"
        if decl.exact or not (np.issubdtype(w.dtype, np.floating) or w.dtype.name.startswith(("bfloat", "float"))):
            n = int((_bytes(g) != _bytes(w)).any(axis=-1).sum())
            if n:
                return f"{o.name}: {n} of {g.size} elements differ bitwise from the reference"
        else:
            gf, wf = g.astype(np.float32), w.astype(np.float32)
            ok = np.isclose(gf, wf, rtol=decl.rtol, atol=decl.atol, equal_nan=True)
            if not ok.all():
                i = np.unravel_index(int(np.argmin(ok)), ok.shape)
                return (f"{o.name}: {int((~ok).sum())} of {g.size} elements outside rtol={decl.rtol} "
                        f"atol={decl.atol}; e.g. at {i}: {gf[i]} vs {wf[i]}")
    return None


def _bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(a.size, a.dtype.itemsize)
