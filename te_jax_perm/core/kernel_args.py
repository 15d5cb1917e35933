"""Derives one launch's grid, runtime scalars and compile-time constants from a declaration."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from te_jax_perm.core.declaration import Config, KernelDecl
from te_jax_perm.core.shapes import bind_dims


@dataclasses.dataclass(frozen=True)
class KernelArgs:
    grid: tuple[int, ...]
    scalars: dict[str, int]
    constexprs: dict[str, Any]
    config: Config

    @staticmethod
    def build(decl: KernelDecl, avals: Sequence[Any], params: Mapping[str, Any], config: Config) -> "KernelArgs":
        dims = bind_dims(decl, avals)
        why = decl.violated(dims, params, config)
        if why:
            raise ValueError(f"{decl.name}: {config} is invalid for dims {dict(dims)}: {why}")
        grid = tuple(int(g) for g in decl.grid(dims, params, config))
        constexprs = {**config.kw, **decl.constexprs(dims, params, config)}
        scalars = dict(decl.scalars(dims, params))
        check_signature(decl, scalars, constexprs)
        return KernelArgs(grid, scalars, constexprs, config)


def check_signature(decl: KernelDecl, scalars: Mapping[str, Any], constexprs: Mapping[str, Any]) -> None:
    """The kernel's parameters must follow the calling convention by name, not just count.

    Arguments are passed by position, so a scalar that one side moved to a constexpr would
    otherwise shift every later argument by one (a pointer landing in a size slot) while the
    count still matched.
    """
    names = list(decl.kernel.arg_names)
    n_ops, n_outs = len(decl.operands), len(decl.outputs)
    positional = n_ops + len(scalars) + 2 * n_outs
    got_scalars = names[n_ops:n_ops + len(scalars)]
    rest = set(names[positional:])
    if (got_scalars != list(scalars) or len(names) != positional + len(constexprs)
            or rest != set(constexprs)):
        raise TypeError(
            f"{decl.name}: kernel {decl.kernel.fn.__name__}{tuple(names)} does not match its declaration: "
            f"{n_ops} operand pointers, scalars {list(scalars)}, {n_outs} prealloc + {n_outs} output "
            f"pointers, constexprs {sorted(constexprs)}")
