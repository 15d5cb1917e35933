"""Kernel declarations of chunk sorting: the plan, the row maps built from it, and the row
gather by a map.

Map convention: int32 ``[N]`` each, ``row_id_map`` the output row of each input row and
``src_map`` the input row of each output row, ``-1`` where there is none (see
:mod:`te_jax_perm.kernels.chunk_sort`). Their references are in
:mod:`te_jax_perm.ops.chunk_sort.reference`; the public API and VJP rules in
:mod:`te_jax_perm.ops.chunk_sort.api`.
"""
from __future__ import annotations

import numpy as np

from te_jax_perm.core import Config, KernelDecl, Operand, Output, Partitioning, declare
from te_jax_perm.kernels import chunk_sort as K
from te_jax_perm.ops.chunk_sort.reference import (chunk_maps_reference, chunk_sort_map_reference,
                                                  chunk_sort_plan_reference, gather_rows_reference)
from te_jax_perm.ops.tiling import lanes, pow2_bucket, tile_too_large
from te_jax_perm.ops.tuned_defaults import tabled

MAX_CHUNKS = 2048


def _map_params_check(dims, params) -> None:
    n = params["num_tokens"]
    if not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"num_tokens must be a non-negative Python int, got {n!r}")
    if dims["C"] < 1:
        raise ValueError("split_sizes has shape (0,); expected at least one chunk")
    if dims["C"] > MAX_CHUNKS:
        raise ValueError(f"split_sizes has shape ({dims['C']},); at most "
                         f"{MAX_CHUNKS} chunks are supported (the chunk table lives in registers)")


def _map_validate(operands, dims, params) -> None:
    sizes, order = (np.asarray(o) for o in operands)
    c = dims["C"]
    if not np.array_equal(np.sort(order), np.arange(c)):
        raise ValueError(f"sorted_indices = {order.tolist()[:16]}"
                         f"{'...' if c > 16 else ''} is not a permutation of range({c})")
    if (sizes < 0).any():
        raise ValueError(f"split_sizes has negative entries: {sizes.tolist()[:16]}; expected sizes >= 0")
    if int(sizes.astype(np.int64).sum()) > params["num_tokens"]:
        raise ValueError(f"sum(split_sizes) = {int(sizes.astype(np.int64).sum())} exceeds the "
                         f"{params['num_tokens']} rows being sorted (inp's rows, or make_chunk_sort_map's "
                         "num_tokens)")


def _random_chunks(c: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random split sizes summing to at most n (some chunks empty) and a random order."""
    cuts = np.sort(rng.integers(0, n + 1, size=c - 1)) if c > 1 else np.zeros(0, np.int64)
    edges = np.concatenate([[0], cuts, [n - int(rng.integers(0, max(1, n // 8)))]])
    edges = np.minimum(edges, edges[-1])
    return np.diff(edges).astype(np.int32), rng.permutation(c).astype(np.int32)


def _map_example(dims, params, dtypes, rng) -> tuple[np.ndarray, ...]:
    sizes, order = _random_chunks(dims["C"], params["num_tokens"], rng)
    return sizes.astype(dtypes["split_sizes"]), order.astype(dtypes["sorted_indices"])


def _search_steps(c: int) -> int:
    """Binary-search rounds over C sorted values: ceil(log2(C + 1))."""
    return max(1, int(c).bit_length())


chunk_sort_plan = declare(KernelDecl(
    name="chunk_sort_plan",
    kernel=K.chunk_sort_plan_kernel,
    example_inputs=_map_example,
    operands=(Operand("split_sizes", ("C",), ("int",)), Operand("sorted_indices", ("C",), ("int",))),
    # Zeros: the first-position scratch row is reduced into with atomic max.
    outputs=(Output("plan", lambda dims, params: (K.PLAN_ROWS, dims["C"]), lambda dtypes, params: np.int32,
                    init="zeros"),),
    params=("num_tokens",),
    reference=chunk_sort_plan_reference,
    grid=lambda dims, params, config: (1,),
    scalars=lambda dims, params: {"C": dims["C"], "N": params["num_tokens"]},
    constexprs=lambda dims, params, config: {"C_POW2": lanes(dims["C"])},
    configs=tuple(Config.make(num_warps=w) for w in (1, 2, 4, 8)),
    # One program over C lanes: a warp per 512 of them.
    default_config=lambda dims, params: Config.make(num_warps=max(1, min(8, lanes(dims["C"]) // 512))),
    key_dims=("C",),
    key_params=("num_tokens",),
    key_bucket=pow2_bucket("C"),
    params_check=_map_params_check,
    validate=_map_validate,
))


def _map_plan_check(dims, params) -> None:
    if dims["P"] != K.PLAN_ROWS:
        raise ValueError(f"chunk_sort_map: argument 'plan' has {dims['P']} rows; expected {K.PLAN_ROWS}")
    _map_params_check(dims, params)


chunk_sort_map = declare(KernelDecl(
    name="chunk_sort_map",
    kernel=K.chunk_sort_map_kernel,
    example_inputs=lambda dims, params, dtypes, rng: chunk_sort_plan_reference(
        *_map_example({"C": dims["C"]}, params, {"split_sizes": np.int32, "sorted_indices": np.int32}, rng),
        num_tokens=params["num_tokens"], xp=np),
    operands=(Operand("plan", ("P", "C"), ("int32",)),),
    outputs=tuple(Output(name, lambda dims, params: (params["num_tokens"],), lambda dtypes, params: np.int32)
                  for name in ("row_id_map", "src_map")),
    params=("num_tokens",),
    reference=chunk_sort_map_reference,
    grid=lambda dims, params, config: (-(-params["num_tokens"] // config.kw["BLOCK_N"]),),
    scalars=lambda dims, params: {"C": dims["C"], "N": params["num_tokens"]},
    constexprs=lambda dims, params, config: {"STEPS": _search_steps(dims["C"])},
    configs=tuple(Config.make(num_warps=w, BLOCK_N=bn) for bn in (128, 256, 512, 1024, 2048) for w in (1, 2, 4, 8)),
    # Rows are independent binary searches over the (L2-resident) plan: ~4 rows per thread.
    default_config=lambda dims, params: Config.make(num_warps=4, BLOCK_N=512),
    key_dims=("C",),
    key_params=("num_tokens",),
    key_bucket=pow2_bucket("C"),
    params_check=_map_plan_check,
))


def chunk_maps(split_sizes, sorted_indices, *, num_tokens: int, backend: str | None = None,
               config: Config | None = None):
    """``(row_id_map, src_map)`` int32 ``[num_tokens]`` each: the plan, then the maps
    (``config`` for the maps kernel)."""
    (plan,) = chunk_sort_plan(split_sizes, sorted_indices, backend=backend, num_tokens=num_tokens)
    return chunk_sort_map(plan, backend=backend, config=config, num_tokens=num_tokens)


# -- the row movers: a gather by a source map, with optional probs ------------------------
def _move_fits(dims, params, config: Config) -> str | None:
    kw = config.kw
    too_wide = kw["BLOCK_H"] > lanes(dims["H"])
    return tile_too_large(kw["ROWS"], kw["BLOCK_H"]) or (
        f"BLOCK_H = {kw['BLOCK_H']} wider than lanes(H = {dims['H']}) = {lanes(dims['H'])}" if too_wide else None)


_MOVE_CONSTRAINTS = (_move_fits,)


def _move_programs(dims, config) -> int:
    """The row mover's programs: one per ROWS rows, each walking the whole row."""
    return -(-dims["N"] // config.kw["ROWS"])


def _move_default(dims, params) -> Config:
    # 4096-column tiles: rows wider than 2048 move as one token per program in as few column
    # steps as fit (on the H100, 1-3% faster at H = 2880-7168 than two 2048-column rows; on
    # an H200 at H = 2880, 1-2% slower: a device that differs gets table entries).
    block_h = min(lanes(dims["H"]), 4096)
    rows = max(1, min(8, 4096 // block_h))
    return Config.make(num_warps=8 if rows * block_h >= 4096 else 4, ROWS=rows, BLOCK_H=block_h)


_MOVE_CONFIGS = tuple(Config.make(num_warps=w, ROWS=r, BLOCK_H=b)
                      for r in (1, 2, 4, 8) for b in (128, 256, 512, 1024, 2048, 4096) for w in (4, 8))


def _move_example(with_probs: bool):
    def make(dims, params, dtypes, rng) -> tuple[np.ndarray, ...]:
        n, h = dims["N"], dims["H"]
        sizes, order = _random_chunks(max(1, min(16, n)), n, rng)
        _, src_map = chunk_maps_reference(sizes, order, num_tokens=n, xp=np)
        ops = (rng.standard_normal((n, h)).astype(dtypes["inp"]), src_map)
        if with_probs:
            ops += (rng.random(n).astype(dtypes["probs"]),)
        return ops
    return make


def _move_decl(with_probs: bool):
    operands = (Operand("inp", ("N", "H")), Operand("src_map", ("N",), ("int32",)))
    outputs = (Output("output", lambda dims, params: (dims["N"], dims["H"]), lambda dtypes, params: dtypes["inp"]),)
    if with_probs:
        operands += (Operand("probs", ("N",), ("float",)),)
        outputs += (Output("permuted_probs", lambda dims, params: (dims["N"],),
                           lambda dtypes, params: dtypes["probs"]),)
    return declare(KernelDecl(
        example_inputs=_move_example(with_probs),
        name="sort_chunks_probs" if with_probs else "sort_chunks",
        kernel=K.sort_chunks_probs_kernel if with_probs else K.sort_chunks_kernel,
        operands=operands,
        outputs=outputs,
        reference=gather_rows_reference,
        grid=lambda dims, params, config: (_move_programs(dims, config),),
        scalars=lambda dims, params: {"N": dims["N"]},
        # H is compiled in (vectorised rows; see the kernel); it is a key dim, so each H
        # has its own cache entry and tuning.
        constexprs=lambda dims, params, config: {"H": dims["H"]},
        configs=_MOVE_CONFIGS,
        constraints=_MOVE_CONSTRAINTS,
        # Both kernels read the swept one's entries: the same row mover, the probs one
        # element a row more.
        default_config=tabled("sort_chunks_probs", _move_default, "N", _MOVE_CONSTRAINTS, _move_programs),
        key_dims=("N", "H"),
        key_bucket=pow2_bucket("N"),
        # Rows move whole to other rows (not N-local); each H-slice moves independently.
        partitioning=Partitioning(outputs=(("N", "H"), ("N",))[:len(outputs)], local=("H",)),
    ))


sort_chunks = _move_decl(False)
sort_chunks_probs = _move_decl(True)
