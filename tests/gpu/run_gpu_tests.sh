#!/usr/bin/env bash
# The whole GPU suite in one command, from the repository root on the GPU machine (~7 min on an H100):
#   tests/gpu/run_gpu_tests.sh OUT_DIR
# (a) pytest: every test file (op tests get backend in {xla, triton}; gpu-marked tests run,
#     8 workers when pytest-xdist is installed,
# (b) the command-buffer capture test, alone (it times),
# (c) the unsynchronised alternating-shape stress (python3 -m tests.gpu.stress),
# (d) every kernel fwd+bwd (tests/gpu/memcheck_ops.py) under compute-sanitizer --tool memcheck.
# Each step logs to OUT_DIR/<step>.log and prints one "STEP ..." line (also appended to
# OUT_DIR/summary.txt); OUT_DIR/gpu_suite_<GPU>.txt (e.g. gpu_suite_H100.txt) gets the
# device, the versions and passed/failed counts per step. Env: STEPS (default
# "pytest,capture,stress,memcheck"), PYTEST_S, CAPTURE_S, STRESS_S, MEMCHECK_S (per-step time limits, s),
# PYTEST_ARGS (extra pytest args, e.g. "-k dispatch"), PYTEST_WORKERS (default 8).
# DRY_RUN=1 checks the plumbing anywhere (CPU included): a few fast tests, a 2-case stress.
set -u
OUT=${1:?usage: tests/gpu/run_gpu_tests.sh OUT_DIR}
mkdir -p "$OUT"
STEPS=${STEPS:-pytest,capture,stress,memcheck}
PYTEST_S=${PYTEST_S:-330}
STRESS_S=${STRESS_S:-150}
MEMCHECK_S=${MEMCHECK_S:-90}
PYTEST_WORKERS=${PYTEST_WORKERS:-8}
CAPTURE_S=${CAPTURE_S:-100}
PYTEST_ARGS=${PYTEST_ARGS:-}

if [ "${DRY_RUN:-0}" != 1 ] && [ -z "${TE_JAX_PERM_SETUP_DONE:-}" ] && [ -f tests/gpu/setup_device.sh ]; then
  # shellcheck disable=SC1091
  source tests/gpu/setup_device.sh || echo "setup_device.sh failed" >&2
fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}

say() { echo "$*"; echo "$*" >> "$OUT/summary.txt"; }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oE '[A-Z][0-9]{2,4}[A-Za-z]*' | head -1)
SUITE="$OUT/gpu_suite_${GPU:-cpu}.txt"
DEVICE=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
{
  echo "device: ${DEVICE:-none}"
  python3 -c "import sys, jax, triton; from te_jax_perm.core import compat; print('python', sys.version.split()[0], 'jax', jax.__version__, 'triton', triton.__version__, 'jax-triton', compat.installed('jax-triton'))" 2>&1 | tail -1
} > "$SUITE"
# counts NAME LOG: "passed=N failed=M ..." from a pytest summary line.
counts() {
  local line; line=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|[0-9]+ (passed|failed).* in [0-9.]+s" "$2" | tail -1)
  local p f e s
  p=$(echo "$line" | grep -oE "[0-9]+ passed" | grep -oE "[0-9]+"); f=$(echo "$line" | grep -oE "[0-9]+ failed" | grep -oE "[0-9]+")
  e=$(echo "$line" | grep -oE "[0-9]+ errors?" | grep -oE "[0-9]+"); s=$(echo "$line" | grep -oE "[0-9]+ skipped" | grep -oE "[0-9]+")
  echo "$1: passed=${p:-0} failed=${f:-0} errors=${e:-0} skipped=${s:-0}"
}

# run_step NAME LIMIT_S CMD...: runs CMD under a time limit, logs, prints one line.
run_step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  local dt=$((SECONDS - t0)) tail
  case "$name" in
    pytest) tail=$(grep -E "(passed|failed|error)" "$OUT/$name.log" | tail -1) ;;
    stress*) tail=$(grep -E "^STRESS" "$OUT/$name.log" | tail -1) ;;
    memcheck) tail=$(grep -E "ERROR SUMMARY|^MEMCHECK-OPS" "$OUT/$name.log" | tr '\n' ' ') ;;
    *) tail=$(tail -1 "$OUT/$name.log") ;;
  esac
  local verdict=PASS
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMEOUT(${limit}s)"
  [ $rc -ne 0 ] && [ "$verdict" = PASS ] && verdict="FAIL(rc=$rc)"
  say "STEP $name: $verdict in ${dt}s :: ${tail:-see $OUT/$name.log}"
  return $rc
}

find_sanitizer() {
  command -v compute-sanitizer 2>/dev/null && return
  local c
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
           /opt/nvidia/*/compute-sanitizer /usr/bin/compute-sanitizer; do
    [ -x "$c" ] && { echo "$c"; return; }
  done
  # pip's nvidia-cuda-sanitizer-api wheels ship the binary inside site-packages.
  python3 - <<'PY' 2>/dev/null
import glob, os, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + [p for p in sys.path if "site-packages" in p]
for r in roots:
    for c in glob.glob(os.path.join(r, "nvidia", "**", "compute-sanitizer"), recursive=True):
        if os.path.isfile(c) and os.access(c, os.X_OK):
            print(c); raise SystemExit
PY
}

# The tests that exercise kernels on this machine's backend (CPU-only machinery - the
# sanitizer, the compile pool, virtual-device sharding - is covered by CI).
PYTEST_TARGET=${PYTEST_TARGET:-tests}
XDIST=""
if [ "$PYTEST_WORKERS" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then XDIST="-n $PYTEST_WORKERS"; fi
STRESS_ARGS="--cases 40 --passes 4"
if [ "${DRY_RUN:-0}" = 1 ]; then
  PYTEST_TARGET="tests/test_benchmarks_smoke.py -k bytes_count"
  STRESS_ARGS="--small --cases 2 --passes 2 --dtypes float32"
fi

status=0
case ",$STEPS," in *,pytest,*)
  # The stress test runs as its own step; everything else, every backend of this machine.
  # shellcheck disable=SC2086
  run_step pytest "$PYTEST_S" python3 -m pytest -q -rfE --durations=15 -p no:cacheprovider $XDIST \
    --deselect tests/gpu/test_stress.py::test_stress_triton_alternating_shapes_dtypes_align \
    --deselect tests/gpu/test_capture.py::test_dispatch_combine_step_is_captured_in_command_buffers $PYTEST_TARGET $PYTEST_ARGS \
    || status=1
  counts pytest "$OUT/pytest.log" >> "$SUITE" ;;
esac
case ",$STEPS," in *,capture,*)
  # Alone on the GPU: it times the step with command buffers on and off.
  if [ "${DRY_RUN:-0}" != 1 ]; then
    run_step capture "$CAPTURE_S" python3 -m pytest -q -rfE -s -p no:cacheprovider tests/gpu/test_capture.py || status=1
    counts capture "$OUT/capture.log" >> "$SUITE"
  fi ;;
esac
case ",$STEPS," in *,stress,*)
  # Backend: triton on a GPU (interpret elsewhere, for DRY_RUN).
  # shellcheck disable=SC2086
  run_step stress "$STRESS_S" python3 -m tests.gpu.stress $STRESS_ARGS && echo "stress: passed=1 failed=0 :: $(grep -E '^STRESS' "$OUT/stress.log" | tail -1)" >> "$SUITE" \
    || { status=1; echo "stress: passed=0 failed=1 :: $(grep -E '^STRESS' "$OUT/stress.log" | tail -1)" >> "$SUITE"; } ;;
esac
case ",$STEPS," in *,memcheck,*)
  SAN=$(find_sanitizer)
  if [ -z "$SAN" ]; then
    say "STEP memcheck: SKIPPED :: compute-sanitizer not found (PATH, /usr/local/cuda*, pip nvidia wheels)"
    echo "memcheck: skipped (compute-sanitizer not found)" >> "$SUITE"
  else
    # One cudaMalloc per buffer (no pooling) so memcheck sees every buffer's real bounds;
    # no CUDA graphs so each report names the kernel launch directly.
    XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" \
      run_step memcheck "$MEMCHECK_S" "$SAN" --tool memcheck --error-exitcode 99 --report-api-errors no \
        --print-limit 50 python3 -m tests.gpu.memcheck_ops \
      && echo "memcheck: passed=1 failed=0 :: $(grep -E 'ERROR SUMMARY|^MEMCHECK-OPS' "$OUT/memcheck.log" | tr '\n' ' ')" >> "$SUITE" \
      || { status=1; echo "memcheck: passed=0 failed=1 :: $(grep -E 'ERROR SUMMARY|^MEMCHECK-OPS' "$OUT/memcheck.log" | tr '\n' ' ')" >> "$SUITE"; }
  fi ;;
esac
echo "suite: $([ $status -eq 0 ] && echo PASS || echo FAIL)" >> "$SUITE"
cat "$SUITE"
exit $status
