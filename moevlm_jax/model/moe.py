"""The MoE block: float32 softmax router over all experts, top-k, renormalisation, SwiGLU experts
computed by ``parallelism.experts.experts_forward``; and the dense SwiGLU MLP.

The router (``moevlm_jax.model.router``: ``route``, ``router_stats``, the optional aux-loss-free
``ExpertBias``) also returns the per-row statistics every router loss is computed from: over valid
tokens, top-k assignment counts per expert, summed router probabilities per expert, token counts
and summed squared logsumexp (z-loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import TextConfig
from moevlm_jax.model.layers import Linear, dtype_of, param
from moevlm_jax.model.router import ExpertBias, route, router_stats
from moevlm_jax.parallelism.experts import experts_forward_with_stats
from moevlm_jax.parallelism.logical import constrain

__all__ = ["MLP", "ExpertBias", "SparseMoeBlock", "route", "router_stats"]


class SparseMoeBlock(nnx.Module):
    """Router ``gate`` [embed, exp] + fused experts: gate_up_proj ``[E, H, 2, I]`` (gate first),
    down_proj ``[E, I, H]``."""

    def __init__(self, cfg: TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd, h, e, i = dtype_of(compute.param_dtype), cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        std = cfg.initializer_range
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = e
        self.compute = compute
        self.norm_topk_prob = cfg.norm_topk_prob
        # aux-loss-free balancing: routing state (not a Param), stacked to [layers, E] with the layer
        self.expert_bias = (ExpertBias(jnp.zeros((e,), jnp.float32), out_sharding=("exp",))
                            if compute.router.expert_bias else None)
        self.gate = Linear((h,), (e,), ("embed",), ("exp",), use_bias=False, param_dtype=pd, rngs=rngs, std=std)
        # [E, H, 2, I]: an expert-tensor-parallel split of I keeps each shard's gate and up columns paired
        self.gate_up_proj = param(rngs, "normal", (e, h, 2, i), ("exp", "embed", None, "moe_mlp"), pd, std)
        self.down_proj = param(rngs, "normal", (e, i, h), ("exp", "moe_mlp", "embed"), pd, std)

    def __call__(self, x: jax.Array, valid: jax.Array) -> tuple[jax.Array, dict]:
        """x ``[B, S, H]``, valid ``[B, S]`` -> ``[B, S, H]`` and router stats (see router_stats)."""
        b, s, h = x.shape
        with jax.named_scope("router"):
            _logits, _probs, top_w, top_i, stats = self.routing(x, valid)
        tokens = constrain(x.reshape(b * s, h), ("act_tokens", "act_embed"))
        options = self.compute.moe_options
        # padding positions (not ``valid``) go to no expert: id E, which every dispatcher leaves out of the expert
        # counts and the drop count (parallelism.permute.route_plan), so the grouped matmuls never see their rows
        # (~8% of the proxy's positions) and their output here is zero; nothing valid reads them (attention keys
        # are segment-masked, the loss masked), as in Megatron's packed sequences, which carry no padding at all
        expert_ids = jnp.where(valid[..., None], top_i, self.num_experts)
        with jax.named_scope("experts"):  # permutation / dispatch and the expert matmuls
            y, drops = experts_forward_with_stats(
                tokens, expert_ids.reshape(b * s, self.top_k), top_w.reshape(b * s, self.top_k).astype(x.dtype),
                self.gate_up_proj[...].astype(x.dtype), self.down_proj[...].astype(x.dtype),
                fp8_config=self.compute.fp8.at("experts"), **options,
            )
        if options.get("capacity_factor") is not None:  # global counts, spread over the rows (sums add up)
            stats["dropped"] = jnp.full((b,), drops["dropped"].astype(jnp.float32) / b)
            stats["assignments"] = jnp.full((b,), float(s * self.top_k))
        y = constrain(y, ("act_tokens", "act_embed")).reshape(b, s, h)
        return checkpoint_name(y, "moe"), stats

    def routing(self, x: jax.Array, valid: jax.Array) -> tuple[jax.Array, ...]:
        """Router logits (float32), probabilities, top-k weights and experts, and router stats."""
        kernel = self.gate.kernel[...]
        if self.compute.router.dtype == "float32":  # Megatron moe_router_dtype fp32
            logits = jnp.einsum("bsh,he->bse", x.astype(jnp.float32), kernel.astype(jnp.float32))
        else:  # HF: logits in the compute dtype, softmax in float32
            logits = jnp.einsum("bsh,he->bse", x, kernel.astype(x.dtype)).astype(jnp.float32)
        logits = checkpoint_name(constrain(logits, ("act_batch", "act_norm_seq", "act_exp")), "moe_router")
        bias = None if self.expert_bias is None else self.expert_bias[...]
        probs, top_w, top_i = route(logits, self.top_k, bias=bias, norm_topk_prob=self.norm_topk_prob)
        aux_top_i = None if bias is None else jax.lax.top_k(probs, self.top_k)[1]
        stats = router_stats(logits, probs, top_i, valid, self.num_experts, aux_top_i=aux_top_i)
        return logits, probs, top_w, top_i, stats


class MLP(nnx.Module):
    """Dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd, h, i, std = dtype_of(compute.param_dtype), cfg.hidden_size, cfg.intermediate_size, cfg.initializer_range
        kw = dict(use_bias=False, param_dtype=pd, rngs=rngs, std=std, fp8=compute.fp8.at("dense"))
        self.gate_proj = Linear((h,), (i,), ("embed",), ("mlp",), **kw)
        self.up_proj = Linear((h,), (i,), ("embed",), ("mlp",), **kw)
        self.down_proj = Linear((i,), (h,), ("mlp",), ("embed",), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[B, S, H]`` -> ``[B, S, H]``."""
        x = constrain(x, ("act_batch", "act_seq", "act_embed"))  # SP: all-gather the sequence
        g = checkpoint_name(self.gate_proj(x), "mlp_hidden")
        u = checkpoint_name(self.up_proj(x), "mlp_hidden")
        h = constrain(jax.nn.silu(g) * u, ("act_batch", "act_seq", "act_mlp"))
        return checkpoint_name(constrain(self.down_proj(h), ("act_batch", "act_seq", "act_embed")), "mlp")
