"""The framework's worked example: a row-gather kernel declared in ~20 lines, plus a
zero-initialised histogram kernel (accumulating output) used by the core tests."""
import jax.numpy as jnp
import triton
import triton.language as tl

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare


@triton.jit
def gather_rows_kernel(src_ptr, idx_ptr, H, out_prealloc_ptr, out_ptr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    src_row = tl.load(idx_ptr + row).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        mask = cols < H
        vals = tl.load(src_ptr + src_row * H + cols, mask=mask)
        tl.store(out_ptr + row.to(tl.int64) * H + cols, vals, mask=mask)


gather_rows = declare(KernelDecl(
    name="example_gather_rows",
    kernel=gather_rows_kernel,
    operands=(Operand("src", ("N", "H")), Operand("idx", ("R",), ("int32",))),
    outputs=(Output("out", lambda d, p: (d["R"], d["H"]), lambda t, p: t["src"]),),
    reference=lambda src, idx: (src[idx],),
    grid=lambda d, p, c: (d["R"],),
    scalars=lambda d, p: {"H": d["H"]},
    configs=tuple(Config.make(BLOCK_H=b, num_warps=w) for b in (16, 32, 64) for w in (1, 2)),
    default_config=lambda d, p: Config.make(BLOCK_H=min(64, triton.next_power_of_2(max(d["H"], 1)))),
))


@triton.jit
def histogram_kernel(values_ptr, N, counts_prealloc_ptr, counts_ptr, NUM_BINS: tl.constexpr,
                     BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    v = tl.load(values_ptr + offs, mask=mask, other=0)
    tl.atomic_add(counts_ptr + v, tl.full([BLOCK], 1, tl.int32), mask=mask & (v >= 0) & (v < NUM_BINS))


histogram = declare(KernelDecl(
    name="example_histogram",
    kernel=histogram_kernel,
    operands=(Operand("values", ("N",), ("int32",)),),
    outputs=(Output("counts", lambda d, p: (p["num_bins"],), lambda t, p: jnp.int32, init="zeros"),),
    params=("num_bins",),
    # Out-of-range values are ignored (negative ones too: JAX would wrap them).
    reference=lambda values, num_bins: (jnp.zeros((num_bins,), jnp.int32).at[
        jnp.where(values < 0, num_bins, values)].add(1, mode="drop"),),
    grid=lambda d, p, c: (triton.cdiv(d["N"], c.kw["BLOCK"]),),
    scalars=lambda d, p: {"N": d["N"]},
    constexprs=lambda d, p, c: {"NUM_BINS": p["num_bins"]},
    default_config=lambda d, p: Config.make(BLOCK=128),
    params_check=lambda d, p: _check_bins(p["num_bins"]),
))


def _check_bins(num_bins):
    if not isinstance(num_bins, int) or num_bins <= 0:
        raise ValueError(f"example_histogram: num_bins must be a positive int, got {num_bins!r}")
