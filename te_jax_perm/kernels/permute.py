"""Triton kernels moving token rows through a row-id map (layout in ``row_id_map.py``).

Two bodies, each specialised by constexpr flags and exposed through thin wrappers whose
signatures follow the framework convention (operands, scalars, preallocs, outputs):

* ``_scatter_body``: token rows -> expert-sorted rows (dispatch forward, combine backward).
  Programs ``[0, cdiv(T, ROWS))`` each own ROWS tokens; the programs after them each own
  FILL_ROWS output rows and zero those that no token writes (padding, dropped budget), so
  every output element is written exactly once and no output needs a memset.
* ``_gather_body``: expert-sorted rows -> token rows, summed in fp32 (combine forward,
  dispatch backward). Each program owns ROWS tokens and writes each of their rows once.

Row offsets are int64: ``rows * H`` exceeds 2**31 at real sizes.
"""
import triton
import triton.language as tl


@triton.jit
def _scatter_body(x_ptr, rid_ptr, pad_ptr, seg_start_ptr, seg_count_ptr, probs_ptr, w_ptr, y_ptr,
                  T, H, E, N_OUT, out_ptr, pout_ptr, dw_ptr,
                  HAS_PROBS: tl.constexpr, WEIGHTED: tl.constexpr, PADDED: tl.constexpr,
                  BLOCK_H: tl.constexpr, ROWS: tl.constexpr, FILL_ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    n_tok = tl.cdiv(T, ROWS)
    W = 2 * E + 1
    if pid < n_tok:
        for r in tl.static_range(ROWS):
            t = (pid * ROWS + r).to(tl.int64)
            if t < T:
                row = rid_ptr + t * W
                cnt = tl.load(row + 2 * E)
                xrow = x_ptr + t * H
                if WEIGHTED:
                    # Combine backward: one pass per destination, since each needs its own dot.
                    for j in range(cnt):
                        dest = tl.load(row + j).to(tl.int64)
                        if dest >= 0:
                            e = tl.load(row + E + j)
                            if PADDED:
                                dest += tl.load(pad_ptr + e)
                            w = tl.load(w_ptr + t * E + e)
                            acc = tl.zeros([BLOCK_H], dtype=tl.float32)
                            for h0 in range(0, H, BLOCK_H):
                                off = h0 + tl.arange(0, BLOCK_H)
                                hm = off < H
                                g = tl.load(xrow + off, mask=hm, other=0).to(tl.float32)
                                yv = tl.load(y_ptr + dest * H + off, mask=hm, other=0).to(tl.float32)
                                acc += g * yv
                                tl.store(out_ptr + dest * H + off, (g * w).to(out_ptr.dtype.element_ty), mask=hm)
                            tl.store(dw_ptr + t * E + e, tl.sum(acc, axis=0))
                else:
                    if HAS_PROBS:
                        for j in range(cnt):
                            dest = tl.load(row + j).to(tl.int64)
                            if dest >= 0:
                                e = tl.load(row + E + j)
                                if PADDED:
                                    dest += tl.load(pad_ptr + e)
                                tl.store(pout_ptr + dest, tl.load(probs_ptr + t * E + e))
                    # Read each slice of the token once and write it to all its experts.
                    for h0 in range(0, H, BLOCK_H):
                        off = h0 + tl.arange(0, BLOCK_H)
                        hm = off < H
                        v = tl.load(xrow + off, mask=hm)
                        for j in range(cnt):
                            dest = tl.load(row + j).to(tl.int64)
                            if dest >= 0:
                                if PADDED:
                                    dest += tl.load(pad_ptr + tl.load(row + E + j))
                                tl.store(out_ptr + dest * H + off, v, mask=hm)
    else:
        rows = (pid - n_tok) * FILL_ROWS + tl.arange(0, FILL_ROWS)
        e = tl.arange(0, BLOCK_E)
        em = e < E
        s = tl.load(seg_start_ptr + e, mask=em, other=0)
        c = tl.load(seg_count_ptr + e, mask=em, other=0)
        inside = (rows[:, None] >= s[None, :]) & (rows[:, None] < (s + c)[None, :])
        used = tl.sum(inside.to(tl.int32), axis=1)
        zero = (used == 0) & (rows < N_OUT)
        if tl.sum(zero.to(tl.int32), axis=0) > 0:
            r64 = rows.to(tl.int64)
            if HAS_PROBS:
                tl.store(pout_ptr + r64, tl.zeros([FILL_ROWS], dtype=pout_ptr.dtype.element_ty), mask=zero)
            for h0 in range(0, H, BLOCK_H):
                off = h0 + tl.arange(0, BLOCK_H)
                m = zero[:, None] & (off < H)[None, :]
                tl.store(out_ptr + r64[:, None] * H + off[None, :],
                         tl.zeros([FILL_ROWS, BLOCK_H], dtype=out_ptr.dtype.element_ty), mask=m)


@triton.jit
def permute_kernel(x_ptr, rid_ptr, pad_ptr, seg_start_ptr, seg_count_ptr, T, H, E, N_OUT,
                   out_prealloc, out_ptr,
                   PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                   FILL_ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    _scatter_body(x_ptr, rid_ptr, pad_ptr, seg_start_ptr, seg_count_ptr, x_ptr, x_ptr, x_ptr,
                  T, H, E, N_OUT, out_ptr, out_ptr, out_ptr,
                  False, False, PADDED, BLOCK_H, ROWS, FILL_ROWS, BLOCK_E)


@triton.jit
def permute_probs_kernel(x_ptr, rid_ptr, pad_ptr, seg_start_ptr, seg_count_ptr, probs_ptr, T, H, E, N_OUT,
                         out_prealloc, pout_prealloc, out_ptr, pout_ptr,
                         PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                         FILL_ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    _scatter_body(x_ptr, rid_ptr, pad_ptr, seg_start_ptr, seg_count_ptr, probs_ptr, x_ptr, x_ptr,
                  T, H, E, N_OUT, out_ptr, pout_ptr, out_ptr,
                  True, False, PADDED, BLOCK_H, ROWS, FILL_ROWS, BLOCK_E)


@triton.jit
def scatter_weighted_kernel(g_ptr, rid_ptr, pad_ptr, seg_start_ptr, seg_count_ptr, w_ptr, y_ptr, T, H, E, N_OUT,
                            out_prealloc, dw_prealloc, out_ptr, dw_ptr,
                            PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                            FILL_ROWS: tl.constexpr, BLOCK_E: tl.constexpr):
    _scatter_body(g_ptr, rid_ptr, pad_ptr, seg_start_ptr, seg_count_ptr, w_ptr, w_ptr, y_ptr,
                  T, H, E, N_OUT, out_ptr, out_ptr, dw_ptr,
                  False, True, PADDED, BLOCK_H, ROWS, FILL_ROWS, BLOCK_E)


@triton.jit
def _gather_body(y_ptr, rid_ptr, pad_ptr, w_ptr, gpp_ptr, T, H, E, out_ptr, dprobs_ptr,
                 WEIGHTED: tl.constexpr, HAS_PGRAD: tl.constexpr, PADDED: tl.constexpr,
                 BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    pid = tl.program_id(0)
    W = 2 * E + 1
    for r in tl.static_range(ROWS):
        t = (pid * ROWS + r).to(tl.int64)
        if t < T:
            row = rid_ptr + t * W
            cnt = tl.load(row + 2 * E)
            for h0 in range(0, H, BLOCK_H):
                off = h0 + tl.arange(0, BLOCK_H)
                hm = off < H
                acc = tl.zeros([BLOCK_H], dtype=tl.float32)
                for j in range(cnt):
                    dest = tl.load(row + j).to(tl.int64)
                    if dest >= 0:
                        e = tl.load(row + E + j)
                        if PADDED:
                            dest += tl.load(pad_ptr + e)
                        v = tl.load(y_ptr + dest * H + off, mask=hm, other=0).to(tl.float32)
                        if WEIGHTED:
                            v = v * tl.load(w_ptr + t * E + e)
                        acc += v
                tl.store(out_ptr + t * H + off, acc.to(out_ptr.dtype.element_ty), mask=hm)
            if HAS_PGRAD:
                for j in range(cnt):
                    dest = tl.load(row + j).to(tl.int64)
                    if dest >= 0:
                        e = tl.load(row + E + j)
                        if PADDED:
                            dest += tl.load(pad_ptr + e)
                        tl.store(dprobs_ptr + t * E + e, tl.load(gpp_ptr + dest))


@triton.jit
def unpermute_kernel(y_ptr, rid_ptr, pad_ptr, T, H, E, out_prealloc, out_ptr,
                     PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    _gather_body(y_ptr, rid_ptr, pad_ptr, y_ptr, y_ptr, T, H, E, out_ptr, out_ptr,
                 False, False, PADDED, BLOCK_H, ROWS)


@triton.jit
def unpermute_weighted_kernel(y_ptr, rid_ptr, pad_ptr, w_ptr, T, H, E, out_prealloc, out_ptr,
                              PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    _gather_body(y_ptr, rid_ptr, pad_ptr, w_ptr, w_ptr, T, H, E, out_ptr, out_ptr,
                 True, False, PADDED, BLOCK_H, ROWS)


@triton.jit
def unpermute_pgrad_kernel(y_ptr, rid_ptr, pad_ptr, gpp_ptr, T, H, E, out_prealloc, dprobs_prealloc,
                           out_ptr, dprobs_ptr,
                           PADDED: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr):
    _gather_body(y_ptr, rid_ptr, pad_ptr, gpp_ptr, gpp_ptr, T, H, E, out_ptr, dprobs_ptr,
                 False, True, PADDED, BLOCK_H, ROWS)
