"""Vision rows balanced apart from the decoder rows (``data.balance_vision_rows``): ``patch_dest`` places each
merged token, and the model's loss and gradients equal those of the same images in their own rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moevlm_jax.hf import load_pretrained
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.qwen3_vl_moe import scatter_to_dest
from tests.model.test_compute import F32, _batch, objective


def test_scatter_to_dest_places_tokens_across_rows_and_its_backward_is_a_gather():
    rng = np.random.default_rng(0)
    b, v, s, h = 3, 4, 5, 2
    tokens = rng.standard_normal((2, b, v, h)).astype(np.float32)  # [n_ds, B, V, H]
    valid = np.array([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]], bool)
    # (vision row, token) -> (decoder row, position)
    where = {(0, 0): (0, 1), (0, 1): (2, 4), (1, 0): (0, 3), (1, 2): (1, 0)}
    dest = np.zeros((b, v), np.int32)
    for (r, k), (t, pos) in where.items():
        dest[r, k] = (t - r) * s + pos
    out = np.asarray(scatter_to_dest(jnp.asarray(tokens), jnp.asarray(dest), jnp.asarray(valid), s))
    ref = np.zeros((2, b, s, h), np.float32)
    for (r, k), (t, pos) in where.items():
        ref[:, t, pos] = tokens[:, r, k]
    np.testing.assert_array_equal(out, ref)
    probe = rng.standard_normal(ref.shape).astype(np.float32)
    fn = lambda x: jnp.sum(scatter_to_dest(x, jnp.asarray(dest), jnp.asarray(valid), s) * probe)  # noqa: E731
    grad = np.asarray(jax.grad(fn)(jnp.asarray(tokens)))
    ref_grad = np.zeros_like(tokens)
    for (r, k), (t, pos) in where.items():
        ref_grad[:, r, k] = probe[:, t, pos]
    np.testing.assert_array_equal(grad, ref_grad)
    assert "scatter-add" not in str(jax.make_jaxpr(jax.grad(fn))(jnp.asarray(tokens)))


def _move_second_image(batch, image_token_id):
    """The "multi" batch (row 0: images of 16 and 24 patches, row 1: none, row 2: one of 40) with row 0's
    second image moved to vision row 1, and ``patch_dest`` for every row."""
    out = {k: np.array(v) for k, v in batch.items()}
    s = out["input_ids"].shape[1]
    seg = out["patch_segment_ids"]
    assert (seg[0] == 1).sum() == 16 and (seg[0] == 2).sum() == 24 and not seg[1].any()
    keys = ("pixel_values", "patch_rc", "patch_hw", "patch_segment_ids")
    for k in keys:
        out[k][1] = 0
        out[k][1, :24] = batch[k][0, 16:40]
        out[k][0, 16:] = 0
    out["patch_segment_ids"][1, :24] = 1
    dest = np.zeros(seg.shape, np.int32)
    tokens0 = np.flatnonzero(out["input_ids"][0] == image_token_id)
    tokens2 = np.flatnonzero(out["input_ids"][2] == image_token_id)
    assert len(tokens0) == 10 and len(tokens2) == 10
    dest[0, :16] = np.repeat(tokens0[:4], 4)
    dest[1, :24] = np.repeat((0 - 1) * s + tokens0[4:], 4)
    dest[2, :40] = np.repeat(tokens2, 4)
    out["patch_dest"] = dest
    return out


def test_balanced_rows_give_the_same_loss_and_gradients(hf_models):
    path = hf_models["tiny"].path
    batch = _batch(path, "multi", num_patches=40)
    model, config = load_pretrained(path, compute=ComputeConfig(**F32, scan_layers=True))
    balanced = _move_second_image(batch, config.image_token_id)
    graphdef, state = nnx.split(model)
    fn = jax.jit(jax.value_and_grad(lambda st, bt: objective(nnx.merge(graphdef, st), bt)))
    loss, grads = fn(state, batch)
    loss_b, grads_b = fn(state, balanced)
    np.testing.assert_allclose(loss_b, loss, rtol=1e-6)
    for (path_, g), (_, g_b) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(grads_b)):
        np.testing.assert_allclose(np.asarray(g_b[...]), np.asarray(g[...]), rtol=2e-5, atol=1e-7, err_msg=str(path_))
    # a destination one row off changes the loss (the test can fail)
    wrong = dict(balanced, patch_dest=np.where(balanced["patch_segment_ids"] > 0, balanced["patch_dest"] + 1, 0))
    assert abs(float(fn(state, wrong)[0]) - float(loss)) > 1e-4


def test_trainer_refuses_a_destination_outside_the_row_group():
    """prepare's host check: 4 rows in 2 groups (microbatches or data-parallel ranks) of 2; vision row 1 may feed
    decoder row 0, not row 2."""
    import pytest

    from moevlm_jax.training.trainer import check_dest_groups

    s = 8
    seg = np.zeros((4, 8), np.int32)
    seg[1, :4] = 1
    arrays = {"input_ids": np.zeros((4, s), np.int32), "patch_segment_ids": seg,
              "patch_dest": np.zeros((4, 8), np.int32)}
    arrays["patch_dest"][1, :4] = (0 - 1) * s + 3
    check_dest_groups(arrays, 2)
    arrays["patch_dest"][1, :4] = (2 - 1) * s + 3
    check_dest_groups(arrays, 1)  # one group of 4 rows: fine
    with pytest.raises(ValueError, match="vision row 1 feeds decoder row 2 outside its group of 2 rows"):
        check_dest_groups(arrays, 2)
    arrays["patch_segment_ids"][1] = 0  # padding patches are not checked
    check_dest_groups(arrays, 2)
