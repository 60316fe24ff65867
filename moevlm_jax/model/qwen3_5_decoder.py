"""The Qwen3.5-MoE text decoder: hybrid layers (Gated DeltaNet or gated full attention, each
followed by the MoE block with a shared expert), zero-centred RMSNorms, final norm.

As HF's ``Qwen3_5MoeTextModel``:
- RMSNorms (input / post-attention / final, and the full-attention q/k norms) are zero-centred:
  ``norm(x) * (1 + weight)`` in float32, then cast (weights start at zero);
- full attention: q_proj yields the query and an output gate per head (``[embed, heads, 2,
  head_dim]``, HF's ``view(..., heads, 2 * head_dim).chunk(2)``), q/k RMSNorm over the whole head,
  interleaved MRoPE on the first ``int(head_dim * partial_rotary_factor)`` channels only, causal
  attention within a packed sample, ``out * sigmoid(gate)``, o_proj;
- the MoE block: the router and experts of :class:`~moevlm_jax.model.moe.SparseMoeBlock` plus a
  dense SwiGLU shared expert on every token, scaled by ``sigmoid(x @ shared_expert_gate)``.

Layers are stacked per run of consecutive layers of one type (``stacks[g]``, leading axis
``layers``; ``decoder.layer_groups`` over ``layer_types``), each run by ``run_stack`` (scan, remat,
pipeline stages as for Qwen3-VL).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moevlm_jax.model.attention import dot_product_attention
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.decoder import ACT, INNER, KV_AXES, Q_AXES, layer_groups
from moevlm_jax.model.layers import Linear, dtype_of, param, run_stack, stack_modules
from moevlm_jax.model.moe import SparseMoeBlock
from moevlm_jax.model.qwen3_5_config import Qwen35TextConfig
from moevlm_jax.model.qwen3_5_gdn import GatedDeltaNet
from moevlm_jax.model.rotary import apply_rotary, mrope_cos_sin
from moevlm_jax.parallelism.logical import constrain
from moevlm_jax.parallelism.vocab import embed_lookup


class ZeroCenteredRMSNorm(nnx.Module):
    """HF's Qwen3_5MoeRMSNorm: ``(norm(x) * (1 + scale))`` in float32, cast back; scale starts at 0."""

    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.eps = eps
        self.scale = param(None, "zeros", (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[..., dim]`` -> same shape and dtype."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)


def apply_partial_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x ``[B, S, N, D]``, cos/sin ``[B, S, R]`` (R <= D) -> x with its first R channels rotated."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return jnp.concatenate([apply_rotary(x[..., :r], cos, sin), x[..., r:]], axis=-1)


class GatedAttention(nnx.Module):
    """HF's Qwen3_5MoeAttention: q (+ output gate), k, v projections, zero-centred q/k norms, partial
    interleaved MRoPE, causal attention within a segment, sigmoid output gate, o_proj."""

    def __init__(self, cfg: Qwen35TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd, h, n, k, d = (dtype_of(compute.param_dtype), cfg.hidden_size, cfg.num_attention_heads,
                          cfg.num_key_value_heads, cfg.head_dim)
        kw = dict(use_bias=cfg.attention_bias, param_dtype=pd, rngs=rngs, std=cfg.initializer_range,
                  fp8=compute.fp8.at("dense"))
        self.impl = compute.attention
        self.attn_kw = tuple(compute.attention_options.for_tower("text").items())  # cuDNN bound, head-dim pad
        self.q_proj = Linear((h,), (n, 2, d), ("embed",), ("q_heads", None, "head_dim"), **kw)  # (query, gate)
        self.k_proj = Linear((h,), (k, d), ("embed",), ("kv_heads", "head_dim"), **kw)
        self.v_proj = Linear((h,), (k, d), ("embed",), ("kv_heads", "head_dim"), **kw)
        self.o_proj = Linear((n, d), (h,), ("q_heads", "head_dim"), ("embed",), **kw)
        self.q_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps, param_dtype=pd)
        self.k_norm = ZeroCenteredRMSNorm(d, cfg.rms_norm_eps, param_dtype=pd)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x ``[B, S, H]``, cos/sin ``[B, S, R]``, segment_ids ``[B, S]`` -> ``[B, S, H]``."""
        x = constrain(x, INNER)  # SP: all-gather the sequence (not the column-parallel weights)
        qg = checkpoint_name(self.q_proj(x), "qkv_proj")  # [B, S, N, 2, D]
        q, gate = qg[..., 0, :], qg[..., 1, :]
        k = checkpoint_name(self.k_proj(x), "qkv_proj")
        v = checkpoint_name(self.v_proj(x), "qkv_proj")
        q = apply_partial_rotary(checkpoint_name(self.q_norm(q), "layernorm"), cos, sin)
        k = apply_partial_rotary(checkpoint_name(self.k_norm(k), "layernorm"), cos, sin)
        q, k, v = constrain(q, Q_AXES), constrain(k, KV_AXES), constrain(v, KV_AXES)
        out = dot_product_attention(q, k, v, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                    causal=True, impl=self.impl, logical_axes=(Q_AXES, KV_AXES), **dict(self.attn_kw))
        out = checkpoint_name(out, "core_attn")
        out = constrain(out * jax.nn.sigmoid(constrain(gate, Q_AXES)), Q_AXES)
        return checkpoint_name(constrain(self.o_proj(out), INNER), "attn_out")  # row-parallel partial sums


class SharedExpert(nnx.Module):
    """The dense SwiGLU shared expert: down(silu(gate(x)) * up(x)), width shared_expert_intermediate_size."""

    def __init__(self, cfg: Qwen35TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd, h, i = dtype_of(compute.param_dtype), cfg.hidden_size, cfg.shared_expert_intermediate_size
        kw = dict(use_bias=False, param_dtype=pd, rngs=rngs, std=cfg.initializer_range, fp8=compute.fp8.at("dense"))
        self.gate_proj = Linear((h,), (i,), ("embed",), ("mlp",), **kw)
        self.up_proj = Linear((h,), (i,), ("embed",), ("mlp",), **kw)
        self.down_proj = Linear((i,), (h,), ("mlp",), ("embed",), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[B, S, H]`` (sequence gathered) -> ``[B, S, H]``."""
        g = checkpoint_name(self.gate_proj(x), "mlp_hidden")
        u = checkpoint_name(self.up_proj(x), "mlp_hidden")
        h = constrain(jax.nn.silu(g) * u, ("act_batch", "act_seq", "act_mlp"))
        return checkpoint_name(constrain(self.down_proj(h), INNER), "mlp")


class SharedExpertMoeBlock(SparseMoeBlock):
    """HF's Qwen3_5MoeSparseMoeBlock: the routed experts of SparseMoeBlock (``gate``,
    ``gate_up_proj``, ``down_proj``) + ``sigmoid(x @ shared_expert_gate) * shared_expert(x)``."""

    def __init__(self, cfg: Qwen35TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        super().__init__(cfg, compute, rngs)
        pd, h = dtype_of(compute.param_dtype), cfg.hidden_size
        self.shared_expert = SharedExpert(cfg, compute, rngs)
        self.shared_expert_gate = Linear((h,), (1,), ("embed",), (None,), use_bias=False, param_dtype=pd, rngs=rngs,
                                         std=cfg.initializer_range)

    def __call__(self, x: jax.Array, valid: jax.Array) -> tuple[jax.Array, dict]:
        """x ``[B, S, H]``, valid ``[B, S]`` -> ``[B, S, H]`` and router stats (see router_stats)."""
        routed, stats = super().__call__(x, valid)
        xs = constrain(x, INNER)  # SP: all-gather the sequence for the dense shared expert
        with jax.named_scope("shared_expert"):
            shared = self.shared_expert(xs)
            shared = jax.nn.sigmoid(self.shared_expert_gate(xs)) * shared
        return constrain(routed, ACT) + constrain(shared, ACT), stats


class Qwen35DecoderLayer(nnx.Module):
    """x + mixer(norm(x)); x + moe(norm(x)); the mixer a GatedDeltaNet ("linear_attention") or
    GatedAttention ("full_attention")."""

    def __init__(self, cfg: Qwen35TextConfig, compute: ComputeConfig, kind: str, rngs: nnx.Rngs):
        pd = dtype_of(compute.param_dtype)
        self.kind = kind
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)
        if kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, compute, rngs)
        else:
            self.self_attn = GatedAttention(cfg, compute, rngs)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)
        self.mlp = SharedExpertMoeBlock(cfg, compute, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, dict]:
        """x ``[B, S, H]`` -> ``[B, S, H]`` and the router stats."""
        h = checkpoint_name(self.input_layernorm(x), "layernorm")
        if self.kind == "linear_attention":
            with jax.named_scope("decoder_gdn"):  # profiler trace labels
                mixed = self.linear_attn(h, segment_ids)
        else:
            with jax.named_scope("decoder_attention"):
                mixed = self.self_attn(h, cos, sin, segment_ids)
        x = constrain(x + mixed, ACT)
        h = checkpoint_name(self.post_attention_layernorm(x), "layernorm")
        y, stats = self.mlp(h, segment_ids > 0)
        return constrain(x + y, ACT), stats


class Qwen35TextModel(nnx.Module):
    """Token embedding, stacked hybrid decoder layers, final (zero-centred) norm."""

    def __init__(self, cfg: Qwen35TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd = dtype_of(compute.param_dtype)
        self.cfg = cfg
        self.compute = compute
        self.groups = tuple(layer_groups(cfg.layer_types))
        self.embed_tokens = param(rngs, "normal", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd,
                                  cfg.initializer_range)
        self.stacks = nnx.List([
            stack_modules(lambda r, kind=kind: Qwen35DecoderLayer(cfg, compute, kind, r), n, rngs, "layers")
            for kind, _, n in self.groups
        ])
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, param_dtype=pd)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """input_ids ``[B, S]`` -> embeddings ``[B, S, H]`` in the compute dtype."""
        with jax.named_scope("embed"):
            rows = embed_lookup(self.embed_tokens[...], input_ids, ("vocab", "embed"), ACT)  # cast only the rows
            return constrain(rows.astype(dtype_of(self.compute.dtype)), ACT)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> tuple[jax.Array, dict]:
        """x ``[B, S, H]`` input embeddings, positions ``[3, B, S]``, segment_ids ``[B, S]`` -> normed
        hidden ``[B, S, H]`` and router stats with a leading axis over all layers (in layer order)."""
        cfg = self.cfg
        cos, sin = mrope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section)
        side = (cos, sin, segment_ids)  # batch-dependent: split with the carry when pipelined

        def body(layer, h, _, side):
            return layer(h, *side)

        stats = []
        for (_, first, _), stack in zip(self.groups, self.stacks):
            x, s = run_stack(stack, body, x, None, self.compute, side=side, side_axes=(0, 0, 0), layer_offset=first)
            stats.append(s)
        router = jax.tree.map(lambda *a: jnp.concatenate(a), *stats)
        return self.norm(x), router
