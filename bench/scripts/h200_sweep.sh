#!/usr/bin/env bash
# Issue 7 on one H200 in one `run` call (device tool); results under $OUT.
#   run(command="bash bench/scripts/h200_sweep.sh", carry=[".gpudeps"], timeout_s=600)
# The proxy sweep, each point in its own process (OOM recorded): capture none / step / scopes at MBS 2
# with no recompute (the bench's setting), the same with drop-and-pad 'capacity' experts (capacity factor
# 1.25: 0.61 of the ceiling in the MoE-layer bench, ~10% dropped), then MBS 4 with selective recompute. bf16 parameters and AdamW
# state (float32 masters need ~133 GiB at MBS 2: bench/step_h200.md). PROBE=1 first runs
# bench/scripts/probe_tokamax.py (kernel accuracy and configs, ~2 min).
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/sweep.txt" 2>&1; cat "$OUT/sweep.txt"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv | tee -a "$OUT/sweep.txt"
if [ "${PROBE:-0}" = 1 ]; then
  timeout 170 python3 bench/scripts/probe_tokamax.py --budget 120 --out "$OUT/tokamax_probe.json" 2>&1 \
      | tee "$OUT/tokamax_probe.txt" | grep -v "^  File\|^Traceback\|Autotuning cache miss" | tail -60
fi
sweep() {  # out-dir, then sweep args
  local out=$1; shift
  timeout "$(left "${BUDGET:-575}")" python3 -m moevlm_jax.tools.sweep --model proxy --layout fsdp --steps 5 --warmup 2 \
      --timeout "${POINT_TIMEOUT:-150}" --out "/tmp/$out" "$@" --state-dtype bfloat16 param_dtype=bfloat16 2>&1 \
      | grep -v "Autotuning cache miss" | tee -a "$OUT/sweep.txt"
  [ -f "/tmp/$out/results.json" ] && cp "/tmp/$out/results.json" "$OUT/sweep_${out}.json"
}
if [ "${SET:-capture}" = capture ]; then
  sweep capture --mbs 2 --recompute none --capture none,step,scopes
  sweep capacity --mbs 2 --recompute none --capture step moe.backend=capacity moe.capacity_factor=1.25
  sweep mbs4sel --mbs 4 --recompute selective --capture step
else  # SET=best: larger MBS with selective recompute and scopes, drop-and-pad and dropless experts
  sweep best --mbs 4,6 --recompute selective --capture scopes moe.backend=capacity moe.capacity_factor=1.25
  sweep mbs4tok --mbs 4 --recompute selective --capture scopes
  sweep mbs8cap --mbs 8 --recompute selective --capture scopes moe.backend=capacity moe.capacity_factor=1.25
fi
grep -l "Error\|error" /tmp/*/logs/*.log 2>/dev/null | head -3 | xargs -r tail -n 5 | cut -c1-400 > "$OUT/point_errors.txt"
echo "wall $(( $(date +%s) - T0 )) s"
