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
        parts = [f"{k}={v}" for k, v in self.constants] + [f"warps={self.num_warps}", f"stages={self.num_stages}"]
        return f"Config({','.join(parts)})"


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
    """Everything about one kernel, declared once. Callables take the bound ``dims`` and the
    static ``params`` (and a ``config`` where it matters)."""

    name: str                                  # unique: custom-call scopes, logs, caches
    kernel: Any                                # the @triton.jit function
    operands: tuple[Operand, ...]              # in kernel-argument order, as are outputs
    outputs: tuple[Output, ...]
    # (*operands, **params) -> a tuple of arrays, one per output (even for one), pure JAX
    reference: Callable[..., Sequence[Any]]
    grid: Callable[[Dims, Params, Config], tuple[int, ...]]
    default_config: Callable[[Dims, Params], Config]   # used when nothing is tuned
    params: tuple[str, ...] = ()               # static (hashable, trace-time) parameters
    # Runtime scalar arguments in kernel order (ints: int32, or int64 past its range; floats:
    # float32); their values must not change the binary.
    scalars: Callable[[Dims, Params], Mapping[str, int | float]] = lambda dims, params: {}
    # Compile-time constants beyond the config's own (e.g. dtype-dependent flags).
    constexprs: Callable[[Dims, Params, Config], Mapping[str, Any]] = lambda dims, params, config: {}
    configs: tuple[Config, ...] = ()           # the autotuning search space
    constraints: tuple[Constraint, ...] = ()   # each: None when valid, else why to prune
    # Dims whose value changes the best config (bucketed by key_bucket); by default every
    # operand dim, so a result tuned at one shape is never reused at another.
    key_dims: tuple[str, ...] | None = None
    key_params: tuple[str, ...] = ()           # params that change the compiled code or grid
    key_bucket: Callable[[str, int], int] = lambda dim_name, size: size
    exact: bool = True                         # bit-exact against the reference (data movement)
    # Otherwise each float output element within atol + rtol * the reference's largest magnitude.
    rtol: float = 1e-2
    atol: float = 1e-2
    # Raises ValueError on bad static facts, once per bound call (core/launch.py).
    params_check: Callable[[Dims, Params], None] | None = None
    # (operands, dims, params) raising ValueError on bad values (operands: a tuple of NumPy
    # arrays in declaration order): run when all operands are concrete, on traced ones under TE_JAX_PERM_CHECKS=1 (core/checks.py).
    validate: Callable[..., None] | None = None
    partitioning: Partitioning | None = None   # None: every axis replicated
    # (dims, params, dtypes by operand name, np.random.Generator) -> valid operands (e.g.
    # in-range indices) for autotuning trials.
    example_inputs: Callable[..., Sequence[Any]] | None = None
    # False for a kernel Triton's interpreter cannot run (a Gluon kernel: warp partitions,
    # barriers, asynchronous copies): backend "interpret" refuses it by name.
    interpretable: bool = True

    def __post_init__(self):
        if self.partitioning is not None and len(self.partitioning.outputs) != len(self.outputs):
            raise ValueError(f"{self.name}: partitioning names {len(self.partitioning.outputs)} outputs, "
                             f"the kernel has {len(self.outputs)}")
        if self.key_dims is None:
            every = tuple(dict.fromkeys(d for op in self.operands for d in op.dims))
            object.__setattr__(self, "key_dims", every)

    def run_reference(self, operands: Sequence[Any], params: Params, expected: Sequence[Any] | None = None) -> list:
        """The reference's outputs for ``operands``, checked to be one array per declared
        output and, given ``expected`` (the outputs' avals), of their shapes and dtypes: a
        reference that breaks its declaration fails here, naming the kernel and the output."""
        outs = self.reference(*operands, **params)
        names = [o.name for o in self.outputs]
        if not isinstance(outs, (tuple, list)) or len(outs) != len(names):
            got = (f"{len(outs)} values" if isinstance(outs, (tuple, list))
                   else "a single array" if hasattr(outs, "shape") else f"a {type(outs).__name__}")
            raise TypeError(f"{self.name}: its reference returned {got}; expected a tuple of "
                            f"{len(names)} array(s), one per output {names}")
        for name, out, want in zip(names, outs, expected or ()):
            shape, dtype = tuple(np.shape(out)), np.dtype(out.dtype if hasattr(out, "dtype") else np.result_type(out))
            if shape != tuple(want.shape) or dtype != want.dtype:
                raise TypeError(f"{self.name}: its reference's output {name!r} is {dtype}{list(shape)}; "
                                f"the declaration makes it {np.dtype(want.dtype)}{list(want.shape)}")
        return list(outs)

    def violated(self, dims: Dims, params: Params, config: Config) -> str | None:
        """First violated constraint's reason, or None if ``config`` is valid."""
        return next((why for c in self.constraints if (why := c(dims, params, config))), None)
