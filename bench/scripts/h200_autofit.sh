#!/usr/bin/env bash
# Issue 21 on one H200, one call: the user's command `python -m moevlm_jax.train --layout fsdp`
# (recipe gpu-default: float32 parameters / state, global batch 64, which does not fit one H200 as
# written) with auto-fit, against recipe h200 (the fastest setting measured) in the same call; the
# planner's estimates for both; the time to the first step and the peak memory of each.
#   bash bench/scripts/h200_autofit.sh   (results under $OUT)
set -uo pipefail
source bench/scripts/gpu_env.sh
unset XLA_PYTHON_CLIENT_MEM_FRACTION JAX_COMPILATION_CACHE_DIR  # the user's environment: the CLI's own defaults
OUT=${OUT:-/tmp/h200_autofit}
RUNS=/tmp/h200_autofit_runs  # not under $OUT: nothing large comes back
mkdir -p "$OUT" "$RUNS"
COMMON="train.eval_every=0 train.eval_batches=0 train.checkpointing=false train.log_every=1 train.compilation_cache_dir=null"
now() { python3 -c "import time; print(f'{time.time():.1f}')"; }
python -m moevlm_jax.plan --model proxy --data proxy --devices 1 --global-batch 64 --layouts fsdp --top 10 \
    --out "$OUT/plan" compute.scan_layers=false > "$OUT/plan.txt" 2>&1
# the user's command (auto-fit on), then the peer as written (--no-auto-fit: its own check is a separate compile)
t0=$(now)
timeout ${FIT_TIMEOUT:-330} python -m moevlm_jax.train --layout fsdp --steps ${FIT_STEPS:-8} --run-dir "$RUNS/fit" \
    $COMMON > "$OUT/fit.log" 2>&1
echo "fit rc=$? wall_s=$(python3 -c "print(round($(now) - $t0, 1))")" | tee -a "$OUT/summary.txt"
t0=$(now)
timeout ${H200_TIMEOUT:-240} python -m moevlm_jax.train --recipe h200 --no-auto-fit --steps ${H200_STEPS:-12} \
    --run-dir "$RUNS/h200" $COMMON > "$OUT/h200.log" 2>&1
echo "h200 rc=$? wall_s=$(python3 -c "print(round($(now) - $t0, 1))")" | tee -a "$OUT/summary.txt"
# auto-fit's choice not the bf16-sum MBS 8 x 8 (its compiled check refused it): that setting as written, to see
runs="fit h200"
if ! grep -q "auto-fit: running with.*grad_accum_dtype=bfloat16" "$OUT/fit.log" && [ -z "${SKIP_EXPLICIT:-}" ]; then
  t0=$(now)
  timeout ${EXPLICIT_TIMEOUT:-150} python -m moevlm_jax.train --layout fsdp --no-auto-fit --steps 6 --run-dir "$RUNS/mbs8" \
      $COMMON train.micro_batch_size=8 train.grad_accum=8 compute.param_dtype=bfloat16 optimizer.state_dtype=bfloat16 \
      optimizer.grad_accum_dtype=bfloat16 > "$OUT/mbs8.log" 2>&1
  echo "mbs8 rc=$? wall_s=$(python3 -c "print(round($(now) - $t0, 1))")" | tee -a "$OUT/summary.txt"
  runs="$runs mbs8"
fi
for r in $runs; do
  grep -E "auto-fit|throughput|run .*steps|new batch shape|error" "$OUT/$r.log" | sed "s/^/$r: /" | tee -a "$OUT/summary.txt"
  cp "$RUNS/$r/metrics.jsonl" "$OUT/${r}_metrics.jsonl" 2>/dev/null
done
