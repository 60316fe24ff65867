#!/usr/bin/env bash
# FP8 against bf16 on one GPU, as bench/results/fp8.md reports it:
#   1. bench/scripts/fp8_gemm.py: the library's FP8 GEMMs against bf16 at the proxy's shapes (speed, error, and
#      whether the compiled HLO holds an FP8 cuBLASLt GEMM); GEMM=0 skips it;
#   2. the proxy trained STEPS steps on real data by the train CLI (recipe h200 at MBS 8 with the layer scan,
#      one compiled batch shape), in bf16 and then with compute.fp8.recipe=$FP8, every step logged; then the
#      loss of both runs side by side in 25-step windows. Each run starts with an empty compilation cache.
#
#   bash bench/scripts/fp8.sh                                               # tensor recipe, 200 steps
#   GEMM=0 FP8=blockwise FP8_EXTRA=compute.fp8.grad_format=e4m3 bash bench/scripts/fp8.sh   # DeepSeek-V3's
# Variables (defaults): RESULTS (runs/bench/fp8-<UTC time>), MBS (8), STEPS (200), FP8 (tensor), FP8_EXTRA, GEMM (1),
#   PYTHON (python).
# Results: $RESULTS/fp8_gemm.json, $RESULTS/{bf16,fp8}/metrics.jsonl, $RESULTS/{bf16,fp8}.log, curve.txt, log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-runs/bench/fp8-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
unset JAX_COMPILATION_CACHE_DIR
log() { tee -a "$RESULTS/log.txt"; }
git log -1 --format='commit %H (%cI)' 2>/dev/null | log
if [ "${GEMM:-1}" != 0 ]; then
  $PY bench/scripts/fp8_gemm.py "$RESULTS/fp8_gemm.json" --iters 10 --hlo-dir "$RESULTS/hlo" 2>&1 | tail -12 | log
fi
# one compiled train step a run (every batch padded to the data's largest patch bucket), no evaluation, no checkpoint
COMMON="train.micro_batch_size=${MBS:-8} compute.scan_layers=true train.reserve_largest_bucket=true
 train.eval_every=0 train.eval_batches=0 train.show_answers=0 train.checkpointing=false train.log_every=1
 train.tensorboard=false train.compilation_cache_dir=null"
run() {  # name, extra overrides
  local name=$1; shift
  $PY -m moevlm_jax.train --recipe h200 --no-auto-fit --steps "${STEPS:-200}" --run-dir "$RESULTS/$name" \
      $COMMON "$@" --quiet > "$RESULTS/$name.log" 2>&1
  echo "$name exit $?" | log
  grep -E "run .*steps|throughput|first step|Error" "$RESULTS/$name.log" | tail -6 | log
}
run bf16
run fp8 compute.fp8.recipe="${FP8:-tensor}" ${FP8_EXTRA:-}
$PY - "$RESULTS" <<'PY' 2>&1 | tee "$RESULTS/curve.txt" | log
import json, sys
out = sys.argv[1]
def read(n):
    try:
        return {r["step"]: r for r in map(json.loads, open(f"{out}/{n}/metrics.jsonl")) if "loss" in r}
    except OSError:
        return {}
a, b = read("bf16"), read("fp8")
common = sorted(set(a) & set(b))
print("steps in both:", len(common))
for lo in range(1, (common[-1] if common else 0) + 1, 25):
    s = [k for k in common if lo <= k < lo + 25]
    if s:
        la, lb = sum(a[k]["loss"] for k in s) / len(s), sum(b[k]["loss"] for k in s) / len(s)
        print(f"steps {lo:3d}-{s[-1]:3d}: bf16 {la:.4f} fp8 {lb:.4f} rel {lb / la - 1:+.3%}")
PY
echo "results in $RESULTS" | log
