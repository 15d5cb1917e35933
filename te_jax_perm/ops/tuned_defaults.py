"""Shipped default configs measured on sm_90 GPUs: per device kind, the fastest config of each
row-moving kernel (the permutation's movers, the chunk sort's) at each row width and row count
it was swept at. A declaration reads them through :func:`tabled`, with no opt-in; shapes the
table lacks get the declaration's rule.

The table is data, written by ``python3 -m benchmarks.config_sweep --table`` from the sweeps
listed in ``benchmarks/results/mover_table_sweeps.txt``; nothing here measures anything.
"""
from __future__ import annotations

import functools
import json
import math
import os
from typing import Callable, Sequence

from te_jax_perm.core import Config
from te_jax_perm.core.backends import device_kind

# device kind -> kernel name -> row width H -> row count -> config (JSON).
DEFAULTS_TABLE = os.path.join(os.path.dirname(__file__), "tuned_defaults_sm90.json")

# An entry serves row counts within ROWS_WINDOW of the count it was measured at, and beyond
# 2x of that count only where its launch still holds MIN_WARPS warps of work (programs that
# own rows, times warps per program: about eight per multiprocessor of an H100 or H200).
# With fewer, a tile chosen to fill the GPU at the entry's row count leaves most of it idle,
# and the rule's small-count slicing does better. Measured against the rule at 16 to 2048
# tokens (entries from 4096-16384): gathers on one warp group per token row, faster under
# the rule at 16 tokens (all eleven, 0.66-0.97x on an H100), slower at 256 (1024 warps;
# seven of eleven); the dispatch forward's four-token one-warp entries 1.19-1.64x slower
# than the rule at 256-512 tokens (at most 576 warps), 0.94-0.97x at 2048 on all but the
# widest rows. Summed over each measured set, this choice took less time than either the
# entries or the rule alone.
ROWS_WINDOW = 32
MIN_WARPS = 1024


@functools.lru_cache(maxsize=None)
def shipped_tables() -> dict:
    """Every shipped table: device kind -> kernel -> H -> row count -> config."""
    try:
        with open(DEFAULTS_TABLE) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


@functools.lru_cache(maxsize=8)
def merged_table(kind: str) -> dict:
    """The defaults table of device ``kind``: kernel -> H -> row count -> config."""
    tables = shipped_tables()
    if not tables:
        return {}
    # The first device's table (its sweeps came first) under this device's own entries:
    # a device measured at a few shapes keeps the first device's configs elsewhere.
    merged = {k: {h: dict(by_n) for h, by_n in v.items()} for k, v in next(iter(tables.values())).items()}
    for kernel, by_h in tables.get(kind, {}).items():
        for h, by_n in by_h.items():
            merged.setdefault(kernel, {}).setdefault(h, {}).update(by_n)
    return merged


def device_table() -> dict:
    """The defaults table for the device this process computes on: the first shipped
    device's entries, overridden by this device's own where it was measured (another sm_90
    part without a table, or the CPU backends, get the first device's as they are)."""
    return merged_table(device_kind())


def tabled(name: str, rule: Callable[[dict, dict], Config], rows_dim: str,
           constraints: Sequence[Callable[[dict, dict, Config], str | None]],
           programs: Callable[[dict, Config], int]) -> Callable[[dict, dict], Config]:
    """A ``default_config`` for a declaration whose kernel is swept as ``name``: the table's
    config at this exact row width ``dims["H"]``, measured at the row count (``dims[rows_dim]``,
    the declaration's first key dim) nearest this one in log2 and within ``ROWS_WINDOW``
    of it, when it meets every one of the declaration's ``constraints`` here (e.g. not more
    rows per program than there are rows) and, unless it was measured within 2x of this row
    count, its ``programs`` (those that own rows, at these dims) times its warps reach
    ``MIN_WARPS``; else ``rule``."""
    def default(dims, params) -> Config:
        by_n = device_table().get(name, {}).get(str(dims["H"]), {})
        ln = math.log2(max(dims[rows_dim], 1))
        # Each entry's distance from this row count in log2, within the window.
        dist = {n: d for n in by_n if (d := abs(math.log2(int(n)) - ln)) <= math.log2(ROWS_WINDOW)}
        if dist:
            n_best = min(dist, key=lambda n: (dist[n], -int(n)))
            cfg = Config.from_json(by_n[n_best])
            # Within 2x of where it was measured an entry stands as measured; further off it
            # must still fill the GPU.
            if (all(c(dims, params, cfg) is None for c in constraints)
                    and (dist[n_best] <= 1 or programs(dims, cfg) * cfg.num_warps >= MIN_WARPS)):
                return cfg
        return rule(dims, params)
    default.rows_dim = rows_dim  # what the sweeps record as a kernel's row count
    return default
