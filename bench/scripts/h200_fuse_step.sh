#!/usr/bin/env bash
# The proxy step (recipe h200, real data, MBS 10: issue 24's yardstick) with the Triton experts' row gather
# inside the gate_up kernel (parallelism/permute.py FUSE "gather", the default) against no fusion
# (MOEVLM_MOE_FUSE=""), one after the other in one call (ORDER=ba: the default first).
#   run(command="bash bench/scripts/h200_fuse_step.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
set -f
left() { local l=$(( ${1} - ($(date +%s) - T0) )); echo $(( l > 1 ? l : 1 )); }
ARGS="--recipe h200 --peer none --data real --mbs ${MBS:-10} --warmup 3 --steps ${STEPS:-8}"
side() {  # $1: a (no fusion) or b (the default, gather); $2: seconds
  mkdir -p "/tmp/w$1"
  local fuse=gather; [ "$1" = a ] && fuse=""
  echo "=== side $1: MOEVLM_MOE_FUSE='$fuse'" | tee -a "$OUT/log.txt"
  MOEVLM_MOE_FUSE="$fuse" timeout "$2" python3 -m moevlm_jax.tools.bench $ARGS --work-dir "/tmp/w$1" \
      --out "$OUT/step_fuse_${fuse:-none}.json" 2>&1 | grep -v "Autotuning cache miss" | tail -6 | tee -a "$OUT/log.txt"
}
if [ "${ORDER:-ab}" = ab ]; then side a "${A_S:-260}"; side b "$(left 585)"; else side b "${A_S:-260}"; side a "$(left 585)"; fi
echo "wall $(( $(date +%s) - T0 )) s"
