#!/usr/bin/env bash
# The training step (python -m bench.step, ours only) for several sides in one invocation, one fresh process each,
# in order: an A/B of settings, kernels or whole trees on the same card and the same batches. Only differences
# measured in one invocation (better: in both orders) count; step times move by ~1-4% between machines of the
# same kind.
#
#   SIDES is a ';'-separated list of name|env|bench-args|dir, e.g.
#     SIDES="tree||;xla_triton_gemm||compute.xla_flags=[];tree2||" bash bench/scripts/step_ab.sh
#     SIDES="base|||../base;head||;base2|||../base;head2||" bash bench/scripts/step_ab.sh
#   env: VAR=value words for that process (e.g. XLA_FLAGS=--xla_gpu_enable_command_buffer=); bench-args: more
#   arguments or KEY=VALUE overrides; dir: another checkout to run the step from (its own library), e.g. made with
#     git worktree add ../base <commit>
#   (a checkout from before `bench/step.py` existed runs its `moevlm_jax.tools.bench` instead).
# The first process on a fresh machine compiles ~60 s longer than later ones (a cold cache in the driver / XLA's
# autotuner): put a warm-up side or the reference first, and compare compile times among the later sides only.
#
# Variables (defaults): SIDES (required), RESULTS (runs/bench/step_ab-<UTC time>), RECIPE (h200), MBS (11; 3-4 on
#   an 80 GB H100), WARMUP (3), STEPS (8), DATA (real), BENCH_ARGS (added to every side, e.g. "--devices 8" on a
#   machine of several GPUs: the recipe's layout over them, MBS per device), PYTHON (python).
# Results: $RESULTS/step_<name>.json, $RESULTS/side_<name>.log (whole, with its exit status), $RESULTS/log.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
RESULTS=${RESULTS:-runs/bench/step_ab-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$RESULTS"; RESULTS=$(cd "$RESULTS" && pwd)
PY=${PYTHON:-python}
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95} PYTHONUNBUFFERED=1
log() { tee -a "$RESULTS/log.txt"; }
set -f
ARGS="--recipe ${RECIPE:-h200} --peer none --data ${DATA:-real} --mbs ${MBS:-11} --warmup ${WARMUP:-3} --steps ${STEPS:-8} ${BENCH_ARGS:-}"
IFS=';' read -ra SS <<< "${SIDES:?SIDES=name|env|args|dir;... (see the header)}"
for s in "${SS[@]}"; do
  IFS='|' read -r name env extra dir <<< "$s"
  dir=${dir:-$ROOT}
  module=bench.step; [ -f "$dir/bench/step.py" ] || module=moevlm_jax.tools.bench
  echo "=== side $name: env '$env' args '$extra' tree $dir ($(git -C "$dir" rev-parse --short HEAD 2>/dev/null))" | log
  (cd "$dir" && env PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}" $env $PY -m $module $ARGS $extra \
      --out "$RESULTS/step_$name.json") > "$RESULTS/side_$name.log" 2>&1
  echo "side $name exit $?" >> "$RESULTS/side_$name.log"
  grep -v "Autotuning cache miss" "$RESULTS/side_$name.log" | tail -6 | log
done
echo "results in $RESULTS" | log
