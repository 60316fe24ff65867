"""Qwen3.5-MoE: vision tower + projector + hybrid Gated DeltaNet / gated-attention MoE decoder + LM
head (Flax NNX), as HF's ``Qwen3_5MoeForConditionalGeneration`` computes it.

The same interface as :class:`~moevlm_jax.model.qwen3_vl_moe.Qwen3VLMoe`:
``Qwen35Moe.hidden_states(batch)`` is the jit-able core on the per-row batch of ARCHITECTURE.md
(packed rows: ``segment_ids`` restart attention, the GDN state and its conv window at every packed
sample), ``forward(batch)`` adds the LM head, ``__call__`` is the eager Hugging Face style entry.
The vision tower is Qwen3-VL's (:class:`~moevlm_jax.model.vision.VisionModel`) without DeepStack:
HF's Qwen3.5 tower is the same code (patch embed, interpolated position table, 2D rotary, blocks,
merger). Parameter names mirror HF's module names (see :mod:`moevlm_jax.hf.qwen3_5_names`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.eager import hf_call, jit_forward  # noqa: F401 - jit_forward re-exported
from moevlm_jax.model.layers import Linear, dtype_of
from moevlm_jax.model.qwen3_5_config import Qwen35ModelConfig
from moevlm_jax.model.qwen3_5_decoder import Qwen35TextModel
from moevlm_jax.model.qwen3_vl_moe import place_visual_tokens, spread_placeholders, visual_token_mask
from moevlm_jax.model.vision import VisionModel
from moevlm_jax.parallelism.logical import constrain

__all__ = ["Qwen35Moe", "jit_forward"]


class Qwen35Moe(nnx.Module):
    """Qwen3_5MoeForConditionalGeneration in Flax NNX."""

    def __init__(self, config: Qwen35ModelConfig, compute: ComputeConfig | None = None, rngs: nnx.Rngs | None = None):
        compute = compute or ComputeConfig()
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.compute = compute
        self.visual = VisionModel(config.vision_config, compute, rngs)
        self.language_model = Qwen35TextModel(config.text_config, compute, rngs)
        t = config.text_config
        self.lm_head = None if config.tie_word_embeddings else Linear(
            (t.hidden_size,), (t.vocab_size,), ("embed",), ("vocab",), use_bias=False,
            param_dtype=dtype_of(compute.param_dtype), rngs=rngs, std=t.initializer_range)

    def lm_head_kernel(self) -> jax.Array:
        """The LM head as ``[H, vocab]`` (the embedding transposed when tied)."""
        if self.lm_head is None:
            return self.language_model.embed_tokens[...].T
        return self.lm_head.kernel[...]

    def hidden_states(self, batch: Mapping[str, Any]) -> tuple[jax.Array, dict]:
        """batch (ARCHITECTURE.md) -> final-normed hidden ``[B, S, H]`` (compute dtype) and aux:
        ``aux["router"]``: expert_counts ``[L, B, E]``, prob_sums ``[L, B, E]``, tokens ``[L, B]``,
        z_sums ``[L, B]`` over all L decoder layers (every layer is MoE; valid tokens only)."""
        input_ids = jnp.asarray(batch["input_ids"])
        segment_ids = jnp.asarray(batch["segment_ids"])
        positions = jnp.asarray(batch["positions"])
        pixels = batch.get("pixel_values")
        images = pixels is not None and pixels.shape[1] > 0
        is_image = visual_token_mask(input_ids, self.config)
        vocab = self.config.text_config.vocab_size
        x = self.language_model.embed(spread_placeholders(input_ids, is_image, vocab) if images else input_ids)
        if images:
            merged, _ = self.visual(jnp.asarray(pixels), jnp.asarray(batch["patch_rc"]), jnp.asarray(batch["patch_hw"]),
                                    jnp.asarray(batch["patch_segment_ids"]))
            unit = self.config.vision_config.spatial_merge_size**2
            x = jnp.where(is_image[..., None], place_visual_tokens(merged.astype(x.dtype), batch, is_image, unit), x)
            x = constrain(x, ("act_batch", "act_norm_seq", "act_embed"))
        hidden, router = self.language_model(x, positions, segment_ids)
        return hidden, {"router": router}

    def forward(self, batch: Mapping[str, Any]) -> tuple[jax.Array, dict]:
        """batch -> logits ``[B, S, vocab]`` (float32) and aux (see hidden_states)."""
        hidden, aux = self.hidden_states(batch)
        with jax.named_scope("lm_head"):
            kernel = self.lm_head_kernel().astype(hidden.dtype)
            logits = jnp.einsum("bsh,hv->bsv", hidden, kernel, preferred_element_type=jnp.float32)
        return constrain(logits, ("act_batch", "act_seq", "act_vocab")), aux

    def __call__(self, input_ids: Any, pixel_values: Any = None, image_grid_thw: Any = None,
                 attention_mask: Any = None, pixel_values_videos: Any = None, video_grid_thw: Any = None) -> jax.Array:
        """HF-style eager call: input_ids ``[B, S]``, pixel_values ``[N, patch_dim]``, image_grid_thw
        ``[n, 3]``, attention_mask ``[B, S]``, pixel_values_videos / video_grid_thw -> logits ``[B, S, vocab]``
        float32."""
        return hf_call(self, input_ids, pixel_values, image_grid_thw, attention_mask, pixel_values_videos,
                       video_grid_thw)
