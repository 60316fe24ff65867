"""The Qwen3-VL vision tower: patch embedding, interpolated learned position embedding, 2D-rotary
ViT blocks with attention restricted to each image (frame), the patch merger (projector) and the
DeepStack mergers.

Works on per-row patch batches ``[B, P, patch_dim]`` (patches of a row's images, 2x2 merge blocks
consecutive, zero rows = padding). Position-embedding interpolation and rotary angles are computed
in-graph from integer ``patch_rc`` / ``patch_hw``, so one compiled step serves any image sizes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moevlm_jax.model.attention import dot_product_attention
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import VisionConfig
from moevlm_jax.model.layers import (
    LayerNorm,
    Linear,
    activation,
    dtype_of,
    param,
    run_stack,
    stack_modules,
)
from moevlm_jax.model.rotary import apply_rotary, vision_rope_cos_sin
from moevlm_jax.parallelism.logical import constrain

ACT = ("act_batch", None, "act_vis_embed")


def interpolation_taps(patch_rc: jax.Array, patch_hw: jax.Array, side: int) -> tuple[jax.Array, jax.Array]:
    """Bilinear (align_corners=True) taps into a ``side x side`` table for each patch:
    patch_rc, patch_hw ``[..., 2]`` int -> indices ``[..., 4]`` int32, weights ``[..., 4]`` float32."""

    def axis(index, size):
        src = index.astype(jnp.float32) * (side - 1) / jnp.maximum(size - 1, 1).astype(jnp.float32)
        floor = jnp.floor(src)
        taps = jnp.stack([floor, floor + 1], axis=-1)
        weights = jnp.maximum(1.0 - jnp.abs(src[..., None] - taps), 0.0)
        return jnp.clip(taps, 0, side - 1).astype(jnp.int32), weights

    ht, hw_ = axis(patch_rc[..., 0], patch_hw[..., 0])
    wt, ww = axis(patch_rc[..., 1], patch_hw[..., 1])
    idx = (ht[..., :, None] * side + wt[..., None, :]).reshape(*ht.shape[:-1], 4)
    wts = (hw_[..., :, None] * ww[..., None, :]).reshape(*ht.shape[:-1], 4)
    return idx, wts


class VisionAttention(nnx.Module):
    """Bidirectional multi-head attention with 2D rotary, within one patch segment."""

    def __init__(self, cfg: VisionConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd, c, n, d = dtype_of(compute.param_dtype), cfg.hidden_size, cfg.num_heads, cfg.head_dim
        self.impl = compute.attention
        self.attn_kw = tuple(compute.attention_options.for_tower("vision").items())  # cuDNN bound, head-dim pad
        q = compute.fp8.at("vision")
        self.qkv = Linear((c,), (3, n, d), ("vis_embed",), (None, "vis_heads", "vis_head_dim"),
                          use_bias=True, param_dtype=pd, rngs=rngs, std=cfg.initializer_range, fp8=q)
        self.proj = Linear((n, d), (c,), ("vis_heads", "vis_head_dim"), ("vis_embed",),
                           use_bias=True, param_dtype=pd, rngs=rngs, std=cfg.initializer_range, fp8=q)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x ``[B, P, C]``, cos/sin ``[B, P, D]``, segment_ids ``[B, P]`` -> ``[B, P, C]``."""
        qkv = checkpoint_name(self.qkv(x), "qkv_proj")  # [B, P, 3, N, D]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = dot_product_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                    causal=False, impl=self.impl, **dict(self.attn_kw))
        out = checkpoint_name(out, "core_attn")
        return checkpoint_name(self.proj(out), "attn_out")


class VisionMLP(nnx.Module):
    """fc1 -> activation -> fc2, with biases."""

    def __init__(self, cfg: VisionConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd, q = dtype_of(compute.param_dtype), compute.fp8.at("vision")
        self.act = cfg.hidden_act
        self.linear_fc1 = Linear((cfg.hidden_size,), (cfg.intermediate_size,), ("vis_embed",), ("vis_mlp",),
                                 use_bias=True, param_dtype=pd, rngs=rngs, std=cfg.initializer_range, fp8=q)
        self.linear_fc2 = Linear((cfg.intermediate_size,), (cfg.hidden_size,), ("vis_mlp",), ("vis_embed",),
                                 use_bias=True, param_dtype=pd, rngs=rngs, std=cfg.initializer_range, fp8=q)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[..., C]`` -> ``[..., C]``."""
        # fc1's output is what GELU's backward needs: saved, the activation is recomputed (elementwise)
        h = activation(self.act)(checkpoint_name(self.linear_fc1(x), "mlp_hidden"))
        return checkpoint_name(self.linear_fc2(h), "mlp")


class VisionBlock(nnx.Module):
    """Pre-norm ViT block: x + attn(norm1(x)); x + mlp(norm2(x))."""

    def __init__(self, cfg: VisionConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd = dtype_of(compute.param_dtype)
        self.norm1 = LayerNorm(cfg.hidden_size, 1e-6, param_dtype=pd)
        self.norm2 = LayerNorm(cfg.hidden_size, 1e-6, param_dtype=pd)
        self.attn = VisionAttention(cfg, compute, rngs)
        self.mlp = VisionMLP(cfg, compute, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x ``[B, P, C]`` -> ``[B, P, C]``."""
        x = x + self.attn(checkpoint_name(self.norm1(x), "layernorm"), cos, sin, segment_ids)
        x = x + self.mlp(checkpoint_name(self.norm2(x), "layernorm"))
        return constrain(x, ACT)


class PatchMerger(nnx.Module):
    """LayerNorm -> concat each 2x2 block -> fc1 -> GELU (exact) -> fc2. The DeepStack mergers
    normalise after the concat (``postshuffle``), the main merger before it."""

    def __init__(self, cfg: VisionConfig, compute: ComputeConfig, rngs: nnx.Rngs, postshuffle: bool):
        pd = dtype_of(compute.param_dtype)
        self.unit = cfg.spatial_merge_size**2
        big = cfg.hidden_size * self.unit
        self.postshuffle = postshuffle
        self.norm = LayerNorm(big if postshuffle else cfg.hidden_size, 1e-6, param_dtype=pd)
        q = compute.fp8.at("vision")
        self.linear_fc1 = Linear((big,), (big,), ("vis_embed",), ("vis_mlp",), use_bias=True, param_dtype=pd,
                                 rngs=rngs, std=cfg.initializer_range, fp8=q)
        self.linear_fc2 = Linear((big,), (cfg.out_hidden_size,), ("vis_mlp",), ("embed",), use_bias=True,
                                 param_dtype=pd, rngs=rngs, std=cfg.initializer_range, fp8=q)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[B, P, C]`` (P a multiple of merge**2) -> ``[B, P / merge**2, out_hidden]``."""
        b, p, c = x.shape
        if not self.postshuffle:
            x = self.norm(x)
        x = x.reshape(b, p // self.unit, c * self.unit)
        if self.postshuffle:
            x = self.norm(x)
        x = jax.nn.gelu(self.linear_fc1(x), approximate=False)
        return self.linear_fc2(x)


class VisionModel(nnx.Module):
    """The whole vision tower; returns merged visual tokens and DeepStack features."""

    def __init__(self, cfg: VisionConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd = dtype_of(compute.param_dtype)
        self.cfg = cfg
        self.compute = compute
        self.side = math.isqrt(cfg.num_position_embeddings)
        self.patch_embed = Linear((cfg.patch_dim,), (cfg.hidden_size,), ("patch_in",), ("vis_embed",),
                                  use_bias=True, param_dtype=pd, rngs=rngs, std=cfg.initializer_range)
        self.pos_embed = param(rngs, "normal", (cfg.num_position_embeddings, cfg.hidden_size), (None, "vis_embed"),
                               pd, cfg.initializer_range)
        self.blocks = stack_modules(lambda r: VisionBlock(cfg, compute, r), cfg.depth, rngs, "vis_layers")
        self.merger = PatchMerger(cfg, compute, rngs, postshuffle=False)
        n_ds = len(cfg.deepstack_visual_indexes)
        self.deepstack_merger_list = (
            stack_modules(lambda r: PatchMerger(cfg, compute, r, postshuffle=True), n_ds, rngs, None) if n_ds else None
        )

    def __call__(self, pixel_values: jax.Array, patch_rc: jax.Array, patch_hw: jax.Array,
                 patch_segment_ids: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """pixel_values ``[B, P, patch_dim]``, patch_rc/patch_hw ``[B, P, 2]``, patch_segment_ids
        ``[B, P]`` -> merged tokens ``[B, P/4, H]`` and DeepStack features ``[n_ds, B, P/4, H]``
        (in block order, i.e. the order decoder layers 0, 1, ... receive them), or None."""
        with jax.named_scope("vision_encoder"):  # profiler trace labels (bench.step --profile)
            x, feats = self.encode(pixel_values, patch_rc, patch_hw, patch_segment_ids)
        with jax.named_scope("projector"):
            return self.project(x, feats)

    def encode(self, pixel_values: jax.Array, patch_rc: jax.Array, patch_hw: jax.Array,
               patch_segment_ids: jax.Array) -> tuple[jax.Array, list[jax.Array]]:
        """Patch embedding, position embedding and the ViT blocks -> last block's output and the
        DeepStack blocks' outputs (in block order)."""
        cfg, dt = self.cfg, dtype_of(self.compute.dtype)
        x = self.patch_embed(pixel_values.astype(dt))
        idx, wts = interpolation_taps(patch_rc, patch_hw, self.side)
        table = constrain(self.pos_embed[...].astype(jnp.float32), (None, None))  # gathered before the lookup
        pos = jnp.sum(table[idx] * wts[..., None], axis=-2)
        x = constrain(x + pos.astype(dt), ACT)
        cos, sin = vision_rope_cos_sin(patch_rc, cfg.head_dim, cfg.rope_theta)

        def body(block, h, _, side):
            return block(h, *side), None

        side = (cos, sin, patch_segment_ids)  # batch-dependent inputs of every block
        ds_blocks = sorted(cfg.deepstack_visual_indexes)
        feats, start = [], 0
        for i in ds_blocks:  # split the scan at each DeepStack block: a constant number of scans
            x, _ = run_stack(self.blocks, body, x, None, self.compute, start, i + 1, side=side)
            feats.append(x)
            start = i + 1
        x, _ = run_stack(self.blocks, body, x, None, self.compute, start, cfg.depth, side=side)
        return x, feats

    def project(self, x: jax.Array, feats: list[jax.Array]) -> tuple[jax.Array, jax.Array | None]:
        """The patch merger (projector) and the DeepStack mergers."""
        cfg = self.cfg
        ds_blocks = sorted(cfg.deepstack_visual_indexes)
        merged = self.merger(x)
        if not feats:
            return merged, None
        order = [list(cfg.deepstack_visual_indexes).index(i) for i in ds_blocks]
        graphdef, state = nnx.split(self.deepstack_merger_list)
        if order != sorted(order):
            state = jax.tree.map(lambda a: a[jnp.asarray(order)], state)
        deepstack = jax.vmap(lambda st, f: nnx.merge(graphdef, st)(f))(state, jnp.stack(feats))
        return merged, deepstack
