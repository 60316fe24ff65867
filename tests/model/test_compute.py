"""Compute options give the same numbers: scan over depth == unrolled layers (forward, with images
and DeepStack), recompute full / selective == no recompute (loss and gradients), bf16 compute close to f32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moevlm_jax.data.batch import hf_inputs_to_batch, hf_labels_to_targets
from moevlm_jax.hf import load_pretrained
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.qwen3_vl_moe import jit_forward
from moevlm_jax.training.objective import microbatch_objective
from tests.model.hf_reference import make_batches

# quick compiles (tests/xla_options.py): each option and its reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

F32 = dict(dtype="float32", param_dtype="float32")


def objective(model, batch):
    """The trainer's objective of one whole batch (one microbatch, whole rows): mean CE + router losses."""
    return microbatch_objective(model, batch, jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0), 1, None)[0]


def _batch(hf_path, name, **kw):
    _, config = load_pretrained(hf_path)
    hb = make_batches()[name]
    batch = hf_inputs_to_batch(config, hb.input_ids, hb.pixel_values, hb.image_grid_thw, hb.attention_mask, **kw)
    batch["targets"], batch["loss_mask"] = hf_labels_to_targets(hb.labels)
    return batch


@pytest.fixture(scope="module")
def image_batch(hf_models):
    return _batch(hf_models["tiny"].path, "multi", num_patches=40)


def _logits(path, compute, batch):
    model, _ = load_pretrained(path, compute=compute)
    return np.asarray(jit_forward(model, {k: v for k, v in batch.items() if k not in ("targets", "loss_mask")})[0])


@pytest.mark.parametrize("scan", [dict(scan_layers=True), dict(scan_layers=False, vision_scan_layers=True),
                                  dict(scan_layers=True, vision_scan_layers=False)],
                         ids=["both", "vision_only", "text_only"])
def test_scan_equals_unrolled(hf_models, image_batch, scan):
    """Scanned stacks (both, or one tower's: compute.vision_scan_layers) give the unrolled logits."""
    path = hf_models["tiny"].path
    unrolled = _logits(path, ComputeConfig(**F32, scan_layers=False), image_batch)
    scanned = _logits(path, ComputeConfig(**F32, **scan), image_batch)
    valid = image_batch["segment_ids"] > 0
    np.testing.assert_allclose(scanned[valid], unrolled[valid], rtol=1e-5, atol=1e-5 * np.abs(unrolled).max())


def test_vision_scan_layers_follows_scan_layers_unless_set():
    assert ComputeConfig(scan_layers=False).stack_scan("vision") is False
    assert ComputeConfig(scan_layers=False, vision_scan_layers=True).stack_scan("vision") is True
    assert ComputeConfig(scan_layers=False, vision_scan_layers=True).stack_scan("text") is False
    assert ComputeConfig(scan_layers=True, vision_scan_layers=False).stack_scan("vision") is False


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(graphdef, state, batch):
    return jax.value_and_grad(lambda st: objective(nnx.merge(graphdef, st), batch))(state)


@pytest.mark.parametrize("compute", [
    ComputeConfig(**F32, scan_layers=True, recompute="full"),
    ComputeConfig(**F32, scan_layers=True, recompute="selective",
                  recompute_modules=("core_attn", "moe_act", "layernorm", "mlp", "moe"), router={"z_loss_coef": 0.0}),
], ids=["full", "selective"])
def test_recompute_keeps_loss_and_grads(hf_models, compute):
    """On a text batch (vision shares run_stack and the recompute policy; its backward is slow to compile)."""
    path = hf_models["dense_mix"].path  # dense + MoE stacks, tied embeddings
    batch = _batch(path, "text")
    ref_model, _ = load_pretrained(path, compute=ComputeConfig(**F32, scan_layers=False, loss_chunk_size=16))
    model, _ = load_pretrained(path, compute=compute.replace(loss_chunk_size=16))
    ref_loss, ref_grads = _loss_and_grads(*nnx.split(ref_model), batch)
    loss, grads = _loss_and_grads(*nnx.split(model), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    ref_flat, flat = dict(nnx.to_flat_state(ref_grads)), dict(nnx.to_flat_state(grads))
    assert ref_flat.keys() == flat.keys()
    for k in ref_flat:
        r, g = np.asarray(ref_flat[k][...]), np.asarray(flat[k][...])
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * (np.abs(r).max() + 1e-12), err_msg=str(k))
    assert np.abs(np.asarray(flat[("language_model", "stacks", 1, "mlp", "gate_up_proj")][...])).max() > 0


def test_bf16_compute_close_to_f32(hf_models, image_batch):
    """bf16 compute (f32 params) stays close to f32: mean error well under 1% of the logit scale
    (HF's own bf16 run shows the same ~0.5%; a few tokens differ more where a routing choice flips)."""
    path = hf_models["tiny"].path
    ref = _logits(path, ComputeConfig(**F32, scan_layers=False), image_batch)
    bf16 = _logits(path, ComputeConfig(dtype="bfloat16", param_dtype="float32", scan_layers=True), image_batch)
    valid = image_batch["segment_ids"] > 0
    err = np.abs(bf16 - ref)[valid] / np.abs(ref[valid]).max()
    assert np.isfinite(bf16).all()
    assert err.mean() < 0.01, err.mean()
    assert np.median(err) < 0.01


def test_traced_graph_does_not_grow_with_depth():
    """With scan_layers the traced program is the same size for 4 or 12 decoder layers and 4 or 12
    vision blocks (so is compile time); unrolled, it grows; with only the vision tower scanned
    (compute.vision_scan_layers), it grows with the decoder's depth alone."""
    import dataclasses

    from moevlm_jax.model.qwen3_vl_moe import Qwen3VLMoe
    from moevlm_jax.model.registry import load_model_config

    base = load_model_config("tiny-v512")
    ids = np.full((1, 16), 7)
    ids[0, 2], ids[0, 3:7], ids[0, 7] = 502, 500, 503
    batch = hf_inputs_to_batch(base, ids, np.zeros((16, 1536), np.float32), np.array([[1, 4, 4]]))

    def size(text_depth, vision_depth, **scan):
        config = dataclasses.replace(base.replace_text(num_hidden_layers=text_depth),
                                     vision_config=dataclasses.replace(base.vision_config, depth=vision_depth))
        model = nnx.eval_shape(lambda: Qwen3VLMoe(config, ComputeConfig(**F32, **scan), nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
        jaxpr = jax.make_jaxpr(lambda st: nnx.merge(graphdef, st).forward(batch))(state)
        return len(str(jaxpr).splitlines())

    assert size(4, 4, scan_layers=True) == size(12, 12, scan_layers=True)
    assert size(12, 12, scan_layers=False) > size(4, 4, scan_layers=False) + 100
    vision_only = dict(scan_layers=False, vision_scan_layers=True)
    assert size(4, 4, **vision_only) == size(4, 12, **vision_only)
    assert size(12, 4, **vision_only) > size(4, 4, **vision_only) + 100
    assert size(4, 12, scan_layers=False) > size(4, 4, scan_layers=False) + 100


def test_materialised_grad_is_the_identity_with_a_barrier_on_its_cotangent():
    """Unrolled stacks pass each layer's weights through layers.materialised_grad: values and gradients
    unchanged (the scanned == unrolled tests above), and the backward holds one optimization barrier per
    use, so the stacked gradient's concatenate has materialised operands."""
    from moevlm_jax.model.layers import materialised_grad

    x = jnp.arange(6.0).reshape(2, 3)
    f = lambda a: jnp.sum(jnp.sin(materialised_grad(a)) * a)  # noqa: E731
    np.testing.assert_allclose(jax.grad(f)(x), jnp.cos(x) * x + jnp.sin(x), rtol=1e-6)
    np.testing.assert_allclose(f(x), jnp.sum(jnp.sin(x) * x), rtol=1e-6)
    assert str(jax.make_jaxpr(jax.grad(f))(x)).count("optimization_barrier") == 1
