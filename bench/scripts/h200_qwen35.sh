#!/usr/bin/env bash
# Issue 23 on one H200 in one `run` call: the chunked gated delta rule on the GPU against its float32
# references (bench/scripts/h200_gdn_check.py; GDN_S=0 skips it), then the proxy35 step against HF
# transformers on the same batches at each MBS of $MBS (comma list; HF repeats each of ours), HF eager and,
# with HF_COMPILE=on, under torch.compile; PROFILE=1 adds a jax.profiler trace of our timed steps and its
# breakdown (GDN as its own row) to the JSON. Results under $OUT: gdn_check_h200.{json,txt},
# proxy35_peer_mbs${MBS}.json (the report), proxy35_ours.json / proxy35_hf.json (each side as it finished:
# kept when the call's time cuts the peer), log.txt.
#   run(command="bash bench/scripts/h200_qwen35.sh", carry=[".gpudeps"], timeout_s=...)
#   run(command="GDN_S=0 MBS=2,6 HF_COMPILE=on PROFILE=1 bash bench/scripts/h200_qwen35.sh", ...)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
if [ "${GDN_S:-150}" != 0 ]; then
  timeout ${GDN_S:-150} python3 bench/scripts/h200_gdn_check.py "$OUT/gdn_check_h200.json" 2>&1 | tee "$OUT/gdn_check_h200.txt" | tail -30
  echo "gdn rc=${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
fi
MBS=${MBS:-4}
PROF=""; [ "${PROFILE:-0}" = 1 ] && PROF="--profile /tmp/prof35"
timeout "$(left "${END:-470}")" python3 -m moevlm_jax.tools.bench --recipe h200 --model proxy35 --peer hf \
    --hf-compile "${HF_COMPILE:-off}" $PROF --data real --mbs "$MBS" --warmup 2 --steps 4 --work-dir /tmp/bp35 \
    --out "$OUT/proxy35_peer_mbs${MBS/,/_}.json" data.tokenizer=qwen3.5 compute.scan_layers=true 2>&1 \
    | grep -v "Autotuning cache miss" | tail -40 | tee -a "$OUT/log.txt"
pkill -f moevlm_jax.tools.bench_hf
for f in ours.json hf.json; do [ -f "/tmp/bp35/$f" ] && cp "/tmp/bp35/$f" "$OUT/proxy35_$f"; done
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
