"""Permute token rows into expert-sorted rows and back, through a row-id map.

``permute_with_mask_map`` / ``unpermute_with_mask_map`` are differentiable (custom VJPs
whose backward passes are the opposite kernel), jit-able and vmap-able. Every launch,
forward and backward, is a declared kernel with aliased preallocated outputs.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare
from te_jax_perm.core.sharding import Partitioning
from te_jax_perm.kernels import permute as K
from te_jax_perm.ops import _checks
from te_jax_perm.ops._bits import from_bits, to_bits

FILL_ROWS = 16  # output rows per zero-fill program (only rows no token writes are touched)


# -- configs shared by all row-moving kernels ------------------------------------------
def _key_bucket(name: str, v: int) -> int:
    return triton.next_power_of_2(max(v, 1)) if name == "T" else v


MAX_TILE = 16384  # elements of one program's [ROWS, BLOCK_H] tile: 32 KB of bf16


def _pow2_at_most(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def _default_config(d, p) -> Config:
    """Whole rows per program (up to 8192 elements: 16 KB of bf16, so H=7168 is one step),
    ~8192 elements per program so each thread keeps four 16-byte vectors in flight, and
    enough warps for that: 8 warps at H in {2880, 4096, 7168} (bf16: 2 rows of 4096 lanes,
    or 1 row of 8192 lanes; masked lanes past H move no bytes). Dtype-agnostic: fp32 rows
    double the bytes per thread, still well within registers (checked in the PTX test)."""
    block_h = min(triton.next_power_of_2(max(d["H"], 16)), 8192)
    rows = min(max(1, 8192 // block_h), 4, _pow2_at_most(d["T"]))
    return Config.make(num_warps=max(1, min(8, rows * block_h // 1024)), BLOCK_H=block_h, ROWS=rows)


_CONFIGS = tuple(Config.make(num_warps=w, BLOCK_H=bh, ROWS=r)
                 for bh in (128, 256, 512, 1024, 2048, 4096, 8192) for r in (1, 2, 4)
                 for w in (2, 4, 8) if r * bh <= MAX_TILE)


def _block_h_ok(d, p, c) -> str | None:
    bh = c.kw["BLOCK_H"]
    if bh <= 0 or bh & (bh - 1):
        return f"BLOCK_H={bh} is not a power of two"
    if bh > 2 * triton.next_power_of_2(max(d["H"], 16)):
        return f"BLOCK_H={bh} is over twice the row width H={d['H']} (all-masked lanes)"
    if bh * c.kw["ROWS"] > MAX_TILE:
        return f"ROWS*BLOCK_H = {bh * c.kw['ROWS']} > {MAX_TILE} (register tile too large)"
    return None


def _rows_ok(d, p, c) -> str | None:
    # Programs own the disjoint token ranges [pid*ROWS, pid*ROWS+ROWS) by construction;
    # ROWS beyond the token count would only add idle iterations.
    r = c.kw["ROWS"]
    if r < 1:
        return f"ROWS={r} must be >= 1"
    if r > 1 and r > d["T"]:
        return f"ROWS={r} exceeds the token count T={d['T']}"
    return None


_CONSTRAINTS = (_block_h_ok, _rows_ok)


def _map_check(d, p) -> None:
    if d["W"] != 2 * d["E"] + 1:
        raise ValueError(f"row_id_map has {d['W']} columns; expected 2*E+1 = {2 * d['E'] + 1} for E={d['E']} "
                         "experts (from pad_offsets)")


def _common(**kw: Any) -> dict:
    return dict(configs=_CONFIGS, constraints=_CONSTRAINTS, default_config=_default_config,
                key_dims=("T", "H"), key_bucket=_key_bucket, params_check=_map_check, **kw)


# -- pure-JAX references (the ``xla`` backend) -----------------------------------------
# These are the CPU default and the pure-XLA baseline on GPU, so they must stay O(N*H + T*H
# + T*E) in memory: never a [T, E, H] tensor (60 GB at T=8192, E=256, H=7168). Every op goes
# through the inverse map (output row -> token, expert), built from int32 [T, E] entries, and
# then moves or sums whole rows by gathers and segment sums over the N output rows.
def _dests(rid, pad, padded):
    """(dest [T,E] with -1 where dropped, expert ids [T,E] clipped to [0,E), valid [T,E])."""
    e = (rid.shape[1] - 1) // 2
    dest, ex = rid[:, :e], rid[:, e:2 * e]
    valid = dest >= 0
    if padded:
        dest = dest + pad[jnp.clip(ex, 0, e - 1)]
    return jnp.where(valid, dest, -1), jnp.clip(ex, 0, e - 1), valid


def _inverse_map(rid, pad, padded, n):
    """Per output row: (token int32 [n], expert int32 [n]); rows no token writes (padding,
    unused budget) get token T and expert E, which index the zero row/column that callers
    pad their [T, .] and [T, E] arrays with."""
    t, e = rid.shape[0], (rid.shape[1] - 1) // 2
    dest, ex, valid = _dests(rid, pad, padded)
    # Out-of-range rows (dropped entries point at row n) fall into the extra slot, sliced off.
    safe = jnp.where(valid, dest, n).ravel()
    tok = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[:, None], dest.shape).ravel()
    row_token = jnp.full((n + 1,), t, jnp.int32).at[safe].set(tok, mode="drop")[:n]
    row_expert = jnp.full((n + 1,), e, jnp.int32).at[safe].set(ex.ravel().astype(jnp.int32), mode="drop")[:n]
    return row_token, row_expert


def _pad_rows(x):
    """``x`` with one zero row appended (the row unwritten output rows gather)."""
    return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], axis=0)


def _weights_at(w, row_token, row_expert):
    """``w[token, expert]`` per output row as float32, 0 for unwritten rows."""
    wp = jnp.pad(w.astype(jnp.float32), ((0, 1), (0, 1)))
    return wp[row_token, row_expert]


def _scatter_ref(x, rid, pad, seg_start, seg_count, probs=None, *, num_out_rows, padded):
    del seg_start, seg_count
    row_token, row_expert = _inverse_map(rid, pad, padded, num_out_rows)
    # A gather of N rows (zero row for unwritten ones): bit-exact data movement.
    out = _pad_rows(x)[row_token]
    if probs is None:
        return (out,)
    pout = jnp.pad(probs, ((0, 1), (0, 1)))[row_token, row_expert]
    return out, pout


def _scatter_weighted_ref(g, rid, pad, seg_start, seg_count, w, y, *, padded):
    del seg_start, seg_count
    n, t, e = y.shape[0], g.shape[0], w.shape[1]
    row_token, row_expert = _inverse_map(rid, pad, padded, n)
    g_rows = _pad_rows(g.astype(jnp.float32))[row_token]  # [N, H]; zero for unwritten rows
    out = (g_rows * _weights_at(w, row_token, row_expert)[:, None]).astype(y.dtype)
    # d w[t, e] = <g[t], y[r]> for the row r of (t, e): N dots over H, scattered into [T, E].
    dots = jnp.sum(g_rows * y.astype(jnp.float32), axis=-1)
    dw = jnp.zeros((t + 1, e + 1), jnp.float32).at[row_token, row_expert].set(dots, mode="drop")[:t, :e]
    return out, dw


def _gather_ref(y, rid, pad, w=None, gpp=None, *, padded):
    n, t, e = y.shape[0], rid.shape[0], (rid.shape[1] - 1) // 2
    row_token, row_expert = _inverse_map(rid, pad, padded, n)
    rows = y.astype(jnp.float32)
    if w is not None:
        rows = rows * _weights_at(w, row_token, row_expert)[:, None]
    # Unwritten rows go to segment T, which is sliced off; f32 accumulation, then cast.
    out = jax.ops.segment_sum(rows, row_token, num_segments=t + 1)[:t].astype(y.dtype)
    if gpp is None:
        return (out,)
    # d probs[t, e] = gpp[r] for the row r of (t, e): N scalars scattered into [T, E].
    dprobs = jnp.zeros((t + 1, e + 1), jnp.float32).at[row_token, row_expert].set(
        gpp.astype(jnp.float32), mode="drop")[:t, :e]
    return out, dprobs


# -- valid autotuning operands ----------------------------------------------------------
# Random ints are not a row-id map; trial operands come from a real map of top-k routing,
# with padding and drops as the params ask, so every candidate config can be validated.
def _np_row_id_map(rm: np.ndarray, drop_at: int) -> tuple[np.ndarray, np.ndarray]:
    """(row_id_map int32 [T, 2E+1], kept int32 [E]) of a bool [T, E] routing map."""
    t, e = rm.shape
    m = rm.astype(np.int64)
    totals = m.sum(axis=0)
    start = np.cumsum(totals) - totals
    dest = start[None, :] + np.cumsum(m, axis=0) - m
    rank = np.cumsum(m, axis=1) - m  # routed experts before each expert
    col = np.where(rm, rank, m.sum(axis=1, keepdims=True) + np.arange(e) - rank)
    order = np.argsort(col, axis=1, kind="stable")
    vd = np.where(rm & (dest < drop_at), dest, -1)
    ve = np.where(rm, np.arange(e)[None, :], -1)
    rid = np.concatenate([np.take_along_axis(vd, order, 1), np.take_along_axis(ve, order, 1),
                          m.sum(axis=1, keepdims=True)], axis=1).astype(np.int32)
    return rid, np.clip(drop_at - start, 0, totals).astype(np.int32)


def _np_layout(t: int, e: int, rows: int, padded: bool, rng: np.random.Generator):
    """A row-id map, pad offsets and segments whose rows fit in ``rows`` output rows."""
    k = min(e, 4)
    top = np.argsort(rng.random((t, e)), axis=1)[:, :k]
    rm = np.zeros((t, e), bool)
    np.put_along_axis(rm, top, True, axis=1)
    align = 4 if padded and rows > e * 3 else 1
    rid, kept = _np_row_id_map(rm, rows - e * (align - 1))
    padded_counts = -(-kept // align) * align
    pad = ((np.cumsum(padded_counts) - padded_counts) - (np.cumsum(kept) - kept)).astype(np.int32)
    return rid, pad, (np.cumsum(kept) - kept + pad).astype(np.int32), kept


def _rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _scatter_example(with_probs: bool):
    def make(dims, params, dtypes, rng):
        t, h, e = dims["T"], dims["H"], dims["E"]
        rid, pad, ss, sc = _np_layout(t, e, params["num_out_rows"], params["padded"], rng)
        ops = (_rand(rng, (t, h), dtypes["inp"]), rid, pad, ss, sc)
        return ops + ((rng.random((t, e)).astype(dtypes["probs"]),) if with_probs else ())
    return make


def _scatter_weighted_example(dims, params, dtypes, rng):
    t, h, e, n = dims["T"], dims["H"], dims["E"], dims["N"]
    rid, pad, ss, sc = _np_layout(t, e, n, params["padded"], rng)
    return (_rand(rng, (t, h), dtypes["grad"]), rid, pad, ss, sc,
            rng.random((t, e)).astype(dtypes["merging_probs"]), _rand(rng, (n, h), dtypes["fwd_inp"]))


def _gather_example(extra: str | None):
    def make(dims, params, dtypes, rng):
        t, h, e, n = dims["T"], dims["H"], dims["E"], dims["N"]
        rid, pad, _, _ = _np_layout(t, e, n, params["padded"], rng)
        ops = (_rand(rng, (n, h), dtypes["inp"]), rid, pad)
        if extra == "merging_probs":
            ops += (rng.random((t, e)).astype(dtypes[extra]),)
        elif extra == "grad_permuted_probs":
            ops += (rng.random(n).astype(dtypes[extra]),)
        return ops
    return make


# -- declarations ----------------------------------------------------------------------
# Token dtypes are checked by the public functions (core's "float" kind misses bfloat16).
_X = Operand("inp", ("T", "H"))
_RID = Operand("row_id_map", ("T", "W"), ("int32",))
_PAD = Operand("pad_offsets", ("E",), ("int32",))
_SEG = (Operand("seg_start", ("E",), ("int32",)), Operand("seg_count", ("E",), ("int32",)))
_TE32 = lambda name: Operand(name, ("T", "E"), ("float32",))  # noqa: E731


def _scatter_scalars(d, p):
    return {"T": d["T"], "E": d["E"], "N_OUT": p["num_out_rows"]}


def _scatter_grid(d, p, c):
    return (-(-d["T"] // c.kw["ROWS"]) + -(-p["num_out_rows"] // FILL_ROWS),)


def _scatter_constexprs(d, p, c):
    # H is compiled in (16-byte vector rows, see kernels/permute.py); it is an exact key dim.
    fill_h = max(16, min(triton.next_power_of_2(max(d["H"], 1)), 8192 // FILL_ROWS))
    return {"H": d["H"], "PADDED": p["padded"], "FILL_ROWS": FILL_ROWS,
            "BLOCK_E": triton.next_power_of_2(max(d["E"], 1)), "FILL_H": fill_h}


# Each H-slice of a row moves independently, so a kernel that only moves (and sums) rows is
# shard-local along H; never along tokens (rows go anywhere). Outputs without H (permuted
# probs, their gradients) come out whole and identical on every H-shard.
_H_LOCAL_SCATTER = Partitioning(outputs=(("R", "H"),), local=("H",))
_H_LOCAL_SCATTER_PROBS = Partitioning(outputs=(("R", "H"), ("R",)), local=("H",))

_out_rows = Output("out", lambda d, p: (p["num_out_rows"], d["H"]), lambda t, p: t["inp"])

permute_rows = declare(KernelDecl(
    name="permute", kernel=K.permute_kernel,
    operands=(_X, _RID, _PAD, *_SEG), outputs=(_out_rows,),
    params=("num_out_rows", "padded"), reference=_scatter_ref,
    grid=_scatter_grid, scalars=_scatter_scalars, constexprs=_scatter_constexprs,
    example_inputs=_scatter_example(False), partitioning=_H_LOCAL_SCATTER, key_params=("padded",), **_common()))

permute_rows_probs = declare(KernelDecl(
    name="permute_probs", kernel=K.permute_probs_kernel,
    operands=(_X, _RID, _PAD, *_SEG, _TE32("probs")),
    outputs=(_out_rows, Output("permuted_probs", lambda d, p: (p["num_out_rows"],), lambda t, p: jnp.float32)),
    params=("num_out_rows", "padded"), reference=_scatter_ref,
    grid=_scatter_grid, scalars=_scatter_scalars, constexprs=_scatter_constexprs,
    example_inputs=_scatter_example(True), partitioning=_H_LOCAL_SCATTER_PROBS, key_params=("padded",), **_common()))

scatter_weighted = declare(KernelDecl(
    name="unpermute_bwd_weighted", kernel=K.scatter_weighted_kernel,
    operands=(Operand("grad", ("T", "H")), _RID, _PAD, *_SEG, _TE32("merging_probs"),
              Operand("fwd_inp", ("N", "H"))),
    outputs=(Output("grad_inp", lambda d, p: (d["N"], d["H"]), lambda t, p: t["fwd_inp"]),
             Output("grad_probs", lambda d, p: (d["T"], d["E"]), lambda t, p: jnp.float32, init="zeros")),
    params=("padded",), reference=_scatter_weighted_ref,
    grid=lambda d, p, c: (-(-d["T"] // c.kw["ROWS"]) + -(-d["N"] // FILL_ROWS),),
    scalars=lambda d, p: {"T": d["T"], "E": d["E"], "N_OUT": d["N"]},
    constexprs=_scatter_constexprs, exact=False, rtol=1e-5, atol=1e-5,
    # Not H-local: grad_probs is a dot product over all of H (replicated).
    example_inputs=_scatter_weighted_example,
    key_params=("padded",), **_common()))


def _gather_pgrad_ref(y, rid, pad, gpp, *, padded):
    return _gather_ref(y, rid, pad, None, gpp, padded=padded)


def _gather_decl(name, kernel, extra_ops, extra_outs, exact=True, reference=_gather_ref):
    extra = extra_ops[0].name if extra_ops else None
    # Sums over a token's rows, slice by slice of H: H-local (grad_probs has no H axis).
    part = Partitioning(outputs=(("T", "H"),) + tuple(("T", "E") for _ in extra_outs), local=("H",))
    return declare(KernelDecl(
        name=name, kernel=kernel,
        operands=(Operand("inp", ("N", "H")), _RID, _PAD, *extra_ops),
        outputs=(Output("out", lambda d, p: (d["T"], d["H"]), lambda t, p: t["inp"]), *extra_outs),
        params=("padded",), reference=reference,
        grid=lambda d, p, c: (-(-d["T"] // c.kw["ROWS"]),),
        scalars=lambda d, p: {"T": d["T"], "E": d["E"]},
        constexprs=lambda d, p, c: {"H": d["H"], "PADDED": p["padded"]},
        exact=exact, rtol=1e-2, atol=1e-2, example_inputs=_gather_example(extra), partitioning=part,
        key_params=("padded",),
        **_common()))


unpermute_rows = _gather_decl("unpermute", K.unpermute_kernel, (), (), exact=False)
unpermute_rows_weighted = _gather_decl("unpermute_weighted", K.unpermute_weighted_kernel,
                                       (_TE32("merging_probs"),), (), exact=False)
unpermute_rows_pgrad = _gather_decl(
    "permute_bwd_probs", K.unpermute_pgrad_kernel, (Operand("grad_permuted_probs", ("N",), ("float32",)),),
    (Output("grad_probs", lambda d, p: (d["T"], d["E"]), lambda t, p: jnp.float32, init="zeros"),), exact=False,
    reference=_gather_pgrad_ref)


# -- helpers -----------------------------------------------------------------------------
def _segments(tokens_per_expert: jax.Array, pad: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Output row range [start, start+count) each expert's kept rows occupy."""
    kept = tokens_per_expert.astype(jnp.int32)
    return (jnp.cumsum(kept) - kept + pad).astype(jnp.int32), kept


def kept_per_expert(row_id_map: jax.Array) -> jax.Array:
    """Rows kept per expert, recovered from a row-id map (int32 [E])."""
    e = _checks.num_experts_of_map(row_id_map)
    valid = row_id_map[:, :e] >= 0
    ids = jnp.where(valid, row_id_map[:, e:2 * e], e).ravel()
    return jax.ops.segment_sum(valid.ravel().astype(jnp.int32), ids, num_segments=e + 1)[:e]


# -- differentiable cores ------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _permute(inp, probs, rid, pad, seg_start, seg_count, num_out_rows, padded, backend):
    return _permute_fwd(inp, probs, rid, pad, seg_start, seg_count, num_out_rows, padded, backend)[0]


def _permute_fwd(inp, probs, rid, pad, seg_start, seg_count, num_out_rows, padded, backend):
    kw = dict(backend=backend, num_out_rows=num_out_rows, padded=padded)
    x = to_bits(inp)
    if probs is None:
        (out,), pout = permute_rows(x, rid, pad, seg_start, seg_count, **kw), None
    else:
        out, pout = permute_rows_probs(x, rid, pad, seg_start, seg_count, probs, **kw)
    return (from_bits(out, inp.dtype), pout), (rid, pad)


def _permute_bwd(num_out_rows, padded, backend, res, cts):
    rid, pad = res
    g_out, g_pout = cts
    if g_pout is not None:
        g_inp, g_probs = unpermute_rows_pgrad(g_out, rid, pad, g_pout, backend=backend, padded=padded)
    else:
        (g_inp,), g_probs = unpermute_rows(g_out, rid, pad, backend=backend, padded=padded), None
    return g_inp, g_probs, None, None, None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _unpermute(inp, merging_probs, rid, pad, tokens_per_expert, padded, backend):
    return _unpermute_fwd(inp, merging_probs, rid, pad, tokens_per_expert, padded, backend)[0]


def _unpermute_fwd(inp, merging_probs, rid, pad, tokens_per_expert, padded, backend):
    if merging_probs is None:
        (out,) = unpermute_rows(inp, rid, pad, backend=backend, padded=padded)
    else:
        (out,) = unpermute_rows_weighted(inp, rid, pad, merging_probs, backend=backend, padded=padded)
    return out, (inp, merging_probs, rid, pad, tokens_per_expert)


def _unpermute_bwd(padded, backend, res, g):
    inp, merging_probs, rid, pad, tokens_per_expert = res
    kept = kept_per_expert(rid) if tokens_per_expert is None else tokens_per_expert
    seg_start, seg_count = _segments(kept, pad)
    if merging_probs is None:
        g_inp, _ = _permute_fwd(g.astype(inp.dtype), None, rid, pad, seg_start, seg_count,
                                inp.shape[0], padded, backend)[0]
        g_w = None
    else:
        g_inp, g_w = scatter_weighted(g, rid, pad, seg_start, seg_count, merging_probs, inp,
                                      backend=backend, padded=padded)
    return g_inp, g_w, None, None, None


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


# -- public API ------------------------------------------------------------------------------
def permute_with_mask_map(inp: jax.Array, row_id_map: jax.Array, tokens_per_expert: jax.Array,
                          num_out_rows: int, probs: jax.Array | None = None,
                          pad_offsets: jax.Array | None = None, backend: str | None = None
                          ) -> tuple[jax.Array, jax.Array | None]:
    """Scatters token rows to expert-sorted rows.

    Args:
      inp: ``[T, H]`` tokens (bf16, fp16, fp32 or fp8 e4m3; copied bit-exactly).
      row_id_map: int32 ``[T, 2E+1]`` from :func:`make_row_id_map`.
      tokens_per_expert: int32 ``[E]`` rows *kept* per expert before padding (the second
        result of :func:`make_row_id_map`); it tells which output rows are padding.
      num_out_rows: static output row count (``num_out_tokens``, plus ``E*(align_size-1)``
        when padded).
      probs: optional float32 ``[T, E]``; permuted alongside the rows.
      pad_offsets: optional int32 ``[E]``: rows of padding inserted before each expert.
      backend: ``"triton"``, ``"interpret"``, ``"xla"`` or ``None`` (default).

    Returns:
      ``(out [num_out_rows, H] inp.dtype, permuted_probs [num_out_rows] float32 or None)``.
      Output rows that no token fills (padding, unused budget) are zero.
    """
    _checks.check_rank("inp", inp, (2,), "[T, H]")
    _checks.check_token_dtype("inp", inp)
    e = _checks.num_experts_of_map(row_id_map)
    _checks.check_shape("row_id_map", row_id_map, (inp.shape[0], 2 * e + 1),
                        f"[T={inp.shape[0]}, 2E+1] (T from inp {tuple(inp.shape)})")
    _checks.check_shape("tokens_per_expert", tokens_per_expert, (e,), f"[E={e}]")
    num_out_rows = _checks.check_static_int("num_out_rows", num_out_rows, 0)
    if probs is not None:
        _checks.check_shape("probs", probs, (inp.shape[0], e), f"[T={inp.shape[0]}, E={e}]")
        _checks.check_float32("probs", probs)
    padded = pad_offsets is not None
    pad = _pad_or_zeros(pad_offsets, e)
    seg_start, seg_count = _segments(tokens_per_expert, pad)
    return _permute(inp, probs, row_id_map, pad, seg_start, seg_count, num_out_rows, padded, backend)


def unpermute_with_mask_map(inp: jax.Array, row_id_map: jax.Array, merging_probs: jax.Array | None = None,
                            pad_offsets: jax.Array | None = None, tokens_per_expert: jax.Array | None = None,
                            backend: str | None = None) -> jax.Array:
    """Gathers each token's expert rows and sums them (weighted by ``merging_probs``).

    Args:
      inp: ``[N, H]`` expert-sorted rows (as produced by :func:`permute_with_mask_map`).
      row_id_map: int32 ``[T, 2E+1]``.
      merging_probs: optional float32 ``[T, E]`` weights; unweighted sum when ``None``.
      pad_offsets: int32 ``[E]`` when ``inp`` is padded; padding rows are ignored.
      tokens_per_expert: optional int32 ``[E]`` kept rows per expert (unpadded); only the
        backward pass uses it (to know which gradient rows are padding) and recovers it
        from ``row_id_map`` when omitted.
      backend: as for :func:`permute_with_mask_map`.

    Returns:
      ``[T, H]`` in ``inp.dtype``, accumulated in float32.
    """
    _checks.check_rank("inp", inp, (2,), "[N, H]")
    _checks.check_token_dtype("inp", inp)
    e = _checks.num_experts_of_map(row_id_map)
    t = row_id_map.shape[0]
    if merging_probs is not None:
        _checks.check_shape("merging_probs", merging_probs, (t, e), f"[T={t}, E={e}] (from row_id_map)")
        _checks.check_float32("merging_probs", merging_probs)
    if tokens_per_expert is not None:
        _checks.check_shape("tokens_per_expert", tokens_per_expert, (e,), f"[E={e}]")
    padded = pad_offsets is not None
    pad = _pad_or_zeros(pad_offsets, e)
    return _unpermute(inp, merging_probs, row_id_map, pad, tokens_per_expert, padded, backend)


def _pad_or_zeros(pad_offsets, e):
    if pad_offsets is None:
        return jnp.zeros((e,), jnp.int32)
    _checks.check_shape("pad_offsets", pad_offsets, (e,), f"[E={e}]")
    return jnp.asarray(pad_offsets).astype(jnp.int32)
