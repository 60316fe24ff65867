#!/usr/bin/env bash
# Issue 24's yardstick (recipe h200, real data, MBS 10) as an A/B in one call: side a = the library before a
# change, side b = the library as it is, one after the other (ORDER=ba: b first). AB picks the change:
#   searchsorted  a: every jnp.searchsorted forced to jnp's default binary-search loop (bench/scripts/
#                 with_searchsorted.py scan); b: compare_all in permute.route_plan and gmm_triton.tile_table
#   fuse          a: no Triton expert fusion (MOEVLM_MOE_FUSE=""); b: the default, the row gather inside the
#                 gate_up kernel (parallelism/permute.py FUSE)
#   run(command="AB=fuse bash bench/scripts/h200_step_ab.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
set -f
left() { local l=$(( ${1} - ($(date +%s) - T0) )); echo $(( l > 1 ? l : 1 )); }
ARGS="--recipe h200 --peer none --data real --mbs ${MBS:-10} --warmup 3 --steps ${STEPS:-8}"
case "${AB:?AB=searchsorted or AB=fuse}" in
  searchsorted) A_RUN="python3 bench/scripts/with_searchsorted.py scan -m"; A_ENV=""; NAMES=(scan compare_all) ;;
  fuse) A_RUN="python3 -m"; A_ENV="MOEVLM_MOE_FUSE="; NAMES=(fuse_none fuse_gather) ;;
  *) echo "AB must be searchsorted or fuse, got '$AB'"; exit 2 ;;
esac
side() {  # $1: a (before) or b (as is); $2: seconds
  local run="python3 -m" env="" name=${NAMES[1]}
  [ "$1" = a ] && { run=$A_RUN; env=$A_ENV; name=${NAMES[0]}; }
  mkdir -p "/tmp/w$1"
  echo "=== side $1 ($name)" | tee -a "$OUT/log.txt"
  env $env timeout "$2" $run moevlm_jax.tools.bench $ARGS --work-dir "/tmp/w$1" --out "$OUT/step_$name.json" 2>&1 \
      | grep -v "Autotuning cache miss" | tail -6 | tee -a "$OUT/log.txt"
}
if [ "${ORDER:-ab}" = ab ]; then side a "${A_S:-260}"; side b "$(left 585)"; else side b "${A_S:-260}"; side a "$(left 585)"; fi
echo "wall $(( $(date +%s) - T0 )) s"
