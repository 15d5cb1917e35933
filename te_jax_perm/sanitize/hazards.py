"""Hazard records and the report that collects them: structured objects with readable text."""
from __future__ import annotations

import dataclasses

Pid = tuple[int, int, int]

# Hazard kinds, as reports name them.
OOB = "out_of_bounds"
WRITE_WRITE = "write_write"
READ_WRITE = "read_write"
IN_PLACE = "in_place"
INPUT_WRITE = "input_write"
UNWRITTEN = "unwritten"
KINDS = (OOB, WRITE_WRITE, READ_WRITE, IN_PLACE, INPUT_WRITE, UNWRITTEN)


@dataclasses.dataclass(frozen=True)
class Hazard:
    """One hazard found in one launch."""

    kind: str                   # one of KINDS
    kernel: str                 # the declared kernel name
    buffer: str                 # operand/output the access belongs to (in_place: the output)
    programs: tuple[Pid, ...]   # (pid,) for out_of_bounds/input_write; (reader or first writer, writer); () for unwritten
    access: str                 # "load", "store" or "atomic"
    elements: tuple[int, int]   # half-open range of the offending elements, in buffer's own dtype
    count: int                  # number of offending elements
    buffer_elements: int
    input: str | None = None    # in_place: the input hypothetically sharing buffer's memory

    def text(self) -> str:
        lo, hi = self.elements
        span = f"{self.count} element(s) in element offsets [{lo}, {hi})"
        k = f"kernel {self.kernel!r}"
        if self.kind == OOB:
            return (f"{k}: out-of-bounds {self.access} by program {self.programs[0]} on {self.buffer!r} "
                    f"({self.buffer_elements} elements): {span}")
        if self.kind == INPUT_WRITE:
            return f"{k}: program {self.programs[0]} stores into input {self.buffer!r}: {span}"
        if self.kind == UNWRITTEN:
            return (f"{k}: no program stores {span} of output {self.buffer!r} ({self.buffer_elements} elements), "
                    "which does not start as zeros: they are returned as allocated")
        a, b = self.programs
        if self.kind == WRITE_WRITE:
            return f"{k}: programs {a} and {b} both store to {self.buffer!r}: {span}"
        if self.kind == READ_WRITE:
            return f"{k}: program {a} loads {self.buffer!r} where program {b} stores: {span}"
        return (f"{k} is not in-place safe for (input {self.input!r}, output {self.buffer!r}): program {a} "
                f"loads {self.input!r} where program {b} stores {self.buffer!r}: {span}")


@dataclasses.dataclass
class LaunchSummary:
    """What one observed launch touched, and its in-place verdicts."""

    kernel: str
    grid: Pid
    bytes_loaded: dict[str, int]
    bytes_stored: dict[str, int]
    bytes_atomic: dict[str, int]
    in_place_checked: tuple[tuple[str, str], ...]
    in_place_unsafe: tuple[tuple[str, str], ...]
    hazards: int
    truncated: int = 0  # hazards found but not recorded (per-class cap)


class HazardError(RuntimeError):
    """Raised by the sanitizer in raise-on-first mode."""

    def __init__(self, hazard: Hazard):
        super().__init__(hazard.text())
        self.hazard = hazard


@dataclasses.dataclass
class Report:
    """Every hazard and launch the sanitizer saw; truthy when ``hazards`` (bugs of the
    launches as they ran) has any. ``in_place`` holds :data:`IN_PLACE` verdicts, hazards that
    *would* occur if an input shared memory with an output of its shape and dtype: not bugs,
    as XLA never aliases an input to a declared preallocated output, but a caller wanting
    in-place use must heed them."""

    hazards: list[Hazard] = dataclasses.field(default_factory=list)
    in_place: list[Hazard] = dataclasses.field(default_factory=list)
    launches: list[LaunchSummary] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.hazards)

    def of_kind(self, kind: str) -> list[Hazard]:
        return [h for h in self.hazards + self.in_place if h.kind == kind]

    def kernels(self) -> list[str]:
        return sorted({s.kernel for s in self.launches})

    def in_place_unsafe(self, kernel: str | None = None) -> set[tuple[str, str]]:
        """``(input, output)`` pairs some launch showed are unsafe to share memory."""
        return {p for s in self.launches if kernel in (None, s.kernel) for p in s.in_place_unsafe}

    def text(self, limit: int = 20) -> str:
        if not self.hazards:
            lines = [f"sanitizer: no hazards in {len(self.launches)} launch(es) of {self.kernels()}"]
        else:
            lines = [f"sanitizer: {len(self.hazards)} hazard(s) in {len(self.launches)} launch(es):"]
            lines += ["  " + h.text() for h in self.hazards[:limit]]
            if len(self.hazards) > limit:
                lines.append(f"  ... and {len(self.hazards) - limit} more")
        for kernel in self.kernels():
            for i, o in sorted(self.in_place_unsafe(kernel)):
                lines.append(f"  note: kernel {kernel!r} is not in-place safe for (input {i!r}, output {o!r})")
        if truncated := sum(s.truncated for s in self.launches):
            lines.append(f"  ({truncated} further hazard(s) not recorded: per-launch cap)")
        return "\n".join(lines)

    __str__ = text
