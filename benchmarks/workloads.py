"""Random routing problems: top-k routing maps, probabilities, and EP chunk layouts.

Host-side NumPy so that generating a problem never compiles anything on the device.
"""
from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Routing:
    routing_map: np.ndarray    # bool [T, E], exactly k True per row
    probs: np.ndarray          # float32 [T, E], softmax over the routed experts, 0 elsewhere
    tokens_per_expert: np.ndarray  # int32 [E]


def topk_routing(rng: np.random.Generator, T: int, E: int, k: int, skew: str = "uniform") -> Routing:
    """Each token picks ``k`` distinct experts by top-k of random logits.

    ``skew="hot"`` biases logits so expert 0 takes about half of all tokens;
    ``skew="empty"`` never routes to the upper half of the experts (when ``k`` allows).
    """
    if not 1 <= k <= E:
        raise ValueError(f"k={k} must be in [1, E={E}]")
    logits = rng.standard_normal((T, E)).astype(np.float32)
    if skew == "hot":
        logits[rng.random(T) < 0.5, 0] += 100.0
    elif skew == "empty":
        if 2 * k <= E:  # otherwise every expert is needed to give each token k distinct ones
            logits[:, E // 2:] -= 100.0
    elif skew != "uniform":
        raise ValueError(f"unknown skew {skew!r}")
    top = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    routing_map = np.zeros((T, E), bool)
    np.put_along_axis(routing_map, top, True, axis=1)
    sel = np.where(routing_map, logits, -np.inf)
    sel = np.exp(sel - sel.max(axis=1, keepdims=True))
    probs = (sel / sel.sum(axis=1, keepdims=True)).astype(np.float32)
    return Routing(routing_map, probs, routing_map.sum(axis=0).astype(np.int32))


def ep_chunks(rng: np.random.Generator, num_rows: int, ep: int, local_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Chunk layout after an EP all-to-all: rows grouped by (source rank, local expert).

    Returns ``split_sizes`` (int32 [ep*local_experts], summing to ``num_rows``, some may be
    zero) and ``sorted_indices`` that reorder the chunks to (local expert, source rank).
    """
    chunks = ep * local_experts
    split_sizes = rng.multinomial(num_rows, np.full(chunks, 1.0 / chunks)).astype(np.int32)
    sorted_indices = np.array([r * local_experts + e for e in range(local_experts) for r in range(ep)], np.int32)
    return split_sizes, sorted_indices


def tokens(rng: np.random.Generator, T: int, H: int, dtype) -> np.ndarray:
    """Distinct-ish finite values so that a misplaced row is visible in any dtype."""
    x = rng.standard_normal((T, H)).astype(np.float32)
    return x.astype(dtype)
