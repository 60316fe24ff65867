#!/usr/bin/env bash
# One H200, one `run` call: (1) the proxy35 step (Qwen3.5-MoE shapes, issue 23) at MBS 4, real data, profiled
# with XLA command buffers off (compute.capture=none: inside a command buffer a kernel carries the buffer's
# name, not its HLO op, and the trace breakdown cannot place it), the breakdown with its GDN rows in the JSON;
# (2) recipe h200 as committed through the train CLI on an empty compilation cache and no VQA set on disk:
# its time to the first step (issue 24). Results under $OUT: log.txt, proxy35_profiled_mbs4.json, h200.log,
# h200_metrics.jsonl.
#   run(command="bash bench/scripts/h200_breakdown35.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
unset JAX_COMPILATION_CACHE_DIR
rm -rf "$HOME/.cache/moevlm_jax/vqa"
timeout 120 python3 -m moevlm_jax.train --recipe h200 --no-auto-fit --steps 15 --run-dir /tmp/h200 \
    train.eval_every=0 train.eval_batches=0 train.show_answers=0 train.checkpointing=false train.log_every=1 \
    train.tensorboard=false train.compilation_cache_dir=null > "$OUT/h200.log" 2>&1
echo "h200 rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
cp /tmp/h200/metrics.jsonl "$OUT/h200_metrics.jsonl" 2>/dev/null
grep -E "compiled ahead|-> compile|run .*steps|throughput" "$OUT/h200.log" | cut -c1-300 | tail -5 | tee -a "$OUT/log.txt"
timeout "$(left "${END:-560}")" python3 -m moevlm_jax.tools.bench --recipe h200 --model proxy35 --data real --mbs 4 \
    --warmup 2 --steps 4 --profile /tmp/prof35 --out "$OUT/proxy35_profiled_mbs4.json" data.tokenizer=qwen3.5 \
    compute.scan_layers=true compute.capture=none 2>&1 | grep -v "Autotuning cache miss" | tail -45 | cut -c1-250 \
    | tee -a "$OUT/log.txt"
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
