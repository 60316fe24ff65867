"""The text decoder: GQA attention with per-head q/k RMSNorm and interleaved MRoPE, MoE or dense
MLP layers, final RMSNorm.

Layers are stacked for scan over depth. Consecutive layers of the same kind (MoE / dense) form one
stack (``stacks[g]``, leading axis ``layers``), each run by one ``lax.scan``, so compile time does
not grow with depth. DeepStack features ``[n_ds, B, S, H]`` (already scattered to the image-token
rows, zero elsewhere) are added after decoder layers ``0 .. n_ds - 1`` inside the same scan.

Generation (``moevlm_jax.inference``) runs the same layers through ``*.cached`` methods, separate from
the training ``__call__`` path (which they leave as it was): the new tokens' K/V are written into a
preallocated per-stack cache ``[n, B, T, K, D]`` at slots ``start ..``; a prefill (empty cache) attends
with the training op, a decode step's queries attend to the whole cache (``attention.cached_attention``).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moevlm_jax.model.attention import cached_attention, dot_product_attention
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import TextConfig
from moevlm_jax.model.layers import (
    Linear,
    RMSNorm,
    dtype_of,
    param,
    run_stack,
    stack_modules,
)
from moevlm_jax.model.moe import MLP, SparseMoeBlock
from moevlm_jax.model.rotary import apply_rotary, mrope_cos_sin
from moevlm_jax.parallelism.logical import constrain
from moevlm_jax.parallelism.vocab import embed_lookup

ACT = ("act_batch", "act_norm_seq", "act_embed")  # the residual stream (sequence parallel under TP)
INNER = ("act_batch", "act_seq", "act_embed")  # attention's input / output (sequence gathered under SP)
Q_AXES = ("act_batch", "act_seq", "act_heads", "act_head_dim")
KV_AXES = ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")


class TextAttention(nnx.Module):
    """q/k/v projections ``[embed, heads, head_dim]``, per-head RMSNorm on q and k, rotary, causal
    attention within a segment, out-projection ``[heads, head_dim, embed]``."""

    def __init__(self, cfg: TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd, h, n, k, d = (dtype_of(compute.param_dtype), cfg.hidden_size, cfg.num_attention_heads,
                          cfg.num_key_value_heads, cfg.head_dim)
        kw = dict(use_bias=cfg.attention_bias, param_dtype=pd, rngs=rngs, std=cfg.initializer_range,
                  fp8=compute.fp8.at("dense"))
        self.impl = compute.attention
        self.attn_kw = tuple(compute.attention_options.for_tower("text").items())  # cuDNN bound, head-dim pad
        self.q_proj = Linear((h,), (n, d), ("embed",), ("q_heads", "head_dim"), **kw)
        self.k_proj = Linear((h,), (k, d), ("embed",), ("kv_heads", "head_dim"), **kw)
        self.v_proj = Linear((h,), (k, d), ("embed",), ("kv_heads", "head_dim"), **kw)
        self.o_proj = Linear((n, d), (h,), ("q_heads", "head_dim"), ("embed",), **kw)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=pd)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, param_dtype=pd)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x ``[B, S, H]``, cos/sin ``[B, S, D]``, segment_ids ``[B, S]`` -> ``[B, S, H]``."""
        x = constrain(x, INNER)  # SP: all-gather the sequence (not the column-parallel weights)
        q = checkpoint_name(self.q_proj(x), "qkv_proj")
        k = checkpoint_name(self.k_proj(x), "qkv_proj")
        v = checkpoint_name(self.v_proj(x), "qkv_proj")
        q = apply_rotary(checkpoint_name(self.q_norm(q), "layernorm"), cos, sin)
        k = apply_rotary(checkpoint_name(self.k_norm(k), "layernorm"), cos, sin)
        q, k, v = constrain(q, Q_AXES), constrain(k, KV_AXES), constrain(v, KV_AXES)
        out = dot_product_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                    causal=True, impl=self.impl, logical_axes=(Q_AXES, KV_AXES), **dict(self.attn_kw))
        out = checkpoint_name(out, "core_attn")
        return checkpoint_name(constrain(self.o_proj(out), INNER), "attn_out")  # row-parallel partial sums

    def cached(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array, k_cache: jax.Array,
               v_cache: jax.Array, layer: jax.Array, kv_segment_ids: jax.Array, start: jax.Array, *,
               prefill: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Generation: x ``[B, S, H]`` the new tokens at cache slots ``start .. start + S - 1``, cos/sin
        ``[B, S, D]``, segment_ids ``[B, S]``; k_cache/v_cache ``[n, B, T, K, D]`` the stack's caches, of
        which row ``layer`` is this layer's; kv_segment_ids ``[B, T]`` (every slot's id, 0 = padding)
        -> ``[B, S, H]`` and the caches with the new K/V written (in place: only the new slots).
        ``prefill``: the cache holds nothing before these tokens (start 0), so they attend among
        themselves with the training attention (``compute.attention``: cuDNN flash on GPUs)."""
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k), cos, sin)
        zero = jnp.zeros((), jnp.int32)
        at = (jnp.asarray(layer, jnp.int32), zero, jnp.asarray(start, jnp.int32), zero, zero)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype)[None], at)
        v_cache = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype)[None], at)
        if prefill:
            out = dot_product_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                        causal=True, impl=self.impl, **dict(self.attn_kw))
        else:
            keys = jax.lax.dynamic_index_in_dim(k_cache, layer, keepdims=False).astype(q.dtype)
            values = jax.lax.dynamic_index_in_dim(v_cache, layer, keepdims=False).astype(q.dtype)
            out = cached_attention(q, keys, values, q_segment_ids=segment_ids, kv_segment_ids=kv_segment_ids,
                                   q_offset=start)
        return self.o_proj(out), k_cache, v_cache


class DecoderLayer(nnx.Module):
    """x + attn(norm(x)); x + mlp(norm(x)), the MLP a SparseMoeBlock ("moe") or an MLP ("dense")."""

    def __init__(self, cfg: TextConfig, compute: ComputeConfig, kind: str, rngs: nnx.Rngs):
        pd = dtype_of(compute.param_dtype)
        self.kind = kind
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)
        self.self_attn = TextAttention(cfg, compute, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)
        self.mlp = SparseMoeBlock(cfg, compute, rngs) if kind == "moe" else MLP(cfg, compute, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array,
                                                                                                      dict | None]:
        """x ``[B, S, H]`` -> ``[B, S, H]`` and router stats (MoE layers) or None."""
        with jax.named_scope("decoder_attention"):  # profiler trace labels (bench.step --profile)
            attn = self.self_attn(checkpoint_name(self.input_layernorm(x), "layernorm"), cos, sin, segment_ids)
        x = constrain(x + attn, ACT)
        h = checkpoint_name(self.post_attention_layernorm(x), "layernorm")
        if self.kind == "moe":
            y, stats = self.mlp(h, segment_ids > 0)
        else:
            y, stats = self.mlp(h), None
        return constrain(x + y, ACT), stats

    def cached(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array, k_cache: jax.Array,
               v_cache: jax.Array, layer: jax.Array, kv_segment_ids: jax.Array, start: jax.Array, *,
               prefill: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Generation: the layer on new tokens with the KV cache (``TextAttention.cached``: row
        ``layer`` of the stack's caches) -> ``[B, S, H]`` and the updated caches."""
        attn, k_cache, v_cache = self.self_attn.cached(self.input_layernorm(x), cos, sin, segment_ids, k_cache,
                                                       v_cache, layer, kv_segment_ids, start, prefill=prefill)
        x = x + attn
        h = self.post_attention_layernorm(x)
        y = self.mlp(h, segment_ids > 0)[0] if self.kind == "moe" else self.mlp(h)
        return x + y, k_cache, v_cache


def layer_groups(kinds: tuple[str, ...]) -> list[tuple[str, int, int]]:
    """Runs of consecutive layers of one kind: ``(kind, first_layer, count)``."""
    out, start = [], 0
    for kind, run in itertools.groupby(kinds):
        n = len(list(run))
        out.append((kind, start, n))
        start += n
    return out


class TextModel(nnx.Module):
    """Token embedding, stacked decoder layers, final norm."""

    def __init__(self, cfg: TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd = dtype_of(compute.param_dtype)
        self.cfg = cfg
        self.compute = compute
        self.groups = tuple(layer_groups(cfg.layer_kinds))
        self.embed_tokens = param(rngs, "normal", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd,
                                  cfg.initializer_range)
        self.stacks = nnx.List([
            stack_modules(lambda r, kind=kind: DecoderLayer(cfg, compute, kind, r), n, rngs, "layers")
            for kind, _, n in self.groups
        ])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """input_ids ``[B, S]`` -> embeddings ``[B, S, H]`` in the compute dtype."""
        with jax.named_scope("embed"):  # profiler trace labels (bench.trace_breakdown)
            rows = embed_lookup(self.embed_tokens[...], input_ids, ("vocab", "embed"), ACT)  # cast only the rows
            return constrain(rows.astype(dtype_of(self.compute.dtype)), ACT)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array,
                 deepstack: jax.Array | None = None) -> tuple[jax.Array, dict | None]:
        """x ``[B, S, H]`` input embeddings, positions ``[3, B, S]``, segment_ids ``[B, S]``, deepstack
        ``[n_ds, B, S, H]`` or None -> normed hidden ``[B, S, H]`` and router stats with a leading
        axis over the MoE layers (in layer order), or None when there are none."""
        cfg = self.cfg
        cos, sin = mrope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
        n_ds = 0 if deepstack is None else deepstack.shape[0]
        side = (cos, sin, segment_ids, deepstack)  # batch-dependent: split with the carry when pipelined

        def body(layer, h, layer_idx, side, with_ds):
            cos, sin, segment_ids, deepstack = side
            h, stats = layer(h, cos, sin, segment_ids)
            if with_ds:
                add = jax.lax.dynamic_index_in_dim(deepstack, jnp.minimum(layer_idx, n_ds - 1), keepdims=False)
                h = h + jnp.where(layer_idx < n_ds, add.astype(h.dtype), jnp.zeros_like(h))
            return h, stats

        stats = []
        for (kind, first, n), stack in zip(self.groups, self.stacks):
            with_ds = first < n_ds
            x, s = run_stack(stack, lambda layer, h, i, sd, w=with_ds: body(layer, h, i, sd, w), x,
                             jnp.arange(first, first + n, dtype=jnp.int32), self.compute,
                             side=side, side_axes=(0, 0, 0, 1), layer_offset=first)
            if kind == "moe":
                stats.append(s)
        router = jax.tree.map(lambda *a: jnp.concatenate(a), *stats) if stats else None
        return self.norm(x), router

    def cache_shapes(self, batch: int, length: int) -> list[tuple[int, ...]]:
        """Shape of each stack's K (and V) cache: ``[layers of the stack, batch, length, kv_heads, head_dim]``."""
        cfg = self.cfg
        return [(n, batch, length, cfg.num_key_value_heads, cfg.head_dim) for _, _, n in self.groups]

    def cached(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, cache: list[tuple[jax.Array,
                                                                                                   jax.Array]],
               kv_segment_ids: jax.Array, start: jax.Array, deepstack: jax.Array | None = None, *,
               prefill: bool = False) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
        """Generation (prefill or decode): x ``[B, S, H]`` embeddings of the new tokens, which sit at
        cache slots ``start .. start + S - 1``; positions ``[3, B, S]``, segment_ids ``[B, S]``; cache:
        per stack ``(k, v)`` of ``cache_shapes``; kv_segment_ids ``[B, T]`` (1 where a slot holds, or
        will hold, a token of the row, 0 = padding); deepstack ``[n_ds, B, S, H]`` or None -> normed
        hidden ``[B, S, H]`` and the cache with the new tokens' K/V written. Each query attends to
        the slots up to its own with its segment id: the same attention as the training forward
        (``prefill``: an empty cache, start 0: the prompt attends among itself with the training op)."""
        cfg = self.cfg
        cos, sin = mrope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.mrope_section)
        n_ds = 0 if deepstack is None else deepstack.shape[0]
        side = (cos, sin, segment_ids, deepstack)
        start = jnp.asarray(start, jnp.int32)

        def body(layer, carry, idx, side, first, with_ds):
            h, k_all, v_all = carry
            cos, sin, segment_ids, deepstack = side
            # the layer's cache row within its stack: idx - first
            h, k_all, v_all = layer.cached(h, cos, sin, segment_ids, k_all, v_all, idx - first, kv_segment_ids, start,
                                           prefill=prefill)
            if with_ds:
                add = jax.lax.dynamic_index_in_dim(deepstack, jnp.minimum(idx, n_ds - 1), keepdims=False)
                h = h + jnp.where(idx < n_ds, add.astype(h.dtype), jnp.zeros_like(h))
            return (h, k_all, v_all), None

        out = []
        for (_kind, first, n), stack, (k_all, v_all) in zip(self.groups, self.stacks, cache):
            with_ds = first < n_ds
            (x, k_all, v_all), _ = run_stack(
                stack, lambda layer, c, i, sd, f=first, w=with_ds: body(layer, c, i, sd, f, w), (x, k_all, v_all),
                jnp.arange(first, first + n, dtype=jnp.int32), self.compute, side=side, side_axes=(0, 0, 0, 1),
                layer_offset=first)
            out.append((k_all, v_all))
        return self.norm(x), out
