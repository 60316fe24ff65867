#!/usr/bin/env bash
# The yardstick: the proxy training step (recipe h200, real data) against HF transformers on one GPU, in one
# invocation, as bench/results/step.md reports it. Two processes one after the other, each with the whole GPU:
#   1. ours alone at OURS_MBS (recipe h200's MBS 11 on a 141 GB H200; use 4 on an 80 GB H100);
#   2. python -m bench.step --peer hf at PEER_MBS (4: HF's best that fits an H200; 2 on an H100): ours, HF eager
#      and HF with torch.compile per block on the same batches from the same weights, and the cross-entropy of
#      both sides step by step (exit 1 when step 1 disagrees).
# The headline ratio is ours alone (1) over the faster HF rate of (2), each side's steady rate: timed steps that
# compiled or ran a batch shape first are left out. PEER_STEPS defaults to 16 timed steps so that HF's compiled
# side keeps >= 10 steady steps (torch.compile recompiles on the first steps of each new shape); the script
# says so when it kept fewer.
#
# Usage (from anywhere; a normal `pip install -e ".[gpu,test]"`, see bench/README.md):
#   bash bench/scripts/yardstick.sh                          # H200: ours MBS 11, HF MBS 4
#   OURS_MBS=4 PEER_MBS=2 bash bench/scripts/yardstick.sh    # H100 80 GB
# Variables (defaults): RESULTS (runs/bench/yardstick-<UTC time>), OURS_MBS (11), PEER_MBS (4), RECIPE (h200),
#   WARMUP (3), STEPS (8: ours alone), PEER_STEPS (16), PEER=1 (0: ours alone only), OURS=1 (0: the peer only),
#   EXTRA (overrides for both, e.g. "compute.xla_flags=[]"), PEER_EXTRA ("compute.scan_layers=true": ours in the
#   peer run only serves the loss check and compiles faster scanned), PYTHON (python).
# Results: $RESULTS/ours_mbs<N>.json, $RESULTS/peer_mbs<M>.json, $RESULTS/log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
RESULTS=${RESULTS:-runs/bench/yardstick-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"
PY=${PYTHON:-python}
O=${OURS_MBS:-11} P=${PEER_MBS:-4}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}  # JAX preallocates 75% by default
export PYTHONUNBUFFERED=1
log() { tee -a "$RESULTS/log.txt"; }
git log -1 --format='commit %H (%cI)' 2>/dev/null | log
$PY -c "import jax, torch, transformers; print('jax', jax.__version__, 'torch', torch.__version__, 'transformers',
transformers.__version__, 'device', jax.devices()[0].device_kind)" 2>&1 | log
set -f  # overrides such as [full_iteration] are not globs
if [ "${OURS:-1}" != 0 ]; then
  echo "=== ours alone: recipe ${RECIPE:-h200}, MBS $O" | log
  $PY -m bench.step --recipe "${RECIPE:-h200}" --peer none --data real --mbs "$O" --warmup "${WARMUP:-3}" \
      --steps "${STEPS:-8}" --out "$RESULTS/ours_mbs$O.json" ${EXTRA:-} 2>&1 | log
fi
if [ "${PEER:-1}" != 0 ]; then
  echo "=== the HF peer: MBS $P, ${PEER_STEPS:-16} timed steps" | log
  $PY -m bench.step --recipe "${RECIPE:-h200}" --peer hf --data real --mbs "$P" --warmup "${WARMUP:-3}" \
      --steps "${PEER_STEPS:-16}" --out "$RESULTS/peer_mbs$P.json" ${EXTRA:-} ${PEER_EXTRA-compute.scan_layers=true} \
      2>&1 | log
  $PY - "$RESULTS/peer_mbs$P.json" <<'PY' 2>&1 | log
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except OSError as e:
    sys.exit(f"no peer report: {e}")
for r in report.get("peer", {}).get("runs", []):
    n = (r.get("steady") or {}).get("steps")
    if r.get("mode") == "compile":
        ok = n is not None and n >= 10
        print(f"{r['name']} {r['side']}: {n} steady steps" + ("" if ok else " (fewer than 10: raise PEER_STEPS)"))
PY
fi
echo "results in $RESULTS" | log
