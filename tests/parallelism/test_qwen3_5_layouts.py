"""Qwen3.5-MoE under the layout presets on 8 CPU devices trains exactly like one device, through the
trainer's own step (objective + AdamW, ``Trainer.create`` / ``prepare`` / ``lower_step``): the same
per-step losses, gradient norms and parameters (float32) over 3 steps on a packed batch with images,
samples and images crossing the sequence-shard boundaries.

The model is qwen3.5-tiny (Gated DeltaNet + gated attention, 8 experts top-2 + a shared expert, tied
embeddings) with two changes for speed and the pipeline: a 512-token vocabulary (special ids 500-503,
as tiny-v512) and the layer pattern [linear, linear, full, full], whose two stacks divide over 2
pipeline stages (the 3:1 pattern's stacks of 3 and 1 cannot be stored stage-split: the validator
says so).

What each preset exercises (one compile each, LLVM optimisations off):
- ``tp``: GDN key / value heads, gated-attention heads and the shared expert over 'tensor' with SP; ETP;
- ``ep``: expert parallelism (all-to-all dispatch of the routed experts; the shared expert and its gate
  run on every token outside the dispatch, ZeRO-sharded like any dense weight);
- ``cp``: CP 4: the GDN conv window and recurrent state carried across the shards
  (``parallelism.context.SequenceShards``), attention's K/V all-gathered;
- ``folded``: TP 2 x CP 2 x EP 4 over context x tensor: GDN heads split over 'tensor' *inside* the CP
  shard_map, the token rows of both;
- ``pp``: GPipe over 2 stages, each stack (linear / full attention) its own pipeline, uneven per stack.
``fsdp`` and ``tp_ep`` add no Qwen3.5-specific code path over these (plain ZeRO-3 is the reference's own
path on one device; tp_ep = tp's heads + ep's dispatch) and run with ``MOEVLM_QWEN35_ALL_LAYOUTS=1``, as
does ``ep_etp``; the same presets are checked for Qwen3-VL in test_layouts.py / test_pipeline.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re

import jax
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.parallelism.validate import LayoutError, validate_layout
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.trainer import Trainer
from tests.parallelism.packed_batch import packed_batch
from tests.xla_options import FAST  # LLVM optimisations off: a third of the compile

# quick compiles (tests/xla_options.py): the one-device reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

PRESETS = ("tp", "ep", "cp", "folded", "pp")
# In the default suite since 2026-12-02 (~90 s for the module on 2 cores). It was opt-in after it lost its
# xdist worker in four of five full-suite runs (2026-12-01): crashes inside XLA:CPU compiles (the memory-map
# limit, tests/conftest.py) and, with XLA's own thread pool, a collective abort (the suite now has the CLI's
# collective threads, parallelism/cpu_threads.py).
MORE = ("fsdp", "tp_ep", "ep_etp")
ROWS, SEQ, STEPS = 16, 32, 3
COMPUTE = ComputeConfig(dtype="float32", param_dtype="float32", loss_chunk_size=16)
# Adam with eps 1 is ~SGD for the small gradients here (update ~ lr * gradient): parameters follow the
# gradients smoothly, so a layout that computes them differently shows in the parameters
OPTIMIZER = OptimizerConfig(lr=0.5, schedule="constant", warmup_steps=0, eps=1.0, weight_decay=0.0, clip_grad_norm=0.0)
METRICS = ("loss", "ce_loss", "grad_norm", "router_aux_loss", "trained_tokens")
LIN, FULL = "linear_attention", "full_attention"


def qwen3_5_test_config():
    """qwen3.5-tiny with a 512-token vocabulary and the layer pattern [lin, lin, full, full]."""
    config = load_model_config("qwen3.5-tiny")
    config = dataclasses.replace(config, image_token_id=500, video_token_id=501, vision_start_token_id=502,
                                 vision_end_token_id=503)
    return config.replace_text(vocab_size=512, layer_types=(LIN, LIN, FULL, FULL))


@pytest.fixture(scope="module")
def setup():
    config = qwen3_5_test_config()
    abstract = Trainer.create(config, COMPUTE, load_layout("fsdp"), OPTIMIZER, steps=STEPS,
                              devices=jax.devices()[:1]).abstract_params
    rng = np.random.default_rng(0)

    def draw(path, leaf):  # (zero-centred) norm scales ~0.1, A_log ~U(-1, 1), the rest ~N(0, 0.02): no init compile
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if "A_log" in name:
            return rng.uniform(-1.0, 1.0, leaf.shape).astype(np.float32)
        if "linear_attn']['norm" in name:  # the GDN gated norm: a plain (not zero-centred) scale
            return 1.0 + 0.1 * noise
        return 0.1 * noise if "norm" in name else 0.02 * noise

    params = jax.tree_util.tree_map_with_path(draw, abstract)
    return config, params, packed_batch(config, ROWS, SEQ)


def train(setup, layout, devices=None):
    """STEPS trainer steps of ``layout`` (on ``devices``, default all 8): per-step metrics, the final
    parameters (host) and the compiled step's HLO."""
    config, params, batch = setup
    trainer = Trainer.create(config, COMPUTE, layout, OPTIMIZER, steps=STEPS, devices=devices)
    validate_layout(config, layout, trainer.mesh, ROWS, SEQ)
    state = trainer.init_state(seed=0, params=params)
    placed = trainer.prepare(batch)
    compiled = trainer.lower_step(state, placed.arrays, placed.capacity, bounded=placed.bounded).compile(FAST)
    records = []
    for _ in range(STEPS):
        state, metrics = compiled(state, placed.arrays)
        records.append({k: float(v) for k, v in jax.device_get(metrics).items() if k in METRICS})
    return records, jax.device_get(state["params"]), compiled.as_text()


@pytest.fixture(scope="module")
def reference(setup):
    """One device: the same trainer step's metrics and parameters."""
    return train(setup, load_layout("fsdp"), devices=jax.devices()[:1])[:2]


def assert_same_training(got, want, initial):
    (records, params), (ref_records, ref_params) = got, want
    assert ref_records[-1]["loss"] < ref_records[0]["loss"]  # it trains
    for step, (r, ref) in enumerate(zip(records, ref_records)):
        for k in METRICS:
            assert r[k] == pytest.approx(ref[k], rel=2e-6, abs=1e-7), f"step {step} {k}: {r[k]} vs {ref[k]}"
    flat, start = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (params, initial))
    for path, ref in jax.tree_util.tree_flatten_with_path(ref_params)[0]:
        moved = np.abs(np.asarray(ref) - np.asarray(start[path])).max()  # ~ lr x |gradient| x steps
        np.testing.assert_allclose(flat[path], ref, rtol=0, atol=1e-4 * moved + 1e-7,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("name", PRESETS + tuple(pytest.param(n, marks=pytest.mark.skipif(
    not os.environ.get("MOEVLM_QWEN35_ALL_LAYOUTS"), reason="MOEVLM_QWEN35_ALL_LAYOUTS=1: no distinct Qwen3.5 path"))
    for n in MORE))
def test_qwen3_5_preset_trains_like_one_device(setup, reference, name, caplog):
    with caplog.at_level(logging.INFO, logger="moevlm_jax.parallelism.pipeline"):
        records, params, hlo = train(setup, load_layout(name))
    assert_same_training((records, params), reference, setup[1])
    if name in ("cp", "folded"):  # GDN under CP: the shards' (transition, final) states [cp, B, Hv, Dk, D]
        cp = 4 if name == "cp" else 2  # all-gathered over 'context', the sequence not gathered for the GDN
        assert re.search(rf"f32\[{cp},\d+,\d+,16,16\][^=]*? all-gather", hlo)
    if name == "pp":  # each stack its own pipeline over the 2 stages
        logged = [r.getMessage() for r in caplog.records]
        for text in ("'layers' (layers 0..1) gpipe: 2 stages", "'layers' (layers 2..3) gpipe: 2 stages"):
            assert any(text in m for m in logged), logged


# ----------------------------------------------------------------------------- validation (no compile)

@pytest.mark.parametrize("name", ("fsdp", "tp", "ep", "tp_ep", "ep_etp", "cp", "folded", "pp", "pp_circular", "pp_ep"))
def test_presets_validate_qwen3_5(name):
    """Every preset fits the test config; the released 3:1 pattern (stacks of 3 and 1 layers) is refused
    by the pipeline presets before anything compiles, naming the stacks."""
    validate_layout(qwen3_5_test_config(), load_layout(name), batch_size=ROWS, seq_len=SEQ, num_devices=8)
    tiny = load_model_config("qwen3.5-tiny")
    if not name.startswith("pp"):
        validate_layout(tiny, load_layout(name), batch_size=ROWS, seq_len=SEQ, num_devices=8)
        return
    with pytest.raises(LayoutError, match=r"decoder stacks layers 0\.\.2 \(3 linear_attention\), layers 3\.\.3 "
                                          r"\(1 full_attention\) do not divide over the 2 devices of mesh axes "
                                          r"stage=2"):
        validate_layout(tiny, load_layout(name), batch_size=ROWS, seq_len=SEQ, num_devices=8)


def test_gdn_heads_shared_expert_and_cp_window_are_checked():
    model = qwen3_5_test_config().replace_text(linear_num_key_heads=3, linear_num_value_heads=9,
                                               shared_expert_intermediate_size=33)
    with pytest.raises(LayoutError) as err:
        validate_layout(model, load_layout("tp"), batch_size=ROWS, seq_len=SEQ, num_devices=8)
    text = str(err.value)
    for want in ("text_config.linear_num_key_heads (GDN query / key heads) = 3 does not divide over the 2 devices of "
                 "mesh axes tensor=2 that logical axis 'q_heads' maps to",
                 "text_config.linear_num_value_heads (GDN value heads) = 9 does not divide over the 2 devices",
                 "text_config.shared_expert_intermediate_size = 33 does not divide over the 2 devices of mesh axes "
                 "tensor=2 that logical axis 'mlp' maps to"):
        assert want in text, text
    with pytest.raises(LayoutError, match=r"leaves 2 tokens a shard, fewer than the 3 the GDN conv window"):
        validate_layout(qwen3_5_test_config(), load_layout("cp"), batch_size=ROWS, seq_len=8, num_devices=8)
