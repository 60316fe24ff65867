#!/usr/bin/env bash
# Issue 8's yardstick on one H200 in one `run` call, each side at its best MBS: ours alone on real data at
# OURS_MBS (recipe h200's 8; HF runs out of memory there), then the bench with the HF peer at PEER_MBS (4:
# HF's best, bench/README.md) on the same batches: ours, HF eager and HF per-block torch.compile at that MBS.
# OURS_LAST=1: the peer first, ours alone in the time left (when compiles are slow, e.g. unrolled layers);
# OURS=0: the peer only (ours alone timed earlier in the same call, e.g. by h200_step_sides.sh).
# PEER_EXTRA: overrides for the peer invocation only, e.g. 'compute.scan_layers=true' (ours at PEER_MBS
# then serves the same-batch loss check and compiles in ~25 s a shape instead of ~60; the ratio is ours
# alone at OURS_MBS, recipe as is, over HF's best). Budget: ours alone ~280 s (4 shapes unrolled), peer ~250 s.
# Results under $OUT: log.txt, ours_mbs<N>.json, peer_mbs<M>.json (or the sides' files if time ran out).
#   run(command="bash bench/scripts/h200_peer.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
set -f  # after gpu_env.sh (its wheel list is a glob): override values such as [full_iteration] are not globs
O=${OURS_MBS:-8} P=${PEER_MBS:-4}
mkdir -p /tmp/bo /tmp/bp
ours() {  # ours alone at MBS $O, for at most $1 s
  timeout "$1" python3 -m moevlm_jax.tools.bench --recipe h200 --peer none --data real --mbs "$O" --warmup 3 --steps 6 \
      --work-dir /tmp/bo --out "$OUT/ours_mbs$O.json" ${EXTRA:-} 2>&1 | grep -v "Autotuning cache miss" | tail -8 | tee -a "$OUT/log.txt"
}
[ "${OURS:-1}" = 0 ] || [ "${OURS_LAST:-0}" = 1 ] || ours "${OURS_S:-210}"
timeout "$(left "${END:-585}")" python3 -m moevlm_jax.tools.bench --recipe h200 --peer hf --data real --mbs "$P" --warmup 3 --steps 6 \
    --work-dir /tmp/bp --out "$OUT/peer_mbs$P.json" ${EXTRA:-} ${PEER_EXTRA:-} 2>&1 | grep -v "Autotuning cache miss" | tail -30 | tee -a "$OUT/log.txt"
pkill -f moevlm_jax.tools.bench_hf
if [ ! -f "$OUT/peer_mbs$P.json" ]; then  # stopped before the combined report: keep each side's file
  for f in ours.json hf.json; do [ -f "/tmp/bp/$f" ] && cp "/tmp/bp/$f" "$OUT/peer_mbs${P}_$f"; done
fi
[ "${OURS:-1}" != 0 ] && [ "${OURS_LAST:-0}" = 1 ] && ours "$(left "${END:-585}")"  # the peer first, ours alone in the time left
echo "wall $(( $(date +%s) - T0 )) s"
