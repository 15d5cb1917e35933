"""Permute token rows into expert-sorted rows and back, through a row-id map.

``permute_with_mask_map`` / ``unpermute_with_mask_map`` are differentiable (custom VJPs
whose backward passes are the opposite kernel), jit-able and vmap-able. Every launch,
forward and backward, is a declared kernel (:mod:`te_jax_perm.ops.permute_decl`) with
aliased preallocated outputs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_jax_perm.ops import _checks
from te_jax_perm.ops import permute_decl as D
from te_jax_perm.ops._bits import from_bits, to_bits


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
@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _permute(inp, probs, rid, pad, num_out_rows, padded, backend):
    return permute_fwd(inp, probs, rid, pad, num_out_rows, padded, backend)[0]


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
    return (from_bits(out, inp.dtype, (num_out_rows,) + inp.shape[1:]), pout), (rid, pad)


def permute_bwd(num_out_rows, padded, backend, res, cts):
    rid, pad = res
    g_out, g_pout = cts
    if g_pout is not None:
        g_inp, g_probs = D.permute_bwd_probs(g_out, rid, pad, g_pout, backend=backend, padded=padded)
    else:
        (g_inp,), g_probs = D.unpermute(g_out, rid, pad, backend=backend, padded=padded), None
    return g_inp, g_probs, None, None


_permute.defvjp(permute_fwd, permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _unpermute(inp, merging_probs, rid, pad, padded, backend):
    return unpermute_fwd(inp, merging_probs, rid, pad, padded, backend)[0]


def unpermute_fwd(inp, merging_probs, rid, pad, padded, backend):
    if merging_probs is None:
        (out,) = D.unpermute(inp, rid, pad, backend=backend, padded=padded)
    else:
        (out,) = D.unpermute_weighted(inp, rid, pad, merging_probs, backend=backend, padded=padded)
    return out, (inp, merging_probs, rid, pad)


def unpermute_bwd(padded, backend, res, g):
    inp, merging_probs, rid, pad = res
    if merging_probs is None:
        g_inp, _ = permute_fwd(g.astype(inp.dtype), None, rid, pad, inp.shape[0], padded, backend)[0]
        g_w = None
    else:
        owner = _owners(rid, pad, inp.shape[0], padded, backend)
        g_inp, g_w = D.unpermute_bwd_weighted(g, rid, pad, owner, merging_probs, inp, backend=backend,
                                              padded=padded)
    return g_inp, g_w, None, None


_unpermute.defvjp(unpermute_fwd, unpermute_bwd)


# -- public API ------------------------------------------------------------------------------
def _permute_args(inp, row_id_map, tokens_per_expert, num_out_rows, probs, pad_offsets):
    """Checked arguments of :func:`permute_with_mask_map`: ``(pad, padded, num_out_rows)``."""
    _checks.check_rank("inp", inp, (2,), "[T, H]")
    _checks.check_token_dtype("inp", inp)
    e = _checks.num_experts_of_map(row_id_map)
    _checks.check_shape("row_id_map", row_id_map, (inp.shape[0], 2 * e + 1),
                        f"[T={inp.shape[0]}, 2E+1] (T from inp {tuple(inp.shape)})")
    _checks.check_shape("tokens_per_expert", tokens_per_expert, (e,), f"[E={e}]")
    _checks.check_index_values("tokens_per_expert", tokens_per_expert)
    num_out_rows = _checks.check_static_int("num_out_rows", num_out_rows, 0)
    if probs is not None:
        _checks.check_shape("probs", probs, (inp.shape[0], e), f"[T={inp.shape[0]}, E={e}]")
        _checks.check_probs_dtype("probs", probs)
    return pad_operand(pad_offsets, e), pad_offsets is not None, num_out_rows


def permute_with_mask_map(inp: jax.Array, row_id_map: jax.Array, tokens_per_expert: jax.Array,
                          num_out_rows: int, probs: jax.Array | None = None,
                          pad_offsets: jax.Array | None = None, backend: str | None = None
                          ) -> tuple[jax.Array, jax.Array | None]:
    """Scatters token rows to expert-sorted rows.

    Args:
      inp: ``[T, H]`` tokens (bf16, fp16, fp32 or fp8 e4m3; copied bit-exactly).
      row_id_map: int32 ``[T, 2E+1]`` from :func:`make_row_id_map`.
      tokens_per_expert: int32 ``[E]`` rows per expert (the second result of
        :func:`make_row_id_map`); accepted as TransformerEngine takes it and shape-checked,
        but not needed: which output rows tokens fill is derived from ``row_id_map`` on the
        device, so a count that disagrees with the map cannot leave rows unwritten.
      num_out_rows: static output row count (``num_out_tokens``, plus ``E*(align_size-1)``
        when padded).
      probs: optional ``[T, E]`` bfloat16, float16 or float32; permuted alongside the rows.
      pad_offsets: optional int32 ``[E]``: rows of padding inserted before each expert.
      backend: ``"triton"``, ``"interpret"``, ``"xla"`` or ``None`` (default).

    Returns:
      ``(out [num_out_rows, H] inp.dtype, permuted_probs [num_out_rows] probs.dtype or
      None)``. Output rows that no token fills (padding, unused budget) are zero; map
      entries addressing rows past ``num_out_rows`` are dropped; where several entries
      address one row, the last in token-major order (highest ``t*E + j``) writes it.
    """
    pad, padded, num_out_rows = _permute_args(inp, row_id_map, tokens_per_expert, num_out_rows, probs, pad_offsets)
    return _permute(inp, probs, row_id_map, pad, num_out_rows, padded, backend)


def _unpermute_args(inp, row_id_map, merging_probs, pad_offsets, tokens_per_expert):
    """Checked arguments of :func:`unpermute_with_mask_map`: ``(pad, padded)``."""
    _checks.check_rank("inp", inp, (2,), "[N, H]")
    _checks.check_token_dtype("inp", inp)
    e = _checks.num_experts_of_map(row_id_map)
    t = row_id_map.shape[0]
    if merging_probs is not None:
        _checks.check_shape("merging_probs", merging_probs, (t, e), f"[T={t}, E={e}] (from row_id_map)")
        _checks.check_probs_dtype("merging_probs", merging_probs)
    if tokens_per_expert is not None:
        _checks.check_shape("tokens_per_expert", tokens_per_expert, (e,), f"[E={e}]")
        _checks.check_index_values("tokens_per_expert", tokens_per_expert)
    return pad_operand(pad_offsets, e), pad_offsets is not None


def unpermute_with_mask_map(inp: jax.Array, row_id_map: jax.Array, merging_probs: jax.Array | None = None,
                            pad_offsets: jax.Array | None = None, tokens_per_expert: jax.Array | None = None,
                            backend: str | None = None) -> jax.Array:
    """Gathers each token's expert rows and sums them (weighted by ``merging_probs``).

    Args:
      inp: ``[N, H]`` expert-sorted rows (as produced by :func:`permute_with_mask_map`).
      row_id_map: int32 ``[T, 2E+1]``.
      merging_probs: optional ``[T, E]`` weights (bfloat16, float16 or float32; their
        gradient comes back in their dtype); unweighted sum when ``None``.
      pad_offsets: int32 ``[E]`` when ``inp`` is padded; padding rows are ignored.
      tokens_per_expert: optional int32 ``[E]``; accepted as TransformerEngine takes it and
        shape-checked, but not needed (the backward derives its row layout from the map).
      backend: as for :func:`permute_with_mask_map`.

    Returns:
      ``[T, H]`` in ``inp.dtype``, accumulated in float32. Map entries addressing rows
      ``inp`` does not have contribute nothing (no kernel reads past ``inp``).
    """
    pad, padded = _unpermute_args(inp, row_id_map, merging_probs, pad_offsets, tokens_per_expert)
    return _unpermute(inp, merging_probs, row_id_map, pad, padded, backend)


def pad_operand(pad_offsets, e):
    """The kernels' ``pad`` operand: the checked ``pad_offsets``, or :func:`unread_pad` when
    there are none."""
    if pad_offsets is None:
        return unread_pad(e)
    _checks.check_shape("pad_offsets", pad_offsets, (e,), f"[E={e}]")
    _checks.check_index_values("pad_offsets", pad_offsets)
    return jnp.asarray(pad_offsets).astype(jnp.int32)
