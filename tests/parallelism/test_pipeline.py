"""Pipeline parallelism (parallelism/pipeline.py) against unpipelined references, on 8 CPU devices.

1. Schedules on a toy stack (tanh MLP layers with a per-layer input, a batch-dependent side input
   and per-layer outputs): GPipe and circular, even and uneven stages, equal a sequential scan in
   the output, the per-layer outputs (re-assembled from microbatch rows) and the gradients.
2. Bubble fractions and option validation.
3. The tiny Qwen3-VL-MoE with images, trained 3 steps by ``moevlm_jax.training.trainer`` under the pp
   presets (GPipe x FSDP, circular x FSDP, GPipe x EP) and a 4-stage x 2-data layout with uneven
   stages and the vision tower pipelined too: the same losses, gradient norms and parameters as
   one device. Adam's eps is set large so that the updates are ~linear in the gradients and the
   parameter comparison is a gradient comparison.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moevlm_jax.config import load_layout
from moevlm_jax.data.batch import hf_inputs_to_batch
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import ModelConfig
from moevlm_jax.model.qwen3_vl_moe import Qwen3VLMoe
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.parallelism import logical, pipeline
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.trainer import Trainer

# quick compiles (tests/xla_options.py): the unpipelined references compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

# ----------------------------------------------------------------------------- toy stack

L, B, H = 8, 16, 16
ROWS_RULES = [["act_batch", ["stage", "data", "fsdp", "expert"]], ["layers", "stage"], ["embed", "fsdp"]]


def _layer(h, p, i, side):
    h = jnp.tanh(h @ p["w"] + p["b"] + side * (i + 1).astype(h.dtype))
    return h, {"sum": jnp.sum(h, axis=-1), "layer": jnp.broadcast_to(i, h.shape[:1])}


def _objective(out):
    h, ys = out
    return jnp.sum(h**2) + 0.1 * jnp.sum(ys["sum"] ** 2)


@pytest.fixture(scope="module")
def toy():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"w": jax.random.normal(k[0], (L, H, H)) / 4, "b": jax.random.normal(k[1], (L, H))}
    x, side = jax.random.normal(k[2], (B, H)), jax.random.normal(k[3], (B, H))

    def sequential(p):
        return jax.lax.scan(lambda h, inp: _layer(h, *inp, side), x, (p, jnp.arange(L)))

    (h, ys), grads = jax.jit(lambda p: (sequential(p), jax.grad(lambda q: _objective(sequential(q)))(p)))(params)
    return params, x, side, (h, ys, grads)


@pytest.mark.parametrize("mesh,options", [
    ({"stage": 4, "data": 2}, {"microbatches": 4}),
    ({"stage": 4, "data": 2}, {"microbatches": 4, "schedule": "circular", "repeats": 2}),
    ({"stage": 2, "data": 4}, {"microbatches": 2, "stage_layers": [3, 5]}),
    ({"stage": 2, "data": 4}, {"microbatches": 2, "schedule": "circular", "stage_layers": [1, 3, 4, 0]}),
], ids=["gpipe-4x2", "circular-4x2", "uneven-3-5", "circular-uneven"])
def test_schedule_equals_sequential(toy, mesh, options, caplog):
    params, x, side, (ref_h, ref_ys, ref_grads) = toy
    layout = load_layout({"mesh": mesh, "rules": ROWS_RULES, "options": {"pipeline": options}})
    device_mesh = layout.make_mesh()

    def run(p):
        with logical.sharding_context(device_mesh, layout.rules, layout.options):
            cfg = pipeline.active_config("layers")
            assert cfg is not None and cfg.stages == mesh["stage"]
            return pipeline.run_pipeline(_layer, p, x, None, side, 0, cfg)

    with caplog.at_level(logging.INFO, logger="moevlm_jax.parallelism.pipeline"):
        (h, ys), grads = jax.jit(lambda p: (run(p), jax.grad(lambda q: _objective(run(q)))(p)))(params)
    repeats = options.get("repeats", 2 if options.get("schedule") == "circular" else 1)
    bubble = pipeline.bubble_fraction(mesh["stage"], options["microbatches"], repeats)
    assert any(f"bubble fraction {bubble:.3f}" in r.getMessage() for r in caplog.records)  # logged when traced
    np.testing.assert_allclose(h, ref_h, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ys["sum"], ref_ys["sum"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(ys["layer"], ref_ys["layer"])  # [L, B]: every row of every layer once
    for k in grads:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-4, atol=1e-5, err_msg=k)


def _options(pipeline_options: dict):
    """A layout's options with these pipeline settings, through the config loader."""
    return load_layout({"mesh": {"stage": 2, "data": -1}, "options": {"pipeline": pipeline_options}}).options


def test_bubble_fraction_and_chunks():
    assert pipeline.bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert pipeline.bubble_fraction(2, 4) == pytest.approx(1 / 5)
    assert pipeline.bubble_fraction(2, 4, repeats=2) == pytest.approx(1 / 9)
    assert pipeline.bubble_fraction(1, 8) == 0.0
    cfg = pipeline.pipeline_config(_options({"schedule": "circular", "microbatches": 4}), 2)
    assert (cfg.repeats, cfg.iterations, cfg.chunks) == (2, 9, 4)
    np.testing.assert_array_equal(pipeline.chunk_layers(8, 0, cfg, "layers"), [[0, 2], [2, 2], [4, 2], [6, 2]])
    uneven = pipeline.pipeline_config(_options({"stage_layers": [3, 5]}), 2)
    np.testing.assert_array_equal(pipeline.chunk_layers(8, 0, uneven, "layers"), [[0, 3], [3, 5]])
    # a dense group (layer 0) and an MoE group (layers 1..7) take their share of each stage
    np.testing.assert_array_equal(pipeline.chunk_layers(1, 0, uneven, "layers"), [[0, 1], [1, 0]])
    np.testing.assert_array_equal(pipeline.chunk_layers(7, 1, uneven, "layers"), [[0, 2], [2, 5]])
    assert "bubble fraction 0.111" in pipeline.describe(cfg, pipeline.chunk_layers(8, 0, cfg, "layers"))


@pytest.mark.parametrize("options,message", [
    ({"schedule": "zigzag"}, "layout.options.pipeline.schedule: 'zigzag' is not one of"),
    ({"schedule": "gpipe", "repeats": 2}, "use schedule 'circular'"),
    ({"schedule": "circular", "microbatches": 1}, "microbatches >= stages"),
    ({"stage_layers": [4]}, "stages x repeats = 2"),
    ({"microbatch": 4}, "unknown key 'layout.options.pipeline.microbatch'; did you mean 'microbatches'"),
])
def test_bad_options_raise(options, message):
    with pytest.raises(ValueError, match=message):  # the loader's checks, then the schedule's for 2 stages
        pipeline.pipeline_config(_options(options), 2)
    with pytest.raises(ValueError, match="sum to 9, but the model has 8 'layers' layers"):
        pipeline.pipeline_config(_options({"stage_layers": [4, 5]}), 2, {"layers": 8})


def test_inner_rules_drop_the_stage_axis():
    rules = logical.normalize_rules(ROWS_RULES + [["embed", ["stage", "fsdp"]], ["vocab", "stage"]])
    assert pipeline.inner_rules(rules)[0] == ("act_batch", ("data", "fsdp", "expert"))
    assert pipeline.inner_rules(rules)[-2:] == (("embed", "fsdp"), ("vocab", None))


# ----------------------------------------------------------------------------- the tiny model

STEPS, ROWS, SEQ = 3, 16, 40
F32 = {"dtype": "float32", "param_dtype": "float32", "loss_chunk_size": 16}
FROZEN = ("vision_model",)  # the ViT blocks' backward is slow to compile; mergers and DeepStack train
METRICS = ("loss", "ce_loss", "grad_norm", "router_aux_loss", "trained_tokens")
PP4_UNEVEN = {"name": "pp4_uneven", "mesh": {"stage": 4, "data": 2},
              "rules": [["act_batch", ["stage", "data"]], ["act_tokens", ["stage", "data"]],
                        ["act_patches", ["stage", "data"]], ["layers", "stage"], ["vis_layers", "stage"]],
              "options": {"pipeline": {"microbatches": 4, "stage_layers": {"layers": [2, 0, 1, 1]}}}}


def _host_batch(config, seed: int) -> dict[str, np.ndarray]:
    """ROWS rows of SEQ tokens: most rows hold one image (4x4 or 4x6 patches), two a video of 4 frames (2x4 patches
    a frame pair, each pair after a timestamp token), some are text only, one is left-padded; labels on text tokens
    (a fixed 24-patch bucket: one compiled step)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 400, size=(ROWS, SEQ))
    mask = np.ones((ROWS, SEQ), np.int64)
    mask[1, :5] = 0
    grids, videos = [], []
    for r in range(ROWS):
        if r % 9 == 5:  # a video: per frame pair <timestamp><|vision_start|> 2 x <|video_pad|> <|vision_end|>
            for at in (8, 13):
                ids[r, at + 1], ids[r, at + 2:at + 4], ids[r, at + 4] = config.vision_start_token_id, \
                    config.video_token_id, config.vision_end_token_id
            videos.append((2, 2, 4))
            continue
        if r % 3 == 2:
            continue
        h, w = (4, 4) if r % 3 == 0 else (4, 6)
        n = h * w // 4
        ids[r, 8], ids[r, 9:9 + n], ids[r, 9 + n] = config.vision_start_token_id, config.image_token_id, \
            config.vision_end_token_id
        grids.append((1, h, w))
    grid, video = np.asarray(grids), np.asarray(videos)
    pixels, frames = (rng.standard_normal((int(g.prod(-1).sum()), config.vision_config.patch_dim)).astype(np.float32)
                      for g in (grid, video))
    batch = hf_inputs_to_batch(config, ids, pixels, grid, mask, num_patches=24, pixel_values_videos=frames,
                               video_grid_thw=video)
    nxt = np.roll(ids, -1, axis=1)
    vision = (config.image_token_id, config.video_token_id)
    trained = (mask > 0) & ~np.isin(ids, vision) & ~np.isin(nxt, vision) & (rng.random(ids.shape) > 0.1)
    trained[:, -1] = False
    batch["targets"], batch["loss_mask"] = nxt.astype(np.int32), trained.astype(np.float32)
    return batch


def _random_params(config) -> dict:
    """Parameters drawn in numpy (norm scales ~1, the rest ~N(0, 0.02)): no init compile."""
    abstract = Trainer.create(config, ComputeConfig.from_dict(F32), load_layout("fsdp"), OptimizerConfig(), steps=1,
                              devices=jax.devices()[:1]).abstract_params
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        return 1.0 + 0.1 * noise if "norm" in jax.tree_util.keystr(path) else 0.02 * noise

    return jax.tree_util.tree_map_with_path(draw, abstract)


def _train(layout, config, batches, init_params=None, devices=None):
    optimizer = OptimizerConfig(lr=0.1, schedule="constant", warmup_steps=0, eps=1.0, weight_decay=0.0,
                                clip_grad_norm=0.0)
    trainer = Trainer.create(config, ComputeConfig.from_dict(F32), layout, optimizer, steps=STEPS, devices=devices,
                             frozen=FROZEN)
    state = trainer.init_state(seed=0, params=init_params)
    start = jax.device_get(state["params"])
    records = []
    for batch in batches:
        state, metrics = trainer.step(state, trainer.prepare(batch))
        records.append({k: float(v) for k, v in jax.device_get(metrics).items() if k in METRICS})
    return trainer, start, records, jax.device_get(state["params"])


@pytest.fixture(scope="module")
def model_reference():
    config = load_model_config("tiny-v512")
    batches = [_host_batch(config, seed) for seed in range(STEPS)]
    _, start, records, params = _train(load_layout("fsdp"), config, batches, _random_params(config),
                                       devices=jax.devices()[:1])
    return config, batches, start, records, params


@pytest.mark.parametrize("layout,logged", [
    ("pp", ["'layers' (layers 0..3) gpipe: 2 stages x 1 repeats, 4 microbatches"]),
    ("pp_circular", ["'layers' (layers 0..3) circular: 2 stages x 2 repeats, 4 microbatches"]),
    ("pp_ep", ["'layers' (layers 0..3) gpipe: 2 stages x 1 repeats, 4 microbatches"]),
    ("pp4_uneven", ["'layers' (layers 0..3) gpipe: 4 stages", "layers per chunk [2, 0, 1, 1]", "over 'vis_layers'"]),
])
def test_tiny_model_trains_as_on_one_device(model_reference, layout, logged, caplog):
    config, batches, start, ref_records, ref_params = model_reference
    layout = load_layout(PP4_UNEVEN) if layout == "pp4_uneven" else load_layout(layout)
    with caplog.at_level(logging.INFO, logger="moevlm_jax.parallelism.pipeline"):
        trainer, _, records, params = _train(layout, config, batches, init_params=start)
    assert all(any(text in r.getMessage() for r in caplog.records) for text in logged)  # the schedule ran
    experts = trainer.param_shardings["language_model"]["stacks"][0]["mlp"]["gate_up_proj"].spec
    assert (*experts, None)[:2] == (("stage", "expert") if layout.name == "pp_ep" else ("stage", None))
    for step, (got, want) in enumerate(zip(records, ref_records)):
        for k in METRICS:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), f"step {step} {k}: {got[k]} vs {want[k]}"
    flat, initial = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (params, start))
    for path, ref in jax.tree_util.tree_flatten_with_path(ref_params)[0]:
        moved = np.abs(np.asarray(ref) - np.asarray(initial[path])).max()  # ~ lr x |gradient|
        np.testing.assert_allclose(flat[path], ref, rtol=0, atol=1e-4 * moved + 1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def test_mixed_groups_forward_and_router_stats():
    """A dense layer then MoE layers (two stacks, each its own pipeline) with uneven stages [1, 3] and
    DeepStack addends on layers 0 and 1 (one in each stack): same hidden states and per-layer router
    stats ``[L, B, E]`` (microbatch rows re-assembled) as without a mesh."""
    raw = load_model_config("tiny-v512").to_hf_dict()
    raw["text_config"]["mlp_only_layers"] = [0]
    config = ModelConfig.from_hf_dict(raw)
    assert config.text_config.layer_kinds == ("dense", "moe", "moe", "moe")
    batch = {k: v for k, v in _host_batch(config, 0).items() if k not in ("targets", "loss_mask")}
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3VLMoe(config, ComputeConfig.from_dict(F32), nnx.Rngs(0))))
    nnx.replace_by_pure_dict(state, _random_params(config))
    layout = load_layout({"mesh": {"stage": 2, "data": 4}, "rules": ROWS_RULES,
                               "options": {"pipeline": {"microbatches": 2, "stage_layers": [1, 3]}}})
    mesh = layout.make_mesh()

    def forward(st, bt, pipelined):
        if not pipelined:
            return nnx.merge(graphdef, st).hidden_states(bt)
        with logical.sharding_context(mesh, layout.rules, layout.options):
            return nnx.merge(graphdef, st).hidden_states(bt)

    (ref_h, ref_aux), (h, aux) = (jax.jit(forward, static_argnums=2)(state, batch, p) for p in (False, True))
    np.testing.assert_allclose(h, ref_h, rtol=1e-5, atol=1e-5)
    assert aux["router"]["expert_counts"].shape == (3, ROWS, config.text_config.num_experts)
    for k, ref in ref_aux["router"].items():
        np.testing.assert_allclose(aux["router"][k], ref, rtol=1e-5, atol=1e-5, err_msg=k)
