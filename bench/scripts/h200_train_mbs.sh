#!/usr/bin/env bash
# The train command at the h200 recipe's MBS candidates, one H200, one `run` call: for each MBS in $MBS_LIST,
# `python -m moevlm_jax.train --recipe h200` as a user runs it (auto-fit on, the recipe's compilation cache in
# /tmp), $STEPS steps with an evaluation and an async checkpoint every $EVERY steps: does the recipe's step
# leave room for what the train command adds (evaluation's compiled step, checkpoint staging)? The summary's
# steady useful tokens/s and the peak memory of each; metrics.jsonl kept. CKPT=false: no checkpoints (the lent
# H200's 64 GB disk holds less than recipe h200's two 34 GB train states that keep_checkpoints=1 needs at once).
#   run(command="CKPT=false MBS_LIST='11' bash bench/scripts/h200_train_mbs.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
STEPS=${STEPS:-30}; EVERY=${EVERY:-15}
for mbs in ${MBS_LIST:-11}; do
  timeout "${RUN_S:-500}" python3 -m moevlm_jax.train --recipe h200 --steps "$STEPS" --run-dir "/tmp/mbs_$mbs" \
      train.micro_batch_size=$mbs train.eval_every=$EVERY train.eval_batches=4 train.checkpointing=${CKPT:-true} train.checkpoint_every=$EVERY \
      train.log_every=5 train.keep_checkpoints=1 train.tensorboard=false train.compilation_cache_dir=/tmp/jax_cache > "$OUT/mbs$mbs.log" 2>&1
  echo "mbs $mbs rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
  cp "/tmp/mbs_$mbs/metrics.jsonl" "$OUT/mbs${mbs}_metrics.jsonl" 2>/dev/null
  ls "/tmp/mbs_$mbs" "/tmp/mbs_$mbs"/checkpoints 2>/dev/null | tee -a "$OUT/log.txt"
  grep -iE "auto-fit|out of memory|RESOURCE_EXHAUSTED|checkpoint|eval|throughput|steady|peak|Traceback|Error" "$OUT/mbs$mbs.log" \
      | grep -v "Autotuning" | tail -20 | tee -a "$OUT/log.txt"
done
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
