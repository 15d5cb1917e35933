"""``python -m te_jax_perm.autotune``: print the cache, or tune the ops ahead of time.

    python -m te_jax_perm.autotune --print-cache
    python -m te_jax_perm.autotune --tune-shapes [--backend triton] [--small] [--dtype bfloat16]
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m te_jax_perm.autotune")
    ap.add_argument("--print-cache", action="store_true")
    ap.add_argument("--tune-shapes", action="store_true", help="tune every kernel of dispatch+combine at shapes.md")
    ap.add_argument("--backend", default=None, help="triton (GPU default) or interpret")
    ap.add_argument("--small", action="store_true", help="the small CPU shape only")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-dir", default=None)
    a = ap.parse_args(argv)
    from absl import logging
    logging.set_verbosity(logging.INFO)
    from te_jax_perm import autotune
    if a.cache_dir:
        autotune.set_cache_dir(a.cache_dir)
    if a.tune_shapes:
        for row in tune_shapes(a.backend, a.small, a.dtype):
            print(json.dumps(row))
    if a.print_cache or not a.tune_shapes:
        autotune.print_cache()
    return 0


def tune_shapes(backend: str | None = None, small: bool = False, dtype: str = "bfloat16") -> list[dict]:
    """Tunes each kernel that dispatch+combine launch, at every shapes.md size; one row per launch."""
    import jax
    import ml_dtypes  # noqa: F401  (bfloat16 as a NumPy dtype)
    from te_jax_perm import autotune
    from te_jax_perm.autotune import workloads
    backend = backend or ("triton" if jax.default_backend() == "gpu" else "interpret")
    table = workloads.SMALL_SHAPES if small else workloads.MOE_SHAPES
    np_dtype = np.dtype(dtype) if dtype != "bfloat16" else np.dtype(ml_dtypes.bfloat16)
    rows = []
    for model, H, E, k, Ts in table:
        for T in Ts:
            args = workloads.moe_problem(T, H, E, k, np_dtype)
            with autotune.autotuning(True):
                launches = workloads.record_launches(workloads.moe_step(backend, k), args)
            for ln in launches:
                res = autotune.tune(ln.decl, ln.avals, ln.params, backend)
                rows.append({"model": model, "T": T, "H": H, "E": E, "k": k, "kernel": ln.decl.name,
                             "best": res.entry.get("best"), "best_time_s": res.entry.get("best_time_s"),
                             "default": res.entry.get("default"), "default_time_s": res.entry.get("default_time_s"),
                             "rejected": len(res.entry.get("rejected", [])),
                             "failed": len(res.entry.get("failed", [])), "pruned": len(res.entry.get("pruned", []))})
    return rows


if __name__ == "__main__":
    sys.exit(main())
