#!/usr/bin/env bash
# Issue 23 on one H200 in one `run` call (what the session's last ~8 device minutes allow): the chunked
# gated delta rule on the GPU against its float32 references (bench/scripts/h200_gdn_check.py), then the
# proxy35 step against HF transformers eager on the same batches at MBS 4 (HF's torch.compile and our
# MBS sweep do not fit in the call). Results under $OUT: gdn_check_h200.{json,txt}, proxy35_peer_mbs4.json, log.txt.
#   run(command="bash bench/scripts/h200_qwen35.sh", carry=[".gpudeps"], timeout_s=...)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
left() { local l=$(( ${1} - ($(date +%s) - T0) )); echo $(( l > 1 ? l : 1 )); }
timeout ${GDN_S:-150} python3 bench/scripts/h200_gdn_check.py "$OUT/gdn_check_h200.json" 2>&1 | tee "$OUT/gdn_check_h200.txt" | tail -30
echo "gdn rc=${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
timeout "$(left "${END:-470}")" python3 -m moevlm_jax.tools.bench --recipe h200 --model proxy35 --peer hf --hf-compile off \
    --data real --mbs ${MBS:-4} --warmup 2 --steps 4 --work-dir /tmp/bp35 --out "$OUT/proxy35_peer_mbs${MBS:-4}.json" \
    data.tokenizer=qwen3.5 compute.scan_layers=true 2>&1 | grep -v "Autotuning cache miss" | tail -40 | tee -a "$OUT/log.txt"
pkill -f moevlm_jax.tools.bench_hf
for f in ours.json hf.json; do [ -f "/tmp/bp35/$f" ] && cp "/tmp/bp35/$f" "$OUT/proxy35_$f"; done
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
