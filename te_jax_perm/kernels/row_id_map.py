"""Triton kernels building the row-id map on device, in three passes.

Row-id map layout, int32 ``[T, 2E+1]``: for token ``t`` with ``k`` routed experts
(ascending expert id), ``map[t, :k]`` are their destination rows in the expert-sorted
output (``-1`` when the row was dropped because it falls at or beyond ``num_out_tokens``),
``map[t, E:E+k]`` the matching expert ids, ``map[t, 2E] = k``; the unused tail of both
halves is ``-1``. Destinations are *unpadded*; padding adds ``pad_offsets[expert]``.

Pass 1 counts each expert's tokens per block of ``BLOCK_T`` tokens, pass 2 scans those
counts over blocks (one program per group of experts), pass 3 writes each block's rows.
"""
import triton
import triton.language as tl


@triton.jit
def block_counts_kernel(rm_ptr, T, counts_prealloc, counts_ptr, E: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SUB: tl.constexpr):
    # [SUB, BLOCK_E] sub-tiles keep registers low; E compiled in makes the rows 16-byte loads.
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    c = tl.zeros([BLOCK_E], dtype=tl.int32)
    for s0 in range(0, BLOCK_T, SUB):
        t = b * BLOCK_T + s0 + tl.arange(0, SUB)
        mask = (t < T)[:, None] & (e < E)[None, :]
        m = tl.load(rm_ptr + t.to(tl.int64)[:, None] * E + e[None, :], mask=mask, other=0)
        c += tl.sum((m != 0).to(tl.int32), axis=0)
    tl.store(counts_ptr + b.to(tl.int64) * E + e, c, mask=e < E)


@triton.jit
def block_scan_kernel(counts_ptr, NB, E, prefix_prealloc, totals_prealloc, prefix_ptr, totals_ptr,
                      EC: tl.constexpr, CH: tl.constexpr):
    # Exclusive prefix over blocks of each expert's count; each program owns EC experts.
    p = tl.program_id(0)
    e = p * EC + tl.arange(0, EC)
    em = e < E
    carry = tl.zeros([EC], dtype=tl.int32)
    for b0 in range(0, NB, CH):
        b = b0 + tl.arange(0, CH)
        mask = (b < NB)[:, None] & em[None, :]
        offs = b.to(tl.int64)[:, None] * E + e[None, :]
        c = tl.load(counts_ptr + offs, mask=mask, other=0)
        inc = tl.cumsum(c, axis=0)
        tl.store(prefix_ptr + offs, inc - c + carry[None, :], mask=mask)
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + e, carry, mask=em)


@triton.jit
def fill_map_kernel(rm_ptr, prefix_ptr, totals_ptr, T, N, map_prealloc, map_ptr, E: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SUB: tl.constexpr):
    # The block's BLOCK_T tokens go in [SUB, BLOCK_E] sub-tiles (a [64, 256] tile with its
    # cumsums spilled heavily), carrying each expert's running count between them; the
    # next sub-tile's routing rows are loaded before this one's stores.
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    tot = tl.load(totals_ptr + e, mask=em, other=0)
    start = tl.cumsum(tot, axis=0) - tot
    run = start + tl.load(prefix_ptr + b.to(tl.int64) * E + e, mask=em, other=0)
    t = b * BLOCK_T + tl.arange(0, SUB)
    nxt = tl.load(rm_ptr + t.to(tl.int64)[:, None] * E + e[None, :], mask=(t < T)[:, None] & em[None, :], other=0)
    for s0 in range(0, BLOCK_T, SUB):
        t = b * BLOCK_T + s0 + tl.arange(0, SUB)
        tm = t < T
        mask = tm[:, None] & em[None, :]
        m = (nxt != 0).to(tl.int32)
        tn = t + SUB
        nxt = tl.load(rm_ptr + tn.to(tl.int64)[:, None] * E + e[None, :],
                      mask=((tn < T) & (s0 + SUB < BLOCK_T))[:, None] & em[None, :], other=0)
        within = tl.cumsum(m, axis=0) - m
        dest = run[None, :] + within
        run += tl.sum(m, axis=0)
        # Routed experts go to the front in expert order, the others fill the tail, so the
        # scattered stores below write every column of the row exactly once.
        rank_r = tl.cumsum(m, axis=1) - m
        cnt = tl.sum(m, axis=1)
        col = tl.where(m > 0, rank_r, cnt[:, None] + e[None, :] - rank_r)
        vd = tl.where((m > 0) & (dest < N), dest, -1)
        ve = tl.where(m > 0, e[None, :] + tl.zeros_like(m), -1)
        base = t.to(tl.int64)[:, None] * (2 * E + 1)
        tl.store(map_ptr + base + col, vd, mask=mask)
        tl.store(map_ptr + base + E + col, ve, mask=mask)
        tl.store(map_ptr + t.to(tl.int64) * (2 * E + 1) + 2 * E, cnt, mask=tm)
