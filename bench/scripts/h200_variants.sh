#!/usr/bin/env bash
# Issue 8 on one H200 in one `run` call: attention kernel variants (bench/scripts/probe_attention.py, CASES)
# then the profiled proxy step (recipe h200, mock data, MBS 8, capture none: every kernel visible) once
# per variant of VARIANTS (';'-separated override lists; "-" = the recipe as is; a word mbs=N sets that
# variant's micro-batch size, else MBS or 8), each with its trace
# breakdown; MEMSETS=1 also dumps the memset / copy events of the first variant's trace
# (bench/scripts/trace_events.py); HLO=1 keeps the first variant's compiled step HLO (gzip). Results under $OUT: log.txt, attn.json, step_<i>.json, events.json.
#   run(command="VARIANTS='-;compute.scan_layers=false' bash bench/scripts/h200_variants.sh", carry=[".gpudeps"])
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
set -f  # after gpu_env.sh (its wheel list is a glob): override values such as [core_attn] are not globs
if [ -n "${CASES:-}" ]; then
  timeout "${PROBE_S:-200}" python3 bench/scripts/probe_attention.py --cases "$CASES" --out "$OUT/attn.json" 2>&1 \
      | grep -v "Autotuning cache miss" | tee -a "$OUT/log.txt"
fi
i=0
IFS=';' read -ra VS <<< "${VARIANTS:--}"
for v in "${VS[@]}"; do
  [ "$(left "${END:-590}")" -lt 60 ] && { echo "no time for variant $i: $v" | tee -a "$OUT/log.txt"; break; }
  ov="" mb=${MBS:-8}
  for t in $v; do case $t in mbs=*) mb=${t#mbs=} ;; -) ;; *) ov="$ov $t" ;; esac; done
  echo "=== variant $i: ${v}" | tee -a "$OUT/log.txt"
  rm -rf /tmp/prof$i /tmp/bw$i; mkdir -p /tmp/bw$i
  timeout "$(left "${END:-590}")" python3 -m moevlm_jax.tools.bench --recipe h200 --peer none --data mock --mbs "$mb" \
      --warmup 2 --steps 4 --profile /tmp/prof$i --work-dir /tmp/bw$i --out "$OUT/step_$i.json" compute.capture=none $ov 2>&1 \
      | grep -v "Autotuning cache miss" | grep -v "^  " | tail -22 | tee -a "$OUT/log.txt"
  if [ "$i" = 0 ] && [ "${HLO:-0}" = 1 ]; then  # the profiled step's HLO, to read a trace's fusions offline
    for h in $(set +f; ls /tmp/prof0/*/train_step_*.hlo.txt 2>/dev/null); do gzip -c "$h" > "$OUT/step_0_$(basename "$h").gz"; done
  fi
  if [ "$i" = 0 ] && [ "${MEMSETS:-0}" = 1 ]; then
    python3 bench/scripts/trace_events.py /tmp/prof0 --match 'Memset|Memcpy' --steps 4 --out "$OUT/events.json" 2>&1 \
        | head -25 | tee -a "$OUT/log.txt"
  fi
  i=$((i + 1))
done
echo "wall $(( $(date +%s) - T0 )) s"
