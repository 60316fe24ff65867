#!/usr/bin/env bash
# Issue 24's FP8 path on one H200 in one `run` call (not yet run: written 2026-12-02 without device time):
# 1. bench/scripts/h200_fp8_gemm.py: does XLA make our quantise-dequantise dots FP8 cuBLASLt GEMMs, their
#    speed next to bf16, per-GEMM error vs float32 (~60 s);
# 2. the proxy step (recipe h200, real data, MBS $MBS) in bf16, then with compute.fp8.recipe=tensor and
#    =blockwise, each by moevlm_jax.tools.bench in the same call (MFU against the bf16 peak, as the tools
#    report it). Results under $OUT: log.txt, fp8_gemm.json, step_{bf16,tensor,blockwise}.json.
#   run(command="bash bench/scripts/h200_fp8.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
set -f
left() { local l=$(( ${1} - ($(date +%s) - T0) )); echo $(( l > 1 ? l : 1 )); }
MBS=${MBS:-8}
timeout 120 python3 bench/scripts/h200_fp8_gemm.py "$OUT/fp8_gemm.json" 2>&1 | tail -12 | tee -a "$OUT/log.txt"
for v in bf16 tensor blockwise; do
  extra=""; [ "$v" = bf16 ] || extra="compute.fp8.recipe=$v"
  timeout "$(( $(left 590) < ${STEP_S:-170} ? $(left 590) : ${STEP_S:-170} ))" python3 -m moevlm_jax.tools.bench --recipe h200 \
      --peer none --data real --mbs "$MBS" --warmup 3 --steps 6 --out "$OUT/step_$v.json" $extra ${EXTRA:-} 2>&1 \
      | grep -v "Autotuning cache miss" | tail -6 | tee -a "$OUT/log.txt"
done
echo "wall $(( $(date +%s) - T0 )) s"
