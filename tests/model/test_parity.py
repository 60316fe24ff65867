"""Float32 parity with HF transformers, per model family (the same tests on each family's random HF
models): Qwen3VLMoeForConditionalGeneration (moevlm_jax.model.qwen3_vl_moe) and
Qwen3_5MoeForConditionalGeneration (moevlm_jax.model.qwen3_5_moe). Logits, LM loss and router aux loss
on batches without images, with one image, and with several images of different sizes across samples
(left padding), and the HF-style eager call, for several configs of each family:

- Qwen3-VL-MoE (tests/model/hf_reference.py): GQA ratios, expert counts, top-k, deepstack indexes,
  dense layers mixed in, tied embeddings, attention bias;
- Qwen3.5-MoE (tests/model/qwen3_5_reference.py): three layer patterns ([lin, lin, lin, full],
  [lin, full], [full, lin]) with different GQA ratios, GDN head groupings, rotary shares and
  shared-expert sizes.

Qwen3.5 only: packed rows (each sample as HF computes it alone: HF's own GDN path would leak state across
packed samples); the HF checkpoint round trip (bitwise, both directions); multi-token-prediction weights
skipped; parameter counts of the released 35B-A3B shapes against HF's; the new recompute names in the
traced program; scanned + remat'd stacks against unrolled (the Qwen3-VL counterparts of the last two:
test_recompute.py, test_compute.py; its checkpoint round trip: tests/hf/test_checkpoint.py).

Tolerances are relative to scale: max |ours - ref| <= 1e-4 * max |ref| (float32). The random Qwen3.5
models are conditioned so that HF float32 itself is within 5e-5 of HF float64 (qwen3_5_reference.build_hf).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from moevlm_jax.data.batch import hf_inputs_to_batch, hf_labels_to_targets
from moevlm_jax.hf import load_pretrained, save_pretrained
from moevlm_jax.hf.checkpoint import abstract_model, checkpoint_entries
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.eager import jit_forward
from moevlm_jax.model.loss import load_balancing_loss
from moevlm_jax.model.qwen3_5_config import Qwen35ModelConfig
from moevlm_jax.model.registry import load_model_config
from tests.families import PerFamily
from tests.model import hf_reference, qwen3_5_reference
from tests.model.hf_reference import IMAGE, V_END, V_START, VIDEO, HFBatch, HFFixture, make_batches, make_video_batch
from tests.model.qwen3_5_reference import hf_forward as hf_forward_35

CONFIGS = {"qwen3_vl": ["tiny", "dense_mix", "sparse_step"], "qwen3_5": ["tiny", "lin_full", "full_lin"]}
HF_FORWARD = {"qwen3_vl": hf_reference.hf_forward, "qwen3_5": qwen3_5_reference.hf_forward}
BATCHES = ["text", "one_image", "multi"]
NUM_PATCHES = 40  # one patch bucket for all batches (text-only too): one compile per config
# Unrolled layers compile faster on CPU; test_compute.py checks scan == unrolled.
COMPUTE = ComputeConfig(dtype="float32", param_dtype="float32", scan_layers=False)
TOL = 1e-4


def masked_ce(logits: np.ndarray, targets: np.ndarray, loss_mask: np.ndarray) -> float:
    """Mean next-token cross-entropy over loss_mask, in float64 numpy."""
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    nll = lse - np.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return float((nll * loss_mask).sum() / loss_mask.sum())


def _rel(ours, ref) -> float:
    """max |ours - ref| / max |ref| (float64)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def _qwen3_5_hf_models(tmp_path_factory) -> dict[str, HFFixture]:
    """Each Qwen3.5 config as a random HF model saved with transformers' save_pretrained."""
    out = {}
    for seed, (name, cfg) in enumerate(qwen3_5_reference.config_dicts().items()):
        model = qwen3_5_reference.build_hf(cfg, seed)
        path = tmp_path_factory.mktemp(f"hf35_{name}")
        model.save_pretrained(path)
        out[name] = HFFixture(name, cfg, model, str(path))
    return out


@pytest.fixture(scope="module")
def hf(hf_models, tmp_path_factory):
    """family -> {config name: HFFixture}: Qwen3-VL's the session's ``hf_models`` (tests/conftest.py),
    Qwen3.5's built here on first use, once for the module."""
    return PerFamily(lambda family: hf_models if family == "qwen3_vl" else _qwen3_5_hf_models(tmp_path_factory))


@pytest.fixture(scope="module")
def ours(hf):
    """family -> {config name: (our model, config)} loaded from the HF files."""
    return PerFamily(lambda family: {name: load_pretrained(f.path, compute=COMPUTE) for name, f in hf[family].items()})


@pytest.fixture(scope="module")
def batches():
    return make_batches()


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize(("family", "config_name"), [(f, c) for f, names in CONFIGS.items() for c in names])
def test_logits_and_losses_match_hf(hf, ours, batches, family, config_name, batch_name):
    model, config = ours[family][config_name]
    hb = batches[batch_name]
    ref = HF_FORWARD[family](hf[family][config_name].model, hb)

    batch = hf_inputs_to_batch(config, hb.input_ids, hb.pixel_values, hb.image_grid_thw, hb.attention_mask,
                               num_patches=NUM_PATCHES)
    logits, aux = jit_forward(model, batch)
    logits = np.asarray(logits)
    t = config.text_config
    if family == "qwen3_5":  # every layer MoE: the router's expert counts of each layer
        assert aux["router"]["expert_counts"].shape == (t.num_hidden_layers, 3, t.num_experts)
    aux_loss = float(load_balancing_loss(aux["router"], t.num_experts))

    valid = hb.attention_mask == 1
    ref_logits = ref.logits.numpy()
    err = _rel(logits[valid], ref_logits[valid])
    assert err <= TOL, f"logits differ by {err} of their scale"

    targets, loss_mask = hf_labels_to_targets(hb.labels)
    np.testing.assert_allclose(aux_loss, ref.aux_loss.item(), rtol=TOL)
    ce = masked_ce(logits, targets, loss_mask)
    np.testing.assert_allclose(ce + t.router_aux_loss_coef * aux_loss, ref.loss.item(), rtol=TOL)
    assert aux_loss > 0.5  # a real load-balancing value (1.0 = perfectly balanced), not a zero


@pytest.mark.parametrize(("family", "batch_name"), [("qwen3_vl", "multi"), ("qwen3_vl", "text"), ("qwen3_5", "multi")])
def test_eager_call_matches_hf(hf, ours, batches, family, batch_name):
    """The HF-style ``model(input_ids, pixel_values, image_grid_thw, attention_mask)`` entry (for
    a text-only batch: the path without any vision inputs)."""
    model, _ = ours[family]["tiny"]
    hb = batches[batch_name]
    logits = np.asarray(model(hb.input_ids, hb.pixel_values, hb.image_grid_thw, hb.attention_mask))
    ref = HF_FORWARD[family](hf[family]["tiny"].model, hb, labels=False).logits.numpy()
    valid = hb.attention_mask == 1
    assert logits.shape == ref.shape
    assert _rel(logits[valid], ref[valid]) <= TOL


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_video_and_image_logits_match_hf(hf, ours, family):
    """A batch with videos beside an image and a text row (``make_video_batch``: each temporal patch its own span
    between timestamp texts, as HF's processor writes them), through HF's ``pixel_values_videos`` /
    ``video_grid_thw``: the vision tower runs the frame pairs (attention within each), the merged tokens and
    (Qwen3-VL) DeepStack features land on the ``<|video_pad|>`` positions, MRoPE per temporal patch; logits and LM
    loss equal HF's. Also through the HF-style eager call."""
    model, config = ours[family]["tiny"]
    hb = make_video_batch(config.vision_config.patch_dim)
    ref = HF_FORWARD[family](hf[family]["tiny"].model, hb)
    batch = hf_inputs_to_batch(config, hb.input_ids, hb.pixel_values, hb.image_grid_thw, hb.attention_mask,
                               num_patches=NUM_PATCHES + 24, pixel_values_videos=hb.pixel_values_videos,
                               video_grid_thw=hb.video_grid_thw)
    # row 0: the image's 16 patches, then the video's 2 x 24 in token order; one vision segment per frame pair
    assert (batch["patch_segment_ids"][0] > 0).sum() == 16 + 48 and batch["patch_segment_ids"][0].max() == 3
    assert (batch["input_ids"] == VIDEO).sum() == 12 + 6
    logits = np.asarray(jit_forward(model, batch)[0])
    valid = hb.attention_mask == 1
    ref_logits = ref.logits.numpy()
    assert _rel(logits[valid], ref_logits[valid]) <= TOL
    targets, loss_mask = hf_labels_to_targets(hb.labels)
    np.testing.assert_allclose(masked_ce(logits, targets, loss_mask), ref.loss.item() - config.text_config
                               .router_aux_loss_coef * ref.aux_loss.item(), rtol=TOL)
    video_rows = np.isin(np.arange(3), [0, 1])
    without = np.asarray(jit_forward(model, {**batch, "pixel_values": batch["pixel_values"] * 0})[0])
    assert _rel(without[video_rows][valid[video_rows]], ref_logits[video_rows][valid[video_rows]]) > 1e-2  # used
    eager = np.asarray(model(hb.input_ids, hb.pixel_values, hb.image_grid_thw, hb.attention_mask,
                             hb.pixel_values_videos, hb.video_grid_thw))
    assert _rel(eager[valid], ref_logits[valid]) <= TOL


# ----------------------------------------------------------------------------- Qwen3.5 only

@pytest.fixture(scope="module")
def hf35(hf):
    return hf["qwen3_5"]


@pytest.fixture(scope="module")
def ours35(ours):
    return ours["qwen3_5"]


def _sample(rng, n_text: int, grid: tuple[int, int, int] | None, patch_dim: int):
    """One sample: random text ids with (optionally) one image after the first 3 tokens."""
    ids = list(rng.integers(0, 400, n_text))
    pixels = None
    if grid is not None:
        tokens = math.prod(grid) // 4
        ids = ids[:3] + [V_START] + [IMAGE] * tokens + [V_END] + ids[3:]
        pixels = rng.standard_normal((math.prod(grid), patch_dim)).astype(np.float32)
    return np.asarray(ids, np.int64), pixels, grid


def _packed_batch(config, rows, seq_len: int, num_patches: int, unpacked: bool = False) -> dict:
    """The batch of ARCHITECTURE.md for rows of samples, each sample with its own positions (from 0)
    and segment id 1, 2, ...; ``unpacked``: one segment id for all of a row's samples instead."""
    b, pd = len(rows), config.vision_config.patch_dim
    batch = {"input_ids": np.zeros((b, seq_len), np.int32), "positions": np.zeros((3, b, seq_len), np.int32),
             "segment_ids": np.zeros((b, seq_len), np.int32),
             "pixel_values": np.zeros((b, num_patches, pd), np.float32),
             "patch_rc": np.zeros((b, num_patches, 2), np.int32), "patch_hw": np.zeros((b, num_patches, 2), np.int32),
             "patch_segment_ids": np.zeros((b, num_patches), np.int32)}
    for r, samples in enumerate(rows):
        pos, patch, frame = 0, 0, 0
        for k, (ids, pixels, grid) in enumerate(samples):
            one = hf_inputs_to_batch(config, ids[None], pixels, None if grid is None else np.asarray([grid]))
            n = len(ids)
            batch["input_ids"][r, pos:pos + n] = ids
            batch["positions"][:, r, pos:pos + n] = one["positions"][:, 0]
            batch["segment_ids"][r, pos:pos + n] = 1 if unpacked else k + 1
            if pixels is not None:
                m = len(pixels)
                for key in ("pixel_values", "patch_rc", "patch_hw"):
                    batch[key][r, patch:patch + m] = one[key][0, :m]
                batch["patch_segment_ids"][r, patch:patch + m] = one["patch_segment_ids"][0, :m] + frame
                patch, frame = patch + m, frame + 1
            pos += n
    return batch


def test_qwen3_5_packed_rows_equal_samples_alone(hf35, ours35):
    """Rows packing 3 and 2 samples (text only and with images of different sizes; a GDN chunk edge,
    position 64, inside a sample; padding at the end): each sample's logits equal HF's on that sample
    alone (1e-4 of their scale), so attention, the GDN state and its conv window restart at every
    sample. With one segment id per row instead, later samples differ (> 1e-2): the restart matters."""
    model, config = ours35["tiny"]
    hf = hf35["tiny"].model
    rng = np.random.default_rng(5)
    pd = config.vision_config.patch_dim
    rows = [[_sample(rng, 21, None, pd), _sample(rng, 13, (1, 4, 4), pd), _sample(rng, 28, None, pd)],
            [_sample(rng, 24, (1, 6, 4), pd), _sample(rng, 36, None, pd)]]
    batch = _packed_batch(config, rows, seq_len=72, num_patches=24)
    logits = np.asarray(jit_forward(model, batch)[0])
    leaky = np.asarray(jit_forward(model, _packed_batch(config, rows, 72, 24, unpacked=True))[0])
    for r, samples in enumerate(rows):
        pos = 0
        for k, (ids, pixels, grid) in enumerate(samples):
            n = len(ids)
            one = HFBatch(ids[None], np.ones((1, n), np.int64), ids[None].copy(), pixels,
                          None if grid is None else np.asarray([grid], np.int64))
            ref = hf_forward_35(hf, one, labels=False).logits.numpy()[0]
            assert _rel(logits[r, pos:pos + n], ref) <= TOL, (r, k, _rel(logits[r, pos:pos + n], ref))
            if k > 0:
                assert _rel(leaky[r, pos:pos + n], ref) > 1e-2, (r, k)
            pos += n
        assert np.all(np.isfinite(logits[r, pos:]))  # padding: anything finite


def _tensors(path) -> dict[str, np.ndarray]:
    files = sorted(p for p in Path(path).glob("*.safetensors"))
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("config_name", ["tiny", "lin_full"])
def test_qwen3_5_hf_round_trip_bitwise(hf35, ours35, batches, config_name, tmp_path):
    """HF files -> load_pretrained -> save_pretrained: the same tensors (names, dtypes, bytes; the
    experts one tensor each, as transformers writes them) and a config.json transformers reads as the
    original; transformers loads our directory and computes exactly HF's logits; a sharded save loads
    back to the same parameters."""
    hf, path = hf35[config_name].model, hf35[config_name].path
    model, config = ours35[config_name]
    save_pretrained(model, config, tmp_path / "out")
    theirs, mine = _tensors(path), _tensors(tmp_path / "out")
    assert sorted(mine) == sorted(theirs)
    for key, ref in theirs.items():
        assert mine[key].dtype == ref.dtype and mine[key].shape == ref.shape, key
        assert mine[key].tobytes() == ref.tobytes(), key

    ref_cfg = json.loads((Path(path) / "config.json").read_text())
    again = Qwen3_5MoeConfig(**json.loads((tmp_path / "out" / "config.json").read_text())).to_dict()
    drop = ("transformers_version", "_name_or_path")
    assert {k: v for k, v in again.items() if k not in drop} == \
        {k: v for k, v in Qwen3_5MoeConfig(**ref_cfg).to_dict().items() if k not in drop}
    assert Qwen35ModelConfig.from_hf_dict(config.to_hf_dict(), name=config.name) == config

    reloaded = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    hb = batches["one_image"]
    assert torch.equal(hf_forward_35(reloaded, hb, labels=False).logits, hf_forward_35(hf, hb, labels=False).logits)

    if config_name == "tiny":  # bfloat16 files: the same bytes back too
        hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
        hf.to(torch.float32)
        bf16, _ = load_pretrained(tmp_path / "bf16", dtype=jax.numpy.bfloat16)
        save_pretrained(bf16, config, tmp_path / "bf16_out")
        theirs, mine = _tensors(tmp_path / "bf16"), _tensors(tmp_path / "bf16_out")
        assert sorted(mine) == sorted(theirs)
        assert all(mine[k].dtype == v.dtype and mine[k].tobytes() == v.tobytes() for k, v in theirs.items())

    save_pretrained(model, config, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    back, _ = load_pretrained(tmp_path / "sharded", compute=COMPUTE)
    for a, b in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(back, nnx.Param))):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_qwen3_5_mtp_weights_are_skipped(hf35, tmp_path):
    """Released checkpoints also hold the multi-token-prediction head (mtp.*), which HF's model skips on
    load; so does load_pretrained (any other unexpected tensor stays an error)."""
    path = hf35["full_lin"].path
    shutil.copytree(path, tmp_path / "m")
    save_file({"mtp.fc.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "m" / "mtp.safetensors"))
    load_pretrained(tmp_path / "m", compute=COMPUTE)


@pytest.mark.parametrize("name", ["qwen3.5-35b-a3b", "proxy35", "qwen3.5-tiny"])
def test_qwen3_5_parameter_counts_match_hf(name):
    """Our model (abstract: no memory) has HF's parameter count for the released 35B-A3B shapes (35.1B),
    the proxy and the tiny config (HF's on the meta device), and our name table lists exactly HF's
    tensors (the experts' per-expert names folded into HF's fused parameters)."""
    config = load_model_config(name)
    assert isinstance(config, Qwen35ModelConfig)
    with torch.device("meta"):
        hf = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(**config.to_hf_dict()))
    n_hf = sum(p.numel() for p in hf.parameters())
    model = abstract_model(config)
    n_ours = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n_ours == n_hf
    entries = checkpoint_entries(config)
    assert sum(math.prod(e.hf_shape) for e in entries) == n_hf
    fused = {k.split(".experts.")[0] + ".experts." + ("down_proj" if k.endswith("down_proj.weight") else "gate_up_proj")
             if ".mlp.experts." in k else k for k in (e.hf_key for e in entries)}
    hf_names = {n for n, _ in hf.named_parameters()}
    if not config.tie_word_embeddings:
        assert fused == hf_names
    else:
        assert fused == hf_names - {"lm_head.weight"}
    if name == "qwen3.5-35b-a3b":
        assert 35.0e9 < n_hf < 35.2e9


def test_qwen3_5_checkpoint_names_in_the_program(ours35):
    """The recompute names of the new pieces (gdn_conv, gdn_core, gated_norm) and the existing ones
    they sit among are placed in the decoder's traced program."""
    model, config = ours35["lin_full"]
    batch = hf_inputs_to_batch(config, np.ones((1, 8), np.int32))
    jaxpr = str(jax.make_jaxpr(lambda b: model.hidden_states(b)[0])(batch))
    for name in ("gdn_conv", "gdn_core", "gated_norm", "qkv_proj", "core_attn", "attn_out", "layernorm",
                 "moe_router", "moe", "mlp_hidden", "mlp"):
        assert re.search(rf"name={name}\b", jaxpr), name


def test_qwen3_5_scan_and_remat_match_unrolled(hf35, ours35, batches):
    """The layer stacks scanned (one compiled body per run of one layer type) under full recompute:
    the unrolled model's logits (1e-4 of their scale: XLA fuses the two programs differently, and the
    gated RMSNorm amplifies float32 rounding, ~1e-5 here)."""
    model, config = ours35["tiny"]
    hb = batches["multi"]
    batch = hf_inputs_to_batch(config, hb.input_ids, hb.pixel_values, hb.image_grid_thw, hb.attention_mask,
                               num_patches=NUM_PATCHES)
    scanned, _ = load_pretrained(hf35["tiny"].path,
                                 compute=COMPUTE.replace(scan_layers=True, recompute="full"))
    valid = hb.attention_mask == 1
    want = np.asarray(jit_forward(model, batch)[0])
    assert _rel(np.asarray(jit_forward(scanned, batch)[0])[valid], want[valid]) <= TOL
