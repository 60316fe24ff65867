#!/usr/bin/env bash
# The MoE layer bench (moevlm_jax.tools.bench_moe: the Triton dropless experts at both shape sets, the einsum ceiling
# beside) for several variants of the working tree in one call, one fresh process each, in order: SIDES is a
# ';'-separated list of name|env|bench-args[|dir], e.g.
#   SIDES="tree||;triton|MOEVLM_GMM_MGPU=|--no-hf --no-check;unfused|MOEVLM_MOE_FUSE=|--no-hf"
# A side's dir (e.g. .ab_base: an earlier commit's library, made as h200_step_ab.sh's header says, in carry) runs the
# bench from there, i.e. on that library.
# JAX at 80% of the card (HF's block needs the rest). Results under $OUT: layer.txt, moe_layer_<name>.json.
# PROFILE="name|env" (optional): then, in the time left (at least 90 s), that side's layer traced per pass
# (bench/scripts/profile_moe_layer.py --pipelined at PROFILE_SHAPES, default 30b-a3b): $OUT/moe_profile_<name>.json.
#   run(command="SIDES='...' bash bench/scripts/h200_layer_sides.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=${T0:-$(date +%s)}
source bench/scripts/gpu_env.sh > "$OUT/layer.txt" 2>&1; cat "$OUT/layer.txt"
set -f
IFS=';' read -ra SS <<< "${SIDES:?SIDES=name|env|args;...}"
for s in "${SS[@]}"; do
  IFS='|' read -r name env extra dir <<< "$s"
  [ "$(left "${END:-590}")" -lt 60 ] && { echo "no time for side $name" | tee -a "$OUT/layer.txt"; break; }
  echo "=== side $name: env '$env' args '$extra' (at $(( $(date +%s) - T0 )) s)" | tee -a "$OUT/layer.txt"
  (cd "${dir:-.}" && env XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 $env timeout "$(left "${END:-590}")" python3 -m \
      moevlm_jax.tools.bench_moe --shapes "${LAYER_SHAPES:-235b-a22b,30b-a3b}" --tokens 16384 --backends triton \
      --iters 10 $extra --out "$OUT/moe_layer_$name.json") 2>&1 | grep -v "Autotuning cache miss" | tail -14 \
      | tee -a "$OUT/layer.txt"
done
if [ -n "${PROFILE:-}" ]; then
  IFS='|' read -r name env <<< "$PROFILE"
  if [ "$(left "${END:-590}")" -ge 90 ]; then
    echo "=== profile $name: env '$env' (at $(( $(date +%s) - T0 )) s)" | tee -a "$OUT/layer.txt"
    env $env timeout "$(left "${END:-590}")" python3 bench/scripts/profile_moe_layer.py --pipelined --steps 10 \
        --shapes "${PROFILE_SHAPES:-30b-a3b}" --out "$OUT/moe_profile_$name.json" 2>&1 \
        | grep -v "Autotuning cache miss" | tail -40 | tee -a "$OUT/layer.txt"
  else
    echo "no time for profile $name" | tee -a "$OUT/layer.txt"
  fi
fi
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/layer.txt"
