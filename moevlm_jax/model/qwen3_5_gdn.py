"""Qwen3.5-MoE's linear-attention layer: HF's ``Qwen3_5MoeGatedDeltaNet`` as a Flax NNX module over
the Gated DeltaNet core of :mod:`moevlm_jax.model.gated_deltanet`, on packed rows.

The layer (HF names)::

    q | k | v = silu(causal_conv1d(x @ in_proj_qkv, conv1d))     # depthwise conv over the sequence
    g, beta   = -exp(A_log) softplus(x @ in_proj_a + dt_bias), sigmoid(x @ in_proj_b)
    o         = chunked gated delta rule(l2norm(q), l2norm(k), v, g, beta)
    y         = gated_rms_norm(o, x @ in_proj_z, norm) @ out_proj

Parameter layout (ours; :mod:`moevlm_jax.hf.qwen3_5_names` converts): the fused q/k/v projection
and the conv are stored per key-head group, ``[embed, Hk, 2 Dk + r Dv]`` / ``[K, Hk, 2 Dk + r Dv]``
with ``r = Hv / Hk`` (group j: q head j, k head j, then value heads ``j r .. j r + r - 1``, which
are the value heads HF's ``repeat_interleave`` pairs with key head j). HF's tensors hold all q
channels, then all k, then all v: the same numbers in another order. So a layout that splits the
heads over a mesh axis splits q, k, v and the conv consistently, the value-head tensors
(``in_proj_z [embed, Hv, Dv]``, ``in_proj_a/b [embed, Hv]``, ``A_log``, ``dt_bias``, ``out_proj
[Hv, Dv, embed]``) with them: both head axes carry ``q_heads`` (contiguous splits of Hk and Hv
line up because r is the same for every group).

Packed rows: ``segment_ids`` restarts the conv window and the recurrent state at every packed
sample (each sample computes as if alone); padding (id 0) gets no update and outputs zeros.

The delta rule's path is ``compute.gdn_kernel`` (``gated_deltanet.gated_delta_rule``: Pallas-Triton kernels on
GPUs, the einsum form elsewhere).

Context parallelism (the layout splits ``act_seq``): the conv and the delta rule run on each device's
sequence shard (``parallelism.context.context_parallel_map``), carrying what crosses the boundary
instead of gathering the sequence: the conv gets the previous shard's last K - 1 inputs
(``SequenceShards.from_previous``), the rule runs every shard from a zero state with the terms an
incoming state adds (``gated_deltanet.chunk_gated_delta_rule_carry``, on the einsum path), the incoming states follow
from the shards before (``SequenceShards.incoming_state``) and are added to the outputs. A sample
that starts exactly on a shard boundary gets no carry (``SequenceShards.continues``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.gated_deltanet import (
    apply_incoming_state,
    causal_conv1d,
    chunk_gated_delta_rule_carry,
    conv_tail,
    gated_delta_rule,
    gated_rms_norm,
    gdn_gates,
    resolve_gdn_kernel,
)
from moevlm_jax.model.layers import Linear, dtype_of, param
from moevlm_jax.model.qwen3_5_config import Qwen35TextConfig
from moevlm_jax.parallelism import context
from moevlm_jax.parallelism.logical import constrain

INNER = ("act_batch", "act_seq", "act_embed")  # the layer's input / output (sequence gathered under SP)
HEADS = ("act_batch", "act_seq", "act_heads", "act_head_dim")  # q, k, v, z, the core output
GATES = ("act_batch", "act_seq", "act_heads")  # a, b, g, beta
MIXED = GATES + (None,)  # the fused q | k | v channels per key-head group [B, S, Hk, G]
SEG = ("act_batch", "act_seq")
WHOLE_HEADS = HEADS[:3] + (None,)  # q, k, v, the core output where a kernel needs each head whole
KERNEL = (None, "act_heads", None)  # the conv weight [K, Hk, G], split like the heads it convolves
GDN_CHUNK_SIZE = 64  # HF's torch_chunk_gated_delta_rule default (FLA's chunk)
GDN_PRECISION = None  # matmul precision of the core (None: the backend's default for float32)


class Conv1d(nnx.Module):
    """The depthwise causal conv's weight ``kernel [K, *channels]`` (no bias: HF's has none)."""

    def __init__(self, width: int, channels: tuple[int, ...], axes: tuple[str | None, ...], *, param_dtype,
                 rngs: nnx.Rngs, std: float):
        self.kernel = param(rngs, "normal", (width, *channels), (None, *axes), param_dtype, std)


class GatedNorm(nnx.Module):
    """HF's Qwen3_5MoeRMSNormGated weight ``scale [Dv]`` (ones; plain, not zero-centred)."""

    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.eps = eps
        self.scale = param(None, "ones", (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        """x, z ``[..., Dv]`` -> norm(x) * scale * silu(z), in x's dtype."""
        return gated_rms_norm(x, z, self.scale[...].astype(x.dtype), self.eps)


class GatedDeltaNet(nnx.Module):
    """HF's ``Qwen3_5MoeGatedDeltaNet`` (no cache): projections, conv, gates, chunked delta rule,
    gated norm, out projection (parameter layout: module docstring)."""

    def __init__(self, cfg: Qwen35TextConfig, compute: ComputeConfig, rngs: nnx.Rngs):
        pd, h, std = dtype_of(compute.param_dtype), cfg.hidden_size, cfg.initializer_range
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.hk, self.hv, self.dk, self.dv = hk, hv, dk, dv
        self.kernel = compute.gdn_kernel  # the delta rule's path (auto: Pallas-Triton on GPUs, gated_delta_rule)
        group = 2 * dk + (hv // hk) * dv  # one key-head group's q, k and value channels
        kw = dict(use_bias=False, param_dtype=pd, rngs=rngs, std=std)
        q = dict(fp8=compute.fp8.at("dense"))  # the large projections; b and a (one column a head) stay as they are
        self.in_proj_qkv = Linear((h,), (hk, group), ("embed",), ("q_heads", None), **kw, **q)
        self.in_proj_z = Linear((h,), (hv, dv), ("embed",), ("q_heads", "head_dim"), **kw, **q)
        self.in_proj_b = Linear((h,), (hv,), ("embed",), ("q_heads",), **kw)
        self.in_proj_a = Linear((h,), (hv,), ("embed",), ("q_heads",), **kw)
        self.conv1d = Conv1d(cfg.linear_conv_kernel_dim, (hk, group), ("q_heads", None), param_dtype=pd, rngs=rngs,
                             std=std)
        self.dt_bias = param(None, "ones", (hv,), ("q_heads",), pd)
        # HF's init: A ~ U(0.01, 16), kept away from 0 so that log(A) is finite
        a = jax.random.uniform(rngs.params(), (hv,), jnp.float32, 0.01, 16.0)
        self.A_log = nnx.Param(jnp.log(a).astype(pd), out_sharding=("q_heads",))
        self.norm = GatedNorm(dv, cfg.rms_norm_eps, param_dtype=pd)
        self.out_proj = Linear((hv, dv), (h,), ("q_heads", "head_dim"), ("embed",), **kw, **q)

    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x ``[B, S, H]`` (normed residual stream), segment_ids ``[B, S]`` -> ``[B, S, H]``."""
        x = constrain(x, INNER)  # SP: all-gather the sequence
        b, s, _ = x.shape
        hv, dk, dv = self.hv, self.dk, self.dv
        mixed = checkpoint_name(constrain(self.in_proj_qkv(x), MIXED), "qkv_proj")  # [B, S, Hk, G]
        z = checkpoint_name(constrain(self.in_proj_z(x), HEADS), "qkv_proj")  # [B, S, Hv, Dv]
        beta_in = checkpoint_name(constrain(self.in_proj_b(x), GATES), "qkv_proj")  # [B, S, Hv]
        a = checkpoint_name(constrain(self.in_proj_a(x), GATES), "qkv_proj")
        kernel = self.conv1d.kernel[...].astype(x.dtype)
        split = bool(context.sequence_axes(HEADS))  # context parallel: carry across the sequence shards
        if split:
            conv = context.context_parallel_map(_conv_shard, (mixed, kernel, segment_ids), (MIXED, KERNEL, SEG), MIXED)
        else:
            conv = _conv(mixed, kernel, segment_ids)
        conv = checkpoint_name(constrain(conv, MIXED), "gdn_conv")
        q = constrain(conv[..., :dk], HEADS)
        k = constrain(conv[..., dk:2 * dk], HEADS)
        v = constrain(conv[..., 2 * dk:].reshape(b, s, hv, dv), HEADS)  # group j: value heads j r .. j r + r - 1
        g, beta = gdn_gates(a, beta_in, self.A_log[...], self.dt_bias[...])
        with jax.named_scope("gated_delta_rule"):  # profiler trace labels (bench.trace_breakdown)
            if split:
                core = context.context_parallel_map(_rule_shard, (q, k, v, g, beta, segment_ids),
                                                    (HEADS, HEADS, HEADS, GATES, GATES, SEG), HEADS)
            else:
                kernel = resolve_gdn_kernel(self.kernel, q.dtype, dk, dv, GDN_CHUNK_SIZE)
                rule = functools.partial(_rule, kernel=kernel)
                if kernel == "triton":  # Pallas kernels: each device its rows and heads (GSPMD would gather them)
                    axes = (WHOLE_HEADS,) * 3 + (GATES, GATES, SEG)
                    core = context.per_device_map(rule, (q, k, v, g, beta, segment_ids), axes, WHOLE_HEADS)
                else:
                    core = rule(q, k, v, g, beta, segment_ids)
        core = checkpoint_name(constrain(core, HEADS), "gdn_core")
        y = checkpoint_name(constrain(self.norm(core, z), HEADS), "gated_norm")
        return checkpoint_name(constrain(self.out_proj(y), INNER), "attn_out")  # row-parallel partial sums


def _rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, segment_ids: jax.Array, *,
          kernel: str) -> jax.Array:
    """The chunked delta rule on the path ``kernel`` from a zero state -> the core output ``[B, S, Hv, Dv]``."""
    out, _ = gated_delta_rule(q, k, v, g, beta, kernel=kernel, chunk_size=GDN_CHUNK_SIZE, segment_ids=segment_ids,
                              use_qk_l2norm=True, precision=GDN_PRECISION)
    return out


def _conv(mixed: jax.Array, kernel: jax.Array, segment_ids: jax.Array, window: jax.Array | None = None) -> jax.Array:
    """The causal depthwise conv + silu of the fused channels: mixed ``[B, S, Hk, G]``, kernel ``[K, Hk, G]``,
    window ``[B, K-1, Hk G]`` (the inputs before the row; None: zeros) -> ``[B, S, Hk, G]``."""
    b, s, hk, group = mixed.shape
    out, _ = causal_conv1d(mixed.reshape(b, s, hk * group), kernel.reshape(kernel.shape[0], hk * group),
                           segment_ids=segment_ids, initial_window=window, activation="silu")
    return out.reshape(b, s, hk, group)


def _conv_shard(shards: context.SequenceShards, mixed: jax.Array, kernel: jax.Array,
                segment_ids: jax.Array) -> jax.Array:
    """:func:`_conv` on one sequence shard, its window the previous shard's last K - 1 inputs (where the
    row's first sample continues across the boundary)."""
    b, s, hk, group = mixed.shape
    tail = conv_tail(mixed.reshape(b, s, hk * group), segment_ids, kernel.shape[0] - 1)
    keep = shards.continues(segment_ids)
    window = jnp.where(keep[:, None, None], shards.from_previous(tail), jnp.zeros((), tail.dtype))
    return _conv(mixed, kernel, segment_ids, window)


def _rule_shard(shards: context.SequenceShards, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
                beta: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """The chunked delta rule on one sequence shard with the state carried in from the shards before."""
    out0, q_eff, final, transition = chunk_gated_delta_rule_carry(
        q, k, v, g, beta, chunk_size=GDN_CHUNK_SIZE, segment_ids=segment_ids, use_qk_l2norm=True,
        precision=GDN_PRECISION)
    incoming = shards.incoming_state(transition, final, shards.continues(segment_ids))
    return apply_incoming_state(out0, q_eff, incoming, GDN_PRECISION).astype(q.dtype)
