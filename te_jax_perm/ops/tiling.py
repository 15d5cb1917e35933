"""Tile arithmetic shared by every op's kernel declarations: powers of two and register budgets.

Triton's ``tl.arange`` needs power-of-two extents, so block sizes are powers of two and
row widths, chunk and expert counts are rounded up to one; autotuning keys bucket sizes
the same way so that nearby sizes share one tuned entry.
"""
from __future__ import annotations

from typing import Callable

# Elements of one program's [rows, block] register tile: 16384 is 32 KB of bf16 (64 KB of
# fp32) per program, the most the row movers keep in flight without spilling.
MAX_TILE = 16384


def next_pow2(v: int) -> int:
    """Smallest power of two ``>= v`` (1 for ``v <= 1``)."""
    v = int(v)
    return 1 if v <= 1 else 1 << (v - 1).bit_length()


def lanes(n: int) -> int:
    """Lanes of a kernel axis over ``n`` experts, chunks or row columns: the power of two
    ``>= n``, at least 16 (Triton 3.6 fails to compile a scan over one lane, and size-1
    aranges lay out badly); lanes past ``n`` are masked."""
    return max(16, next_pow2(n))


def pow2_at_most(v: int) -> int:
    """Largest power of two ``<= max(v, 1)``."""
    return 1 << (max(int(v), 1).bit_length() - 1)


def pow2_bucket(*dims: str) -> Callable[[str, int], int]:
    """The autotuning ``key_bucket`` of every shipped kernel: ``dims`` (the row or chunk count,
    which changes with every batch) rounded up to a power of two so that nearby sizes share
    one tuned entry; any other key dim kept exact (a width or expert count compiled in)."""
    def bucket(name: str, v: int) -> int:
        return next_pow2(v) if name in dims else int(v)
    return bucket


def not_pow2(name: str, v: int) -> str | None:
    """``None`` when ``v`` is a positive power of two, else the reason it is not."""
    return None if v > 0 and v & (v - 1) == 0 else f"{name}={v} is not a power of two"


def tile_too_large(rows: int, block: int) -> str | None:
    """``None`` when a ``[rows, block]`` register tile fits in ``MAX_TILE`` elements, else why not."""
    return (f"a [{rows}, {block}] register tile ({rows * block} elements) exceeds {MAX_TILE}"
            if rows * block > MAX_TILE else None)
