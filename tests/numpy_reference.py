"""Independent NumPy reference for MoE dispatch/combine: plain loops, no shared code."""
from __future__ import annotations

import numpy as np


def dispatch_layout(rm: np.ndarray, num_out_tokens: int, align: int | None):
    """dest[t, e] output row (-1 if not routed or dropped), kept counts, pad_offsets, rows."""
    t, e = rm.shape
    order = [(tok, ex) for ex in range(e) for tok in range(t) if rm[tok, ex]]
    kept = np.zeros(e, np.int64)
    unpadded = -np.ones((t, e), np.int64)
    for i, (tok, ex) in enumerate(order):
        if i < num_out_tokens:
            unpadded[tok, ex] = i
            kept[ex] += 1
    if align is None:
        return unpadded, kept, None, num_out_tokens
    padded_counts = [(c + align - 1) // align * align for c in kept]
    pad = np.zeros(e, np.int64)
    for ex in range(1, e):
        pad[ex] = pad[ex - 1] + padded_counts[ex - 1] - kept[ex - 1]
    dest = -np.ones((t, e), np.int64)
    for tok in range(t):
        for ex in range(e):
            if unpadded[tok, ex] >= 0:
                dest[tok, ex] = unpadded[tok, ex] + pad[ex]
    # The buffer: worst-case padding, rounded down to a multiple of align.
    return dest, np.array(padded_counts), pad, (num_out_tokens + e * (align - 1)) // align * align


def row_id_map(rm: np.ndarray, num_out_tokens: int, pad_offsets: np.ndarray | None = None) -> np.ndarray:
    """The [T, 2E+1] map; with ``pad_offsets`` its destinations are the padded rows."""
    t, e = rm.shape
    unpadded, _, _, _ = dispatch_layout(rm, num_out_tokens, None)
    if pad_offsets is not None:
        unpadded = np.where(unpadded >= 0, unpadded + np.asarray(pad_offsets)[None, :], -1)
    out = -np.ones((t, 2 * e + 1), np.int64)
    for tok in range(t):
        j = 0
        for ex in range(e):
            if rm[tok, ex]:
                out[tok, j] = unpadded[tok, ex]
                out[tok, e + j] = ex
                j += 1
        out[tok, 2 * e] = j
    return out


def dispatch(x, rm, num_out_tokens, probs=None, align=None):
    dest, tpe, pad, rows = dispatch_layout(rm, num_out_tokens, align)
    out = np.zeros((rows, x.shape[1]), x.dtype)
    pp = np.zeros(rows, np.float32)
    for tok in range(rm.shape[0]):
        for ex in range(rm.shape[1]):
            if dest[tok, ex] >= 0:
                out[dest[tok, ex]] = x[tok]
                if probs is not None:
                    pp[dest[tok, ex]] = probs[tok, ex]
    return out, (pp if probs is not None else None), dest, pad, tpe


def combine(y, dest, w=None):
    t, e = dest.shape
    out = np.zeros((t, y.shape[1]), np.float64)
    for tok in range(t):
        for ex in range(e):
            if dest[tok, ex] >= 0:
                out[tok] += y[dest[tok, ex]].astype(np.float64) * (1.0 if w is None else float(w[tok, ex]))
    return out


def dispatch_vjp(g_out, g_pp, dest):
    """Gradients of dispatch w.r.t. tokens and probs."""
    t, e = dest.shape
    gx = np.zeros((t, g_out.shape[1]), np.float64)
    gp = np.zeros((t, e), np.float64)
    for tok in range(t):
        for ex in range(e):
            if dest[tok, ex] >= 0:
                gx[tok] += g_out[dest[tok, ex]]
                if g_pp is not None:
                    gp[tok, ex] = g_pp[dest[tok, ex]]
    return gx, gp


def combine_vjp(g, y, dest, w=None):
    """Gradients of combine w.r.t. expert rows and merging probs."""
    t, e = dest.shape
    gy = np.zeros(y.shape, np.float64)
    gw = np.zeros((t, e), np.float64)
    for tok in range(t):
        for ex in range(e):
            d = dest[tok, ex]
            if d >= 0:
                gy[d] = g[tok] * (1.0 if w is None else float(w[tok, ex]))
                gw[tok, ex] = float(np.dot(y[d].astype(np.float64), g[tok].astype(np.float64)))
    return gy, gw


def map_entries(rid, n, pad=None):
    """``(entry, token, expert, row)`` of every usable entry of any [T, 2E+1] map, in entry
    order (``entry = t*E + j``): a token's first ``cnt`` columns (clamped to [0, E]) whose
    expert is in [0, E) and whose row (plus ``pad[expert]`` when given) is in [0, n)."""
    t, e = rid.shape[0], (rid.shape[1] - 1) // 2
    for tok in range(t):
        for j in range(min(max(int(rid[tok, 2 * e]), 0), e)):
            d, ex = int(rid[tok, j]), int(rid[tok, e + j])
            if d < 0 or not 0 <= ex < e:
                continue
            d += 0 if pad is None else int(pad[ex])
            if 0 <= d < n:
                yield tok * e + j, tok, ex, d


def map_gather(y, rid, pad=None, w=None, gpp=None):
    """What each token gathers through any [T, 2E+1] map, entry by entry (:func:`map_entries`),
    each entry adding its row (times ``w[t, expert]``); ``(rows, grad_probs)``,
    ``grad_probs[t, expert] = gpp[row]`` of the token's last such entry."""
    t, e = rid.shape[0], (rid.shape[1] - 1) // 2
    out = np.zeros((t, y.shape[1]), np.float64)
    gp = np.zeros((t, e), np.float64)
    for _, tok, ex, d in map_entries(rid, y.shape[0], pad):
        out[tok] += y[d].astype(np.float64) * (1.0 if w is None else float(w[tok, ex]))
        if gpp is not None:
            gp[tok, ex] = gpp[d]
    return out, gp


def map_scatter_weighted(g, y, rid, pad=None, w=None):
    """The combine backward through any [T, 2E+1] map, entry by entry (the entries of
    :func:`map_entries`): each output row is written by its highest entry ``t*E + j``
    only (its owner; unowned rows zero) with ``g[t] * w[t, expert]``, and that entry's
    ``grad_w[t, expert] = <g[t], y[row]>``; of a token's entries naming one expert, the last
    that owns its row gives the gradient."""
    t, e = rid.shape[0], (rid.shape[1] - 1) // 2
    entries = list(map_entries(rid, y.shape[0], pad))
    owner = {}
    for entry, tok, ex, d in entries:
        owner[d] = max(owner.get(d, -1), entry)
    gy = np.zeros(y.shape, np.float64)
    gw = np.zeros((t, e), np.float64)
    for entry, tok, ex, d in entries:   # in entry order: a later entry's gradient replaces
        if owner[d] == entry:
            gy[d] = g[tok] * (1.0 if w is None else float(w[tok, ex]))
            gw[tok, ex] = float(np.dot(y[d].astype(np.float64), g[tok].astype(np.float64)))
    return gy, gw
