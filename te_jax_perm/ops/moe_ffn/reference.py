"""Pure-JAX reference of the fused MoE layer's gathering GEMM (its ``xla`` backend), the
activations ``moe_ffn`` (and the expert-parallel layer) apply between the expert GEMMs with
the checks of their names and weights, and the float64 NumPy
:func:`moe_ffn_reference` the tests hold every path to.

Row semantics every path shares (those of :mod:`te_jax_perm.kernels.moe_ffn`): ``M``
expert-sorted rows, grouped by ``group_sizes`` (clamped as the grouped GEMM clamps them);
row ``r``'s token is ``(owner[r] - 1) // G`` where ``owner[r] > 0`` and that token exists;
a row without one (padding, unused budget, past the groups) reads zeros and gives zeros.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from te_jax_perm import _checks
from te_jax_perm.ops.grouped_gemm.reference import clamped_group_sizes, grouped_gemm_reference

# name -> (function of the first GEMM's float32 output, whether w_in holds gate and up side
# by side, [E, H, 2F], the activation being act(gate) * up).
ACTIVATIONS: dict[str, tuple[Callable[[jax.Array], jax.Array], bool]] = {
    "silu_glu": (jax.nn.silu, True),
    "gelu_glu": (jax.nn.gelu, True),
    "silu": (jax.nn.silu, False),
    "gelu": (jax.nn.gelu, False),
    "relu": (jax.nn.relu, False),
}


def check_activation(name: str, activation: Any) -> bool:
    """Whether the activation named ``activation`` is gated; a ``ValueError`` naming the
    argument ``name`` where it is not one of :data:`ACTIVATIONS`."""
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"{name}={activation!r}; expected one of {tuple(ACTIVATIONS)}")
    return ACTIVATIONS[activation][1]


def check_expert_weights(w_in: Any, w_out: Any, e: int, h: int, activation: str, experts: str = "E",
                         experts_from: str = "routing_map", activation_name: str = "activation") -> int:
    """Checks an expert FFN's ``w_in [E, H, F]`` (``[E, H, 2F]`` for a gated ``activation``)
    and ``w_out [E, F, H]``; returns ``F``. ``experts`` names the expert count ``e`` in the
    messages and ``experts_from`` says where it comes from (a device's share of the experts
    is not routing_map's count); ``activation_name`` is what the caller calls the activation
    (``EPConfig.activation`` for the expert-parallel layer)."""
    gated = ACTIVATIONS[activation][1]
    want_in = f"[{experts}={e}, H={h}, {'2F' if gated else 'F'}]"
    _checks.check_rank("w_in", w_in, (3,), want_in)
    if tuple(w_in.shape[:2]) != (e, h) or (gated and w_in.shape[2] % 2):
        raise ValueError(f"w_in has shape {tuple(w_in.shape)}; expected {want_in} ({experts} from {experts_from}, H "
                         f"from x{'; gate and up columns side by side, an even count' if gated else ''})")
    f = w_in.shape[2] // 2 if gated else w_in.shape[2]
    other = w_in.shape[2] if gated else w_in.shape[2] // 2   # F under the other reading of w_in
    want_out = f"[{experts}={e}, F={f}, H={h}]"
    if (getattr(w_out, "ndim", None) == 3 and tuple(w_out.shape) == (e, other, h) and other != f
            and (gated or w_in.shape[2] % 2 == 0)):
        raise ValueError(
            f"w_out has shape {tuple(w_out.shape)}, which fits w_in {tuple(w_in.shape)} as a "
            f"{'plain' if gated else 'gated'} activation's weights, but {activation_name}={activation!r} is "
            f"{'gated' if gated else 'not gated'}: expected w_out {want_out}; or choose a "
            f"{'plain activation (silu, gelu, relu)' if gated else 'gated activation (silu_glu, gelu_glu)'}")
    _checks.check_shape("w_out", w_out, (e, f, h), f"{want_out} (F from w_in {tuple(w_in.shape)})")
    return f


def activate(activation: str, h: jax.Array) -> jax.Array:
    """The activation between the expert GEMMs, in float32: ``act(h)``, or for a gated one
    ``act(gate) * up`` with ``gate, up = h[..., :F], h[..., F:]`` (``[..., 2F] -> [..., F]``).
    ``act(0) = 0`` for every one, so zero rows (padding) stay zero."""
    fn, gated = ACTIVATIONS[activation]
    h = h.astype(jnp.float32)
    if not gated:
        return fn(h)
    gate, up = jnp.split(h, 2, axis=-1)
    return fn(gate) * up


def row_tokens(owner: jax.Array, num_groups: int, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """``(token int32 [M], owned bool [M])`` of each row: its owner's token where the owner
    is positive and names a token in ``[0, num_tokens)``; token 0 where not owned."""
    tok = (jnp.maximum(owner, 1) - 1) // num_groups
    owned = (owner > 0) & (tok < num_tokens)
    return jnp.where(owned, tok, 0).astype(jnp.int32), owned


def row_groups(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Each of ``rows`` rows' group, int32 ``[rows]``; ``G`` for rows past the groups."""
    ends = jnp.cumsum(clamped_group_sizes(group_sizes, rows))
    # Every row against every end (one fused reduction): a binary search is a loop, which on
    # a GPU reads its condition back to the host at every step, stalling the stream in the
    # middle of a training step. (Written out rather than as jnp.searchsorted, whose shape
    # rule fails inside a partly manual jax.shard_map.)
    return jnp.sum(ends[None, :] <= jnp.arange(rows, dtype=ends.dtype)[:, None], axis=1, dtype=jnp.int32)


def row_probs(probs: jax.Array, group_sizes: jax.Array, owner: jax.Array) -> jax.Array:
    """``float32 [M]``: each owned row's probability ``probs[token, group]``, 0 for rows
    without an owner or past the groups."""
    t, g = probs.shape
    tok, owned = row_tokens(owner, g, t)
    grp = row_groups(group_sizes, owner.shape[0])
    owned = owned & (grp < g)
    p = probs.astype(jnp.float32)[tok, jnp.minimum(grp, g - 1)]
    return jnp.where(owned, p, 0.0)


def gather_rows(x: jax.Array, owner: jax.Array, num_groups: int) -> jax.Array:
    """``[M, K]``: each row's token row of ``x [T, K]``, zeros where the row has no owner."""
    tok, owned = row_tokens(owner, num_groups, x.shape[0])
    if x.shape[0] == 0:
        return jnp.zeros((owner.shape[0], x.shape[1]), x.dtype)
    return jnp.where(owned[:, None], x[tok], jnp.zeros((), x.dtype))


def moe_gather_gemm_reference(x, rhs, group_sizes, owner, *, elem_bytes):
    """Kernel ``moe_gather_gemm``: ``[M, D]``, row r = ``x[token(r)] @ rhs[g]``."""
    del elem_bytes
    # Rows past the groups read nothing in the kernel: the reference GEMM zeros them.
    return (grouped_gemm_reference(gather_rows(x, owner, group_sizes.shape[0]), rhs, group_sizes),)


# -- the op's NumPy reference ----------------------------------------------------------------
def _np_activate(activation: str, h: np.ndarray) -> np.ndarray:
    _, gated = ACTIVATIONS[activation]
    name = activation.replace("_glu", "")
    if name == "silu":
        fn = lambda v: v / (1.0 + np.exp(-v))                                              # noqa: E731
    elif name == "gelu":  # the tanh form, as jax.nn.gelu computes it by default
        fn = lambda v: 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v ** 3)))  # noqa: E731
    else:
        fn = lambda v: np.maximum(v, 0.0)                                                 # noqa: E731
    if not gated:
        return fn(h)
    gate, up = np.split(h, 2, axis=-1)
    return fn(gate) * up


def moe_ffn_reference(x: Any, routing_map: Any, probs: Any, w_in: Any, w_out: Any, num_out_tokens: int,
                      activation: str = "silu_glu") -> np.ndarray:
    """NumPy float64: ``y[t] = sum_e probs[t, e] * act(x[t] @ w_in[e]) @ w_out[e]`` over the
    experts ``e`` token ``t`` is routed to and whose row the dispatch keeps: rows in
    expert-major order (tokens ascending within an expert) at or past ``num_out_tokens``
    are dropped, as ``token_dispatch`` drops them. ``[T, H]``."""
    x, probs, w_in, w_out = (np.asarray(a, np.float64) for a in (x, probs, w_in, w_out))
    rm = np.asarray(routing_map).astype(bool)
    y = np.zeros_like(x)
    row = 0
    for e in range(rm.shape[1]):
        for t in np.flatnonzero(rm[:, e]):
            if row < num_out_tokens:
                y[t] += probs[t, e] * (_np_activate(activation, x[t] @ w_in[e]) @ w_out[e])
            row += 1
    return y
