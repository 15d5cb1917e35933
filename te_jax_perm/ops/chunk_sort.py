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

Both directions move rows through one declared kernel whose output is a preallocated,
alias-declared buffer; the backward pass (the inverse sort) is that same kernel, so it can
never be handed the incoming gradient's memory as its output (a row permutation run in
place would overwrite rows it has yet to read).
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare, resolve_backend
from te_jax_perm.core.sharding import Partitioning
from te_jax_perm.kernels.chunk_sort import chunk_sort_map_kernel, sort_rows_kernel, sort_rows_probs_kernel
from te_jax_perm.ops._bits import from_bits, to_bits


def _pow2_bucket(name: str, v: int) -> int:
    del name
    return int(triton.next_power_of_2(max(int(v), 1)))


# --------------------------------------------------------------------------------------
# Row map: int32 [N], output row of each input row or -1.
# --------------------------------------------------------------------------------------
def _map_reference(split_sizes: jax.Array, sorted_indices: jax.Array, *, num_tokens: int):
    n = num_tokens
    sizes = jnp.maximum(split_sizes.astype(jnp.int32), 0)
    cum = jnp.cumsum(sizes)
    incl = jnp.minimum(cum, n)
    excl = jnp.minimum(cum - sizes, n)
    eff = incl - excl
    out_sizes = eff[sorted_indices]
    out_excl = jnp.cumsum(out_sizes) - out_sizes
    dst_start = jnp.zeros_like(sizes).at[sorted_indices].set(out_excl)
    rows = jnp.arange(n, dtype=jnp.int32)
    chunk = jnp.clip(jnp.searchsorted(incl, rows, side="right"), 0, sizes.shape[0] - 1)
    dst = rows - excl[chunk] + dst_start[chunk]
    return (jnp.where(rows < incl[-1], dst, -1).astype(jnp.int32),)


def _map_params_check(dims, params) -> None:
    n = params["num_tokens"]
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"chunk_sort_map: num_tokens must be a non-negative Python int, got {n!r}")
    if dims["C"] < 1:
        raise ValueError("chunk_sort_map: argument 'split_sizes' has shape (0,); expected at least one chunk")
    if dims["C"] > MAX_CHUNKS:
        raise ValueError(f"chunk_sort_map: argument 'split_sizes' has shape ({dims['C']},); at most "
                         f"{MAX_CHUNKS} chunks are supported (the chunk table lives in registers)")


def _map_validate(operands, dims, params) -> None:
    sizes, order = (np.asarray(o) for o in operands)
    c = dims["C"]
    if not np.array_equal(np.sort(order), np.arange(c)):
        raise ValueError(f"chunk_sort_map: argument 'sorted_indices' = {order.tolist()[:16]}"
                         f"{'...' if c > 16 else ''} is not a permutation of range({c})")
    if (sizes < 0).any():
        raise ValueError(f"chunk_sort_map: argument 'split_sizes' has negative entries: {sizes.tolist()[:16]}")
    if int(sizes.astype(np.int64).sum()) > params["num_tokens"]:
        raise ValueError(f"chunk_sort_map: sum(split_sizes) = {int(sizes.sum())} exceeds the number of "
                         f"rows num_tokens = {params['num_tokens']}")


def _np_row_map(sizes: np.ndarray, order: np.ndarray, n: int) -> np.ndarray:
    """Host-side map for valid inputs (autotuning trial operands)."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    row_map = np.full(n, -1, np.int32)
    dst = 0
    for c in order:
        row_map[starts[c]:starts[c] + sizes[c]] = np.arange(dst, dst + sizes[c])
        dst += sizes[c]
    return row_map


def _random_chunks(c: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random split sizes summing to at most n (some chunks empty) and a random order."""
    cuts = np.sort(rng.integers(0, n + 1, size=c - 1)) if c > 1 else np.zeros(0, np.int64)
    edges = np.concatenate([[0], cuts, [n - int(rng.integers(0, max(1, n // 8)))]])
    edges = np.minimum(edges, edges[-1])
    return np.diff(edges).astype(np.int32), rng.permutation(c).astype(np.int32)


def _map_example(dims, params, dtypes, rng) -> tuple[np.ndarray, ...]:
    sizes, order = _random_chunks(dims["C"], params["num_tokens"], rng)
    return sizes.astype(dtypes["split_sizes"]), order.astype(dtypes["sorted_indices"])


# Chunk tables are padded to at least 16 lanes: no size-1 aranges, friendlier layouts.
MIN_LANES = 16
MAX_CHUNKS = 2048


def _chunk_lanes(c: int) -> int:
    return max(MIN_LANES, _pow2_bucket("C", c))


def _map_fits(dims, params, cfg: Config) -> str | None:
    cp = _chunk_lanes(dims["C"])
    kw = cfg.kw
    if kw["BLOCK_N"] * cp > 32768:
        return f"BLOCK_N*next_pow2(C) = {kw['BLOCK_N'] * cp} > 32768 (register tile too large)"
    if kw["BLOCK_C"] * cp > 32768:
        return f"BLOCK_C*next_pow2(C) = {kw['BLOCK_C'] * cp} > 32768 (register tile too large)"
    return None


def _map_default(dims, params) -> Config:
    cp = _chunk_lanes(dims["C"])
    return Config.make(num_warps=4, BLOCK_N=max(16, min(256, 8192 // cp)), BLOCK_C=max(4, min(16, 8192 // cp)))


# The autotuner needs valid operands (a permutation, an in-range row map); older cores
# without the field simply tune on the default.
_HAS_EXAMPLES = "example_inputs" in KernelDecl.__dataclass_fields__


def _examples(fn) -> dict:
    return {"example_inputs": fn} if _HAS_EXAMPLES else {}


MAP_DECL = KernelDecl(
    **_examples(_map_example),
    name="chunk_sort_map",
    kernel=chunk_sort_map_kernel,
    operands=(Operand("split_sizes", ("C",), ("int",)), Operand("sorted_indices", ("C",), ("int",))),
    outputs=(Output("row_id_map", lambda d, p: (p["num_tokens"],), lambda t, p: np.int32),),
    params=("num_tokens",),
    reference=_map_reference,
    grid=lambda d, p, c: (triton.cdiv(p["num_tokens"], c.kw["BLOCK_N"]),),
    scalars=lambda d, p: {"C": d["C"], "N": p["num_tokens"]},
    constexprs=lambda d, p, c: {"C_POW2": _chunk_lanes(d["C"])},
    configs=tuple(Config.make(num_warps=w, BLOCK_N=bn, BLOCK_C=bc)
                  for bn in (16, 32, 64, 128, 256) for bc in (4, 16) for w in (2, 4, 8)),
    constraints=(_map_fits,),
    default_config=_map_default,
    key_dims=("C",),
    key_params=("num_tokens",),
    key_bucket=_pow2_bucket,
    params_check=_map_params_check,
    validate=_map_validate,
)
_chunk_sort_map = declare(MAP_DECL)


# --------------------------------------------------------------------------------------
# Row movement by map, forward (scatter) or inverse (gather), with optional probs.
# --------------------------------------------------------------------------------------
def _move_reference(inp, row_id_map, probs=None, *, is_forward: bool):
    n = inp.shape[0]
    mapped = row_id_map >= 0
    if is_forward:
        # Unmapped rows are exactly [total, N): send them to themselves as zeros.
        dst = jnp.where(mapped, row_id_map, jnp.arange(n, dtype=row_id_map.dtype))
        keep = mapped[:, None]
        out = jnp.zeros_like(inp).at[dst].set(jnp.where(keep, inp, jnp.zeros((), inp.dtype)))
        outs = (out,)
        if probs is not None:
            outs += (jnp.zeros_like(probs).at[dst].set(jnp.where(mapped, probs, jnp.zeros((), probs.dtype))),)
        return outs
    src = jnp.where(mapped, row_id_map, 0)
    outs = (jnp.where(mapped[:, None], inp[src], jnp.zeros((), inp.dtype)),)
    if probs is not None:
        outs += (jnp.where(mapped, probs[src], jnp.zeros((), probs.dtype)),)
    return outs


def _move_fits(dims, params, cfg: Config) -> str | None:
    kw = cfg.kw
    if kw["ROWS"] * kw["BLOCK_H"] > 16384:
        return f"ROWS*BLOCK_H = {kw['ROWS'] * kw['BLOCK_H']} > 16384 (register tile too large)"
    if kw["BLOCK_H"] > max(16, _pow2_bucket("H", dims["H"])):
        return f"BLOCK_H = {kw['BLOCK_H']} wider than next_pow2(H = {dims['H']})"
    return None


def _move_default(dims, params) -> Config:
    block_h = min(max(16, _pow2_bucket("H", dims["H"])), 2048)
    rows = max(1, min(8, 4096 // block_h))
    return Config.make(num_warps=8 if rows * block_h >= 4096 else 4, ROWS=rows, BLOCK_H=block_h)


_MOVE_CONFIGS = tuple(Config.make(num_warps=w, ROWS=r, BLOCK_H=b)
                      for r in (1, 2, 4, 8) for b in (128, 256, 512, 1024, 2048, 4096) for w in (4, 8))


def _move_example(with_probs: bool):
    def make(dims, params, dtypes, rng) -> tuple[np.ndarray, ...]:
        n, h = dims["N"], dims["H"]
        sizes, order = _random_chunks(max(1, min(16, n)), n, rng)
        ops = (rng.standard_normal((n, h)).astype(dtypes["inp"]), _np_row_map(sizes, order, n))
        if with_probs:
            ops += (rng.random(n).astype(dtypes["probs"]),)
        return ops
    return make


def _move_decl(with_probs: bool) -> KernelDecl:
    operands = (Operand("inp", ("N", "H")), Operand("row_id_map", ("N",), ("int32",)))
    outputs = (Output("output", lambda d, p: (d["N"], d["H"]), lambda t, p: t["inp"]),)
    if with_probs:
        operands += (Operand("probs", ("N",), ("float",)),)
        outputs += (Output("permuted_probs", lambda d, p: (d["N"],), lambda t, p: t["probs"]),)
    return KernelDecl(
        **_examples(_move_example(with_probs)),
        name="sort_chunks_probs" if with_probs else "sort_chunks",
        kernel=sort_rows_probs_kernel if with_probs else sort_rows_kernel,
        operands=operands,
        outputs=outputs,
        params=("is_forward",),
        reference=_move_reference,
        grid=lambda d, p, c: (triton.cdiv(d["N"], c.kw["ROWS"]),),
        scalars=lambda d, p: {"N": d["N"]},
        # H is compiled in (vectorised rows; see the kernel); it is a key dim, so each H
        # has its own cache entry and tuning.
        constexprs=lambda d, p, c: {"FORWARD": bool(p["is_forward"]), "H": d["H"]},
        configs=_MOVE_CONFIGS,
        constraints=(_move_fits,),
        default_config=_move_default,
        key_dims=("N", "H"),
        key_params=("is_forward",),
        key_bucket=lambda name, v: _pow2_bucket(name, v) if name == "N" else int(v),  # H is compiled in
        # Rows move whole to other rows (not N-local); each H-slice moves independently.
        partitioning=Partitioning(outputs=(("N", "H"), ("N",))[:len(outputs)], local=("H",)),
    )


MOVE_DECL = _move_decl(False)
MOVE_PROBS_DECL = _move_decl(True)
_move = declare(MOVE_DECL)
_move_probs = declare(MOVE_PROBS_DECL)


def _apply(inp, row_id_map, probs, is_forward: bool, backend: str):
    x = to_bits(inp)
    if probs is None:
        (out,) = _move(x, row_id_map, backend=backend, is_forward=is_forward)
        return from_bits(out, inp.dtype), None
    out, pout = _move_probs(x, row_id_map, probs, backend=backend, is_forward=is_forward)
    return from_bits(out, inp.dtype), pout


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
def _check_inputs(inp: jax.Array, probs: jax.Array | None, where: str) -> None:
    if inp.ndim != 2:
        raise ValueError(f"{where}: argument 'inp' has shape {tuple(inp.shape)}; expected rank 2 [N, H]")
    if probs is not None:
        if tuple(probs.shape) != (inp.shape[0],):
            raise ValueError(f"{where}: argument 'probs' has shape {tuple(probs.shape)}; expected "
                             f"({inp.shape[0]},) (one probability per row of 'inp')")
        if not jnp.issubdtype(probs.dtype, jnp.floating):
            raise TypeError(f"{where}: argument 'probs' has dtype {probs.dtype}; expected a float dtype")


def _as_index_vector(x: Any, name: str, where: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"{where}: argument {name!r} has shape {tuple(x.shape)}; expected rank 1 [C]")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{where}: argument {name!r} has dtype {x.dtype}; expected an integer dtype")
    return x.astype(jnp.int32)


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
    where = "make_chunk_sort_map"
    split_sizes = _as_index_vector(split_sizes, "split_sizes", where)
    sorted_indices = _as_index_vector(sorted_indices, "sorted_indices", where)
    if split_sizes.shape != sorted_indices.shape:
        raise ValueError(f"{where}: argument 'sorted_indices' has shape {tuple(sorted_indices.shape)}; "
                         f"expected {tuple(split_sizes.shape)} (one entry per chunk of 'split_sizes')")
    (row_map,) = _chunk_sort_map(split_sizes, sorted_indices, backend=backend, num_tokens=int(num_tokens))
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
    where = "sort_chunks_by_map"
    inp = jnp.asarray(inp)
    probs = None if probs is None else jnp.asarray(probs)
    _check_inputs(inp, probs, where)
    row_id_map = jnp.asarray(row_id_map)
    if tuple(row_id_map.shape) != (inp.shape[0],) or row_id_map.dtype != jnp.int32:
        raise ValueError(f"{where}: argument 'row_id_map' has shape {tuple(row_id_map.shape)} dtype "
                         f"{row_id_map.dtype}; expected ({inp.shape[0]},) int32")
    return _sort_by_map(inp, row_id_map, probs, bool(is_forward), resolve_backend(backend))


def sort_chunks_by_index(inp: jax.Array, split_sizes: jax.Array, sorted_indices: jax.Array,
                         probs: jax.Array | None = None, backend: str | None = None
                         ) -> tuple[jax.Array, jax.Array | None, jax.Array]:
    """Reorders contiguous chunks of rows: output chunk ``j`` = input chunk ``sorted_indices[j]``.

    Args:
      inp: [N, H], any dtype; rows grouped in chunks of ``split_sizes`` rows from row 0.
      split_sizes: int [C], may be traced (no host sync); ``sum <= N``.
      sorted_indices: int [C], a permutation of ``range(C)``.
      probs: optional float [N], moved with the rows.
      backend: ``"triton"``, ``"interpret"`` or ``"xla"``; ``None`` picks the default.

    Returns:
      ``(output [N, H], permuted_probs [N] or None, row_id_map int32 [N])``. Rows beyond
      ``sum(split_sizes)`` are zero in the output. Pass ``row_id_map`` to
      :func:`sort_chunks_by_map` with ``is_forward=False`` to undo the sort. Gradients flow
      to ``inp`` and ``probs`` (the inverse sort); none to the sizes or indices.
    """
    where = "sort_chunks_by_index"
    inp = jnp.asarray(inp)
    probs = None if probs is None else jnp.asarray(probs)
    _check_inputs(inp, probs, where)
    chosen = resolve_backend(backend)
    row_map = make_chunk_sort_map(split_sizes, sorted_indices, inp.shape[0], backend=chosen)
    out, permuted_probs = _sort_by_map(inp, row_map, probs, True, chosen)
    return out, permuted_probs, row_map
