#!/usr/bin/env bash
# The guide's central comparison on one host of N GPUs (default 8), in one invocation: the real
# Qwen3-VL-30B-A3B trained under FSDP and under expert parallelism (and a 3D layout), one process a GPU over NCCL
# (python -m moevlm_jax.launch), each layout's steady useful tokens/s per GPU, MFU and peak memory from its summary,
# beside what the compiled plan predicts for the same settings (python -m moevlm_jax.plan.compiled, compiled first
# on these GPUs: its "pred" columns); then the MoE layer's EP dispatchers (flat, hierarchical over 2 host groups,
# with and without the exchange in chunks). Results page: bench/results/plans.md.
#
#   bash bench/scripts/multi_gpu.sh                          # 8 GPUs: fsdp, ep, tp_ep
#   GPUS=16 GPUS_PER_HOST=8 LAYOUTS="fsdp ep_multinode" ... # the same program across hosts needs a cluster
#                                                            # launcher (SLURM / mpirun): see README "Many hosts"
# Variables (defaults): RESULTS (runs/bench/multi_gpu-<UTC time>), GPUS (all visible), LAYOUTS ("fsdp ep tp_ep"),
#   MODEL (qwen3-vl-30b-a3b), STEPS (20), SETTINGS (MBS 1, full recompute, scanned layers, bf16 parameters and
#   AdamW state: the settings bench/scripts/compiled_plans.sh compiles), GPU (h100 | h200: the compiled plan's
#   target), PYTHON (python).
# Results: $RESULTS/<layout>.log and <layout>/metrics.jsonl, $RESULTS/compiled/compiled.txt, $RESULTS/moe_layer.json,
#   $RESULTS/log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-runs/bench/multi_gpu-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
N=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}
SETTINGS=${SETTINGS:-"compute.scan_layers=true compute.recompute=full train.micro_batch_size=1 compute.param_dtype=bfloat16 optimizer.state_dtype=bfloat16 optimizer.grad_accum_dtype=bfloat16"}
LAYOUTS=${LAYOUTS:-"fsdp ep tp_ep"}
log() { tee -a "$RESULTS/log.txt"; }
git log -1 --format='commit %H (%cI)' 2>/dev/null | log
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sort | uniq -c | log
echo "=== the compiled plan's prediction for $N GPUs (one host)" | log
# shellcheck disable=SC2086
$PY -m moevlm_jax.plan.compiled --model "${MODEL:-qwen3-vl-30b-a3b}" --layouts "$(echo $LAYOUTS | tr ' ' ,)" \
    --gpus "$N" --gpus-per-host "${GPUS_PER_HOST:-$N}" --gpu "${GPU:-h100}" --out "$RESULTS/compiled" $SETTINGS \
    > "$RESULTS/compiled.log" 2>&1
head -$(( 2 + $(echo $LAYOUTS | wc -w) )) "$RESULTS/compiled/compiled.txt" 2>/dev/null | log
for layout in $LAYOUTS; do
  echo "=== $layout: $N processes x 1 GPU, ${STEPS:-20} steps" | log
  # shellcheck disable=SC2086
  $PY -m moevlm_jax.launch --processes "$N" -- --model "${MODEL:-qwen3-vl-30b-a3b}" --layout "$layout" \
      --steps "${STEPS:-20}" --run-dir "$RESULTS/$layout" --no-auto-fit $SETTINGS train.checkpointing=false \
      train.eval_every=0 train.show_answers=0 train.log_every=1 > "$RESULTS/$layout.log" 2>&1
  echo "$layout exit $?" | log
  grep -E "first step|throughput|Error|Traceback" "$RESULTS/$layout.log" | cut -c1-300 | tail -4 | log
done
echo "=== the MoE layer's EP dispatchers over $N GPUs (2 host groups)" | log
$PY -m bench.moe_layer --ep "$N" --ep-hosts 2 --dispatch-chunks 2,4 --no-hf --out "$RESULTS/moe_layer.json" 2>&1 \
    | grep -E "ep$N|all-to-all" | log
echo "results in $RESULTS" | log
