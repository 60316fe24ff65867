#!/usr/bin/env bash
# Issue 24's yardstick (recipe h200, real data, MBS 10) as an A/B in one call: side a = the library before a
# change, side b = the library as it is, one after the other (ORDER=ba: b first). AB picks the change:
#   searchsorted  a: every jnp.searchsorted forced to jnp's default binary-search loop (bench/scripts/
#                 with_searchsorted.py scan); b: compare_all in permute.route_plan and gmm_triton.tile_table
#   fuse          a: no Triton expert fusion (MOEVLM_MOE_FUSE=""); b: the default, the row gather inside the
#                 gate_up kernel (parallelism/permute.py FUSE)
#   base          a: the library of an earlier commit, extracted here beforehand (the device copy has no git):
#                   rm -rf .ab_base && mkdir .ab_base && git archive <commit> moevlm_jax parallelism data configs \
#                       | tar -x -C .ab_base     (.ab_base in .git/info/exclude, and in carry)
#                 b: the working tree
#   C_ENV="VAR=value ..." and/or C_ARGS="<bench args>" (e.g. "--mbs 11") add a side c: the working tree with
#   those (values without spaces; C_ENV=XLA_FLAGS=--flag=value merges with the recipe's capture flags);
#   C_DIR=.ab_c runs side c from another extracted library instead (a variant of the tree, e.g. extracted as
#   .ab_base is and edited; .ab_c in .git/info/exclude, and in carry)
#   BENCH_ARGS="<bench args>" adds to every side (e.g. "--devices 8" on a machine of several GPUs: the recipe's
#   fsdp layout over them, MBS per device)
#   run(command="AB=fuse bash bench/scripts/h200_step_ab.sh", carry=[".gpudeps"], timeout_s=600)
# Budget: the first side on a new machine takes ~230 s (the VQA set generated, and its compile 150-186 s against
# ~100-110 s for the later sides, runs 17-23; bench/step_h200.md run 23 lost two sides at A_S=225-230),
# each later side ~140 s: A_S >= 290, and a side c only where ~140 s are left. Each side's whole log is
# $OUT/side_{a,b,c}.log, ending with its exit status (124: its timeout).
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
set -f
ARGS="--recipe h200 --peer none --data real --mbs ${MBS:-10} --warmup 3 --steps ${STEPS:-8} ${BENCH_ARGS:-}"
case "${AB:?AB=searchsorted or AB=fuse}" in
  searchsorted) A_RUN="python3 bench/scripts/with_searchsorted.py scan -m"; A_ENV=""; NAMES=(scan compare_all) ;;
  fuse) A_RUN="python3 -m"; A_ENV="MOEVLM_MOE_FUSE="; NAMES=(fuse_none fuse_gather) ;;
  base) [ -d .ab_base/moevlm_jax ] || { echo "AB=base needs .ab_base (see the header)"; exit 2; }
        A_RUN="python3 -m"; A_ENV="PYTHONPATH=${PYTHONPATH%:$PWD}:$PWD/.ab_base"; A_DIR=.ab_base; NAMES=(base head) ;;
  *) echo "AB must be searchsorted, fuse or base, got '$AB'"; exit 2 ;;
esac
side() {  # $1: a (before), b (as is) or c (as is + C_ENV, C_ARGS); $2: seconds
  local run="python3 -m" env="" name=${NAMES[1]} dir=.
  [ "$1" = a ] && { run=$A_RUN; env=$A_ENV; name=${NAMES[0]}; dir=${A_DIR:-.}; }
  [ "$1" = c ] && { env=${C_ENV:-}; name=${NAMES[1]}_c; }
  [ "$1" = c ] && [ -n "${C_DIR:-}" ] && { env="$env PYTHONPATH=${PYTHONPATH%:$PWD}:$PWD/$C_DIR"; dir=$C_DIR; }
  mkdir -p "/tmp/w$1"
  echo "=== side $1 ($name)" | tee -a "$OUT/log.txt"
  local extra=""; [ "$1" = c ] && extra=${C_ARGS:-}
  (cd "$dir" && env $env timeout "$2" $run moevlm_jax.tools.bench $ARGS $extra --work-dir "/tmp/w$1" --out "$OUT/step_$name.json") 2>&1 \
      | grep -v "Autotuning cache miss" > "$OUT/side_$1.log"
  local rc=${PIPESTATUS[0]}
  echo "side $1 exit $rc (full log: side_$1.log)" >> "$OUT/side_$1.log"
  tail -6 "$OUT/side_$1.log" | tee -a "$OUT/log.txt"
}
if [ "${ORDER:-ab}" = ab ]; then side a "${A_S:-300}"; side b "$(left "${B_END:-585}")"; else side b "${A_S:-300}"; side a "$(left "${B_END:-585}")"; fi
[ -n "${C_ENV:-}${C_ARGS:-}${C_DIR:-}" ] && side c "$(left 590)"
echo "wall $(( $(date +%s) - T0 )) s"
