"""HF checkpoint import/export: bitwise round trips through transformers, both expert layouts,
sharded files with and without an index, bf16, and clear errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import Qwen3VLMoeForConditionalGeneration

from moevlm_jax.hf import (
    CheckpointError,
    SafetensorsFile,
    checkpoint_entries,
    load_pretrained,
    save_pretrained,
)


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype, k
        assert torch.equal(sa[k], sb[k]), f"{k} changed in the round trip"


def _flat_params(model) -> dict:
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("config_name", ["tiny", "dense_mix", "sparse_step"])
def test_round_trip_bitwise(hf_models, tmp_path, config_name):
    """HF -> load_pretrained -> save_pretrained -> transformers from_pretrained: every tensor equal."""
    fx = hf_models[config_name]
    model, config = load_pretrained(fx.path)
    shard = 20_000 if config_name == "tiny" else 5 * 2**30  # tiny: many shards + index
    save_pretrained(model, config, tmp_path, max_shard_bytes=shard)
    t = config.text_config
    if config_name == "tiny":
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 3
        key = "model.language_model.layers.0.mlp.experts.gate_up_proj"
        shape = SafetensorsFile(tmp_path / index["weight_map"][key]).info(key)[1]
        assert shape == (t.num_experts, t.hidden_size, 2 * t.moe_intermediate_size)  # hub layout
    reloaded = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path).eval()
    _assert_same_state(fx.model, reloaded)
    assert reloaded.config.text_config.to_dict()["num_local_experts"] == fx.model.config.text_config.num_experts


def test_hub_expert_layout_in_shards_without_index(hf_models, tmp_path):
    """Experts stored hub-style ([E, H, 2I] / [E, I, H]) across two files, no index: same weights."""
    fx = hf_models["tiny"]
    tensors = load_file(f"{fx.path}/model.safetensors")
    hub = {}
    for k, v in tensors.items():
        hub[k] = np.ascontiguousarray(v.transpose(0, 2, 1)) if ".mlp.experts." in k else v
    keys = sorted(hub)
    save_file({k: hub[k] for k in keys[: len(keys) // 2]}, str(tmp_path / "part-a.safetensors"), {"format": "pt"})
    save_file({k: hub[k] for k in keys[len(keys) // 2 :]}, str(tmp_path / "part-b.safetensors"), {"format": "pt"})
    shutil.copy(f"{fx.path}/config.json", tmp_path / "config.json")
    e = next(k for k in hub if k.endswith("experts.gate_up_proj"))
    assert hub[e].shape != tensors[e].shape  # the test really changes the layout

    a, _ = load_pretrained(fx.path)
    b, _ = load_pretrained(tmp_path)
    pa, pb = _flat_params(a), _flat_params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


def test_bfloat16_round_trip(hf_models, tmp_path):
    fx = hf_models["sparse_step"]
    src = tmp_path / "src"
    Qwen3VLMoeForConditionalGeneration.from_pretrained(fx.path, dtype=torch.bfloat16).save_pretrained(src)
    model, config = load_pretrained(src, dtype=jax.numpy.bfloat16)
    assert all(np.asarray(v[...]).dtype == ml_dtypes.bfloat16 for _, v in nnx.to_flat_state(nnx.state(model)))
    save_pretrained(model, config, tmp_path / "out")
    a = Qwen3VLMoeForConditionalGeneration.from_pretrained(src, dtype=torch.bfloat16)
    b = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "out", dtype=torch.bfloat16)
    _assert_same_state(a, b)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"


def test_checkpoint_entries_cover_hf_state_dict(hf_models):
    for fx in hf_models.values():
        from moevlm_jax.model.config import ModelConfig

        config = ModelConfig.from_hf_dict(fx.model.config.to_dict())
        keys = {e.hf_key for e in checkpoint_entries(config)}
        hf_keys = set(fx.model.state_dict())
        if fx.model.config.tie_word_embeddings:
            hf_keys.discard("lm_head.weight")
        assert keys == hf_keys


def _corrupt(hf_path: str, tmp_path, mutate) -> str:
    out = tmp_path / "bad"
    shutil.copytree(hf_path, out)
    tensors = load_file(str(out / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    return str(out)


Q = "model.language_model.layers.1.self_attn.q_proj.weight"


@pytest.mark.parametrize("case, pattern", [
    ("missing", f"missing tensor {Q}"),
    ("unexpected", "unexpected tensor model.visual.extra.weight"),
    ("shape", f"tensor {Q} has shape"),
    ("dtype", f"tensor {Q} .* has dtype I32"),
    ("experts_shape", "tensor model.language_model.layers.0.mlp.experts.down_proj has shape"),
])
def test_bad_checkpoint_names_the_tensor(hf_models, tmp_path, case, pattern):
    def mutate(t):
        if case == "missing":
            del t[Q]
        elif case == "unexpected":
            t["model.visual.extra.weight"] = np.zeros((2,), np.float32)
        elif case == "shape":
            t[Q] = t[Q][:-1]
        elif case == "dtype":
            t[Q] = t[Q].astype(np.int32)
        elif case == "experts_shape":
            k = "model.language_model.layers.0.mlp.experts.down_proj"
            t[k] = t[k][:, :-1]

    with pytest.raises(CheckpointError, match=pattern):
        load_pretrained(_corrupt(hf_models["tiny"].path, tmp_path, mutate))


def test_unreadable_files(hf_models, tmp_path):
    bad = tmp_path / "garbage"
    shutil.copytree(hf_models["tiny"].path, bad)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match=r"unreadable safetensors file .*model.safetensors"):
        load_pretrained(bad)

    short = tmp_path / "truncated"
    shutil.copytree(hf_models["tiny"].path, short)
    data = (short / "model.safetensors").read_bytes()
    (short / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=r"tensor \S+ in .*data offsets"):
        load_pretrained(short)

    missing_shard = tmp_path / "index"
    shutil.copytree(hf_models["tiny"].path, missing_shard)
    keys = list(load_file(str(missing_shard / "model.safetensors")))
    index = {"weight_map": {k: "model-00002-of-00002.safetensors" for k in keys}}
    (missing_shard / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_pretrained(missing_shard)
