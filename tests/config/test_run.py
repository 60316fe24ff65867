"""A run's model from an HF checkpoint directory: ``--model DIR`` and ``train.init_from=DIR`` alone take the
architecture of a checkpoint transformers saved, as the model registry reads its ``config.json``."""

import json

import pytest

from moevlm_jax.config.run import resolve_raw
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.schema import ConfigError, to_plain


def test_model_dir_is_the_checkpoints_config(hf_models):
    fx = hf_models["dense_mix"]
    want = load_model_config(fx.path)  # config.json as the registry reads it (HF parity: tests/model)
    assert want.text_config.num_experts == 6 and want.tie_word_embeddings  # what transformers wrote
    for ref in (fx.path, f"{fx.path}/config.json"):
        raw, sources = resolve_raw("cpu-default", model=ref)
        assert raw["model"] == to_plain(want)
        assert sources["model"].endswith("config.json")
    raw, _ = resolve_raw("cpu-default", overrides=[f"model={fx.path}"])  # model=DIR is the same as --model DIR
    assert raw["model"] == to_plain(want)


def test_init_from_alone_takes_the_model_from_the_checkpoint(hf_models):
    fx = hf_models["sparse_step"]
    raw, _ = resolve_raw("cpu-default", overrides=[f"train.init_from={fx.path}"])
    assert raw["model"] == to_plain(load_model_config(fx.path))
    assert raw["train"]["init_from"] == fx.path
    # --model given: it wins (a checkpoint of another architecture then fails at load, naming the tensors)
    raw, _ = resolve_raw("cpu-default", model="tiny", overrides=[f"train.init_from={fx.path}"])
    assert raw["model"]["text_config"]["num_experts"] == load_model_config("tiny").text_config.num_experts


def test_a_directory_without_config_json_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="without config.json"):
        resolve_raw("cpu-default", model=str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ConfigError, match="expected a mapping"):
        resolve_raw("cpu-default", model=str(tmp_path))
