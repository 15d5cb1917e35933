"""Chunk sorting: reorder contiguous chunks of rows, e.g. the expert-parallel regrouping.

After an expert-parallel all-to-all, rows arrive grouped by (source rank, local expert);
:func:`sort_chunks_by_index` reorders them to (local expert, source rank) and back.

Semantics, for ``inp`` of shape ``[N, H]`` split into chunks of ``split_sizes[c]`` rows:

* output chunk ``j`` is input chunk ``sorted_indices[j]``, chunks packed from row 0;
* rows beyond the placed chunks are zero in the output; an input row that no output row
  takes has ``row_id_map`` entry ``-1`` and receives zero gradient;
* ``split_sizes`` and ``sorted_indices`` may be traced. When concrete, the sizes must be
  non-negative with ``sum <= N`` and ``sorted_indices`` a permutation of ``range(C)``
  (checked at trace time). Traced values are never trusted: negative sizes count as 0 and
  chunks are truncated where the input ends; an index outside ``[0, C)``, or one that
  repeats an earlier index, places nothing (an empty output chunk), so a chunk no valid
  index names is dropped like the rows past ``sum(split_sizes)``. Dropping, rather than
  guessing where a chunk was meant to go, makes a bad order show up as zero rows and zero
  gradients, the same way every other dropped row of this library does, and keeps each
  output row the copy of at most one input row.

Rows move by one declared gather kernel (:mod:`te_jax_perm.ops.chunk_sort.decl`) whose
output is a preallocated, alias-declared buffer: output row ``j`` reads input row
``src_map[j]`` or is zero, so every output element is written exactly once, by the program
owning its row, for any map. The map kernel builds both directions (``row_id_map`` and its
inverse ``src_map``) from the chunk table, with no extra pass over the rows; the backward
pass is the same gather by the other map, so it can never be handed the incoming
gradient's memory as its output.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from te_jax_perm.core import resolve_backend
from te_jax_perm.core.manual_axes import like_primal, witness
from te_jax_perm import _checks
from te_jax_perm.ops._bits import from_bits, to_bits
from te_jax_perm.ops.chunk_sort import decl as D
from te_jax_perm.ops.chunk_sort.reference import checked_chunks, checked_rows


def _gather(inp, src_map, probs, backend: str, name: str):
    """Row ``j`` of the result = ``inp[src_map[j]]``, with ``probs`` where given; ``name``:
    the public op, named where a second differentiation is refused (:func:`first_order`)."""
    def gather(inp, src_map, probs):
        x = to_bits(inp)
        if probs is None:
            (out,) = D.sort_chunks(x, src_map, backend=backend)
            return from_bits(out, inp.dtype, inp.shape), None
        out, pout = D.sort_chunks_probs(x, src_map, probs, backend=backend)
        return from_bits(out, inp.dtype, inp.shape), pout
    return _checks.first_order(name, gather)(inp, src_map, probs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _move(inp, src_map, dst_map, probs, backend: str, name: str):
    """Output row ``j`` = ``inp[src_map[j]]``; ``dst_map`` is ``src_map``'s inverse."""
    return _gather(inp, src_map, probs, backend, name)


def _move_fwd(inp, src_map, dst_map, probs, backend, name):
    return _gather(inp, src_map, probs, backend, name), (dst_map, witness(inp), witness(probs))


def _move_bwd(backend, name, res, cotangents):
    dst_map, inp, probs = res
    # Gradient rows go back through the inverse map: the same aliased gather, a fresh
    # preallocated output, never the incoming gradient buffer.
    g_out, g_probs = cotangents
    g_inp, g_p = _gather(g_out, dst_map, g_probs, backend, name)
    return like_primal(g_inp, inp), None, None, like_primal(g_p, probs)


_move.defvjp(_move_fwd, _move_bwd)


def _one_to_one(row_id_map):
    """``(dst, src)``: ``row_id_map`` with entries outside ``[0, N)`` and all but the first
    row naming each output row set to ``-1``, and its inverse."""
    n = row_id_map.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32)
    ok = (row_id_map >= 0) & (row_id_map < n)
    target = jnp.where(ok, row_id_map, n)
    first = jnp.full((n + 1,), n, jnp.int32).at[target].min(rows)[:n]
    dst = jnp.where(ok & (first[jnp.clip(target, 0, max(n - 1, 0))] == rows), row_id_map, -1)
    return dst, jnp.where(first < n, first, -1)


# -- public API ------------------------------------------------------------------------------
def _one_to_one_problem(row_id_map: np.ndarray) -> str | None:
    n = row_id_map.shape[0]
    bad = row_id_map[(row_id_map < -1) | (row_id_map >= n)]
    if bad.size:
        return (f"row_id_map has entries {sorted(set(bad.tolist()))[:8]} outside [-1, N={n}); expected a chunk-sort "
                "map from make_chunk_sort_map")
    values, counts = np.unique(row_id_map[row_id_map >= 0], return_counts=True)
    if (counts > 1).any():
        return (f"row_id_map names output rows {values[counts > 1].tolist()[:8]} more than once; expected each "
                "output row at most once, as in a map from make_chunk_sort_map")
    return None


@_checks.keyword_only
def make_chunk_sort_map(split_sizes: jax.Array, sorted_indices: jax.Array, num_tokens: int,
                        *, backend: str | None = None) -> jax.Array:
    """Row map of a chunk sort, built on device.

    Args:
      split_sizes: int [C], rows per input chunk (may be traced).
      sorted_indices: int [C], output chunk ``j`` is input chunk ``sorted_indices[j]``.
      num_tokens: static row count N of the tensors the map will sort.
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; ``None`` picks the default.

    Returns:
      int32 [N]: the output row of each input row, ``-1`` for rows no output row takes:
      those beyond ``sum(split_sizes)``, and those of a chunk that a traced
      ``sorted_indices`` does not validly name (an index outside ``[0, C)``, or one that
      repeats an earlier index, places nothing).
    """
    return _maps(split_sizes, sorted_indices, num_tokens, backend)[0]


def _maps(split_sizes, sorted_indices, num_tokens, backend):
    split_sizes, sorted_indices = checked_chunks(split_sizes, sorted_indices)
    num_tokens = _checks.check_static_int("num_tokens", num_tokens, 0)
    return D.chunk_maps(split_sizes, sorted_indices, backend=backend, num_tokens=num_tokens)


@_checks.keyword_only
def sort_chunks_by_map(inp: jax.Array, row_id_map: jax.Array, probs: jax.Array | None = None,
                       is_forward: bool = True, *, backend: str | None = None
                       ) -> tuple[jax.Array, jax.Array | None]:
    """Applies a chunk-sort row map (from :func:`make_chunk_sort_map`) or its inverse.

    Args:
      inp: [N, H], any dtype.
      row_id_map: int32 [N] from :func:`make_chunk_sort_map` for the same N: entries in
        ``[-1, N)``, no output row named twice (checked when concrete, and under
        ``TE_JAX_PERM_CHECKS=1``). Otherwise, an entry outside ``[0, N)``, and each entry
        naming the same output row as an earlier entry, counts as ``-1``.
      probs: optional bfloat16, float16 or float32 [N], moved with the rows.
      is_forward: static bool; ``True`` sorts (row ``i`` goes to ``row_id_map[i]``); ``False``
        undoes it (output row ``i`` is input row ``row_id_map[i]``).
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; ``None`` picks the default.

    Returns:
      ``(output [N, H], permuted_probs [N] or None)``; rows nothing moves to are zero.
      Differentiable in ``inp`` and ``probs``.
    """
    inp, probs = checked_rows(inp, probs)
    # Checked as given: jnp.asarray would wrap int64 entries to int32, and under jit make a
    # NumPy map a tracer whose entries go unchecked. A NumPy (or list) map may be any integer
    # dtype whose entries fit int32; an array map must be int32.
    row_id_map = _checks.array_like("row_id_map", row_id_map)
    _checks.check_shape("row_id_map", row_id_map, (inp.shape[0],), f"({inp.shape[0]},) int32")
    if isinstance(row_id_map, np.ndarray):
        _checks.check_index_values("row_id_map", row_id_map)
        row_id_map = row_id_map.astype(np.int32)
    _checks.check_int32("row_id_map", row_id_map)
    _checks.check_values(_one_to_one_problem, row_id_map)
    is_forward = _checks.check_static_bool("is_forward", is_forward)
    dst, src = _one_to_one(jnp.asarray(row_id_map))
    backend = resolve_backend(backend)
    name = "sort_chunks_by_map"
    return _move(inp, src, dst, probs, backend, name) if is_forward else _move(inp, dst, src, probs, backend, name)


@_checks.keyword_only
def sort_chunks_by_index(inp: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array, *,
                         backend: str | None = None) -> tuple[jax.Array, jax.Array]:
    """Reorders contiguous chunks of rows: output chunk ``j`` = input chunk ``sorted_indices[j]``.

    Args:
      inp: ``[N, H]`` or ``[B, S, H]`` (flattened to ``N = B*S`` rows), any dtype; rows
        grouped in chunks of ``split_sizes`` rows from row 0.
      split_sizes: int [C] with C >= 1 (no chunks raise a ValueError), may be traced (no host
        sync); ``sum <= N``.
      sorted_indices: int [C], a permutation of ``range(C)`` (checked when concrete; a
        traced index outside ``[0, C)``, or one that repeats an earlier index, places
        nothing, so a chunk no valid index names is dropped: zero rows, zero gradient).
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; ``None`` picks the default.

    Returns:
      ``(output [N, H], row_id_map int32 [N])``. Rows beyond ``sum(split_sizes)`` are zero
      in the output. Pass ``row_id_map`` to :func:`sort_chunks_by_map` with
      ``is_forward=False`` to undo the sort. Gradients flow to ``inp`` (the inverse sort);
      none to the sizes or indices. :func:`sort_chunks_by_index_with_probs` also moves
      per-row probabilities.
    """
    out, _, row_map = _sort_chunks(inp, split_sizes, sorted_indices, None, backend, "sort_chunks_by_index")
    return out, row_map


@_checks.keyword_only
def sort_chunks_by_index_with_probs(inp: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array,
                                    probs: jax.Array, *, backend: str | None = None
                                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:func:`sort_chunks_by_index` moving ``probs [N]`` (bfloat16, float16 or float32) with the rows.

    Returns:
      ``(output [N, H], permuted_probs [N] in probs.dtype, row_id_map int32 [N])``;
      differentiable in ``inp`` and ``probs``.
    """
    if probs is None:
        # None would take sort_chunks_by_index's path and hand back None as permuted_probs.
        raise TypeError("probs is None; expected float [N] probabilities, one per row of inp (sort_chunks_by_index "
                        "sorts without them)")
    return _sort_chunks(inp, split_sizes, sorted_indices, probs, backend, "sort_chunks_by_index_with_probs")


def _sort_chunks(inp, split_sizes, sorted_indices, probs, backend, name):
    inp, probs = checked_rows(_checks.flatten_rows("inp", _checks.array("inp", inp), "N", "H"), probs)
    chosen = resolve_backend(backend)
    row_map, src_map = _maps(split_sizes, sorted_indices, inp.shape[0], chosen)
    out, permuted_probs = _move(inp, src_map, row_map, probs, chosen, name)
    return out, permuted_probs, row_map
