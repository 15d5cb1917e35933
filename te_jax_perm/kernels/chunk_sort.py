"""Triton kernels for chunk sorting: the row map build and the row permutation.

Row-map convention (shared with :mod:`te_jax_perm.ops.chunk_sort`): ``row_map[i]`` is the
output row of input row ``i``, or ``-1`` when row ``i`` lies beyond the (clipped) sum of
the split sizes. Mapped destinations always lie in ``[0, total)`` and unmapped rows are
exactly ``[total, N)``, so a program that finds ``row_map[i] < 0`` owns output row ``i``
and zero-fills it: every output element is written exactly once, no memset needed.
"""
import triton
import triton.language as tl


@triton.jit
def chunk_sort_map_kernel(split_ptr, sorted_ptr, C, N, map_prealloc_ptr, map_ptr,
                          C_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Each program maps BLOCK_N rows; chunk bookkeeping is recomputed per program (C is small)."""
    pid = tl.program_id(0)
    c = tl.arange(0, C_POW2)
    # Sizes summed in int64: C sizes of up to 2**31-1 cannot overflow it, so chunks are
    # truncated where the input ends (destinations never leave [0, N)) whatever the sizes.
    sizes = tl.maximum(tl.load(split_ptr + c, mask=c < C, other=0).to(tl.int64), 0)
    cum = tl.cumsum(sizes, axis=0)
    incl = tl.minimum(cum, N).to(tl.int32)
    excl = tl.minimum(cum - sizes, N).to(tl.int32)
    eff = incl - excl
    # Output start of every chunk: walk the sorted order in tiles, carrying the running sum.
    dst_start = tl.zeros([C_POW2], dtype=tl.int32)
    carry = tl.sum(tl.zeros([BLOCK_C], dtype=tl.int32), axis=0)
    for j0 in range(0, C, BLOCK_C):
        j = j0 + tl.arange(0, BLOCK_C)
        sj = tl.load(sorted_ptr + j, mask=j < C, other=-1).to(tl.int32)
        hit = sj[:, None] == c[None, :]
        size_j = tl.sum(tl.where(hit, eff[None, :], 0), axis=1)
        excl_j = carry + tl.cumsum(size_j, axis=0) - size_j
        dst_start += tl.sum(tl.where(hit, excl_j[:, None], 0), axis=0)
        carry += tl.sum(size_j, axis=0)
    delta = dst_start - excl
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (excl[None, :] <= rows[:, None]) & (rows[:, None] < incl[None, :])
    shift = tl.sum(tl.where(inside, delta[None, :], 0), axis=1)
    found = tl.sum(inside.to(tl.int32), axis=1) > 0
    dst = tl.where(found, rows + shift, -1)
    tl.store(map_ptr + rows, dst, mask=rows < N)


@triton.jit
def _move_rows(inp_ptr, map_ptr, probs_ptr, N, out_ptr, probs_out_ptr, H: tl.constexpr,
               FORWARD: tl.constexpr, HAS_PROBS: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """ROWS rows per program, BLOCK_H columns per step; int64 offsets (N*H may pass 2**31).

    H is a compile-time constant: only a known H lets Triton prove the column masks and
    row starts 16-byte aligned and emit vector loads/stores (checked in the PTX: v4.b32
    vs b16) whatever H is; a runtime H would be known divisible by 16 at best."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = rows < N
    target = tl.load(map_ptr + rows, mask=in_range, other=-1)
    # Entries outside [0, N) count as unmapped: no map moves a row outside the buffers.
    mapped = (target >= 0) & (target < N)
    if FORWARD:
        # Scatter: row i goes to target[i]; unmapped rows zero-fill their own slot.
        src = rows
        dst = tl.where(mapped, target, rows)
    else:
        # Gather: output row i comes from target[i]; unmapped rows are zero.
        src = tl.where(mapped, target, 0)
        dst = rows
    src64 = src.to(tl.int64)
    dst64 = dst.to(tl.int64)
    load_rows = in_range & mapped
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cmask = cols < H
        x = tl.load(inp_ptr + src64[:, None] * H + cols[None, :],
                    mask=load_rows[:, None] & cmask[None, :], other=0)
        tl.store(out_ptr + dst64[:, None] * H + cols[None, :], x, mask=in_range[:, None] & cmask[None, :])
    if HAS_PROBS:
        p = tl.load(probs_ptr + src64, mask=load_rows, other=0)
        tl.store(probs_out_ptr + dst64, p, mask=in_range)


@triton.jit
def sort_chunks_kernel(inp_ptr, map_ptr, N, out_prealloc_ptr, out_ptr, H: tl.constexpr,
                     FORWARD: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    _move_rows(inp_ptr, map_ptr, map_ptr, N, out_ptr, out_ptr, H, FORWARD, False, ROWS, BLOCK_H)


@triton.jit
def sort_chunks_probs_kernel(inp_ptr, map_ptr, probs_ptr, N, out_prealloc_ptr, probs_prealloc_ptr,
                           out_ptr, probs_out_ptr, H: tl.constexpr,
                           FORWARD: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    _move_rows(inp_ptr, map_ptr, probs_ptr, N, out_ptr, probs_out_ptr, H, FORWARD, True, ROWS, BLOCK_H)
