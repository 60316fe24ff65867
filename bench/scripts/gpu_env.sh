# Sourced by the bench/scripts/h200_*.sh one-call runs (each sets T0=$(date +%s) first): defines `left END`
# (the seconds left until END seconds after T0, at least 1: a timeout for the next command), installs the
# carried wheels (.gpudeps/wheels, from ../shared/tools/gpu-deps) except flax, whose image copy matches the image's jax (the flax
# 0.12.8 wheel fails there on jax 0.11.2: jax.experimental.hijax has no HiPrimitive), and sets paths.
# Only the tokamax version pyproject.toml pins (gpu-deps may fetch a newer one beside it; two versions
# make pip refuse the whole install).
rm -rf /tmp/site
TOKAMAX_PIN=$(grep -o 'tokamax==[0-9.]*' pyproject.toml | head -1 | cut -d= -f3)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    $(ls .gpudeps/wheels/*.whl | grep -v '/flax-' | grep -v '/tokamax-') \
    $(ls .gpudeps/wheels/tokamax-"$TOKAMAX_PIN"-*.whl) 2>&1 | grep -v "already exists" || true
export PYTHONPATH=/tmp/site:$PWD/.gpudeps/shim:$PWD PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
# JAX's persistent compilation cache: the processes of one call (bench, its breakdown, sweep points)
# share compiled programs that are the same (e.g. the bench's MBS-2 step and the sweep's MBS-2 point)
export JAX_COMPILATION_CACHE_DIR=/tmp/jax_cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=2
python3 -c "import jax, flax, tokamax, torch, transformers; print('versions: jax', jax.__version__, 'flax', flax.__version__, 'tokamax', tokamax.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
left() { local l=$(( ${1} - ($(date +%s) - T0) )); echo $(( l > 1 ? l : 1 )); }
