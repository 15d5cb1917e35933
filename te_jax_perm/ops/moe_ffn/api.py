"""A Mixture-of-Experts expert layer with the dispatch and the combine fused into the
expert GEMMs: ``moe_ffn`` computes what ``token_dispatch`` → ``grouped_matmul(w_in)`` →
activation → ``grouped_matmul(w_out)`` → ``token_combine(merging_probs=probs)`` computes,
without the dispatched copy of the tokens.

The forward pass (kernels declared in :mod:`te_jax_perm.ops.moe_ffn.decl` and the grouped
GEMM's):

1. the dispatch's row-id map and its row owners (each expert-sorted row's one writing map
   entry, so its token), built on the device as ``token_dispatch`` builds them;
2. ``moe_gather_gemm``: row ``r`` of the first GEMM reads its token's row of ``x`` through
   the owner table (no ``[R, H]`` copy of the tokens); rows without a token are zeros. On
   Hopper, whose TMA cannot gather rows, the dispatch's ``permute`` kernel moves the rows
   into place instead and the grouped GEMM's TMA kernel multiplies them
   (faster there, though it writes the copy);
3. the activation, in float32, times each row's routing probability, rounded once to the
   compute dtype (XLA fuses it): the probability rides on the activations, so the second
   GEMM is the grouped GEMM's own (on Hopper its TMA kernel) and no
   epilogue of its own is needed;
4. the second GEMM, ``grouped_matmul``'s forward kernel;
5. the combine: each token sums its rows in a fixed order (its map's columns, float32) in
   the ``unpermute`` gather kernel. A token's rows come from different experts' tiles, so
   summing them inside the GEMM would need atomics; the gather keeps the sum deterministic.

The backward pass (one custom VJP) moves the output gradient's token rows into the
expert-sorted order once (the dispatch's ``permute`` kernel) and runs the grouped GEMM's own
kernels on them (on Hopper its TMA and warp-specialised ones, which gather no rows): the
second GEMM's input gradient (its dot with each row's activation is the probability's
gradient) and weight gradient (on the scaled activations the forward multiplied); the
first GEMM's input gradient and, from ``x``'s rows moved the same way, its weight gradient.
One ``permute_bwd_probs`` gather sums each token's rows into ``dx`` and moves each row's
probability gradient into place. The row copies live only inside the pass that makes
them; the forward keeps none for the backward. No kernel uses float atomics.

Both passes run per token shard (``te_jax_perm.ops.token_split``): under a multi-device
``jit`` with tokens sharded, each shard runs the layer on its own tokens, and the weights'
gradients are summed over the shards (reduce-scattered where a weight arrives split by the
token axes, as FSDP splits it).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from te_jax_perm.core import resolve_backend
from te_jax_perm.core.manual_axes import like_primal
from te_jax_perm import _checks
from te_jax_perm.ops.grouped_gemm.api import KERNEL_DTYPES, gemms
from te_jax_perm.ops.grouped_gemm.decl import on_hopper
from te_jax_perm.ops.moe_ffn import decl as D
from te_jax_perm.ops.moe_ffn.reference import activate, check_activation, check_expert_weights, row_probs
from te_jax_perm.ops.permute import decl as P
from te_jax_perm.ops.permute.api import dispatch_rows, local_budget, permute_fwd, unread_pad
from te_jax_perm.ops.row_id_map.api import dispatch_map
from te_jax_perm.ops.row_id_map.reference import kept_of, padded_counts_of, routed
from te_jax_perm.ops.token_split import shard_count, split_over_tokens


@_checks.keyword_only
def moe_ffn(x: jax.Array, routing_map: jax.Array, probs: jax.Array, w_in: jax.Array, w_out: jax.Array,
            num_out_tokens: int, *, activation: str = "silu_glu", align_size: int | None = None,
            backend: str | None = None) -> jax.Array:
    """The routed experts of an MoE layer, dispatch and combine fused into their GEMMs.

    Equals ``token_dispatch(x, routing_map, num_out_tokens, align_size=align_size)``, then
    per expert ``act(rows @ w_in[e]) @ w_out[e]`` (``grouped_matmul`` twice), then
    ``token_combine(..., merging_probs=probs)``, within the GEMMs' own rounding.

    Args:
      x: ``[T, H]`` or ``[B, S, H]`` tokens, float16, bfloat16 or float32.
      routing_map: ``[T, E]`` (or ``[B, S, E]``) bool or integer 0/1.
      probs: ``[T, E]`` (or ``[B, S, E]``) routing probabilities, bfloat16, float16 or
        float32; entries off the route are not read.
      w_in: ``[E, H, F]`` first expert weights; ``[E, H, 2F]`` for a gated activation
        (gate columns first, then up).
      w_out: ``[E, F, H]`` second expert weights.
      num_out_tokens: static row budget, usually ``T * k``: routed rows whose expert-sorted
        position (experts ascending, tokens in order within one) is at or past it are
        dropped, as ``token_dispatch`` drops them.
      activation: ``"silu_glu"`` (SwiGLU), ``"gelu_glu"``, ``"silu"``, ``"gelu"`` (tanh
        form) or ``"relu"``; computed in float32.
      align_size: optional static int: each expert's rows padded to a multiple of it, as
        ``token_dispatch(align_size=...)`` pads them (the result does not change; under
        token sharding, a shard whose share of the rows cannot hold the padded layout
        runs unpadded).
      backend: ``"triton"``, ``"interpret"``, ``"xla"`` or ``None`` (the default backend).

    Returns:
      ``x``'s shape, in the promoted dtype of ``x``, ``w_in`` and ``w_out``: each token's
      routed experts' outputs weighted by ``probs`` and summed in float32. Differentiable
      in ``x``, ``probs``, ``w_in`` and ``w_out``; deterministic (no float atomics).

    Sharding: under a multi-device ``jit`` with the tokens sharded (data or FSDP
    parallelism), each token shard runs the whole layer on its own tokens, as
    ``token_dispatch`` does: its row-id map, both GEMMs on its own rows and the combine,
    with ``num_out_tokens // shards`` rows of budget each (each shard drops past its
    share); the result stays sharded like ``x``. The weights are used whole (a sharded
    weight is gathered, as FSDP does before a layer) and their gradients are summed over
    the shards; a weight split along a dimension by the token mesh axes (FSDP) gets its
    gradient reduce-scattered along it, split like the weight, instead of all-reduced.
    ``T`` must divide by the number of shards. The token axis is ``[B*S]``
    flattened: shard ``B`` (or ``T``); a split ``S`` or hidden axis is gathered, and so are
    token operands sharded differently from ``x``. With ``backend="interpret"`` a
    multi-device program computes the unsharded layer (one global budget). Inside
    ``jax.shard_map`` (its type check on or off), weights the body receives replicated get
    gradients summed over the shards. For expert parallelism see
    ``te_jax_perm.parallel.ep_moe_layer``.
    """
    x = _checks.array("x", x)
    xt = _checks.flatten_rows("x", x, "T", "H")
    routing_map = _checks.routing_map_array("routing_map", routing_map)
    t, h = xt.shape
    rm = _checks.routing_rows(routing_map, "x", x)
    e = rm.shape[1]
    if e == 0:
        raise ValueError(f"routing_map has shape {tuple(routing_map.shape)}; expected at least one expert")
    probs = _checks.probs_like_map(probs, routing_map)
    check_activation("activation", activation)
    w_in, w_out = _checks.array("w_in", w_in), _checks.array("w_out", w_out)
    f = check_expert_weights(w_in, w_out, e, h, activation)
    check_layer_dtypes(x, probs, w_in, w_out)
    dt = jnp.result_type(x.dtype, w_in.dtype, w_out.dtype)
    num_out_tokens = _checks.check_static_int("num_out_tokens", num_out_tokens, 0)
    align_size, rows = dispatch_rows(num_out_tokens, e, align_size)
    if t == 0 or rows == 0 or f == 0:
        return jnp.zeros(x.shape, dt)  # no row reaches an expert
    backend = resolve_backend(backend)
    y = _moe_ffn(xt.astype(dt), w_in.astype(dt), w_out.astype(dt), probs, rm, unread_pad(e),
                 Layer(t, num_out_tokens, align_size, layer_rows(t, rows), activation, backend))
    return y.reshape(x.shape)


def check_layer_dtypes(x: jax.Array, probs: jax.Array, w_in: jax.Array, w_out: jax.Array) -> None:
    """An expert layer's dtypes (``moe_ffn``'s and the expert-parallel layer's): tokens and
    weights in a dtype the GEMM kernels compute in, probabilities in a float dtype; a
    ``TypeError`` naming the argument otherwise."""
    for name, arr in (("x", x), ("w_in", w_in), ("w_out", w_out)):
        if jnp.dtype(arr.dtype) not in KERNEL_DTYPES:
            raise TypeError(f"{name} has dtype {jnp.dtype(arr.dtype).name}; expected float16, bfloat16 or float32")
    _checks.check_probs_dtype("probs", probs)


# -- the fused layer and its VJP ---------------------------------------------------------------
# Forward and backward each run per token shard (``split_over_tokens``); what the backward
# needs crosses between them as token- or row-sharded residuals.
_IN_AXES = (("T", "D"), ("E", "D", "F2"), ("E", "F", "D"), ("T", "E"), ("T", "E"), ("E",))
_RES_AXES = (("T", "W"), ("R",), ("R", "F2"))   # row-id map, row owners, first GEMM's output


def layer_rows(tokens: int, dispatch_rows: int) -> int:
    """The layer's expert-sorted rows. They live only inside the layer, so their count is
    ours to choose: the dispatch's rows rounded up to a multiple of the token count, so that
    every token sharding divides them too (not past int32 row indices: there they stay as
    they are, and a sharding must divide them)."""
    rows = -(-dispatch_rows // tokens) * tokens
    return rows if rows <= _checks.INT32_MAX else dispatch_rows


class Layer(NamedTuple):
    """The static facts of one call: global token and row counts, drop budget, activation."""
    tokens: int
    num_out_tokens: int
    align_size: int | None
    rows: int
    activation: str
    backend: str

    def shard(self, local_tokens: int, num_experts: int) -> tuple[int, int, int | None]:
        """``(rows, budget, align_size)`` of the shard holding ``local_tokens`` tokens: its
        share of the rows and of ``num_out_tokens``, padded where its rows hold the padded
        layout and unpadded where they cannot (the result is the same either way)."""
        shards = shard_count(self.tokens, local_tokens)
        rows = self.rows // shards
        budget = local_budget(self.num_out_tokens, shards, rows, num_experts, None)
        padded_fits = local_budget(self.num_out_tokens, shards, rows, num_experts, self.align_size) == budget
        return rows, budget, self.align_size if padded_fits else None


def _group_sizes(kept: jax.Array, align_size: int | None) -> jax.Array:
    return kept if align_size is None else padded_counts_of(kept, align_size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _moe_ffn(x, w_in, w_out, probs, rm, pad, layer):
    return _fwd(x, w_in, w_out, probs, rm, pad, layer)[0]


def _fwd(x, w_in, w_out, probs, rm, pad, layer):
    y, rid, owner, h = split_over_tokens("moe_ffn", functools.partial(_fwd_local, layer),
                                         (x, w_in, w_out, probs, rm, pad), _IN_AXES, (("T", "D"),) + _RES_AXES,
                                         layer.backend)
    return y, (x, w_in, w_out, probs, rm, pad, rid, owner, h)


def _fwd_local(layer, x, w_in, w_out, probs, rm, pad):
    """One token shard's layer: ``(y, row_id_map, owner, h)``."""
    backend, e = layer.backend, w_in.shape[0]
    rows, budget, align = layer.shard(x.shape[0], e)
    rid, kept, owner = dispatch_map(rm, budget, align or 1, rows, backend)
    group_sizes = _group_sizes(kept, align)
    fwd, _, _ = gemms(backend)
    if on_hopper(backend):
        # Hopper's TMA moves blocks, not gathered rows, and the grouped GEMM's TMA kernel
        # outruns the gathering pointer kernel by more than moving the rows first costs: on
        # an H100, steps of 15.25 and 29.54 ms at Qwen3-235B's and Mixtral's layers against
        # 15.83 and 30.34 ms gathering. The moved rows live only
        # until the GEMM has read them.
        h = fwd(_rows(x, rid, owner, pad, backend), w_in, group_sizes, x.dtype)
    else:
        (h,) = D.moe_gather_gemm(x, w_in, group_sizes, owner, backend=backend, elem_bytes=x.dtype.itemsize)
    p = row_probs(probs, group_sizes, owner)
    # The probability rides on the activations, rounded once with them. A row without an
    # owner has h = 0, so act = 0, and p = 0: it stays zero.
    a = activate(layer.activation, h) * p[:, None]
    z = fwd(a.astype(x.dtype), w_out, group_sizes, x.dtype)
    (y,) = P.unpermute(z, rid, pad, backend=backend, padded=False)
    return y, rid, owner, h


def _rows(v, rid, owner, pad, backend):
    """``[M, K]``: each expert-sorted row's token row of ``v [T, K]`` (zeros for rows no
    token owns), moved by the dispatch's ``permute`` kernel along the owner table."""
    (rows, _), _ = permute_fwd(v, None, rid, pad, owner.shape[0], False, backend, owner)
    return rows


def _bwd(layer, res, dy):
    args = res + (dy,)
    dx, dw_in, dw_out, dprobs = split_over_tokens(
        "moe_ffn (backward)", functools.partial(_bwd_local, layer), args, _IN_AXES + _RES_AXES + (("T", "D"),),
        (("T", "D"), ("E", "D", "F2"), ("E", "F", "D"), ("T", "E")), layer.backend,
        summed={1: 1, 2: 2})
    # The routing map and pad are not differentiable inputs: their cotangents are symbolic zeros.
    x, w_in, w_out, probs = res[:4]
    return (like_primal(dx, x), like_primal(dw_in, w_in), like_primal(dw_out, w_out), like_primal(dprobs, probs),
            None, None)


def _bwd_local(layer, x, w_in, w_out, probs, rm, pad, rid, owner, h, dy):
    """One token shard's gradients ``(dx, dw_in, dw_out, dprobs)``, the weights' partial
    over the shard's rows."""
    backend, dt, e = layer.backend, x.dtype, w_in.shape[0]
    _, budget, align = layer.shard(x.shape[0], e)
    # The shard's group sizes again, from its routing map (a column sum): a per-shard [E]
    # array has no token axis to cross from the forward on.
    group_sizes = _group_sizes(kept_of(routed(rm).sum(axis=0, dtype=jnp.int32), budget), align)
    _, dgrad, wgrad = gemms(backend)
    a, act_vjp = jax.vjp(lambda v: activate(layer.activation, v), h)
    p = row_probs(probs, group_sizes, owner)
    # Second GEMM and combine: y[t] = sum_r (p_r a_r) @ w_out[g]. Row r's gradient before its
    # probability, dy[token] @ w_out[g].T, gives both the probability's gradient (its dot
    # with a_r) and, scaled, a_r's; w_out[g]'s is the scaled rows the forward multiplied,
    # transposed, times dy's rows (dy's rows stay unscaled for the input gradient).
    dy_rows = _rows(dy.astype(dt), rid, owner, pad, backend)
    # In the kernels' dtype, widened where it is read: a float32 copy would double its bytes.
    da_unscaled = dgrad(dy_rows, w_out, group_sizes, dt).astype(jnp.float32)
    dprobs_rows = jnp.sum(da_unscaled * a, axis=-1)
    dw_out = wgrad((a * p[:, None]).astype(dt), dy_rows, group_sizes, dt)
    (dh,) = act_vjp(da_unscaled * p[:, None])
    # First GEMM and dispatch: each row's input gradient, summed into its token with the
    # probability gradients moved alongside (one gather, fixed order).
    dx_rows = dgrad(dh, w_in, group_sizes, dt)
    dw_in = wgrad(_rows(x, rid, owner, pad, backend), dh, group_sizes, dt)
    dx, dprobs = P.permute_bwd_probs(dx_rows, rid, pad, dprobs_rows.astype(probs.dtype),
                                     backend=backend, padded=False)
    return dx, dw_in, dw_out, dprobs


_moe_ffn.defvjp(_fwd, _bwd)
