"""``python -m te_jax_perm.autotune``: print the cache, or tune the ops ahead of time.

    python -m te_jax_perm.autotune --print_cache
    python -m te_jax_perm.autotune --tune_shapes [--backend=triton] [--small] [--dtype=bfloat16]
        [--budget_s=240] [--shapes=deepseek-v3:8192,qwen3] [--max_candidates=24]

``--helpshort`` explains every flag.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable, Sequence

import jax
import ml_dtypes  # noqa: F401  (bfloat16 as a NumPy dtype)
import numpy as np
from absl import app, flags, logging

from te_jax_perm import autotune, workloads
from te_jax_perm.autotune.cache import call_key, format_cache, key_digest, record_counts
from te_jax_perm.core import hooks
from te_jax_perm.core.launch import Call
from te_jax_perm.ops import shipped_decls
from te_jax_perm.progress import Progress
from te_jax_perm.workloads import shape_list


def _define_flags() -> None:
    flags.DEFINE_bool("print_cache", False, "print every cached tuning result (the default when not tuning)")
    flags.DEFINE_bool("tune_shapes", False, "tune every kernel that dispatch+combine launch at real MoE sizes, "
                      "forward and backward")
    flags.DEFINE_enum("backend", None, ["triton", "interpret"], "where to tune: triton (the GPU default) or "
                      "interpret (the Triton interpreter, the CPU default)")
    flags.DEFINE_bool("small", False, "tune at the one small CPU shape only")
    flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "token dtype to tune for")
    flags.DEFINE_string("cache_dir", None, "tuning cache directory (default: $TE_JAX_PERM_AUTOTUNE_CACHE, else "
                        "~/.cache/te_jax_perm/autotune)")
    flags.DEFINE_float("budget_s", None, "wall-clock budget in seconds for --tune_shapes; no tuning starts after it")
    flags.DEFINE_string("shapes", None, "comma-separated model:T filters for --tune_shapes, e.g. "
                        "deepseek-v3:8192,qwen3")
    flags.DEFINE_integer("max_candidates", 24, "configs tried per kernel (the default config is always kept; "
                         "0: every config)", lower_bound=0)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; every setting is a --flag (--helpshort lists them)")
    logging.set_verbosity(logging.INFO)
    f = flags.FLAGS
    if f.cache_dir:
        autotune.set_cache_dir(f.cache_dir)
    if f.tune_shapes:
        try:
            shape_list(f.small, f.shapes)
        except ValueError as e:
            raise app.UsageError(f"--shapes: {e}") from None
        opts = autotune.TuneOptions(max_candidates=f.max_candidates or None)
        tune_shapes(f.backend, f.small, f.dtype, f.budget_s, f.shapes, opts,
                    on_row=lambda row: print(json.dumps(row), flush=True))
    if f.print_cache or not f.tune_shapes:
        print(format_cache(shipped_decls()))
    return 0


def record_launches(fn: Callable, args: Sequence[Any]) -> list[Call]:
    """Each kernel call in ``jax.jit(fn)(*args)``, in order; the installed resolver still runs
    (lowering under autotuning also tunes)."""
    seen: list[Call] = []
    with hooks.observe_calls(seen.append):
        jax.jit(fn).lower(*args)
    return seen


def tune_shapes(backend: str | None = None, small: bool = False, dtype: str = "bfloat16",
                budget_s: float | None = None, shapes: str | None = None, options: Any = None,
                on_row: Callable[[dict], None] | None = None) -> list[dict]:
    """Tunes each kernel that dispatch+combine launch at real MoE sizes (priority
    order), forward and backward; one row per distinct tuning key, passed to ``on_row`` as soon as it is done.

    With ``budget_s``, no tuning starts after the budget (but the first always does), and
    the one running when it runs out stops timing configs after the first (the default): its
    row says ``complete: false`` and it is not cached."""
    backend = autotune.tuning_backend(backend)
    deadline = None if budget_s is None else time.monotonic() + budget_s
    options = dataclasses.replace(options or autotune.TuneOptions(), deadline=deadline)
    rows: list[dict] = []
    seen: dict[str, str] = {}
    todo = shape_list(small, shapes)
    progress = Progress(len(todo), budget_s)
    for si, (model, H, E, k, T) in enumerate(todo):
        if rows and deadline is not None and time.monotonic() > deadline:
            logging.warning("tune_shapes: budget of %.0fs spent; %s T=%d and later shapes not tuned", budget_s,
                            model, T)
            break
        args = workloads.moe_problem(T, H, E, k, np.dtype(dtype))
        # Record only: tuning happens below, under the budget, not inside the lowering.
        with autotune.autotuning(False):
            # Inference's kernels, then those a training step adds (repeated keys are skipped).
            launches = [ln for step in (workloads.moe_step, workloads.moe_train_step)
                        for ln in record_launches(step(backend, k), args)]
        for li, ln in enumerate(launches):
            digest = key_digest(call_key(ln))
            where = f"{model} T={T}"
            if digest in seen:
                logging.info("tune_shapes: %s at %s has the key tuned at %s; not tuned again", ln.decl.name, where,
                             seen[digest])
                continue
            if rows and deadline is not None and time.monotonic() > deadline:
                logging.warning("tune_shapes: budget spent before %s at %s", ln.decl.name, where)
                break
            seen[digest] = where
            t0 = time.perf_counter()
            res = autotune.tune_call(ln, options)
            e = res.entry
            row = {"model": model, "T": T, "H": H, "E": E, "k": k, "kernel": ln.decl.name,
                   **{f: e.get(f) for f in ("best", "best_time_s", "default", "default_time_s")},
                   **record_counts(e),
                   "complete": e.get("complete", True), "cached": res.cached,
                   "wall_s": time.perf_counter() - t0, "phases_s": e.get("phases_s")}
            if row["best_time_s"] and row["default_time_s"]:
                row["speedup_vs_default"] = row["default_time_s"] / row["best_time_s"]
            rows.append(row)
            logging.info("tune_shapes: %s", progress.line(si + (li + 1) / len(launches),
                         f"shape {si + 1}/{len(todo)} ({model} T={T}), kernel {li + 1}/{len(launches)}"))
            if on_row:
                on_row(row)
    return rows


if __name__ == "__main__":
    from te_jax_perm import cli
    _define_flags()
    cli.run(main)
