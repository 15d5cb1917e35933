"""Triton kernels for chunk sorting: the row maps build and the row gather.

Maps (shared with :mod:`te_jax_perm.ops.chunk_sort`), both int32 ``[N]``: ``row_map[i]`` is
the output row of input row ``i`` and ``src_map[j]`` the input row of output row ``j``, each
``-1`` where there is none; on mapped rows they are inverse to each other. Rows move by
gathering (output row ``j`` reads ``src_map[j]``, or is zero): every output element is
written exactly once, by the program that owns its row, whatever the maps hold.
"""
import triton
import triton.language as tl


# Rows of the chunk-sort plan ([PLAN_ROWS, C] int32): per chunk c, its rows' end in the
# input (incl), the shift of its rows to the output and whether it is placed; per position
# p of the sorted order, the end of its rows in the output (out_incl) and the shift back
# to the input; then scratch the plan kernel fills and reads back (first position naming
# each chunk, as C - p; each chunk's size and start; each position's output start).
(INCL, DST_SHIFT, PLACED, OUT_INCL, SRC_SHIFT, FIRST, EFF, EXCL,
 OUT_EXCL) = (tl.constexpr(i) for i in range(9))
PLAN_ROWS = 9


@triton.jit
def chunk_sort_plan_kernel(split_ptr, sorted_ptr, C, N, plan_prealloc_ptr, plan_ptr, C_POW2: tl.constexpr):
    """One program: the whole plan in O(C) vector steps, gathering through its own scratch
    rows (a barrier between writing and reading them). A chunk is placed at the first
    position of the sorted order that names it; later positions naming it, and positions
    naming no chunk, are empty."""
    c = tl.arange(0, C_POW2)
    cm = c < C
    # Sizes summed in int64: C sizes of up to 2**31-1 cannot overflow it, so chunks are
    # truncated where the input ends (destinations never leave [0, N)) whatever the sizes.
    sizes = tl.maximum(tl.load(split_ptr + c, mask=cm, other=0).to(tl.int64), 0)
    cum = tl.cumsum(sizes, axis=0)
    incl = tl.minimum(cum, N).to(tl.int32)
    excl = tl.minimum(cum - sizes, N).to(tl.int32)
    tl.store(plan_ptr + EFF * C + c, incl - excl, mask=cm)
    tl.store(plan_ptr + EXCL * C + c, excl, mask=cm)
    s = tl.load(sorted_ptr + c, mask=cm, other=-1)
    named = cm & (s >= 0) & (s < C)
    at = tl.where(named, s, 0).to(tl.int32)
    # The earliest position naming each chunk wins (max of C - p; the row starts at zero).
    tl.atomic_max(plan_ptr + FIRST * C + at, C - c, mask=named)
    tl.debug_barrier()
    first = named & (C - tl.load(plan_ptr + FIRST * C + at, mask=named, other=0) == c)
    size_at = tl.where(first, tl.load(plan_ptr + EFF * C + at, mask=first, other=0), 0)
    out_incl = tl.cumsum(size_at, axis=0)
    out_excl = out_incl - size_at
    tl.store(plan_ptr + OUT_EXCL * C + c, out_excl, mask=cm)
    tl.store(plan_ptr + OUT_INCL * C + c, out_incl, mask=cm)
    src_shift = tl.where(first, tl.load(plan_ptr + EXCL * C + at, mask=first, other=0) - out_excl, 0)
    tl.store(plan_ptr + SRC_SHIFT * C + c, src_shift, mask=cm)
    tl.debug_barrier()
    code = tl.load(plan_ptr + FIRST * C + c, mask=cm, other=0)
    placed = cm & (code > 0)
    start = tl.load(plan_ptr + OUT_EXCL * C + tl.where(placed, C - code, 0), mask=placed, other=0)
    tl.store(plan_ptr + INCL * C + c, incl, mask=cm)
    tl.store(plan_ptr + DST_SHIFT * C + c, tl.where(placed, start - excl, 0), mask=cm)
    tl.store(plan_ptr + PLACED * C + c, placed.to(tl.int32), mask=cm)


@triton.jit
def _count_at_most(row_ptr, C, x, STEPS: tl.constexpr):
    """How many of the C non-decreasing values at ``row_ptr`` are <= each ``x``: a binary
    search of STEPS >= log2(C + 1) rounds; every load is inside [0, C)."""
    lo = tl.zeros_like(x)
    hi = tl.zeros_like(x) + C
    for _ in tl.static_range(STEPS):
        active = lo < hi
        mid = (lo + hi) // 2
        v = tl.load(row_ptr + mid, mask=active, other=0)
        le = active & (v <= x)
        lo = tl.where(le, mid + 1, lo)
        hi = tl.where(active & ~le, mid, hi)
    return lo


@triton.jit
def chunk_sort_map_kernel(plan_ptr, C, N, map_prealloc_ptr, src_prealloc_ptr, map_ptr, src_ptr,
                          STEPS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Each program maps BLOCK_N rows both ways from the plan: input row -> its chunk ->
    output row, and output row -> its position of the sorted order -> input row."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = rows < N
    chunk = tl.minimum(_count_at_most(plan_ptr + INCL * C, C, rows, STEPS), C - 1)
    total = tl.load(plan_ptr + INCL * C + C - 1)
    mapped = rm & (rows < total) & (tl.load(plan_ptr + PLACED * C + chunk, mask=rm, other=0) > 0)
    dst = tl.where(mapped, rows + tl.load(plan_ptr + DST_SHIFT * C + chunk, mask=mapped, other=0), -1)
    tl.store(map_ptr + rows, dst, mask=rm)
    pos = tl.minimum(_count_at_most(plan_ptr + OUT_INCL * C, C, rows, STEPS), C - 1)
    filled = rm & (rows < tl.load(plan_ptr + OUT_INCL * C + C - 1))
    src = tl.where(filled, rows + tl.load(plan_ptr + SRC_SHIFT * C + pos, mask=filled, other=0), -1)
    tl.store(src_ptr + rows, src, mask=rm)


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
