#!/usr/bin/env bash
# The whole GPU check in one command, from the repository root on the GPU machine:
#   benchmarks/run_gpu_suite.sh OUT_DIR [TOTAL_BUDGET_S=480]
# (a) pytest, (b) stress, (c) memcheck (tests/gpu/run_gpu_tests.sh), then (d) the
# benchmark with whatever time is left: OUT_DIR/bench.json, bench.png, bench.log.
# Files written (flat): summary.txt pytest.log stress.log memcheck.log bench.log bench.json bench.png
# Env: STEPS (default "pytest,stress,memcheck,bench"), PYTEST_S, STRESS_S, MEMCHECK_S,
# BENCH_ARGS (extra args for python3 -m benchmarks.run, e.g. "--shapes DeepSeek --autotune").
# DRY_RUN=1 checks the plumbing anywhere (CPU: interpret backend, tiny sweeps).
set -u
OUT=${1:?usage: benchmarks/run_gpu_suite.sh OUT_DIR [TOTAL_BUDGET_S]}
TOTAL=${2:-480}
mkdir -p "$OUT"
: > "$OUT/summary.txt"
export STEPS=${STEPS:-pytest,stress,memcheck,bench}
START=$SECONDS
if [ "${DRY_RUN:-0}" != 1 ] && ! python3 -c "import jax_triton" 2>/dev/null && [ -f tests/gpu/setup_device.sh ]; then
  # shellcheck disable=SC1091
  source tests/gpu/setup_device.sh || echo "setup_device.sh failed" >&2
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
echo "suite: $(python3 -c 'import jax, triton; print(jax.__version__, triton.__version__, jax.devices()[0].device_kind)' 2>&1 | tail -1)" | tee -a "$OUT/summary.txt"

tests/gpu/run_gpu_tests.sh "$OUT"
tests_rc=$?

bench_rc=0
case ",$STEPS," in *,bench,*)
  LEFT=$((TOTAL - (SECONDS - START)))
  if [ $LEFT -lt 60 ]; then
    echo "STEP bench: SKIPPED :: only ${LEFT}s of the ${TOTAL}s budget left" | tee -a "$OUT/summary.txt"
    bench_rc=1
  else
    t0=$SECONDS
    # Stop starting measurements 40s before the end: the last one, the JSON and the PNG fit.
    # shellcheck disable=SC2086
    MODE=gpu; [ "${DRY_RUN:-0}" = 1 ] && MODE=auto
    timeout --kill-after=10 "$LEFT" python3 -m benchmarks.run --out "$OUT" --mode $MODE --log \
      --budget-s $((LEFT - 40)) ${BENCH_ARGS:-} > /dev/null 2> "$OUT/bench.stderr.tmp"
    bench_rc=$?
    # Python tracebacks go to bench.log too; keep stderr only when the run died.
    [ $bench_rc -ne 0 ] && tail -50 "$OUT/bench.stderr.tmp" >> "$OUT/bench.log"
    rm -f "$OUT/bench.stderr.tmp"
    line=$(grep -E "^BENCH SUMMARY" "$OUT/bench.log" | tail -1)
    echo "STEP bench: rc=$bench_rc in $((SECONDS - t0))s :: ${line:-no summary, see bench.log}" | tee -a "$OUT/summary.txt"
    grep -E "^(TARGET|LAYER)" "$OUT/bench.log" >> "$OUT/summary.txt"
  fi ;;
esac
echo "suite done in $((SECONDS - START))s (tests rc=$tests_rc, bench rc=$bench_rc)" | tee -a "$OUT/summary.txt"
[ $tests_rc -eq 0 ] && [ $bench_rc -eq 0 ]
