"""Routing formats for the ops' callers: plain JAX with no kernel, so a module, not an op package.

Top-k expert indices ``[T, k]`` and routing maps ``[T, E]``.

Routers usually produce top-k indices (``jax.lax.top_k``); the ops take a routing map, as
TransformerEngine's do. These convert between the two.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax_perm import _checks


def topk_to_routing_map(indices: jax.Array, num_experts: int) -> jax.Array:
    """The routing map of top-k expert indices.

    Args:
      indices: int ``[T, k]`` (or ``[B, S, k]``): the experts each token is routed to;
        ``-1`` routes nowhere (it fills the tail of :func:`routing_map_to_topk`'s rows, so
        its indices convert back to the map they came from). Other concrete indices must
        lie in ``[0, num_experts)``; traced ones outside it route nowhere. A repeated index
        routes the token to that expert once.
      num_experts: static E.

    Returns:
      bool ``[T, E]`` (or ``[B, S, E]``): ``True`` where a token is routed to an expert.
    """
    e = _checks.check_static_int("num_experts", num_experts, 0)
    indices = _checks.array_like("indices", indices)
    _checks.check_rank("indices", indices, (2, 3), "[T, k] or [B, S, k]")
    _checks.check_index_values("indices", indices)
    _checks.check_values(lambda i: None if ((i >= -1) & (i < e)).all() else
                         f"indices hold {sorted(set(i[(i < -1) | (i >= e)].tolist()))[:8]}; expected expert ids "
                         f"in [0, num_experts={e}), or -1 for no expert", indices)
    indices = jnp.asarray(indices)
    return (indices[..., None] == jnp.arange(e, dtype=indices.dtype)).any(axis=-2)


def routing_map_to_topk(routing_map: jax.Array, k: int) -> jax.Array:
    """Top-k expert indices of a routing map: each token's routed experts, ascending.

    Args:
      routing_map: ``[T, E]`` (or ``[B, S, E]``) bool or 0/1 integers.
      k: static number of indices per token.

    Returns:
      int32 ``[T, k]`` (or ``[B, S, k]``): the ``k`` lowest-numbered routed experts of each
      token; ``-1`` fills the tail of a token routed to fewer than ``k``.
    """
    routing_map = _checks.routing_map_array("routing_map", routing_map)
    _checks.check_rank("routing_map", routing_map, (2, 3), "[T, E] or [B, S, E]")
    e = routing_map.shape[-1]
    k = _checks.check_static_int("k", k, 0)
    if k > e:
        raise ValueError(f"k = {k} exceeds the routing map's E = {e} experts (routing_map has shape "
                         f"{tuple(routing_map.shape)}); expected k <= E")
    ids = jnp.arange(e, dtype=jnp.int32)
    # top_k of (E - id) over routed experts picks the lowest ids first; unrouted score 0.
    score, top = jax.lax.top_k(jnp.where(routing_map != 0, e - ids, 0), k)
    return jnp.where(score > 0, top, -1).astype(jnp.int32)
