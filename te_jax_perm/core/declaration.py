"""Kernel declarations: the single source every primitive property is derived from.

The kernel's calling convention is ``core/kernel_args.py``'s. ``prealloc_ptrs[i]`` and
``output_ptrs[i]`` point at the same memory: the preallocated buffer is an extra
custom-call operand declared aliased to output ``i`` (XLA's Triton call passes an aliased
output both as the operand and as the result). Kernels write through ``output_ptrs`` and
read ``prealloc_ptrs`` only for ``init="zeros"`` outputs, which they may accumulate into.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import numpy as np

Dims = Mapping[str, int]
Params = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Operand:
    """An array operand. ``dims`` names each axis (``("T", "H")``): equal names must have equal
    sizes across operands. ``dtypes``: allowed kinds (``"float"``, ``"int"``, ``"bool"``) or
    names (``"int32"``); ``None`` allows any."""

    name: str
    dims: tuple[str, ...]
    dtypes: tuple[str, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Output:
    """An output written into a preallocated, alias-declared buffer. ``init`` is ``"empty"``
    when the kernel writes every element, ``"zeros"`` when it accumulates or leaves some
    untouched (e.g. padding rows)."""

    name: str
    shape: Callable[[Dims, Params], tuple[int, ...]]
    dtype: Callable[[Mapping[str, np.dtype], Params], Any]
    init: str = "empty"

    def __post_init__(self):
        if self.init not in ("empty", "zeros"):
            raise ValueError(f"Output {self.name!r}: init must be 'empty' or 'zeros', got {self.init!r}")


@dataclasses.dataclass(frozen=True)
class Config:
    """One tuning point: compile-time constants plus launch options."""

    constants: tuple[tuple[str, Any], ...] = ()
    num_warps: int = 4
    num_stages: int = 1

    @staticmethod
    def make(num_warps: int = 4, num_stages: int = 1, **constants: Any) -> "Config":
        return Config(tuple(sorted(constants.items())), num_warps, num_stages)

    @property
    def kw(self) -> dict[str, Any]:
        return dict(self.constants)

    def to_json(self) -> dict:
        return {"constants": dict(self.constants), "num_warps": self.num_warps, "num_stages": self.num_stages}

    @staticmethod
    def from_json(d: Mapping) -> "Config":
        return Config.make(d["num_warps"], d["num_stages"], **d["constants"])

    def __str__(self) -> str:
        c = ",".join(f"{k}={v}" for k, v in self.constants)
        return f"Config({c},warps={self.num_warps},stages={self.num_stages})"


Constraint = Callable[[Dims, Params, Config], "str | None"]


@dataclasses.dataclass(frozen=True)
class Partitioning:
    """How a kernel's axes may be split across devices (``core/sharding.py`` applies it).

    ``outputs``: each output's axis names (names shared with ``Operand.dims`` are the same
    axis). ``local``: axes along which output shard ``i`` depends only on operand shard
    ``i``; output shapes must then follow from operand dims (not static params).
    """

    outputs: tuple[tuple[str, ...], ...]
    local: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class KernelDecl:
    """Everything about one kernel, declared once.

    Attributes:
      name: unique kernel name (used in custom-call scopes, logs, caches).
      kernel: the ``@triton.jit`` function.
      operands: array operands, in kernel-argument order.
      outputs: outputs, in kernel-argument order.
      params: names of static (hashable, trace-time) parameters.
      scalars: ``(dims, params) -> {name: int}``: runtime scalar kernel arguments, in
        kernel-argument order. Values here must not change the compiled binary.
      constexprs: ``(dims, params, config) -> {name: value}``: compile-time constants
        (beyond the config's own), e.g. dtype-dependent flags.
      grid: ``(dims, params, config) -> tuple[int, ...]``.
      reference: ``(*operands, **params) -> tuple of outputs``: pure JAX.
      configs: the autotuning search space.
      default_config: ``(dims, params) -> Config`` used when nothing is tuned.
      constraints: each returns ``None`` when a config is valid for the shapes, or a
        reason string when it must be pruned.
      key_dims: dims whose value changes the best config (bucketed by ``key_bucket``);
        by default every dim of the operands, so a result tuned at one shape is never
        reused at another. Name fewer only for dims the best config does not depend on.
      key_params: static params that change the compiled code or grid shape.
      exact: outputs must match the reference bit-exactly (pure data movement).
      params_check: optional ``(dims, params) -> None`` raising ``ValueError``: checks of
        the static facts, run once per call when it is bound (``core/launch.py``).
      validate: optional ``(operands, dims, params) -> None`` raising ``ValueError``:
        checks of the operands' values (NumPy arrays), run by the public call when every
        operand is concrete, and on traced ones when the program runs under
        ``TE_JAX_PERM_CHECKS=1`` (``core/checks.py``).
      partitioning: optional :class:`Partitioning`: output axis names and the axes along
        which the kernel is shard-local under jit/SPMD; ``None`` replicates.
      example_inputs: optional ``(dims, params, dtypes, rng) -> tuple of np.ndarray``
        making valid operands (e.g. in-range indices) for autotuning trials; ``dtypes``
        maps operand names to ``np.dtype``, ``rng`` is a ``np.random.Generator``.
    """

    name: str
    kernel: Any
    operands: tuple[Operand, ...]
    outputs: tuple[Output, ...]
    reference: Callable[..., Sequence[Any]]
    grid: Callable[[Dims, Params, Config], tuple[int, ...]]
    default_config: Callable[[Dims, Params], Config]
    params: tuple[str, ...] = ()
    scalars: Callable[[Dims, Params], Mapping[str, int]] = lambda dims, params: {}
    constexprs: Callable[[Dims, Params, Config], Mapping[str, Any]] = lambda dims, params, config: {}
    configs: tuple[Config, ...] = ()
    constraints: tuple[Constraint, ...] = ()
    key_dims: tuple[str, ...] | None = None
    key_params: tuple[str, ...] = ()
    key_bucket: Callable[[str, int], int] = lambda dim_name, size: size
    exact: bool = True
    rtol: float = 1e-2
    atol: float = 1e-2
    params_check: Callable[[Dims, Params], None] | None = None
    validate: Callable[..., None] | None = None
    partitioning: Partitioning | None = None  # None: every axis replicated
    example_inputs: Callable[..., Sequence[Any]] | None = None

    def __post_init__(self):
        if self.key_dims is None:
            every = tuple(dict.fromkeys(d for op in self.operands for d in op.dims))
            object.__setattr__(self, "key_dims", every)

    def violated(self, dims: Dims, params: Params, config: Config) -> str | None:
        """First violated constraint's reason, or None if ``config`` is valid."""
        for c in self.constraints:
            why = c(dims, params, config)
            if why:
                return why
        return None
