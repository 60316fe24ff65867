"""Layout validation: every preset fits the tiny model on 8 devices; each kind of misfit is reported
before compiling, all at once, naming the model field, logical axis, mesh axes and sizes."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.parallelism.validate import LayoutError, validate_layout

PRESETS = ("fsdp", "tp", "ep", "tp_ep", "ep_etp", "cp", "folded")


@pytest.fixture(scope="module")
def tiny():
    return load_model_config("tiny-v512")


def _layout(mesh, *rules, options=None):
    return load_layout({"name": "test", "mesh": mesh, "rules": [list(r) for r in rules],
                             "options": options or {}})


@pytest.mark.parametrize("name", PRESETS)
def test_presets_fit_the_tiny_model(tiny, name, caplog):
    with caplog.at_level(logging.WARNING, "moevlm_jax.parallelism.validate"):
        warnings = validate_layout(tiny, load_layout(name), batch_size=8, seq_len=32, num_devices=8)
    # the guide's advice: ETP while EP alone would fit
    assert bool(warnings) == (name in ("tp", "ep_etp"))
    assert all("expert tensor parallelism" in w for w in warnings)
    assert len(caplog.records) == len(warnings)


def test_plus_aliases_name_the_same_presets():
    assert load_layout("tp+ep") == load_layout("tp_ep")
    assert load_layout("ep+etp").rules == load_layout("ep_etp").rules


def test_mesh_product_must_match_the_devices(tiny):
    with pytest.raises(LayoutError, match=r"multiply to 8 devices but 6 are available"):
        validate_layout(tiny, _layout({"fsdp": 2, "tensor": 4}), num_devices=6)
    with pytest.raises(LayoutError, match=r"multiply to 4, which does not divide the 6 devices, so -1 on 'fsdp'"):
        validate_layout(tiny, load_layout("folded"), num_devices=6)


def test_every_divisibility_problem_is_reported_at_once(tiny):
    model = tiny.replace_text(num_attention_heads=6, num_key_value_heads=3, vocab_size=509, num_experts=6)
    layout = _layout({"fsdp": 2, "expert": 4}, ["q_heads", "fsdp"], ["vocab", "fsdp"], ["exp", "expert"],
                     ["act_batch", "fsdp"], ["act_norm_seq", "expert"])
    with pytest.raises(LayoutError) as err:
        validate_layout(model, layout, batch_size=3, seq_len=30, num_devices=8)
    text = str(err.value)
    assert text.startswith("layout 'test' does not fit model 'tiny-v512' on mesh fsdp=2 x expert=4:")
    for want in (("text_config.vocab_size = 509 does not divide over the 2 devices of mesh axes fsdp=2 that "
                  "logical axis 'vocab' maps to"),
                 ("text_config.num_experts = 6 does not divide over the 4 devices of mesh axes expert=4 that "
                  "logical axis 'exp' maps to"),
                 ("batch rows (micro batch x data parallel) = 3 does not divide over the 2 devices of mesh axes "
                  "fsdp=2 that logical axis 'act_batch' maps to"),
                 ("sequence length = 30 does not divide over the 4 devices of mesh axes expert=4 that logical "
                  "axis 'act_norm_seq' maps to")):
        assert want in text, text
    assert "num_attention_heads" not in text  # 6 heads over fsdp=2 divide
    assert text.count("\n  ") == 4, text


def test_kv_heads_fewer_than_tensor_axis_says_how_to_replicate(tiny):
    layout = _layout({"fsdp": 2, "tensor": 4}, ["q_heads", "tensor"], ["kv_heads", "tensor"])
    with pytest.raises(LayoutError, match=r"num_key_value_heads = 2 does not divide over the 4 devices of mesh "
                                          r"axes tensor=4 .* map kv_heads and act_kv_heads to null"):
        validate_layout(tiny, layout, num_devices=8)


def test_vision_and_expert_widths(tiny):
    v = dataclasses.replace(tiny.vision_config, num_heads=4, intermediate_size=62)
    model = dataclasses.replace(tiny, vision_config=v).replace_text(moe_intermediate_size=30)
    layout = _layout({"fsdp": 2, "tensor": 4}, ["vis_heads", "tensor"], ["vis_mlp", "tensor"], ["moe_mlp", "tensor"])
    with pytest.raises(LayoutError) as err:
        validate_layout(model, layout, num_devices=8)
    text = str(err.value)
    assert "vision_config.intermediate_size = 62" in text and "logical axis 'vis_mlp'" in text
    assert "text_config.moe_intermediate_size = 30" in text and "logical axis 'moe_mlp'" in text
    assert "vision_config.num_heads" not in text


def test_unknown_names_in_rules(tiny):
    layout = _layout({"fsdp": 8}, ["act_seqs", "fsdp"], ["embed", "fdsp"])
    with pytest.raises(LayoutError) as err:
        validate_layout(tiny, layout, num_devices=8)
    assert "unknown logical axis 'act_seqs'" in str(err.value)
    assert "unknown mesh axes ['fdsp']" in str(err.value)


def test_token_rows_not_following_the_residual_stream_warn(tiny):
    layout = _layout({"fsdp": 2, "tensor": 4}, ["act_batch", "fsdp"], ["act_norm_seq", "tensor"],
                     ["act_tokens", "fsdp"])
    warnings = validate_layout(tiny, layout, batch_size=8, seq_len=32, num_devices=8)
    assert any("reshuffles its rows" in w and "['fsdp', 'tensor']" in w for w in warnings)


def test_pipeline_options_are_checked_early(tiny):
    with pytest.raises(ValueError, match="layout.options.pipeline.schedule: 'zigzag' is not one of"):
        _layout({"stage": 2, "fsdp": -1}, ["layers", "stage"], options={"pipeline": {"schedule": "zigzag"}})
    layout = _layout({"stage": 2, "fsdp": -1}, ["layers", "stage"],
                     options={"pipeline": {"schedule": "circular", "microbatches": 1}})
    with pytest.raises(LayoutError, match="microbatches >= stages"):
        validate_layout(tiny, layout, num_devices=8)
