"""A flat, vectorised device-to-device copy: the bandwidth baseline permutations are judged by.

Each program copies ``ITERS`` consecutive tiles of ``BLOCK`` elements, so one config can
trade program count against bytes in flight. Offsets are int64: a 1D view of a large
activation easily exceeds 2**31 elements.

Only the program holding the ragged end masks its accesses: ``N`` arrives at run time
without divisibility hints, so a mask ``offs < N`` cannot be proven constant over a
16-byte vector and would force element-wise loads/stores on every program.
"""
import triton
import triton.language as tl


@triton.jit
def copy_kernel(src_ptr, N, dst_prealloc_ptr, dst_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                EVEN: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    if EVEN or base + BLOCK * ITERS <= N:
        for i in tl.static_range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, eviction_policy="evict_first"))
    else:
        for i in tl.static_range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            mask = offs < N
            tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask, eviction_policy="evict_first"), mask=mask)
