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
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from te_jax_perm.core import resolve_backend
from te_jax_perm.ops import _checks
from te_jax_perm.ops.grouped_gemm.api import KERNEL_DTYPES, gemms
from te_jax_perm.ops.grouped_gemm.decl import on_hopper
from te_jax_perm.ops.moe_ffn import decl as D
from te_jax_perm.ops.moe_ffn.reference import ACTIVATIONS, activate, row_probs
from te_jax_perm.ops.permute import decl as P
from te_jax_perm.ops.permute.api import dispatch_rows, local_budget, permute_fwd, unread_pad
from te_jax_perm.ops.row_id_map.api import dispatch_map
from te_jax_perm.ops.row_id_map.reference import padded_counts_of


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
        ``token_dispatch(align_size=...)`` pads them (the result does not change).
      backend: ``"triton"``, ``"interpret"``, ``"xla"`` or ``None`` (the default backend).

    Returns:
      ``x``'s shape, in the promoted dtype of ``x``, ``w_in`` and ``w_out``: each token's
      routed experts' outputs weighted by ``probs`` and summed in float32. Differentiable
      in ``x``, ``probs``, ``w_in`` and ``w_out``; deterministic (no float atomics).

    Sharding: it has no token-sharding rule. Under a multi-device ``jit`` with tokens
    sharded it computes the whole (unsharded) layer, gathering the tokens, and returns a
    replicated result; for a data-parallel layer call it per shard inside
    ``jax.shard_map`` (each shard's own tokens and row budget).
    """
    x = jnp.asarray(x)
    xt = _checks.flatten_rows("x", x, "T", "H")
    routing_map = _checks.routing_map_array("routing_map", routing_map)
    t, h = xt.shape
    rm = _checks.routing_rows(routing_map, "x", x)
    e = rm.shape[1]
    if e == 0:
        raise ValueError(f"routing_map has shape {tuple(routing_map.shape)}; expected at least one expert")
    probs = _checks.probs_like_map(probs, routing_map)
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}; expected one of {tuple(ACTIVATIONS)}")
    gated = ACTIVATIONS[activation][1]
    w_in, w_out = jnp.asarray(w_in), jnp.asarray(w_out)
    f = _check_weights(w_in, w_out, e, h, gated)
    for name, arr in (("x", x), ("w_in", w_in), ("w_out", w_out)):
        if arr.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{name} has dtype {arr.dtype}; expected float16, bfloat16 or float32")
    dt = jnp.result_type(x.dtype, w_in.dtype, w_out.dtype)
    num_out_tokens = _checks.check_static_int("num_out_tokens", num_out_tokens, 0)
    align_size, rows = dispatch_rows(num_out_tokens, e, align_size)
    if t == 0 or rows == 0 or f == 0:
        return jnp.zeros(x.shape, dt)  # no row reaches an expert
    backend = resolve_backend(backend)
    budget = local_budget(num_out_tokens, 1, rows, e, align_size)
    rid, kept, owner = dispatch_map(rm, budget, align_size or 1, rows, backend)
    group_sizes = kept if align_size is None else padded_counts_of(kept, align_size)
    y = _moe_ffn(xt.astype(dt), w_in.astype(dt), w_out.astype(dt), probs, rid, group_sizes, owner, activation,
                 backend)
    return y.reshape(x.shape)


def _check_weights(w_in: Any, w_out: Any, e: int, h: int, gated: bool) -> int:
    """The checked weights' inner size ``F``."""
    want_in = f"[E={e}, H={h}, {'2F' if gated else 'F'}]"
    _checks.check_rank("w_in", w_in, (3,), want_in)
    if tuple(w_in.shape[:2]) != (e, h) or (gated and w_in.shape[2] % 2):
        raise ValueError(f"w_in has shape {tuple(w_in.shape)}; expected {want_in} (E from routing_map, H from x"
                         f"{'; gate and up columns side by side, an even count' if gated else ''})")
    f = w_in.shape[2] // 2 if gated else w_in.shape[2]
    _checks.check_shape("w_out", w_out, (e, f, h), f"[E={e}, F={f}, H={h}] (F from w_in {tuple(w_in.shape)})")
    return f


# -- the fused layer and its VJP ---------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _moe_ffn(x, w_in, w_out, probs, rid, group_sizes, owner, activation, backend):
    return _fwd(x, w_in, w_out, probs, rid, group_sizes, owner, activation, backend)[0]


def _fwd(x, w_in, w_out, probs, rid, group_sizes, owner, activation, backend):
    fwd, _, _ = gemms(backend)
    if on_hopper(backend):
        # Hopper's TMA moves blocks, not gathered rows, and the grouped GEMM's TMA kernel
        # outruns the gathering pointer kernel by more than moving the rows first costs: on
        # an H100, steps of 15.25 and 29.54 ms at Qwen3-235B's and Mixtral's layers against
        # 15.83 and 30.34 ms gathering. The moved rows live only
        # until the GEMM has read them.
        h = fwd(_rows(x, rid, owner, w_in.shape[0], backend), w_in, group_sizes, x.dtype)
    else:
        (h,) = D.moe_gather_gemm(x, w_in, group_sizes, owner, backend=backend, elem_bytes=x.dtype.itemsize)
    p, _ = row_probs(probs, group_sizes, owner)
    # The probability rides on the activations, rounded once with them. A row without an
    # owner has h = 0, so act = 0, and p = 0: it stays zero.
    a = activate(activation, h) * p[:, None]
    z = fwd(a.astype(x.dtype), w_out, group_sizes, x.dtype)
    (y,) = P.unpermute(z, rid, unread_pad(w_in.shape[0]), backend=backend, padded=False)
    return y, (x, w_in, w_out, probs, rid, group_sizes, owner, h)


def _rows(v, rid, owner, num_groups, backend):
    """``[M, K]``: each expert-sorted row's token row of ``v [T, K]`` (zeros for rows no
    token owns), moved by the dispatch's ``permute`` kernel along the owner table."""
    (rows, _), _ = permute_fwd(v, None, rid, unread_pad(num_groups), owner.shape[0], False, backend, owner)
    return rows


def _bwd(activation, backend, res, dy):
    x, w_in, w_out, probs, rid, group_sizes, owner, h = res
    dt, e = x.dtype, w_in.shape[0]
    _, dgrad, wgrad = gemms(backend)
    a, act_vjp = jax.vjp(lambda v: activate(activation, v), h)
    p, _ = row_probs(probs, group_sizes, owner)
    # Second GEMM and combine: y[t] = sum_r (p_r a_r) @ w_out[g]. Row r's gradient before its
    # probability, dy[token] @ w_out[g].T, gives both the probability's gradient (its dot
    # with a_r) and, scaled, a_r's; w_out[g]'s is the scaled rows the forward multiplied,
    # transposed, times dy's rows (dy's rows stay unscaled for the input gradient).
    dy_rows = _rows(dy.astype(dt), rid, owner, e, backend)
    # In the kernels' dtype, widened where it is read: a float32 copy would double its bytes.
    da_unscaled = dgrad(dy_rows, w_out, group_sizes, dt).astype(jnp.float32)
    dprobs_rows = jnp.sum(da_unscaled * a, axis=-1)
    dw_out = wgrad((a * p[:, None]).astype(dt), dy_rows, group_sizes, dt)
    (dh,) = act_vjp(da_unscaled * p[:, None])
    # First GEMM and dispatch: each row's input gradient, summed into its token with the
    # probability gradients moved alongside (one gather, fixed order).
    dx_rows = dgrad(dh, w_in, group_sizes, dt)
    dw_in = wgrad(_rows(x, rid, owner, e, backend), dh, group_sizes, dt)
    dx, dprobs = P.permute_bwd_probs(dx_rows, rid, unread_pad(e), dprobs_rows.astype(probs.dtype),
                                     backend=backend, padded=False)
    # The map, group sizes and owners are integers: their cotangents are symbolic zeros.
    return dx, dw_in, dw_out, dprobs, None, None, None


_moe_ffn.defvjp(_fwd, _bwd)
