"""The models: Qwen3-VL-MoE (vision tower ``vision``, decoder ``decoder``, ``moe``, ``router``, the
top-level ``qwen3_vl_moe.Qwen3VLMoe``, its config ``config``) and Qwen3.5-MoE (``qwen3_5_config``,
``qwen3_5_decoder``, ``qwen3_5_gdn`` over ``gated_deltanet``, the top-level ``qwen3_5_moe.Qwen35Moe``);
the family of a config (config / model class, HF name table, FLOPs shape) is ``registry``'s; shared:
attention and rotary ops, layer stacks and remat policies (``layers``), losses (``loss``) and how a
model computes (``compute``). Model code names tensor axes logically; meshes and collectives live in
``parallelism/``."""

import flax as _flax

# Parameters carry logical axis names as sharding metadata; only parallelism/ turns them into
# mesh shardings. Without this, Flax tries to shard every annotated Variable eagerly at creation
# and fails when no mesh is active.
_flax.config.update("flax_always_shard_variable", False)
