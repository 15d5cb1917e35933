"""CPU checks of the benchmarks' parts and of the GPU drivers (tests/gpu/ skips here).

Byte counts, target lines, kernel-time bookkeeping and wall timing are checked on made-up
or tiny inputs; the stress harness must run and its comparison must catch a single flipped bit.
"""
import json
import os
import re
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cases, timing
from benchmarks.shapes import CPU_SHAPES
from tests.gpu import stress
from tests.live_outputs import step_probe

ON_GPU = jax.default_backend() == "gpu"


def test_dispatch_bytes_count_reads_once_and_every_output():
    shape = CPU_SHAPES[0]
    p = cases.Problem.make(shape)
    built = next(c for c in cases.CASES if (c.op, c.direction) == ("token_dispatch", "fwd")).build(p, "xla")
    T, H, E, k = shape.T, shape.H, shape.E, shape.k
    item = np.dtype(shape.dtype).itemsize
    expected = (T * H * item + T * E + T * k * 4                    # tokens once, routing map, routed probs
                + T * k * H * item + T * k * 4 + T * (2 * E + 1) * 4 + E * 4)  # rows, probs, map, counts
    assert built.bytes == expected


@pytest.mark.skipif(ON_GPU, reason="interpret backend runs on the CPU platform; tests/gpu covers the GPU")
def test_stress_harness_interpret_tiny():
    rep = stress.run_stress("interpret", n_cases=2, passes=2, small=True, dtypes=("float32", "bfloat16"))
    assert rep.calls == 4 and rep.cases == 2
    assert not rep.failures, "\n".join(rep.failures)


def test_stress_cases_are_distinct_and_cover_dtypes_and_alignments():
    cs = stress.make_cases(np.random.default_rng(0), 40, small=False)
    assert len(set(cs)) == 40
    assert {c.dtype for c in cs} == {"bfloat16", "float16", "float32", stress.FP8}
    assert {c.align for c in cs} == {None, 16, 32}
    assert {c.skew for c in cs} == {"uniform", "hot", "empty"}
    assert any(c.drop for c in cs) and any(not c.with_probs for c in cs)


def test_stress_comparison_catches_one_flipped_bit_and_large_errors():
    want = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = want.copy()
    assert stress.same("dispatch", got, want, "float32") is None
    got[1, 2] = np.nextafter(got[1, 2], np.float32(100))
    assert "1 of 12" in stress.same("dispatch", got, want, "float32")
    assert stress.same("combine", got, want, "float32") is None  # within fp32 tolerance
    got[0, 0] += 1.0
    assert "max abs error" in stress.same("combine", got, want, "float32")
    assert "shape/dtype" in stress.same("combine", got[:2], want, "float32")
    zero = np.zeros(3, np.float32)
    assert stress.same("sort", -zero, zero, "float32") is not None


def test_gpu_driver_names_its_steps_and_rejects_others(tmp_path):
    """The one GPU driver (python3 -m tests.gpu.run): --helpshort exits 0, an unknown step
    is an error naming the steps there are, and nothing runs."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root))
    run = lambda *a: subprocess.run([sys.executable, "-m", "tests.gpu.run", *a], cwd=root, env=env,
                                    capture_output=True, text=True, timeout=300)
    helped = run("--helpshort")
    assert helped.returncode == 0 and "--steps" in helped.stdout, helped.stderr[-2000:]
    bad = run(f"--out={tmp_path}", "--steps=pytest,bogus")
    assert bad.returncode != 0 and "unknown ['bogus']" in bad.stderr and "'memcheck'" in bad.stderr, bad.stderr
    assert not (tmp_path / "summary.txt").exists()


# What each benchmark measures or launches first: a bad flag must end the run before it.
FIRST_WORK = {"layer_bench": "copy_bandwidth_gbps", "peer": "te_module", "config_sweep": "sweep_movers",
              "autotune_bench": "compile_time"}


@pytest.mark.parametrize("bench, argv", [
    ("layer_bench", ["--mode", "cpu", "--shapes", "NoSuchShape"]),
    ("layer_bench", ["--mode", "cpu", "--steps", "-1"]),
    ("peer", ["--shapes", "NoSuchShape"]),
    ("peer", ["--calls", "0"]),
    ("config_sweep", ["--part", "movers", "--shapes", "NoSuchShape"]),
    ("config_sweep", ["--part", "movers", "--tokens", "16,x"]),
    ("autotune_bench", ["--small", "--shapes", "NoSuchShape"]),
])
def test_a_bad_flag_ends_a_benchmark_before_it_writes_or_measures(bench, argv, tmp_path, monkeypatch):
    import importlib
    module = importlib.import_module(f"benchmarks.{bench}")

    def measured(*a, **kw):
        raise AssertionError(f"{bench} {argv}: started measuring before it checked its flags")

    monkeypatch.setattr(module, FIRST_WORK[bench], measured)
    out = tmp_path / "out"
    with pytest.raises(SystemExit):
        module.main(["--out", str(out), *argv])
    assert not out.exists(), f"{bench} {argv}: wrote its output directory before it checked its flags"


def test_ncu_movers_checks_every_shape_name_before_the_first_launch(monkeypatch):
    from benchmarks import ncu_movers
    from benchmarks.shapes import GPU_SHAPES

    def launched(*a, **kw):
        raise AssertionError("a shape was set up before every name was checked")

    monkeypatch.setattr(cases.Problem, "make", launched)
    with pytest.raises(SystemExit, match="NoSuchShape"):
        ncu_movers.run([GPU_SHAPES[0].name, "NoSuchShape"])


def test_ep_bench_rejects_steps_below_one():
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "benchmarks.ep_bench", "--steps=0"], cwd=root, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(root)))
    assert done.returncode != 0 and "steps" in done.stderr, done.stdout[-2000:] + done.stderr[-2000:]


def test_gpu_driver_splits_pytest_args_as_a_shell_would(tmp_path):
    """``--pytest_args="-k 'a or b'"`` reaches pytest as two arguments (split on spaces, the
    quoted expression fell apart and pytest collected nothing)."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "tests.gpu.run", "--dry_run", "--steps=pytest", f"--out={tmp_path}",
                           "--workers=0", "--pytest_args=-k 'bytes_count or no_such_test'"], cwd=root, capture_output=True,
                          text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(root)))
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 0 and "STEP pytest: PASS" in summary, summary + done.stderr[-2000:]


@pytest.mark.parametrize("case,kernel", [("token_combine.bwd", "unpermute_bwd_weighted"),
                                         ("sort_chunks_by_index.fwd", "sort_chunks_probs"),
                                         ("sort_chunks_by_index.bwd", "sort_chunks_probs")])
def test_sweep_binds_each_kernel_to_the_operands_its_op_hands_it(case, kernel):
    """The config sweep's call of a kernel (a permutation mover or the chunk sort's) is bound
    to the operands the op passes it; launched under a config, it gives the kernel's
    reference outputs on them (here on the interpreter, as the sweep does on the GPU)."""
    import dataclasses
    from benchmarks import cases
    from benchmarks.config_sweep import AUX, MOVERS, mover_call
    from benchmarks.shapes import GPU_SHAPES, by_name
    from te_jax_perm.core.interpret_backend import interpret_call
    from te_jax_perm.core.launch import configure
    assert (case, kernel) in MOVERS + AUX
    shape = dataclasses.replace(by_name("gpt-oss", GPU_SHAPES)[0], T=8, H=96)
    # The interpreter lowers for the CPU only: on a GPU machine the op runs on its CPU device.
    with jax.default_device(jax.devices("cpu")[0]):
        call, operands = mover_call(cases.Problem.make(shape), case, kernel, backend="interpret")
        assert call.decl.name == kernel and call.dims["H"] == 96 and call.backend == "interpret"
        assert [(tuple(o.shape), np.dtype(o.dtype)) for o in operands] == \
            [(tuple(a.shape), np.dtype(a.dtype)) for a in call.avals]
        launch = configure(call, call.decl.default_config(call.dims, call.params))
        got = jax.jit(lambda ops: interpret_call(launch, ops))(operands)
    want = call.decl.reference(*operands, **dict(call.params))
    assert len(got) == len(want) == len(call.out_avals)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-2)


def test_quick_sweeps_take_whole_and_half_rows_at_one_stage():
    from benchmarks.config_sweep import sweep_candidates
    from te_jax_perm.ops.permute import decl as D
    dims = {"T": 16384, "H": 7168, "E": 256, "W": 513, "N": 131072, "R": 131072}
    for decl in (D.unpermute_bwd_weighted.decl, D.permute_probs.decl):
        quick = sweep_candidates(decl, dims, {"padded": False, "num_out_rows": 131072}, {1}, quick=True)
        assert {c.kw["BLOCK_H"] for c in quick} == {4096, 8192}
        assert all(c.kw["ROWS"] == 1 and c.num_stages == 1 for c in quick)
        assert {c.num_warps for c in quick} == {c.num_warps for c in decl.configs}


def test_a_full_sweeps_first_phase_times_every_tile_shape_and_warp_count():
    """Phase one runs at one stage count; a family declared without it (the sorter's, at
    one stage only) enters at its nearest, not never."""
    from benchmarks.config_sweep import FIRST_STAGES, sweep_candidates
    from te_jax_perm.ops.chunk_sort import decl as C
    from te_jax_perm.ops.permute import decl as D
    family = lambda c: (tuple(sorted(c.kw.items())), c.num_warps)  # noqa: E731
    for decl, dims, params in (
            (D.unpermute_bwd_weighted.decl, {"T": 8192, "H": 4096, "E": 128, "W": 257, "N": 65536, "R": 65536},
             {"padded": False, "num_out_rows": 65536}),
            (C.sort_chunks.decl, {"N": 65536, "H": 4096}, {})):
        valid = [c for c in decl.configs if not decl.violated(dims, params, c)]
        got = sweep_candidates(decl, dims, params, {FIRST_STAGES})
        assert {family(c) for c in got} == {family(c) for c in valid}
        assert len(got) == len({family(c) for c in got})
        declared = {c.num_stages for c in valid}
        want = FIRST_STAGES if FIRST_STAGES in declared else min(declared, key=lambda s: abs(s - FIRST_STAGES))
        assert {c.num_stages for c in got} == {want}
    assert FIRST_STAGES not in {c.num_stages for c in C.sort_chunks.decl.configs}   # the case it covers


def test_a_sweep_group_stops_timing_configs_once_its_budget_is_spent():
    from benchmarks.config_sweep import within_budget
    now = iter([1.0, 2.0, 3.0, 4.0, 5.0])
    got = list(within_budget(["dflt", "a", "b", "c", "d"], 2.5, clock=lambda: next(now)))
    assert got == [("dflt", True), ("a", True), ("b", True), ("c", False), ("d", False)]
    assert all(run for _, run in within_budget(["dflt", "a"], None))
    # The first config (the default) runs even past the deadline.
    assert list(within_budget(["dflt", "a"], 0.0, clock=lambda: 9.0)) == [("dflt", True), ("a", False)]


def test_the_sweeps_runoff_takes_the_close_configs_and_the_default():
    from benchmarks.config_sweep import RUNOFF_MAX, RUNOFF_PCT, runoff_entrants

    def row(name, us, agrees=True):
        return {"config_str": name, "us": us, "agrees": agrees}
    near = 100 * (1 + RUNOFF_PCT / 100)
    group = [row("slow", 150.0), row("best", 100.0), row("close", near - 0.1), row("far", near + 0.1),
             row("wrong", 99.0, agrees=False), row("failed", None), row("dflt", 120.0)]
    # Configs within RUNOFF_PCT of the fastest that agree, fastest first, then the default.
    assert [r["config_str"] for r in runoff_entrants(group, "dflt")] == ["best", "close", "dflt"]
    # The default among the close ones runs once.
    assert [r["config_str"] for r in runoff_entrants(group, "close")] == ["best", "close"]
    # One entrant decides nothing: no runoff.
    assert runoff_entrants([row("best", 100.0), row("slow", 150.0)], "best") == []
    assert runoff_entrants([row("wrong", 1.0, agrees=False)], "wrong") == []
    many = [row(f"c{i}", 100.0 + i * 0.01) for i in range(RUNOFF_MAX + 3)]
    assert len(runoff_entrants(many, "c0")) == RUNOFF_MAX


def test_default_table_takes_the_fastest_config_and_a_later_sweep_supersedes(tmp_path):
    from benchmarks.config_sweep import default_table

    def sweep(name, rows):
        path = tmp_path / name
        path.write_text(json.dumps({"rows": [{"kernel": "k", "H": 4096, "T": t, "config": c, "us": us}
                                             for t, c, us in rows]}))
        return str(path)
    old = sweep("old.json", [(8192, "a", 10.0), (8192, "b", 9.0), (64, "c", 1.0)])
    new = sweep("new.json", [(8192, "d", 11.0), (8192, "e", 12.0)])
    assert default_table([old]) == {"k": {"4096": {"64": "c", "8192": "b"}}}
    # The re-measured group takes the new file's best, even though the old timings were lower.
    assert default_table([old, new]) == {"k": {"4096": {"64": "c", "8192": "d"}}}


def test_default_table_serves_every_shape_sharing_a_key(tmp_path):
    """Two shapes with one (H, T) key: the entry is the config least slow at both against
    each one's best, not the best config of the shape whose kernel happens to be fastest."""
    from benchmarks.config_sweep import default_table
    rows = [{"kernel": "k", "H": 4096, "T": 8192, "shape": s, "config": c, "us": us}
            for s, c, us in (("small", "a", 68.6), ("small", "b", 69.4), ("small", "c", 80.0),
                             ("big", "a", 213.6), ("big", "b", 205.7), ("big", "c", 204.0))]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"rows": rows}))
    # a: 1.000 / 1.047 slower; b: 1.012 / 1.008; c: 1.166 / 1.000 -> b.
    assert default_table([str(path)]) == {"k": {"4096": {"8192": "b"}}}


def test_small_t_targets_compare_kernels_and_judge_the_wall_against_the_launch_floor():
    from benchmarks.small_t import target_lines
    row = lambda backend, T, kernel, wall, floor: {  # noqa: E731
        "model": "m", "backend": backend, "T": T, "kernel_us": kernel, "wall_us": wall,
        "wall_over_kernel": wall / kernel, "floor_us": floor}
    rows = [row("triton", 16, 30.0, 90.0, 41.0), row("xla", 16, 33.0, 95.0, 41.0),
            row("triton", 256, 70.0, 72.0, 41.0), row("xla", 256, 60.0, 62.0, 41.0)]
    kernels, wall = target_lines(rows)
    assert kernels.startswith("TARGET small-T triton kernel <= xla kernel: FAIL") and "T=256: 70.0 vs 60.0us" in kernels
    # 1.3x 30us = 39us is below the 41us floor: no step with these arguments launches that fast.
    assert wall.startswith("TARGET small-T wall <= 1.3x kernel: OUT OF REACH")
    assert "T=16: wall 90us = 3.00x kernel (floor 41us > 1.3x kernel 39us)" in wall
    assert "PASS" in target_lines(rows[:2] + rows[3:])[0]
    # A floor within reach makes the miss a failure; a wall within 1.3x passes.
    assert target_lines([row("triton", 16, 40.0, 90.0, 41.0)])[1].startswith("TARGET small-T wall <= 1.3x kernel: FAIL")
    assert target_lines([row("triton", 64, 40.0, 50.0, 41.0)])[1].startswith("TARGET small-T wall <= 1.3x kernel: PASS")
    assert target_lines([row("triton", 64, 40.0, 90.0, 41.0), row("triton", 16, 30.0, 90.0, 41.0)])[1].startswith(
        "TARGET small-T wall <= 1.3x kernel: FAIL")


def test_sweep_table_leaves_out_configs_that_disagree(tmp_path):
    from benchmarks.config_sweep import default_table
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"rows": [{"kernel": "k", "H": 8, "T": 8, "config": "fast", "us": 1.0, "agrees": False},
                                         {"kernel": "k", "H": 8, "T": 8, "config": "ok", "us": 2.0, "agrees": True}]}))
    assert default_table([str(path)]) == {"k": {"8": {"8": "ok"}}}


def test_default_table_keys_a_kernel_by_its_own_row_count_and_serves_both_directions(tmp_path):
    """A chunk-sort row (its row count N recorded as ``rows``) is keyed by N, not the shape's
    token count; its forward and backward at one shape are two shapes the entry must serve
    (the config least slow at both)."""
    from benchmarks.config_sweep import default_table
    row = lambda case, c, us: {  # noqa: E731
        "kernel": "sort_chunks_probs", "H": 2880, "T": 8192, "rows": 32768, "shape": "s", "case": case, "config": c, "us": us}
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"rows": [row("fwd", "a", 10.0), row("fwd", "b", 10.4), row("bwd", "a", 12.0),
                                         row("bwd", "b", 10.0), row("bwd", "c", 9.0)]}))
    # a: 1.00 forward, 1.33 backward; b: 1.04, 1.11 (c, the backward's fastest, was not timed forward).
    assert default_table([str(path)]) == {"sort_chunks_probs": {"2880": {"32768": "b"}}}


def test_default_tables_rebuild_only_the_swept_devices(tmp_path):
    from benchmarks.config_sweep import default_tables
    path = tmp_path / "h200.json"
    path.write_text(json.dumps({"meta": {"device": "H200"},
                                "rows": [{"kernel": "k", "H": 8, "T": 8, "config": "c", "us": 1.0}]}))
    shipped = {"H100": {"k": {"8": {"8": "old"}}}, "H200": {"k": {"8": {"8": "stale"}}}}
    assert default_tables([str(path)], shipped) == {"H100": {"k": {"8": {"8": "old"}}},
                                                     "H200": {"k": {"8": {"8": "c"}}}}


def test_shipped_mover_table_is_what_the_listed_sweeps_build():
    """The shipped default table is exactly what ``config_sweep --table`` builds from the
    sweeps its listing names: no entry edited by hand, no listed sweep missing."""
    from benchmarks.config_sweep import default_tables, table_sweeps
    from te_jax_perm.ops import tuned_defaults
    paths = table_sweeps()
    assert paths and all(os.path.exists(p) for p in paths), paths
    assert default_tables(paths) == tuned_defaults.shipped_tables()


def test_gpu_driver_hostile_memcheck_selects_existing_tests():
    """Every test the hostile-input memcheck names exists (a renamed test would otherwise
    drop out of it silently), and the selection keeps tests on the kernel backend."""
    import pathlib
    from tests.gpu.hostile import HOSTILE_TESTS, collect
    root = pathlib.Path(__file__).resolve().parents[1]
    ids = collect(root, dict(os.environ, PYTHONPATH=str(root)))
    for target in HOSTILE_TESTS:
        assert any(i.startswith(target) for i in ids), target
    assert not any("[xla" in i for i in ids)


def _quick_test(tmp_path) -> str:
    """A test file that passes at once, outside the repository (no conftest, no jax to
    import): the driver tests below are about the driver, not about what it runs."""
    path = tmp_path / "test_quick.py"
    path.write_text("def test_passes():\n    pass\n")
    return str(path)


def _stand_in_sanitizer(path, test: str, before: str = "", run: str = "os.execv(cmd[0], cmd)") -> str:
    """A stand-in for compute-sanitizer at ``path``: drops the sanitizer's arguments, points
    the driver's pytest command (its last argument is the test id) at ``test``, runs
    ``before``, then ``run``."""
    import sys
    from tests.gpu.hostile import MEMCHECK_ARGS
    path.write_text(f"#!{sys.executable}\nimport os, signal, subprocess, sys, time\n"
                    f"cmd = sys.argv[1 + {len(MEMCHECK_ARGS)}:]\ncmd[-1] = {test!r}\n{before}\n{run}\n")
    path.chmod(0o755)
    return str(path)


def _quick_pytest_env(root):
    """The driver's environment for a trivial test file: the sanitized pytest loads no
    installed plugin, so it reaches the test within a second even on a machine busy with
    a whole test suite (its time limit counts from the process start, the stack dump's
    from the test's)."""
    return dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")


@pytest.mark.slow
def test_gpu_driver_hostile_memcheck_reruns_a_crash_or_hang_once_and_fails_on_errors(tmp_path):
    """The hostile-input memcheck runs each test in a sanitized process of its own: a process
    killed by a signal or past its time limit without a report is rerun once; a memcheck
    report fails the run. Here stand-in sanitizers crash, or hang, on their first call and
    then run the test; another reports a memcheck error."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    test = _quick_test(tmp_path)
    once = lambda name, act: (f"if not os.path.exists({str(tmp_path / name)!r}):\n"  # noqa: E731
                              f"    open({str(tmp_path / name)!r}, 'w').close()\n    {act}")
    sanitizers = {
        "crash_once": _stand_in_sanitizer(tmp_path / "crash_once.py", test,
                                          once("crashed", "os.kill(os.getpid(), signal.SIGSEGV)")),
        "hang_once": _stand_in_sanitizer(tmp_path / "hang_once.py", test, once("hung", "time.sleep(120)")),
        "reports": _stand_in_sanitizer(tmp_path / "reports.py", test, run="subprocess.call(cmd)\n"
                                       "print('========= ERROR SUMMARY: 1 error')\nsys.exit(99)"),
    }
    env = _quick_pytest_env(root)
    runs = {}
    for name, sanitizer in sanitizers.items():
        runs[name] = subprocess.run(
            [sys.executable, "-m", "tests.gpu.hostile", f"--sanitizer={sanitizer}", f"--out={tmp_path / name}",
             f"--tests={test}", "--timeout_s=10"], cwd=root, capture_output=True, text=True, timeout=600, env=env)
    for name in ("crash_once", "hang_once"):  # died or hung without a report: rerun once
        run = runs[name]
        assert run.returncode == 0, run.stdout + run.stderr
        assert "MEMCHECK-HOSTILE PASS: 1 of 1" in run.stdout and "1 passed on a rerun" in run.stdout, run.stdout
        assert "(try 2)" in run.stdout
    assert "TIMEOUT" in runs["hang_once"].stdout
    report = runs["reports"]
    assert report.returncode == 1, report.stdout + report.stderr
    assert "MEMCHECK-HOSTILE FAIL: 0 of 1" in report.stdout, report.stdout
    assert re.search(r"memcheck: \S*test_quick\.py::test_passes", report.stdout), report.stdout


@pytest.mark.slow
def test_gpu_driver_hostile_memcheck_logs_where_a_hung_test_hangs(tmp_path):
    """A sanitized test still running at three quarters of its limit dumps its Python stack
    before it is killed, and the run prints that log's end and each test's time: a hang on
    the GPU machine says where it hung even when the log files do not come back. Here the
    stand-in sanitizer points the driver's own pytest command at a test that never returns."""
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    hangs = tmp_path / "test_hangs.py"
    hangs.write_text("import time\n\n\ndef test_waits_forever():\n    time.sleep(120)\n")
    stand_in = _stand_in_sanitizer(tmp_path / "hang.py", str(hangs))
    run = subprocess.run([sys.executable, "-m", "tests.gpu.hostile", f"--sanitizer={stand_in}",
                          f"--out={tmp_path / 'out'}", f"--tests={_quick_test(tmp_path)}", "--timeout_s=10"],
                         cwd=root, capture_output=True, text=True, timeout=300,
                         env=_quick_pytest_env(root))
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"^TIMEOUT +\S+ \(1\d s\) \(try 2\)$", run.stdout, re.M), run.stdout
    assert "Timeout (0:00:07)!" in run.stdout and "in test_waits_forever" in run.stdout, run.stdout
    assert "MEMCHECK-HOSTILE FAIL: 0 of 1" in run.stdout


def test_gpu_driver_hostile_memcheck_verdicts():
    """A sanitized process killed by a signal is a crash (rerun once) even when the
    sanitizer printed its "ERROR SUMMARY: 0 errors"; pytest's own failure is a failure."""
    from tests.gpu.hostile import verdict
    summary = "========= ERROR SUMMARY: 0 errors"
    assert verdict(-11, "tests/x.py::t PASSED\n" + summary) == "crash"
    assert verdict(1, "1 failed in 2.0s\n" + summary) == "fail"
    assert verdict(0, "1 passed in 1.0s\n" + summary) == "pass"
    assert verdict(99, "1 passed in 1.0s\n========= ERROR SUMMARY: 2 errors") == "memcheck"


def test_peer_targets_compare_kernel_times_and_time_per_byte(tmp_path):
    from benchmarks import peer

    def row(op, impl, us, nbytes, pct):
        return {"shape": "S", "op": op, "impl": impl, "kernel_us": us, "bytes": nbytes, "pct_copy": pct}

    rows = [row("token_combine.fwd", "ours", 10.0, 1000, 95.0), row("token_combine.fwd", "te", 9.0, 1000, 99.0),
            row("token_combine.bwd", "ours", 25.0, 2000, 80.0), row("token_combine.bwd", "te", 30.0, 2000, 70.0)]
    rows[0]["spread_pct"], rows[1]["spread_pct"] = 0.4, 1.3  # older results carry none: no spread is shown
    lines = peer.targets(rows)
    assert lines[0] == ("TARGET FAIL S token_combine.fwd: ours 10.0 µs <= te 9.0 µs (ratio 0.90x; "
                        "95.0% and 99.0% of the device copy; call-to-call spread 0.4% and 1.3%)")
    assert lines[1].endswith("80.0% and 70.0% of the device copy)")
    assert lines[1].startswith("TARGET PASS S token_combine.bwd: ours 25.0 µs <= te 30.0 µs")
    # 25 µs for 2000 bytes against 10 µs for 1000: 1.25x the forward's time per byte.
    assert lines[2].startswith("TARGET FAIL S token_combine.bwd: time per byte <= 1.1x forward's (1.25x;")
    # Trailing at 97% or more of the copy's rate by less than the larger spread: at the limit.
    tie = [row("token_dispatch.bwd", "ours", 100.5, 1000, 98.0), row("token_dispatch.bwd", "te", 100.0, 1000, 98.5)]
    tie[0]["spread_pct"], tie[1]["spread_pct"] = 0.3, 0.6
    assert peer.targets(tie)[0].startswith("TARGET AT LIMIT S token_dispatch.bwd: ours 100.5 µs <= te 100.0 µs")
    tie[1]["spread_pct"] = 0.4  # a gap of 0.5% against spreads of 0.3% and 0.4%
    assert peer.targets(tie)[0].startswith("TARGET FAIL")
    tie[1]["spread_pct"], tie[0]["pct_copy"] = 0.6, 96.9  # below 97% of the copy's rate
    assert peer.targets(tie)[0].startswith("TARGET FAIL")
    del tie[0]["spread_pct"]  # no spread measured: no tie can be told from a loss
    tie[0]["pct_copy"] = 98.0
    assert peer.targets(tie)[0].startswith("TARGET FAIL")
    rows[0]["wall_us"], rows[1]["wall_us"] = 31.0, 12.5  # the wall time per call, beside the kernel time
    assert peer.targets(rows)[0] == lines[0][:-1] + "; wall 31.0 and 12.5 µs a call)"
    del rows[0]["wall_us"]
    path = tmp_path / "peer.json"
    path.write_text(json.dumps({"meta": {}, "rows": rows, "targets": []}))
    assert peer.main(["--summary", str(path)]) == 0
    assert json.loads(path.read_text())["targets"] == lines
    assert (tmp_path / "peer_summary.txt").read_text() == "\n".join(lines) + "\n"
    pytest.importorskip("matplotlib")
    assert (tmp_path / "peer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"   # the chart, redrawn beside it

def test_kernel_times_split_by_call_and_their_spread():
    from benchmarks.kernel_timer import KernelTimes
    t = KernelTimes("x", 4, [("a", 1.0), ("b", 9.0), ("a", 1.0), ("b", 10.0), ("a", 1.0), ("b", 11.0),
                             ("a", 2.0), ("b", 30.0)])
    assert t.per_call_sums() == [10.0, 11.0, 12.0, 32.0] and t.per_call_us() == 11.5
    q1, _, q3 = statistics.quantiles([10.0, 11.0, 12.0, 32.0], n=4)
    assert t.spread_pct() == 100 * (q3 - q1) / 11.5
    assert t.per_call_us(lambda n: n == "a") == 1.0
    uneven = KernelTimes("y", 2, [("a", 1.0), ("a", 2.0), ("a", 3.0)])  # kernels not split evenly by call
    assert uneven.per_call_sums() == [] and uneven.per_call_us() == 3.0 and uneven.spread_pct() is None
    assert KernelTimes("z", 3, [("a", 1.0)] * 3).spread_pct() is None   # fewer than four calls


def test_wall_time_enqueues_each_labels_calls_back_to_back_in_turns_and_waits_once(monkeypatch):
    import time

    from benchmarks import kernel_timer
    clock, log = [0.0], []

    def op(label, seconds):
        def call():
            log.append(label)
            clock[0] += seconds
            return label
        return call

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(kernel_timer, "wait_for", lambda out: log.append(f"wait {out}"))
    walls = kernel_timer.wall_us([("a", op("a", 2e-6)), ("b", op("b", 5e-6))], calls=3, reps=2)
    assert walls == pytest.approx([2.0, 5.0])
    # Per round: one call waited for (outside the timing), then three enqueued and one wait.
    one_round = ["a", "wait a", "a", "a", "a", "wait a", "b", "wait b", "b", "b", "b", "wait b"]
    assert log == one_round * 2


def test_wall_time_keeps_one_calls_outputs_live(monkeypatch):
    # A label's calls run as a training loop runs its steps: each call's outputs are dropped
    # before the next is enqueued, so a large layer's timing never holds two steps' buffers.
    from benchmarks import kernel_timer
    monkeypatch.setattr(kernel_timer, "wait_for", lambda out: None)
    step, seen = step_probe()
    kernel_timer.wall_us([("a", step)], calls=4, reps=1)
    assert seen == [0] * 5, f"outputs of earlier calls alive at each call: {seen}"


def test_kernel_times_of_several_rounds_merge_by_label_in_the_first_rounds_order(monkeypatch):
    """``measure(rounds=3)`` profiles the labels in order, reversed, then in order again, and
    each label's result holds the calls of all three rounds."""
    from benchmarks import kernel_timer
    from benchmarks.kernel_timer import KernelTimes
    orders, us = [], iter(range(1, 100))

    def once(items, calls, warmup):
        orders.append([label for label, _ in items])
        return [KernelTimes(label, calls, [("k", float(next(us)))] * calls) for label, _ in items]

    monkeypatch.setattr(kernel_timer, "profile_once", once)
    got = kernel_timer.measure([("copy", None), ("ours", None), ("te", None)], calls=2, rounds=3)
    assert orders == [["copy", "ours", "te"], ["te", "ours", "copy"], ["copy", "ours", "te"]]
    assert [t.label for t in got] == ["copy", "ours", "te"]
    # copy: 1.0 (round 1), 6.0 (round 2, timed last), 7.0 (round 3); two calls each.
    assert got[0].calls == 6 and got[0].per_call_sums() == [1.0, 1.0, 6.0, 6.0, 7.0, 7.0]
    assert got[0].per_call_us() == 6.0 and got[2].per_call_sums() == [3.0, 3.0, 4.0, 4.0, 9.0, 9.0]
    assert kernel_timer.measure([("a", None)], calls=1) == [KernelTimes("a", 1, [("k", 10.0)])]


def test_wall_ms_blocks_on_every_timed_call_after_one_untimed_one():
    calls = [0]

    def op(x):
        jax.debug.callback(lambda: calls.__setitem__(0, calls[0] + 1))
        return x + 1

    ms = timing.wall_ms(jax.jit(op), (jnp.zeros(3),), reps=4)
    assert len(ms) == 4 and all(t > 0 for t in ms) and calls[0] == 5
    assert timing.median_wall_ms(jax.jit(op), (jnp.zeros(3),), reps=0) > 0   # at least one timed call


# -- the grouped-GEMM problems of grouped_gemm_bench and layer_bench -------------------------
def _arrays(closed_jaxpr) -> list:
    """The aval of every value a jaxpr computes, its sub-jaxprs' (jit, scan, custom VJP) included."""
    out, todo = [], [closed_jaxpr]
    while todo:
        j = todo.pop()
        j = getattr(j, "jaxpr", j)
        out += [v.aval for v in j.invars]
        for eqn in j.eqns:
            out += [v.aval for v in eqn.outvars]
            for p in eqn.params.values():
                todo += [q for q in (p if isinstance(p, (list, tuple)) else [p]) if hasattr(q, "eqns")
                         or hasattr(getattr(q, "jaxpr", None), "eqns")]
    return out


def wide_arrays(closed_jaxpr, min_elems: int) -> list[str]:
    """The arrays of 4-byte (or wider) numbers with at least ``min_elems`` elements."""
    return [str(a) for a in _arrays(closed_jaxpr) if isinstance(getattr(a, "dtype", None), np.dtype)
            and a.dtype.itemsize >= 4 and a.size >= min_elems]


def test_operand_builder_never_holds_a_float32_copy_of_the_weights():
    """DeepSeek-V3's expert weights ([256, 7168, 4096] bf16, 14 GiB) are drawn one expert
    at a time: traced (nothing allocated), no float32 value or random bits of more than one
    expert exist; compiled, XLA's buffer assignment needs the result and a few slices beside
    it, not the 28 GiB a float32 draw of the whole array takes."""
    from benchmarks import gemm_problems as gp
    key = jax.random.key(0)
    shape = (256, 7168, 4096)
    draw = jax.jit(lambda k: gp.random_normal(k, shape, jnp.bfloat16, scale=7168 ** -0.5))
    one_expert = 7168 * 4096
    assert gp.slice_rows(shape) == 1
    jaxpr = jax.make_jaxpr(draw)(key)
    assert jaxpr.out_avals[0].shape == shape and jaxpr.out_avals[0].dtype == jnp.bfloat16
    assert not wide_arrays(jaxpr, one_expert + 1)
    assert wide_arrays(jaxpr, one_expert)   # the checker sees the float32 draw of one expert
    # The checker flags a draw of the whole array in float32, and the float32 promotion that
    # dividing bf16 by a NumPy float64 makes.
    assert wide_arrays(jax.make_jaxpr(lambda k: jax.random.normal(k, shape, jnp.float32).astype(jnp.bfloat16))(key),
                       one_expert + 1)
    assert wide_arrays(jax.make_jaxpr(lambda k: jax.random.normal(k, shape, jnp.bfloat16) / np.sqrt(7168))(key),
                       one_expert + 1)
    mem = draw.lower(key).compile().memory_analysis()
    assert mem.output_size_in_bytes == 2 * 256 * one_expert
    assert mem.temp_size_in_bytes < 4 * 256 * one_expert / 16, mem.temp_size_in_bytes / 2**30


def test_random_normal_is_normal_with_every_slice_its_own():
    from benchmarks import gemm_problems as gp
    key = jax.random.key(3)
    shape = (6, 40, 24)
    x = gp.random_normal(key, shape, jnp.bfloat16, scale=0.5, slice_bytes=4 * 40 * 24)   # one group a slice
    assert x.shape == shape and x.dtype == jnp.bfloat16
    v = np.asarray(x, np.float32)
    assert abs(v.mean()) < 0.02 and abs(v.std() - 0.5) < 0.02, (v.mean(), v.std())
    assert len(np.unique(v)) > 1000 and np.mean(v == 0) < 0.01    # float32 draws, not 8-bit bf16 ones
    groups = v.reshape(6, -1)
    assert all(not np.array_equal(groups[i], groups[j]) for i in range(6) for j in range(i))
    np.testing.assert_array_equal(np.asarray(gp.random_normal(key, shape, jnp.bfloat16, scale=0.5,
                                                              slice_bytes=4 * 40 * 24), np.float32), v)
    assert gp.slice_rows((65536, 7168)) == 4096 and gp.slice_rows((96, 32)) == 96
    assert gp.slice_rows((7, 1 << 26)) == 1                     # a row over the limit: one row a slice
    assert gp.random_normal(key, (0, 4), jnp.float32).shape == (0, 4)


def test_both_gemm_benchmarks_time_the_shapes_of_their_committed_results():
    """One table serves both benchmarks; each committed result's shapes are in it, under the
    same name and sizes, so that new results compare with the committed ones."""
    from benchmarks import gemm_problems as gp
    from benchmarks import layer_bench
    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
    table = {s.name: s for s in gp.SHAPES}
    for device in ("H100", "H200"):
        with open(os.path.join(results, f"grouped_gemm_{device}.json")) as f:
            for name, r in json.load(f)["shapes"].items():
                assert (table[name].M, table[name].K, table[name].N, table[name].G) == (r["M"], r["K"], r["N"], r["G"])
        with open(os.path.join(results, f"layer_{device}.json")) as f:
            committed = [(r["M"], r["K"], r["N"], r["G"]) for r in json.load(f)["gemm_table"]]
        # The table may have grown since (a shape added); every committed row is still in it.
        assert [x for x in ((s.M, s.K, s.N, s.G) for s in layer_bench.GPU_GEMMS) if x in committed] == committed
    assert all(s in gp.SHAPES for s in layer_bench.GPU_GEMMS)
    assert gp.named("qwen3_up_T8192") == (table["qwen3_up_T8192"],)
    with pytest.raises(KeyError, match="nope"):
        gp.named("nope")
    sizes = gp.group_sizes(1000, 7)
    assert sizes.dtype == np.int32 and sizes.sum() == 1000 and len(sizes) == 7
    np.testing.assert_array_equal(sizes, gp.group_sizes(1000, 7))
    s = gp.GemmShape("x", 8, 4, 2, 3)
    assert s.flops == 128 and s.tflops(1.0, gemms=3) == 3 * 128 / 1e9 and s.bytes_fwd("bfloat16") == 2 * (32 + 24 + 16)


def test_real_model_shapes_carry_their_models_dimensions():
    """The autotuner's and every benchmark's real-model shapes carry the dimensions of their
    model in ``te_jax_perm.workloads.MODELS``, and the committed results' shapes are among
    them under the same names and sizes; the layer benchmark's expert GEMMs in the GEMM table
    follow from its layers (M = T*k rows; the up-projection's N = 2F, gate and up fused; the
    down-projection's K = F; a group per expert). The benchmarks' per-model targets name
    exactly the models they run."""
    from benchmarks import gemm_problems as gp
    from benchmarks import layer_bench, shapes, small_t
    from te_jax_perm import workloads as wl
    by_name = {m.name: m for m in wl.MODELS}
    by_key = {m.key: m for m in wl.MODELS if m.key}
    assert len(by_name) == len(wl.MODELS)

    def dims(m):
        return m.H, m.E, m.k

    moe = shapes.GPU_SHAPES + shapes.OFF_LIST_SHAPES
    assert all(dims(s) == dims(by_name[s.model]) for s in moe)
    assert all((H, E, k) == dims(by_key[m]) for m, H, E, k, _ in wl.shape_list())
    assert all(m in wl.MODELS for m in small_t.MODELS.values())

    # A layer without a step target is never judged.
    assert set(layer_bench.TARGET_STEP) == {s.model for s in layer_bench.GPU_SHAPES}

    labels = {wl.DEEPSEEK_V3.name: "deepseek_v3", wl.QWEN3_235B.name: "qwen3", wl.MIXTRAL_8X7B.name: "mixtral"}
    layer_gemms = set()
    for s in layer_bench.GPU_SHAPES:
        m = by_name[s.model]
        assert (s.H, s.F, s.E, s.k) == (m.H, m.F, m.E, m.k), s.name
        up, down = gp.named(f"{labels[s.model]}_up_T{s.T}", f"{labels[s.model]}_down_T{s.T}")
        assert (up.M, up.K, up.N, up.G) == (s.T * s.k, s.H, 2 * s.F, s.E), up
        assert (down.M, down.K, down.N, down.G) == (s.T * s.k, s.F, s.H, s.E), down
        layer_gemms |= {up, down}
    assert layer_gemms == {g for g in gp.SHAPES if not g.name.startswith("g")}

    results = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")

    def rows(name):
        with open(os.path.join(results, name)) as f:
            return json.load(f)["rows"]

    table = {s.name: (s.model, s.T, *dims(s)) for s in moe}
    assert {r["shape"]: (r["model"], r["T"], r["H"], r["E"], r["k"]) for r in rows("peer_H100.json")}.items() \
        <= table.items()
    tuned = {(m, T, H, E, k) for m, H, E, k, T in wl.shape_list()}
    assert {(r["model"], r["T"], r["H"], r["E"], r["k"]) for r in rows("autotune_tuning.json")} <= tuned
    assert {r["model"]: (r["H"], r["E"], r["k"]) for r in rows("small_t_H100.json") if "H" in r} == \
        {name: dims(m) for name, m in small_t.MODELS.items()}


def test_layer_gemm_row_at_deepseek_v3_holds_no_float32_copy_of_the_weights():
    """The GEMM table's G=256 row (DeepSeek-V3's [256, 7168, 4096] bf16 weights, 14 GiB):
    its operands, its forward and its fwd+bwd (whose weight gradient is another 14 GiB of
    bf16) make no float32 value as large as the weights. Traced at full size, nothing
    allocated; the kernel backend of this machine stands in for the GPU's triton (the same
    graph)."""
    from benchmarks import gemm_problems as gp
    from benchmarks import layer_bench
    from tests.conftest import KERNEL_BACKEND
    (shape,) = [s for s in layer_bench.GPU_GEMMS if s.G == 256]
    weights = shape.G * shape.K * shape.N

    def build():
        o = gp.operands(shape, "bfloat16", cotangent=True)
        return o.lhs, o.rhs, o.group_sizes, o.dense_rhs, o.dout

    assert not wide_arrays(jax.make_jaxpr(build)(), weights)
    lhs = jax.ShapeDtypeStruct((shape.M, shape.K), jnp.bfloat16)
    rhs = {KERNEL_BACKEND: jax.ShapeDtypeStruct((shape.G, shape.K, shape.N), jnp.bfloat16),
           "dense": jax.ShapeDtypeStruct((shape.K, shape.N), jnp.bfloat16)}
    cases = layer_bench.gemm_cases(jnp.asarray(gp.group_sizes(shape.M, shape.G)), (KERNEL_BACKEND,))
    assert set(cases) == set(rhs)
    for name, mm in cases.items():
        for fn in (jax.jit(mm), layer_bench.loss_and_grads(mm)):
            jaxpr = jax.make_jaxpr(fn)(lhs, rhs[name])
            assert not wide_arrays(jaxpr, weights), (name, wide_arrays(jaxpr, weights))
        assert jaxpr.out_avals[-1].shape == rhs[name].shape and jaxpr.out_avals[-1].dtype == jnp.bfloat16


def test_ncu_movers_summary_groups_launches_by_shape_and_compares_time_per_byte():
    from benchmarks import ncu_movers as N
    cols = ["ID", "Kernel Name", N.TIME, N.DRAM_PCT, N.READ, N.WRITE]

    def row(i, kernel, ns, pct, rd, wr):
        return ",".join(f'"{v}"' for v in (i, kernel, f"{ns:,}", pct, f"{rd:,}", f"{wr:,}"))
    lines = [f"{N.SHAPE_MARK}A", f"{N.SHAPE_MARK}B", ",".join(f'"{c}"' for c in cols), '"","","nsecond","%","byte","byte"']
    i = 0
    for scale in (1, 2):      # two shapes: fwd, fwd, bwd, copy each (a kernel launched twice is averaged)
        for kernel, ns, rd, wr in (("unpermute_weighted_kernel(...)", 100_000, 900, 100),
                                   ("unpermute_weighted_kernel(...)", 100_000, 900, 100),
                                   ("unpermute_bwd_weighted_kernel", 220_000, 1000, 1000),
                                   ("some_other_kernel", 5_000, 1, 1),
                                   ("device_copy_kernel", 200_000 * scale, 1000, 1000)):
            lines.append(row(i, kernel, ns, 80.0, rd, wr))
            i += 1
    rows, names = N.read_rows(lines)
    assert names == ["A", "B"] and len(rows) == 8 and {r["kernel"] for r in rows} == set(N.KERNELS)
    out = N.summarize(rows, names)
    # bwd: 220 us / 2000 B; fwd: 100 us / 1000 B -> 1.1; copy: 200 (A) or 400 (B) us / 2000 B.
    assert "A: combine.bwd time per DRAM byte / the forward's: 1.100" in out
    assert "A: combine.bwd time per DRAM byte / the copy's: 1.100" in out
    assert "B: combine.bwd time per DRAM byte / the copy's: 0.550" in out
    assert "B: copy time per DRAM byte / the forward's: 2.000" in out
    assert sum(l.startswith("B: ") for l in out) == 6


def test_interleaved_ms_times_every_function_in_rotating_turns(monkeypatch):
    order = []

    def op(tag):
        def f(x):
            jax.debug.callback(lambda: order.append(tag))
            return x + 1
        return jax.jit(f)

    waits = [0]
    block = jax.block_until_ready
    monkeypatch.setattr(timing.jax, "block_until_ready", lambda x: (waits.__setitem__(0, waits[0] + 1), block(x))[1])
    fns = {"a": (op("a"), (jnp.zeros(3),)), "b": (op("b"), (jnp.zeros(3),)), "c": (op("c"), (jnp.zeros(3),))}
    out = timing.interleaved_ms(fns, calls=2, rounds=3)
    jax.effects_barrier()
    # The compiling calls, then per turn and function: the back-to-back run's last call, and
    # each waited-for call.
    assert waits[0] == 3 + 3 * 3 * (1 + 2)
    assert set(out) == {"a", "b", "c"} and all(b2b > 0 and waited > 0 for b2b, waited in out.values())
    # One compiling call each, then per turn each function's 2 back-to-back and 2 waited-for calls,
    # the turns starting at a, then b, then c.
    runs = order[3:]
    assert order[:3] == ["a", "b", "c"] and len(runs) == 3 * 3 * 4
    starts = [runs[i] for i in range(0, len(runs), 12)]
    assert starts == ["a", "b", "c"]
    assert runs[:12] == ["a"] * 4 + ["b"] * 4 + ["c"] * 4
