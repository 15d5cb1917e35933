"""The hostile-input tests under compute-sanitizer: corrupt maps, non-permutation orders,
counts that disagree with the map, short inputs, overflowing sizes, on the kernel backend.

    python3 -m tests.gpu.hostile --sanitizer=PATH --out=DIR [--workers=4]

Each collected test runs in a process of its own under ``compute-sanitizer --tool memcheck``
(several at once): one process running them all was killed by a segfault inside the
sanitizer after a varying number of tests (the same tests pass outside it, and memcheck
reported no error before the crash), which hid every test after it. A test whose sanitized
process dies by a signal without any memcheck report, or hangs, is run once more in a fresh
process, alone on the GPU once the others are done; the summary counts those reruns. A
memcheck error, a failing test, or a crash that repeats fails the run. A test still running
at three quarters of ``--timeout_s`` dumps its Python stack into its log (printed with the
run's output when it fails), and each test's line gives its time.

A module without flags: the CPU suite reads :data:`HOSTILE_TESTS` without defining the GPU
driver's flags in its process.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import subprocess
import sys
import time

HOSTILE_TESTS = [
    "tests/test_ops_memory_safety.py",
    "tests/test_chunk_sort.py::test_traced_non_permutation_drops_chunks_on_every_backend",
    "tests/test_chunk_sort.py::test_non_injective_map_keeps_the_first_row_per_destination",
    "tests/test_chunk_sort.py::test_zero_rows_give_zero_size_results",
    "tests/test_permute.py::test_row_owner_kernel_matches_its_reference_on_hostile_maps",
    "tests/test_permute.py::test_permute_ignores_counts_that_disagree_with_the_map",
    "tests/test_permute.py::test_duplicate_destinations_have_one_writer_on_every_backend",
    "tests/test_permute.py::test_gathers_add_every_entry_of_a_hostile_map",
    "tests/test_dispatch.py::test_zero_tokens_give_zero_size_results",
    "tests/test_grouped_gemm.py::test_values_and_vjp_match_numpy",
    # The device's default row-tile GEMMs at sizes where Hopper's is TMA tiles.
    "tests/test_grouped_gemm.py::test_gpu_default_row_tile_gemms_on_hostile_sizes",
    # Kernels the interpreter cannot run, so the sanitizer never saw them.
    "tests/test_grouped_gemm.py::test_gpu_ws_wgrad_matches_reference",
]
# Their runs on the kernel backend (the xla runs launch none of our kernels).
SELECT = ["-k", "not xla"]

# One cudaMalloc per buffer so memcheck sees every buffer's real bounds; no CUDA graphs, so
# each report names the kernel launch directly.
MEMCHECK_ENV = {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform",
                "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer= "
                             "--xla_gpu_autotune_level=0"}
MEMCHECK_ARGS = ["--tool", "memcheck", "--error-exitcode", "99", "--report-api-errors", "no", "--print-limit", "50"]
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider"]
RERUN = ("crash", "timeout")   # verdicts that earn a second try


def collect(root: pathlib.Path, env: dict, targets: list[str] = HOSTILE_TESTS) -> list[str]:
    """The test ids of ``targets`` on the kernel backend."""
    done = subprocess.run([sys.executable, *PYTEST, "--collect-only", *targets, *SELECT], cwd=root,
                          capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        raise RuntimeError("collecting the hostile tests failed:\n" + done.stdout[-3000:] + done.stderr[-2000:])
    return [line.strip() for line in done.stdout.splitlines() if "::" in line]


def verdict(rc: int, log: str) -> str:
    """``pass``, ``memcheck`` (errors reported), ``fail`` (the test failed) or ``crash`` (the
    sanitized process died by a signal with neither); ``timeout`` comes from :func:`run_one`."""
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", log)]
    if any(errors) or rc == 99:
        return "memcheck"
    if rc == 0 and re.search(r"\b1 passed\b", log):
        return "pass"
    # pytest's summary ("1 failed", "1 error"), not the sanitizer's "ERROR SUMMARY: 0 errors".
    if re.search(r"\b\d+ (failed|errors?)\b", "\n".join(ln for ln in log.splitlines() if "ERROR SUMMARY" not in ln)):
        return "fail"
    return "crash" if rc < 0 or rc > 128 else "fail"

def run_one(test: str, sanitizer: str, root: pathlib.Path, env: dict, timeout: float) -> tuple[str, str]:
    # A test still running at three quarters of the limit has pytest dump every thread's
    # Python stack to stderr, so a hang's log says where it hung (compiling, launching, or
    # waiting on the device) before the process is killed.
    cmd = [sanitizer, *MEMCHECK_ARGS, sys.executable, *PYTEST, "-o", f"faulthandler_timeout={max(1, int(timeout * 0.75))}",
           test]
    try:
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = "".join(s.decode(errors="replace") if isinstance(s, bytes) else s for s in (e.stdout, e.stderr) if s)
        return "timeout", f"$ {' '.join(cmd)}\nTIMEOUT after {timeout:.0f}s\n{out}"
    log = done.stdout + done.stderr
    return verdict(done.returncode, log), f"$ {' '.join(cmd)}\nrc={done.returncode}\n{log}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tests.gpu.hostile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--sanitizer", required=True, help="path of compute-sanitizer")
    ap.add_argument("--out", required=True, help="directory for one log per test")
    ap.add_argument("--workers", type=int, default=4, help="sanitized test processes at once")
    ap.add_argument("--timeout_s", type=float, default=240, help="limit of one sanitized test process")
    ap.add_argument("--tests", default=",".join(HOSTILE_TESTS), help="comma-separated pytest targets")
    a = ap.parse_args(argv)
    root = pathlib.Path(__file__).resolve().parents[2]
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **MEMCHECK_ENV}
    tests = collect(root, env, a.tests.split(","))
    print(f"{len(tests)} hostile tests, {a.workers} at a time", flush=True)

    def attempt(test: str, tries: int) -> str:
        started = time.monotonic()
        v, log = run_one(test, a.sanitizer, root, env, a.timeout_s)
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", test)[-150:]
        (out / f"{name}.try{tries}.log").write_text(log)
        print(f"{v.upper():8s} {test} ({time.monotonic() - started:.0f} s)" + (f" (try {tries})" if tries > 1 else ""),
              flush=True)
        if v != "pass" and (tries > 1 or v not in RERUN):  # the log files may not travel back; this does
            print(f"--- {test}, try {tries}: the log's end\n" + "\n".join(log.splitlines()[-40:]), flush=True)
        return v

    with concurrent.futures.ThreadPoolExecutor(a.workers) as pool:
        results = {t: (v, 1) for t, v in zip(tests, pool.map(lambda t: attempt(t, 1), tests))}
    # A process that died without a report, or hung (seen under memcheck with several
    # sanitized processes sharing the GPU, each passing in seconds alone), runs once more,
    # alone on the GPU.
    for t in tests:
        if results[t][0] in RERUN:
            results[t] = (attempt(t, 2), 2)
    bad = {t: v for t, (v, _) in results.items() if v != "pass"}
    reruns = [t for t, (v, n) in results.items() if v == "pass" and n > 1]
    for t, v in sorted(bad.items()):
        print(f"  {v}: {t}")
    print(f"MEMCHECK-HOSTILE {'PASS' if tests and not bad else 'FAIL'}: {len(tests) - len(bad)} of {len(tests)} "
          f"tests passed under memcheck with no error reported; {len(reruns)} passed on a rerun after the "
          f"sanitized process died or hung without a report", flush=True)
    return 0 if tests and not bad else 1


if __name__ == "__main__":
    sys.exit(main())
