"""Trace-time checking of operands and static parameters against a declaration."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np

from te_jax_perm.core.declaration import KernelDecl, Operand

_KIND = {
    # jnp.issubdtype: NumPy does not count ml_dtypes floats (bfloat16) as np.floating.
    "float": lambda dt: jax.numpy.issubdtype(dt, jax.numpy.floating) or dt.name.startswith("float8"),
    "int": lambda dt: np.issubdtype(dt, np.integer),
    "bool": lambda dt: dt == np.bool_,
}


def _dtype_ok(op: Operand, dt: np.dtype) -> bool:
    if op.dtypes is None:
        return True
    return any((_KIND[k](dt) if k in _KIND else dt.name == k) for k in op.dtypes)


def bind_dims(decl: KernelDecl, avals: Sequence[Any]) -> dict[str, int]:
    """Binds each operand's symbolic dims to sizes, raising on any mismatch.

    Errors name the kernel, the argument, the shape seen and the shape expected.
    """
    if len(avals) != len(decl.operands):
        raise TypeError(f"{decl.name}: expected {len(decl.operands)} operands "
                        f"({', '.join(o.name for o in decl.operands)}), got {len(avals)}")
    dims: dict[str, int] = {}
    where: dict[str, str] = {}
    for op, aval in zip(decl.operands, avals):
        shape = tuple(aval.shape)
        if len(shape) != op.rank:
            raise ValueError(f"{decl.name}: argument {op.name!r} has shape {shape} (rank {len(shape)}); "
                             f"expected rank {op.rank} with axes {_fmt_expected(op, dims)}")
        dt = np.dtype(aval.dtype)
        if not _dtype_ok(op, dt):
            raise TypeError(f"{decl.name}: argument {op.name!r} has dtype {dt.name}; "
                            f"expected one of {list(op.dtypes)}")
        for name, size in zip(op.dims, shape):
            if name in dims and dims[name] != size:
                raise ValueError(
                    f"{decl.name}: argument {op.name!r} has shape {shape}; expected "
                    f"{_fmt_expected(op, dims)} (axis {name}={dims[name]} from {where[name]!r})")
            dims.setdefault(name, int(size))
            where.setdefault(name, op.name)
    return dims


def _fmt_expected(op: Operand, dims: Mapping[str, int]) -> str:
    return "(" + ", ".join(f"{d}={dims[d]}" if d in dims else d for d in op.dims) + ")"


def check_static_params(decl: KernelDecl, params: Mapping[str, Any]) -> None:
    missing = set(decl.params) - set(params)
    extra = set(params) - set(decl.params)
    if missing or extra:
        raise TypeError(f"{decl.name}: static params mismatch: missing {sorted(missing)}, "
                        f"unexpected {sorted(extra)}")
    for k, v in params.items():
        if isinstance(v, jax.core.Tracer) or isinstance(v, jax.Array):
            raise TypeError(f"{decl.name}: parameter {k!r} must be a static Python value "
                            f"(it sets output shapes or the grid), got a traced/array value "
                            f"{getattr(v, 'aval', type(v))}; pass a Python int or mark it static")
        try:
            hash(v)
        except TypeError as e:
            raise TypeError(f"{decl.name}: parameter {k!r} must be hashable, got {type(v)}") from e
