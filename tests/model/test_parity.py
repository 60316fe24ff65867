"""Float32 parity with HF transformers' Qwen3VLMoeForConditionalGeneration: logits, LM loss and
router aux loss on batches without images, with one image, and with several images of different
sizes across samples (left padding), for several configs (GQA ratios, expert counts, top-k,
deepstack indexes, dense layers mixed in, tied embeddings, attention bias)."""

from __future__ import annotations

import numpy as np
import pytest

from moevlm_jax.data.batch import hf_inputs_to_batch, hf_labels_to_targets
from moevlm_jax.hf import load_pretrained
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.loss import load_balancing_loss
from moevlm_jax.model.qwen3_vl_moe import jit_forward
from tests.model.hf_reference import hf_forward, make_batches

CONFIGS = ["tiny", "dense_mix", "sparse_step"]
BATCHES = ["text", "one_image", "multi"]
NUM_PATCHES = 40  # one patch bucket for all batches (text-only too): one compile per config
# Unrolled layers compile faster on CPU; test_scan_remat.py checks scan == unrolled.
COMPUTE = ComputeConfig(dtype="float32", param_dtype="float32", scan_layers=False)


def masked_ce(logits: np.ndarray, targets: np.ndarray, loss_mask: np.ndarray) -> float:
    """Mean next-token cross-entropy over loss_mask, in float64 numpy."""
    z = logits.astype(np.float64)
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    nll = lse - np.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    return float((nll * loss_mask).sum() / loss_mask.sum())


@pytest.fixture(scope="module")
def ours(hf_models):
    return {name: load_pretrained(f.path, compute=COMPUTE) for name, f in hf_models.items()}


@pytest.fixture(scope="module")
def batches():
    return make_batches()


@pytest.mark.parametrize("batch_name", BATCHES)
@pytest.mark.parametrize("config_name", CONFIGS)
def test_logits_and_losses_match_hf(hf_models, ours, batches, config_name, batch_name):
    model, config = ours[config_name]
    hb = batches[batch_name]
    ref = hf_forward(hf_models[config_name].model, hb)

    batch = hf_inputs_to_batch(config, hb.input_ids, hb.pixel_values, hb.image_grid_thw, hb.attention_mask,
                               num_patches=NUM_PATCHES)
    logits, aux = jit_forward(model, batch)
    logits = np.asarray(logits)
    aux_loss = float(load_balancing_loss(aux["router"], config.text_config.num_experts))

    valid = hb.attention_mask == 1
    ref_logits = ref.logits.numpy()
    scale = np.abs(ref_logits[valid]).max()
    err = np.abs(logits - ref_logits)[valid].max()
    assert err <= 1e-4 * scale, f"logits differ by {err} (scale {scale})"

    targets, loss_mask = hf_labels_to_targets(hb.labels)
    coef = config.text_config.router_aux_loss_coef
    np.testing.assert_allclose(aux_loss, ref.aux_loss.item(), rtol=1e-4)
    np.testing.assert_allclose(masked_ce(logits, targets, loss_mask) + coef * aux_loss, ref.loss.item(), rtol=1e-4)
    assert aux_loss > 0.5  # a real load-balancing value (1.0 = perfectly balanced), not a zero


@pytest.mark.parametrize("batch_name", ["multi", "text"])
def test_eager_call_matches_hf(hf_models, ours, batches, batch_name):
    """The HF-style ``model(input_ids, pixel_values, image_grid_thw, attention_mask)`` entry (for
    a text-only batch: the path without any vision inputs)."""
    model, _ = ours["tiny"]
    hb = batches[batch_name]
    logits = np.asarray(model(hb.input_ids, hb.pixel_values, hb.image_grid_thw, hb.attention_mask))
    ref = hf_forward(hf_models["tiny"].model, hb).logits.numpy()
    valid = hb.attention_mask == 1
    assert logits.shape == ref.shape
    assert np.abs(logits - ref)[valid].max() <= 1e-4 * np.abs(ref[valid]).max()
