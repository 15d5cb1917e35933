"""The grouped GEMM's weight gradient for Hopper, warp-specialised (a Gluon kernel).

``out[g] = lhs[rows of g].T @ dout[rows of g]``, as ``grouped_gemm_wgrad_kernel`` computes
it, by ``PROGRAMS`` persistent programs that split into two partitions: one loader warp
streams each block's row slices into a ring of ``STAGES`` shared-memory buffers by tensor
memory access (TMA), and the default partition's warpgroups multiply them with
asynchronous warpgroup MMAs and store each finished ``[BK, BN]`` block by TMA. Loads, MMAs
and stores of consecutive blocks overlap without the compiler's software pipeline, which
with a group's few hundred rows leaves the tensor cores idle at each block's start and end.

Bounds: the row slices' descriptors span ``lhs`` and ``dout``'s ``M`` rows (rows past ``M``
read as zeros). A group's last, partial slice is read at full height and its rows past the
group's end are zeroed in shared memory before the MMA reads them, so no other group's rows
(nor a ``0 * inf`` from them) reach the sum. The output's descriptor spans the ``G * K``
rows of ``[G, K, N]`` seen as one matrix; ``K`` is a multiple of ``BK``, so a block never
crosses into the next group's matrix, and its columns past ``N`` are clipped. Every block
of every group is stored, zeros for an empty group. The declaration checks what this needs
(``ops/grouped_gemm/decl.py``, ``ws_wgrad_fits``).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

# The weight gradient's block order is the pointer kernel's (a Triton function Gluon calls).
from te_jax_perm.kernels.grouped_gemm import wgrad_tile_of

# Names that Triton releases after 3.6 changed: the CTA barrier, and TMA's copies.
_cta_barrier = getattr(gl, "thread_barrier", None) or getattr(gl, "barrier")
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# The loader warp holds a few scalars: the fewest registers a warpgroup may be given, in
# steps of 8, leaving the rest to the MMA warpgroups' accumulator.
LOADER_REGS = gl.constexpr(40)


@gluon.jit
def _barrier_ring(STAGES: gl.constexpr):
    """``(ready, empty)``: one barrier per stage each, counting one arrival a phase (the
    loader's expected bytes; the MMA warps' release)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    return ready, empty


@gluon.jit
def _store_tile(desc, row, col, cs, acc):
    """``acc`` to global memory at ``[row, col]`` by TMA, through ``cs`` once the previous
    tile's store has read it."""
    tma.store_wait(0)
    _cta_barrier()
    cs.store(acc.to(cs.dtype))
    fence_async_shared()  # the TMA store reads shared memory through the async proxy
    _cta_barrier()
    _tma_store(desc, [row, col], cs)


@gluon.jit
def _clamped_sizes(gs_ptr, M, G: gl.constexpr, G_P2: gl.constexpr, WARPS: gl.constexpr):
    """``(idx, sizes)`` over ``G_P2`` lanes: each group's size clamped to ``[0, M]``, in
    int64 (the sizes may add past 2**31); 0 past ``G``."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    idx = gl.arange(0, G_P2, layout=layout)
    sizes = gl.load(gs_ptr + idx, mask=idx < G, other=0).to(gl.int64)
    return idx, gl.minimum(gl.maximum(sizes, 0), M)


@gluon.jit
def _group_rows(gs_ptr, M, g, G: gl.constexpr, G_P2: gl.constexpr, WARPS: gl.constexpr):
    """Group ``g``'s rows ``[start, end)``: the clamped sizes' running sum clamped to ``M``."""
    idx, sizes = _clamped_sizes(gs_ptr, M, G, G_P2, WARPS)
    start = gl.sum(gl.where(idx < g, sizes, 0), 0)
    end = start + gl.sum(gl.where(idx == g, sizes, 0), 0)
    return gl.minimum(start, M).to(gl.int32), gl.minimum(end, M).to(gl.int32)


@gluon.jit
def _loader(x_desc, dy_desc, gs_ptr, M, xs, dys, ready, empty, K: gl.constexpr, N: gl.constexpr,
            G: gl.constexpr, G_P2: gl.constexpr, BK: gl.constexpr, BN: gl.constexpr, BR: gl.constexpr,
            STAGES: gl.constexpr, PROGRAMS: gl.constexpr):
    num_k: gl.constexpr = K // BK
    num_n: gl.constexpr = (N + BN - 1) // BN
    it = 0
    for t in range(gl.program_id(0), G * num_k * num_n, PROGRAMS):
        g, tile_k, tile_n = wgrad_tile_of(t, num_k, num_n)
        r0, r1 = _group_rows(gs_ptr, M, g, G, G_P2, 1)
        for r in range(r0, r1, BR):
            s = it % STAGES
            # A fresh barrier counts as having completed the phase before its first, so
            # the first STAGES waits pass at once.
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + dy_desc.block_type.nbytes)
            _tma_load(x_desc, [r, tile_k * BK], ready.index(s), xs.index(s))
            _tma_load(dy_desc, [r, tile_n * BN], ready.index(s), dys.index(s))
            it += 1


@gluon.jit
def _zero_rows_from(buf, valid, ROWS: gl.constexpr, COLS: gl.constexpr, WARPS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    v = buf.load(layout)
    buf.store(gl.where((rows < valid)[:, None], v, gl.zeros_like(v)))


@gluon.jit
def _mma(out_desc, gs_ptr, M, xs, dys, cs, ready, empty, K: gl.constexpr, N: gl.constexpr, G: gl.constexpr,
         G_P2: gl.constexpr, BK: gl.constexpr, BN: gl.constexpr, BR: gl.constexpr, STAGES: gl.constexpr,
         PROGRAMS: gl.constexpr, WARPS: gl.constexpr):
    num_k: gl.constexpr = K // BK
    num_n: gl.constexpr = (N + BN - 1) // BN
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                          instr_shape=[16, BN, 16])
    it = 0
    for t in range(gl.program_id(0), G * num_k * num_n, PROGRAMS):
        g, tile_k, tile_n = wgrad_tile_of(t, num_k, num_n)
        r0, r1 = _group_rows(gs_ptr, M, g, G, G_P2, WARPS)
        acc = gl.zeros((BK, BN), gl.float32, acc_layout)
        for r in range(r0, r1, BR):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            if r + BR > r1:  # the group's last slice is partial: its rows past the end become zeros
                _zero_rows_from(xs.index(s), r1 - r, BR, BK, WARPS)
                _zero_rows_from(dys.index(s), r1 - r, BR, BN, WARPS)
                fence_async_shared()  # the MMA reads shared memory through the async proxy
                _cta_barrier()
            acc = warpgroup_mma(xs.index(s).permute((1, 0)), dys.index(s), acc, is_async=True)
            # One MMA in flight: the previous slice's is done, so its buffers go back to the loader.
            acc = warpgroup_mma_wait(1, deps=[acc])
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=r > r0)
            it += 1
        acc = warpgroup_mma_wait(0, deps=[acc])
        mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=r1 > r0)
        _store_tile(out_desc, g * K + tile_k * BK, tile_n * BN, cs, acc)
    tma.store_wait(0)


@gluon.jit
def grouped_gemm_wgrad_ws_kernel(lhs_ptr, dout_ptr, group_sizes_ptr, M, out_prealloc_ptr, out_ptr,
                                 K: gl.constexpr, N: gl.constexpr, G: gl.constexpr, G_P2: gl.constexpr,
                                 BK: gl.constexpr, BN: gl.constexpr, BR: gl.constexpr, STAGES: gl.constexpr,
                                 PROGRAMS: gl.constexpr, WARPS: gl.constexpr):
    """out[g] = lhs[rows of g].T @ dout[rows of g], [G, K, N] (see the module docstring).
    ``out_prealloc_ptr`` is ``out``'s preallocated buffer (the same memory)."""
    dtype: gl.constexpr = lhs_ptr.dtype.element_ty
    x_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BR, BK], dtype)
    dy_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BR, BN], dtype)
    out_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BK, BN], dtype)
    x_desc = tma.make_tensor_descriptor(lhs_ptr, shape=[M, K], strides=[K, 1], block_shape=[BR, BK], layout=x_layout)
    dy_desc = tma.make_tensor_descriptor(dout_ptr, shape=[M, N], strides=[N, 1], block_shape=[BR, BN],
                                         layout=dy_layout)
    out_desc = tma.make_tensor_descriptor(out_ptr, shape=[G * K, N], strides=[N, 1], block_shape=[BK, BN],
                                          layout=out_layout)
    xs = gl.allocate_shared_memory(dtype, [STAGES, BR, BK], x_layout)
    dys = gl.allocate_shared_memory(dtype, [STAGES, BR, BN], dy_layout)
    cs = gl.allocate_shared_memory(dtype, [BK, BN], out_layout)
    ready, empty = _barrier_ring(STAGES)
    gl.warp_specialize([
        (_mma, (out_desc, group_sizes_ptr, M, xs, dys, cs, ready, empty, K, N, G, G_P2, BK, BN, BR, STAGES,
                PROGRAMS, WARPS)),
        (_loader, (x_desc, dy_desc, group_sizes_ptr, M, xs, dys, ready, empty, K, N, G, G_P2, BK, BN, BR, STAGES,
                   PROGRAMS)),
    ], [1], [LOADER_REGS])


# -- the forward and the input gradient: row tiles of each group --------------------------------
@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _row_schedule(gs_ptr, M, G: gl.constexpr, G_P2: gl.constexpr, BM: gl.constexpr, WARPS: gl.constexpr):
    """The row tiles of every group as vectors over the groups, as ``row_schedule`` makes
    them: ``(idx, starts, ends, tiles, tile_ends, total, used, row_tiles)``; group ``g`` owns
    row tiles ``[tile_ends[g] - tiles[g], tile_ends[g])``, ``total`` tiles cover the groups'
    rows, ``used`` rows are in groups (int64: the sizes may add past 2**31) and ``row_tiles``
    tiles cover those and the rows past them (at most M / BM + G)."""
    idx, sizes = _clamped_sizes(gs_ptr, M, G, G_P2, WARPS)
    incl = gl.associative_scan(sizes, 0, _add)
    ends = gl.minimum(incl, M)
    starts = gl.minimum(incl - sizes, M)
    tiles = (ends - starts + BM - 1) // BM
    tile_ends = gl.associative_scan(tiles, 0, _add)
    total, used = gl.sum(tiles, 0), gl.max(ends, 0)
    return idx, starts, ends, tiles, tile_ends, total, used, (total + (M - used + BM - 1) // BM).to(gl.int32)


@gluon.jit
def _row_tile(rt, idx, starts, ends, tiles, tile_ends, total, used, BM: gl.constexpr):
    """Row tile ``rt``: ``(g, first row, end row)``; past the groups' tiles, a tile of the
    rows past every group (``g = -1``), whose output is zeros."""
    if rt < total:
        g = gl.sum(gl.where(tile_ends <= rt, 1, 0), 0)
        sel = idx == g
        first_tile = gl.sum(gl.where(sel, tile_ends - tiles, 0), 0)
        r0 = gl.sum(gl.where(sel, starts, 0), 0) + (rt - first_tile) * BM
        r1 = gl.sum(gl.where(sel, ends, 0), 0)
    else:
        g = -1
        r0 = used + (rt - total) * BM
        r1 = r0 + BM
    return g, r0.to(gl.int32), r1.to(gl.int32)


@gluon.jit
def _mm_tile(t, idx, starts, ends, tiles, tile_ends, total, used, row_tiles, num_n: gl.constexpr,
             GROUP_M: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """Tile ``t`` of :func:`_row_schedule`'s row tiles times ``num_n`` column tiles: ``(g,
    first row, end row, first column)``. ``GROUP_M`` row tiles at a time, column by column,
    so that the programs in flight share ``rhs`` column slices in L2 (row by row, a wide
    ``D`` would stream the whole ``rhs`` once per row tile)."""
    width = GROUP_M * num_n
    first = (t // width) * GROUP_M
    rows = gl.minimum(row_tiles - first, GROUP_M)
    g, r0, r1 = _row_tile(first + (t % width) % rows, idx, starts, ends, tiles, tile_ends, total, used, BM)
    return g, r0, r1, (t % width) // rows * BN


@gluon.jit
def _mm_loader(a_desc, b_desc, gs_ptr, M, a_bufs, b_bufs, ready, empty, C: gl.constexpr, D: gl.constexpr,
               G: gl.constexpr, G_P2: gl.constexpr, TRANS_RHS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
               BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, PROGRAMS: gl.constexpr):
    num_n: gl.constexpr = (D + BN - 1) // BN
    idx, starts, ends, tiles, tile_ends, total, used, row_tiles = _row_schedule(gs_ptr, M, G, G_P2, BM, 1)
    it = 0
    for t in range(gl.program_id(0), row_tiles * num_n, PROGRAMS):
        g, r0, r1, n0 = _mm_tile(t, idx, starts, ends, tiles, tile_ends, total, used, row_tiles, num_n, GROUP_M,
                                 BM, BN)
        if g >= 0:
            for k in range(0, C, BK):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                _tma_load(a_desc, [r0, k], ready.index(s), a_bufs.index(s))
                if TRANS_RHS:  # rhs [G, D, C] seen as [G * D, C]: rows g * D + n0 ..
                    _tma_load(b_desc, [g * D + n0, k], ready.index(s), b_bufs.index(s))
                else:          # rhs [G, C, D] seen as [G * C, D]: rows g * C + k ..
                    _tma_load(b_desc, [g * C + k, n0], ready.index(s), b_bufs.index(s))
                it += 1


@gluon.jit
def _mm_mma(out_desc, out_ptr, gs_ptr, M, a_bufs, b_bufs, cs, ready, empty, C: gl.constexpr, D: gl.constexpr,
            G: gl.constexpr, G_P2: gl.constexpr, TRANS_RHS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
            BK: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, PROGRAMS: gl.constexpr,
            WARPS: gl.constexpr):
    num_n: gl.constexpr = (D + BN - 1) // BN
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                          instr_shape=[16, BN, 16])
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    idx, starts, ends, tiles, tile_ends, total, used, row_tiles = _row_schedule(gs_ptr, M, G, G_P2, BM, WARPS)
    it = 0
    for t in range(gl.program_id(0), row_tiles * num_n, PROGRAMS):
        g, r0, r1, n0 = _mm_tile(t, idx, starts, ends, tiles, tile_ends, total, used, row_tiles, num_n, GROUP_M,
                                 BM, BN)
        acc = gl.zeros((BM, BN), gl.float32, acc_layout)
        if g >= 0:
            for k in range(0, C, BK):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                if TRANS_RHS:
                    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
                else:
                    acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES), pred=k > 0)
                it += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((it + STAGES - 1) % STAGES))
        if r0 + BM <= r1:  # a whole tile of the group's rows: stored by TMA (clipped at D)
            _store_tile(out_desc, r0, n0, cs, acc)
        else:  # the group's last, partial tile (the next rows are another group's), or zeros
            vals = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), store_layout)
            rows = r0 + gl.arange(0, BM, layout=gl.SliceLayout(1, store_layout))
            cols = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, store_layout))
            mask = ((rows < r1) & (rows < M))[:, None] & (cols < D)[None, :]
            gl.store(out_ptr + rows.to(gl.int64)[:, None] * D + cols[None, :], vals, mask=mask)
    tma.store_wait(0)


@gluon.jit
def grouped_gemm_ws_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, M, out_prealloc_ptr, out_ptr,
                           C: gl.constexpr, D: gl.constexpr, G: gl.constexpr, G_P2: gl.constexpr,
                           TRANS_RHS: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
                           GROUP_M: gl.constexpr, STAGES: gl.constexpr, PROGRAMS: gl.constexpr,
                           WARPS: gl.constexpr):
    """out[rows of g] = lhs[rows of g] @ rhs[g] (``rhs[g].T`` with ``TRANS_RHS``), [M, D]:
    ``grouped_gemm_kernel``'s product, warp-specialised. ``PROGRAMS`` programs stride over
    the row tiles of every group (each group starting a tile) and the tiles of the rows past
    them, times ``D``'s column tiles (``GROUP_M`` row tiles at a time); a loader warp
    streams ``lhs`` and ``rhs`` slices by TMA (``C`` and, with ``TRANS_RHS``, ``D``
    multiples of the block, so no slice crosses into the next group's matrix) and the MMA warpgroups store whole tiles by TMA, a group's partial
    last tile and the zero rows past the groups with masked stores, so no program writes
    another group's rows."""
    dtype: gl.constexpr = lhs_ptr.dtype.element_ty
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], dtype)
    if TRANS_RHS:
        b_block: gl.constexpr = [BN, BK]
    else:
        b_block: gl.constexpr = [BK, BN]
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(b_block, dtype)
    out_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)
    a_desc = tma.make_tensor_descriptor(lhs_ptr, shape=[M, C], strides=[C, 1], block_shape=[BM, BK], layout=a_layout)
    if TRANS_RHS:
        b_desc = tma.make_tensor_descriptor(rhs_ptr, shape=[G * D, C], strides=[C, 1], block_shape=b_block,
                                            layout=b_layout)
    else:
        b_desc = tma.make_tensor_descriptor(rhs_ptr, shape=[G * C, D], strides=[D, 1], block_shape=b_block,
                                            layout=b_layout)
    out_desc = tma.make_tensor_descriptor(out_ptr, shape=[M, D], strides=[D, 1], block_shape=[BM, BN],
                                          layout=out_layout)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_block, b_layout)
    cs = gl.allocate_shared_memory(dtype, [BM, BN], out_layout)
    ready, empty = _barrier_ring(STAGES)
    gl.warp_specialize([
        (_mm_mma, (out_desc, out_ptr, group_sizes_ptr, M, a_bufs, b_bufs, cs, ready, empty, C, D, G, G_P2,
                   TRANS_RHS, BM, BN, BK, GROUP_M, STAGES, PROGRAMS, WARPS)),
        (_mm_loader, (a_desc, b_desc, group_sizes_ptr, M, a_bufs, b_bufs, ready, empty, C, D, G, G_P2, TRANS_RHS,
                      BM, BN, BK, GROUP_M, STAGES, PROGRAMS)),
    ], [1], [LOADER_REGS])
