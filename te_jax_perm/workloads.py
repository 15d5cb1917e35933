"""The ops at real MoE model sizes: the published models' layer dimensions (the one table the
autotuner and the benchmarks take them from), the shapes tuned in priority order by
``python -m te_jax_perm.autotune --tune_shapes``, the one generator of random routing
problems (maps, probs, tokens, EP chunk layouts) that the autotuner, the benchmarks and the
tests draw from, and the dispatch+combine step that launches the ops' main kernels."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class MoEModel:
    """A published MoE model's expert layer: tokens of hidden size ``H``, each routed to
    ``k`` of ``E`` experts whose FFNs are ``F`` wide."""

    name: str                 # as the benchmarks label its shapes ("DeepSeek-V3")
    H: int
    E: int
    k: int
    F: int | None = None      # where a benchmark runs the model's expert FFN (the permutation needs no F)
    key: str | None = None    # the autotuner's name (its --shapes terms match it), where it tunes the model


MIXTRAL_8X7B = MoEModel("Mixtral-8x7B", H=4096, E=8, k=2, F=14336, key="mixtral-8x7b")
QWEN3_235B = MoEModel("Qwen3-235B-A22B", H=4096, E=128, k=8, F=1536, key="qwen3-235b")
DEEPSEEK_V3 = MoEModel("DeepSeek-V3", H=7168, E=256, k=8, F=2048, key="deepseek-v3")
GPT_OSS_120B = MoEModel("gpt-oss-120b", H=2880, E=128, k=4, key="gpt-oss-120b")
QWEN3_30B = MoEModel("Qwen3-30B-A3B", H=2048, E=128, k=8)
DBRX = MoEModel("DBRX", H=6144, E=16, k=4)
QWEN2_57B = MoEModel("Qwen2-57B-A14B", H=3584, E=64, k=8)
LLAMA_4_SCOUT = MoEModel("Llama-4-Scout", H=5120, E=16, k=1)
# Every model whose layers the autotuner or the benchmarks run.
MODELS: tuple[MoEModel, ...] = (MIXTRAL_8X7B, QWEN3_235B, DEEPSEEK_V3, GPT_OSS_120B, QWEN3_30B, DBRX, QWEN2_57B,
                                LLAMA_4_SCOUT)

# The autotuner's shapes (model key, hidden, experts, top-k, tokens), most important first:
# a run cut short by its budget has tuned these.
MOE_SHAPES = tuple((m.key, m.H, m.E, m.k, tokens) for m, tokens in (
    (DEEPSEEK_V3, 8192), (QWEN3_235B, 8192), (GPT_OSS_120B, 8192), (MIXTRAL_8X7B, 8192), (DEEPSEEK_V3, 4096),
    (MIXTRAL_8X7B, 16384)))
SMALL_SHAPES = (("small", 96, 8, 2, 64),)


def shape_list(small: bool = False, shapes: str | None = None) -> list[tuple[str, int, int, int, int]]:
    """``(model, H, E, k, T)`` in priority order; ``shapes`` keeps those whose ``model:T``
    contains any of its comma-separated terms (``"deepseek-v3:8192,qwen3"``)."""
    rows = list(SMALL_SHAPES if small else MOE_SHAPES)
    if shapes:
        terms = [t.strip() for t in shapes.split(",") if t.strip()]
        every = rows
        rows = [r for r in rows if any(t in f"{r[0]}:{r[4]}" for t in terms)]
        if not rows:   # a typo must not pass for a run that tuned everything asked for
            raise ValueError(f"shapes={shapes!r} matches none of the {'small ' if small else ''}shapes; expected "
                             f"terms found in model:T, e.g. of {sorted({f'{m}:{T}' for m, _, _, _, T in every})}")
    return rows


def top_k_map(logits: np.ndarray, k: int) -> np.ndarray:
    """bool ``[..., T, E]``: each token routed to the ``k`` experts of highest logit."""
    top = np.argpartition(-logits, k - 1, axis=-1)[..., :k]
    m = np.zeros(logits.shape, bool)
    np.put_along_axis(m, top, True, axis=-1)
    return m


def topk_routing(rng: np.random.Generator, T: int, E: int, k: int,
                 skew: str = "uniform") -> tuple[np.ndarray, np.ndarray]:
    """A routing map (bool ``[T, E]``, each token to the ``k`` distinct experts of highest
    random logit) and its probs (fp32 ``[T, E]``, the softmax over the routed experts, 0
    elsewhere). ``skew="hot"`` biases the logits so that expert 0 takes about half of all
    tokens; ``skew="empty"`` routes nothing to the experts from ``max(k, E // 2)`` on (the
    upper half, or all past the first ``k`` that each token needs); ``skew="all_one"`` routes
    every token to expert 0."""
    if not 1 <= k <= E:
        raise ValueError(f"k={k} must be in [1, E={E}]")
    logits = rng.standard_normal((T, E)).astype(np.float32)
    if skew == "hot":
        logits[rng.random(T) < 0.5, 0] += 100.0
    elif skew == "empty":
        logits[:, max(k, E // 2):] -= 100.0
    elif skew == "all_one":
        logits[:, 0] += 100.0
    elif skew != "uniform":
        raise ValueError(f"unknown skew {skew!r}; expected uniform, hot, empty or all_one")
    routing_map = top_k_map(logits, k)
    # Less the row's max before exp: a "hot" logit of 100 overflows float32's exp.
    sel = np.where(routing_map, logits, -np.inf)
    sel = np.exp(sel - sel.max(axis=1, keepdims=True))
    return routing_map, (sel / sel.sum(axis=1, keepdims=True)).astype(np.float32)


def tokens(rng: np.random.Generator, T: int, H: int, dtype: Any) -> np.ndarray:
    """``[T, H]`` standard normal values, distinct enough that a misplaced row shows in any dtype."""
    return rng.standard_normal((T, H)).astype(np.float32).astype(dtype)


def ep_chunks(rng: np.random.Generator, num_rows: int, ep: int, local_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk layout after an EP all-to-all: rows grouped by (source rank, local expert).

    Returns ``split_sizes`` (int32 [ep*local_experts], summing to ``num_rows``, some may be
    zero) and ``sorted_indices`` that reorder the chunks to (local expert, source rank).
    """
    chunks = ep * local_experts
    split_sizes = rng.multinomial(num_rows, np.full(chunks, 1.0 / chunks)).astype(np.int32)
    sorted_indices = np.array([r * local_experts + e for e in range(local_experts) for r in range(ep)], np.int32)
    return split_sizes, sorted_indices


def moe_problem(T: int, H: int, E: int, k: int, dtype: Any, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Tokens ``[T, H]``, a uniform :func:`topk_routing` map ``[T, E]`` and its probs, from ``seed``."""
    rng = np.random.default_rng(seed)
    routing_map, probs = topk_routing(rng, T, E, k)
    return tokens(rng, T, H, dtype), routing_map, probs


def moe_step(backend: str, k: int) -> Callable:
    """Dispatch then combine (forward), the ops' main kernels in one function."""
    import te_jax_perm

    def step(x, rmap, probs):
        out, pprobs, row_id_map, _, _ = te_jax_perm.token_dispatch(x, rmap, x.shape[0] * k, probs=probs,
                                                                    backend=backend)
        return te_jax_perm.token_combine(out, row_id_map, probs, backend=backend)
    return step


def moe_train_step(backend: str, k: int) -> Callable:
    """:func:`moe_step`'s gradients in the tokens and the probabilities: the kernels a
    training step runs (the combine forward that records row owners, both backwards)."""
    import jax

    step = moe_step(backend, k)
    return jax.grad(lambda x, rmap, probs: step(x, rmap, probs).astype("float32").sum(), argnums=(0, 2))
