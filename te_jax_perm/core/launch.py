"""One kernel call, and one launch of it: every fact derived once from the declaration.

A :class:`Call` binds a declaration to operand shapes/dtypes, static params and a backend
(dims bound and checked, output avals derived); configs are chosen for it. A
:class:`Launch` adds the config: grid, runtime scalars, constexprs, checked against the
constraints and the kernel's signature. Both are frozen, built where a call is lowered and
passed down to the backend, the tuner and the sanitizer, which never re-derive any of it.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from absl import logging

from te_jax_perm.core import hooks
from te_jax_perm.core.aliasing import AliasPlan, alias_plan
from te_jax_perm.core.declaration import Config, Dims, KernelDecl, Operand, Params
from te_jax_perm.core.kernel_args import check_signature


# -- operand and parameter checks -------------------------------------------------------------
_KIND = {
    # By name: NumPy does not count ml_dtypes' floats (bfloat16, float8_*) as np.floating.
    "float": lambda dt: dt.name.startswith(("float", "bfloat")),
    "int": lambda dt: np.issubdtype(dt, np.integer),
    "bool": lambda dt: dt == np.bool_,
}


def check_operand_count(decl: KernelDecl, n: int) -> None:
    if n != len(decl.operands):
        raise TypeError(f"{decl.name}: expected {len(decl.operands)} operands "
                        f"({', '.join(o.name for o in decl.operands)}), got {n}")


def check_operands(decl: KernelDecl, operands: Sequence[Any]) -> None:
    """No string or ``None`` among them, then their count: an option passed positionally (a
    backend name) would otherwise fail inside JAX's array conversion, naming nothing of ours."""
    names = ", ".join(o.name for o in decl.operands)
    for i, v in enumerate(operands):
        if v is None or isinstance(v, str):
            which = f"argument {decl.operands[i].name!r}" if i < len(decl.operands) else f"positional argument {i}"
            raise TypeError(f"{decl.name}: {which} is {v!r}; expected an array (the operands are {names}; pass "
                            "backend, config and params by keyword)")
    check_operand_count(decl, len(operands))


def bind_dims(decl: KernelDecl, avals: Sequence[Any]) -> dict[str, int]:
    """Each operand's symbolic dims bound to sizes; errors name the kernel, the argument,
    the shape seen and the shape expected."""
    check_operand_count(decl, len(avals))
    dims: dict[str, int] = {}
    where: dict[str, str] = {}
    for op, aval in zip(decl.operands, avals):
        shape = tuple(aval.shape)
        if len(shape) != len(op.dims):
            raise ValueError(f"{decl.name}: argument {op.name!r} has shape {shape} (rank {len(shape)}); "
                             f"expected rank {len(op.dims)} with axes {_fmt_expected(op, dims)}")
        dt = np.dtype(aval.dtype)
        if op.dtypes is not None and not any(_KIND[k](dt) if k in _KIND else dt.name == k for k in op.dtypes):
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
    """Exactly the declared params, each a hashable Python value (it sets shapes or the grid)."""
    if set(params) != set(decl.params):
        raise TypeError(f"{decl.name}: static params mismatch: missing {sorted(set(decl.params) - set(params))}, "
                        f"unexpected {sorted(set(params) - set(decl.params))}")
    for k, v in params.items():
        if isinstance(v, (jax.core.Tracer, jax.Array)):
            raise TypeError(f"{decl.name}: parameter {k!r} must be a static Python value "
                            f"(it sets output shapes or the grid), got a traced/array value "
                            f"{getattr(v, 'aval', type(v))}; pass a Python int or mark it static")
        try:
            hash(v)
        except TypeError as e:
            raise TypeError(f"{decl.name}: parameter {k!r} must be hashable, got {type(v)}") from e


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return types.MappingProxyType(dict(mapping))


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
    """A declared kernel at one set of operand shapes/dtypes, static params and backend."""

    decl: KernelDecl
    backend: str
    avals: tuple[jax.core.ShapedArray, ...]
    params: Params
    dims: Dims
    out_avals: tuple[jax.core.ShapedArray, ...]

    @property
    def dtypes(self) -> tuple[np.dtype, ...]:
        """Operand dtypes, in operand order."""
        return tuple(np.dtype(a.dtype) for a in self.avals)

    @property
    def aliases(self) -> AliasPlan:
        return alias_plan(self.decl)


def _shaped(shape: Sequence[int], dtype: Any) -> jax.core.ShapedArray:
    return jax.core.ShapedArray(tuple(int(s) for s in shape), np.dtype(dtype))


def bind_call(decl: KernelDecl, avals: Sequence[Any], params: Params, backend: str) -> Call:
    """The :class:`Call` of ``decl`` on operands shaped like ``avals`` (anything with
    ``.shape`` and ``.dtype``). Raises, naming the argument, when they or ``params`` do not
    fit the declaration."""
    check_static_params(decl, params)
    for op, a in zip(decl.operands, avals):
        if not all(isinstance(s, (int, np.integer)) for s in a.shape):
            # Sizes set grids, tiles and buffer lengths at compile time.
            raise TypeError(f"{decl.name}: argument {op.name!r} has shape {tuple(a.shape)} with symbolic sizes "
                            "(as jax.export's symbolic shapes make); expected concrete sizes")
    items = tuple(sorted(params.items()))
    return _bind(decl, tuple(_shaped(a.shape, a.dtype) for a in avals), items, backend,
                 tuple(_types(v) for _, v in items))


def _types(v: Any) -> Any:
    """``v``'s type, and its items' types for a tuple or frozenset: ``(2,) == (2.0,)`` too."""
    if isinstance(v, tuple):
        return type(v), tuple(_types(x) for x in v)
    if isinstance(v, frozenset):
        return type(v), frozenset((x, _types(x)) for x in v)
    return type(v)


# Abstract evaluation, lowering and the tuner all bind the same call: derive it once. The
# params' types (inside tuples too) are part of the key: 1 == True, and params_check must
# see each as given.
@functools.lru_cache(maxsize=4096)
def _bind(decl: KernelDecl, avals: tuple, param_items: tuple, backend: str, param_types: tuple) -> Call:
    params = dict(param_items)
    dims = bind_dims(decl, avals)
    if decl.params_check is not None:
        decl.params_check(dims, params)
    dtypes = {op.name: np.dtype(a.dtype) for op, a in zip(decl.operands, avals)}
    out_avals = tuple(_shaped(o.shape(dims, params), o.dtype(dtypes, params)) for o in decl.outputs)
    return Call(decl, backend, avals, _frozen(params), _frozen(dims), out_avals)


@dataclasses.dataclass(frozen=True, eq=False)
class Launch:
    """A :class:`Call` with its config: what one kernel launch needs, derived once."""

    call: Call
    config: Config
    grid: tuple[int, ...]
    scalars: Mapping[str, Any]       # runtime scalar kernel arguments, in kernel order
    constexprs: Mapping[str, Any]    # the config's constants plus the declared ones, in kernel order

    decl = property(lambda self: self.call.decl)
    backend = property(lambda self: self.call.backend)
    avals = property(lambda self: self.call.avals)
    params = property(lambda self: self.call.params)
    dims = property(lambda self: self.call.dims)
    out_avals = property(lambda self: self.call.out_avals)
    aliases = property(lambda self: self.call.aliases)

    @property
    def grid3(self) -> tuple[int, int, int]:
        """The grid padded to three axes, as CUDA and the interpreter take it."""
        return tuple(self.grid) + (1,) * (3 - len(self.grid))  # type: ignore[return-value]

    @property
    def empty(self) -> bool:
        """No program to run (CUDA rejects empty grids; preallocated buffers are the result)."""
        return any(g == 0 for g in self.grid)


def configure(call: Call, config: Config) -> Launch:
    """The launch of ``call`` with ``config``; raises if the config violates a declared
    constraint for these dims or the kernel's parameters do not follow the declaration."""
    decl, dims, params = call.decl, call.dims, call.params
    if why := decl.violated(dims, params, config):
        raise ValueError(f"{decl.name}: {config} is invalid for dims {dict(dims)}: {why}")
    raw = decl.grid(dims, params, config)
    # Triton launches one to three grid axes; anything else would fail inside its launcher
    # (a bare count, here) with a message that names neither the kernel nor the grid.
    grid = tuple(int(g) for g in raw) if isinstance(raw, (tuple, list)) else ()
    if not 1 <= len(grid) <= 3 or min(grid) < 0:
        raise ValueError(f"{decl.name}: its grid for {config} at dims {dict(dims)} is {raw!r}; "
                         "expected one to three program counts, none negative")
    if min(grid) == 0:
        # No program runs, so an output that does not start as zeros would be returned as
        # allocated: memory nobody wrote.
        for out, aval, zeroed in zip(decl.outputs, call.out_avals, call.aliases.zeroed):
            if not zeroed and aval.size:
                raise ValueError(f"{decl.name}: its grid for {config} at dims {dict(dims)} is {grid}, which runs "
                                 f"no program, but output {out.name!r} has shape {aval.shape} and does not start "
                                 "as zeros: nothing would write it; expected a grid with programs for every "
                                 "output element, or init='zeros'")
    constexprs = {**config.kw, **decl.constexprs(dims, params, config)}
    scalars = dict(decl.scalars(dims, params))
    constexprs = check_signature(decl, scalars, constexprs)  # now in the kernel's order
    return Launch(call, config, grid, _frozen(scalars), _frozen(constexprs))


def select_config(call: Call, explicit: Config | None) -> Config:
    """The config ``call`` launches with: ``explicit``, else the installed resolver's pick
    (the autotuner's), else the declaration's default (:func:`configure` checks whichever
    it is against the constraints)."""
    hooks.notify_call(call)
    if explicit is not None:
        return explicit
    if (picked := hooks.resolve_config(call)) is not None:
        return picked
    cfg = call.decl.default_config(call.dims, call.params)
    logging.vlog(1, "%s: default config %s for %s", call.decl.name, cfg, dict(call.dims))
    return cfg
