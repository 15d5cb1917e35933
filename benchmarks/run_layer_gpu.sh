#!/usr/bin/env bash
# The MoE-layer measurements on one GPU in one command, from the repository root:
#   benchmarks/run_layer_gpu.sh OUT_DIR [TOTAL_BUDGET_S=570]
# (a) the grouped-GEMM GPU tests, (b) benchmarks.layer_bench (grouped-GEMM table: tokamax vs
# jax.lax.ragged_dot vs a dense dot; then the layer at DeepSeek-V3, Qwen3 and Mixtral shapes),
# (c) examples/moe_permute.py at --preset=qwen3 and --preset=deepseek_v3.
# Files written (flat): layer_summary.txt layer_gemm_tests.log layer.json layer.png layer.log
#   layer_example_qwen3.{log,json} layer_example_deepseek_v3.{log,json}
set -u
OUT=${1:?usage: benchmarks/run_layer_gpu.sh OUT_DIR [TOTAL_BUDGET_S]}
TOTAL=${2:-570}
# DRY_RUN=1 checks the plumbing anywhere (CPU: the bench's smoke sweep, small examples).
MODE=gpu; EX_ARGS=""
[ "${DRY_RUN:-0}" = 1 ] && MODE=auto && EX_ARGS="--tokens=64 --hidden=32 --ffn=32 --experts=8 --topk=2"
mkdir -p "$OUT"
SUMMARY="$OUT/layer_summary.txt"
: > "$SUMMARY"
START=$SECONDS
if ! python3 -c "import jax_triton, tokamax" 2>/dev/null && [ -f tests/gpu/setup_device.sh ]; then
  # shellcheck disable=SC1091
  source tests/gpu/setup_device.sh || echo "setup_device.sh failed" >&2
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false}
left() { echo $((TOTAL - (SECONDS - START))); }

python3 - <<'EOF' 2>&1 | tail -3 | tee -a "$SUMMARY"
import jax
try:
    import tokamax
    tk = f"tokamax {tokamax.__version__}"
except Exception as e:  # report why, the measurements then run on lax.ragged_dot only
    tk = f"tokamax NOT importable: {type(e).__name__}: {e}"
print(f"layer suite: jax {jax.__version__}, {jax.devices()[0].device_kind} x{jax.device_count()}; {tk}")
EOF

t0=$SECONDS
timeout --kill-after=10 90 python3 -m pytest -q -p no:cacheprovider tests/test_grouped_gemm.py -k gpu \
  > "$OUT/layer_gemm_tests.log" 2>&1
echo "STEP grouped-GEMM GPU tests: rc=$? in $((SECONDS - t0))s :: $(tail -1 "$OUT/layer_gemm_tests.log")" | tee -a "$SUMMARY"

# The bench gets what is left after reserving time for the two examples.
BENCH=$(( $(left) - 240 ))
if [ "$BENCH" -gt 60 ]; then
  t0=$SECONDS
  timeout --kill-after=10 "$BENCH" python3 -m benchmarks.layer_bench --out "$OUT" --mode $MODE \
    --budget-s $((BENCH - 70)) --steps 5 > /dev/null 2> "$OUT/layer_bench.stderr"
  rc=$?
  [ $rc -ne 0 ] && tail -40 "$OUT/layer_bench.stderr" >> "$OUT/layer.log"
  rm -f "$OUT/layer_bench.stderr"
  echo "STEP layer bench: rc=$rc in $((SECONDS - t0))s" | tee -a "$SUMMARY"
  grep -E "^(GEMM|LAYER|TARGET)" "$OUT/layer.log" >> "$SUMMARY"
else
  echo "STEP layer bench: SKIPPED, ${BENCH}s left for it" | tee -a "$SUMMARY"
fi

for preset in qwen3 deepseek_v3; do
  LEFT=$(left)
  [ "$preset" = qwen3 ] && LIM=$(( LEFT / 2 )) || LIM=$(( LEFT - 5 ))
  if [ "$LIM" -lt 45 ]; then
    echo "STEP example $preset: SKIPPED, ${LIM}s left" | tee -a "$SUMMARY"; continue
  fi
  t0=$SECONDS
  timeout --kill-after=10 "$LIM" python3 examples/moe_permute.py --preset=$preset --steps=10 $EX_ARGS \
    --json_out="$OUT/layer_example_$preset.json" > "$OUT/layer_example_$preset.log" 2>&1
  rc=$?
  echo "STEP example $preset: rc=$rc in $((SECONDS - t0))s" | tee -a "$SUMMARY"
  grep -E "max err|train step|GEMM limit|profile|PASS|FAIL" "$OUT/layer_example_$preset.log" | grep -v "^I" \
    | sed "s/^/  /" >> "$SUMMARY"
done
echo "layer suite done in $((SECONDS - START))s" | tee -a "$SUMMARY"
