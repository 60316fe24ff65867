#!/usr/bin/env bash
# Issue 24's frozen-vision case and time to first step, one H200 in one `run` call:
# 0. (PROBE=1) the FP8 GEMM check, bf16 and the tensor recipe (bench/scripts/h200_fp8_gemm.py);
# 1. the train CLI, recipe h200 as written (unrolled layers, MBS 10), an empty compilation cache, 3 steps:
#    the summary's "first step done N s after the process started" is the time to first step;
# 2. the yardstick bench (recipe h200, real data, MBS 10) with the vision tower trained, then with
#    train.freeze_vision_model=true (the guide's decoder-focused case), same call. In its one call
#    (2026-12-02, bench/frozen_h200.md) both bench runs were cut while compiling one step per patch bucket:
#    bench/scripts/h200_frozen_cli.sh measures the frozen case instead.
# Results under $OUT: log.txt, first_step.log, {unfrozen,frozen}.json / .txt.
#   run(command="bash bench/scripts/h200_frozen.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
unset JAX_COMPILATION_CACHE_DIR
# PROBE=1 first: the FP8 GEMM check, bf16 and the tensor recipe (fp8 arrays handed to the dot), its HLO kept
if [ "${PROBE:-0}" = 1 ]; then
  timeout 50 python3 bench/scripts/h200_fp8_gemm.py "$OUT/fp8_gemm.json" --iters 10 --hlo-dir /tmp/hlo \
      --variants bf16,fp8_tensor 2>&1 | tail -9 | cut -c1-400 | tee -a "$OUT/log.txt"
  cp /tmp/hlo/qkv_fp8_tensor.hlo.txt "$OUT/" 2>/dev/null
fi
timeout 170 python3 -m moevlm_jax.train --recipe h200 --no-auto-fit --steps 3 --run-dir /tmp/fs \
    train.eval_every=0 train.eval_batches=0 train.show_answers=0 train.checkpointing=false train.tensorboard=false \
    train.compilation_cache_dir=null train.log_every=1 > "$OUT/first_step.log" 2>&1
echo "first-step run rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
grep -E "first step|throughput|steps 0" "$OUT/first_step.log" | tee -a "$OUT/log.txt"
for v in unfrozen frozen; do
  extra=""; [ "$v" = frozen ] && extra="train.freeze_vision_model=true"
  timeout "$(( $(left 590) / $( [ "$v" = unfrozen ] && echo 2 || echo 1 ) ))" python3 -m moevlm_jax.tools.bench --recipe h200 --data real --mbs 10 \
      --warmup 2 --steps 5 --out "$OUT/$v.json" $extra 2>&1 | grep -v "Autotuning cache miss" > "$OUT/$v.txt"
  echo "$v rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
  tail -8 "$OUT/$v.txt" | tee -a "$OUT/log.txt"
done
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
