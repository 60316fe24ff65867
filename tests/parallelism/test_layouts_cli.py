"""The train CLI under every layout preset: ``python -m moevlm_jax.train --layout <preset> --steps 2
--run-dir D`` (in process, 8 CPU devices, the tiny model, with the Qwen3 vocabulary the
built-in data needs; real images, the vision tower frozen) runs by ``--layout`` alone, and logs the FSDP
run's losses and gradient norms step for step: same seed, same data, same global batch of 8 rows (micro
batch = 8 / data-parallel size, derived), AdamW. 8 rows do not split into the pipeline presets' 4
microbatches over the 4 data-parallel devices of a stage: the config takes 2 (tests/config/test_layout_batch.py
resolves every preset against the cpu-default recipe). The vision tower's gradients under every preset:
tests/parallelism/test_layouts.py.

In the default suite: one train-step compile per preset with the quick compile options. It needs the CLI's
XLA:CPU collective threads (parallelism/cpu_threads.py; the suite has them): with XLA's own pool the tp run
deadlocked.
"""

from __future__ import annotations

import pytest
import yaml

from moevlm_jax.train import main
from moevlm_jax.training.metrics import read_metrics
from tests.training.train_setup import COMPUTE, SEQ_LEN, data_config

pytestmark = pytest.mark.usefixtures("legacy_emitters")  # quick compiles: every run compiles alike
PRESETS = ("tp", "ep", "tp+ep", "ep+etp", "cp", "folded", "pp", "pp_circular", "pp_ep")
# 8 rows: the pp presets' 4 microbatches would be 2 rows over 4 devices, the config fits 2 of 4 rows; 2 steps:
# the first from the same initial state, the second after one AdamW update (lr at full value from step 1:
# warmup_steps 1)
ROWS, STEPS = 8, 2


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layouts_cli")
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "name": "layouts-cli", "model": "tiny", "layout": "fsdp", "data": data_config(),
        "compute": COMPUTE, "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"steps": STEPS, "global_batch_size": ROWS, "seq_len": SEQ_LEN, "log_every": 1,
                  "eval_every": 0, "eval_batches": 0, "checkpointing": False, "tensorboard": False,
                  "freeze_vision_model": True},
    }))
    return path


def _train(recipe, layout: str, run_dir) -> dict[int, float]:
    code = main(["--recipe", str(recipe), "--layout", layout, "--steps", str(STEPS), "--run-dir", str(run_dir),
                 "--quiet"])
    assert code == 0
    if layout.startswith("pp"):  # the fitted microbatch count is what config.yaml records
        resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert resolved["layout"]["options"]["pipeline"]["microbatches"] == 2
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


@pytest.fixture(scope="module")
def fsdp_records(recipe, tmp_path_factory):
    return _train(recipe, "fsdp", tmp_path_factory.mktemp("fsdp"))


@pytest.mark.parametrize("layout", PRESETS)
def test_cli_trains_like_fsdp(recipe, fsdp_records, layout, tmp_path):
    got = _train(recipe, layout, tmp_path / layout)
    assert sorted(got) == list(range(1, STEPS + 1))
    ref = fsdp_records
    # the same rows: the global batch's tokens every step, as fsdp's
    assert [got[s]["tokens"] for s in got] == [ref[s]["tokens"] for s in got] == [ROWS * SEQ_LEN] * STEPS
    assert got[1]["loss"] == pytest.approx(ref[1]["loss"], rel=1e-5)
    for step in range(1, STEPS + 1):  # after AdamW updates from step 2 (float32 rounding, seen ~1e-7)
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=2e-5), f"step {step} {key}"
