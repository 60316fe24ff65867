#!/usr/bin/env bash
# Issue 24: Nsight Compute's counters for the experts' d(w) kernels at the 235B-A22B gate_up shape
# (bench/scripts/ncu_dw.py): the per-group and the streamed Mosaic kernel and the balanced einsum on cuBLAS, each
# its warm-up call skipped and the second call profiled, application replay (kernel replay's memory save/restore of
# several GB did not finish in 170 s, bench/moe_layer.md run 18). Sections: speed of light, memory workload, the
# scheduler and warp-state statistics (what the warps wait on). Results under $OUT: ncu_<name>.txt.
#   run(command="bash bench/scripts/h200_ncu_dw.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/ncu_env.txt" 2>&1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.8
NCU=${NCU:-/usr/local/cuda/bin/ncu}
for spec in "per_group|mosaic" "streamed|mosaic" "einsum|nvjet|gemm"; do
  name=${spec%%|*}; regex=${spec#*|}
  echo "=== $name (at $(( $(date +%s) - T0 )) s)" | tee -a "$OUT/ncu_env.txt"
  timeout "$(left "${END:-580}")" "$NCU" --replay-mode application --kernel-name "regex:$regex" --launch-skip 1 \
      --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
      --section WarpStateStats --metrics lts__t_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum \
      python3 bench/scripts/ncu_dw.py --only "$name" > "$OUT/ncu_$name.txt" 2>&1
  echo "rc $?" >> "$OUT/ncu_$name.txt"
  grep -E "Duration|Throughput|bytes|Stall|Issued|Eligible|rc " "$OUT/ncu_$name.txt" | head -40
done
echo "wall $(( $(date +%s) - T0 )) s"
