"""Host-side batch construction against HF: MRoPE positions (get_rope_index), patch (row, col)
layout and position-embedding interpolation taps; the in-graph visual-token scatter."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.vision_utils import (
    get_vision_interpolation_indices_and_weights,
    get_vision_position_ids,
)

from moevlm_jax.data.batch import (
    hf_inputs_to_batch,
    hf_labels_to_targets,
    patch_layout,
)
from moevlm_jax.model.qwen3_vl_moe import scatter_visual_tokens
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.model.vision import interpolation_taps
from tests.model.hf_reference import IMAGE, V_END, V_START, make_batches

GRIDS = np.array([[1, 4, 6], [1, 10, 4], [1, 2, 2], [2, 4, 4], [1, 16, 12]])


def test_positions_match_hf_get_rope_index(hf_models):
    hf = hf_models["tiny"].model.model
    config = load_model_config("tiny-v512")
    for name, hb in make_batches().items():
        batch = hf_inputs_to_batch(config, hb.input_ids, hb.pixel_values, hb.image_grid_thw, hb.attention_mask)
        if hb.image_grid_thw is None:  # HF: plain arange positions when there is no image
            np.testing.assert_array_equal(batch["positions"], np.broadcast_to(np.arange(40), (3, 3, 40)))
            continue
        ref, _ = hf.get_rope_index(torch.tensor(hb.input_ids), torch.tensor((hb.input_ids == IMAGE).astype(np.int64)),
                                   image_grid_thw=torch.tensor(hb.image_grid_thw),
                                   attention_mask=torch.tensor(hb.attention_mask))
        np.testing.assert_array_equal(batch["positions"], ref.numpy(), err_msg=name)


def test_positions_image_first_and_back_to_back_runs(hf_models):
    """An image at the very start, an image right after another's end token, odd grids."""
    hf = hf_models["tiny"].model.model
    config = load_model_config("tiny-v512")
    grids = np.array([[1, 2, 6], [1, 8, 2], [1, 4, 4]])
    seq = [V_START] + [IMAGE] * 3 + [V_END, V_START] + [IMAGE] * 4 + [V_END, 7, 8, V_START] + [IMAGE] * 4 + [V_END, 9]
    ids = np.array([seq])
    batch = hf_inputs_to_batch(config, ids, np.zeros((grids.prod(-1).sum(), 1536), np.float32), grids)
    ref, _ = hf.get_rope_index(torch.tensor(ids), torch.tensor((ids == IMAGE).astype(np.int64)),
                               image_grid_thw=torch.tensor(grids))
    np.testing.assert_array_equal(batch["positions"], ref.numpy())


def test_patch_layout_and_interpolation_match_hf():
    rc, hw, frame = patch_layout(GRIDS, 2)
    ref = get_vision_position_ids(torch.tensor(GRIDS), 2).numpy()
    np.testing.assert_array_equal(rc, ref)
    np.testing.assert_array_equal(hw, np.repeat(GRIDS[:, 1:], GRIDS.prod(-1), axis=0))
    np.testing.assert_array_equal(frame, np.repeat(np.arange(6), [24, 40, 4, 16, 16, 192]))
    for side in (8, 48):
        idx, w = interpolation_taps(jnp.asarray(rc), jnp.asarray(hw), side)
        ref_idx, ref_w = get_vision_interpolation_indices_and_weights(
            torch.tensor(GRIDS), side, mode="bilinear", align_corners=True, spatial_merge_size=2)
        np.testing.assert_array_equal(np.asarray(idx), ref_idx.numpy())
        np.testing.assert_allclose(np.asarray(w), ref_w.numpy(), rtol=1e-6, atol=1e-7)


def test_patch_rows_and_segments():
    config = load_model_config("tiny-v512")
    hb = make_batches()["multi"]
    batch = hf_inputs_to_batch(config, hb.input_ids, hb.pixel_values, hb.image_grid_thw, hb.attention_mask,
                               num_patches=48)
    assert batch["pixel_values"].shape == (3, 48, 1536)
    np.testing.assert_array_equal(batch["patch_segment_ids"][0], [1] * 16 + [2] * 24 + [0] * 8)
    np.testing.assert_array_equal(batch["patch_segment_ids"][1], [0] * 48)
    np.testing.assert_array_equal(batch["patch_segment_ids"][2], [1] * 40 + [0] * 8)
    np.testing.assert_array_equal(batch["pixel_values"][2, :40], hb.pixel_values[40:])
    np.testing.assert_array_equal(batch["segment_ids"], hb.attention_mask)
    with pytest.raises(ValueError, match="image tokens"):
        hf_inputs_to_batch(config, hb.input_ids[:, ::-1] * 0 + IMAGE, hb.pixel_values, hb.image_grid_thw)


def test_scatter_visual_tokens_with_gaps():
    """Valid merged tokens need not be contiguous: the k-th valid one fills the k-th image token."""
    rng = np.random.default_rng(0)
    tokens = rng.standard_normal((2, 2, 6, 3)).astype(np.float32)  # [n_ds, B, V, H]
    valid = np.array([[1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 0, 0]], bool)
    is_image = np.zeros((2, 9), bool)
    is_image[0, [2, 3, 7]] = True
    is_image[1, [0, 1, 2]] = True
    out = np.asarray(scatter_visual_tokens(jnp.asarray(tokens), jnp.asarray(is_image), jnp.asarray(valid)))
    ref = np.zeros((2, 2, 9, 3), np.float32)
    for b in range(2):
        ref[:, b, np.flatnonzero(is_image[b])] = tokens[:, b, np.flatnonzero(valid[b])]
    np.testing.assert_array_equal(out, ref)


def test_scatter_visual_tokens_counts_differ_and_backward_is_a_gather():
    """Row 0 has more image positions than valid tokens (the extra ones stay zero), row 1 more valid
    tokens than image positions (the extra tokens are dropped); the gradient w.r.t. the tokens is the
    probe read back at each token's position, and the backward holds no scatter-add (no atomics)."""
    rng = np.random.default_rng(1)
    tokens = rng.standard_normal((2, 5, 3)).astype(np.float32)  # [B, V, H]
    valid = np.array([[1, 0, 1, 0, 0], [1, 1, 1, 1, 0]], bool)
    is_image = np.zeros((2, 7), bool)
    is_image[0, [1, 2, 5, 6]] = True
    is_image[1, [3, 4]] = True
    probe = rng.standard_normal((2, 7, 3)).astype(np.float32)
    fn = lambda t: jnp.sum(scatter_visual_tokens(t, jnp.asarray(is_image), jnp.asarray(valid)) * probe)  # noqa: E731
    out = np.asarray(scatter_visual_tokens(jnp.asarray(tokens), jnp.asarray(is_image), jnp.asarray(valid)))
    ref, ref_grad = np.zeros((2, 7, 3), np.float32), np.zeros_like(tokens)
    for b in range(2):
        pos, src = np.flatnonzero(is_image[b]), np.flatnonzero(valid[b])
        n = min(len(pos), len(src))
        ref[b, pos[:n]] = tokens[b, src[:n]]
        ref_grad[b, src[:n]] = probe[b, pos[:n]]
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_allclose(np.asarray(jax.grad(fn)(jnp.asarray(tokens))), ref_grad, rtol=0, atol=0)
    assert "scatter-add" not in str(jax.make_jaxpr(jax.grad(fn))(jnp.asarray(tokens)))


def test_hf_labels_to_targets():
    labels = np.array([[-100, 5, 6, -100, 7]])
    targets, mask = hf_labels_to_targets(labels)
    np.testing.assert_array_equal(targets, [[5, 6, 0, 7, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 0, 1, 0]])
