"""Meshes, layouts, logical-axis rules, expert dispatch, grouped matmul, pipeline (recompute policies:
moevlm_jax.model.layers; command-buffer capture: moevlm_jax.training.capture).

Logical axis vocabulary (model code uses only these names):

parameters
  vocab, embed, q_heads, kv_heads, head_dim, mlp, exp, moe_mlp, layers,
  vis_embed, vis_heads, vis_head_dim, vis_mlp, vis_layers, patch_in, norm
activations
  act_batch, act_embed, act_heads, act_kv_heads, act_head_dim, act_mlp, act_vocab,
  act_norm_seq (sequence in the decoder's residual stream: embeddings, norms, residual adds;
      sequence parallelism splits it over the tensor axis, context parallelism over context),
  act_seq (sequence inside attention, the MLP and the LM head, where tensor parallelism splits
      heads / mlp / vocab: never over the tensor axis; context parallelism splits it, and the
      attention then runs over sequence shards, parallelism/context.py),
  act_exp, act_tokens (flattened batch*seq rows in the MoE block: the act_batch axes then the
      act_norm_seq axes, so the reshape moves nothing), act_patches (vision rows), act_vis_embed

A layout (configs/layouts/*.yaml) maps them to the mesh axes of parallelism.layout.MESH_AXES;
parallelism.validate checks a layout against a model config and batch shape before compiling.
"""

if __name__ != "moevlm_jax.parallelism":  # the folder is the package moevlm_jax.parallelism, not a top-level name
    raise ImportError("import moevlm_jax.parallelism (this folder is installed as moevlm_jax.parallelism, not as "
                      f"{__name__!r})")

PARAM_AXES: tuple[str, ...] = (
    "vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp", "exp", "moe_mlp", "layers",
    "vis_embed", "vis_heads", "vis_head_dim", "vis_mlp", "vis_layers", "patch_in", "norm",
)
ACTIVATION_AXES: tuple[str, ...] = (
    "act_batch", "act_embed", "act_heads", "act_kv_heads", "act_head_dim", "act_mlp", "act_vocab",
    "act_norm_seq", "act_seq", "act_exp", "act_tokens", "act_patches", "act_vis_embed",
)
LOGICAL_AXES: tuple[str, ...] = PARAM_AXES + ACTIVATION_AXES
