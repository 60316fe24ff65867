#!/usr/bin/env bash
# Issue 24 on one H200 in one `run` call: JAX's Mosaic-GPU grouped matmuls (ragged_dot_mgpu, transposed_ragged_dot_mgpu)
# against parallelism/gmm_triton.py and the per-matmul ceiling (bench/scripts/probe_mgpu_gmm.py), both shape sets;
# DENSE=1 adds JAX's warp-specialised dense Hopper matmul against jnp.dot; KINDS=dw (say) times one kind. With
# LAYER_SIDES (as h200_layer_sides.sh's SIDES) the layer bench follows in the same call.
#   run(command="bash bench/scripts/h200_mgpu.sh", carry=[".gpudeps"], timeout_s=600)
set -uo pipefail
T0=$(date +%s)
source bench/scripts/gpu_env.sh > "$OUT/mgpu.txt" 2>&1; cat "$OUT/mgpu.txt"
python3 - <<'PY' 2>&1 | tee -a "$OUT/mgpu.txt"
import inspect
from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as r, transposed_ragged_dot_mgpu as t
print("ragged_dot", inspect.signature(r.ragged_dot)); print("transposed_ragged_dot", inspect.signature(t.transposed_ragged_dot))
PY
(cd bench/scripts && timeout "$(left "${PROBE_END:-560}")" python3 probe_mgpu_gmm.py --budget "${BUDGET:-450}" \
    --shapes "${SHAPES:-gate_up_235b,down_235b,gate_up,down}" --kinds "${KINDS:-fwd,dx,dw}" --first "${FIRST:-0}" $([ "${DENSE:-0}" = 1 ] && echo --dense) \
    --out "$OUT/mgpu_probe.json" 2>&1 | grep -v "Autotuning cache miss" | tail -150 | tee -a "$OUT/mgpu.txt")
echo "wall $(( $(date +%s) - T0 )) s"
if [ -n "${LAYER_SIDES:-}" ]; then
  mv "$OUT/mgpu.txt" "$OUT/mgpu_probe.txt"
  T0=$T0 SIDES="$LAYER_SIDES" END=${END:-590} bash bench/scripts/h200_layer_sides.sh
fi
