"""The Qwen3-VL-MoE model: vision tower (``vision``), decoder (``decoder``, ``moe``, ``router``),
attention and rotary ops, layer stacks and remat policies (``layers``), losses (``loss``), the model
config (``config``) and how it computes (``compute``), and the top-level ``qwen3_vl_moe.Qwen3VLMoe``.
Model code names tensor axes logically; meshes and collectives live in ``parallelism/``."""

import flax as _flax

# Parameters carry logical axis names as sharding metadata; only parallelism/ turns them into
# mesh shardings. Without this, Flax tries to shard every annotated Variable eagerly at creation
# and fails when no mesh is active.
_flax.config.update("flax_always_shard_variable", False)
