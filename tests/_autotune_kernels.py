"""Small kernels and declarations for the autotuner tests (Triton sources must live in a file)."""
import ctypes
import dataclasses
import os
import time

import triton
import triton.language as tl

from te_jax_perm.core import Config, KernelDecl, Operand, Output


@triton.jit
def accumulate_rows_kernel(x_ptr, T, H, out_alias_ptr, out_ptr, BS: tl.constexpr, BT: tl.constexpr,
                           BH: tl.constexpr):
    """out[r] += x[r]: program p owns rows [p*BS, (p+1)*BS), walked in tiles of BT rows.

    The tile mask checks only ``r < T``, not the program's own range: when BS % BT != 0 a
    program's last tile spills into its neighbour's rows: a race."""
    p = tl.program_id(0)
    c = tl.arange(0, BH)
    for t0 in range(0, BS, BT):
        r = p * BS + t0 + tl.arange(0, BT)
        m = (r[:, None] < T) & (c[None, :] < H)
        off = r[:, None] * H + c[None, :]
        tl.store(out_ptr + off, tl.load(out_ptr + off, mask=m) + tl.load(x_ptr + off, mask=m), mask=m)


def tiles_own_rows(d, p, c):
    if c.kw["BS"] % c.kw["BT"]:
        return f"BS={c.kw['BS']} is not a multiple of BT={c.kw['BT']}: tiles would spill into the next program"
    return None


def not_wider_than_rows(d, p, c):
    if c.kw["BS"] > triton.next_power_of_2(d["T"]):
        return f"BS={c.kw['BS']} exceeds next_power_of_2(T={d['T']})"
    return None


SAFE_CONFIGS = tuple(Config.make(BS=bs, BT=bt) for bs in (8, 16, 32, 64) for bt in (2, 4))
RACY_CONFIG = Config.make(BS=40, BT=32)  # 2 programs x 2 tiles: fewest launches, rows 40..63 added twice


def accumulate_decl(name="test_accumulate", configs=SAFE_CONFIGS, constraints=(tiles_own_rows,), **kw):
    kw.setdefault("default_config", lambda d, p: Config.make(BS=8, BT=8))
    return KernelDecl(
        name=name, kernel=accumulate_rows_kernel,
        operands=(Operand("x", ("T", "H"), ("float",)),),
        outputs=(Output("out", lambda d, p: (d["T"], d["H"]), lambda t, p: t["x"], init="zeros"),),
        reference=lambda x, **p: (x,),
        grid=lambda d, p, c: (triton.cdiv(d["T"], c.kw["BS"]),),
        scalars=lambda d, p: {"T": d["T"], "H": d["H"]},
        constexprs=lambda d, p, c: {"BH": triton.next_power_of_2(d["H"])},
        configs=configs, constraints=constraints,
        key_dims=("T", "H"), key_bucket=lambda n, v: triton.next_power_of_2(v),
        exact=False, rtol=1e-6, atol=1e-6, **kw)


@triton.jit
def copy_rows_kernel(x_ptr, T, H, out_alias_ptr, out_ptr, BS: tl.constexpr, BT: tl.constexpr,
                     BH: tl.constexpr):
    """out[r] = x[r] with the same tiling (a different source: a different tuning key)."""
    p = tl.program_id(0)
    c = tl.arange(0, BH)
    for t0 in range(0, BS, BT):
        r = p * BS + t0 + tl.arange(0, BT)
        m = (r[:, None] < T) & (c[None, :] < H)
        off = r[:, None] * H + c[None, :]
        tl.store(out_ptr + off, tl.load(x_ptr + off, mask=m), mask=m)


# -- compiles that crash -----------------------------------------------------------------
# A compile job names its kernel by module and attribute; a worker loading one of these
# names dies (or hangs, or raises) the way a compiler crash in that job would.
FAULTS = ("abort", "segfault", "hang", "raise")


def __getattr__(name):
    kind = name.removeprefix("crash_compile_")
    if kind == name or kind not in FAULTS:
        raise AttributeError(name)
    if kind == "abort":
        os.abort()
    if kind == "segfault":
        ctypes.string_at(0)
    if kind == "hang":
        while True:
            time.sleep(3600)
    raise RuntimeError("planted compile error")


def crashing(job, kind):
    """``job`` made to fail with ``kind`` in the worker that compiles it."""
    return dataclasses.replace(job, kernel_module=__name__, kernel_name=f"crash_compile_{kind}")
