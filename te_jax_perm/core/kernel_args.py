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
        return KernelArgs(grid, dict(decl.scalars(dims, params)), constexprs, config)
