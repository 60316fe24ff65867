#!/usr/bin/env bash
# Issue 24, one H200, one `run` call: (1) recipe h200's time to the first step through the train CLI on this
# (new) machine, empty compilation cache and no VQA set on disk (FIRST=0 skips it); (2) the vision tower's blocks
# (bench/scripts/probe_step_parts.py --parts vision, 6 proxy blocks at MBS 10, forward + backward, command buffers
# off) once per XLA flag set of FLAGSETS (';'-separated; "-" = XLA's defaults), each a fresh process, with its
# kernel profile; PROBE=compile instead times the training step's trace / lower / XLA compile and the state
# initialiser's compile per flag set (bench/scripts/probe_compile.py, with $PROBE_ARGS, e.g. --no-kernels-ahead). FIRST_ENV="VAR=value ..." is the first-step
# run's environment (e.g. XLA_FLAGS=...). The recipe's own flags (its capture's, compute.xla_flags: since run 24
# --xla_gpu_enable_triton_gemm=false) replace the same flags of the environment in the first-step run and PROBE=compile. Results under $OUT: log.txt, first_step.log, first_step_metrics.jsonl,
# vision_<i>.json or compile_<i>.json.
#   run(command="bash bench/scripts/h200_flags.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/log.txt" 2>&1; cat "$OUT/log.txt"
if [ "${FIRST:-1}" = 1 ]; then
  ( unset JAX_COMPILATION_CACHE_DIR; rm -rf "$HOME/.cache/moevlm_jax/vqa" /tmp/fs
    env ${FIRST_ENV:-} timeout "$(left "${FIRST_END:-300}")" python3 -m moevlm_jax.train --recipe h200 --no-auto-fit --steps "${STEPS:-6}" \
      --run-dir /tmp/fs train.eval_every=0 train.eval_batches=0 train.show_answers=0 train.checkpointing=false \
      train.log_every=1 train.tensorboard=false train.compilation_cache_dir=null > "$OUT/first_step.log" 2>&1
    echo "first step run rc=$? at $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt" )
  cp /tmp/fs/metrics.jsonl "$OUT/first_step_metrics.jsonl" 2>/dev/null
  grep -E "compiled ahead|first step|-> compile|run .*steps|throughput" "$OUT/first_step.log" | cut -c1-300 | tail -6 | tee -a "$OUT/log.txt"
fi
i=0
set -f
IFS=';' read -ra FS <<< "${FLAGSETS:--}"
for f in "${FS[@]}"; do
  [ "$(left "${END:-590}")" -lt 45 ] && { echo "no time for flag set $i: $f" | tee -a "$OUT/log.txt"; break; }
  [ "$f" = "-" ] && f=""
  echo "=== flag set $i: XLA_FLAGS='$f'" | tee -a "$OUT/log.txt"
  if [ "${PROBE:-vision}" = compile ]; then
    XLA_FLAGS="$f" env -u JAX_COMPILATION_CACHE_DIR timeout "$(left "${END:-590}")" python3 bench/scripts/probe_compile.py \
        --init ${PROBE_ARGS:-} --out "$OUT/compile_$i.json" 2>&1 | grep -v "Autotuning cache miss" | tail -3 | tee -a "$OUT/log.txt"
  else
    XLA_FLAGS="$f" env -u JAX_COMPILATION_CACHE_DIR timeout "$(left "${END:-590}")" python3 bench/scripts/probe_step_parts.py --parts vision \
        --variants bias_split --profile bias_split --rounds 3 --out "$OUT/vision_$i.json" 2>&1 \
        | grep -v "Autotuning cache miss" | head -${LINES_OUT:-24} | tee -a "$OUT/log.txt"
  fi
  i=$((i + 1))
done
echo "wall $(( $(date +%s) - T0 )) s" | tee -a "$OUT/log.txt"
