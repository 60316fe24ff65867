"""qwen3_vl_moe.spread_placeholders: image placeholder positions read distinct embedding rows (no hot
row in the embedding gradient's scatter-add); the loss and the embedding table's gradient equal those
of the plain lookup on an image batch of the tiny model."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moevlm_jax.hf import load_pretrained
from moevlm_jax.model import qwen3_vl_moe
from moevlm_jax.model.compute import ComputeConfig
from tests.model.test_compute import F32, _batch, objective

EMBED = ("language_model", "embed_tokens")


def _loss_and_embed_grad(path, batch):
    model, _ = load_pretrained(path, compute=ComputeConfig(**F32, scan_layers=True))
    graphdef, state = nnx.split(model)
    flat = dict(nnx.to_flat_state(state))

    def loss(table):
        flat[EMBED] = flat[EMBED].replace(table)
        return objective(nnx.merge(graphdef, nnx.from_flat_state(flat)), batch)

    table = flat[EMBED][...]
    return jax.jit(jax.value_and_grad(loss))(table)


def test_spread_lookup_keeps_loss_and_embedding_gradient(hf_models, monkeypatch):
    path = hf_models["tiny"].path
    batch = _batch(path, "multi", num_patches=40)
    _, config = load_pretrained(path)
    ids = jnp.asarray(batch["input_ids"])
    is_image = ids == config.image_token_id
    assert int(is_image.sum()) > 1
    spread = qwen3_vl_moe.spread_placeholders(ids, is_image, config.text_config.vocab_size)
    assert len(np.unique(np.asarray(spread)[np.asarray(is_image)])) == int(is_image.sum())  # distinct rows
    assert np.array_equal(np.asarray(spread)[~np.asarray(is_image)], np.asarray(ids)[~np.asarray(is_image)])

    loss, grad = _loss_and_embed_grad(path, batch)
    monkeypatch.setattr(qwen3_vl_moe, "spread_placeholders", lambda ids, is_image, vocab: ids)
    ref_loss, ref_grad = _loss_and_embed_grad(path, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-6, atol=1e-9)
    assert np.abs(np.asarray(grad)).max() > 0
