#!/usr/bin/env bash
# Issue 24's yardstick (recipe h200, real data, MBS 10) for several variants of the working tree in one call,
# one fresh process each, in order: SIDES is a ';'-separated list of name|env|bench-args, e.g.
#   SIDES="tree||;no_triton_gemm|XLA_FLAGS=--xla_gpu_enable_triton_gemm=false|;fp32_logits||compute.logits_fp32=true"
# (XLA_FLAGS merge with the recipe's own, which replace the same flags: since run 24 the Triton GEMM side is
# "triton_gemm||compute.xla_flags=[]"). The first process on a new machine compiles ~60 s longer
# than the later ones (bench/step_h200.md run 23): put the reference first and compare compile times among the
# later sides only. Each side gets FIRST_S (first) or SIDE_S seconds, and none starts with under 120 s left of END.
# Results under $OUT: log.txt, side_<name>.log (whole, with its exit status), step_<name>.json.
#   run(command="SIDES='...' bash bench/scripts/h200_step_sides.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=${T0:-$(date +%s)}  # a calling script may pass its own start
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
set -f
ARGS="--recipe h200 --peer none --data real --mbs ${MBS:-10} --warmup 3 --steps ${STEPS:-8}"
n=0
IFS=';' read -ra SS <<< "${SIDES:?SIDES=name|env|args;...}"
for s in "${SS[@]}"; do
  IFS='|' read -r name env extra <<< "$s"
  limit=$([ $n = 0 ] && echo "${FIRST_S:-300}" || echo "${SIDE_S:-200}")
  [ "$(left "${END:-590}")" -lt 120 ] && { echo "no time for side $name" | tee -a "$OUT/log.txt"; break; }
  [ "$limit" -gt "$(left "${END:-590}")" ] && limit=$(left "${END:-590}")
  echo "=== side $name: env '$env' args '$extra' (limit $limit s, at $(( $(date +%s) - T0 )) s)" | tee -a "$OUT/log.txt"
  mkdir -p "/tmp/w_$name"
  env $env timeout "$limit" python3 -m moevlm_jax.tools.bench $ARGS $extra --work-dir "/tmp/w_$name" \
      --out "$OUT/step_$name.json" 2>&1 | grep -v "Autotuning cache miss" > "$OUT/side_$name.log"
  rc=${PIPESTATUS[0]}
  echo "side $name exit $rc" >> "$OUT/side_$name.log"
  tail -6 "$OUT/side_$name.log" | tee -a "$OUT/log.txt"
  n=$((n + 1))
done
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
