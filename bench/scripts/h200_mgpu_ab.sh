#!/usr/bin/env bash
# Issue 24 on one H200 in one `run` call: the Mosaic-GPU experts kernel (parallelism/gmm_mgpu.py, $MOEVLM_GMM_MGPU)
# in the MoE layer (bench_moe, both shape sets, HF beside, checked against float32), then the yardstick (recipe
# h200, real data, MBS 10) without and with it, one fresh process each (bench/scripts/h200_step_sides.sh).
#   run(command="bash bench/scripts/h200_mgpu_ab.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/layer.txt" 2>&1
KINDS=${KINDS:-fwd,dx}
MOEVLM_GMM_MGPU=$KINDS XLA_PYTHON_CLIENT_MEM_FRACTION=0.8 timeout "$(left "${LAYER_END:-170}")" python3 -m moevlm_jax.tools.bench_moe \
    --shapes 235b-a22b,30b-a3b --tokens 16384 --backends triton --iters 10 --out "$OUT/moe_layer_mgpu.json" 2>&1 \
    | grep -v "Autotuning cache miss" | tail -30 | tee -a "$OUT/layer.txt"
T0=$T0 SIDES="tree||;mgpu|MOEVLM_GMM_MGPU=$KINDS|" STEPS=${STEPS:-6} FIRST_S=${FIRST_S:-260} SIDE_S=${SIDE_S:-190} \
    END=${END:-595} bash bench/scripts/h200_step_sides.sh
