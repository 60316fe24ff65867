#!/usr/bin/env bash
# The user's command on a new machine against the best setting measured on the same card, as
# bench/results/plans.md reports it ("The user's command on one GPU"):
#   1. `python -m moevlm_jax.train --layout fsdp --steps STEPS` (recipe gpu-default, auto-fit on) with an EMPTY
#      compilation cache (a fresh train.compilation_cache_dir) and no generated VQA set on disk: the summary's
#      "first step done N s after the process started", its steady useful tokens/s, the training programs it
#      compiled, what auto-fit chose, and that it ends with its summary and final checkpoint;
#   2. the peer: `python -m bench.step --recipe h200 --data real --mbs PEER_MBS` (recipe h200 at the micro batch
#      that fits the card: 11 on a 141 GB H200, 4 on an 80 GB H100), steady useful tokens/s.
# The ratio (1) / (2) is the figure; each run is its own process with the whole GPU. PART=train or PART=peer runs
# one of the two (two calls of one machine), PART=both (default) both.
#
#   bash bench/scripts/user_command.sh                 # H200
#   PEER_MBS=4 bash bench/scripts/user_command.sh      # H100 80 GB
# Variables (defaults): RESULTS (runs/bench/user_command-<UTC time>), STEPS (30), PEER_MBS (11), PART (both),
#   PYTHON (python), VQA_CACHE (as first_step.sh: deleted before the train run so that it is generated).
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-runs/bench/user_command-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
unset JAX_COMPILATION_CACHE_DIR
VQA_CACHE=${VQA_CACHE:-${MOEVLM_DATA_CACHE:-$HOME/.cache/moevlm_jax}/vqa}
log() { tee -a "$RESULTS/log.txt"; }
git log -1 --format='commit %H (%cI)' 2>/dev/null | log
$PY -c "import jax; print('jax', jax.__version__, 'device', jax.devices()[0].device_kind)" 2>&1 | log
if [ "${PART:-both}" != peer ]; then
  rm -rf "$VQA_CACHE" "$RESULTS/jax_cache" "$RESULTS/train"
  echo "=== the user's command: --layout fsdp --steps ${STEPS:-30} (empty compilation cache)" | log
  start=$(date +%s)
  $PY -m moevlm_jax.train --layout fsdp --steps "${STEPS:-30}" --run-dir "$RESULTS/train" \
      train.compilation_cache_dir="$RESULTS/jax_cache" > "$RESULTS/train.log" 2>&1
  echo "exit $? after $(( $(date +%s) - start )) s" | log
  grep -E "auto-fit|compiled ahead|-> compile|first step|run .*steps|throughput|useful|checkpoint|Traceback|Error" \
      "$RESULTS/train.log" | cut -c1-400 | tail -20 | log
  echo "compiled training programs in the cache: $(ls "$RESULTS/jax_cache" 2>/dev/null | grep -c train_step)" | log
  ls "$RESULTS/train/checkpoints" 2>/dev/null | sed 's/^/checkpoint: /' | log
fi
if [ "${PART:-both}" != train ]; then
  echo "=== the peer: recipe h200, MBS ${PEER_MBS:-11}" | log
  # the share of the card the train command gives a step (JAX preallocates 75% by default)
  XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95} \
  $PY -m bench.step --recipe h200 --peer none --data real --mbs "${PEER_MBS:-11}" --warmup 3 --steps 8 \
      --out "$RESULTS/peer.json" 2>&1 | grep -vE "^W[0-9]|^I[0-9]" | tail -12 | log
fi
echo "results in $RESULTS" | log
