"""Every layout preset runs with the shipped CPU recipe by ``--layout NAME`` alone: a pipeline's microbatch count
follows the recipe's global batch (the nearest count that fits, said in one log line and recorded in
config.yaml); only what cannot be made to fit is refused, with the reason. Config resolution only, no
compiles: the presets' training against fsdp is tests/parallelism/test_layouts_cli.py."""

from __future__ import annotations

import logging

import pytest
import yaml

from moevlm_jax.config.files import CONFIG_DIR
from moevlm_jax.config.run import load_config
from moevlm_jax.parallelism.pipeline import PipelineConfig, fit_microbatches
from moevlm_jax.schema import ConfigError

PRESETS = sorted(p.stem for p in (CONFIG_DIR / "layouts").glob("*.yaml"))
PIPELINED = ("pp", "pp_circular", "pp_ep")


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_resolves_with_the_cpu_default_recipe_on_8_devices(name, caplog):
    with caplog.at_level(logging.INFO, logger="moevlm_jax"):
        cfg = load_config("cpu-default", layout=name, num_devices=8, num_processes=1)
    assert cfg.global_batch_size == cfg.train.global_batch_size == 8  # the recipe's rows, under every layout
    notes = [r.getMessage() for r in caplog.records if "pipeline microbatches" in r.getMessage()]
    if name in PIPELINED:  # 8 rows over stage 2 x 4: 4 microbatches of 2 rows cannot split over 4 devices
        assert cfg.layout.options.pipeline.microbatches == 2
        assert cfg.resolved["layout"]["options"]["pipeline"]["microbatches"] == 2  # config.yaml records it
        assert len(notes) == 1 and "\n" not in notes[0]
        assert notes[0].startswith(f"layout {name}: pipeline microbatches 4 -> 2 ")
        assert "in 4 microbatches of 2 rows do not divide over the 4 devices" in notes[0]
        assert "the global batch is kept" in notes[0]
    else:
        assert notes == []


def test_a_fitting_count_is_kept_and_the_nearest_is_taken_otherwise():
    gpipe = PipelineConfig(stages=2, microbatches=4)
    assert fit_microbatches(gpipe, rows=16, shards=4) == 4  # 4 microbatches of 4 rows over 4 devices
    assert fit_microbatches(gpipe, rows=8, shards=4) == 2  # the largest count below that fits
    assert fit_microbatches(gpipe, rows=6, shards=1) == 3  # 3 is one below, 6 two above
    assert fit_microbatches(PipelineConfig(stages=2, microbatches=3), rows=8, shards=1) == 2  # 2 and 4: the smaller


def test_the_circular_schedule_keeps_at_least_one_microbatch_a_stage():
    # 6 rows, 4 stages: GPipe takes 3 microbatches (nearest to 4); circular needs >= 4 stages' worth: 6
    assert fit_microbatches(PipelineConfig(stages=4, microbatches=4), rows=6, shards=1) == 3
    circular = PipelineConfig(stages=4, microbatches=4, schedule="circular", repeats=2)
    assert fit_microbatches(circular, rows=6, shards=1) == 6
    with pytest.raises(ValueError, match="circular schedule needs at least 4 microbatches .* multiple of 16"):
        fit_microbatches(circular, rows=8, shards=4)  # 1 or 2 microbatches split over 4 devices, fewer than 4 stages


def _stage4_layout(tmp_path):
    """A circular pipeline over 4 stages whose batch rows are data parallel over fsdp 2 only."""
    path = tmp_path / "stage4.yaml"
    path.write_text(yaml.safe_dump({
        "name": "stage4", "mesh": {"stage": 4, "fsdp": -1},
        "rules": [["act_batch", ["data", "fsdp"]], ["act_tokens", ["data", "fsdp"]],
                  ["act_patches", ["data", "fsdp"]], ["layers", "stage"], ["embed", "fsdp"],
                  ["vis_embed", "fsdp"], ["vocab", None], ["vis_layers", None]],
        "options": {"pipeline": {"schedule": "circular", "repeats": 2, "microbatches": 4}}}))
    return str(path)


def test_what_cannot_fit_is_refused_with_the_reason(tmp_path):
    # 4 rows over data parallel 2: at least 4 microbatches (stages) of a multiple of 2 rows cannot be had
    with pytest.raises(ConfigError, match="layout 'stage4' does not fit the batch: pipeline: no microbatch count "
                                          "fits 4 batch rows .* at least 4 microbatches"):
        load_config("cpu-default", layout=_stage4_layout(tmp_path), overrides=["train.global_batch_size=4"],
                    num_devices=8, num_processes=1)


def test_accumulation_moves_into_the_micro_batch_when_no_count_fits(tmp_path, caplog):
    # 8 rows, grad_accum 2: 4 rows a microbatch step fit no count; 8 rows in one step split into 4 of 2 rows
    with caplog.at_level(logging.INFO, logger="moevlm_jax"):
        cfg = load_config("cpu-default", layout=_stage4_layout(tmp_path), overrides=["train.grad_accum=2"],
                          num_devices=8, num_processes=1)
    assert (cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.global_batch_size) == (4, 1, 8)
    assert cfg.layout.options.pipeline.microbatches == 4
    assert (cfg.resolved["train"]["micro_batch_size"], cfg.resolved["train"]["grad_accum"]) == (4, 1)
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("layout stage4:")]
    assert notes == ["layout stage4: micro batch 2 x grad_accum 2 -> 4 x 1 (train.micro_batch_size, "
                     "train.grad_accum) so the pipeline's microbatches fit, the global batch is kept"]
