"""Qwen3-VL-MoE: vision tower + projector + DeepStack + MoE decoder + LM head (Flax NNX).

``Qwen3VLMoe.hidden_states(batch)`` is the jit-able core on the per-row batch of ARCHITECTURE.md;
``Qwen3VLMoe.__call__`` is the eager Hugging Face style entry (HF input conventions, returns
logits); ``Qwen3VLMoe.cached_hidden_states`` the generation forward with a KV cache
(``moevlm_jax.inference``). Parameter names mirror HF's module names (see ``moevlm_jax.hf``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import ModelConfig
from moevlm_jax.model.decoder import TextModel
from moevlm_jax.model.eager import hf_call, jit_forward  # noqa: F401 - jit_forward re-exported
from moevlm_jax.model.layers import Linear, dtype_of
from moevlm_jax.model.vision import VisionModel
from moevlm_jax.parallelism.logical import constrain


def visual_token_mask(input_ids: jax.Array, config: Any) -> jax.Array:
    """Where the vision tower's merged tokens go: the image and the video placeholders (``<|image_pad|>``,
    ``<|video_pad|>``). A row's images and videos share one patch sequence in prompt order (``data.batch``), so
    the k-th merged token fills the k-th of these positions, as HF's two masked scatters do; DeepStack too."""
    return (input_ids == config.image_token_id) | (input_ids == config.video_token_id)


def spread_placeholders(input_ids: jax.Array, is_image: jax.Array, vocab_size: int) -> jax.Array:
    """The ids the embedding lookup reads: each image placeholder position reads its own table row
    (its flat position modulo ``vocab_size``) instead of the image token's.

    Placeholder embeddings are replaced by the vision features, so their gradient is exactly zero
    whichever row they read; but with one shared row, the embedding gradient's scatter-add (atomic
    adds on the GPU) piles thousands of positions a row onto that one row (the proxy data: most of
    the tokens). Spread, the same zeros land on distinct rows. The forward output is unchanged."""
    flat = jnp.arange(input_ids.size, dtype=jnp.int32).reshape(input_ids.shape) % vocab_size
    return jnp.where(is_image, flat.astype(input_ids.dtype), input_ids)


def scatter_visual_tokens(tokens: jax.Array, is_image: jax.Array, token_valid: jax.Array) -> jax.Array:
    """Place the k-th valid visual token of each row on the row's k-th image token:
    tokens ``[..., B, V, H]``, is_image ``[B, S]``, token_valid ``[B, V]`` -> ``[..., B, S, H]``
    (zero on non-image rows, and on image rows past the row's valid tokens). Static shapes.

    A scatter with unique indices (every token has its own target; tokens with none target distinct
    out-of-range rows, dropped), so the backward is a gather: the earlier gather formulation read
    one source row for every sequence position and its backward was a scatter-add with repeated
    indices, which XLA:GPU runs with bf16 atomics (a 2.4 ms kernel per H200 step, bench/results/step.md)."""
    b, v = token_valid.shape
    s = is_image.shape[1]
    rows = jnp.arange(b)[:, None]
    img_rank = jnp.where(is_image, jnp.cumsum(is_image, axis=1) - 1, v)  # ranks >= v: dropped
    pos_of_rank = jnp.broadcast_to(s + jnp.arange(v, dtype=jnp.int32), (b, v)).at[rows, img_rank].set(
        jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)), mode="drop")
    tok_rank = jnp.clip(jnp.cumsum(token_valid, axis=1) - 1, 0, v - 1)
    pos = jnp.where(token_valid, jnp.take_along_axis(pos_of_rank, tok_rank, axis=1), s + v + jnp.arange(v))
    out = jnp.zeros((*tokens.shape[:-3], b, s, tokens.shape[-1]), tokens.dtype)
    return out.at[..., rows, pos, :].set(tokens, mode="drop", unique_indices=True)


def scatter_to_dest(tokens: jax.Array, dest: jax.Array, token_valid: jax.Array, seq_len: int) -> jax.Array:
    """Place each valid visual token where its ``dest`` says: tokens ``[..., B, V, H]``, dest / token_valid
    ``[B, V]`` -> ``[..., B, S, H]``. ``dest[r, v] = (text row - r) * S + position``: the token of vision row ``r``
    goes to a decoder row of its own row group (``data.packing`` balances images over the vision rows of a group,
    so a row's images need not sit in its own vision row). Zero elsewhere. As :func:`scatter_visual_tokens`, a
    scatter with unique indices (invalid tokens target distinct rows past the end, dropped), whose backward is a
    gather."""
    b, v = dest.shape
    flat = jnp.arange(b, dtype=jnp.int32)[:, None] * seq_len + dest.astype(jnp.int32)
    flat = jnp.where(token_valid, flat, b * seq_len + jnp.arange(b * v, dtype=jnp.int32).reshape(b, v))
    lead, h = tokens.shape[:-3], tokens.shape[-1]
    out = jnp.zeros((*lead, b * seq_len, h), tokens.dtype)
    out = out.at[..., flat.reshape(-1), :].set(tokens.reshape(*lead, b * v, h), mode="drop", unique_indices=True)
    return out.reshape(*lead, b, seq_len, h)


def place_visual_tokens(tokens: jax.Array, batch: Mapping[str, Any], is_image: jax.Array, unit: int) -> jax.Array:
    """The vision tower's merged tokens ``[..., B, V, H]`` on the decoder's image-token positions ``[..., B, S, H]``:
    by the batch's ``patch_dest`` (one entry per patch, every ``unit``-th read) when the data balanced its vision
    rows, else the k-th valid token of each row on the row's k-th image token."""
    token_valid = jnp.asarray(batch["patch_segment_ids"])[:, ::unit] > 0
    if "patch_dest" in batch:
        return scatter_to_dest(tokens, jnp.asarray(batch["patch_dest"])[:, ::unit], token_valid, is_image.shape[1])
    return scatter_visual_tokens(tokens, is_image, token_valid)


class Qwen3VLMoe(nnx.Module):
    """Qwen3VLMoeForConditionalGeneration in Flax NNX."""

    def __init__(self, config: ModelConfig, compute: ComputeConfig | None = None, rngs: nnx.Rngs | None = None):
        compute = compute or ComputeConfig()
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = config
        self.compute = compute
        self.visual = VisionModel(config.vision_config, compute, rngs)
        self.language_model = TextModel(config.text_config, compute, rngs)
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
        z_sums ``[L, B]`` over the L MoE layers (valid tokens only), or None without MoE layers."""
        x, deepstack = self.input_embeddings(batch)
        hidden, router = self.language_model(x, jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"]),
                                             deepstack)
        return hidden, {"router": router}

    def input_embeddings(self, batch: Mapping[str, Any]) -> tuple[jax.Array, jax.Array | None]:
        """The decoder's input ``[B, S, H]`` (token embeddings, the vision tower's merged tokens on the
        image-token rows) and the DeepStack features ``[n_ds, B, S, H]`` scattered likewise (None
        without images or DeepStack)."""
        input_ids = jnp.asarray(batch["input_ids"])
        deepstack = None
        pixels = batch.get("pixel_values")
        images = pixels is not None and pixels.shape[1] > 0
        is_image = visual_token_mask(input_ids, self.config)
        vocab = self.config.text_config.vocab_size
        x = self.language_model.embed(spread_placeholders(input_ids, is_image, vocab) if images else input_ids)
        if images:
            merged, ds = self.visual(jnp.asarray(pixels), jnp.asarray(batch["patch_rc"]),
                                     jnp.asarray(batch["patch_hw"]),
                                     jnp.asarray(batch["patch_segment_ids"]))
            unit = self.config.vision_config.spatial_merge_size**2
            x = jnp.where(is_image[..., None], place_visual_tokens(merged.astype(x.dtype), batch, is_image, unit), x)
            x = constrain(x, ("act_batch", "act_norm_seq", "act_embed"))
            if ds is not None:
                deepstack = place_visual_tokens(ds.astype(x.dtype), batch, is_image, unit)
        return x, deepstack

    def forward(self, batch: Mapping[str, Any]) -> tuple[jax.Array, dict]:
        """batch -> logits ``[B, S, vocab]`` (float32) and aux (see hidden_states)."""
        hidden, aux = self.hidden_states(batch)
        return self.logits(hidden), aux

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden ``[B, S, H]`` -> logits ``[B, S, vocab]`` float32 (the LM head)."""
        with jax.named_scope("lm_head"):
            kernel = self.lm_head_kernel().astype(hidden.dtype)
            logits = jnp.einsum("bsh,hv->bsv", hidden, kernel, preferred_element_type=jnp.float32)
        return constrain(logits, ("act_batch", "act_seq", "act_vocab"))

    def cached_hidden_states(self, batch: Mapping[str, Any], cache: list[tuple[jax.Array, jax.Array]],
                             kv_segment_ids: jax.Array, start: jax.Array, *,
                             prefill: bool = False) -> tuple[jax.Array, list]:
        """Generation (``moevlm_jax.inference``): the forward of new tokens against a KV cache.
        batch: ``input_ids``/``segment_ids`` ``[B, S]``, ``positions`` ``[3, B, S]`` and for a prefill
        with images the ``pixel_values``/``patch_*`` keys (the vision tower runs, its features and
        DeepStack placed as in training); the tokens sit at cache slots ``start .. start + S - 1``;
        cache per decoder stack ``(k, v)`` ``[n, B, T, K, D]`` (``language_model.cache_shapes``),
        kv_segment_ids ``[B, T]`` -> final-normed hidden ``[B, S, H]`` and the updated cache.
        ``prefill``: the cache is empty and start 0 (the prompt attends among itself, training's op)."""
        x, deepstack = self.input_embeddings(batch)
        return self.language_model.cached(x, jnp.asarray(batch["positions"]), jnp.asarray(batch["segment_ids"]),
                                          cache, kv_segment_ids, start, deepstack, prefill=prefill)

    def __call__(self, input_ids: Any, pixel_values: Any = None, image_grid_thw: Any = None,
                 attention_mask: Any = None, pixel_values_videos: Any = None, video_grid_thw: Any = None) -> jax.Array:
        """HF-style eager call: input_ids ``[B, S]``, pixel_values ``[N, patch_dim]``, image_grid_thw
        ``[n, 3]``, attention_mask ``[B, S]``, pixel_values_videos / video_grid_thw -> logits ``[B, S, vocab]``
        float32."""
        return hf_call(self, input_ids, pixel_values, image_grid_thw, attention_mask, pixel_values_videos,
                       video_grid_thw)
