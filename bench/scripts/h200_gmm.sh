#!/usr/bin/env bash
# Issue 6 on one H200 in one `run` call: the Pallas-Triton grouped-matmul kernels (parallelism/gmm_triton.py)
# against tokamax and the ceiling, one matmul at a time over tile configs (bench/scripts/probe_gmm.py), then
# the whole MoE layer (moevlm_jax.tools.bench_moe) with the fastest accurate configs, tokamax, capacity, hybrid and
# HF's grouped_mm in the same run (PROBE=0: the layer only; PROBE_SHAPES=gate_up_235b,down_235b SHAPES=235b-a22b
# for the 235B-A22B experts). STEP=1 adds the proxy step with the Triton experts
# (recipe h200; MBS=4, DATA=real by default, until STEP_END s);
# PROFILE=1 a profiled proxy step on mock data (capture none) with the trace breakdown's largest unscoped kernels;
# AB_KEYS=fwd:KxN,... the layer again (AB_SHAPES, triton, no HF) with those CONFIGS entries at the kernels' defaults,
# then as configured; LAYER_PROFILE=1 the MoE layer alone, profiled, ms per pass (bench/scripts/profile_moe_layer.py,
# PROFILE_SHAPES, PROFILE_ARGS).
# The probe's config file holds only the probed shapes' "KIND:KxN" entries (PROBE_DEFAULTS=1: the first shape's
# configs also become the kernels' defaults, i.e. for every unlisted shape, as in runs 6-8).
#   run(command="bash bench/scripts/h200_gmm.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/gmm.txt" 2>&1; cat "$OUT/gmm.txt"
[ "${PROBE:-1}" = 1 ] && (cd bench/scripts && timeout "${PROBE_S:-260}" python3 probe_gmm.py --budget "${PROBE_BUDGET:-200}" --shapes "${PROBE_SHAPES:-gate_up,down}" \
    --out "$OUT/gmm_probe.json" --best-out "$OUT/gmm_triton_configs.json" $([ "${PROBE_DEFAULTS:-0}" = 1 ] || echo --keyed-only) 2>&1 | grep -v "Autotuning cache miss" \
    | tail -60 | tee -a "$OUT/gmm.txt")
[ -f "$OUT/gmm_triton_configs.json" ] && export MOEVLM_GMM_TRITON_CONFIGS=$OUT/gmm_triton_configs.json
timeout "$(left "${MOE_END:-540}")" python3 -m moevlm_jax.tools.bench_moe --shapes "${SHAPES:-30b-a3b}" --tokens 16384 \
    --backends "${BACKENDS:-tokamax,triton,capacity,hybrid}" --capacity-factor "${CF:-1.25}" \
    $([ "${MOE_HF:-1}" = 1 ] || echo --no-hf) --iters 10 --out "$OUT/moe_layer.json" 2>&1 \
    | grep -v "Autotuning cache miss" | tee "$OUT/moe_layer.txt"
if [ "${STEP:-0}" = 1 ] && [ "$(left 590)" -ge 120 ]; then
  mkdir -p /tmp/bw
  timeout "$(left "${STEP_END:-590}")" python3 -m moevlm_jax.tools.bench --recipe h200 --peer none --data "${DATA:-real}" \
      --mbs "${MBS:-4}" --warmup 3 --steps 6 --work-dir /tmp/bw --out "$OUT/step_triton.json" compute.moe.backend=triton 2>&1 \
      | grep -v "Autotuning cache miss" | tail -30 | tee "$OUT/step_triton.txt"
fi
if [ "${PROFILE:-0}" = 1 ] && [ "$(left 590)" -ge 100 ]; then
  mkdir -p /tmp/bp
  timeout "$(left 590)" python3 -m moevlm_jax.tools.bench --recipe h200 --peer none --data mock --mbs "${MBS:-4}" --warmup 2 --steps 4 \
      --profile /tmp/prof --work-dir /tmp/bp --out "$OUT/step_profile.json" compute.capture=none ${EXTRA:-} 2>&1 \
      | grep -v "Autotuning cache miss" | tail -45 | tee "$OUT/step_profile.txt"
fi
if [ -n "${AB_KEYS:-}" ]; then  # the layer (no HF, no checks) with these CONFIGS keys at the kernels' defaults, then as configured
  python3 -c "import dataclasses, json, sys; from moevlm_jax.parallelism.gmm_triton import CONFIGS
print(json.dumps({k: dataclasses.asdict(CONFIGS[k.split(':')[0]]) for k in sys.argv[1].split(',')}))" "$AB_KEYS" > /tmp/ab_defaults.json
  for v in defaults configured; do
    cfg=$([ $v = defaults ] && echo /tmp/ab_defaults.json || echo "${MOEVLM_GMM_TRITON_CONFIGS:-}")
    MOEVLM_GMM_TRITON_CONFIGS=$cfg timeout "$(left "${AB_END:-590}")" python3 -m moevlm_jax.tools.bench_moe --shapes "${AB_SHAPES:-235b-a22b}" \
        --tokens 16384 --backends triton --no-hf --no-check --iters 10 --out "$OUT/moe_layer_ab_$v.json" 2>&1 \
        | grep -v "Autotuning cache miss" | sed "s/^/[$v] /" | tee -a "$OUT/moe_layer_ab.txt"
  done
fi
if [ "${LAYER_PROFILE:-0}" = 1 ] && [ "$(left 590)" -ge "${LAYER_PROFILE_MIN:-90}" ]; then
  timeout "$(left 590)" python3 bench/scripts/profile_moe_layer.py --shapes "${PROFILE_SHAPES:-235b-a22b}" \
      --out "$OUT/moe_profile.json" --tar "$OUT/moe_profile.tgz" ${PROFILE_ARGS:-} 2>&1 | grep -v "Autotuning cache miss" | tee "$OUT/moe_profile.txt"
fi
echo "wall $(( $(date +%s) - T0 )) s"
