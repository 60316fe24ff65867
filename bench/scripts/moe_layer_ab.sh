#!/usr/bin/env bash
# One MoE layer, forward + backward (python -m bench.moe_layer: the dropless Triton / Mosaic-GPU experts at the
# 235B-A22B and 30B-A3B shape sets, with the cuBLAS ceiling measured in the same process), for several sides in
# one invocation, one fresh process each, in order; as bench/results/moe_layer.md reports it.
#
#   SIDES is a ';'-separated list of name|env|bench-args|dir, e.g.
#     bash bench/scripts/moe_layer_ab.sh                         # the default: the tree with HF's block and the check
#     SIDES="tree||--no-hf --no-check --rounds 7;base||--no-hf --no-check --rounds 7|../base;tree2||--no-hf --no-check --rounds 7" \
#         bash bench/scripts/moe_layer_ab.sh
#   env: VAR=value words for that process; bench-args: more bench.moe_layer arguments; dir: another checkout to run
#   from (its own library, e.g. `git worktree add ../base <commit>`; one from before bench/moe_layer.py existed runs
#   its `moevlm_jax.tools.bench_moe`).
# JAX gets 80% of the card (HF's torch block needs the rest).
# PROFILE="name|env" (optional): afterwards, that side's layer traced per pass (bench/scripts/profile_moe_layer.py
# --pipelined at PROFILE_SHAPES, default 30b-a3b): $RESULTS/moe_profile_<name>.json.
#
# Variables (defaults): SIDES ("tree||--rounds 7"), RESULTS (runs/bench/moe_layer-<UTC time>), LAYER_SHAPES
#   (235b-a22b,30b-a3b), TOKENS (16384), PROFILE, PROFILE_SHAPES, PYTHON (python).
# Results: $RESULTS/moe_layer_<name>.json, $RESULTS/log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
RESULTS=${RESULTS:-runs/bench/moe_layer-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"; RESULTS=$(cd "$RESULTS" && pwd)
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
log() { tee -a "$RESULTS/log.txt"; }
git log -1 --format='commit %H (%cI)' 2>/dev/null | log
set -f
IFS=';' read -ra SS <<< "${SIDES:-tree||--rounds 7}"
for s in "${SS[@]}"; do
  IFS='|' read -r name env extra dir <<< "$s"
  dir=${dir:-$ROOT}
  module=bench.moe_layer; [ -f "$dir/bench/moe_layer.py" ] || module=moevlm_jax.tools.bench_moe
  echo "=== side $name: env '$env' args '$extra' tree $dir" | log
  (cd "$dir" && env PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 $env \
      $PY -m $module --shapes "${LAYER_SHAPES:-235b-a22b,30b-a3b}" --tokens "${TOKENS:-16384}" --backends triton \
      --iters 10 $extra --out "$RESULTS/moe_layer_$name.json") 2>&1 | grep -v "Autotuning cache miss" | tail -14 | log
done
if [ -n "${PROFILE:-}" ]; then
  IFS='|' read -r name env <<< "$PROFILE"
  echo "=== profile $name: env '$env'" | log
  env XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 $env $PY bench/scripts/profile_moe_layer.py --pipelined --steps 10 \
      --shapes "${PROFILE_SHAPES:-30b-a3b}" --out "$RESULTS/moe_profile_$name.json" 2>&1 \
      | grep -v "Autotuning cache miss" | tail -40 | log
fi
echo "results in $RESULTS" | log
