"""Permute token rows into expert-sorted rows and back, through a row-id map; and the
TransformerEngine-compatible dispatch and combine built on the same kernels.

``permute_with_mask_map`` / ``unpermute_with_mask_map`` take a row-id map from
``make_row_id_map``; they are differentiable (custom VJPs whose backward passes are the
opposite kernel), jit-able and vmap-able. Every launch, forward and backward, is a
declared kernel (:mod:`te_jax_perm.ops.permute.decl`) with aliased preallocated outputs.

``token_dispatch`` groups token rows by expert (expert ascending, tokens in their original
order within an expert), optionally dropping rows beyond a static budget and padding each
expert's rows to a multiple of ``align_size``. ``token_combine`` brings the expert rows
back and sums each token's rows, weighted by ``merging_probs`` when given.

Signatures, dtypes, output sizes and return arity are those of
``transformer_engine.jax.permutation``; ``backend=`` is keyword-only and ours.

The row-id map that ``token_dispatch`` returns addresses the rows of *its* output buffer,
padding included: ``token_combine`` needs nothing else, so a padded dispatch combined
without ``pad_offsets`` still returns the right tokens (``pad_offsets`` is accepted, as in
TransformerEngine, and shape-checked, but not read).

Token sharding: with tokens sharded over a data/FSDP-parallel mesh, each shard dispatches
and combines its own tokens, with ``num_out_tokens`` (the output rows) divided across the
shards, as TransformerEngine does (``tokens_per_expert`` then counts every shard's rows:
see :func:`token_dispatch`); see :mod:`te_jax_perm.ops.token_split`.

Batch shape: inputs may be ``[B, S, ...]``; they are flattened to ``T = B*S`` tokens.
``token_combine`` returns ``[T, H]`` (the row-id map keeps no batch shape); reshape to
``[B, S, H]`` if needed.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from te_jax_perm.core import resolve_backend
from te_jax_perm.core.manual_axes import like_primal, witness
from te_jax_perm import _checks
from te_jax_perm.ops._bits import from_bits, to_bits
from te_jax_perm.ops.permute import decl as D
from te_jax_perm.ops.row_id_map.api import dispatch_map
from te_jax_perm.ops.row_id_map.reference import kept_of, pad_offsets_of, padded_counts_of, padded_extent, routed
from te_jax_perm.ops.token_split import shard_count, split_over_tokens


def unread_pad(e: int) -> np.ndarray:
    """The ``pad`` operand of an unpadded launch (``padded=False``), which no kernel reads.
    Its values are chosen so that it stays a buffer of the compiled program: XLA rewrites a
    constant of one repeated value into a broadcast and ``0, 1, 2, ...`` into an iota, each
    a kernel launched on every call."""
    return np.arange(e, 0, -1, dtype=np.int32)


def _owners(rid, pad, rows, padded, backend):
    """Each of ``rows`` output rows' one writing map entry (see ``row_owner``), derived on
    the device from the map itself: no count from the caller decides what gets written."""
    return D.row_owner(rid, pad, backend=backend, num_out_rows=rows, padded=padded)[0]


# -- differentiable cores ------------------------------------------------------------------
# permute_with_mask_map's and unpermute_with_mask_map's VJPs; each rule runs under
# first_order, so that differentiating a gradient again raises naming the op.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _permute(inp, probs, rid, pad, num_out_rows, padded, backend):
    return _permute_fwd(inp, probs, rid, pad, num_out_rows, padded, backend)[0]


def _permute_fwd(inp, probs, rid, pad, num_out_rows, padded, backend):
    return _checks.first_order("permute_with_mask_map", lambda *a: permute_fwd(*a, num_out_rows, padded, backend))(
        inp, probs, rid, pad)


def _permute_bwd(num_out_rows, padded, backend, res, cts):
    return _checks.first_order("permute_with_mask_map", lambda res, cts: permute_bwd(padded, backend, res, cts))(
        res, cts)


def permute_fwd(inp, probs, rid, pad, num_out_rows, padded, backend, owner=None):
    """``owner``: the map's row owners when its builder already has them (the dispatch's
    map), else derived here."""
    kw = dict(backend=backend, num_out_rows=num_out_rows, padded=padded)
    x = to_bits(inp)
    if owner is None:
        owner = _owners(rid, pad, num_out_rows, padded, backend)
    if probs is None:
        (out,), pout = D.permute(x, rid, pad, owner, **kw), None
    else:
        out, pout = D.permute_probs(x, rid, pad, owner, probs, **kw)
    return (from_bits(out, inp.dtype, (num_out_rows,) + inp.shape[1:]), pout), (rid, pad, witness(inp), witness(probs))


def permute_grads(g_out, g_pout, rid, pad, padded, backend):
    """The permute's backward gather: ``(g_inp, g_probs)``, ``g_probs`` None without ``g_pout``."""
    if g_pout is not None:
        return D.permute_bwd_probs(g_out, rid, pad, g_pout, backend=backend, padded=padded)
    return D.unpermute(g_out, rid, pad, backend=backend, padded=padded)[0], None


def permute_bwd(padded, backend, res, cts):
    rid, pad, inp, probs = res
    g_inp, g_probs = permute_grads(*cts, rid, pad, padded, backend)
    return like_primal(g_inp, inp), like_primal(g_probs, probs), None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _unpermute(inp, merging_probs, rid, pad, padded, backend):
    return _checks.first_order("unpermute_with_mask_map", lambda *a: unpermute_rows(*a, padded, backend))(
        inp, merging_probs, rid, pad)


def _unpermute_fwd(inp, merging_probs, rid, pad, padded, backend):
    return _checks.first_order("unpermute_with_mask_map", lambda *a: unpermute_fwd(*a, padded, backend))(
        inp, merging_probs, rid, pad)


def _unpermute_bwd(padded, backend, res, g):
    return _checks.first_order("unpermute_with_mask_map", lambda res, g: unpermute_bwd(padded, backend, res, g))(
        res, g)


def unpermute_rows(inp, merging_probs, rid, pad, padded, backend):
    """The combine forward: each token's rows summed (weighted)."""
    kw = dict(backend=backend, padded=padded)
    if merging_probs is None:
        return D.unpermute(inp, rid, pad, **kw)[0]
    return D.unpermute_weighted(inp, rid, pad, merging_probs, **kw)[0]


def unpermute_fwd(inp, merging_probs, rid, pad, padded, backend):
    """The combine forward under differentiation: the same sums, and the map's row owners
    for the backward's scatter, filled by the same kernel from the entries it already
    walks (a separate ``row_owner`` launch in the backward costs more)."""
    kw = dict(backend=backend, padded=padded)
    if merging_probs is None:
        out, owner = D.unpermute_owner(inp, rid, pad, **kw)
    else:
        out, owner = D.unpermute_weighted_owner(inp, rid, pad, merging_probs, **kw)
    return out, (inp, merging_probs, rid, pad, owner)


def unpermute_grads(g, inp, merging_probs, rid, pad, owner, padded, backend):
    """The combine's backward scatter: ``(g_inp, g_w)``, ``g_w`` None without ``merging_probs``."""
    if merging_probs is None:
        return permute_fwd(g.astype(inp.dtype), None, rid, pad, inp.shape[0], padded, backend, owner)[0][0], None
    return D.unpermute_bwd_weighted(g, rid, pad, owner, merging_probs, inp, backend=backend, padded=padded)


def unpermute_bwd(padded, backend, res, g):
    inp, merging_probs, rid, pad, owner = res
    g_inp, g_w = unpermute_grads(g, inp, merging_probs, rid, pad, owner, padded, backend)
    return like_primal(g_inp, inp), like_primal(g_w, merging_probs), None, None


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


# -- public API ------------------------------------------------------------------------------
def _per_expert(name: str, counts: Any, e: int, note: str = "") -> Any:
    """``counts`` (``tokens_per_expert``, ``pad_offsets``) checked as an int ``[E]`` of
    values that fit int32; arrays taken as token_dispatch takes them (lists too), not cast yet."""
    counts = _checks.array_like(name, counts)
    _checks.check_shape(name, counts, (e,), f"[E={e}]{note}")
    _checks.check_index_values(name, counts)
    return counts


def _permute_args(inp, row_id_map, tokens_per_expert, num_out_rows, probs, pad_offsets):
    """Checked arguments of :func:`permute_with_mask_map`: ``(inp, probs, pad, padded, num_out_rows)``,
    arrays taken as token_dispatch takes them (lists too)."""
    inp = _checks.array("inp", inp)
    _checks.check_rank("inp", inp, (2,), "[T, H]")
    _checks.check_token_dtype("inp", inp)
    e = _checks.num_experts_of_map(row_id_map)
    _checks.check_shape("row_id_map", row_id_map, (inp.shape[0], 2 * e + 1),
                        f"[T={inp.shape[0]}, 2E+1] (T from inp {tuple(inp.shape)})")
    _per_expert("tokens_per_expert", tokens_per_expert, e)
    num_out_rows = _checks.check_static_int("num_out_rows", num_out_rows, 0)
    if probs is not None:
        probs = _checks.array("probs", probs)
        _checks.check_shape("probs", probs, (inp.shape[0], e), f"[T={inp.shape[0]}, E={e}]")
        _checks.check_probs_dtype("probs", probs)
    return inp, probs, pad_operand(pad_offsets, e, row_id_map), pad_offsets is not None, num_out_rows


@_checks.keyword_only
def permute_with_mask_map(inp: jax.Array, row_id_map: jax.Array, tokens_per_expert: jax.Array,
                          num_out_rows: int, probs: jax.Array | None = None,
                          pad_offsets: jax.Array | None = None, *, backend: str | None = None
                          ) -> tuple[jax.Array, jax.Array | None]:
    """Scatters token rows to expert-sorted rows.

    Args:
      inp: ``[T, H]`` tokens (bf16, fp16, fp32 or fp8 e4m3; copied bit-exactly).
      row_id_map: int32 ``[T, 2E+1]`` from :func:`make_row_id_map` (or :func:`token_dispatch`),
        read as addressing rows of the whole output, also under a multi-device ``jit``. A
        token-sharded :func:`token_dispatch`'s map addresses each shard's own rows: use it
        here only inside ``jax.shard_map`` (see :func:`token_dispatch`).
      tokens_per_expert: int32 ``[E]`` rows per expert (the second result of
        :func:`make_row_id_map`); accepted as TransformerEngine takes it and shape-checked,
        but not needed: which output rows tokens fill is derived from ``row_id_map`` on the
        device, so a count that disagrees with the map cannot leave rows unwritten.
      num_out_rows: static output row count (``num_out_tokens``, plus ``E*(align_size-1)``
        when padded).
      probs: optional ``[T, E]`` bfloat16, float16 or float32; permuted alongside the rows.
      pad_offsets: optional int32 ``[E]``: rows of padding inserted before each expert
        (none negative, none below the one before: checked when concrete, and under
        ``TE_JAX_PERM_CHECKS=1``),
        for the unpadded map of :func:`make_row_id_map`. The map :func:`token_dispatch`
        returns already addresses its padded rows: pass it without ``pad_offsets`` (a
        concrete map that is padded already raises; a traced one is checked under
        ``TE_JAX_PERM_CHECKS=1``). The padded output's experts hold their counts padded up
        to multiples of the alignment, not :func:`make_row_id_map`'s ``tokens_per_expert``:
        a grouped GEMM over it takes the padded counts as its group sizes.
      backend: ``"triton"``, ``"interpret"``, ``"xla"`` or ``None`` (default).

    Returns:
      ``(out [num_out_rows, H] inp.dtype, permuted_probs [num_out_rows] probs.dtype or
      None)``. Output rows that no token fills (padding, unused budget) are zero; map
      entries addressing rows past ``num_out_rows`` are dropped; where several entries
      address one row, the last in token-major order (highest ``t*E + j``) writes it.
    """
    inp, probs, pad, padded, num_out_rows = _permute_args(inp, row_id_map, tokens_per_expert, num_out_rows, probs,
                                                          pad_offsets)
    return _permute(inp, probs, row_id_map, pad, num_out_rows, padded, backend)


def _combine_inputs(inp, row_id_map, merging_probs, rows: str, batched: bool):
    """Checked ``(inp [rows, H], merging_probs [T, E] or None, E)`` of a combine, ``E`` and
    ``T`` from ``row_id_map``; ``batched`` also takes ``[B, S, E]`` weights (flattened)."""
    inp = _checks.array("inp", inp)
    _checks.check_rank("inp", inp, (2,), f"[{rows}, H]")
    _checks.check_token_dtype("inp", inp)
    e = _checks.num_experts_of_map(row_id_map)
    t = row_id_map.shape[0]
    if merging_probs is not None:
        merging_probs = _checks.array("merging_probs", merging_probs)
        if batched:
            merging_probs = _checks.flatten_rows("merging_probs", merging_probs, "T", "E")
        _checks.check_shape("merging_probs", merging_probs, (t, e), f"[T={t}, E={e}] (from row_id_map)")
        _checks.check_probs_dtype("merging_probs", merging_probs)
    return inp, merging_probs, e


def _unpermute_args(inp, row_id_map, merging_probs, pad_offsets, tokens_per_expert):
    """Checked arguments of :func:`unpermute_with_mask_map`: ``(inp, merging_probs, pad, padded)``,
    arrays taken as token_combine takes them (lists too)."""
    inp, merging_probs, e = _combine_inputs(inp, row_id_map, merging_probs, "N", batched=False)
    if tokens_per_expert is not None:
        _per_expert("tokens_per_expert", tokens_per_expert, e)
    return inp, merging_probs, pad_operand(pad_offsets, e, row_id_map), pad_offsets is not None


@_checks.keyword_only
def unpermute_with_mask_map(inp: jax.Array, row_id_map: jax.Array, merging_probs: jax.Array | None = None,
                            pad_offsets: jax.Array | None = None, tokens_per_expert: jax.Array | None = None,
                            *, backend: str | None = None) -> jax.Array:
    """Gathers each token's expert rows and sums them (weighted by ``merging_probs``).

    Args:
      inp: ``[N, H]`` expert-sorted rows (as produced by :func:`permute_with_mask_map`).
      row_id_map: int32 ``[T, 2E+1]``, read as addressing rows of the whole ``inp``, as
        for :func:`permute_with_mask_map` (a token-sharded :func:`token_dispatch`'s map
        only inside ``jax.shard_map``).
      merging_probs: optional ``[T, E]`` weights (bfloat16, float16 or float32; their
        gradient comes back in their dtype); unweighted sum when ``None``.
      pad_offsets: int32 ``[E]`` when ``inp`` is padded and ``row_id_map`` is the unpadded
        map of :func:`make_row_id_map`; padding rows are ignored. Non-negative and non-decreasing, as for
        :func:`permute_with_mask_map`. :func:`token_dispatch`'s
        map already addresses the padded rows: pass it without ``pad_offsets`` (as for
        :func:`permute_with_mask_map`).
      tokens_per_expert: optional int32 ``[E]``; accepted as TransformerEngine takes it and
        shape-checked, but not needed (the backward derives its row layout from the map).
      backend: as for :func:`permute_with_mask_map`.

    Returns:
      ``[T, H]`` in ``inp.dtype``, accumulated in float32. Map entries addressing rows
      ``inp`` does not have contribute nothing (no kernel reads past ``inp``). Differentiated,
      the forward also keeps an int32 ``[N]`` table of each row's writing entry for the
      backward (as :func:`token_combine`).
    """
    inp, merging_probs, pad, padded = _unpermute_args(inp, row_id_map, merging_probs, pad_offsets, tokens_per_expert)
    return _unpermute(inp, merging_probs, row_id_map, pad, padded, backend)


def pad_operand(pad_offsets, e, row_id_map):
    """The lower-level ops' ``pad`` operand: the checked ``pad_offsets``, or
    :func:`unread_pad` when there are none. The ops add it to ``row_id_map``'s destinations,
    so a map that is padded already is refused (concrete, or traced in the checked mode)."""
    if pad_offsets is None:
        return unread_pad(e)
    pad_offsets = _per_expert("pad_offsets", pad_offsets, e)
    _checks.check_values(_checks.pad_offsets_problem, pad_offsets)
    pad = jnp.asarray(pad_offsets).astype(jnp.int32)
    _checks.check_values(_checks.padded_twice_problem, row_id_map, pad)
    return pad


# -- TransformerEngine-compatible dispatch and combine ------------------------------------

def dispatch_rows(num_out_tokens: int, num_experts: int, align_size: int | None) -> tuple[int | None, int]:
    """``(align_size, rows)``: the checked static ``align_size`` (``None`` unpadded) and the
    rows of the dispatch buffer; raises, naming both arguments, when the rows would not
    have int32 indices.

    Padded, the rows are the worst case (every expert ``align_size - 1`` rows of padding,
    :func:`padded_extent`) rounded down to a multiple of ``align_size``, as
    TransformerEngine: padded counts are multiples of ``align_size`` summing to at most
    that worst case, so the rounding never cuts a used row."""
    if align_size is None:
        return None, num_out_tokens
    align_size = _checks.check_static_int("align_size", align_size, 1)
    # The padded layout before it is rounded down: the rows the map's int32 arithmetic
    # reaches, which the buffer's row count alone can understate.
    extent = padded_extent(num_out_tokens, num_experts, align_size)
    if extent > _checks.INT32_MAX:
        raise ValueError(f"align_size = {align_size} with num_out_tokens = {num_out_tokens} and E = {num_experts} "
                         f"pads up to {extent} rows; expected at most 2**31 - 1 rows (row indices are int32): choose "
                         "a smaller align_size")
    return align_size, extent // align_size * align_size


def local_budget(num_out_tokens: int, shards: int, rows: int, num_experts: int, align_size: int | None) -> int:
    """Row budget of one of ``shards`` token shards whose buffer holds ``rows`` rows, whatever
    the routing.

    ``num_out_tokens`` is divided across the shards; padded, the budget is also capped so
    that the shard's padded layout (at most ``budget + E*(align_size-1)`` rows, a multiple
    of ``align_size``) always fits its rows. Unsharded the cap never binds."""
    budget = num_out_tokens // shards
    if align_size is None:
        return min(budget, rows)
    fits = (rows // align_size + 1) * align_size - 1 - num_experts * (align_size - 1)
    return max(0, min(budget, fits))


def fitting_budget(routing_map: jax.Array, budget: int, align_size: int, rows: int) -> jax.Array:
    """The row budget (int32, traced) this routing's padded layout fits into ``rows`` rows:
    the longest prefix of the expert-major order (experts ascending, tokens in order), at
    most ``budget`` rows, whose experts padded to multiples of ``align_size`` fit. Where
    :func:`local_budget`'s worst case binds, this keeps every row the routing leaves room for."""
    totals = routed(routing_map).sum(0, dtype=jnp.int32)
    start = jnp.cumsum(totals) - totals                                  # unpadded, expert-major
    kept = kept_of(totals, budget)
    padded = padded_counts_of(kept, align_size)
    padded_start = jnp.cumsum(padded) - padded
    # Cut inside expert e (every earlier one whole): as many aligned rows as still fit. An
    # expert starting past the budget (nothing kept) stands for the whole budget.
    room = jnp.clip((rows - padded_start) // align_size * align_size, 0, None)
    fits = jnp.max(jnp.where(padded_start <= rows, start + jnp.minimum(kept, room), 0))
    return jnp.minimum(fits, budget).astype(jnp.int32)


def _dispatch_local(tokens, num_out_tokens, align_size, rows, backend):
    """The dispatch forward of one token shard: ``(x, rm, probs, pad) -> (out, pp, rid, kept)``
    (``pp`` None without ``probs``), ``kept`` the shard's kept rows per expert (summed over
    the shards by the caller).

    ``tokens`` and ``rows`` are the global sizes; the shard's local ``x`` says how many
    shards there are."""
    def run(x, rm, probs, pad):
        shards = shard_count(tokens, x.shape[0])
        e, local_rows = rm.shape[1], rows // shards
        budget = local_budget(num_out_tokens, shards, local_rows, e, align_size)
        if align_size is not None and budget < min(num_out_tokens // shards, local_rows):
            # The worst case binds: keep what this routing's padded layout has room for.
            budget = fitting_budget(rm, min(num_out_tokens // shards, local_rows), align_size, local_rows)
        rid, kept, owner = dispatch_map(rm, budget, align_size or 1, local_rows, backend)
        (out, pp), _ = permute_fwd(x, probs, rid, pad, local_rows, False, backend, owner)
        return out, pp, rid, kept
    return run


def _dispatch_bwd_local(backend):
    """``(g_out, g_pp, rid, pad) -> (g_x, g_probs)``: the gather of the dispatch backward."""
    return lambda g_out, g_pp, rid, pad: permute_grads(g_out, g_pp, rid, pad, False, backend)


def _unread_pad_of(rid):
    # An operand of the per-shard call, not made inside it: a partitioned body cannot close
    # over a constant.
    return unread_pad((rid.shape[1] - 1) // 2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _dispatch(x, rm, probs, num_out_tokens, align_size, rows, backend):
    return _dispatch_fwd(x, rm, probs, num_out_tokens, align_size, rows, backend)[0]


def _dispatch_fwd(x, rm, probs, num_out_tokens, align_size, rows, backend):
    out, pp, rid, kept = split_over_tokens(
        "token_dispatch", _dispatch_local(x.shape[0], num_out_tokens, align_size, rows, backend),
        (x, rm, probs, unread_pad(rm.shape[1])), (("T", "H"), ("T", "E"), ("T", "E"), ("E",)),
        (("R", "H"), ("R",), ("T", "W"), ("E",)), backend, summed={3: None})
    return (out, pp, rid, kept), (rid, witness(x), witness(probs))


def _dispatch_bwd(num_out_tokens, align_size, rows, backend, res, cts):
    rid, x, probs = res
    g_out, g_pp, _, _ = cts
    g_x, g_probs = split_over_tokens("token_dispatch (backward)", _dispatch_bwd_local(backend),
                                     (g_out, g_pp, rid, _unread_pad_of(rid)),
                                     (("R", "H"), ("R",), ("T", "W"), ("E",)), (("T", "H"), ("T", "E")), backend)
    return like_primal(g_x, x), None, like_primal(g_probs, probs)


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


def _combine_local(backend, with_owner):
    """``(inp, rid, w, pad) -> (out, owner)``: each token's rows summed (weighted by ``w``
    when given), and ``with_owner`` the rows' owners for the backward (else None)."""
    def run(inp, rid, w, pad):
        if with_owner:
            out, res = unpermute_fwd(inp, w, rid, pad, False, backend)
            return out, res[-1]
        return unpermute_rows(inp, w, rid, pad, False, backend), None
    return run


def _combine_bwd_local(backend):
    """``(g, rid, inp, owner, w, pad) -> (g_inp, g_w)``: the scatter of the combine backward."""
    return lambda g, rid, inp, owner, w, pad: unpermute_grads(g, inp, w, rid, pad, owner, False, backend)


def _combine_call(inp, w, rid, backend, with_owner):
    return split_over_tokens("token_combine", _combine_local(backend, with_owner),
                             (inp, rid, w, _unread_pad_of(rid)), (("R", "H"), ("T", "W"), ("T", "E"), ("E",)),
                             (("T", "H"), ("R",)), backend)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _combine(inp, w, rid, backend):
    return _combine_call(inp, w, rid, backend, False)[0]


def _combine_fwd(inp, w, rid, backend):
    out, owner = _combine_call(inp, w, rid, backend, True)
    return out, (inp, w, rid, owner)


def _combine_bwd(backend, res, g):
    inp, w, rid, owner = res
    # The merging probabilities' gradient is a dot product over all of a row's hidden
    # elements: with them the hidden axis is not local (named "D": gathered where it is
    # split, as the kernel's own rule does), else each hidden slice would return its
    # partial sum as the whole gradient.
    h = "H" if w is None else "D"
    g_inp, g_w = split_over_tokens("token_combine (backward)", _combine_bwd_local(backend),
                                   (g, rid, inp, owner, w, _unread_pad_of(rid)),
                                   (("T", h), ("T", "W"), ("R", h), ("R",), ("T", "E"), ("E",)),
                                   (("R", h), ("T", "E")), backend)
    return like_primal(g_inp, inp), like_primal(g_w, w), None


_combine.defvjp(_combine_fwd, _combine_bwd)


@_checks.keyword_only
def token_dispatch(inp: jax.Array, routing_map: jax.Array, num_out_tokens: int,
                   probs: jax.Array | None = None, align_size: int | None = None, *,
                   backend: str | None = None):
    """Dispatches tokens to experts.

    Args:
      inp: ``[T, H]`` or ``[B, S, H]`` tokens (bf16, fp16, fp32, fp8 e4m3; moved bit-exactly).
      routing_map: ``[T, E]`` or ``[B, S, E]``, bool or integer 0/1.
      num_out_tokens: static number of output rows before padding, usually ``T * k``.
        Routed rows whose expert-sorted position is ``>= num_out_tokens`` are dropped
        (deterministically: the tail of the highest experts). Rows beyond the routed count
        are zero.
      probs: optional ``[T, E]`` (or ``[B, S, E]``) routing probabilities, bfloat16,
        float16 or float32.
      align_size: optional static int; pads each expert's rows with zero rows up to a
        multiple of it. The output then has ``((num_out_tokens + E*(align_size-1)) //
        align_size) * align_size`` rows; ``num_out_tokens + E*(align_size-1)``, the rows
        before that rounding, must stay below ``2**31`` (int32 row indices).
      backend: ``"triton"``, ``"interpret"``, ``"xla"`` or ``None`` (default).

    Returns:
      ``(output, permuted_probs, row_id_map, pad_offsets, tokens_per_expert)``:
      ``output [R, H]`` in ``inp.dtype``; ``permuted_probs [R]`` in ``probs.dtype`` or
      ``None``; ``row_id_map`` int32 ``[T, 2E+1]`` addressing rows of ``output`` (padding
      included); ``pad_offsets`` int32 ``[E]`` (``None`` without ``align_size``);
      ``tokens_per_expert`` int32 ``[E]`` rows per expert (kept rows, padded up when
      ``align_size`` is given).

    Sharding: with ``inp`` sharded over tokens under ``jit``, each shard dispatches its own
    tokens (as TransformerEngine's does): ``output`` holds one expert-grouped block per
    shard, and ``tokens_per_expert`` counts the kept rows of every shard (a sum across
    them); with ``align_size``, that sum padded up once, as TransformerEngine pads it (so
    it and ``pad_offsets`` describe the unsharded layout, not the rows of ``output``,
    where each shard pads its own rows). Padded, a shard whose padded layout would not fit its ``rows / shards`` keeps the
    longest run of its rows in expert-major order that fits; the rest drop. The
    rows as a whole are then not grouped by expert, so a grouped GEMM must not take them
    with these counts: run dispatch, the expert GEMMs and the combine per shard inside
    ``jax.shard_map`` (each shard then gets its own counts), or use the expert-parallel
    layer. The same holds for ``row_id_map``: it addresses each shard's rows within that
    shard's block, which :func:`token_combine` reads per shard, but
    :func:`permute_with_mask_map` and :func:`unpermute_with_mask_map` read as addressing
    the whole ``output`` (rows of every shard but the first would move to and from the
    first shard's rows); pass it to them only inside ``jax.shard_map``.
    """
    inp = _checks.array("inp", inp)
    routing_map = _checks.routing_map_array("routing_map", routing_map)
    x = _checks.flatten_rows("inp", inp, "T", "H")
    _checks.check_token_dtype("inp", inp)
    rm = _checks.routing_rows(routing_map, "inp", inp)
    num_out_tokens = _checks.check_static_int("num_out_tokens", num_out_tokens, 0)
    e = rm.shape[1]
    if probs is not None:
        probs = _checks.probs_like_map(probs, routing_map)
    align_size, rows = dispatch_rows(num_out_tokens, e, align_size)
    # kept: rows per expert of the whole output (summed over token shards when sharded).
    out, permuted_probs, row_id_map, kept = _dispatch(x, rm, probs, num_out_tokens, align_size, rows,
                                                      resolve_backend(backend))
    if align_size is None:
        return out, permuted_probs, row_id_map, None, kept
    return out, permuted_probs, row_id_map, pad_offsets_of(kept, align_size), padded_counts_of(kept, align_size)


@_checks.keyword_only
def token_combine(inp: jax.Array, row_id_map: jax.Array, merging_probs: jax.Array | None = None,
                  pad_offsets: jax.Array | None = None, *, backend: str | None = None) -> jax.Array:
    """Combines expert rows back into tokens.

    Args:
      inp: ``[R, H]`` expert rows, laid out as :func:`token_dispatch` produced them.
      row_id_map: int32 ``[T, 2E+1]`` from :func:`token_dispatch`. Under a multi-device
        ``jit`` with the tokens sharded the combine runs per token shard and reads each
        shard's entries as addressing rows of its own block of ``inp``, as the dispatch
        wrote them; a map built on whole arrays (:func:`make_row_id_map`'s, or an unsharded
        dispatch's) would read the wrong rows there: combine it with
        :func:`unpermute_with_mask_map`.
      merging_probs: optional ``[T, E]`` (or ``[B, S, E]``) weights, bfloat16, float16 or
        float32; their gradient comes back in their dtype.
      pad_offsets: the ``pad_offsets`` from :func:`token_dispatch` when it padded. Only
        its shape and dtype (int ``[E]``) are checked, and, with a concrete map (a traced
        one under ``TE_JAX_PERM_CHECKS=1``), that the map is padded where it pads an expert
        with rows (``pad_offsets`` beside an unpadded map raises); its values are not read:
        the map already addresses the padded rows, so leaving it out after a padded dispatch
        is fine. Rows that :func:`permute_with_mask_map` padded through ``pad_offsets`` from
        :func:`make_row_id_map`'s unpadded map come back with
        :func:`unpermute_with_mask_map` and the same ``pad_offsets``; here an unchecked
        traced unpadded map would read unpadded rows.
      backend: as for :func:`token_dispatch`.

    Returns:
      ``[T, H]`` in ``inp.dtype``: each token's expert rows summed (fp32 accumulation),
      weighted by ``merging_probs`` when given. Dropped rows contribute nothing. A concrete
      map addressing rows ``inp`` does not have raises; a traced one is checked only under
      ``TE_JAX_PERM_CHECKS=1`` and otherwise such entries contribute nothing (no kernel
      reads past ``inp``).

    Differentiated, the forward also keeps an int32 ``[R]`` table for the backward: which
    map entry writes each row of ``inp``'s gradient (rows no entry names get zeros), filled
    by the forward's own kernel from the entries it reads.
    """
    inp, merging_probs, e = _combine_inputs(inp, row_id_map, merging_probs, "R", batched=True)
    if pad_offsets is not None:
        pad_offsets = _per_expert("pad_offsets", pad_offsets, e, " (from row_id_map)")
    _checks.check_values(functools.partial(_checks.row_id_map_problem, inp.shape[0]), row_id_map,
                         *(() if pad_offsets is None else (pad_offsets,)))
    return _combine(inp, merging_probs, row_id_map, resolve_backend(backend))
