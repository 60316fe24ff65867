#!/usr/bin/env bash
# The Qwen3.5-MoE proxy step (model proxy35: Gated DeltaNet + full attention, recipe h200 with the layer scan) against
# HF transformers on the same batches and initial weights, one GPU, as bench/results/qwen35.md reports it.
# HF runs its PyTorch reference delta rule (flash-linear-attention and causal-conv1d are not assumed installed);
# HF_COMPILE=on adds its per-block torch.compile (more than 5 minutes of compile on an H200). PROFILE=1 adds a
# jax.profiler trace of our timed steps and its breakdown (GDN as its own row) to the JSON: profile with
# CAPTURE=none (command buffers hide the HLO ops' names), and read the profiled step times as slower than unprofiled.
#
#   bash bench/scripts/qwen35.sh                      # MBS 2 and 4: HF eager fits 2, ours 4 (and 6)
#   MBS=4 CAPTURE=none PROFILE=1 PEER=none bash bench/scripts/qwen35.sh
# Variables (defaults): RESULTS (runs/bench/qwen35-<UTC time>), MBS (2,4), WARMUP (2), STEPS (4), HF_COMPILE (off),
#   PEER (hf; none: ours only), PROFILE (0), CAPTURE (the recipe's), EXTRA (more overrides), PYTHON (python).
# Results: $RESULTS/proxy35_mbs<MBS>.json, $RESULTS/log.txt (and $RESULTS/profile/ with PROFILE=1).
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-runs/bench/qwen35-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
PY=${PYTHON:-python}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95} PYTHONUNBUFFERED=1
MBS=${MBS:-2,4}
PROF=(); [ "${PROFILE:-0}" = 1 ] && PROF=(--profile "$RESULTS/profile")
CAP=(); [ -n "${CAPTURE:-}" ] && CAP=("compute.capture=$CAPTURE")
git log -1 --format='commit %H (%cI)' 2>/dev/null | tee -a "$RESULTS/log.txt"
$PY -m bench.step --recipe h200 --model proxy35 --peer "${PEER:-hf}" --hf-compile "${HF_COMPILE:-off}" "${PROF[@]}" \
    --data real --mbs "$MBS" --warmup "${WARMUP:-2}" --steps "${STEPS:-4}" --out "$RESULTS/proxy35_mbs${MBS//,/_}.json" \
    data.tokenizer=qwen3.5 compute.scan_layers=true "${CAP[@]}" ${EXTRA:-} 2>&1 \
    | grep -v "Autotuning cache miss" | tee -a "$RESULTS/log.txt"
echo "results in $RESULTS" | tee -a "$RESULTS/log.txt"
