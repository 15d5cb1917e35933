"""Triton kernels building the row-id map on device, in one or two launches.

Row-id map layout, int32 ``[T, 2E+1]``: for token ``t`` with ``k`` routed experts
(ascending expert id), ``map[t, :k]`` are their destination rows in the expert-sorted
output (``-1`` when the row was dropped because it falls at or beyond ``num_out_tokens``),
``map[t, E:E+k]`` the matching expert ids, ``map[t, 2E] = k``; the unused tail of both
halves is ``-1``. Destinations are *unpadded*; padding adds ``pad_offsets[expert]``.
``kept[e]`` (written by program 0 alone) is the number of expert ``e``'s rows not dropped.

Tokens go in blocks of ``BLOCK_T``, one program per block. A program needs, per expert,
the number of routed tokens in all earlier blocks (its exclusive prefix) and in all blocks
(the totals, whose exclusive scan over experts gives each expert's first row).

* Two launches (``row_id_map_block_counts_kernel`` then ``row_id_map_fill_kernel``): pass 1
  writes each block's per-expert counts ``[NB, E]``; in pass 2 every program reduces that small
  matrix (L2-resident) itself, so no separate scan pass or host-side glue is needed.
* One launch (``row_id_map_fused_kernel``), for small ``T*E``: every program reduces the routing
  map itself instead of the counts - cheaper than a second launch while ``T*E`` is small.

The routing map may be bool (Triton loads ``*i1`` as bytes) or any integer type holding 0/1.
"""
import triton
import triton.language as tl


@triton.jit
def row_id_map_block_counts_kernel(rm_ptr, T, counts_prealloc, counts_ptr, E: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SUB: tl.constexpr):
    # [SUB, BLOCK_E] sub-tiles keep registers low; E compiled in makes the rows vector loads.
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
def _start_rows(pre, tot, b, N, ALIGN, kept_ptr, E: tl.constexpr, BLOCK_E: tl.constexpr):
    """Each expert's first destination row for block ``b`` and each expert's padding rows
    before it (zeros when ``ALIGN == 1``); program 0 also writes ``kept``."""
    e = tl.arange(0, BLOCK_E)
    start = tl.cumsum(tot, axis=0) - tot
    # N - start cannot overflow: N <= 2^31-1 and start >= 0.
    kept = tl.minimum(tl.maximum(N - start, 0), tot)
    if b == 0:
        tl.store(kept_ptr + e, kept, mask=e < E)
    # Padding: each expert's kept rows rounded up to a multiple of ALIGN; the rows before
    # expert e grow by the padding of all earlier experts.
    padded = (kept + ALIGN - 1) // ALIGN * ALIGN
    pad = (tl.cumsum(padded, axis=0) - padded) - (tl.cumsum(kept, axis=0) - kept)
    return start + pre, pad


@triton.jit
def _fill_block(rm_ptr, run, pad, b, T, N, R, map_ptr, owner_ptr, E: tl.constexpr, BLOCK_T: tl.constexpr,
                BLOCK_E: tl.constexpr, SUB: tl.constexpr, OWNED: tl.constexpr):
    # The block's BLOCK_T tokens go in [SUB, BLOCK_E] sub-tiles (a [64, 256] tile with its
    # cumsums spills heavily), carrying each expert's running row between them; the next
    # sub-tile's routing rows are loaded before this one's stores.
    e = tl.arange(0, BLOCK_E)
    em = e < E
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
        kept = (m > 0) & (dest < N)
        vd = tl.where(kept, dest + pad[None, :], -1)
        ve = tl.where(m > 0, e[None, :] + tl.zeros_like(m), -1)
        base = t.to(tl.int64)[:, None] * (2 * E + 1)
        tl.store(map_ptr + base + col, vd, mask=mask)
        tl.store(map_ptr + base + E + col, ve, mask=mask)
        tl.store(map_ptr + t.to(tl.int64) * (2 * E + 1) + 2 * E, cnt, mask=tm)
        if OWNED:
            # The map is built here, so each kept row has exactly one entry: its owner (the
            # entry id t*E + column + 1, as row_owner_kernel would find) is a plain store.
            # Rows stay in [0, R), whatever N, ALIGN and a counts operand say (counts that
            # are not the map's block counts can make a row negative).
            own = mask & kept & (vd >= 0) & (vd < R)
            tl.store(owner_ptr + vd.to(tl.int64), (t[:, None] * E + col + 1), mask=own)


@triton.jit
def _fill_body(rm_ptr, counts_ptr, T, N, ALIGN, R, map_ptr, kept_ptr, owner_ptr, E: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SUB: tl.constexpr, CH: tl.constexpr,
               OWNED: tl.constexpr):
    # Pass 2: this block's prefix and the totals, reduced from the [NB, E] counts in
    # [CH, BLOCK_E] chunks (L2 hits: every program reads the same small matrix).
    b = tl.program_id(0)
    nb = tl.cdiv(T, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    pre = tl.zeros([BLOCK_E], dtype=tl.int32)
    tot = tl.zeros([BLOCK_E], dtype=tl.int32)
    for r0 in range(0, nb, CH):
        r = r0 + tl.arange(0, CH)
        c = tl.load(counts_ptr + r.to(tl.int64)[:, None] * E + e[None, :],
                    mask=(r < nb)[:, None] & em[None, :], other=0)
        tot += tl.sum(c, axis=0)
        pre += tl.sum(tl.where((r < b)[:, None], c, 0), axis=0)
    run, pad = _start_rows(pre, tot, b, N, ALIGN, kept_ptr, E, BLOCK_E)
    _fill_block(rm_ptr, run, pad, b, T, N, R, map_ptr, owner_ptr, E, BLOCK_T, BLOCK_E, SUB, OWNED)


@triton.jit
def _fused_body(rm_ptr, T, N, ALIGN, R, map_ptr, kept_ptr, owner_ptr, E: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SUB: tl.constexpr, CH: tl.constexpr,
                OWNED: tl.constexpr):
    # One launch: the prefix and totals reduced straight from the routing map's [CH, BLOCK_E]
    # row chunks (every program reads the whole map: only worth it while T*E is small).
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    lim = b * BLOCK_T
    pre = tl.zeros([BLOCK_E], dtype=tl.int32)
    tot = tl.zeros([BLOCK_E], dtype=tl.int32)
    for r0 in range(0, T, CH):
        r = r0 + tl.arange(0, CH)
        m = tl.load(rm_ptr + r.to(tl.int64)[:, None] * E + e[None, :], mask=(r < T)[:, None] & em[None, :], other=0)
        c = (m != 0).to(tl.int32)
        tot += tl.sum(c, axis=0)
        pre += tl.sum(tl.where((r < lim)[:, None], c, 0), axis=0)
    run, pad = _start_rows(pre, tot, b, N, ALIGN, kept_ptr, E, BLOCK_E)
    _fill_block(rm_ptr, run, pad, b, T, N, R, map_ptr, owner_ptr, E, BLOCK_T, BLOCK_E, SUB, OWNED)


@triton.jit
def row_id_map_fill_kernel(rm_ptr, counts_ptr, T, N, map_prealloc, kept_prealloc, map_ptr, kept_ptr,
                           E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SUB: tl.constexpr,
                           CH: tl.constexpr):
    _fill_body(rm_ptr, counts_ptr, T, N, 1, 0, map_ptr, kept_ptr, kept_ptr, E, BLOCK_T, BLOCK_E, SUB, CH, False)


@triton.jit
def row_id_map_fused_kernel(rm_ptr, T, N, map_prealloc, kept_prealloc, map_ptr, kept_ptr, E: tl.constexpr,
                            BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, SUB: tl.constexpr, CH: tl.constexpr):
    _fused_body(rm_ptr, T, N, 1, 0, map_ptr, kept_ptr, kept_ptr, E, BLOCK_T, BLOCK_E, SUB, CH, False)


@triton.jit
def dispatch_map_fill_kernel(rm_ptr, counts_ptr, T, N, ALIGN, R, map_prealloc, kept_prealloc, owner_prealloc,
                             map_ptr, kept_ptr, owner_ptr, E: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_E: tl.constexpr, SUB: tl.constexpr, CH: tl.constexpr):
    _fill_body(rm_ptr, counts_ptr, T, N, ALIGN, R, map_ptr, kept_ptr, owner_ptr, E, BLOCK_T, BLOCK_E, SUB, CH,
               True)


@triton.jit
def dispatch_map_fused_kernel(rm_ptr, T, N, ALIGN, R, map_prealloc, kept_prealloc, owner_prealloc,
                              map_ptr, kept_ptr, owner_ptr, E: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_E: tl.constexpr, SUB: tl.constexpr, CH: tl.constexpr):
    _fused_body(rm_ptr, T, N, ALIGN, R, map_ptr, kept_ptr, owner_ptr, E, BLOCK_T, BLOCK_E, SUB, CH, True)
