#!/usr/bin/env bash
# Issue 24's time to the first step, one H200, one `run` call: the train CLI with recipe h200 as written
# (unrolled layers, whole-step capture, the step compiled ahead, the reserved patch bucket), each run a
# fresh process with an empty compilation cache AND no VQA set on disk (a new machine's first run: the set
# is generated, ~12 s), $STEPS steps, one compiled training shape (train.reserve_largest_bucket) so the
# steady throughput is read from the same run. RUNS picks the runs, in order (default: all four of the
# 2026-12-02 comparison, when the recipe compiled nothing ahead and reserved the largest bucket):
#   ahead_vscan  + compute.vision_scan_layers=true (the vision tower scanned, the decoder unrolled)
#                + train.compile_ahead=true (the step compiled in a thread while the state and data start)
#   vscan        + compute.vision_scan_layers=true
#   as_written   the recipe as written
#   ahead        + train.compile_ahead=true (unrolled)
#   largest      + train.reserve_bucket=null (every batch padded to the data's largest bucket)
#   no_kernels_ahead  + train.kernels_ahead=false (the Mosaic-GPU kernels compiled inside XLA's compile only)
#   eval_ahead     + an evaluation every 10 steps (8 held-out batches; train.eval_ahead, default on: its step compiled
#                in the background after the training step's): the log's "eval at step 10 ... (N s)" is the stall
#   eval_jit       the same with train.eval_ahead=false (the eval step compiled at the first evaluation)
# The summary's "first step done N s after the process started" and its steady useful tokens/s per run.
# Results under $OUT: log.txt, {name}.log, {name}_metrics.jsonl.
#   run(command="bash bench/scripts/h200_first_step.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
unset JAX_COMPILATION_CACHE_DIR  # an empty cache: nothing read, nothing written
STEPS=${STEPS:-20}
COMMON="train.reserve_largest_bucket=true train.eval_every=0 train.eval_batches=0 train.show_answers=0
 train.checkpointing=false train.log_every=1 train.tensorboard=false train.compilation_cache_dir=null"
run() {  # name, extra overrides
  local name=$1; shift
  rm -rf "$HOME/.cache/moevlm_jax/vqa" "/tmp/fs_$name"
  timeout "$(left "${END:-585}")" python3 -m moevlm_jax.train --recipe h200 --no-auto-fit --steps "$STEPS" \
      --run-dir "/tmp/fs_$name" $COMMON "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
  cp "/tmp/fs_$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  grep -E "compiled ahead|-> compile|eval at step|run .*steps|throughput" "$OUT/$name.log" | cut -c1-300 | tail -8 | tee -a "$OUT/log.txt"
}
for name in ${RUNS:-ahead_vscan vscan as_written ahead}; do
  case $name in
    ahead_vscan) run ahead_vscan compute.vision_scan_layers=true train.compile_ahead=true ;;
    vscan) run vscan compute.vision_scan_layers=true ;;
    as_written) run as_written ;;
    ahead) run ahead train.compile_ahead=true ;;
    largest) run largest train.reserve_bucket=null ;;
    no_kernels_ahead) run no_kernels_ahead train.kernels_ahead=false ;;
    eval_ahead) run eval_ahead train.eval_every=10 train.eval_batches=8 ;;
    eval_jit) run eval_jit train.eval_every=10 train.eval_batches=8 train.eval_ahead=false ;;
    *) echo "unknown run '$name'" | tee -a "$OUT/log.txt" ;;
  esac
done
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
