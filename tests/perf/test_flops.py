"""Model FLOPs (``moevlm_jax.perf.flops``, the MFU numerator) against hand computation and the yardstick of
bench/README.md, for both model families; the device peak table.

Qwen3.5-MoE: gated attention (q_proj with the output gate; the n^2 term on full-attention layers only),
Gated DeltaNet projections + conv and its chunked delta rule, routed + shared experts; the shape read from
a config (any family, by the registry) agrees with the model's own parameters; a Qwen3-VL config is
unchanged by the hybrid fields."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
import yaml
from flax import nnx

from moevlm_jax.config import CONFIG_DIR
from moevlm_jax.hf import abstract_model
from moevlm_jax.model.qwen3_5_gdn import GDN_CHUNK_SIZE
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.perf import flops
from moevlm_jax.perf.flops import flops_shape

SMALL = flops.ModelShape(
    hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
    vocab_size=10, moe_intermediate_size=6, num_experts=4, num_experts_per_tok=2,
    vision_depth=1, vision_hidden_size=4, vision_intermediate_size=8, vision_num_heads=2,
    vision_out_hidden_size=8, vision_patch_dim=12, spatial_merge_size=2, num_deepstack_mergers=1,
)


def test_small_model_by_hand():
    # decoder token: q 8*8 + k,v 2*8*4 + o 8*8 = 192; router 8*4 = 32; 2 experts x 3 x 8*6 = 288;
    # 2 layers -> 1024; LM head 8*10 = 80 -> 1104
    assert flops.text_params_per_token(SMALL) == 1104
    # patch: embed 12*4 = 48; block 4*4*4 + 2*4*8 = 128; 2 mergers x (16*16 + 16*8) / 4 = 192 -> 368
    assert flops.vision_params_per_patch(SMALL) == 368
    # documents of 3 and 5 tokens: 6*1104*8 + causal attention 6*2 layers*2 heads*4*(9+25)
    assert flops.text_flops(SMALL, [3, 5]) == 6 * 1104 * 8 + 6 * 2 * 2 * 4 * 34 == 56256
    # images of 4 and 8 patches: 6*368*12 + bidirectional attention 12*1 layer*4 hidden*(16+64)
    assert flops.vision_flops(SMALL, [4, 8]) == 6 * 368 * 12 + 12 * 4 * 80 == 30336
    assert flops.step_flops(SMALL, [3, 5], [4, 8]) == 56256 + 30336


def test_dense_and_shared_expert_layers():
    m = flops.ModelShape(hidden_size=8, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=4, vocab_size=10, moe_intermediate_size=6, num_experts=4,
                         num_experts_per_tok=2, num_moe_layers=2, intermediate_size=16,
                         shared_expert_intermediate_size=5)
    attn = 8 * 8 * 4
    moe = 8 * 4 + 2 * 3 * 8 * 6 + 3 * 8 * 5 + 8  # router, top-2 experts, shared expert + its gate
    assert flops.text_params_per_token(m) == 3 * attn + 2 * moe + 3 * 8 * 16 + 80
    hf = {"text_config": {"hidden_size": 8, "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 4,
                          "vocab_size": 10, "num_experts": 4, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 6, "intermediate_size": 16, "mlp_only_layers": [1],
                          "shared_expert_intermediate_size": 5}}
    assert flops.ModelShape.from_config(hf) == m  # layer 1 dense via mlp_only_layers; kv heads default


def test_batch_flops_reads_documents_and_images():
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 0, 0], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]])
    pseg = np.array([[1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2], [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
    got = flops.batch_flops(SMALL, {"segment_ids": seg, "patch_segment_ids": pseg})
    assert got == flops.step_flops(SMALL, [3, 5, 4], [4, 8, 4])
    accum = {"segment_ids": np.stack([seg, seg]), "patch_segment_ids": np.stack([pseg, pseg])}  # [G, B, S]
    assert flops.batch_flops(SMALL, accum) == 2 * got
    assert flops.batch_flops(SMALL, {"segment_ids": seg}) == flops.text_flops(SMALL, [3, 5, 4])


def test_proxy_matches_design_yardstick():
    """bench/README.md: proxy, MBS 2 x 4096 tokens, 4 images of 784 patches each, 342 ms/step ~ 180 TFLOP/s."""
    raw = yaml.safe_load((CONFIG_DIR / "models" / "proxy.yaml").read_text())
    m = flops.ModelShape.from_config(raw)
    assert (m.hidden_size, m.num_hidden_layers, m.num_experts, m.vision_depth, m.num_deepstack_mergers,
            m.vision_patch_dim) == (2048, 8, 128, 27, 3, 1536)
    per_step = flops.step_flops(m, [4096, 4096], [784] * 8)
    assert per_step / 0.342 == pytest.approx(180e12, rel=0.03)


SMALL_HYBRID = flops.ModelShape(  # Qwen3.5-style: 1 GDN + 1 full-attention layer
    hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=10,
    moe_intermediate_size=6, num_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=5,
    num_linear_layers=1, attn_output_gate=True, linear_num_key_heads=1, linear_num_value_heads=2,
    linear_key_head_dim=4, linear_value_head_dim=3, linear_conv_kernel_dim=2, gdn_chunk_size=4,
)


def test_small_hybrid_model_by_hand():
    # full attention: q_proj with the gate 8 x (2 heads x 2 x 4) = 128, k, v 2 x 8 x 4 = 64, o 8 x 8 = 64 -> 256
    # GDN: in_proj_qkv 8 x (2*1*4 + 2*3 = 14) = 112, z 8 x 6 = 48, a, b 2 x 8 x 2 = 32, out 6 x 8 = 48,
    #      conv 2 x 14 = 28 -> 268
    # MoE (both layers): router 8 x 4 = 32, 2 experts x 3 x 8 x 6 = 288, shared 3 x 8 x 5 + its gate 8 = 128 -> 448
    # LM head 8 x 10 = 80
    assert flops.gdn_params_per_token(SMALL_HYBRID) == 268
    assert flops.text_params_per_token(SMALL_HYBRID) == 256 + 268 + 2 * 448 + 80 == 1500
    # delta rule per token and value head (C 4, Dk 4, Dv 3): C (3 Dk + 2 Dv) = 72, inverse (C^2 - 1) / 3 = 5,
    # three state products 3 Dk Dv = 36 -> 113 MACs; x 2 value heads x 6 -> 1356 FLOPs
    assert flops.gdn_core_flops_per_token(SMALL_HYBRID) == 6 * 2 * 113 == 1356
    # documents of 3 and 5 tokens: 6 x 1500 x 8 + attention on the 1 full layer 6 x 2 heads x 4 x (9 + 25)
    # + the GDN core 1356 x 8
    assert flops.text_flops(SMALL_HYBRID, [3, 5]) == 6 * 1500 * 8 + 6 * 1 * 2 * 4 * 34 + 1356 * 8 == 84480


@pytest.mark.parametrize("name", ["qwen3.5-tiny", "proxy35"])
def test_shape_from_config_matches_the_model(name):
    """flops.ModelShape.from_config of a Qwen3.5 config (what the train loop and the sweep call) reads its
    hybrid layers, and its matmul parameters per token are the model's own: the active parameters of the
    abstract model less norms, GDN gate constants and the vision tower, plus the LM head (tied or not)."""
    config = load_model_config(name)
    t = config.text_config
    m = flops.ModelShape.from_config(config)
    assert m == flops_shape(config) == flops.ModelShape.from_config(config.to_hf_dict())  # object or config.json
    assert m.num_linear_layers == sum(k == "linear_attention" for k in t.layer_types) and m.attn_output_gate
    assert m.gdn_chunk_size == GDN_CHUNK_SIZE and m.num_moe_layers == t.num_hidden_layers
    state = nnx.state(abstract_model(config), nnx.Param)
    decoder = state["language_model"]
    size = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))
    # stacked parameters hold every layer's weights; a token runs each layer once
    matmul = sum(math.prod(x.shape) for p, x in jax.tree_util.tree_flatten_with_path(decoder)[0]
                 if not any(s in jax.tree_util.keystr(p) for s in ("norm", "A_log", "dt_bias", "embed_tokens")))
    inactive = (t.num_hidden_layers * (t.num_experts - t.num_experts_per_tok) * 3 * t.hidden_size
                * t.moe_intermediate_size)
    assert flops.text_params_per_token(m) == matmul - inactive + t.hidden_size * t.vocab_size
    assert size(decoder["embed_tokens"]) == t.hidden_size * t.vocab_size


def test_qwen3_vl_unchanged_by_the_hybrid_fields():
    """A Qwen3-VL config (no GDN layers, no gate): every layer pays attention, as before."""
    m = flops.ModelShape.from_config(load_model_config("tiny"))
    assert m.num_linear_layers == 0 and not m.attn_output_gate and m.num_attention_layers == m.num_hidden_layers


@pytest.mark.parametrize("kind, peak", [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                        ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("cpu", None), ("TFRT_CPU_0", None)])
def test_peak_table(kind, peak):
    assert flops.peak_flops(kind) == peak


def test_peak_of_this_machine_is_unknown_on_cpu():
    assert flops.peak_flops() is None
