#!/usr/bin/env bash
# The issue-8 step benchmark on one H200, in one `run` call (device tool), results under $OUT.
# Prepared 2026-11-30 without device time: NOT RUN YET. Needs .gpudeps (carry it): wheels from
# `../shared/tools/gpu-deps flax==0.12.8`, with tokamax pinned to 0.0.16 (0.0.17 fails to import
# on jax 0.11.2); .gpudeps/shim stands in for xprof (tokamax imports it for benchmarking only).
#   run(command="bash bench/scripts/h200_step.sh", carry=[".gpudeps"], timeout_s=600)
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpudeps/wheels/*.whl
export PYTHONPATH=/tmp/site:$PWD/.gpudeps/shim:$PWD
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$OUT/gpu.txt"
# ours at MBS 1,2,4 on real and mock data, HF transformers on the same batches and weights,
# the per-component breakdown, and a profiler trace of the timed steps
timeout 560 python3 -m moevlm_jax.bench --peer hf --data real,mock --breakdown --mbs 1,2,4 \
    --profile "$OUT/trace" --out "$OUT/step_h200.json" 2>&1 | tee "$OUT/step_h200.txt"
