"""The train CLI under a pipeline preset, in process on the 8 CPU devices: ``python -m moevlm_jax.train
--layout pp --model tiny --steps 3 --run-dir D`` (the tiny model, with the Qwen3 vocabulary
the built-in VQA data needs; real images; ViT blocks frozen) logs the losses and gradient norms of the
same run under the unpipelined FSDP layout, step for step."""

from __future__ import annotations

import pytest
import yaml

from moevlm_jax.training.metrics import read_metrics
from moevlm_jax.train import main
from tests.training.train_setup import COMPUTE, SEQ_LEN, data_config

# quick compiles (tests/xla_options.py): the FSDP reference run compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

STEPS = 3


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pp_cli")
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "name": "pp-cli-test", "model": "tiny", "layout": "fsdp", "data": data_config(tmp / "cache"),
        "compute": COMPUTE, "optimizer": {"lr": 3e-3, "warmup_steps": 1, "weight_decay": 0.01},
        # MBS 2 x 8 data-parallel devices = 16 rows: 4 microbatches of 4 rows over fsdp 4 in each stage
        "train": {"steps": STEPS, "micro_batch_size": 2, "seq_len": SEQ_LEN, "log_every": 1, "eval_every": 0,
                  "checkpoint_every": 0, "keep_checkpoints": 1, "freeze_vision_model": True,
                  "checkpointing": False},  # the metrics are compared (pp states' checkpoints: test_portable_checkpoints)
    }))
    return path


def _records(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir) if "loss" in r}


def test_pp_preset_cli_matches_fsdp(recipe, tmp_path):
    assert main(["--recipe", str(recipe), "--layout", "pp", "--model", "tiny", "--steps", str(STEPS),
                 "--run-dir", str(tmp_path / "pp"), "--quiet"]) == 0
    assert main(["--recipe", str(recipe), "--run-dir", str(tmp_path / "fsdp"), "--quiet"]) == 0
    pp, ref = _records(tmp_path / "pp"), _records(tmp_path / "fsdp")
    assert sorted(pp) == sorted(ref) == list(range(1, STEPS + 1))
    for step in ref:
        for key in ("loss", "grad_norm"):
            assert pp[step][key] == pytest.approx(ref[step][key], rel=2e-5), f"step {step} {key}"
