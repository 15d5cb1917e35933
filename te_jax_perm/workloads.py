"""The ops at real MoE model sizes: the published shapes (tuned in priority order by
``python -m te_jax_perm.autotune --tune_shapes``), a routing problem of each, and the
dispatch+combine step that launches the ops' main kernels."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

# model, hidden, experts, top-k, tokens (published MoE configurations)
MOE_SHAPES = (
    ("mixtral-8x7b", 4096, 8, 2, (8192, 16384)),
    ("qwen3-235b", 4096, 128, 8, (8192,)),
    ("deepseek-v3", 7168, 256, 8, (4096, 8192)),
    ("gpt-oss-120b", 2880, 128, 4, (8192,)),
)
SMALL_SHAPES = (("small", 96, 8, 2, (64,)),)


# Real MoE sizes, most important first: a run cut short by its budget has tuned these.
PRIORITY = (("deepseek-v3", 8192), ("qwen3-235b", 8192), ("gpt-oss-120b", 8192), ("mixtral-8x7b", 8192),
            ("deepseek-v3", 4096), ("mixtral-8x7b", 16384))


def shape_list(small: bool = False, shapes: str | None = None) -> list[tuple[str, int, int, int, int]]:
    """``(model, H, E, k, T)`` in priority order; ``shapes`` keeps those whose ``model:T``
    contains any of its comma-separated terms (``"deepseek-v3:8192,qwen3"``)."""
    table = SMALL_SHAPES if small else MOE_SHAPES
    rows = [(m, H, E, k, T) for m, H, E, k, Ts in table for T in Ts]
    rank = {p: i for i, p in enumerate(PRIORITY)}
    rows.sort(key=lambda r: rank.get((r[0], r[4]), len(rank)))
    if shapes:
        terms = [t.strip() for t in shapes.split(",") if t.strip()]
        rows = [r for r in rows if any(t in f"{r[0]}:{r[4]}" for t in terms)]
    return rows


def moe_problem(T: int, H: int, E: int, k: int, dtype: Any, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Tokens ``[T, H]``, a top-k routing map ``[T, E]`` (bool) and probs ``[T, E]`` (fp32)."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((T, E)).astype(np.float32)
    top = np.argsort(-logits, axis=1)[:, :k]
    rmap = np.zeros((T, E), bool)
    np.put_along_axis(rmap, top, True, axis=1)
    probs = np.where(rmap, np.exp(logits), 0).astype(np.float32)
    probs /= probs.sum(1, keepdims=True)
    x = rng.standard_normal((T, H)).astype(np.float32).astype(dtype)
    return x, rmap, probs


def moe_step(backend: str, k: int) -> Callable:
    """Dispatch then combine (forward), the ops' main kernels in one function."""
    import te_jax_perm

    def step(x, rmap, probs):
        out, pprobs, row_id_map, _, _ = te_jax_perm.token_dispatch(x, rmap, x.shape[0] * k, probs=probs,
                                                                    backend=backend)
        return te_jax_perm.token_combine(out, row_id_map, probs, backend=backend)
    return step
