"""Triton source of the fused MoE layer's first expert GEMM (``moe_ffn``'s forward).

``moe_gather_gemm_kernel``: ``out[r] = x[token(r)] @ B_g`` over the ``M`` expert-sorted rows a
dispatch would produce (grouped by expert, ``group_sizes`` rows each, the grouped GEMM's tile
schedule: ``group_tile`` of :mod:`te_jax_perm.kernels.grouped_gemm`), but the token rows are
never copied into them: ``owner[r]``, the row's one writing map entry ``t*E + j + 1`` (0 for
none, as ``row_owner`` computes it), names the token ``t = (owner[r] - 1) // E`` whose row the
GEMM reads (``row_tokens``).

Every output element is written by exactly one program (no atomics): row tiles own disjoint
rows. Rows with no owner (padding, unused budget), rows past the groups, and rows whose
owner names a token outside ``[0, T)`` read zeros and are written as zeros; group sizes are
clamped as the grouped GEMM clamps them. Whatever ``owner`` and ``group_sizes`` hold, no
program addresses memory outside its buffers.
"""
import triton
import triton.language as tl

from te_jax_perm.kernels.grouped_gemm import group_tile, tile_dot


@triton.jit
def row_tokens(owner_ptr, rows, live, T, G: tl.constexpr):
    """(token int64, owned) of each of ``rows`` through an owner table (``owner[r] = t*G + j + 1``,
    0 for none): owned where ``live`` and the owner names a token in ``[0, T)``; token 0 where
    not owned (an address that is never read)."""
    own = tl.load(owner_ptr + rows, mask=live, other=0)
    tok = (tl.maximum(own, 1) - 1) // G
    owned = live & (own > 0) & (tok < T)
    return tl.where(owned, tok, 0).to(tl.int64), owned


@triton.jit
def moe_gather_gemm_kernel(x_ptr, rhs_ptr, group_sizes_ptr, owner_ptr, M, T, out_prealloc_ptr, out_ptr,
                           C: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                           PRECISION: tl.constexpr):
    """out [M, D]: row r = x[token(r)] @ rhs[g] (x [T, C], rhs [G, C, D])."""
    g, is_group_tile, row0, row_end, tile_n = group_tile(group_sizes_ptr, M, D, G, G_P2, BM, BN, GROUP_M)
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    # Only group tiles have owners: a fill tile's rows may be named by a stale table, but
    # they belong to no group (and ``g`` names none), so they read nothing. (A bound rather
    # than ``row_ok & is_group_tile``: Triton's interpreter gives a block ANDed with a scalar
    # the wrong mask dtype.)
    tok, owned = row_tokens(owner_ptr, rows, rows < tl.where(is_group_tile, row_end, 0), T, G)
    cols = tile_n * BN + tl.arange(0, BN)
    col_ok = cols < D
    acc = tile_dot(x_ptr, tok, owned, rhs_ptr, g, is_group_tile, cols, col_ok, C, D, False, BM, BN, BK, PRECISION)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * D + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
