#!/usr/bin/env bash
# Issue 24's FP8 path on one H200 in one `run` call (first run 2026-12-02: bench/fp8_h200.md):
# 1. bench/scripts/h200_fp8_gemm.py: does XLA make our quantise-dequantise dots FP8 cuBLASLt GEMMs, their
#    speed next to bf16, per-GEMM error vs float32 (~60 s);
# 2. the proxy trained $STEPS steps on real data (recipe h200 at MBS $MBS, the layer scan for a shorter
#    compile, one compiled shape) in bf16 and then with compute.fp8.recipe=$FP8 by the train CLI, every step logged: the loss
#    curves side by side and the steady throughput of each (MFU against the bf16 peak, as the CLI reports
#    it), same call. The first run starts with an empty compilation cache: its "first step done" is the
#    time to the first step of that setting.
# FP8_EXTRA: more overrides of the fp8 run (e.g. compute.fp8.grad_format=e4m3); GEMM_S=0 skips step 1.
# Results under $OUT: log.txt, fp8_gemm.json, {bf16,fp8}.log, {bf16,fp8}_metrics.jsonl, curve.txt.
#   run(command="bash bench/scripts/h200_fp8.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
unset JAX_COMPILATION_CACHE_DIR
MBS=${MBS:-8}; STEPS=${STEPS:-200}; FP8=${FP8:-tensor}
if [ "${GEMM_S:-60}" -gt 0 ]; then  # GEMM_S=0: no GEMM check
  timeout "${GEMM_S:-60}" python3 bench/scripts/h200_fp8_gemm.py "$OUT/fp8_gemm.json" --iters 10 --hlo-dir "$OUT/hlo" 2>&1 | tail -12 | tee -a "$OUT/log.txt"
fi
RUNS=/tmp/fp8_runs; mkdir -p "$RUNS"
# one compiled train step a run (the data's largest bucket from the start): four compiles cut the first call's runs to ~100 steps
COMMON="train.micro_batch_size=$MBS compute.scan_layers=true train.reserve_largest_bucket=true train.compile_ahead=true train.eval_every=0 train.eval_batches=0 train.show_answers=0
 train.checkpointing=false train.log_every=1 train.tensorboard=false train.compilation_cache_dir=null"
run() {  # name, seconds, extra overrides
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m moevlm_jax.train --recipe h200 --no-auto-fit --steps "$STEPS" --run-dir "$RUNS/$name" \
      $COMMON "$@" --quiet > "$OUT/$name.log" 2>&1
  echo "$name rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
  cp "$RUNS/$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  grep -E "run .*steps|throughput|loss |error|Error" "$OUT/$name.log" | tail -6 | tee -a "$OUT/log.txt"
}
run bf16 "$(( $(left 585) - ${FP8_S:-255} ))"  # the fp8 run keeps $FP8_S s: ~85 s to its first step + 200 steps
run fp8 "$(left 585)" compute.fp8.recipe="$FP8" ${FP8_EXTRA:-}
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/curve.txt"
import json, sys
out = sys.argv[1]
def read(n):
    try:
        return {r["step"]: r for r in map(json.loads, open(f"{out}/{n}_metrics.jsonl")) if "loss" in r}
    except OSError:
        return {}
a, b = read("bf16"), read("fp8")
common = sorted(set(a) & set(b))
print("steps in both:", len(common))
for lo in range(1, (common[-1] if common else 0) + 1, 25):
    s = [k for k in common if lo <= k < lo + 25]
    if s:
        la, lb = sum(a[k]["loss"] for k in s) / len(s), sum(b[k]["loss"] for k in s) / len(s)
        print(f"steps {lo:3d}-{s[-1]:3d}: bf16 {la:.4f} fp8 {lb:.4f} rel {lb / la - 1:+.3%}")
PY
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
