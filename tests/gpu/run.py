"""Every GPU run in one command, from the repository root of a CUDA machine:

    python3 -m tests.gpu.run --out=OUT                       # tests, capture, stress, both memchecks
    python3 -m tests.gpu.run --out=OUT --steps=all --budget_s=540
    python3 -m tests.gpu.run --out=OUT --steps=gemm_tests,layer,example   # the whole MoE layer
    python3 -m tests.gpu.run --out=OUT --steps=bench --bench_args="--shapes DeepSeek"

Steps, in the order they run (``--steps`` picks some, comma-separated; ``all`` is every one):

* ``pytest``: every test file (op tests run on ``xla`` and ``triton``; ``gpu``-marked tests
  run), on ``--workers`` processes; the two steps below are left to themselves;
* ``capture``: the command-buffer (CUDA graph) capture test, alone on the GPU (it times);
* ``stress``: unsynchronised calls alternating shapes, dtypes and ``align_size``;
* ``memcheck``: every kernel forward and backward under ``compute-sanitizer --tool memcheck``;
* ``memcheck_hostile``: the hostile-input tests on the kernel backend under memcheck, one
  process per test (``tests/gpu/hostile.py``);
* ``bench``: ``benchmarks.peer`` (every op's kernel and wall time against the ``xla`` backend,
  a device copy and, where importable, TransformerEngine's kernels);
* ``autotune``: ``benchmarks.autotune_bench`` (compile time, tuned vs default configs);
* ``gemm_tests``: the grouped GEMM's GPU tests;
* ``layer``: ``benchmarks.layer_bench`` with kernel-time profiles (the whole MoE layer);
* ``example``: ``examples/moe_permute.py`` in bfloat16.

Each step logs to ``OUT/<step>.log`` and adds one ``STEP`` line to ``OUT/summary.txt``
(which starts with the device and the versions); a step gets its own time limit or what is
left of ``--budget_s``, whichever is less. Wheels in ``.whl/`` of the checkout (e.g. tokamax
for a machine without internet access) are installed under ``/tmp/site`` first.
``--dry_run`` checks the plumbing on any machine, CPU included: a few fast tests, a tiny
stress, the layer benchmark's CPU smoke sweep; steps that need a GPU are skipped.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import time

from absl import flags

from te_jax_perm import cli
from tests.gpu.hostile import MEMCHECK_ARGS, MEMCHECK_ENV

ROOT = pathlib.Path(__file__).resolve().parents[2]

flags.DEFINE_string("out", None, "directory for the logs, summary.txt and the benchmarks' JSON and PNG files",
                    required=True)
flags.DEFINE_string("steps", "pytest,capture,stress,memcheck,memcheck_hostile", "comma-separated steps to run, or 'all' (see "
                    "the module docstring for what each does)")
flags.DEFINE_float("budget_s", 540, "wall-clock budget of the whole run in seconds; no step starts with less "
                   "than a minute of it left")
# The whole suite needs ~270 s on 12 processes of a 16-core H100 host: use the cores there are.
flags.DEFINE_integer("workers", max(1, (os.cpu_count() or 2) - 2), "pytest processes for the pytest step")
flags.DEFINE_string("pytest_args", "", "extra pytest arguments for the pytest step, split as a shell would, "
                    "e.g. \"-k 'triton or gpu'\"")
flags.DEFINE_string("bench_args", "", "extra arguments for python3 -m benchmarks.peer, e.g. '--shapes DeepSeek'")
flags.DEFINE_bool("dry_run", False, "check the plumbing anywhere (CPU too): small versions of each step, GPU-only "
                  "steps skipped")


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    limit_s: float
    command: list[str]
    summary: str                        # regex of the log lines that summarise the step
    env: dict = dataclasses.field(default_factory=dict)
    gpu_only: bool = False


def compute_sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    candidates = glob.glob("/usr/local/cuda*/bin/compute-sanitizer") + glob.glob("/opt/nvidia/*/compute-sanitizer")
    # pip's nvidia-cuda-sanitizer-api wheels ship the binary inside site-packages.
    for root in (p for p in sys.path if "site-packages" in p):
        candidates += glob.glob(os.path.join(root, "nvidia", "**", "compute-sanitizer"), recursive=True)
    return found or next((c for c in candidates if os.access(c, os.X_OK)), None)


def steps(out: pathlib.Path, dry: bool) -> list[Step]:
    py, f = sys.executable, flags.FLAGS
    pytest = [py, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider"]
    # The sanitizer's config sweep runs Triton's interpreter on the CPU device, on any machine
    # alike: the CPU test run covers it, and here it would take minutes of the step's limit.
    targets = (["tests/test_benchmarks_smoke.py", "-k", "bytes_count"] if dry else
               ["tests", "--durations=15", "--deselect",
                "tests/gpu/test_stress.py::test_stress_triton_alternating_shapes_dtypes_align", "--deselect",
                "tests/gpu/test_capture.py::test_dispatch_combine_step_is_captured_in_command_buffers", "--deselect",
                "tests/test_sanitize_shipped.py::test_every_unpruned_config_is_clean"])
    mode = "auto" if dry else "gpu"
    sanitizer = compute_sanitizer() or "compute-sanitizer"
    memcheck = [sanitizer, *MEMCHECK_ARGS]
    return [
        # One line a test as each finishes: a step cut off at its limit still names its failures.
        Step("pytest", 480, [a for a in pytest if a != "-q"] + ["-v", "-n", str(f.workers)] + targets
             + shlex.split(f.pytest_args), r"^=+ .*(passed|failed)"),
        Step("capture", 100, pytest + ["-s", "tests/gpu/test_capture.py"], r"(passed|failed)", gpu_only=True),
        Step("stress", 240, [py, "-m", "tests.gpu.stress"] + (["--small", "--cases", "2", "--passes", "2",
                                                                "--dtypes", "float32"] if dry else
                                                               ["--cases", "40", "--passes", "4"]), r"^STRESS"),
        Step("memcheck", 90, memcheck + [py, "-m", "tests.gpu.memcheck_ops"], r"ERROR SUMMARY|^MEMCHECK-OPS",
             gpu_only=True, env=MEMCHECK_ENV),
        # About 50 tests in processes of their own, four at a time, about 20 s each under the
        # sanitizer on an H100: 300 s was not enough for all of them.
        Step("memcheck_hostile", 480, [py, "-m", "tests.gpu.hostile", f"--sanitizer={sanitizer}",
                                       f"--out={out / 'memcheck_hostile'}"], r"^(MEMCHECK-HOSTILE|  \w+: )",
             gpu_only=True),
        # PyTorch (the device copy, TransformerEngine's kernels) shares the GPU with JAX here:
        # JAX's pool grows on demand (the driver's default environment below).
        Step("bench", 300, [py, "-m", "benchmarks.peer", "--out", str(out)] + shlex.split(f.bench_args),
             r"^TARGET", gpu_only=True),
        Step("autotune", 170, [py, "-m", "benchmarks.autotune_bench", f"--out={out / 'autotune'}", "--budget-s=120",
                               "--e2e-s=30", "--max-configs=24", "--max-candidates=16"]
             + (["--small", "--dtype=float32"] if dry else []), r"(E2E|tuned|speedup)"),
        Step("gemm_tests", 90, pytest + ["tests/test_grouped_gemm.py", "-k", "gpu"], r"(passed|failed|deselected)"),
        # The layer's pool grows on demand: DeepSeek-V3's step does not fit JAX's default pool
        # (75% of an 80 GB H100), where a 14 GiB allocation stalls, retried without end.
        Step("layer", 300, [py, "-m", "benchmarks.layer_bench", "--out", str(out), "--mode", mode, "--steps", "5",
                            "--profile"], r"^(LAYER|PROFILE|GEMM|TARGET)"),
        Step("example", 120, [py, "examples/moe_permute.py", "--dtype=bfloat16"], r"max error|PASS|FAIL"),
    ]


def device_line() -> str:
    code = ("import sys, jax, triton; print('python', sys.version.split()[0], 'jax', jax.__version__, 'triton', "
            "triton.__version__, 'devices', jax.devices()[0].device_kind, 'x', jax.device_count())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env())
    return done.stdout.strip() or "unknown: " + (done.stderr.strip().splitlines() or ["no output"])[-1]


def child_env() -> dict:
    """The environment every step runs in: the repository (and ``/tmp/site``) importable,
    no GPU memory preallocation (tests start subprocesses that need the GPU too) and a
    writable Triton cache."""
    path = [str(ROOT)] + (["/tmp/site"] if os.path.isdir("/tmp/site") else [])
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]),
                PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
                TRITON_CACHE_DIR=os.environ.get("TRITON_CACHE_DIR", "/tmp/triton_cache"))


def install_carried_wheels() -> None:
    wheels = sorted(glob.glob(str(ROOT / ".whl" / "*.whl")))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", "/tmp/site", *wheels], check=True)


def main(argv: list[str]) -> int:
    del argv
    f = flags.FLAGS
    out = pathlib.Path(f.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    known = steps(out, f.dry_run)
    wanted = [s.strip() for s in f.steps.split(",") if s.strip()]
    wanted = [s.name for s in known] if wanted == ["all"] else wanted
    unknown = set(wanted) - {s.name for s in known}
    if unknown:
        raise SystemExit(f"--steps: unknown {sorted(unknown)}; the steps are {[s.name for s in known]} or 'all'")
    if not f.dry_run:
        install_carried_wheels()
    summary = out / "summary.txt"

    def say(line: str) -> None:
        print(line, flush=True)
        with open(summary, "a") as fh:
            fh.write(line + "\n")

    summary.write_text("")
    say(f"device: {device_line()}")
    failed = 0
    for step in (s for s in known if s.name in wanted):
        left = f.budget_s - (time.monotonic() - start)
        if step.gpu_only and f.dry_run:
            say(f"STEP {step.name}: SKIPPED :: needs a GPU (--dry_run)")
            continue
        if left < 60:
            say(f"STEP {step.name}: SKIPPED :: {left:.0f}s of the {f.budget_s:.0f}s budget left")
            failed += 1
            continue
        limit = min(step.limit_s, left)
        log = out / f"{step.name}.log"
        t0 = time.monotonic()
        with open(log, "w") as fh:
            try:
                rc = subprocess.run(step.command, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, timeout=limit,
                                    env={**child_env(), **step.env}).returncode
                verdict = "PASS" if rc == 0 else f"FAIL(rc={rc})"
            except subprocess.TimeoutExpired:
                verdict = f"TIMEOUT({limit:.0f}s)"
            except FileNotFoundError as e:
                verdict = f"FAIL({e})"
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if re.search(step.summary, ln)]
        failed += verdict != "PASS"
        say(f"STEP {step.name}: {verdict} in {time.monotonic() - t0:.0f}s :: "
            + (" | ".join(lines[-4:]) or f"see {log}"))
    say(f"suite: {'PASS' if not failed else 'FAIL'} in {time.monotonic() - start:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    cli.run(main)
