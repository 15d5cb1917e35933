"""Triton kernels moving token rows through a row-id map (layout in ``row_id_map.py``).

Two bodies, each specialised by constexpr flags and exposed through thin wrappers whose
signatures follow the framework convention (operands, scalars, preallocs, outputs):

* ``row_owner_kernel``: for every output row, which map entry writes it (entry ``t*E + j``
  of token ``t``'s column ``j``, stored plus one, so 0 means "no entry"). Where several
  entries address one row, the highest wins: whatever the map holds, a row has at most one
  writer, decided on the device, the same on every backend.
* ``_scatter_body``: token rows -> expert-sorted rows (dispatch forward, combine backward).
  Programs ``[0, cdiv(T, ROWS))`` of grid axis 0 each own ROWS tokens and write the rows
  their entries own; the programs after them each own FILL_ROWS output rows and zero those
  no entry owns (padding, unused budget), so every output element is written exactly once
  and no output needs a memset.
* ``_gather_body``: expert-sorted rows -> token rows, summed in fp32 (combine forward,
  dispatch backward). Each program owns ROWS tokens and writes each of their rows once.
  With ``OWNER`` it also fills the row_owner table for its tokens once their rows are
  written (the combine forward that a backward follows), so that backward needs no
  ``row_owner_kernel``.

Grid axis 1 splits the row into ``BLOCK_H``-wide column slices, one per program, so a
small slice still gives the GPU many independent programs (and bytes in flight) per
token. The weighted scatter (combine backward) is the exception: its probability gradient
is a dot product over the whole row, so one program walks all of H (axis 1 has one program).
Values without a column axis (permuted probabilities, their gradients) are written by the
slice-0 program only.

Performance notes (H100-class, bandwidth bound):

* ``H`` is a compile-time constant: a known H (e.g. 7168 = 1024*7, 2880 = 64*45) proves row
  starts 16-byte aligned and gives 128-bit vector loads/stores. Token counts stay runtime
  values, so a new token count never needs a new binary.
* A program handles its ROWS tokens as one ``[ROWS, BLOCK_H]`` tile: all ROWS row loads
  are issued before any store, and each map column ``j`` is one ``[ROWS]`` vector load.
* The map entries of step ``j + 1`` are fetched before step ``j``'s row traffic, so the
  dependent index load overlaps the row load/store instead of serialising with it; step
  0's entry loads beside the routed count (``_first``), not after it (top-1's dispatch
  backward 4% faster on an H100). Scatters fetch one column ahead rather than a whole
  block of columns as one vector: taking a column out of a ``[ROWS, K]`` block is a
  reduction across lanes for every row, and with entries, owners and weights loaded as
  eight-column blocks the combine backward ran up to 17% and the dispatch forward up to
  70% slower on an H100 (no faster anywhere by more than 2%).
* The combine backward loads a token's gradient row once for all its rows (``GRAD_ONCE``)
  where one tile holds the row and there are at least two rows per token: 1-2.5% faster
  at top-2 to top-8 on an H100; at top-1 there is nothing to share.
* Gathers of two or more rows per token (``TWO_IN_FLIGHT``, from the row and token counts)
  also request step ``j + 1``'s row before summing step ``j``'s: two row loads in flight
  per program (DBRX's top-4 combine forward 4% faster at the same tile on an H100). With
  one row per token there is nothing to overlap and the second row buffer only costs
  occupancy (top-1 ran 4-5% slower with it).

Row offsets are int64: ``rows * H`` exceeds 2**31 at real sizes.
"""
import triton
import triton.language as tl


@triton.jit
def _dest(rid_row, pad_ptr, j, E, N, live, PADDED: tl.constexpr):
    """Destination rows (int64) and expert ids of map column ``j``, and where they are usable.

    Whatever the map holds, nothing outside the buffers is touched: callers pass ``live``
    only where ``j`` is below the token's routed count clamped to ``[0, E]``, so only the
    row's own columns are read; expert ids outside ``[0, E)`` and destinations outside
    ``[0, N)`` (the rows of the expert-sorted buffer) mark the entry absent."""
    # Both halves of the entry load at once (neither waits for the other's value).
    dest = tl.load(rid_row + j, mask=live, other=-1)
    e = tl.load(rid_row + E + j, mask=live, other=-1)
    return _checked(dest, e, pad_ptr, E, N, live, PADDED)


@triton.jit
def _checked(dest, e, pad_ptr, E, N, live, PADDED: tl.constexpr):
    """:func:`_dest` for an entry already loaded: destination (int64, padded), expert, usable."""
    ok = live & (dest >= 0) & (e >= 0) & (e < E)
    dest = dest.to(tl.int64)
    if PADDED:
        dest += tl.load(pad_ptr + e, mask=ok, other=0)
    ok = ok & (dest >= 0) & (dest < N)
    return dest, e, ok


@triton.jit
def _first(rid_row, pad_ptr, E, N, tm, PADDED: tl.constexpr):
    """The tokens' routed counts, clamped to ``[0, E]`` whatever the map says, and their
    column-0 entries (as :func:`_dest`). The entry loads beside the count, not after it:
    as a column of the token's own row it is in bounds whatever the count says, and one
    dependent load fewer before the first row moves is much of a short program's time.
    (Columns 0 and E are in the row for any E >= 0: with no experts both are the count.)"""
    dest = tl.load(rid_row, mask=tm, other=-1)
    e = tl.load(rid_row + E, mask=tm, other=-1)
    cnt = tl.minimum(tl.maximum(tl.load(rid_row + 2 * E, mask=tm, other=0), 0), E)
    dest, e, ok = _checked(dest, e, pad_ptr, E, N, tm & (0 < cnt), PADDED)
    return cnt, dest, e, ok


@triton.jit
def row_owner_kernel(rid_ptr, pad_ptr, T, E, N, owner_prealloc, owner_ptr, PADDED: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    # A [BLOCK_T, BLOCK_K] tile of map entries per step: every entry's loads and atomic are
    # independent, so they are all in flight at once (one step covers top-k up to BLOCK_K).
    # The first step's entries load beside the routed count rather than after it (masked to
    # the row's E columns, so in bounds whatever the count says): the kernel is latency
    # bound, and one dependent load fewer is most of its time at top-k <= BLOCK_K.
    # The atomics are relaxed: nothing in this kernel reads the table, the kernel's end
    # orders every write before the kernels that read it, and a max does not depend on the
    # order it is taken in, so no fence is needed (Triton's default, acq_rel, makes each one
    # a fenced atomic instead of a fire-and-forget reduction).
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tm = t < T
    t64 = t.to(tl.int64)
    rid_row = rid_ptr + t64 * (2 * E + 1)
    j = tl.arange(0, BLOCK_K)[None, :]
    in_row = tm[:, None] & (j < E)
    dest = tl.load(rid_row[:, None] + j, mask=in_row, other=-1)
    e = tl.load(rid_row[:, None] + E + j, mask=in_row, other=-1)
    cnt = tl.minimum(tl.maximum(tl.load(rid_row + 2 * E, mask=tm, other=0), 0), E)
    dest, _e, ok = _checked(dest, e, pad_ptr, E, N, in_row & (j < cnt[:, None]), PADDED)
    tl.atomic_max(owner_ptr + dest, (t64[:, None] * E + j + 1).to(tl.int32), mask=ok, sem="relaxed")
    _claim_rows(rid_row, pad_ptr, owner_ptr, t64, tm, cnt, E, N, BLOCK_K, PADDED, BLOCK_K)


@triton.jit
def _claim_rows(rid_row, pad_ptr, owner_ptr, t64, tm, cnt, E, N, J0: tl.constexpr, PADDED: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Entries ``(t, j)`` of the tokens ``t64`` from column ``J0`` on, BLOCK_K columns a step,
    each take its row for ``t*E + j + 1`` unless a higher entry has (an atomic max)."""
    for j0 in range(J0, tl.max(cnt, axis=0), BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)[None, :]
        live = tm[:, None] & (j < cnt[:, None])
        dest, _e, ok = _dest(rid_row[:, None], pad_ptr, j, E, N, live, PADDED)
        tl.atomic_max(owner_ptr + dest, (t64[:, None] * E + j + 1).to(tl.int32), mask=ok, sem="relaxed")


@triton.jit
def _zero_token_rows(ptr, t64, tm, E, E_LANES: tl.constexpr):
    """Zeros the [T, E] rows of this program's tokens, then a barrier: entries stored after it
    (by any thread of the program) land on top of the zeros, so every element is written
    and the entries win. Call it where the whole program takes the same branch."""
    lanes = tl.arange(0, E_LANES)[None, :]
    tl.store(ptr + t64[:, None] * E + lanes, tl.zeros([t64.shape[0], E_LANES], dtype=ptr.dtype.element_ty),
             mask=tm[:, None] & (lanes < E))
    tl.debug_barrier()


@triton.jit
def _owns(owner_ptr, dest, t64, j, E, ok):
    """Where entry ``(t, j)`` is its destination row's one writer."""
    return ok & (tl.load(owner_ptr + dest, mask=ok, other=0) == (t64 * E + j + 1).to(tl.int32))


@triton.jit
def _scatter_body(x_ptr, rid_ptr, pad_ptr, owner_ptr, probs_ptr, w_ptr, y_ptr,
                  T, E, N_OUT, out_ptr, pout_ptr, dw_ptr, H: tl.constexpr,
                  HAS_PROBS: tl.constexpr, WEIGHTED: tl.constexpr, PADDED: tl.constexpr,
                  BLOCK_H: tl.constexpr, ROWS: tl.constexpr, FILL_ROWS: tl.constexpr, FILL_H: tl.constexpr,
                  E_LANES: tl.constexpr, GRAD_ONCE: tl.constexpr):
    pid = tl.program_id(0)
    n_tok = tl.cdiv(T, ROWS)
    # This program's columns: one slice, or (weighted: a dot product over the row) all of H.
    if WEIGHTED:
        h_lo = 0
        h_hi = H
    else:
        h_lo = tl.program_id(1) * BLOCK_H
        h_hi = h_lo + BLOCK_H
    first_slice = tl.program_id(1) == 0
    if pid < n_tok:
        t = pid * ROWS + tl.arange(0, ROWS)
        tm = t < T
        t64 = t.to(tl.int64)
        rid_row = rid_ptr + t64 * (2 * E + 1)
        # The routed count bounds loops and columns.
        cnt, dest0, e0, ok0 = _first(rid_row, pad_ptr, E, N_OUT, tm, PADDED)
        kmax = tl.max(cnt, axis=0)
        own0 = _owns(owner_ptr, dest0, t64, 0, E, ok0)
        if WEIGHTED:
            # Combine backward: one pass per map column, since each destination needs its dot.
            # Only the row's owner writes it and gets the weight's gradient; weights without an
            # owned entry get zero (a map that sends two entries to one row gives the other
            # entry's weight none). The next column's entry and owner load while this
            # column's rows move.
            _zero_token_rows(dw_ptr, t64, tm, E, E_LANES)
            if GRAD_ONCE:
                # One tile holds the whole row: the gradient row loads once for all columns.
                g_row = tl.load(x_ptr + t64[:, None] * H + tl.arange(0, BLOCK_H)[None, :],
                                mask=tm[:, None] & (tl.arange(0, BLOCK_H) < H)[None, :], other=0.0).to(tl.float32)
            nxt = dest0
            ne = e0
            nown = own0
            for j in range(kmax):
                dest = nxt
                e = ne
                own = nown
                nxt, ne, nok = _dest(rid_row, pad_ptr, j + 1, E, N_OUT, tm & (j + 1 < cnt), PADDED)
                nown = _owns(owner_ptr, nxt, t64, j + 1, E, nok)
                w = tl.load(w_ptr + t64 * E + e, mask=own, other=0).to(tl.float32)
                acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
                for h0 in range(h_lo, h_hi, BLOCK_H):
                    off = h0 + tl.arange(0, BLOCK_H)
                    hm = (off < H)[None, :]
                    if GRAD_ONCE:
                        g = g_row
                    else:
                        g = tl.load(x_ptr + t64[:, None] * H + off[None, :], mask=own[:, None] & hm, other=0.0)
                        g = g.to(tl.float32)
                    yv = tl.load(y_ptr + dest[:, None] * H + off[None, :], mask=own[:, None] & hm, other=0.0)
                    acc += g * yv.to(tl.float32)
                    tl.store(out_ptr + dest[:, None] * H + off[None, :],
                             (g * w[:, None]).to(out_ptr.dtype.element_ty), mask=own[:, None] & hm)
                tl.store(dw_ptr + t64 * E + e, tl.sum(acc, axis=1).to(dw_ptr.dtype.element_ty), mask=own)
        else:
            if HAS_PROBS and first_slice:
                for j in range(kmax):
                    dest, e, ok = _dest(rid_row, pad_ptr, j, E, N_OUT, tm & (j < cnt), PADDED)
                    own = _owns(owner_ptr, dest, t64, j, E, ok)
                    tl.store(pout_ptr + dest, tl.load(probs_ptr + t64 * E + e, mask=own), mask=own)
            # Read the tokens' slice once and write it to all their experts. Neither the slice
            # nor its copies are touched again by this kernel, so both are marked first to
            # leave L2 (on the H100 the dispatch took 1-8% less time than with the default
            # policy, most at k = 8); the combine backward's rows keep the default, which
            # measured faster there.
            for h0 in range(h_lo, h_hi, BLOCK_H):
                off = h0 + tl.arange(0, BLOCK_H)
                hm = (off < H)[None, :]
                v = tl.load(x_ptr + t64[:, None] * H + off[None, :], mask=tm[:, None] & hm,
                            eviction_policy="evict_first")
                nxt = dest0
                nown = own0
                for j in range(kmax):
                    dest = nxt
                    own = nown
                    nxt, _e, nok = _dest(rid_row, pad_ptr, j + 1, E, N_OUT, tm & (j + 1 < cnt), PADDED)
                    nown = _owns(owner_ptr, nxt, t64, j + 1, E, nok)
                    tl.store(out_ptr + dest[:, None] * H + off[None, :], v, mask=own[:, None] & hm,
                             eviction_policy="evict_first")
    else:
        rows = (pid - n_tok) * FILL_ROWS + tl.arange(0, FILL_ROWS)
        rm = rows < N_OUT
        zero = rm & (tl.load(owner_ptr + rows, mask=rm, other=1) == 0)
        if tl.sum(zero.to(tl.int32), axis=0) > 0:
            r64 = rows.to(tl.int64)
            if HAS_PROBS and first_slice:
                tl.store(pout_ptr + r64, tl.zeros([FILL_ROWS], dtype=pout_ptr.dtype.element_ty), mask=zero)
            for h0 in range(h_lo, h_hi, FILL_H):
                off = h0 + tl.arange(0, FILL_H)
                m = zero[:, None] & ((off < H) & (off < h_hi))[None, :]
                tl.store(out_ptr + r64[:, None] * H + off[None, :],
                         tl.zeros([FILL_ROWS, FILL_H], dtype=out_ptr.dtype.element_ty), mask=m,
                         eviction_policy="evict_first")


@triton.jit
def permute_kernel(x_ptr, rid_ptr, pad_ptr, owner_ptr, T, E, N_OUT,
                   out_prealloc, out_ptr, H: tl.constexpr,
                   PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                   FILL_ROWS: tl.constexpr, FILL_H: tl.constexpr, E_LANES: tl.constexpr):
    _scatter_body(x_ptr, rid_ptr, pad_ptr, owner_ptr, x_ptr, x_ptr, x_ptr,
                  T, E, N_OUT, out_ptr, out_ptr, out_ptr, H,
                  False, False, PADDED, BLOCK_H, ROWS, FILL_ROWS, FILL_H, E_LANES, False)


@triton.jit
def permute_probs_kernel(x_ptr, rid_ptr, pad_ptr, owner_ptr, probs_ptr, T, E, N_OUT,
                         out_prealloc, pout_prealloc, out_ptr, pout_ptr, H: tl.constexpr,
                         PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                         FILL_ROWS: tl.constexpr, FILL_H: tl.constexpr, E_LANES: tl.constexpr):
    _scatter_body(x_ptr, rid_ptr, pad_ptr, owner_ptr, probs_ptr, x_ptr, x_ptr,
                  T, E, N_OUT, out_ptr, pout_ptr, out_ptr, H,
                  True, False, PADDED, BLOCK_H, ROWS, FILL_ROWS, FILL_H, E_LANES, False)


@triton.jit
def unpermute_bwd_weighted_kernel(g_ptr, rid_ptr, pad_ptr, owner_ptr, w_ptr, y_ptr, T, E, N_OUT,
                                  out_prealloc, dw_prealloc, out_ptr, dw_ptr, H: tl.constexpr,
                                  PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                                  FILL_ROWS: tl.constexpr, FILL_H: tl.constexpr, E_LANES: tl.constexpr,
                                  GRAD_ONCE: tl.constexpr):
    _scatter_body(g_ptr, rid_ptr, pad_ptr, owner_ptr, w_ptr, w_ptr, y_ptr,
                  T, E, N_OUT, out_ptr, out_ptr, dw_ptr, H,
                  False, True, PADDED, BLOCK_H, ROWS, FILL_ROWS, FILL_H, E_LANES, GRAD_ONCE)


@triton.jit
def _gather_body(y_ptr, rid_ptr, pad_ptr, w_ptr, gpp_ptr, T, E, N, out_ptr, dprobs_ptr, owner_ptr, H: tl.constexpr,
                 WEIGHTED: tl.constexpr, HAS_PGRAD: tl.constexpr, OWNER: tl.constexpr, PADDED: tl.constexpr,
                 BLOCK_H: tl.constexpr, ROWS: tl.constexpr, E_LANES: tl.constexpr, TWO_IN_FLIGHT: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * ROWS + tl.arange(0, ROWS)
    tm = t < T
    t64 = t.to(tl.int64)
    rid_row = rid_ptr + t64 * (2 * E + 1)
    cnt, dest, e, ok = _first(rid_row, pad_ptr, E, N, tm, PADDED)
    kmax = tl.max(cnt, axis=0)
    off = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = (off < H)[None, :]
    acc = tl.zeros([ROWS, BLOCK_H], dtype=tl.float32)
    # Probability gradients (slice-0 programs): the tokens' rows zeroed, then each entry's
    # value moved alongside its row, so its latency hides behind the row load.
    if HAS_PGRAD and tl.program_id(1) == 0:
        _zero_token_rows(dprobs_ptr, t64, tm, E, E_LANES)
    if TWO_IN_FLIGHT:
        v = tl.load(y_ptr + dest[:, None] * H + off[None, :], mask=ok[:, None] & hm, other=0.0)
    for j in range(kmax):
        # Next column's indices first: their latency hides behind this column's row load.
        nxt, ne, nok = _dest(rid_row, pad_ptr, j + 1, E, N, tm & (j + 1 < cnt), PADDED)
        if TWO_IN_FLIGHT:
            # Column j + 1's row is requested before column j's is summed.
            v_next = tl.load(y_ptr + nxt[:, None] * H + off[None, :], mask=nok[:, None] & hm, other=0.0)
        else:
            v = tl.load(y_ptr + dest[:, None] * H + off[None, :], mask=ok[:, None] & hm, other=0.0)
        vf = v.to(tl.float32)
        if WEIGHTED:
            vf = vf * tl.load(w_ptr + t64 * E + e, mask=ok, other=0).to(tl.float32)[:, None]
        if HAS_PGRAD:
            pm = ok & (tl.zeros_like(t) == tl.program_id(1))
            tl.store(dprobs_ptr + t64 * E + e, tl.load(gpp_ptr + dest, mask=pm), mask=pm)
        acc += vf
        dest = nxt
        e = ne
        ok = nok
        if TWO_IN_FLIGHT:
            v = v_next
    tl.store(out_ptr + t64[:, None] * H + off[None, :], acc.to(out_ptr.dtype.element_ty), mask=tm[:, None] & hm)
    if OWNER:
        # After the rows, not beside them: an atomic in the row loop made the whole gather
        # 4-15% slower on an H100 (its tokens' entries are in L1 by now).
        if tl.program_id(1) == 0:
            _claim_rows(rid_row, pad_ptr, owner_ptr, t64, tm, cnt, E, N, 0, PADDED, BLOCK_K)


@triton.jit
def unpermute_kernel(y_ptr, rid_ptr, pad_ptr, T, E, N, out_prealloc, out_ptr, H: tl.constexpr,
                     PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr, E_LANES: tl.constexpr,
                     TWO_IN_FLIGHT: tl.constexpr):
    _gather_body(y_ptr, rid_ptr, pad_ptr, y_ptr, y_ptr, T, E, N, out_ptr, out_ptr, out_ptr, H,
                 False, False, False, PADDED, BLOCK_H, ROWS, E_LANES, TWO_IN_FLIGHT, 1)


@triton.jit
def unpermute_weighted_kernel(y_ptr, rid_ptr, pad_ptr, w_ptr, T, E, N, out_prealloc, out_ptr, H: tl.constexpr,
                              PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                              E_LANES: tl.constexpr, TWO_IN_FLIGHT: tl.constexpr):
    _gather_body(y_ptr, rid_ptr, pad_ptr, w_ptr, w_ptr, T, E, N, out_ptr, out_ptr, out_ptr, H,
                 True, False, False, PADDED, BLOCK_H, ROWS, E_LANES, TWO_IN_FLIGHT, 1)


@triton.jit
def unpermute_owner_kernel(y_ptr, rid_ptr, pad_ptr, T, E, N, out_prealloc, owner_prealloc, out_ptr, owner_ptr,
                           H: tl.constexpr, PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                           E_LANES: tl.constexpr, TWO_IN_FLIGHT: tl.constexpr, BLOCK_K: tl.constexpr):
    _gather_body(y_ptr, rid_ptr, pad_ptr, y_ptr, y_ptr, T, E, N, out_ptr, out_ptr, owner_ptr, H,
                 False, False, True, PADDED, BLOCK_H, ROWS, E_LANES, TWO_IN_FLIGHT, BLOCK_K)


@triton.jit
def unpermute_weighted_owner_kernel(y_ptr, rid_ptr, pad_ptr, w_ptr, T, E, N, out_prealloc, owner_prealloc,
                                    out_ptr, owner_ptr, H: tl.constexpr, PADDED: tl.constexpr,
                                    BLOCK_H: tl.constexpr, ROWS: tl.constexpr, E_LANES: tl.constexpr,
                                    TWO_IN_FLIGHT: tl.constexpr, BLOCK_K: tl.constexpr):
    _gather_body(y_ptr, rid_ptr, pad_ptr, w_ptr, w_ptr, T, E, N, out_ptr, out_ptr, owner_ptr, H,
                 True, False, True, PADDED, BLOCK_H, ROWS, E_LANES, TWO_IN_FLIGHT, BLOCK_K)


@triton.jit
def permute_bwd_probs_kernel(y_ptr, rid_ptr, pad_ptr, gpp_ptr, T, E, N, out_prealloc, dprobs_prealloc,
                           out_ptr, dprobs_ptr, H: tl.constexpr,
                           PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                           E_LANES: tl.constexpr, TWO_IN_FLIGHT: tl.constexpr):
    _gather_body(y_ptr, rid_ptr, pad_ptr, gpp_ptr, gpp_ptr, T, E, N, out_ptr, dprobs_ptr, out_ptr, H,
                 False, True, False, PADDED, BLOCK_H, ROWS, E_LANES, TWO_IN_FLIGHT, 1)
