#!/usr/bin/env bash
# Refreshes every GPU figure the closing notes quote. STEPS picks a subset so the work can
# be split over two device calls (each call is limited to 10 minutes):
# memcheck of every kernel, the benchmark, the autotune benchmark, the unsynchronised
# stress, and the kernel tests on the triton backend. Files land flat in OUT (<= 8).
#   STEPS=memcheck,bench,autotune tests/gpu/final_session.sh OUT   (~330 s)
#   STEPS=stress,pytest tests/gpu/final_session.sh OUT             (~580 s)
set -u
STEPS=${STEPS:-memcheck,bench,autotune,stress,pytest}
want() { case ",$STEPS," in *,$1,*) return 0 ;; esac; return 1; }
OUT=${1:?usage: tests/gpu/final_session.sh OUT}
mkdir -p "$OUT"
. tests/gpu/setup_device.sh > /dev/null 2>&1
S=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
say "device: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); $(python3 -c 'import jax, triton; print("jax", jax.__version__, "triton", triton.__version__)')"
if want memcheck; then
  XLA_FLAGS="--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0" XLA_PYTHON_CLIENT_ALLOCATOR=platform \
    timeout 90 "$S" --tool memcheck --error-exitcode 99 --print-limit 50 python3 -m tests.gpu.memcheck_ops > "$OUT/memcheck.log" 2>&1
  say "memcheck rc=$? :: $(grep -E 'MEMCHECK-OPS|ERROR SUMMARY' "$OUT/memcheck.log" | tr '\n' ' ')"
fi
if want bench; then
  timeout 150 python3 -m benchmarks.run --out "$OUT" --mode gpu --log --budget-s 120 > /dev/null 2> "$OUT/bench.err"
  say "bench rc=$? :: $(grep -E '^BENCH SUMMARY' "$OUT/bench.log" | tail -1)"
  grep -E "^(TARGET|LAYER)" "$OUT/bench.log" >> "$OUT/summary.txt"; rm -f "$OUT/bench.err"
fi
if want autotune; then
  timeout 170 python3 benchmarks/autotune_bench.py --out="$OUT/at" --budget-s=120 --e2e-s=30 --max-configs=24 \
    --max-candidates=16 > "$OUT/at.log" 2>&1
  say "autotune rc=$?"
  cp "$OUT/at/compile_time.json" "$OUT/at/tuning.json" "$OUT/" 2>/dev/null
  [ -f "$OUT/at/e2e.json" ] && python3 -c "import json,sys; print('E2E', json.dumps(json.load(open(sys.argv[1]))))" "$OUT/at/e2e.json" >> "$OUT/summary.txt"
  rm -rf "$OUT/at" "$OUT/at.log"
fi
if want stress; then
  # 40 cases x 4 passes took 107-113 s on the H100 (compiles included).
  timeout 170 python3 -m tests.gpu.stress --cases 40 --passes 4 > "$OUT/stress.tmp" 2>&1
  say "stress rc=$? :: $(grep -E '^STRESS' "$OUT/stress.tmp" | tail -1)"; rm -f "$OUT/stress.tmp"
fi
if want pytest; then
  timeout 400 python3 -m pytest -q -rf -p no:cacheprovider tests/test_row_id_map.py tests/test_dispatch.py \
    tests/test_core_framework.py tests/test_chunk_sort.py tests/test_example.py > "$OUT/pytest.log" 2>&1
  say "pytest rc=$? :: $(grep -E '(passed|failed)' "$OUT/pytest.log" | tail -1)"
fi
