"""Benchmark shapes: real MoE layer shapes for the GPU, and a tiny CPU smoke sweep."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """One MoE layer's permutation problem: ``T`` tokens of hidden size ``H``, top-``k`` of ``E``."""

    model: str
    T: int
    H: int
    E: int
    k: int
    ep: int = 8            # expert-parallel ranks, for the chunk-sort problem (E//ep local experts)
    dtype: str = "bfloat16"

    @property
    def name(self) -> str:
        return f"{self.model}/T{self.T}/H{self.H}/E{self.E}/k{self.k}"

    @property
    def num_out(self) -> int:
        return self.T * self.k


# DeepSeek-V3, Qwen3, gpt-oss and Mixtral layers. DeepSeek-V3 at T=16384 is there for the row-id-map target
# ("make_row_id_map for T=16384, E=256: <= 10% of the dispatch time at H=7168").
GPU_SHAPES: tuple[MoEShape, ...] = (
    MoEShape("Mixtral-8x7B", 8192, 4096, 8, 2),
    MoEShape("Mixtral-8x7B", 16384, 4096, 8, 2),
    MoEShape("Qwen3-235B-A22B", 8192, 4096, 128, 8),
    MoEShape("DeepSeek-V3", 4096, 7168, 256, 8),
    MoEShape("DeepSeek-V3", 8192, 7168, 256, 8),
    MoEShape("DeepSeek-V3", 16384, 7168, 256, 8),
    MoEShape("gpt-oss-120b", 8192, 2880, 128, 4),
)

# Real MoE layers outside the shapes the defaults were first tuned on: a default rule has to
# hold here too (H=2048/3584/5120/6144, E=16/64, k=1/4).
OFF_LIST_SHAPES: tuple[MoEShape, ...] = (
    MoEShape("Qwen3-30B-A3B", 8192, 2048, 128, 8),
    MoEShape("DBRX", 8192, 6144, 16, 4),
    MoEShape("Qwen2-57B-A14B", 8192, 3584, 64, 8),
    MoEShape("Llama-4-Scout", 8192, 5120, 16, 1),
)

# CPU smoke: small enough for the Triton interpreter (T<=64, H<=96), odd sizes included.
CPU_SHAPES: tuple[MoEShape, ...] = (
    MoEShape("small", 16, 64, 4, 2, ep=2, dtype="float32"),
    MoEShape("small", 33, 96, 8, 2, ep=2, dtype="bfloat16"),
)


def by_substrings(spec: str, items: tuple, flag: str) -> tuple:
    """Items whose ``.name`` contains any comma-separated substring of ``spec`` (all if empty)."""
    if not spec:
        return items
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    picked = tuple(i for i in items if any(w in i.name for w in wanted))
    if not picked:
        raise ValueError(f"{flag} {spec!r} matches none of {[i.name for i in items]}")
    return picked


def by_name(names: str, table: tuple[MoEShape, ...]) -> tuple[MoEShape, ...]:
    """Filters ``table`` by comma-separated substrings of shape names (empty keeps all)."""
    return by_substrings(names, table, "--shapes")
