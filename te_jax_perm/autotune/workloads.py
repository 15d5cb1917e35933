"""The real ops at real MoE model sizes, and the kernel calls they make (recorded by a call
observer, so the tuner and the benchmarks get each launch's exact bound call without
duplicating op logic)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from te_jax_perm.core import hooks
from te_jax_perm.core.launch import Call

# model, hidden, experts, top-k, tokens (published MoE configurations)
MOE_SHAPES = (
    ("mixtral-8x7b", 4096, 8, 2, (8192, 16384)),
    ("qwen3-235b", 4096, 128, 8, (8192,)),
    ("deepseek-v3", 7168, 256, 8, (4096, 8192)),
    ("gpt-oss-120b", 2880, 128, 4, (8192,)),
)
SMALL_SHAPES = (("small", 96, 8, 2, (64,)),)


def record_launches(fn: Callable, args: Sequence[Any]) -> list[Call]:
    """Each kernel call in ``jax.jit(fn)(*args)``, in order; the installed resolver still runs
    (lowering under autotuning also tunes)."""
    import jax
    seen: list[Call] = []
    with hooks.observe_calls(seen.append):
        jax.jit(fn).lower(*args)
    return seen


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
