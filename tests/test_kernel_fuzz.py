"""Every shipped kernel primitive, fed hostile operand values, touches nothing outside its
buffers and writes every element its declaration says it writes.

The public ops hand their kernels operands they built themselves; a primitive called
directly takes whatever it is given. Here each interpretable primitive runs under
``jax.jit`` (its operands traced, so no ``validate`` hook refuses a bad value before the
kernel sees it) on the ``interpret`` backend under the hazard sanitizer, at a few tiny
sizes and valid static params, on operands whose integer entries are partly or wholly
replaced by hostile values (int32's extremes, -1, the sizes of the launch's axes and one
past them) and whose floats sometimes hold NaN and infinities. Cases are drawn from fixed
seeds, so a failure reproduces; its message holds the operands.

Outputs declared ``init="empty"`` are ones the kernel writes in full whatever the operands
(:class:`~te_jax_perm.core.declaration.Output`); the interpreter poisons them (NaN floats),
so with finite float operands every float element of them must come back finite.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from te_jax_perm.autotune.tuner import candidates
from te_jax_perm.ops.row_id_map.reference import NO_DROP, block_sums, routed, row_owner_reference
from te_jax_perm.ops.tiling import next_pow2
from te_jax_perm.sanitize import UNWRITTEN, WRITE_WRITE, sanitize
from tests.test_sanitize_shipped import shipped_kernels

BE = "interpret"
SEEDS = tuple(range(8))
CASES_PER_SEED = 6

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
HOSTILE_INTS = (INT32_MIN, -2**30, -7, -1, 0, 1, 2, 3, 2**30, INT32_MAX)
FLOAT_SPECIALS = (np.nan, np.inf, -np.inf, -0.0, 3e38, -3e38)
BF16 = np.dtype(jnp.bfloat16)
# Operands of any integer dtype take hostile values wrapped to it (int32 twice as often).
ANY_INT = tuple(np.dtype(d) for d in (np.int32, np.int32, np.int8, np.int16, np.uint8, np.uint16, np.uint32))

# Kernels the interpreter cannot run (decl.interpretable False; a Gluon kernel). Today
# grouped_gemm_wgrad_ws, the warp-specialised weight gradient: tests/gpu/hostile.py runs it
# under compute-sanitizer's memcheck instead (test_sanitize_shipped holds that list to it).
KERNELS = shipped_kernels()
OPAQUE = sorted(name for name, k in KERNELS.items() if not k.decl.interpretable)


@dataclasses.dataclass
class Setup:
    """One launch's sizes, static params and operand dtypes (by operand name)."""

    dims: dict
    params: dict
    dtypes: dict
    # Operands for kernels without ``example_inputs``: (rng) -> plausible operands.
    plausible: Callable | None = None


def _pick(rng, seq):
    return seq[int(rng.integers(len(seq)))]


# How often a size is zero: empty axes are valid shapes (no tokens, no experts, rows
# without columns) whose launches must be as clean.
ZERO_SIZE = 0.1


def _size(rng, stop: int) -> int:
    """A size in ``[1, stop)``, or zero one time in ten."""
    return 0 if rng.random() < ZERO_SIZE else int(rng.integers(1, stop))


def _cdiv(a, b):
    return -(-a // b)


# -- sizes and static params, as the ops pass them ------------------------------------------
def _map_setup(writer: bool, fill: bool = False, dispatch: bool = False):
    """The map build's kernels: the block counts (``writer`` False), the map writers, the
    two-pass ones (``fill``) taking the counts, the dispatch's (``dispatch``) also padding."""
    def setup(rng):
        t, e = _size(rng, 10), _size(rng, 6)
        bt = _pick(rng, [b for b in (1, 2, 4, 8, 16) if b <= next_pow2(t)])
        dims, params = {"T": t, "E": e}, {"block_t": bt}
        if writer:
            params["drop_at"] = drop_at = _pick(rng, [0, 1, 3, t * e // 2, t * e, NO_DROP])
        if fill:
            dims["NB"] = _cdiv(t, bt)
        if dispatch:
            align = 1 if drop_at == NO_DROP else _pick(rng, [1, 2, 4])
            kept = min(drop_at, t * e)
            params.update(align=align, num_out_rows=_pick(rng, [0, 1, max(1, kept), kept + e * (align - 1),
                                                               t * e + e * align]))
        dtypes = {"routing_map": _pick(rng, [np.dtype(np.bool_), *ANY_INT]), "counts": np.dtype(np.int32)}

        def plausible(rng):   # the block counts' routing map (the one map kernel without examples)
            return ((rng.random((t, e)) < 0.4).astype(dtypes["routing_map"]),)
        return Setup(dims, params, dtypes, plausible)
    return setup


def _rows(rng, t, e):
    """Output row counts a dispatch of ``t`` tokens over ``e`` experts may have."""
    return _pick(rng, [1, t, t * min(e, 4), t * min(e, 4) + 3 * e, max(1, t * e // 2)])


def _float(rng):
    return _pick(rng, [np.dtype(np.float32), np.dtype(np.float32), BF16])


def _row_owner_setup(rng):
    t, e = _size(rng, 10), _size(rng, 6)
    return Setup({"T": t, "E": e, "W": 2 * e + 1}, {"num_out_rows": _rows(rng, t, e), "padded": bool(rng.integers(2))},
                 {"row_id_map": np.dtype(np.int32), "pad_offsets": np.dtype(np.int32)})


def _scatter_setup(rng):
    t, e, h = _size(rng, 10), _size(rng, 6), _size(rng, 41)
    r = _rows(rng, t, e)
    f = _float(rng)
    return Setup({"T": t, "E": e, "W": 2 * e + 1, "H": h, "R": r}, {"num_out_rows": r, "padded": bool(rng.integers(2))},
                 {"inp": f, "row_id_map": np.dtype(np.int32), "pad_offsets": np.dtype(np.int32),
                  "owner": np.dtype(np.int32), "probs": _float(rng)})


def _gather_setup(rng):
    t, e, h = _size(rng, 10), _size(rng, 6), _size(rng, 41)
    n = _rows(rng, t, e)
    return Setup({"T": t, "E": e, "W": 2 * e + 1, "H": h, "N": n}, {"padded": bool(rng.integers(2))},
                 {"inp": _float(rng), "row_id_map": np.dtype(np.int32), "pad_offsets": np.dtype(np.int32),
                  "merging_probs": _float(rng), "grad_permuted_probs": _float(rng)})


def _weighted_scatter_setup(rng):
    t, e, h = _size(rng, 10), _size(rng, 6), _size(rng, 41)
    n = _rows(rng, t, e)
    f = _float(rng)
    return Setup({"T": t, "E": e, "W": 2 * e + 1, "H": h, "N": n, "R": n}, {"padded": bool(rng.integers(2))},
                 {"grad": f, "row_id_map": np.dtype(np.int32), "pad_offsets": np.dtype(np.int32),
                  "owner": np.dtype(np.int32), "merging_probs": _float(rng), "fwd_inp": f})


def _plan_setup(rng):
    c = int(rng.integers(1, 7))   # at least one chunk (the declaration refuses none)
    return Setup({"C": c}, {"num_tokens": int(rng.integers(0, 10))},
                 {"split_sizes": _pick(rng, ANY_INT), "sorted_indices": _pick(rng, ANY_INT)})


def _chunk_map_setup(rng):
    return Setup({"P": 9, "C": int(rng.integers(1, 7))}, {"num_tokens": int(rng.integers(0, 10))},
                 {"plan": np.dtype(np.int32)})


def _move_setup(rng):
    return Setup({"N": _size(rng, 10), "H": _size(rng, 41)}, {},
                 {"inp": _float(rng), "src_map": np.dtype(np.int32), "probs": _float(rng)})


def _group_sizes(rng, g, m):
    """Sizes of ``g`` groups covering at most ``m`` rows (some empty)."""
    cuts = np.sort(rng.integers(0, m + 1, size=g))
    return np.diff(cuts, prepend=0).astype(np.int32)


def _gemm_dims(rng, *names):
    # Multiples of 4 now and then: the TMA configs (16-byte rows) are candidates there.
    return {n: int(_pick(rng, [_size(rng, 25), 4 * _size(rng, 7)])) for n in names}


def _mm_setup(trans_rhs: bool):
    def setup(rng):
        dims = {"M": _size(rng, 41), **_gemm_dims(rng, "C", "D"), "G": _size(rng, 6)}
        f = _pick(rng, [np.dtype(np.float32), np.dtype(np.float32), BF16, np.dtype(np.float16)])
        params = {"elem_bytes": f.itemsize, "out_dtype": _pick(rng, ["float32", f.name])}
        rhs = (dims["G"], dims["D"], dims["C"]) if trans_rhs else (dims["G"], dims["C"], dims["D"])

        def plausible(rng):
            return (rng.standard_normal((dims["M"], dims["C"])).astype(f), rng.standard_normal(rhs).astype(f),
                    _group_sizes(rng, dims["G"], dims["M"]))
        return Setup(dims, params, {"lhs": f, "rhs": f, "group_sizes": np.dtype(np.int32)}, plausible)
    return setup


def _wgrad_setup(rng):
    dims = {"M": _size(rng, 41), **_gemm_dims(rng, "K", "N"), "G": _size(rng, 6)}
    f = _pick(rng, [np.dtype(np.float32), np.dtype(np.float32), BF16])

    def plausible(rng):
        return (rng.standard_normal((dims["M"], dims["K"])).astype(f),
                rng.standard_normal((dims["M"], dims["N"])).astype(f), _group_sizes(rng, dims["G"], dims["M"]))
    return Setup(dims, {"elem_bytes": f.itemsize}, {"lhs": f, "dout": f, "group_sizes": np.dtype(np.int32)},
                 plausible)


def _gather_gemm_setup(rng):
    t, g = _size(rng, 10), _size(rng, 6)
    dims = {"T": t, **_gemm_dims(rng, "C", "D"), "G": g, "M": _rows(rng, t, g)}
    f = _pick(rng, [np.dtype(np.float32), np.dtype(np.float32), BF16])
    return Setup(dims, {"elem_bytes": f.itemsize},
                 {"x": f, "rhs": f, "group_sizes": np.dtype(np.int32), "owner": np.dtype(np.int32)})


SETUPS: dict[str, Callable] = {
    "row_id_map_block_counts": _map_setup(False),
    "row_id_map_fill": _map_setup(True, fill=True),
    "row_id_map_fused": _map_setup(True),
    "dispatch_map_fill": _map_setup(True, fill=True, dispatch=True),
    "dispatch_map_fused": _map_setup(True, dispatch=True),
    "row_owner": _row_owner_setup,
    "permute": _scatter_setup,
    "permute_probs": _scatter_setup,
    "unpermute_bwd_weighted": _weighted_scatter_setup,
    "unpermute": _gather_setup,
    "unpermute_weighted": _gather_setup,
    "unpermute_owner": _gather_setup,
    "unpermute_weighted_owner": _gather_setup,
    "permute_bwd_probs": _gather_setup,
    "chunk_sort_plan": _plan_setup,
    "chunk_sort_map": _chunk_map_setup,
    "sort_chunks": _move_setup,
    "sort_chunks_probs": _move_setup,
    "grouped_gemm": _mm_setup(False),
    "grouped_gemm_hopper": _mm_setup(False),
    "grouped_gemm_rhs_t": _mm_setup(True),
    "grouped_gemm_rhs_t_hopper": _mm_setup(True),
    "grouped_gemm_wgrad": _wgrad_setup,
    "moe_gather_gemm": _gather_gemm_setup,
}


# -- hostile operand values -------------------------------------------------------------------
def _int_pool(dims) -> np.ndarray:
    sizes = {v for d in dims.values() for v in (d, d + 1)}
    return np.array(sorted(set(HOSTILE_INTS) | sizes | set(range(-2, 10))), np.int64)


def _as(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` in ``dtype``, wrapping as a C cast would (an int8 operand gets int32's
    extremes as their low bits)."""
    return values.astype(np.int64).astype(dtype) if dtype != np.bool_ else values != 0


def _corrupt_ints(rng, a: np.ndarray, pool: np.ndarray, fraction: float | None) -> np.ndarray:
    """``a`` with ``fraction`` of its entries (at least one) replaced from ``pool``; every
    entry with ``fraction`` None."""
    if a.size == 0 or a.dtype == np.bool_:
        return a
    out = a.copy().reshape(-1)
    if fraction is None:
        hit = np.ones(out.size, bool)
    else:
        hit = rng.random(out.size) < fraction
        hit[rng.integers(out.size)] = True
    out[hit] = _as(rng.choice(pool, size=int(hit.sum())), a.dtype)
    return out.reshape(a.shape)


def _corrupt_floats(rng, a: np.ndarray) -> np.ndarray:
    if a.size == 0:
        return a
    out = a.copy().reshape(-1)
    hit = rng.random(out.size) < 0.3
    hit[rng.integers(out.size)] = True
    out[hit] = np.asarray(rng.choice(FLOAT_SPECIALS, size=int(hit.sum()))).astype(a.dtype)
    return out.reshape(a.shape)


def _is_int(a) -> bool:
    return np.issubdtype(np.asarray(a).dtype, np.integer)


def _is_float(a) -> bool:
    return np.asarray(a).dtype.kind == "f" or np.asarray(a).dtype == BF16


# Modes of the cases a seed draws, in turn: the decl's own operands (or plausible ones)
# untouched; a fraction of the integer entries of some integer operands corrupted; every
# integer entry of some drawn from the pool; the last two again with NaN and infinities
# in the floats.
MODES = ("valid", "corrupt", "corrupt", "random", "corrupt+floats", "random+floats")


@dataclasses.dataclass
class Case:
    name: str
    mode: str
    dims: dict
    params: dict
    config: object
    operands: tuple

    def describe(self) -> str:
        ops = "\n".join(f"  {o.name} {np.asarray(a).dtype}{list(np.shape(a))}: {np.asarray(a).tolist()!r:.600}"
                        for o, a in zip(KERNELS[self.name].decl.operands, self.operands))
        return (f"{self.name} [{self.mode}] dims={self.dims} params={self.params} config={self.config}\n{ops}")


def map_owners(decl, ops, dims, params) -> np.ndarray:
    """The row owners of a scatter's map (``row_owner``'s, which the ops pass it)."""
    names = [o.name for o in decl.operands]
    rid, pad = ops[names.index("row_id_map")], ops[names.index("pad_offsets")]
    rows = params.get("num_out_rows", dims.get("N"))
    return np.asarray(row_owner_reference(rid, pad, num_out_rows=rows, padded=params["padded"])[0])


def draw_case(name: str, rng: np.random.Generator, mode: str) -> Case:
    decl = KERNELS[name].decl
    setup = SETUPS[name](rng)
    if decl.example_inputs is not None:
        ops = [np.asarray(a) for a in decl.example_inputs(setup.dims, setup.params, setup.dtypes, rng)]
    else:
        ops = [np.asarray(a) for a in setup.plausible(rng)]
    pool = _int_pool(setup.dims)
    ints = [i for i, a in enumerate(ops) if _is_int(a)]
    if mode != "valid" and ints:
        # Some integer operands, the others left as the decl made them: a hostile operand
        # beside consistent ones reaches what two hostile ones may not.
        chosen = [i for i in ints if rng.random() < 0.5] or [_pick(rng, ints)]
        fraction = None if mode.startswith("random") else _pick(rng, [0.1, 0.3, 0.6])
        for i in chosen:
            ops[i] = _corrupt_ints(rng, ops[i], pool, fraction)
        names = [o.name for o in decl.operands]
        if "owner" in names and "row_id_map" in names and names.index("owner") not in chosen and rng.random() < 0.7:
            # Mostly the row owners of the (hostile) map, as the ops compute them, otherwise
            # those of the map before it was corrupted.
            ops[names.index("owner")] = map_owners(decl, ops, setup.dims, setup.params)
    if mode.endswith("+floats"):
        ops = [_corrupt_floats(rng, a) if _is_float(a) else a for a in ops]
    # The default config, or one of the others valid here (those differing only in warps
    # or stages run the same in the interpreter).
    valid, _ = candidates(decl, setup.dims, setup.params)
    distinct = list({c.constants: c for c in valid}.values())
    config = None if rng.random() < 0.5 or not distinct else _pick(rng, distinct)
    return Case(name, mode, setup.dims, setup.params, config, tuple(ops))


def foreign_owners(case: Case) -> bool:
    """Whether ``case`` hands a scatter an ``owner`` table that is not its map's own."""
    names = [o.name for o in KERNELS[case.name].decl.operands]
    return "owner" in names and "row_id_map" in names and not np.array_equal(
        case.operands[names.index("owner")], map_owners(KERNELS[case.name].decl, case.operands, case.dims,
                                                         case.params))


def documented(case: Case, hazard) -> bool:
    """Whether ``hazard`` is a documented answer to ``case``'s operands rather than a bug.
    The dispatch map's two-pass fill takes its ``counts`` operand as trusted (the ops pass
    the block counts they just computed): counts that are not the routing map's give a map
    whose rows are shared, so two programs may store one row's owner (either entry then
    owns it; every store stays inside the table). A scatter (``permute``, ``permute_probs``,
    ``unpermute_bwd_weighted``) writes each row from the entry its ``owner`` operand names
    and zeroes the rows whose owner is 0, so it stores every row only where ``owner`` is its
    map's own row owners (what the ops pass it): a row whose owner names an entry that does
    not address it is neither written nor zeroed. Nothing else is."""
    if hazard.kind == UNWRITTEN:
        return foreign_owners(case)
    if case.name != "dispatch_map_fill" or hazard.kind != WRITE_WRITE or hazard.buffer != "owner":
        return False
    rm, counts = case.operands
    return not np.array_equal(counts, block_sums(routed(rm, np), case.params["block_t"], np))


def run_case(case: Case):
    """The primitive's outputs on ``case``, jitted (operands traced), under the sanitizer,
    which must report nothing but :func:`documented` hazards."""
    prim = KERNELS[case.name]
    f = jax.jit(lambda *ops: prim(*ops, backend=BE, config=case.config, **case.params))
    with sanitize() as report:
        outs = jax.block_until_ready(f(*case.operands))
    assert all(documented(case, h) for h in report.hazards), f"{case.describe()}\n{report.text()}"
    return [np.asarray(o) for o in outs], report


def check_written(case: Case, outs) -> None:
    """Outputs the declaration says the kernel writes in full (``init="empty"``) hold no
    poison: with finite float operands every float element is finite. The sanitizer checks
    that every element is stored; this checks that what is stored was not read from memory
    nobody wrote. A scatter given foreign owners (:func:`documented`) is not checked."""
    decl = KERNELS[case.name].decl
    if any(_is_float(a) and not np.isfinite(np.asarray(a, np.float32)).all() for a in case.operands):
        return
    if foreign_owners(case):
        return
    for out, a in zip(decl.outputs, outs):
        if out.init == "empty" and _is_float(a):
            bad = ~np.isfinite(np.asarray(a, np.float32))
            assert not bad.any(), (f"{case.describe()}\noutput {out.name!r} left {int(bad.sum())} of {a.size} "
                                   f"elements unwritten, e.g. at {np.argwhere(bad)[:4].tolist()}")


def test_every_interpretable_kernel_is_fuzzed():
    missing = sorted(n for n, k in KERNELS.items() if k.decl.interpretable and n not in SETUPS)
    assert not missing, f"shipped kernels without a fuzz setup here (add one to SETUPS): {missing}"
    assert OPAQUE == ["grouped_gemm_wgrad_ws"], f"update the comment on OPAQUE: {OPAQUE}"


# NaN and infinities in the floats overflow the interpreter's NumPy arithmetic, as intended.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", sorted(SETUPS))
def test_hostile_operand_values_stay_in_bounds(name, seed):
    rng = np.random.default_rng([seed, sorted(SETUPS).index(name)])
    decl = KERNELS[name].decl
    launched = 0
    for i in range(CASES_PER_SEED):
        case = draw_case(name, rng, MODES[i % len(MODES)])
        if decl.params_check is not None:
            try:
                decl.params_check(case.dims, case.params)
            except ValueError:   # a static refusal at trace time is an acceptable answer
                continue
        outs, report = run_case(case)
        launched += len(report.launches)
        check_written(case, outs)
    assert launched, f"{name}: no case launched the kernel"
