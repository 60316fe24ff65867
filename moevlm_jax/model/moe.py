"""The MoE block: float32 softmax router over all experts, top-k, renormalisation, SwiGLU experts
computed by ``parallelism.experts.experts_forward``; and the dense SwiGLU MLP.

The router also returns the per-row statistics every load-balancing loss is computed from
(see ``moevlm_jax.model.loss``): over valid tokens, top-k assignment counts per expert, summed
router probabilities per expert, token counts and summed squared logsumexp (z-loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moevlm_jax.config import ComputeConfig, TextConfig
from moevlm_jax.model.layers import Linear, dtype_of, param
from parallelism.experts import experts_forward
from parallelism.logical import constrain


def route(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router logits ``[T, E]`` -> softmax probs ``[T, E]`` f32, top-k weights ``[T, K]`` f32
    (renormalised to sum 1) and expert ids ``[T, K]`` int32, as HF's Qwen3VLMoeTextTopKRouter."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_w, top_i = jax.lax.top_k(probs, top_k)
    top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return probs, top_w, top_i.astype(jnp.int32)


def router_stats(logits: jax.Array, probs: jax.Array, top_i: jax.Array, valid: jax.Array, num_experts: int) -> dict:
    """Per-row routing sums over valid tokens: logits/probs ``[B, S, E]``, top_i ``[B, S, K]``,
    valid ``[B, S]`` -> expert_counts ``[B, E]``, prob_sums ``[B, E]``, tokens ``[B]``, z_sums ``[B]``."""
    w = valid.astype(jnp.float32)
    onehot = jax.nn.one_hot(top_i, num_experts, dtype=jnp.float32).sum(axis=-2)  # [B, S, E]
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    return {
        "expert_counts": jnp.einsum("bse,bs->be", onehot, w),
        "prob_sums": jnp.einsum("bse,bs->be", probs, w),
        "tokens": jnp.sum(w, axis=-1),
        "z_sums": jnp.sum(jnp.square(lse) * w, axis=-1),
    }


class SparseMoeBlock(nnx.Module):
    """Router ``gate`` [embed, exp] + fused experts: gate_up_proj ``[E, H, 2I]`` (gate half first),
    down_proj ``[E, I, H]``."""

    def __init__(self, cfg: TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd, h, e, i = dtype_of(compute.param_dtype), cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        std = cfg.initializer_range
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = e
        self.compute = compute
        self.gate = Linear((h,), (e,), ("embed",), ("exp",), use_bias=False, param_dtype=pd, rngs=rngs, std=std)
        self.gate_up_proj = param(rngs, "normal", (e, h, 2 * i), ("exp", "embed", "moe_mlp"), pd, std)
        self.down_proj = param(rngs, "normal", (e, i, h), ("exp", "moe_mlp", "embed"), pd, std)

    def __call__(self, x: jax.Array, valid: jax.Array) -> tuple[jax.Array, dict]:
        """x ``[B, S, H]``, valid ``[B, S]`` -> ``[B, S, H]`` and router stats (see router_stats)."""
        b, s, h = x.shape
        logits = jnp.einsum("bsh,he->bse", x.astype(jnp.float32), self.gate.kernel[...].astype(jnp.float32))
        logits = checkpoint_name(logits, "moe_router")
        probs, top_w, top_i = route(logits, self.top_k)
        stats = router_stats(logits, probs, top_i, valid, self.num_experts)
        tokens = constrain(x.reshape(b * s, h), ("act_tokens", "act_embed"))
        y = experts_forward(
            tokens, top_i.reshape(b * s, self.top_k), top_w.reshape(b * s, self.top_k).astype(x.dtype),
            self.gate_up_proj[...].astype(x.dtype), self.down_proj[...].astype(x.dtype), **self.compute.moe_options,
        )
        y = constrain(y, ("act_tokens", "act_embed")).reshape(b, s, h)
        return checkpoint_name(y, "moe"), stats


class MLP(nnx.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd, h, i, std = dtype_of(compute.param_dtype), cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range
        self.gate_proj = Linear((h,), (i,), ("embed",), ("mlp",), use_bias=False, param_dtype=pd, rngs=rngs, std=std)
        self.up_proj = Linear((h,), (i,), ("embed",), ("mlp",), use_bias=False, param_dtype=pd, rngs=rngs, std=std)
        self.down_proj = Linear((i,), (h,), ("mlp",), ("embed",), use_bias=False, param_dtype=pd, rngs=rngs, std=std)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[B, S, H]`` -> ``[B, S, H]``."""
        g = checkpoint_name(self.gate_proj(x), "mlp_hidden")
        u = checkpoint_name(self.up_proj(x), "mlp_hidden")
        h = constrain(jax.nn.silu(g) * u, ("act_batch", "act_seq", "act_mlp"))
        return checkpoint_name(self.down_proj(h), "mlp")
