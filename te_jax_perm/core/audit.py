"""Alias audit: every custom call of ours in a lowered program, with its aliases checked.

A custom call is ours when its location carries the ``te_jax_perm.<kernel>`` name scope
every backend emits. A result is safe when declared aliased (``output_operand_aliases``)
to an operand of its shape and dtype, so XLA cannot give it another input's memory.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import jax
from jax.interpreters.mlir import ir

_SCOPE = re.compile(r"te_jax_perm\.([A-Za-z0-9_]+)")


@dataclasses.dataclass(frozen=True)
class CustomCallReport:
    kernel: str | None           # our kernel name, None for foreign custom calls
    target: str                  # custom-call target (e.g. triton_kernel_call)
    operand_types: tuple[str, ...]
    result_types: tuple[str, ...]
    aliases: dict[int, int]      # result index -> operand index
    unaliased_results: tuple[int, ...]

    @property
    def ours(self) -> bool:
        return self.kernel is not None

    @property
    def ok(self) -> bool:
        return not self.unaliased_results


@dataclasses.dataclass(frozen=True)
class AliasAudit:
    calls: tuple[CustomCallReport, ...]

    @property
    def ours(self) -> tuple[CustomCallReport, ...]:
        return tuple(c for c in self.calls if c.ours)

    @property
    def audited(self) -> bool:
        """Whether the program has any te_jax_perm custom call to audit (the ``xla``
        backend lowers to plain XLA ops, which have none)."""
        return bool(self.ours)

    @property
    def ok(self) -> bool:
        """Every te_jax_perm custom call is alias-declared; ``False`` when there was none
        to audit, so that checking nothing never passes."""
        return self.audited and all(c.ok for c in self.ours)

    def __str__(self) -> str:
        lines = [] if self.audited else [
            "nothing to audit: no te_jax_perm custom call in this program (the xla backend lowers to plain "
            "XLA ops; audit a function that uses backend 'triton' or 'interpret')"]
        for c in self.calls:
            status = "OK" if c.ok else f"UNALIASED results {list(c.unaliased_results)}"
            lines.append(f"{c.kernel or '(foreign)':32s} {c.target:36s} operands={len(c.operand_types)} "
                         f"results={len(c.result_types)} aliases={c.aliases} {status}")
        return "\n".join(lines)


def audit_aliases(fn: Callable, *args: Any, **kwargs: Any) -> AliasAudit:
    """Lowers ``fn(*args, **kwargs)`` (jitted or not) and reports every custom call with its
    aliasing; foreign ones are listed as ``(foreign)``, not judged."""
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    module = jitted.lower(*args, **kwargs).compiler_ir("stablehlo")
    calls: list[CustomCallReport] = []

    def visit(op) -> ir.WalkResult:   # every operation, nested ones included, in program order
        if op.operation.name == "stablehlo.custom_call":
            calls.append(_report(op.operation))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return AliasAudit(tuple(calls))


def _report(op) -> CustomCallReport:
    attrs = op.attributes
    target = str(attrs["call_target_name"]).strip('"')
    m = _SCOPE.search(str(op.location))
    operand_types = tuple(str(v.type) for v in op.operands)
    result_types = tuple(str(r.type) for r in op.results)
    aliases: dict[int, int] = {}
    if "output_operand_aliases" in attrs:
        for a in attrs["output_operand_aliases"]:
            text = str(a)
            out_idx = re.search(r"output_tuple_indices = \[([0-9]*)\]", text).group(1)
            opnd = int(re.search(r"operand_index = ([0-9]+)", text).group(1))
            aliases[int(out_idx) if out_idx else 0] = opnd
    unaliased = tuple(i for i in range(len(result_types))
                      if i not in aliases or operand_types[aliases[i]] != result_types[i])
    return CustomCallReport(m.group(1) if m else None, target, operand_types, result_types, aliases, unaliased)
