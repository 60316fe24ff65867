#!/usr/bin/env bash
# Issue 24's frozen-vision case through the train CLI, one H200, one `run` call: recipe h200 at MBS $MBS with
# the layer scan and one compiled training shape (train.reserve_largest_bucket: the bench meets every patch
# bucket and compiles each, which cut bench/scripts/h200_frozen.sh's runs), $STEPS steps each, vision tower
# trained vs frozen (train.freeze_vision_model=true); the summary's steady useful tokens/s of each.
#   run(command="bash bench/scripts/h200_frozen_cli.sh", carry=[".gpudeps"], timeout_s=400)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
MBS=${MBS:-8}; STEPS=${STEPS:-30}
for v in unfrozen frozen; do
  extra=""; [ "$v" = frozen ] && extra="train.freeze_vision_model=true"
  timeout 150 python3 -m moevlm_jax.train --recipe h200 --no-auto-fit --steps "$STEPS" --run-dir "/tmp/fz_$v" \
      train.micro_batch_size=$MBS compute.scan_layers=true train.reserve_largest_bucket=true train.eval_every=0 \
      train.eval_batches=0 train.show_answers=0 train.checkpointing=false train.log_every=1 train.tensorboard=false \
      $extra > "$OUT/$v.log" 2>&1
  echo "$v rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
  cp "/tmp/fz_$v/metrics.jsonl" "$OUT/${v}_metrics.jsonl" 2>/dev/null
  grep -E "run .*steps|throughput|loss " "$OUT/$v.log" | tail -4 | tee -a "$OUT/log.txt"
done
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
