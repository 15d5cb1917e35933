"""Stress: hundreds of unsynchronised op calls alternating shapes, dtypes and align_size.

Why: a kernel compiled for one specialisation and rapidly reused
with another hit an illegal memory access that one-shape-per-process tests never see. So,
in one process: build many distinct problems (T, H, E, k, dtype, align_size, dropping,
skewed routing), then call the kernel backend on them in shuffled order, pass after pass,
never blocking in between, keeping every result; only at the end compare each result
with the ``xla`` backend (bit-exact for pure data movement, tolerances where the op sums).

    python3 -m tests.gpu.stress [--backend triton] [--cases 40] [--passes 4] [--small]

``--small`` is the compute-sanitizer sweep: tiny shapes, fewer calls.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from te_jax_perm.workloads import ep_chunks, tokens, topk_routing

FP8 = "float8_e4m3fn"
# Outputs that only move data must match bit for bit; the rest sum or scale in fp32.
EXACT = ("dispatch", "pprobs", "row_id_map", "pad_offsets", "tokens_per_expert", "sort", "sort_probs", "sort_map",
         "g_sort_x", "g_sort_probs")
TOL = {"float32": 1e-5, "float16": 4e-3, "bfloat16": 3e-2}


@dataclasses.dataclass(frozen=True)
class StressCase:
    T: int
    H: int
    E: int
    k: int
    dtype: str
    align: int | None
    drop: int            # rows dropped: num_out_tokens = T*k - drop
    skew: str
    with_probs: bool

    @property
    def num_out(self) -> int:
        return max(self.T * self.k - self.drop, 0)

    @property
    def out_rows(self) -> int:
        if not self.align:
            return self.num_out
        return (self.num_out + self.E * (self.align - 1)) // self.align * self.align

    def __str__(self) -> str:
        return (f"T{self.T}/H{self.H}/E{self.E}/k{self.k}/{self.dtype}/align{self.align}/drop{self.drop}/"
                f"{self.skew}/{'probs' if self.with_probs else 'noprobs'}")


def make_cases(rng: np.random.Generator, n: int, small: bool,
               dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32", FP8)) -> list[StressCase]:
    """``n`` distinct cases; every dtype, align_size and skew appears when ``n`` allows."""
    Ts = (1, 7, 33, 64) if small else (1, 7, 333, 1024, 2048)
    Hs = (64, 96, 130) if small else (64, 96, 1000, 2880, 4096)
    Es = (4, 8, 16) if small else (4, 8, 128, 256)
    aligns = (None, 16, 32)
    skews = ("uniform", "hot", "empty")
    max_elems = 2 ** 16 if small else 2 ** 21   # rows*H of the dispatch output: keeps all results in memory
    cases: list[StressCase] = []
    seen = set()
    while len(cases) < n:
        i = len(cases)
        E = int(rng.choice(Es))
        k = int(rng.choice([c for c in (1, 2, 4, 8) if c <= E]))
        T = int(rng.choice(Ts))
        case = StressCase(T=T, H=int(rng.choice(Hs)), E=E, k=k, dtype=dtypes[i % len(dtypes)],
                          align=aligns[i % len(aligns)], drop=int(rng.choice((0, 0, 3))) if T * k > 3 else 0,
                          skew=skews[(i // 2) % len(skews)], with_probs=bool(i % 4 != 3))
        if case.out_rows * case.H > max_elems or case in seen:
            continue
        seen.add(case)
        cases.append(case)
    return cases


def make_inputs(case: StressCase, rng: np.random.Generator) -> tuple[jax.Array, ...]:
    rm, probs = topk_routing(rng, case.T, case.E, case.k, case.skew)
    x = tokens(rng, case.T, case.H, jnp.dtype(case.dtype))
    split, order = ep_chunks(rng, case.out_rows, 2, max(1, case.E // 2))
    return tuple(jax.device_put(a) for a in (x, rm, probs, split, order))


def program(case: StressCase, backend: str) -> Callable[..., dict[str, jax.Array]]:
    """Everything the ops do at this case, forward and backward, as one jitted function."""
    import te_jax_perm as tp

    math_ok = case.dtype != FP8   # fp8 is supported where the op only copies

    def dispatch(x, rm, probs):
        return tp.token_dispatch(x, rm, case.num_out, probs=probs, align_size=case.align, backend=backend)

    def f(x, rm, probs, split, order):
        probs = probs if case.with_probs else None
        out, pprobs, rid, pad, tpe = dispatch(x, rm, probs)
        res = {"dispatch": out, "row_id_map": rid, "tokens_per_expert": tpe}
        if pprobs is not None:
            res["pprobs"] = pprobs
        if pad is not None:
            res["pad_offsets"] = pad

        def sort(o, p):
            if p is None:
                o, m = tp.sort_chunks_by_index(o, split, order, backend=backend)
                return o, None, m
            return tp.sort_chunks_by_index_with_probs(o, split, order, p, backend=backend)

        s_out, s_probs, s_map = sort(out, pprobs)
        res.update(sort=s_out, sort_map=s_map)
        if s_probs is not None:
            res["sort_probs"] = s_probs
        # Backward of the sort: the cotangent is the sorted rows themselves (pure data movement).
        _, sort_vjp = jax.vjp(lambda o, p: sort(o, p)[:2], out, pprobs)
        g = sort_vjp((s_out, s_probs))
        res["g_sort_x"] = g[0]
        if s_probs is not None:
            res["g_sort_probs"] = g[1]
        if not math_ok:
            return res
        res["combine"] = tp.token_combine(out, rid, merging_probs=probs, pad_offsets=pad, backend=backend)
        ct_p = None if pprobs is None else pprobs * 0.5
        _, d_vjp = jax.vjp(lambda a, p: dispatch(a, rm, p)[:2], x, probs)
        gx, gp = d_vjp((out, ct_p))
        res["g_dispatch_x"] = gx
        if gp is not None:
            res["g_dispatch_probs"] = gp
        _, c_vjp = jax.vjp(lambda o, p: tp.token_combine(o, rid, merging_probs=p, pad_offsets=pad, backend=backend),
                           out, probs)
        gx, gp = c_vjp(x)
        res["g_combine_x"] = gx
        if gp is not None:
            res["g_combine_probs"] = gp
        return res

    return jax.jit(f)


def same(name: str, got: np.ndarray, want: np.ndarray, dtype: str) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: shape/dtype {got.shape}/{got.dtype}, expected {want.shape}/{want.dtype}"
    if name in EXACT or want.dtype.kind in "iub":
        bits = f"u{got.dtype.itemsize}"
        diff = got.view(bits) != want.view(bits)   # bitwise: -0.0 vs 0.0 and NaNs count
        if diff.any():
            return f"{name}: {int(diff.sum())} of {got.size} elements differ (first at {np.argwhere(diff)[0].tolist()})"
        return None
    # The sums happen in fp32 on both backends but in different orders; the inputs are
    # rounded to the token dtype, so its precision sets the tolerance.
    tol = TOL.get(dtype, 1e-5)
    g, w = got.astype(np.float32), want.astype(np.float32)
    scale = max(1.0, float(np.abs(w).max(initial=0.0)))
    err = float(np.abs(g - w).max(initial=0.0))
    if not np.all(np.isfinite(g)) or err > tol * scale:
        return f"{name}: max abs error {err:.3g} > {tol:g} * {scale:.3g}"
    return None


@dataclasses.dataclass
class StressReport:
    calls: int
    cases: int
    seconds: float
    failures: list[str]

    def line(self) -> str:
        verdict = "PASS" if not self.failures else f"FAIL ({len(self.failures)} mismatches)"
        return f"STRESS {verdict}: {self.calls} unsynchronised calls over {self.cases} cases in {self.seconds:.1f}s"


def run_stress(backend: str, n_cases: int, passes: int, small: bool, seed: int = 0,
               log: Callable[[str], None] = print, dtypes: tuple[str, ...] | None = None) -> StressReport:
    rng = np.random.default_rng(seed)
    cases = make_cases(rng, n_cases, small, *([dtypes] if dtypes else []))
    inputs = [make_inputs(c, rng) for c in cases]
    progs = [program(c, backend) for c in cases]
    for i, c in enumerate(cases):
        log(f"case {i}: {c}")
    t0 = time.perf_counter()
    results: list[tuple[int, dict[str, jax.Array]]] = []
    failures: list[str] = []
    broken: set[int] = set()
    for p in range(passes):
        order = rng.permutation(len(cases))
        for i in (int(i) for i in order if int(i) not in broken):
            try:
                results.append((i, progs[i](*inputs[i])))   # no block_until_ready: calls queue up
            except Exception as e:  # a trace/compile error of one case; the others go on
                broken.add(i)
                failures.append(f"case {cases[i]}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        log(f"pass {p + 1}/{passes}: {len(results)} calls queued")
    jax.block_until_ready([r for _, r in results])
    seconds = time.perf_counter() - t0
    refs: dict[int, dict[str, np.ndarray]] = {}
    for call, (i, res) in enumerate(results):
        if i not in refs:
            refs[i] = {k: np.asarray(v) for k, v in program(cases[i], "xla")(*inputs[i]).items()}
        ref = refs[i]
        if set(res) != set(ref):
            failures.append(f"call {call} case {cases[i]}: outputs {sorted(res)} != {sorted(ref)}")
            continue
        for name in ref:
            why = same(name, np.asarray(res[name]), ref[name], cases[i].dtype)
            if why:
                failures.append(f"call {call} case {cases[i]}: {why}")
    for f in failures[:20]:
        log("MISMATCH " + f)
    return StressReport(len(results), len(cases), seconds, failures)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default=None, help="kernel backend (default: triton on GPU, else interpret)")
    p.add_argument("--cases", type=int, default=None)
    p.add_argument("--passes", type=int, default=None)
    p.add_argument("--small", action="store_true", help="tiny shapes (compute-sanitizer sweep)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtypes", default="", help="comma-separated token dtypes (default: bf16, fp16, fp32, fp8)")
    a = p.parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    backend = a.backend or ("triton" if on_gpu else "interpret")
    n_cases = a.cases or (12 if a.small else 40)
    passes = a.passes or (2 if a.small else 4)
    dtypes = tuple(d for d in a.dtypes.split(",") if d) or None
    rep = run_stress(backend, n_cases, passes, a.small, a.seed, dtypes=dtypes)
    print(rep.line(), flush=True)
    return 0 if not rep.failures else 1


if __name__ == "__main__":
    sys.exit(main())
