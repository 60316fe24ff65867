"""Model FLOPs against hand computation and the yardstick of bench/README.md; the device peak table."""

from __future__ import annotations

import numpy as np
import pytest
import yaml

from moevlm_jax.config import CONFIG_DIR
from moevlm_jax.perf import flops

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


@pytest.mark.parametrize("kind, peak", [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                        ("NVIDIA H100 PCIe", 756e12), ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("cpu", None), ("TFRT_CPU_0", None)])
def test_peak_table(kind, peak):
    assert flops.peak_flops(kind) == peak


def test_peak_of_this_machine_is_unknown_on_cpu():
    assert flops.peak_flops() is None
