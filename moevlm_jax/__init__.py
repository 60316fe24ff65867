"""moevlm_jax: Mixture-of-Experts vision-language models (Qwen3-VL-MoE) in JAX / Flax NNX."""

import flax as _flax

# Parameters carry logical axis names as sharding metadata; only parallelism/ turns them into
# mesh shardings. Without this, Flax tries to shard every annotated Variable eagerly at creation
# and fails when no mesh is active.
_flax.config.update("flax_always_shard_variable", False)
