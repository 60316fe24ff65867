"""The HF reference for the Qwen3.5-MoE tests: small random HF ``Qwen3_5MoeForConditionalGeneration``
configs and models, and HF's forward on the batches of :func:`tests.model.hf_reference.make_batches`."""

from __future__ import annotations

import logging

import torch
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from moevlm_jax.model.registry import load_model_config
from tests.model.hf_reference import TOKENS, HFBatch

logging.getLogger("transformers").setLevel(logging.ERROR)  # the "falling back to PyTorch" kernel notices

LIN, FULL = "linear_attention", "full_attention"
_VISION = dict(depth=2, hidden_size=32, intermediate_size=40, num_heads=2, num_position_embeddings=36)


def _rope(theta: float, factor: float, sections: list[int] | None) -> dict:
    rope = dict(rope_type="default", rope_theta=theta, partial_rotary_factor=factor)
    if sections is not None:
        rope.update(mrope_section=sections, mrope_interleaved=True)
    return rope


def config_dicts() -> dict[str, dict]:
    """HF config dicts (vocabulary 512, so that the image / vision tokens 500-503 of make_batches fit):

    - "tiny": configs/models/qwen3.5-tiny.yaml (the 3:1 pattern [lin, lin, lin, full]; GQA 2;
      head_dim 32, partial rotary 0.25; GDN 2 key / 4 value heads (each key head serves 2 value
      heads); 8 experts top-2 + a shared expert; tied embeddings) with the small vocabulary.
    - "lin_full": [lin, full] from full_attention_interval 2 (no layer_types); GQA 4 (4 q / 1 kv);
      head_dim 16, partial rotary 0.5; attention bias; GDN 1 key / 2 value heads, key dim 12 != value
      dim 8; 6 experts top-3 + a shared expert of 24; untied.
    - "full_lin": [full, lin] (full attention first); MHA (2 / 2); head_dim 8, full rotary (partial
      1.0); GDN 2 / 2 heads (no grouping), conv kernel 3; 4 experts top-1, shared expert 16 > expert 12;
      one vision block.
    """
    tiny = load_model_config("qwen3.5-tiny").to_hf_dict()
    tiny["text_config"]["vocab_size"] = 512
    tiny.update(TOKENS)
    lin_full = dict(
        text_config=dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, full_attention_interval=2,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=16, attention_bias=True,
                         rope_parameters=_rope(5e6, 0.5, [2, 1, 1]), linear_num_key_heads=1, linear_num_value_heads=2,
                         linear_key_head_dim=12, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                         moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=6,
                         num_experts_per_tok=3, router_aux_loss_coef=0.01),
        vision_config=dict(_VISION, out_hidden_size=32), **TOKENS)
    full_lin = dict(
        text_config=dict(vocab_size=512, hidden_size=24, num_hidden_layers=2, layer_types=[FULL, LIN],
                         num_attention_heads=2, num_key_value_heads=2, head_dim=8,
                         rope_parameters=_rope(1e4, 1.0, [2, 1, 1]), linear_num_key_heads=2, linear_num_value_heads=2,
                         linear_key_head_dim=6, linear_value_head_dim=6, linear_conv_kernel_dim=3,
                         moe_intermediate_size=12, shared_expert_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=1),
        vision_config=dict(_VISION, depth=1, out_hidden_size=24), **TOKENS)
    return {"tiny": tiny, "lin_full": lin_full, "full_lin": full_lin}


def build_hf(config: dict, seed: int) -> Qwen3_5MoeForConditionalGeneration:
    """A random HF model with O(1) activations: weights ~ N(0, 1/fan_in); zero-centred norm weights
    ~ N(0, 0.1) (i.e. scales 1 + N(0, 0.1)), the GDN gated norm ~ 1 + N(0, 0.1); biases ~ N(0, 0.1),
    dt_bias ~ N(0, 1); router weights large enough that top-k choices are clear-cut.

    A_log ~ log U(0.05, 0.5), not HF's log U(0.01, 16): with HF's strong decay the GDN state holds
    about one token, its output is a scalar times one value vector, and where that scalar is near 0
    the gated RMSNorm divides by a near-zero RMS (seen: 1e-5 against a median of 1e-2). The model is
    then ill-conditioned: HF float32 itself is up to 1.5e-3 (relative to the logit scale) from HF
    float64 on these configs. With the state holding several tokens its output is a sum of several
    value vectors, rarely near 0, and HF float32 stays within 5e-5 of float64."""
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "norm" in name and name.endswith("weight") and "visual" not in name:
                p.copy_(0.1 * torch.randn_like(p))  # zero-centred: (1 + weight)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))  # the vision LayerNorms
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("A_log"):  # mild decay: the state holds several tokens (see the docstring)
                p.copy_(torch.empty_like(p).uniform_(0.05, 0.5).log())
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
            elif "experts" in name and "shared" not in name:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)  # transformers keeps [E, out, in]
            else:
                fan_in = p[0].numel() if p.ndim > 1 else p.shape[-1]
                p.copy_(torch.randn_like(p) / fan_in**0.5)
    return model


def hf_forward(model: Qwen3_5MoeForConditionalGeneration, batch: HFBatch, labels: bool = True):
    """HF outputs (logits, loss incl. router aux, aux loss) for an HFBatch, router logits on."""
    kw = dict(input_ids=torch.tensor(batch.input_ids), attention_mask=torch.tensor(batch.attention_mask),
              output_router_logits=True, **batch.hf_kwargs())
    if labels:
        kw["labels"] = torch.tensor(batch.labels)
    with torch.no_grad():
        return model(**kw)


def tiny_hf(layer_types: list[str]) -> Qwen3_5MoeForConditionalGeneration:
    """The "tiny" config's random HF model (vocabulary 512, conditioned as :func:`build_hf`) with these
    decoder layers."""
    cfg = config_dicts()["tiny"]
    cfg["text_config"] = {**cfg["text_config"], "layer_types": layer_types, "num_hidden_layers": len(layer_types)}
    return build_hf(cfg, 0)
