"""Single-device, dense reference of the expert-parallel MoE layer, with its drop rules."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from te_jax_perm import _checks
from te_jax_perm.ops.moe_ffn.reference import activate, check_activation
from te_jax_perm.ops.row_id_map.api import checked_routing_map
from te_jax_perm.ops.row_id_map.reference import kept_of
from te_jax_perm.parallel.ep_moe import EPConfig, check_shapes


def _kept(routing_map: jax.Array, num_out_tokens: int, capacity: int, ep: int) -> jax.Array:
    """[T, E] bool: which routed (token, expert) rows of one device's shard survive."""
    t, e = routing_map.shape
    el = e // ep
    r = routing_map.astype(jnp.int32)
    cnt = r.sum(0)
    # position of row (t, e) in the expert-major, token-ascending order of the dispatch
    pos = (jnp.cumsum(cnt) - cnt)[None, :] + jnp.cumsum(r, axis=0) - 1
    keep = routing_map & (pos < num_out_tokens)
    per_rank = kept_of(cnt, num_out_tokens).reshape(ep, el).sum(1)
    rank_start = jnp.repeat(jnp.cumsum(per_rank) - per_rank, el)
    return keep & (pos - rank_start[None, :] < capacity)


def reference_moe_layer(x: jax.Array, routing_map: jax.Array, probs: jax.Array, w_in: jax.Array,
                        w_out: jax.Array, *, ep: int, data: int = 1, num_out_tokens: int | None = None,
                        capacity: int | None = None, activation: str = EPConfig.activation) -> jax.Array:
    """What :func:`ep_moe_layer` computes, densely: every expert on every token, masked.

    Shapes as for :func:`te_jax_perm.parallel.ep_moe_layer`; ``x`` is split into
    ``data * ep`` equal contiguous shards (``data``: the product of the data axes' sizes)
    whose drop rules apply separately. ``activation`` as ``EPConfig.activation``, with the
    same default (``"silu_glu"``: ``w_in`` is ``[E, H, 2F]``). Arguments are checked as
    :func:`ep_moe_layer` checks its own; a ``TypeError`` or ``ValueError`` names the one
    that does not fit.
    """
    # Checked as the layer checks them: unchecked, a routing map of other values than 0/1
    # is read bitwise, and shapes fail inside the einsums naming no argument.
    ep, data = _checks.check_static_int("ep", ep, 1), _checks.check_static_int("data", data, 1)
    for name, v in (("num_out_tokens", num_out_tokens), ("capacity", capacity)):
        if v is not None:
            _checks.check_static_int(name, v, 0)
    check_activation("activation", activation)
    x, probs, w_in, w_out = (_checks.array(name, a) for name, a in
                             (("x", x), ("probs", probs), ("w_in", w_in), ("w_out", w_out)))
    routing_map = checked_routing_map(routing_map)
    check_shapes(x, routing_map, probs, w_in, w_out,
                 EPConfig(num_out_tokens=num_out_tokens, capacity=capacity, activation=activation), ep, data * ep,
                 f"data * ep = {data} * {ep} token shards", fields="")
    tt, h = x.shape
    e = routing_map.shape[1]
    shards = data * ep
    t = tt // shards
    n, cap = EPConfig(num_out_tokens=num_out_tokens, capacity=capacity).sizes(t, e, e // ep)
    keep = jax.vmap(lambda m: _kept(m, n, cap, ep))(routing_map.reshape(shards, t, e)).reshape(tt, e)
    hid = jnp.einsum("th,ehf->etf", x, w_in, preferred_element_type=jnp.float32)
    y = jnp.einsum("etf,efh->eth", activate(activation, hid).astype(w_out.dtype), w_out,
                   preferred_element_type=jnp.float32)
    w = jnp.where(keep, probs, 0.0).astype(jnp.float32)
    return jnp.einsum("te,eth->th", w, y.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)
