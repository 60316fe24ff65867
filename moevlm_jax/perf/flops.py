"""Model FLOPs (the MFU numerator) and device peak FLOP/s (the denominator).

Definition (bench/README.md): training FLOPs = 6 x active matmul parameters x tokens, plus attention
scores and values. Text: every useful decoder token (image placeholders included) runs the
decoder (q/k/v/o, router, top-k experts; dense or shared-expert MLPs where present) and the LM
head; the embedding lookup is a gather and costs nothing. Causal attention over a packed
document of n tokens costs 6 * layers * q_heads * head_dim * n^2 (3 passes x 2 matmuls x
2 FLOPs/MAC x n^2/2). Vision: every patch runs the patch embedding and the ViT blocks, and its
share (1/merge^2) of the merger and the deepstack mergers; bidirectional attention within an image
of p patches costs 12 * depth * hidden * p^2.

Qwen3.5-MoE (hybrid layers, :func:`qwen3_5_shape`): the full-attention layers' q_proj also yields
the output gate (2 x q_heads x head_dim columns) and only those layers pay the n^2 attention term.
A Gated DeltaNet layer's parameters per token are its projections (in_proj_qkv ``H x (2 Hk Dk + Hv
Dv)``, in_proj_z ``H x Hv Dv``, in_proj_a / in_proj_b ``H x Hv`` each, out_proj ``Hv Dv x H``) and
the depthwise conv (``K x (2 Hk Dk + Hv Dv)``); its core is the chunked delta rule as
``model.gated_deltanet.chunk_gated_delta_rule`` runs it, per value head and chunk of C tokens (the
C x C blocks computed whole, then masked): k_beta.k^T, q.k^T (C^2 Dk each), the unit-lower inverse
by recursive 2 x 2 blocks (C (C^2 - 1) / 3), T.v_beta (C^2 Dv), T.(k_beta decay) (C^2 Dk), the
intra-chunk attention times the new values (C^2 Dv) and three state products (w.S, q.S, k^T.v_new:
C Dk Dv each) MACs, i.e. per token ``C (3 Dk + 2 Dv) + (C^2 - 1) / 3 + 3 Dk Dv`` MACs a value
head, x 6 for training (:func:`gdn_core_flops_per_token`). Gates, norms and the conv's silu are
elementwise and not counted (as norms are not).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from moevlm_jax.model import registry
from moevlm_jax.model.qwen3_5_config import Qwen35ModelConfig
from moevlm_jax.model.qwen3_5_gdn import GDN_CHUNK_SIZE

log = logging.getLogger(__name__)

# Dense bf16 peak FLOP/s per device (datasheet, no sparsity), matched as substrings of
# jax.devices()[0].device_kind, first match wins.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("TPU v6", 918e12),
    ("TPU v5p", 459e12),
    ("TPU v5 lite", 197e12),
    ("TPU v5e", 197e12),
    ("TPU v4", 275e12),
)


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The sizes FLOPs depend on (HF Qwen3-VL-MoE names; vision fields prefixed ``vision_``)."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_moe_layers: int | None = None  # None: every layer is MoE when num_experts > 0
    intermediate_size: int = 0  # dense MLP width for non-MoE layers
    shared_expert_intermediate_size: int = 0
    vision_depth: int = 0
    vision_hidden_size: int = 0
    vision_intermediate_size: int = 0
    vision_num_heads: int = 0
    vision_out_hidden_size: int = 0  # merger output (= text hidden_size)
    vision_patch_dim: int = 1536  # in_channels x temporal_patch x patch x patch
    spatial_merge_size: int = 2
    num_deepstack_mergers: int = 0
    # Qwen3.5 hybrid decoders: Gated DeltaNet ("linear_attention") layers and gated full attention
    num_linear_layers: int = 0  # GDN layers; the other num_hidden_layers - num_linear_layers are attention
    attn_output_gate: bool = False  # q_proj also yields a sigmoid output gate per head (Qwen3.5)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    gdn_chunk_size: int = 64  # the chunked delta rule's chunk (model.qwen3_5_gdn.GDN_CHUNK_SIZE)

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        """From a model config of any family (:func:`flops_shape`: a built config by its class, a mapping
        with ``text_config``/``vision_config`` parts by its ``model_type``; a flat mapping or one with
        ``text``/``vision`` parts reads as Qwen3-VL-MoE)."""
        if isinstance(cfg, registry.CONFIG_TYPES) or (isinstance(cfg, Mapping) and "model_type" in cfg):
            return flops_shape(cfg)
        return qwen3_vl_shape(cfg)

    @property
    def num_attention_layers(self) -> int:
        """Decoder layers with (full) softmax attention."""
        return self.num_hidden_layers - self.num_linear_layers


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def qwen3_vl_shape(cfg: Any) -> ModelShape:
    """The FLOPs shape of a Qwen3-VL-MoE config object or mapping, flat or with ``text_config``/
    ``vision_config`` (or ``text``/``vision``) parts named as in HF Qwen3-VL-MoE."""
    get = _get
    text = get(cfg, "text_config") or get(cfg, "text") or cfg
    vision = get(cfg, "vision_config") or get(cfg, "vision")
    heads = get(text, "num_attention_heads")
    hidden = get(text, "hidden_size")
    layers = get(text, "num_hidden_layers")
    mlp_only = list(get(text, "mlp_only_layers", None) or [])
    sparse_step = int(get(text, "decoder_sparse_step", 1) or 1)
    experts = int(get(text, "num_experts", 0) or 0)
    moe_layers = sum(1 for i in range(layers) if experts > 0 and i not in mlp_only
                     and (i + 1) % sparse_step == 0)
    kw = dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=get(text, "num_key_value_heads", heads),
        head_dim=get(text, "head_dim", None) or hidden // heads,
        vocab_size=get(text, "vocab_size"),
        moe_intermediate_size=get(text, "moe_intermediate_size", 0) or 0,
        num_experts=experts, num_experts_per_tok=get(text, "num_experts_per_tok", 0) or 0,
        num_moe_layers=moe_layers, intermediate_size=get(text, "intermediate_size", 0) or 0,
        shared_expert_intermediate_size=get(text, "shared_expert_intermediate_size", 0) or 0,
    )
    if vision is not None:
        patch = get(vision, "patch_size", 16)
        kw.update(
            vision_depth=get(vision, "depth"), vision_hidden_size=get(vision, "hidden_size"),
            vision_intermediate_size=get(vision, "intermediate_size"),
            vision_num_heads=get(vision, "num_heads"),
            vision_out_hidden_size=get(vision, "out_hidden_size", hidden),
            vision_patch_dim=get(vision, "in_channels", 3) * get(vision, "temporal_patch_size", 2) * patch * patch,
            spatial_merge_size=get(vision, "spatial_merge_size", 2),
            num_deepstack_mergers=len(get(vision, "deepstack_visual_indexes", None) or []),
        )
    return ModelShape(**kw)


def qwen3_5_shape(cfg: Any) -> ModelShape:
    """The FLOPs shape of a Qwen3.5-MoE config (``Qwen35ModelConfig`` or its HF ``config.json``
    mapping): Qwen3-VL's fields plus the GDN layers, the attention output gate, the shared expert."""

    if isinstance(cfg, Mapping):
        cfg = Qwen35ModelConfig.from_hf_dict(cfg)
    t, v = cfg.text_config, cfg.vision_config
    return ModelShape(
        hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers, num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
        moe_intermediate_size=t.moe_intermediate_size, num_experts=t.num_experts,
        num_experts_per_tok=t.num_experts_per_tok, num_moe_layers=t.num_hidden_layers,
        shared_expert_intermediate_size=t.shared_expert_intermediate_size,
        vision_depth=v.depth, vision_hidden_size=v.hidden_size, vision_intermediate_size=v.intermediate_size,
        vision_num_heads=v.num_heads, vision_out_hidden_size=v.out_hidden_size, vision_patch_dim=v.patch_dim,
        spatial_merge_size=v.spatial_merge_size, num_deepstack_mergers=0,
        num_linear_layers=sum(k == "linear_attention" for k in t.layer_types), attn_output_gate=True,
        linear_num_key_heads=t.linear_num_key_heads, linear_num_value_heads=t.linear_num_value_heads,
        linear_key_head_dim=t.linear_key_head_dim, linear_value_head_dim=t.linear_value_head_dim,
        linear_conv_kernel_dim=t.linear_conv_kernel_dim, gdn_chunk_size=GDN_CHUNK_SIZE,
    )


SHAPES = {"qwen3_vl_moe": qwen3_vl_shape, "qwen3_5_moe": qwen3_5_shape}  # model family -> its FLOPs shape


def flops_shape(config: Any) -> ModelShape:
    """The FLOPs shape of a built config or a raw mapping of any family (``model.registry.family_of``)."""
    return SHAPES[registry.family_of(config).name](config)


def gdn_params_per_token(m: ModelShape) -> int:
    """Matmul parameters one token touches in one Gated DeltaNet layer: projections and the conv."""
    h, hk, hv = m.hidden_size, m.linear_num_key_heads, m.linear_num_value_heads
    conv_dim = 2 * hk * m.linear_key_head_dim + hv * m.linear_value_head_dim
    z = hv * m.linear_value_head_dim
    return h * conv_dim + h * z + 2 * h * hv + z * h + m.linear_conv_kernel_dim * conv_dim


def gdn_core_flops_per_token(m: ModelShape) -> float:
    """Training FLOPs (x 6 = 3 passes x 2 FLOPs a MAC) of one GDN layer's chunked delta rule per token
    (see the module docstring for the MAC count)."""
    c, dk, dv = m.gdn_chunk_size, m.linear_key_head_dim, m.linear_value_head_dim
    macs = c * (3 * dk + 2 * dv) + (c * c - 1) / 3 + 3 * dk * dv
    return 6.0 * m.linear_num_value_heads * macs


def text_params_per_token(m: ModelShape) -> int:
    """Matmul parameters one decoder token touches: attention (or GDN projections), router, top-k
    experts, shared expert, LM head."""
    h = m.hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    attn = h * q * (2 if m.attn_output_gate else 1) + 2 * h * kv + q * h
    moe_layers = m.num_hidden_layers if m.num_moe_layers is None else m.num_moe_layers
    if m.num_experts == 0:
        moe_layers = 0
    dense_layers = m.num_hidden_layers - moe_layers
    shared = 3 * h * m.shared_expert_intermediate_size + (h if m.shared_expert_intermediate_size else 0)
    moe = h * m.num_experts + m.num_experts_per_tok * 3 * h * m.moe_intermediate_size + shared
    dense = 3 * h * m.intermediate_size
    mixers = m.num_attention_layers * attn + m.num_linear_layers * (gdn_params_per_token(m) if m.num_linear_layers
                                                                    else 0)
    return mixers + moe_layers * moe + dense_layers * dense + h * m.vocab_size


def vision_params_per_patch(m: ModelShape) -> float:
    """Matmul parameters per patch: patch embedding, ViT blocks, 1/merge^2 of each merger."""
    if m.vision_depth == 0:
        return 0.0
    hv, group = m.vision_hidden_size, m.spatial_merge_size ** 2
    block = 4 * hv * hv + 2 * hv * m.vision_intermediate_size
    merger = (group * hv) ** 2 + group * hv * m.vision_out_hidden_size
    return m.vision_patch_dim * hv + m.vision_depth * block + (1 + m.num_deepstack_mergers) * merger / group


def text_flops(m: ModelShape, doc_lengths: Sequence[int] | np.ndarray) -> float:
    """Training FLOPs of the decoder + LM head for packed documents of these token counts."""
    n = np.asarray(doc_lengths, np.float64)
    attn = 6.0 * m.num_attention_layers * m.num_attention_heads * m.head_dim * float(np.sum(n * n))
    gdn = m.num_linear_layers * gdn_core_flops_per_token(m) * float(n.sum()) if m.num_linear_layers else 0.0
    return 6.0 * text_params_per_token(m) * float(n.sum()) + attn + gdn


def vision_flops(m: ModelShape, image_patches: Sequence[int] | np.ndarray) -> float:
    """Training FLOPs of the vision tower + mergers for images of these patch counts."""
    p = np.asarray(image_patches, np.float64)
    attn = 12.0 * m.vision_depth * m.vision_hidden_size * float(np.sum(p * p))
    return 6.0 * vision_params_per_patch(m) * float(p.sum()) + attn


def step_flops(m: ModelShape, doc_lengths: Sequence[int] | np.ndarray,
               image_patches: Sequence[int] | np.ndarray = ()) -> float:
    """Model training FLOPs of one step: text documents + images (see the module docstring)."""
    return text_flops(m, doc_lengths) + vision_flops(m, image_patches)


def _segment_sizes(segment_ids: np.ndarray) -> np.ndarray:
    """Sizes of the segments (ids > 0) of each row of ``segment_ids`` [B, S]."""
    seg = np.asarray(segment_ids).reshape(-1, np.shape(segment_ids)[-1]).astype(np.int64)
    if seg.size == 0:
        return np.zeros((0,), np.int64)
    width = int(seg.max()) + 1
    flat = (np.arange(seg.shape[0])[:, None] * width + seg)[seg > 0]
    counts = np.bincount(flat, minlength=seg.shape[0] * width)
    return counts[counts > 0]


def batch_flops(m: ModelShape, batch: Mapping[str, np.ndarray]) -> float:
    """Model training FLOPs of a host batch (ARCHITECTURE.md keys): documents from ``segment_ids``
    [..., B, S], images from ``patch_segment_ids`` [..., B, P] (either may carry an accumulation axis)."""
    docs = _segment_sizes(batch["segment_ids"])
    images = _segment_sizes(batch["patch_segment_ids"]) if "patch_segment_ids" in batch else ()
    return step_flops(m, docs, images)


def peak_flops(device_kind: str | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one device (by ``jax.devices()[0].device_kind``); None if unknown."""
    if device_kind is None:

        device_kind = jax.devices()[0].device_kind
    for key, value in PEAK_BF16_FLOPS:
        if key.lower() in device_kind.lower():
            return value
    log.info("no peak FLOP/s known for device kind %r: MFU disabled", device_kind)
    return None
