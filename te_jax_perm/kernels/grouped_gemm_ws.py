"""The grouped GEMM's weight gradient for Hopper, warp-specialised (a Gluon kernel).

``out[g] = lhs[rows of g].T @ dout[rows of g]``, as ``grouped_gemm_wgrad_kernel`` computes
it, by ``PROGRAMS`` persistent programs that split into two partitions: one loader warp
streams each block's row slices into a ring of ``STAGES`` shared-memory buffers by tensor
memory access (TMA), and the default partition's warpgroups multiply them with
asynchronous warpgroup MMAs and store each finished ``[BK, BN]`` block by TMA. The loader
runs ahead into the next block's slices without the compiler's software pipeline, which
with a group's few hundred rows leaves the tensor cores idle at each block's start and end.
The store does not hide behind that work: at a few hundred rows a group the kernel takes
about its loads' time plus its stores' (measured on an H200; a second staging buffer,
plain stores from a partition of their own and stores cut into pieces between the next
block's loads did not change it).

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
