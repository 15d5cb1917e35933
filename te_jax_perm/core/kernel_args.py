"""The one place that orders a kernel's arguments, by the calling convention::

    kernel(*operand_ptrs, *scalar_args, *prealloc_ptrs, *output_ptrs, **constexprs)

The backends and the tuner pass whatever stands for a buffer (a host pointer, a device
array, an XLA operand, an aval) to :func:`kernel_arguments` and never build the list.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from te_jax_perm.core.declaration import KernelDecl

if TYPE_CHECKING:  # pragma: no cover
    from te_jax_perm.core.launch import Launch

OPERAND, SCALAR, PREALLOC, OUTPUT = "operand", "scalar", "prealloc", "output"


@dataclasses.dataclass(frozen=True)
class KernelArg:
    name: str      # the kernel's parameter name
    role: str      # OPERAND, SCALAR, PREALLOC or OUTPUT
    source: str    # the declared operand/output (preallocs: "<output>.prealloc") or scalar name
    value: Any

    @property
    def is_pointer(self) -> bool:
        return self.role != SCALAR


def kernel_arguments(launch: "Launch", operands: Sequence[Any], preallocs: Sequence[Any],
                     outputs: Sequence[Any]) -> tuple[KernelArg, ...]:
    """Every runtime argument of ``launch``'s kernel, in its parameter order: one value per
    declared operand / output in each of ``operands``, ``preallocs``, ``outputs``."""
    decl = launch.decl
    if len(operands) != len(decl.operands) or len(preallocs) != len(decl.outputs) \
            or len(outputs) != len(decl.outputs):
        raise TypeError(f"{decl.name}: {len(operands)} operands, {len(preallocs)} preallocs, {len(outputs)} "
                        f"outputs given; the declaration has {len(decl.operands)} operands and "
                        f"{len(decl.outputs)} outputs")
    slots = ([(OPERAND, op.name, v) for op, v in zip(decl.operands, operands)]
             + [(SCALAR, name, v) for name, v in launch.scalars.items()]
             + [(PREALLOC, o.name + ".prealloc", v) for o, v in zip(decl.outputs, preallocs)]
             + [(OUTPUT, o.name, v) for o, v in zip(decl.outputs, outputs)])
    return tuple(KernelArg(n, role, source, v) for n, (role, source, v) in zip(decl.kernel.arg_names, slots))


def check_signature(decl: KernelDecl, scalars: Mapping[str, Any], constexprs: Mapping[str, Any]
                    ) -> dict[str, Any]:
    """``constexprs`` in the kernel's parameter order; raises unless the kernel follows the
    calling convention by name, not just count: arguments are passed by position, so a
    scalar moved to a constexpr would shift every later argument (a pointer landing in a
    size slot) while the count still matched."""
    names = list(decl.kernel.arg_names)
    n_ops, n_outs = len(decl.operands), len(decl.outputs)
    positional = n_ops + len(scalars) + 2 * n_outs
    if (names[n_ops:n_ops + len(scalars)] != list(scalars) or len(names) != positional + len(constexprs)
            or set(names[positional:]) != set(constexprs)):
        order = ", ".join(n for n, _ in _slots(decl, list(scalars)))
        raise TypeError(
            f"{decl.name}: kernel {decl.kernel.fn.__name__}{tuple(names)} does not match its declaration: "
            f"{n_ops} operand pointers, scalars {list(scalars)}, {n_outs} prealloc + {n_outs} output "
            f"pointers, constexprs {sorted(constexprs)}; expected the parameters ({order}"
            + "".join(f", {c}" for c in sorted(constexprs)) + ") (constexprs in any order; pointers may "
            "be named otherwise)")
    _check_pointer_names(decl, names, list(scalars))
    return {name: constexprs[name] for name in names[positional:]}


def _slots(decl: KernelDecl, scalars: list[str]) -> list[tuple[str, str]]:
    """The calling convention's positional parameters, ``(conventional name, role)`` each:
    operand pointers, scalars, every preallocated output pointer, every output pointer."""
    return ([(f"{op.name}_ptr", f"operand {op.name!r}") for op in decl.operands]
            + [(s, f"scalar {s!r}") for s in scalars]
            + [(f"{o.name}_prealloc_ptr", f"output {o.name!r}'s preallocated buffer") for o in decl.outputs]
            + [(f"{o.name}_ptr", f"output {o.name!r}") for o in decl.outputs])


def _check_pointer_names(decl: KernelDecl, names: list[str], scalars: list[str]) -> None:
    """A pointer parameter named after a declared buffer by the convention (``<operand>_ptr``,
    ``<output>_prealloc_ptr``, ``<output>_ptr``) must sit in that buffer's slot: a kernel
    listing ``a_prealloc_ptr, a_ptr, b_prealloc_ptr, b_ptr`` has the right count, but would
    receive ``a``'s output where it writes ``b``'s preallocated buffer (the convention puts
    every preallocated pointer first). Parameters named otherwise are not checked."""
    slots = _slots(decl, scalars)
    what = {name: role for name, role in slots}
    for i, (have, (want, role)) in enumerate(zip(names, slots)):
        if have != want and have in what:
            order = ", ".join(n for n, _ in slots)
            raise TypeError(
                f"{decl.name}: kernel {decl.kernel.fn.__name__} has parameter {i} {have!r}, the name of "
                f"{what[have]}, where the calling convention passes {role}; expected the parameters in the "
                f"order ({order}): operands, scalars, every preallocated output, every output")


# -- Triton types of the arguments ------------------------------------------------------------
# np.dtype name -> Triton element type.
_TRITON_TYPE = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
}


def triton_type(dtype: Any) -> str:
    name = np.dtype(dtype).name
    if name not in _TRITON_TYPE:
        raise TypeError(f"no Triton pointer type for dtype {name}")
    return _TRITON_TYPE[name]


def scalar_type(value: Any) -> str:
    """The Triton type a runtime scalar is passed as (as Triton's own launcher types it)."""
    if isinstance(value, (bool, np.bool_)):
        return "i1"
    if isinstance(value, (int, np.integer)):
        return "i32" if -2**31 <= int(value) < 2**31 else "i64"
    return "fp32"


def signature(launch: "Launch") -> dict[str, str]:
    """Kernel parameter name -> Triton type (``*bf16``, ``i32``, ``constexpr``) for compiling."""
    args = kernel_arguments(launch, launch.avals, launch.out_avals, launch.out_avals)
    sig = {a.name: ("*" + triton_type(a.value.dtype)) if a.is_pointer else scalar_type(a.value) for a in args}
    # Constexprs follow the runtime arguments, in the kernel's order (check_signature).
    return {**sig, **{name: "constexpr" for name in launch.constexprs}}
