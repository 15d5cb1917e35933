"""Will the expert-parallel layer fit? A per-device working-set estimate, checked before compiling.

Running out of device memory in one rank of a collective program does not fail cleanly:
the other ranks wait in the collective forever. So the estimate is made, and compared with
the device's memory, before anything is compiled.

The estimate counts the buffers one training step (forward and backward) of
:func:`te_jax_perm.parallel.ep_moe_layer` holds on one device: its tokens and routing,
the dispatch buffer, the exchange buffers at their static capacity, the grouped rows and
the FFN activations (float32 where the layer computes in float32), the expert weights and
their gradients, and one transposed copy of the larger weight (the grouped GEMM's
backward reads the weights transposed). Saved forward activations and their gradients
are both live at the peak of the backward, so activations count twice.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from te_jax_perm.ops.moe_ffn.reference import ACTIVATIONS
from te_jax_perm.parallel.ep_moe import EPConfig

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class WorkingSet:
    """Bytes per device, by what holds them."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.parts.items()) + f" (GiB); total {self.total / GIB:.2f} GiB"


def ep_working_set(*, tokens: int, hidden: int, ffn: int, experts: int, ep: int,
                   capacity: int | None = None, num_out_tokens: int | None = None, dtype: Any = "bfloat16",
                   a2a: str = "dense", gated: bool = ACTIVATIONS[EPConfig.activation][1],
                   fsdp: int = 1) -> WorkingSet:
    """Per-device bytes of one fwd+bwd step of ``ep_moe_layer`` (``tokens`` per device).

    ``capacity`` and ``num_out_tokens`` as in :class:`te_jax_perm.parallel.EPConfig`
    (``None``: their defaults, ``T * E`` kept rows and the worst-case capacity); ``gated``:
    a gated activation, whose first weight and GEMM output are twice as wide (``2F``), by
    default as ``EPConfig.activation``'s default is (SwiGLU);
    ``fsdp``: the pieces ``EPConfig.fsdp_axes`` split each weight into (the step holds a
    piece, the gathered weights and their whole gradients before the reduce-scatter).

    It counts the arrays the step keeps with our grouped GEMM kernels (``EPConfig.gemm``
    ``"triton"`` or ``"interpret"``, or left to a GPU's default); XLA's ragged dot
    (``gemm="xla"``) densifies each GEMM over all local experts and can take several times
    more (5.6x this estimate at 64 experts, top-8, ep = 4, on CPU devices).
    """
    b = np.dtype(dtype).itemsize
    el = experts // ep
    n, cap = EPConfig(num_out_tokens=num_out_tokens, capacity=capacity).sizes(tokens, experts, el)
    recv = ep * cap                                               # rows after the exchange
    w = 2 if gated else 1                                         # w_in's columns per F
    act = {
        "tokens and routing": tokens * hidden * b * 2 + tokens * experts * (1 + 4 + 4),   # x, out; map, probs, weights
        "dispatch rows": n * hidden * b * 2,                      # rows out, rows home
        "exchange buffers": recv * hidden * b * (3 if a2a == "dense" else 2),   # (send), receive, returned
        # sorted, back; first GEMM's float32 output ([rows, 2F] gated), float32 activation and its cast
        "grouped rows and FFN": recv * (hidden * b * 2 + ffn * (4 * w + 4 + b) + hidden * 4),
    }
    w_in, w_out = el * hidden * ffn * w * b, el * ffn * hidden * b
    parts = {k: 2 * v for k, v in act.items()}                     # saved for the backward + their gradients
    parts["expert weights"] = (w_in + w_out) // fsdp
    if fsdp > 1:
        parts["gathered weights"] = w_in + w_out
    parts["weight gradients"] = w_in + w_out + ((w_in + w_out) // fsdp if fsdp > 1 else 0)
    parts["transposed weight copy"] = max(w_in, w_out)
    return WorkingSet(parts)


def device_memory_limit(device: jax.Device) -> int | None:
    """Bytes the runtime lets this device allocate, or ``None`` where it does not say (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - some platforms raise instead of returning None
        return None
    return int(stats["bytes_limit"]) if stats and "bytes_limit" in stats else None


def fits(working_set: WorkingSet, limit: int | None, headroom: float = 0.9) -> tuple[bool, str]:
    """``(ok, message)``: does the working set fit in ``headroom`` of ``limit`` bytes?"""
    if limit is None:
        return True, f"working set {working_set.describe()}; device memory unknown here, not checked"
    ok = working_set.total <= headroom * limit
    msg = (f"estimated working set per device {working_set.total / GIB:.1f} GiB "
           f"{'fits in' if ok else 'does NOT fit in'} {headroom:.0%} of the device's {limit / GIB:.1f} GiB "
           f"[{working_set.describe()}]")
    return ok, msg
