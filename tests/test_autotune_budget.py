"""Capped candidate sets, and a wall-clock budget that still leaves a report behind."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from te_jax_perm.autotune.tuner import cap
from te_jax_perm.core import Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cfgs(n):
    return [Config.make(num_warps=1, B=i) for i in range(n)]


@pytest.mark.parametrize("n,limit", [(10, 4), (10, 1), (10, 2), (50, 24), (5, 8), (5, None)])
def test_cap_keeps_default_first_and_spans_the_space(n, limit):
    valid = _cfgs(n)
    default = valid[n // 2]
    kept, skipped = cap(valid, default, limit)
    assert kept[0] == default
    assert len(kept) == (n if limit is None else min(n, limit))
    assert len(set(kept)) == len(kept) and set(kept) | set(skipped) == set(valid) and not set(kept) & set(skipped)
    if limit and limit >= 3 and n > limit:
        assert valid[0] in kept and valid[-1] in kept  # the ends of the declared sweep


def test_cap_default_not_valid_is_not_added():
    valid = _cfgs(6)
    kept, _ = cap(valid, Config.make(num_warps=8, B=99), 3)
    assert len(kept) == 3 and all(c in valid for c in kept)


def test_bench_budget_writes_partial_report(tmp_path):
    """A budget spent before tuning starts still tunes the first kernel's first config (the
    default), writes tuning.json with that one row, caches nothing partial, and exits 0."""
    out = tmp_path / "at"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT] + [p for p in sys.path if p]),
               TRITON_CACHE_DIR=str(tmp_path / "triton"))
    r = subprocess.run([sys.executable, "-m", "benchmarks.autotune_bench", "--small",
                        "--dtype=float32", f"--out={out}", "--max-configs=2", "--workers=1",
                        "--max-candidates=3", "--budget-s=0.001"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    ct = json.loads((out / "compile_time.json").read_text())
    assert ct["configs"] == 2 and ct["pool_failed"] == 0
    tuning = json.loads((out / "tuning.json").read_text())
    assert tuning["done"] and len(tuning["rows"]) == 1, tuning
    (row,) = tuning["rows"]
    assert row["complete"] is False and row["timed"] == 1 and row["not_run"] == 2
    assert row["best"] == row["default"] and row["default_time_s"] > 0
    assert set(row["phases_s"]) >= {"inputs_s", "reference_s", "trials_s", "validate_s"}
    assert not list((out / "cache").glob("*.json"))  # a cut-short search is never cached
    assert not list(out.glob("*.tmp"))


def test_shapes_in_priority_order_and_filtered():
    from te_jax_perm.autotune.__main__ import shape_list
    from te_jax_perm.workloads import MOE_SHAPES
    assert shape_list() == list(MOE_SHAPES)
    assert [(m, T) for m, *_, T in shape_list(shapes="qwen3,mixtral-8x7b:16384")] == [
        ("qwen3-235b", 8192), ("mixtral-8x7b", 16384)]
    with pytest.raises(ValueError, match=r"shapes='no-such-model' matches none of the shapes; expected terms found "
                                         r"in model:T, e.g. of \['deepseek-v3:4096'"):
        shape_list(shapes="no-such-model")     # a typo must not pass for a run that tuned nothing


def test_tune_shapes_records_the_training_steps_kernels(on_cpu):
    """--tune_shapes tunes what a training step runs, not only the forward: the small
    shape's inference and training steps together launch the map build, the permute, both
    combine forwards (plain, and recording row owners) and both backwards."""
    from te_jax_perm import workloads
    from te_jax_perm.autotune.__main__ import record_launches, shape_list
    (_, h, e, k, t), = shape_list(small=True)
    args = workloads.moe_problem(t, h, e, k, np.float32)
    names = {ln.decl.name for step in (workloads.moe_step, workloads.moe_train_step)
             for ln in record_launches(step("interpret", k), args)}
    assert {"permute_probs", "unpermute_weighted", "unpermute_weighted_owner", "unpermute_bwd_weighted",
            "permute_bwd_probs"} <= names, names
    assert any(n.startswith("dispatch_map") or n.startswith("row_id_map") for n in names), names
