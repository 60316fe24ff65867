"""Parameter counts equal HF's for the same configs (HF built on the meta device, ours abstractly)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from moevlm_jax.model.registry import load_model_config
from moevlm_jax.tools.params import main, param_counts


def _hf_counts(config) -> tuple[int, int]:
    """(total, active) counted on an HF model built on the meta device; active drops the
    (E - k) unused experts' share of each MoE layer's expert tensors."""
    with torch.device("meta"):
        model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**config.to_hf_dict()))
    total = sum(p.numel() for p in model.parameters())
    t = config.text_config
    inactive = 0
    for layer in model.model.language_model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            n = experts.gate_up_proj.numel() + experts.down_proj.numel()
            inactive += n * (t.num_experts - t.num_experts_per_tok) // t.num_experts
    return total, total - inactive


@pytest.mark.parametrize("name", ["tiny", "tiny-v512", "proxy", "qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b"])
def test_counts_match_hf(name):
    config = load_model_config(name)
    ours = param_counts(config)
    total, active = _hf_counts(config)
    assert ours["total"] == total
    assert ours["active"] == active


def test_known_sizes():
    """The published sizes: 30B-A3B is 31.07B parameters; the proxy model 6.15B (bench/README.md)."""
    assert round(param_counts(load_model_config("qwen3-vl-30b-a3b"))["total"] / 1e7) == 3107
    assert round(param_counts(load_model_config("proxy"))["total"] / 1e7) == 615
    assert round(param_counts(load_model_config("qwen3-vl-235b-a22b"))["total"] / 1e9) == 236


def test_cli_prints_total_and_active(capsys):
    main(["--model", "tiny-v512"])
    out = capsys.readouterr().out
    c = param_counts(load_model_config("tiny-v512"))
    assert f"{c['total']:,}" in out and f"{c['active']:,}" in out
