"""Meshes, layouts, logical-axis rules, expert dispatch, grouped matmul, pipeline, remat, capture.

Logical axis vocabulary (model code uses only these names):

parameters
  vocab, embed, q_heads, kv_heads, head_dim, mlp, exp, moe_mlp, layers,
  vis_embed, vis_heads, vis_head_dim, vis_mlp, vis_layers, patch_in, norm
activations
  act_batch, act_seq, act_embed, act_heads, act_kv_heads, act_head_dim, act_mlp, act_vocab,
  act_exp, act_tokens (flattened batch*seq rows in the MoE block), act_patches (vision rows),
  act_vis_embed

A layout (configs/layouts/*.yaml) maps them to the mesh axes of parallelism.layout.MESH_AXES.
"""
