"""Chunk sorting: reorder contiguous chunks of rows, e.g. the expert-parallel regrouping.

After an expert-parallel all-to-all, rows arrive grouped by (source rank, local expert);
:func:`sort_chunks_by_index` reorders them to (local expert, source rank) and back.

Semantics, for ``inp`` of shape ``[N, H]`` split into chunks of ``split_sizes[c]`` rows:

* output chunk ``j`` is input chunk ``sorted_indices[j]``, chunks packed from row 0;
* rows beyond ``total = sum(split_sizes)`` are zero in the output (and receive zero
  gradient); their ``row_id_map`` entry is ``-1``;
* ``split_sizes`` may be traced. When it is concrete it must be non-negative with
  ``total <= N`` and ``sorted_indices`` must be a permutation of ``range(C)`` (checked, at
  trace time). When traced, negative sizes count as 0 and chunks are truncated where the
  input ends (rows past ``N`` do not exist); a traced ``sorted_indices`` that is not a
  permutation gives undefined results.

Both directions move rows through one declared kernel (:mod:`te_jax_perm.ops.chunk_sort_decl`)
whose output is a preallocated, alias-declared buffer; the backward pass (the inverse sort)
is that same kernel, so it can never be handed the incoming gradient's memory as its output.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from te_jax_perm.core import resolve_backend
from te_jax_perm.ops import _checks
from te_jax_perm.ops import chunk_sort_decl as D
from te_jax_perm.ops._bits import from_bits, to_bits


def _apply(inp, row_id_map, probs, is_forward: bool, backend: str):
    x = to_bits(inp)
    if probs is None:
        (out,) = D.sort_chunks(x, row_id_map, backend=backend, is_forward=is_forward)
        return from_bits(out, inp.dtype, inp.shape), None
    out, pout = D.sort_chunks_probs(x, row_id_map, probs, backend=backend, is_forward=is_forward)
    return from_bits(out, inp.dtype, inp.shape), pout


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _sort_by_map(inp, row_id_map, probs, is_forward: bool, backend: str):
    return _apply(inp, row_id_map, probs, is_forward, backend)


def _sort_by_map_fwd(inp, row_id_map, probs, is_forward, backend):
    return _apply(inp, row_id_map, probs, is_forward, backend), row_id_map


def _sort_by_map_bwd(is_forward, backend, row_id_map, cotangents):
    # The inverse sort, through the same aliased kernel: a fresh preallocated output,
    # never the incoming gradient buffer.
    g_out, g_probs = cotangents
    g_inp, g_p = _apply(g_out, row_id_map, g_probs, not is_forward, backend)
    return g_inp, None, g_p


_sort_by_map.defvjp(_sort_by_map_fwd, _sort_by_map_bwd)


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------
def _rows_and_probs(inp, probs):
    inp = jnp.asarray(inp)
    _checks.check_rank("inp", inp, (2,), "[N, H]")
    if probs is not None:
        probs = jnp.asarray(probs)
        _checks.check_shape("probs", probs, (inp.shape[0],), f"({inp.shape[0]},) (one probability per row of inp)")
        _checks.check_float("probs", probs)
    return inp, probs


def _chunks(split_sizes, sorted_indices):
    split_sizes = _checks.index_vector("split_sizes", split_sizes)
    sorted_indices = _checks.index_vector("sorted_indices", sorted_indices)
    _checks.check_shape("sorted_indices", sorted_indices, split_sizes.shape,
                        f"{tuple(split_sizes.shape)} (one entry per chunk of split_sizes)")
    return split_sizes, sorted_indices


def make_chunk_sort_map(split_sizes: jax.Array, sorted_indices: jax.Array, num_tokens: int,
                        backend: str | None = None) -> jax.Array:
    """Row map of a chunk sort, built on device.

    Args:
      split_sizes: int [C], rows per input chunk (may be traced).
      sorted_indices: int [C], output chunk ``j`` is input chunk ``sorted_indices[j]``.
      num_tokens: static row count N of the tensors the map will sort.
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; ``None`` picks the default.

    Returns:
      int32 [N]: the output row of each input row, ``-1`` for rows beyond ``sum(split_sizes)``.
    """
    split_sizes, sorted_indices = _chunks(split_sizes, sorted_indices)
    (row_map,) = D.chunk_sort_map(split_sizes, sorted_indices, backend=backend, num_tokens=int(num_tokens))
    return row_map


def sort_chunks_by_map(inp: jax.Array, row_id_map: jax.Array, probs: jax.Array | None = None,
                       is_forward: bool = True, backend: str | None = None
                       ) -> tuple[jax.Array, jax.Array | None]:
    """Applies a chunk-sort row map (from :func:`make_chunk_sort_map`) or its inverse.

    Args:
      inp: [N, H], any dtype.
      row_id_map: int32 [N] from :func:`make_chunk_sort_map` for the same N.
      probs: optional float [N], moved with the rows.
      is_forward: ``True`` sorts (row ``i`` goes to ``row_id_map[i]``); ``False`` undoes it.
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; ``None`` picks the default.

    Returns:
      ``(output [N, H], permuted_probs [N] or None)``; unmapped rows are zero.
      Differentiable in ``inp`` and ``probs``.
    """
    inp, probs = _rows_and_probs(inp, probs)
    row_id_map = jnp.asarray(row_id_map)
    _checks.check_shape("row_id_map", row_id_map, (inp.shape[0],), f"({inp.shape[0]},) int32")
    _checks.check_int32("row_id_map", row_id_map)
    return _sort_by_map(inp, row_id_map, probs, bool(is_forward), resolve_backend(backend))


def sort_chunks_by_index(inp: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array, *,
                         backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Reorders contiguous chunks of rows: output chunk ``j`` = input chunk ``sorted_indices[j]``.

    Args:
      inp: ``[N, H]`` or ``[B, S, H]`` (flattened to ``N = B*S`` rows), any dtype; rows
        grouped in chunks of ``split_sizes`` rows from row 0.
      split_sizes: int [C], may be traced (no host sync); ``sum <= N``.
      sorted_indices: int [C], a permutation of ``range(C)``.
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; ``None`` picks the default.

    Returns:
      ``(output [N, H], row_id_map int32 [N])``. Rows beyond ``sum(split_sizes)`` are zero
      in the output. Pass ``row_id_map`` to :func:`sort_chunks_by_map` with
      ``is_forward=False`` to undo the sort. Gradients flow to ``inp`` (the inverse sort);
      none to the sizes or indices. :func:`sort_chunks_by_index_with_probs` also moves
      per-row probabilities.
    """
    out, _, row_map = _sort_chunks(inp, split_sizes, sorted_indices, None, backend)
    return out, row_map


def sort_chunks_by_index_with_probs(inp: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array,
                                    probs: jax.Array, *, backend: str | None = None
                                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`sort_chunks_by_index` moving float ``probs [N]`` with the rows.

    Returns:
      ``(output [N, H], permuted_probs [N] in probs.dtype, row_id_map int32 [N])``;
      differentiable in ``inp`` and ``probs``.
    """
    return _sort_chunks(inp, split_sizes, sorted_indices, probs, backend)


def _sort_chunks(inp, split_sizes, sorted_indices, probs, backend):
    inp = _flatten_rows(inp)
    inp, probs = _rows_and_probs(inp, probs)
    chosen = resolve_backend(backend)
    row_map = make_chunk_sort_map(split_sizes, sorted_indices, inp.shape[0], backend=chosen)
    out, permuted_probs = _sort_by_map(inp, row_map, probs, True, chosen)
    return out, permuted_probs, row_map


def _flatten_rows(inp):
    inp = jnp.asarray(inp)
    _checks.check_rank("inp", inp, (2, 3), "[N, H] or [B, S, H]")
    return inp.reshape(-1, inp.shape[-1]) if inp.ndim == 3 else inp


def sort_chunks_reference(inp: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array,
                          probs: jax.Array | None = None):
    """:func:`sort_chunks_by_index` (``probs=None``) or :func:`sort_chunks_by_index_with_probs`
    in plain JAX, with their return arity."""
    inp, probs = _rows_and_probs(_flatten_rows(inp), probs)
    split_sizes, sorted_indices = _chunks(split_sizes, sorted_indices)
    (row_map,) = D.chunk_sort_map_reference(split_sizes, sorted_indices, num_tokens=inp.shape[0])
    outs = D.sort_chunks_by_map_reference(inp, row_map, probs, is_forward=True)
    return (outs[0], row_map) if probs is None else (outs[0], outs[1], row_map)
