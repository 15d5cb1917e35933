"""Trial inputs for a launch shape: the declaration's generator, or a generic fallback."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from te_jax_perm.core.declaration import KernelDecl


def make_inputs(decl: KernelDecl, dims: Mapping[str, int], params: Mapping[str, Any],
                dtypes: Sequence[Any], seed: int = 0) -> list[np.ndarray]:
    """Fresh random operands of the traced shapes and dtypes.

    Without ``decl.example_inputs``, integers are drawn from ``[0, smallest dim)`` so they
    are valid indices into any axis of any operand.
    """
    rng = np.random.default_rng(seed)
    named = {op.name: np.dtype(dt) for op, dt in zip(decl.operands, dtypes)}
    if decl.example_inputs is not None:
        arrays = [np.asarray(a) for a in decl.example_inputs(dims, params, named, rng)]
    else:
        hi = max(1, min(dims.values())) if dims else 1
        arrays = []
        for op, dt in zip(decl.operands, dtypes):
            shape = tuple(dims[d] for d in op.dims)
            dt = np.dtype(dt)
            if dt == np.bool_:
                arrays.append(rng.integers(0, 2, shape).astype(bool))
            elif np.issubdtype(dt, np.integer):
                arrays.append(rng.integers(0, hi, shape).astype(dt))
            else:
                arrays.append(rng.standard_normal(shape).astype(np.float32).astype(dt))
    for op, a, dt in zip(decl.operands, arrays, dtypes):
        want = tuple(dims[d] for d in op.dims)
        if a.shape != want or a.dtype != np.dtype(dt):
            raise ValueError(f"{decl.name}: example_inputs gave {op.name!r} shape {a.shape} dtype {a.dtype}; "
                             f"expected {want} {np.dtype(dt)}")
    return arrays


def initial_prealloc(zeroed: bool, shape: tuple[int, ...], dtype: Any, seed: int = 1) -> np.ndarray:
    """An output buffer's contents before a launch (``zeroed`` from the alias plan).

    Buffers not zeroed get random bytes, so a config that skips elements it must write is
    caught by validation instead of passing on lucky zeros.
    """
    dtype = np.dtype(dtype)
    if zeroed:
        return np.zeros(shape, dtype)
    raw = np.random.default_rng(seed).integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape).copy()
