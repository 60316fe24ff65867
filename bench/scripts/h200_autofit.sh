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
timeout ${FIT_TIMEOUT:-380} python -m moevlm_jax.train --layout fsdp --steps ${FIT_STEPS:-4} --run-dir "$RUNS/fit" \
    $COMMON > "$OUT/fit.log" 2>&1
echo "fit rc=$? wall_s=$(python3 -c "print(round($(now) - $t0, 1))")" | tee -a "$OUT/summary.txt"
t0=$(now)
timeout ${H200_TIMEOUT:-240} python -m moevlm_jax.train --recipe h200 --no-auto-fit --steps ${H200_STEPS:-12} \
    --run-dir "$RUNS/h200" $COMMON > "$OUT/h200.log" 2>&1
echo "h200 rc=$? wall_s=$(python3 -c "print(round($(now) - $t0, 1))")" | tee -a "$OUT/summary.txt"
for r in fit h200; do
  grep -E "auto-fit|throughput|run .*steps|new batch shape|error" "$OUT/$r.log" | sed "s/^/$r: /" | tee -a "$OUT/summary.txt"
  cp "$RUNS/$r/metrics.jsonl" "$OUT/${r}_metrics.jsonl" 2>/dev/null
done
