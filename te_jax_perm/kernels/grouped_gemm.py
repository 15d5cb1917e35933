"""Triton sources of the grouped GEMM used for MoE expert layers.

Rows of ``lhs`` are grouped contiguously (group ``g`` owns rows ``[start_g, end_g)``, the
layout ``token_dispatch`` produces); every group multiplies its rows by its own matrix.
Group sizes are device values, so the tile schedule is computed inside the kernel: each
tile index maps to a group by a prefix sum over the (clamped) group sizes. The forward and
input-gradient kernel runs one program per tile with pointer loads, or (``TMA``) a fixed
number of programs that loop over the tiles and load them by tensor descriptors built on
the device once per program (TMA on Hopper).

Bounds: sizes are clamped to ``[0, M]`` and row ends to ``M`` before anything is
addressed, so no value of ``group_sizes`` (negative, huge, or summing past ``M``) makes a
program touch rows outside ``lhs``/``out``; rows past the last group are written as zeros.
Tiles mask their stores at the group's end (TMA tiles store whole through a descriptor
where the tile lies inside its group).
"""
import triton
import triton.language as tl


@triton.jit
def group_bounds(gs_ptr, M, G: tl.constexpr, G_P2: tl.constexpr):
    """Clamped [start, end) row range of every group, as int64 vectors of length G_P2."""
    g_idx = tl.arange(0, G_P2)
    sizes = tl.load(gs_ptr + g_idx, mask=g_idx < G, other=0).to(tl.int64)
    sizes = tl.minimum(tl.maximum(sizes, 0), M)
    incl = tl.cumsum(sizes, 0)
    ends = tl.minimum(incl, M)
    starts = tl.minimum(incl - sizes, M)
    return g_idx, starts, ends


@triton.jit
def row_schedule(group_sizes_ptr, M, G: tl.constexpr, G_P2: tl.constexpr, BM: tl.constexpr):
    """The row tiles of a grouped GEMM, as vectors over the groups: ``(g_idx, starts, ends,
    tiles, tile_ends)``, group ``g`` owning row tiles ``[tile_ends[g] - tiles[g],
    tile_ends[g])``, each inside the group's rows; then ``total_tiles`` (the groups' tiles)
    and ``used_rows`` (the rows they cover)."""
    g_idx, starts, ends = group_bounds(group_sizes_ptr, M, G, G_P2)
    tiles = (ends - starts + BM - 1) // BM
    return g_idx, starts, ends, tiles, tl.cumsum(tiles, 0), tl.sum(tiles, 0), tl.max(ends, 0)


@triton.jit
def swizzled_tile(t, num_m, num_n, GROUP_M: tl.constexpr):
    """(tile_m, tile_n) of tile ``t`` of ``num_m x num_n``: consecutive tiles walk GROUP_M row
    tiles before moving along N, so a column block of the other operand is reused from L2
    by several row tiles."""
    per_band = GROUP_M * num_n
    first_m = (t // per_band) * GROUP_M
    band_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % per_band) % band_m, (t % per_band) // band_m


@triton.jit
def schedule_tile(t, M, num_n: tl.constexpr, g_idx, starts, ends, tiles, tile_ends, total_tiles, used_rows,
                  G: tl.constexpr, BM: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``t`` of a ``row_schedule`` times ``num_n`` column tiles: ``(g, is_group_tile,
    row0, row_end, tile_n)``. The groups' tiles come first, group by group, each group's
    ``swizzled_tile``-wise (GROUP_M of its row tiles at a time, column by column): the
    tiles that read one block of a group's weights run together and the block comes from
    DRAM once. (Bands of GROUP_M row tiles running across groups would split a group of a
    few tiles between two bands run at different times, each reading its weights: at
    DeepSeek-V3's 256 experts, a quarter more bytes than the weights.) Then the tiles of
    the rows no group owns (``is_group_tile`` false, ``g`` then names no group), rows
    ``[row0, M)``, which the kernel zero-fills."""
    g = tl.sum((tile_ends * num_n <= t).to(tl.int32), 0)
    is_group_tile = g < G
    sel = g_idx == g
    g_tiles = tl.sum(tl.where(sel, tiles, 0), 0)
    local = t - tl.sum(tl.where(sel, tile_ends - tiles, 0), 0) * num_n
    # A fill tile's group has no tiles: one keeps the swizzle's arithmetic defined.
    tile_m, tile_n = swizzled_tile(local, tl.maximum(g_tiles, 1), num_n, GROUP_M)
    fill = t - total_tiles * num_n
    row0 = tl.where(is_group_tile, tl.sum(tl.where(sel, starts, 0), 0) + tile_m * BM, used_rows + fill // num_n * BM)
    row_end = tl.where(is_group_tile, tl.sum(tl.where(sel, ends, 0), 0), M)
    return g, is_group_tile, row0, row_end, tl.where(is_group_tile, tile_n, fill % num_n)


@triton.jit
def group_tile(group_sizes_ptr, M, D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's [BM, BN] output tile of a grouped GEMM over ``M`` rows and ``D`` columns,
    one program per tile: ``(g, is_group_tile, row0, row_end, tile_n)`` (``schedule_tile``)."""
    num_n: tl.constexpr = (D + BN - 1) // BN
    g_idx, starts, ends, tiles, tile_ends, total_tiles, used_rows = row_schedule(group_sizes_ptr, M, G, G_P2, BM)
    return schedule_tile(tl.program_id(0), M, num_n, g_idx, starts, ends, tiles, tile_ends, total_tiles, used_rows,
                         G, BM, GROUP_M)


@triton.jit
def tile_dot(a_ptr, a_rows, a_ok, rhs_ptr, g, is_group_tile, cols, col_ok, C: tl.constexpr, D: tl.constexpr,
             TRANS_RHS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
             PRECISION: tl.constexpr):
    """The fp32 [BM, BN] tile ``a[a_rows] @ B_g[:, cols]`` of a row tile (``group_tile``):
    rows of ``a`` ([*, C]) where ``a_ok``, zeros elsewhere and on tiles past the groups (no
    K step runs). ``rhs`` is [G, C, D], or [G, D, C] used transposed with TRANS_RHS."""
    ks = tl.arange(0, BK)
    a_ptrs = a_ptr + a_rows[:, None] * C + ks[None, :]
    b_base = rhs_ptr + tl.where(is_group_tile, g, 0).to(tl.int64) * C * D
    if TRANS_RHS:
        b_ptrs = b_base + cols[None, :].to(tl.int64) * C + ks[:, None]
        b_step = BK
    else:
        b_ptrs = b_base + ks[:, None].to(tl.int64) * D + cols[None, :]
        b_step = BK * D
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.where(is_group_tile, C, 0), BK):
        k_ok = (k + ks) < C
        a = tl.load(a_ptrs, mask=a_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BK
        b_ptrs += b_step
    return acc


@triton.jit
def grouped_gemm_kernel(lhs_ptr, rhs_ptr, group_sizes_ptr, M, out_prealloc_ptr, out_ptr,
                        C: tl.constexpr, D: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                        TRANS_RHS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                        TMA: tl.constexpr, PROGRAMS: tl.constexpr, SPLIT_STORE: tl.constexpr):
    """out[rows of g] = lhs[rows of g] @ B_g for every group g; other rows get zeros.

    lhs is [M, C]. Without TRANS_RHS, rhs is [G, C, D] and B_g = rhs[g]; with TRANS_RHS,
    rhs is [G, D, C] and B_g = rhs[g].T (the input-gradient GEMM, no transposed copy).
    With TMA, the launch's PROGRAMS programs loop over the tiles and move them by tensor
    descriptors (``tma_tiles``); otherwise each program computes one tile with pointer loads
    (and PROGRAMS is unused).
    """
    if TMA:
        tma_tiles(lhs_ptr, rhs_ptr, group_sizes_ptr, M, out_ptr, C, D, G, G_P2, TRANS_RHS, BM, BN, BK, GROUP_M,
                  PRECISION, PROGRAMS, SPLIT_STORE)
    else:
        g, is_group_tile, row0, row_end, tile_n = group_tile(group_sizes_ptr, M, D, G, G_P2, BM, BN, GROUP_M)
        rows = row0 + tl.arange(0, BM)
        row_ok = rows < row_end
        cols = tile_n * BN + tl.arange(0, BN)
        col_ok = cols < D
        acc = tile_dot(lhs_ptr, rows.to(tl.int64), row_ok, rhs_ptr, g, is_group_tile, cols, col_ok, C, D,
                       TRANS_RHS, BM, BN, BK, PRECISION)
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * D + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def tma_tiles(lhs_ptr, rhs_ptr, group_sizes_ptr, M, out_ptr, C: tl.constexpr, D: tl.constexpr, G: tl.constexpr,
              G_P2: tl.constexpr, TRANS_RHS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              GROUP_M: tl.constexpr, PRECISION: tl.constexpr, PROGRAMS: tl.constexpr, SPLIT_STORE: tl.constexpr):
    """``grouped_gemm_kernel``'s tiles, Hopper's way: the PROGRAMS programs stride over every
    tile of the schedule (computed here from ``group_sizes``, exactly as many row tiles as
    the groups and the rows past them need), loading through tensor descriptors (TMA on
    sm_90+) built once per program. ``flatten`` asks Triton to fuse the tile and K loops
    into one software pipeline; Triton 3.6 leaves them apart here (its loop fusion skips a
    K loop whose trip count varies by tile), so each tile's K loop is pipelined on its own.

    Bounds: ``lhs``'s descriptor spans its M rows (a tile's rows past its group read the
    next group's rows, in bounds, and feed only output rows that are never stored), and the
    weights' is three-dimensional, ``[G, C, D]``, so a K or N block past a matrix's edge
    reads zeros, never the next group's weights (no 0 * inf from a neighbour). A tile wholly
    inside its group stores through an ``[M, D]`` descriptor; a group's last, partial tile
    stores with a row mask at the group's end, so no other group's rows are written. Needs
    16-byte row strides (``C`` and ``D`` times the element size), which the declaration checks.
    ``SPLIT_STORE``: a whole tile is stored as two ``[BM, BN / 2]`` halves, so the store
    stages half a tile in shared memory and a pipeline stage more fits beside it.
    """
    num_n: tl.constexpr = (D + BN - 1) // BN
    g_idx, starts, ends, tiles, tile_ends, total_tiles, used_rows = row_schedule(group_sizes_ptr, M, G, G_P2, BM)
    # The group tiles, then the tiles that zero-fill the rows past the groups.
    num_m = total_tiles + (M - used_rows + BM - 1) // BM
    a_desc = tl.make_tensor_descriptor(lhs_ptr, shape=[M, C], strides=[C, 1], block_shape=[BM, BK])
    if TRANS_RHS:
        b_desc = tl.make_tensor_descriptor(rhs_ptr, shape=[G, D, C], strides=[D * C, C, 1], block_shape=[1, BN, BK])
    else:
        b_desc = tl.make_tensor_descriptor(rhs_ptr, shape=[G, C, D], strides=[C * D, D, 1], block_shape=[1, BK, BN])
    if SPLIT_STORE:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, D], strides=[D, 1], block_shape=[BM, BN // 2])
    else:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, D], strides=[D, 1], block_shape=[BM, BN])
    for t in tl.range(tl.program_id(0), num_m * num_n, PROGRAMS, flatten=True):
        g, is_group_tile, row0, row_end, tile_n = schedule_tile(t, M, num_n, g_idx, starts, ends, tiles, tile_ends,
                                                                total_tiles, used_rows, G, BM, GROUP_M)
        row0 = row0.to(tl.int32)
        col0 = (tile_n * BN).to(tl.int32)
        gi = tl.where(is_group_tile, g, 0).to(tl.int32)
        # A fill tile runs no K step: its accumulator stays zero.
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.where(is_group_tile, C, 0), BK):
            a = a_desc.load([row0, k])
            if TRANS_RHS:
                b = tl.trans(tl.reshape(b_desc.load([gi, col0, k]), (BN, BK)))
            else:
                b = tl.reshape(b_desc.load([gi, k, col0]), (BK, BN))
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        tile = acc.to(out_ptr.dtype.element_ty)
        if row0 + BM <= row_end:
            if SPLIT_STORE:
                lo, hi = tl.split(tl.permute(tl.reshape(tile, (BM, 2, BN // 2)), (0, 2, 1)))
                out_desc.store([row0, col0], lo)
                out_desc.store([row0, col0 + BN // 2], hi)
            else:
                out_desc.store([row0, col0], tile)
        else:
            rows = row0 + tl.arange(0, BM)
            cols = col0 + tl.arange(0, BN)
            tl.store(out_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], tile,
                     mask=(rows < row_end)[:, None] & (cols < D)[None, :])


@triton.jit
def wgrad_tile_of(t, num_k: tl.constexpr, num_n: tl.constexpr):
    """``(g, tile_k, tile_n)`` of tile ``t`` of a weight gradient ``[G, K, N]`` cut into
    ``num_k x num_n`` blocks per group."""
    g = t // (num_k * num_n)
    rest = t % (num_k * num_n)
    # Consecutive tiles (those running together) step along the side with fewer tiles, so
    # they share one slice of the other operand, and the operand they walk through whole
    # is the group's smaller one (rows x min(K, N)), which stays in L2 for the next slice.
    # Walking the longer side instead re-reads the larger operand from memory once per
    # tile of the shorter side: Mixtral's up-projection (K = 4096, N = 28672) would read
    # each group's output gradient 32 times.
    if num_k < num_n:
        tile_n = rest // num_k
        tile_k = rest % num_k
    else:
        tile_k = rest // num_n
        tile_n = rest % num_n
    return g, tile_k, tile_n


@triton.jit
def group_rows(g, g_idx, starts, ends):
    """Group ``g``'s clamped rows ``[r_start, r_end)`` (int32: row indices fit, as M does)."""
    sel = g_idx == g
    return tl.sum(tl.where(sel, starts, 0), 0).to(tl.int32), tl.sum(tl.where(sel, ends, 0), 0).to(tl.int32)


@triton.jit
def wgrad_tile(group_sizes_ptr, M, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
               BK: tl.constexpr, BN: tl.constexpr):
    """This program's [BK, BN] block of a weight gradient [G, K, N] and the rows it reduces:
    ``(g, tile_k, tile_n, r_start, r_end)``, rows ``[r_start, r_end)`` being group ``g``'s."""
    g, tile_k, tile_n = wgrad_tile_of(tl.program_id(0), (K + BK - 1) // BK, (N + BN - 1) // BN)
    g_idx, starts, ends = group_bounds(group_sizes_ptr, M, G, G_P2)
    r_start, r_end = group_rows(g, g_idx, starts, ends)
    return g, tile_k, tile_n, r_start, r_end


@triton.jit
def wgrad_body(lhs_ptr, dout_ptr, group_sizes_ptr, M, out_ptr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
               G_P2: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, PRECISION: tl.constexpr):
    """out[g] = lhs[rows of g].T @ dout[rows of g] for this program's [BK, BN] block
    (``wgrad_tile``), reduced over that group's rows."""
    # g < G always: the grid has G * (K blocks) * (N blocks) programs.
    g, tile_k, tile_n, r_start, r_end = wgrad_tile(group_sizes_ptr, M, K, N, G, G_P2, BK, BN)
    kcols = tile_k * BK + tl.arange(0, BK)
    k_ok = kcols < K
    ncols = tile_n * BN + tl.arange(0, BN)
    n_ok = ncols < N
    rs = tl.arange(0, BR)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for r in range(r_start, r_end, BR):
        rows = r + rs
        r_ok = rows < r_end
        x = tl.load(lhs_ptr + rows[:, None].to(tl.int64) * K + kcols[None, :],
                    mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        dy = tl.load(dout_ptr + rows[:, None].to(tl.int64) * N + ncols[None, :],
                     mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(tl.trans(x), dy, acc, input_precision=PRECISION)
    out_ptrs = out_ptr + g.to(tl.int64) * K * N + kcols[:, None].to(tl.int64) * N + ncols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & n_ok[None, :])


@triton.jit
def grouped_gemm_wgrad_kernel(lhs_ptr, dout_ptr, group_sizes_ptr, M, out_prealloc_ptr, out_ptr,
                              K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, G_P2: tl.constexpr,
                              BK: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                              PRECISION: tl.constexpr, TMA: tl.constexpr, PROGRAMS: tl.constexpr):
    """out[g] = lhs[rows of g].T @ dout[rows of g]: the weight gradient, [G, K, N].

    Every [BK, BN] block of every group's matrix is reduced over that group's rows by one
    program, so no two programs write the same element and empty groups get zeros: one
    program per block with pointer loads, or (TMA) the launch's PROGRAMS programs looping
    over the blocks with tensor descriptors (``tma_wgrad_tiles``; PROGRAMS unused otherwise).
    """
    if TMA:
        tma_wgrad_tiles(lhs_ptr, dout_ptr, group_sizes_ptr, M, out_ptr, K, N, G, G_P2, BK, BN, BR, PRECISION,
                        PROGRAMS)
    else:
        wgrad_body(lhs_ptr, dout_ptr, group_sizes_ptr, M, out_ptr, K, N, G, G_P2, BK, BN, BR, PRECISION)


@triton.jit
def tma_wgrad_tiles(lhs_ptr, dout_ptr, group_sizes_ptr, M, out_ptr, K: tl.constexpr, N: tl.constexpr,
                    G: tl.constexpr, G_P2: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                    PRECISION: tl.constexpr, PROGRAMS: tl.constexpr):
    """``grouped_gemm_wgrad_kernel``'s blocks, Hopper's way: PROGRAMS programs stride over
    every block of every group (``wgrad_tile_of``'s order), loading row slices through
    tensor descriptors built once per program and storing each block through one.
    ``flatten`` asks Triton to fuse the block and row loops into one software pipeline, so
    that a block's store would overlap the next block's loads; Triton 3.6 leaves them apart
    here (the row loop's trip count varies by group). On Hopper the warp-specialised kernel
    (``grouped_gemm_ws.py``) overlaps them instead.

    Bounds: the row slices' descriptors span ``lhs`` and ``dout``'s M rows; a group's
    whole ``BR``-row slices are inside its rows, and its last, partial slice is read at the
    group's end row and its rows past that end are zeroed in both operands before the dot,
    so no other group's rows (nor a 0 * inf from them) reach the sum. The output's
    descriptor is three-dimensional, ``[G, K, N]``: a block past a matrix's edge is clipped
    there, never written into the next group's matrix. Needs 16-byte row strides (``K`` and
    ``N`` times the element size), which the declaration checks.
    """
    num_k: tl.constexpr = (K + BK - 1) // BK
    num_n: tl.constexpr = (N + BN - 1) // BN
    g_idx, starts, ends = group_bounds(group_sizes_ptr, M, G, G_P2)
    x_desc = tl.make_tensor_descriptor(lhs_ptr, shape=[M, K], strides=[K, 1], block_shape=[BR, BK])
    dy_desc = tl.make_tensor_descriptor(dout_ptr, shape=[M, N], strides=[N, 1], block_shape=[BR, BN])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[G, K, N], strides=[K * N, N, 1], block_shape=[1, BK, BN])
    rs = tl.arange(0, BR)
    for t in tl.range(tl.program_id(0), G * num_k * num_n, PROGRAMS, flatten=True):
        g, tile_k, tile_n = wgrad_tile_of(t, num_k, num_n)
        r_start, r_end = group_rows(g, g_idx, starts, ends)
        k0 = (tile_k * BK).to(tl.int32)
        n0 = (tile_n * BN).to(tl.int32)
        r_full = r_start + (r_end - r_start) // BR * BR
        acc = tl.zeros((BK, BN), dtype=tl.float32)
        for r in range(r_start, r_full, BR):
            acc = tl.dot(tl.trans(x_desc.load([r, k0])), dy_desc.load([r, n0]), acc, input_precision=PRECISION)
        if r_full < r_end:
            inside = ((r_full + rs) < r_end)[:, None]
            x = tl.where(inside, x_desc.load([r_full, k0]), 0.0)
            dy = tl.where(inside, dy_desc.load([r_full, n0]), 0.0)
            acc = tl.dot(tl.trans(x), dy, acc, input_precision=PRECISION)
        out_desc.store([g.to(tl.int32), k0, n0], tl.reshape(acc.to(out_ptr.dtype.element_ty), (1, BK, BN)))
