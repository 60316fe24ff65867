#!/usr/bin/env bash
# The guide's layout table compiled for the target GPU counts on the GPU at hand (python -m
# moevlm_jax.plan.compiled: JAX's mock GPU topology where fewer GPUs are present than a row names), one
# directory per row under $RESULTS (compiled.txt, compiled.json, each layout's HLO). Results page:
# bench/results/plans.md.
#   ROWS="30b-8 35b-8" GPU=h100 bash bench/scripts/compiled_plans.sh
set -u
RESULTS=${RESULTS:-runs/bench/compiled}
GPU=${GPU:-h100}
LIMIT=${LIMIT:-900}
ROWS=${ROWS:-"30b-8 35b-8 30b-16 235b-64"}
# MBS 1 (accumulation to the recipe's global batch of 64), full recompute, the layer scan, bf16 parameters and
# AdamW state: the settings a 30B-235B run takes on 80-141 GB cards (PRECISION= to set others)
PRECISION=${PRECISION:-"compute.param_dtype=bfloat16 optimizer.state_dtype=bfloat16"}
COMMON="compute.scan_layers=true compute.recompute=full train.micro_batch_size=1 $PRECISION"
mkdir -p "$RESULTS"
row() {
  case $1 in
    30b-8) echo "--model qwen3-vl-30b-a3b --layouts fsdp,ep,tp_ep --gpus 8 --gpus-per-host 8" ;;
    30b-16) echo "--model qwen3-vl-30b-a3b --layouts fsdp,ep --gpus 16 --gpus-per-host 8" ;;
    35b-8) echo "--model qwen3.5-35b-a3b --layouts fsdp,ep --gpus 8 --gpus-per-host 8 data.tokenizer=qwen3.5" ;;
    35b-32) echo "--model qwen3.5-35b-a3b --layouts fsdp,ep --gpus 32 --gpus-per-host 8 data.tokenizer=qwen3.5" ;;
    # EP 8 within each host, FSDP over the hosts (the ep preset's expert: -1 would cross them)
    235b-64) echo "--model qwen3-vl-235b-a22b --layouts ep --gpus 64 --gpus-per-host 8 layout.mesh.fsdp=8 layout.mesh.expert=8" ;;
    235b-128) echo "--model qwen3-vl-235b-a22b --layouts ep --gpus 128 --gpus-per-host 8 layout.mesh.fsdp=16 layout.mesh.expert=8" ;;
    *) echo "unknown row $1" >&2; return 1 ;;
  esac
}
for name in $ROWS; do
  args=$(row "$name") || continue
  # shellcheck disable=SC2086
  timeout "$LIMIT" python3 -m moevlm_jax.plan.compiled --gpu "$GPU" --out "$RESULTS/$name" $args $COMMON \
    > "$RESULTS/$name.log" 2>&1
  echo "$name: exit $?"
  grep -v "^  \|^W[0-9]\|^I[0-9]" "$RESULTS/$name.log" | tail -12
done
