"""Model configs round-trip through HF's Qwen3VLMoeConfig; Qwen3.5 configs default as HF's Qwen3_5MoeConfig;
compute configs validate with clear errors."""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from transformers import Qwen3_5MoeConfig, Qwen3VLMoeConfig

from moevlm_jax.config import find_config
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import ModelConfig
from moevlm_jax.model.qwen3_5_config import Qwen35ModelConfig, Qwen35TextConfig, Qwen35VisionConfig
from moevlm_jax.model.registry import load_model_config


@pytest.mark.parametrize("name", ["tiny", "tiny-v512", "proxy", "qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b"])
def test_yaml_configs_round_trip_through_hf(name):
    ours = load_model_config(name)
    hf = Qwen3VLMoeConfig(**ours.to_hf_dict())
    t, v = hf.text_config, hf.vision_config
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == (
        ours.text_config.hidden_size, ours.text_config.num_hidden_layers, ours.text_config.num_attention_heads,
        ours.text_config.num_key_value_heads, ours.text_config.head_dim)
    assert (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size) == (
        ours.text_config.num_experts, ours.text_config.num_experts_per_tok, ours.text_config.moe_intermediate_size)
    assert t.rope_parameters["mrope_section"] == list(ours.text_config.mrope_section)
    assert list(v.deepstack_visual_indexes) == list(ours.vision_config.deepstack_visual_indexes)
    assert hf.image_token_id == ours.image_token_id and hf.tie_word_embeddings == ours.tie_word_embeddings
    again = ModelConfig.from_hf_dict(hf.to_dict())
    assert again.text_config.to_hf_dict()["num_experts"] == ours.text_config.num_experts
    assert again.text_config.layer_kinds == ours.text_config.layer_kinds
    for a, b in ((again.text_config, ours.text_config), (again.vision_config, ours.vision_config)):
        fields = [f for f in a.__dataclass_fields__ if f not in ("extra", "rope_parameters")]
        assert [getattr(a, f) for f in fields] == [getattr(b, f) for f in fields]
        assert a.rope_theta == b.rope_theta


def test_hub_style_config_json():
    """A transformers-4.57 style config.json: rope_theta + rope_scaling, num_experts, old vision model_type."""
    d = {
        "model_type": "qwen3_vl_moe", "image_token_id": 151655,
        "text_config": {"rope_theta": 5000000, "num_experts": 128, "norm_topk_prob": True,
                        "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                         "rope_type": "default"}},
        "vision_config": {"model_type": "qwen3_vl_moe", "depth": 27, "out_hidden_size": 2048},
    }
    c = ModelConfig.from_hf_dict(d)
    assert c.text_config.rope_theta == 5e6 and c.text_config.mrope_section == (24, 20, 20)
    assert c.text_config.extra["norm_topk_prob"] is True
    assert c.text_config.layer_kinds == ("moe",) * 48


def test_layer_kinds_follow_hf_rule():
    c = load_model_config("tiny-v512")
    assert c.replace_text(mlp_only_layers=[0, 3]).text_config.layer_kinds == ("dense", "moe", "moe", "dense")
    assert c.replace_text(decoder_sparse_step=2).text_config.layer_kinds == ("dense", "moe", "dense", "moe")


def test_yaml_typos_are_errors(tmp_path):
    raw = yaml.safe_load(open(find_config("models", "tiny")))
    raw["text_config"]["num_expert"] = 4
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="unknown key 'model.text_config.num_expert'; did you mean 'num_experts'"):
        load_model_config(tmp_path / "bad.yaml")
    with pytest.raises(ValueError, match="mrope_section"):
        load_model_config("tiny-v512").replace_text(head_dim=32)


def test_qwen3_5_config_defaults_and_checks():
    """Our defaults are HF's class defaults (out_hidden_size aside: HF's default 3584 does not fit its
    2048-wide decoder, which we refuse); layer_types from full_attention_interval as HF; clear errors."""
    hf = Qwen3_5MoeConfig().to_dict()
    hf["vision_config"]["out_hidden_size"] = 2048
    ours = Qwen35ModelConfig.from_hf_dict(hf)
    strip = lambda c: dataclasses.replace(c, extra={}, text_config=dataclasses.replace(c.text_config, extra={}),
                                          vision_config=dataclasses.replace(c.vision_config, extra={}))
    default = Qwen35ModelConfig(vision_config=Qwen35VisionConfig(out_hidden_size=2048))
    assert strip(ours).text_config == default.text_config
    assert dataclasses.replace(strip(ours).vision_config, rope_parameters=None) == default.vision_config
    assert ours.text_config.rotary_dim == 64 and ours.text_config.mrope_section == (11, 11, 10)
    t = Qwen35TextConfig(num_hidden_layers=6, full_attention_interval=3)
    hf_types = Qwen3_5MoeConfig(text_config=dict(num_hidden_layers=6, full_attention_interval=3)
                                ).text_config.layer_types
    assert list(t.layer_types) == hf_types == ["linear_attention", "linear_attention", "full_attention"] * 2
    with pytest.raises(ValueError, match="layer_types entries"):
        Qwen35TextConfig(num_hidden_layers=2, layer_types=("linear_attention", "sliding_attention"))
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        Qwen35TextConfig(num_hidden_layers=2, layer_types=("linear_attention",))
    with pytest.raises(ValueError, match="mrope_section"):
        Qwen35TextConfig(rope_parameters={"rope_theta": 1e7, "partial_rotary_factor": 0.5,
                                          "mrope_section": [11, 11, 10]})
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        Qwen35TextConfig(linear_num_key_heads=3, linear_num_value_heads=32)
    # HF's older top-level rotary spellings are folded into rope_parameters, as HF does
    old = Qwen35ModelConfig.from_hf_dict({"text_config": {"rope_theta": 1e6, "partial_rotary_factor": 0.5,
                                                          "mrope_section": [22, 22, 20]},
                                          "vision_config": {"out_hidden_size": 2048}})
    assert (old.text_config.rope_theta, old.text_config.rotary_dim) == (1e6, 128)
    assert type(load_model_config("tiny")) is ModelConfig  # a Qwen3-VL config (no model_type): that family


@pytest.mark.parametrize("kwargs, message", [
    ({"dtype": "fp8"}, "compute.dtype: 'fp8' is not one of"),
    ({"attention": "flash"}, "compute.attention: 'flash' is not one of"),
    ({"recompute": "some"}, "compute.recompute: 'some' is not one of"),
    ({"recompute_modules": ["attn"]}, "compute.recompute_modules"),
    ({"vision_recompute": "all"}, "compute.vision_recompute: 'all' is not one of"),
    ({"offload": ["attention"]}, "compute.offload"),
    ({"recompute": "selective", "offload": ["core_attn"]}, "recomputed or offloaded"),
    ({"capture": "graphs"}, "compute.capture: 'graphs' is not one of"),
    ({"capture": "scopes", "capture_scopes": ["mlp"]}, "compute.capture_scopes"),
    ({"router": {"aux_loss": "seq"}}, "compute.router.aux_loss"),
    ({"router": {"z_loss": 1}}, "unknown key 'compute.router.z_loss'"),
    ({"loss_chunk_size": 0}, "loss_chunk_size"),
])
def test_compute_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ComputeConfig(**kwargs)


def test_compute_config_is_hashable_and_from_dict():
    c = ComputeConfig.from_dict({"dtype": "float32", "moe": {"capacity_factor": 1.25}, "recompute_modules": ["moe"]})
    assert hash(c) == hash(ComputeConfig.from_dict({"dtype": "float32", "moe": {"capacity_factor": 1.25},
                                                    "recompute_modules": ("moe",)}))
    assert c.moe.capacity_factor == 1.25 and c.moe_options["capacity_factor"] == 1.25
    with pytest.raises(ValueError, match="unknown key 'compute.dtyp'; did you mean 'dtype'"):
        ComputeConfig.from_dict({"dtyp": "float32"})


def test_renamed_compute_keys_still_load(caplog):
    """remat / remat_modules are recompute / recompute_modules now: the old names load, with a warning."""
    with caplog.at_level("WARNING"):
        c = ComputeConfig.from_dict({"remat": "full", "remat_modules": ["mlp"]})
    assert c.recompute == "full" and c.recompute_modules == ("mlp",)
    assert "'compute.remat' is deprecated: it is now 'compute.recompute'" in caplog.text
