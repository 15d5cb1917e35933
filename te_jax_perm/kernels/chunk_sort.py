"""Triton kernels for chunk sorting: the row maps build and the row gather.

Maps (shared with :mod:`te_jax_perm.ops.chunk_sort`), both int32 ``[N]``: ``row_map[i]`` is
the output row of input row ``i`` and ``src_map[j]`` the input row of output row ``j``, each
``-1`` where there is none; on mapped rows they are inverse to each other. Rows move by
gathering (output row ``j`` reads ``src_map[j]``, or is zero): every output element is
written exactly once, by the program that owns its row, whatever the maps hold.
"""
import triton
import triton.language as tl


@triton.jit
def chunk_sort_map_kernel(split_ptr, sorted_ptr, C, N, map_prealloc_ptr, src_prealloc_ptr, map_ptr, src_ptr,
                          C_POW2: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Each program maps BLOCK_N rows both ways; chunk bookkeeping is recomputed per
    program (C is small). A chunk is placed at the first position of the sorted order that
    names it; later positions naming it, and positions naming no chunk, are empty."""
    pid = tl.program_id(0)
    c = tl.arange(0, C_POW2)
    # Sizes summed in int64: C sizes of up to 2**31-1 cannot overflow it, so chunks are
    # truncated where the input ends (destinations never leave [0, N)) whatever the sizes.
    sizes = tl.maximum(tl.load(split_ptr + c, mask=c < C, other=0).to(tl.int64), 0)
    cum = tl.cumsum(sizes, axis=0)
    incl = tl.minimum(cum, N).to(tl.int32)
    excl = tl.minimum(cum - sizes, N).to(tl.int32)
    eff = incl - excl
    # Output start + 1 of every placed chunk (0: not placed yet): walk the sorted order in
    # tiles, carrying the running sum. One lookup per position gives both its size and
    # whether an earlier tile placed its chunk already (-1).
    start1 = tl.zeros([C_POW2], dtype=tl.int32)
    carry = tl.sum(tl.zeros([BLOCK_C], dtype=tl.int32), axis=0)
    b = tl.arange(0, BLOCK_C)
    for j0 in range(0, C, BLOCK_C):
        j = j0 + b
        sj = tl.load(sorted_ptr + j, mask=j < C, other=-1).to(tl.int32)
        hit = sj[:, None] == c[None, :]
        size_j = tl.sum(tl.where(hit, tl.where(start1 > 0, -1, eff)[None, :], 0), axis=1)
        repeat = tl.sum(((b[None, :] < b[:, None]) & (sj[None, :] == sj[:, None])).to(tl.int32), axis=1) > 0
        first = (size_j >= 0) & (sj >= 0) & (sj < C) & ~repeat
        size_j = tl.where(first, size_j, 0)
        excl_j = carry + tl.cumsum(size_j, axis=0) - size_j
        start1 += tl.sum(tl.where(hit & first[:, None], excl_j[:, None] + 1, 0), axis=0)
        carry += tl.sum(size_j, axis=0)
    placed = start1 > 0
    start = start1 - 1
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    # Input row -> output row: the placed chunk holding the row.
    inside = (excl[None, :] <= rows[:, None]) & (rows[:, None] < incl[None, :]) & placed[None, :]
    dst = tl.where(tl.sum(inside.to(tl.int32), axis=1) > 0,
                   rows + tl.sum(tl.where(inside, (start - excl)[None, :], 0), axis=1), -1)
    tl.store(map_ptr + rows, dst, mask=rows < N)
    # Output row -> input row: the placed chunk whose output range holds the row.
    inside = (start[None, :] <= rows[:, None]) & (rows[:, None] < (start + eff)[None, :]) & placed[None, :]
    src = tl.where(tl.sum(inside.to(tl.int32), axis=1) > 0,
                   rows + tl.sum(tl.where(inside, (excl - start)[None, :], 0), axis=1), -1)
    tl.store(src_ptr + rows, src, mask=rows < N)


@triton.jit
def _gather_rows(inp_ptr, map_ptr, probs_ptr, N, out_ptr, probs_out_ptr, H: tl.constexpr,
                 HAS_PROBS: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Output row i = input row map[i], or zeros when map[i] is outside [0, N).

    ROWS rows per program, BLOCK_H columns per step; int64 offsets (N*H may pass 2**31).
    H is a compile-time constant: only a known H lets Triton prove the column masks and
    row starts 16-byte aligned and emit vector loads/stores (checked in the PTX: v4.b32
    vs b16) whatever H is; a runtime H would be known divisible by 16 at best."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = rows < N
    src = tl.load(map_ptr + rows, mask=in_range, other=-1)
    mapped = in_range & (src >= 0) & (src < N)
    src64 = tl.where(mapped, src, 0).to(tl.int64)
    dst64 = rows.to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        cmask = cols < H
        x = tl.load(inp_ptr + src64[:, None] * H + cols[None, :], mask=mapped[:, None] & cmask[None, :], other=0)
        tl.store(out_ptr + dst64[:, None] * H + cols[None, :], x, mask=in_range[:, None] & cmask[None, :])
    if HAS_PROBS:
        p = tl.load(probs_ptr + src64, mask=mapped, other=0)
        tl.store(probs_out_ptr + dst64, p, mask=in_range)


@triton.jit
def sort_chunks_kernel(inp_ptr, map_ptr, N, out_prealloc_ptr, out_ptr, H: tl.constexpr,
                       ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    _gather_rows(inp_ptr, map_ptr, map_ptr, N, out_ptr, out_ptr, H, False, ROWS, BLOCK_H)


@triton.jit
def sort_chunks_probs_kernel(inp_ptr, map_ptr, probs_ptr, N, out_prealloc_ptr, probs_prealloc_ptr,
                             out_ptr, probs_out_ptr, H: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    _gather_rows(inp_ptr, map_ptr, probs_ptr, N, out_ptr, probs_out_ptr, H, True, ROWS, BLOCK_H)
