"""Benchmark shapes: real MoE layer shapes for the GPU, and a tiny CPU smoke sweep."""
from __future__ import annotations

import dataclasses

from te_jax_perm.workloads import (DBRX, DEEPSEEK_V3, GPT_OSS_120B, LLAMA_4_SCOUT, MIXTRAL_8X7B, QWEN2_57B, QWEN3_30B,
                                   QWEN3_235B, MoEModel)


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


def _layers(model: MoEModel, *tokens: int) -> tuple[MoEShape, ...]:
    return tuple(MoEShape(model.name, T, model.H, model.E, model.k) for T in tokens)


# DeepSeek-V3, Qwen3, gpt-oss and Mixtral layers, most informative first (the benchmarks run
# them in this order). DeepSeek-V3 at T=16384 is the largest row-id map (T*E).
GPU_SHAPES: tuple[MoEShape, ...] = (*_layers(DEEPSEEK_V3, 8192), *_layers(QWEN3_235B, 8192),
                                    *_layers(DEEPSEEK_V3, 16384), *_layers(GPT_OSS_120B, 8192),
                                    *_layers(DEEPSEEK_V3, 4096), *_layers(MIXTRAL_8X7B, 8192, 16384))

# Real MoE layers outside the shapes the defaults were first tuned on: a default rule has to
# hold here too (H=2048/3584/5120/6144, E=16/64, k=1/4).
OFF_LIST_SHAPES: tuple[MoEShape, ...] = tuple(s for m in (QWEN3_30B, DBRX, QWEN2_57B, LLAMA_4_SCOUT)
                                              for s in _layers(m, 8192))

# CPU smoke: small enough for the Triton interpreter (T<=64, H<=96), odd sizes included.
CPU_SHAPES: tuple[MoEShape, ...] = (
    MoEShape("small", 16, 64, 4, 2, ep=2, dtype="float32"),
    MoEShape("small", 33, 96, 8, 2, ep=2, dtype="bfloat16"),
)


def by_name(spec: str, items: tuple) -> tuple:
    """The benchmarks' ``--shapes``: the items whose ``.name`` contains any comma-separated
    substring of ``spec`` (all if empty). A spec that matches nothing ends the run with the
    names it could have matched, not a traceback."""
    if not spec:
        return items
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    picked = tuple(i for i in items if any(w in i.name for w in wanted))
    if not picked:
        raise SystemExit(f"--shapes {spec!r} matches none of {[i.name for i in items]}")
    return picked
