#!/usr/bin/env bash
# The proxy step on long clips beside the image yardstick, on one GPU, in one invocation (bench/results/step.md,
# "Long clips"): recipe h200's model and settings on
#   1. the image proxy data (real JPEGs, 4 images a row, seq 4096) at IMG_MBS;
#   2. configs/data/proxy_video.yaml: one 64-frame 448 x 448 px clip a row (mp4 decoded by the pipeline; 25,088
#      patches, ~6.6k tokens of a row of 8192) at each micro batch of VIDEO_MBS, each its own process so that its
#      peak memory is its own; the vision attention's bound is raised to the clip's 32 frame pairs.
# Each run reports steady useful tokens/s, MFU and the peak device memory (bench.step's JSON and table); a micro
# batch that does not fit is reported as out of memory and the next one still runs.
#
# Usage (from anywhere; a normal `pip install -e ".[gpu,test]"`, see bench/README.md):
#   bash bench/scripts/video_step.sh                                   # H200: images MBS 11, clips MBS 1 and 2
#   IMG_MBS=4 VIDEO_MBS="1" bash bench/scripts/video_step.sh           # H100 80 GB
# Variables (defaults): RESULTS (runs/bench/video_step-<UTC time>), IMG_MBS (11), VIDEO_MBS ("1 2"), RECIPE (h200),
#   WARMUP (3), STEPS (8), EXTRA (overrides for every run), PYTHON (python).
# Results: $RESULTS/images_mbs<N>.json, $RESULTS/video_mbs<M>.json, $RESULTS/log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-runs/bench/video_step-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
PY=${PYTHON:-python}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}  # JAX preallocates 75% by default
export PYTHONUNBUFFERED=1
log() { tee -a "$RESULTS/log.txt"; }
git log -1 --format='commit %H (%cI)' 2>/dev/null | log
$PY -c "import jax; print('jax', jax.__version__, 'device', jax.devices()[0].device_kind)" 2>&1 | log
set -f  # overrides such as [full_iteration] are not globs
COMMON=(--recipe "${RECIPE:-h200}" --peer none --warmup "${WARMUP:-3}" --steps "${STEPS:-8}")
IMG=${IMG_MBS:-11}
echo "=== images: the proxy data, MBS $IMG" | log
$PY -m bench.step "${COMMON[@]}" --data real --mbs "$IMG" --out "$RESULTS/images_mbs$IMG.json" ${EXTRA:-} 2>&1 \
    | grep -vE "^[WI][0-9]{4}" | log
for m in ${VIDEO_MBS:-1 2}; do
  echo "=== clips: configs/data/proxy_video.yaml (64 frames of 448 px a row), MBS $m" | log
  $PY -m bench.step "${COMMON[@]}" --data configs/data/proxy_video.yaml --mbs "$m" --out "$RESULTS/video_mbs$m.json" \
      train.seq_len=8192 train.compile_bucket=25088 compute.attention_options.vision_max_segments=32 ${EXTRA:-} 2>&1 \
      | grep -vE "^[WI][0-9]{4}" | log
done
echo "results in $RESULTS" | log
