"""Kernels with planted hazards (and their fixed twins) for the sanitizer tests.

Each is declared on the framework exactly like a library kernel, so the tests exercise
the sanitizer through the same interpret-backend launch path users get.
"""
import jax.numpy as jnp
import triton
import triton.language as tl

from te_jax_perm.core import Config, KernelDecl, Operand, Output, declare


# -- 1. off-by-one mask: `cols <= H` touches one element past each row ------------------
@triton.jit
def gather_rows_kernel(src_ptr, idx_ptr, H, out_prealloc_ptr, out_ptr, BLOCK_H: tl.constexpr,
                       OFF_BY_ONE: tl.constexpr):
    row = tl.program_id(0)
    src_row = tl.load(idx_ptr + row).to(tl.int64)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        if OFF_BY_ONE:
            mask = cols <= H
        else:
            mask = cols < H
        vals = tl.load(src_ptr + src_row * H + cols, mask=mask)
        tl.store(out_ptr + row.to(tl.int64) * H + cols, vals, mask=mask)


def _gather(name: str, off_by_one: bool):
    return declare(KernelDecl(
        name=name, kernel=gather_rows_kernel,
        operands=(Operand("src", ("N", "H")), Operand("idx", ("R",), ("int32",))),
        outputs=(Output("out", lambda d, p: (d["R"], d["H"]), lambda t, p: t["src"]),),
        reference=lambda src, idx: (src[idx],),
        grid=lambda d, p, c: (d["R"],),
        scalars=lambda d, p: {"H": d["H"]},
        constexprs=lambda d, p, c: {"OFF_BY_ONE": off_by_one},
        configs=tuple(Config.make(BLOCK_H=b) for b in (16, 32, 128)),
        default_config=lambda d, p: Config.make(BLOCK_H=128),
    ))


gather_off_by_one = _gather("planted_gather_off_by_one", True)
gather_ok = _gather("planted_gather_ok", False)


# -- 2. tiled writer (lesson 2): NS programs own BS = cdiv(T, NS) rows, write BT-row tiles --
@triton.jit
def tiled_scale_kernel(x_ptr, T, H, out_prealloc_ptr, out_ptr, NS: tl.constexpr, BT: tl.constexpr,
                       BLOCK_H: tl.constexpr):
    pid = tl.program_id(0)
    bs = tl.cdiv(T, NS)
    rows = pid * bs + tl.arange(0, BT)
    cols = tl.arange(0, BLOCK_H)
    mask = (rows[:, None] < T) & (cols[None, :] < H)
    offs = rows[:, None].to(tl.int64) * H + cols[None, :]
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2, mask=mask)


def _tiles_cover_rows(d, p, c):
    # Program p stores rows [p * bs, p * bs + BT): a wider tile overlaps the next program's
    # rows, a narrower one leaves rows that no program stores.
    bs = triton.cdiv(d["T"], c.kw["NS"])
    if c.kw["BT"] > bs:
        return f"BT={c.kw['BT']} exceeds rows per program cdiv(T={d['T']}, NS={c.kw['NS']})={bs}"
    if c.kw["BT"] < bs:
        return f"BT={c.kw['BT']} leaves rows of the {bs} per program cdiv(T={d['T']}, NS={c.kw['NS']}) unwritten"
    return None


tiled_scale = declare(KernelDecl(
    name="planted_tiled_scale", kernel=tiled_scale_kernel,
    operands=(Operand("x", ("T", "H"), ("float",)),),
    outputs=(Output("out", lambda d, p: (d["T"], d["H"]), lambda t, p: t["x"]),),
    reference=lambda x: (x * 2,),
    grid=lambda d, p, c: (c.kw["NS"],),
    scalars=lambda d, p: {"T": d["T"], "H": d["H"]},
    constexprs=lambda d, p, c: {"BLOCK_H": triton.next_power_of_2(max(d["H"], 1))},
    configs=tuple(Config.make(NS=ns, BT=bt) for ns in (2, 5) for bt in (1, 2, 4)),
    constraints=(_tiles_cover_rows,),
    default_config=lambda d, p: Config.make(NS=1, BT=triton.next_power_of_2(max(d["T"], 1))),
))


# -- 3. row permutation (lesson 1): out[dst[r]] = x[r]; fine apart, unsafe in place -------
@triton.jit
def scatter_rows_kernel(x_ptr, dst_ptr, H, out_prealloc_ptr, out_ptr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    dst = tl.load(dst_ptr + row).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    vals = tl.load(x_ptr + row.to(tl.int64) * H + cols, mask=mask)
    tl.store(out_ptr + dst * H + cols, vals, mask=mask)


def _scatter_ref(x, dst):
    return (jnp.zeros_like(x).at[dst].set(x),)


scatter_rows = declare(KernelDecl(
    name="planted_scatter_rows", kernel=scatter_rows_kernel,
    operands=(Operand("x", ("T", "H")), Operand("dst", ("T",), ("int32",))),
    outputs=(Output("out", lambda d, p: (d["T"], d["H"]), lambda t, p: t["x"]),),
    reference=_scatter_ref,
    grid=lambda d, p, c: (d["T"],),
    scalars=lambda d, p: {"H": d["H"]},
    constexprs=lambda d, p, c: {"BLOCK_H": triton.next_power_of_2(max(d["H"], 1))},
    default_config=lambda d, p: Config(),
))


# -- 4. accumulators: atomic (safe) and load-add-store (racy) -----------------------------
@triton.jit
def bin_count_kernel(values_ptr, N, counts_prealloc_ptr, counts_ptr, NUM_BINS: tl.constexpr,
                     BLOCK: tl.constexpr, ATOMIC: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    v = tl.load(values_ptr + offs, mask=mask, other=0)
    bins = tl.arange(0, NUM_BINS)
    hits = tl.sum(((v[:, None] == bins[None, :]) & mask[:, None]).to(tl.int32), axis=0)
    if ATOMIC:
        tl.atomic_add(counts_ptr + bins, hits)
    else:
        # Reads the accumulator through the prealloc (the output's own memory).
        tl.store(counts_ptr + bins, tl.load(counts_prealloc_ptr + bins) + hits)


def _bin_count(name: str, atomic: bool):
    return declare(KernelDecl(
        name=name, kernel=bin_count_kernel,
        operands=(Operand("values", ("N",), ("int32",)),),
        outputs=(Output("counts", lambda d, p: (p["num_bins"],), lambda t, p: jnp.int32, init="zeros"),),
        params=("num_bins",),
        reference=lambda values, num_bins: (jnp.zeros((num_bins,), jnp.int32).at[values].add(1),),
        grid=lambda d, p, c: (triton.cdiv(d["N"], c.kw["BLOCK"]),),
        scalars=lambda d, p: {"N": d["N"]},
        constexprs=lambda d, p, c: {"NUM_BINS": p["num_bins"], "ATOMIC": atomic},
        default_config=lambda d, p: Config.make(BLOCK=8),
    ))


bin_count_atomic = _bin_count("planted_bin_count_atomic", True)
bin_count_racy = _bin_count("planted_bin_count_racy", False)


# -- 5. overruns into a neighbouring buffer, the pointer built in several ways -------------
# FORM picks how the pointer tensor is formed from the base pointer; each must be charged to
# the base pointer's buffer wherever its addresses land.
POINTER_FORMS = ("ptr+tensor", "tensor+ptr", "scalar_then_tensor", "expand_reshape", "advanced", "select",
                 "bitcast")


@triton.jit
def _pointers(base, pid, BLOCK: tl.constexpr, FORM: tl.constexpr):
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if FORM == 0:
        p = base + offs
    elif FORM == 1:
        p = offs + base
    elif FORM == 2:
        p = (base + pid * BLOCK) + tl.arange(0, BLOCK)
    elif FORM == 3:
        p = tl.reshape(base + (offs // 2)[:, None] * 2 + (offs % 2)[:, None], (BLOCK,))
    elif FORM == 4:
        p = base + tl.arange(0, BLOCK)
        p += pid * BLOCK
    elif FORM == 5:
        p = tl.where(offs >= 0, base + offs, base)
    else:
        p = base.to(tl.pointer_type(tl.int32), bitcast=True) + offs
    return p


@triton.jit
def overrun_copy_kernel(src_ptr, N, out_prealloc_ptr, out_ptr, BLOCK: tl.constexpr, FORM: tl.constexpr,
                        LOAD_OVER: tl.constexpr, STORE_OVER: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(_pointers(src_ptr, pid, BLOCK, FORM), mask=offs < N + LOAD_OVER, other=0)
    tl.store(_pointers(out_ptr, pid, BLOCK, FORM), v, mask=offs < N + STORE_OVER)


def overrun_copy(load_over: int, store_over: int, form: int = 0, name: str = "planted_overrun_copy"):
    return declare(KernelDecl(
        name=name, kernel=overrun_copy_kernel,
        operands=(Operand("src", ("N",), ("int32",)),),
        outputs=(Output("out", lambda d, p: (d["N"],), lambda t, p: jnp.int32),),
        reference=lambda src: (src,),
        grid=lambda d, p, c: (triton.cdiv(d["N"], c.kw["BLOCK"]) + 1,),   # one program past the end
        scalars=lambda d, p: {"N": d["N"]},
        constexprs=lambda d, p, c: {"FORM": form, "LOAD_OVER": load_over, "STORE_OVER": store_over},
        default_config=lambda d, p: Config.make(BLOCK=8),
    ))


# -- 6. a kernel that fails inside the interpreter: its error must point at the kernel's line --
@triton.jit
def broken_store_kernel(src_ptr, N, out_prealloc_ptr, out_ptr, BLOCK: tl.constexpr):
    vals = tl.load(src_ptr + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.arange(0, 2 * BLOCK), vals)   # a [BLOCK] value stored to [2 * BLOCK] pointers


broken_store = declare(KernelDecl(
    name="planted_broken_store", kernel=broken_store_kernel,
    operands=(Operand("src", ("N",)),),
    outputs=(Output("out", lambda d, p: (d["N"],), lambda t, p: t["src"]),),
    reference=lambda src: (src,),
    grid=lambda d, p, c: (1,),
    scalars=lambda d, p: {"N": d["N"]},
    default_config=lambda d, p: Config.make(BLOCK=4),
))


# -- 7. two outputs' pointers interleaved: the right count, in the wrong order ------------------
@triton.jit
def interleaved_outputs_kernel(src_ptr, N, a_prealloc_ptr, a_ptr, b_prealloc_ptr, b_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < N
    vals = tl.load(src_ptr + offs, mask=m)
    tl.store(a_ptr + offs, vals, mask=m)     # run as declared, these land in b's preallocated buffer
    tl.store(b_ptr + offs, vals, mask=m)


interleaved_outputs = declare(KernelDecl(
    name="planted_interleaved_outputs", kernel=interleaved_outputs_kernel,
    operands=(Operand("src", ("N",)),),
    outputs=(Output("a", lambda d, p: (d["N"],), lambda t, p: t["src"]),
             Output("b", lambda d, p: (d["N"],), lambda t, p: t["src"])),
    reference=lambda src: (src, src),
    grid=lambda d, p, c: (1,),
    scalars=lambda d, p: {"N": d["N"]},
    default_config=lambda d, p: Config.make(BLOCK=8),
))
