#!/usr/bin/env bash
# Time to the first training step, as bench/results/first_step.md reports it: the train CLI with recipe h200 as a
# user meets it on a new machine, an EMPTY compilation cache and no generated VQA set on disk (it is generated
# first, ~10 s), STEPS steps each run, one fresh process per run. The train summary's "first step done N s after
# the process started" (process start to the end of step 1, imports included) and its steady useful tokens/s.
#
#   bash bench/scripts/first_step.sh                       # recipe h200 as written, evaluation every 10 steps
#   RUNS="as_written vscan" bash bench/scripts/first_step.sh
# Runs (RUNS, in order; default "as_written"):
#   as_written  the recipe as written, with an evaluation of 8 held-out batches every 10 steps (the log's
#               "eval at step 10 ... (N s)" is the first evaluation's stall)
#   vscan       + compute.vision_scan_layers=true (the vision tower scanned: a shorter compile, a slower step)
#   custom      + $EXTRA (any overrides)
# Variables (defaults): RESULTS (runs/bench/first_step-<UTC time>), STEPS (22), RECIPE (h200), EXTRA, PYTHON (python),
#   VQA_CACHE (~/.cache/moevlm_jax/vqa or $MOEVLM_DATA_CACHE/vqa: deleted before each run so that it is generated;
#   KEEP_DATA=1 keeps it).
# Results: $RESULTS/<run>.log, $RESULTS/<run>/metrics.jsonl, $RESULTS/log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-runs/bench/first_step-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
unset JAX_COMPILATION_CACHE_DIR  # an empty cache: nothing read, nothing written
VQA_CACHE=${VQA_CACHE:-${MOEVLM_DATA_CACHE:-$HOME/.cache/moevlm_jax}/vqa}
COMMON="train.eval_every=10 train.eval_batches=8 train.show_answers=0 train.checkpointing=false train.log_every=1
 train.tensorboard=false train.compilation_cache_dir=null"
log() { tee -a "$RESULTS/log.txt"; }
git log -1 --format='commit %H (%cI)' 2>/dev/null | log
run() {  # name, extra overrides
  local name=$1; shift
  [ "${KEEP_DATA:-0}" = 1 ] || rm -rf "$VQA_CACHE"
  $PY -m moevlm_jax.train --recipe "${RECIPE:-h200}" --no-auto-fit --steps "${STEPS:-22}" --run-dir "$RESULTS/$name" \
      $COMMON "$@" > "$RESULTS/$name.log" 2>&1
  echo "$name exit $?" | log
  grep -E "compiled ahead|-> compile|eval at step|first step|run .*steps|throughput" "$RESULTS/$name.log" | cut -c1-300 \
      | tail -8 | log
}
for name in ${RUNS:-as_written}; do
  case $name in
    as_written) run as_written ;;
    vscan) run vscan compute.vision_scan_layers=true ;;
    custom) run custom ${EXTRA:?custom needs EXTRA} ;;
    *) echo "unknown run '$name'" | log ;;
  esac
done
echo "results in $RESULTS" | log
