#!/usr/bin/env bash
# The proxy step (recipe h200, real data, MBS 10: issue 24's yardstick) with the library's searchsorted
# (compare_all in permute.route_plan and gmm_triton.tile_table) against jnp's default binary-search loop
# (bench/scripts/with_searchsorted.py scan), one after the other in one call (ORDER=ba: the library first).
#   run(command="bash bench/scripts/h200_searchsorted.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
set -f
left() { local l=$(( ${1} - ($(date +%s) - T0) )); echo $(( l > 1 ? l : 1 )); }
ARGS="--recipe h200 --peer none --data real --mbs ${MBS:-10} --warmup 3 --steps ${STEPS:-8}"
side() {  # $1: a (scan) or b (as is); $2: seconds
  mkdir -p "/tmp/w$1"
  if [ "$1" = a ]; then
    timeout "$2" python3 bench/scripts/with_searchsorted.py scan -m moevlm_jax.tools.bench $ARGS --work-dir /tmp/wa \
        --out "$OUT/step_scan.json" 2>&1 | grep -v "Autotuning cache miss" | tail -6 | tee -a "$OUT/log.txt"
  else
    timeout "$2" python3 -m moevlm_jax.tools.bench $ARGS --work-dir /tmp/wb --out "$OUT/step_compare_all.json" 2>&1 \
        | grep -v "Autotuning cache miss" | tail -6 | tee -a "$OUT/log.txt"
  fi
}
if [ "${ORDER:-ab}" = ab ]; then side a "${A_S:-250}"; side b "$(left 585)"; else side b "${A_S:-250}"; side a "$(left 585)"; fi
echo "wall $(( $(date +%s) - T0 )) s"
