"""The main job end to end, in process: ``python -m moevlm_jax.train --recipe R --run-dir D`` on the
8 CPU devices (FSDP, MBS 1, global batch 8) with the tiny model, real VQA images, a frozen vision
tower, checkpoints every 3 steps and a final held-out evaluation.

- a run interrupted after step 4 (last checkpoint: step 3) and resumed with ``--resume`` logs the
  losses of the uninterrupted run, step for step;
- frozen parameters are bitwise unchanged between checkpoints, trained ones change, and frozen
  parameters have no optimizer state;
- metrics.jsonl, TensorBoard events, config.yaml, retained checkpoints; config errors name the key.
"""

from __future__ import annotations

import json
import re

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import yaml

from moevlm_jax.train import main
from moevlm_jax.training.metrics import read_metrics
from tests.training.train_setup import (
    COMPUTE,
    SEQ_LEN,
    data_config,
    leaves_by_path,
    logged_losses,
)

# quick compiles (tests/xla_options.py): the straight and the resumed run compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

STEPS = 6


def _recipe(tmp) -> str:
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "cli-test", "model": "tiny", "layout": "fsdp", "data": data_config(tmp / "cache"),
        "compute": COMPUTE,
        "optimizer": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.01},
        "train": {"steps": STEPS, "micro_batch_size": 1, "seq_len": SEQ_LEN, "log_every": 1, "eval_every": 0,
                  "eval_batches": 1, "checkpoint_every": 3, "keep_checkpoints": 2, "freeze_vision_model": True},
    }))
    return str(recipe)


def _restore(run_dir, step):
    with ocp.CheckpointManager((run_dir / "checkpoints").absolute(), item_names=("state", "data")) as mgr:
        out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
    return out["state"], out["data"]


def test_main_job_resume_freeze_and_outputs(tmp_path, capsys):
    """One test (one xdist worker, one compile): three CLI runs, then their files."""
    recipe = _recipe(tmp_path)
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(["--recipe", recipe, "--layout", "fsdp", "--run-dir", str(straight), "--quiet"]) == 0
    # the summary says how long the process took to its first step (here the test worker's age)
    assert re.search(r"first step done \d+s after the process started", capsys.readouterr().out)
    assert main(["--recipe", recipe, "--run-dir", str(resumed), "--quiet"], stop_after=4) == 0
    assert logged_losses(resumed).keys() == {1, 2, 3, 4}
    assert main(["--run-dir", str(resumed), "--resume", "--quiet"]) == 0  # reloads resumed/config.yaml

    # the resumed run logs the uninterrupted run's losses, step for step (bitwise: same program,
    # same data, restored parameters, optimizer state, step, RNG and data iterator)
    a, b = logged_losses(straight), logged_losses(resumed)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    assert [a[s] for s in a] == [b[s] for s in a]
    assert a[STEPS] < a[1]

    # outputs: metrics.jsonl, TensorBoard events, config.yaml (a recipe), retained checkpoints
    records = read_metrics(straight)
    assert all("tokens_per_s" in r and "trained_tokens" in r for r in records if "loss" in r)
    # throughput leaves out the first two steps (compilation; the second's start read late) and checkpoint steps
    # (null there)
    rates = {r["step"]: r["tokens_per_s"] for r in records if "loss" in r}
    assert rates[1] is None and rates[2] is None and rates[3] is None and rates[4] > 0 and rates[5] > 0
    evals = [r for r in records if "eval_accuracy" in r]
    assert len(evals) == 1 and evals[0]["step"] == STEPS and 0 <= evals[0]["eval_accuracy"] <= 1
    assert evals[0]["eval_answers"] > 0
    assert list((straight / "tensorboard").glob("events.out.tfevents.*"))
    saved = yaml.safe_load((straight / "config.yaml").read_text())
    assert saved["train"]["steps"] == STEPS and saved["model"]["name"] == "tiny"
    assert sorted(int(p.name) for p in (straight / "checkpoints").iterdir() if p.name.isdigit()) == [3, 6]

    # freezing: the vision tower is bitwise unchanged between the checkpoints, trained parts move,
    # and frozen parameters have no optimizer state
    from moevlm_jax.training.optimizer import param_group

    s3, d3 = _restore(straight, 3)
    s6, _ = _restore(straight, 6)
    p3, p6 = leaves_by_path(s3["params"]), leaves_by_path(s6["params"])
    groups = {k: param_group(k) for k in p3}
    assert {"vision_model", "vision_projection", "language_model"} <= set(groups.values())
    for k, g in groups.items():
        if g == "vision_model":
            np.testing.assert_array_equal(p6[k], p3[k], err_msg=k)
    changed = {g: any(not np.array_equal(p6[k], p3[k]) for k in p3 if groups[k] == g)
               for g in ("vision_projection", "language_model")}
    assert changed == {"vision_projection": True, "language_model": True}
    opt_paths = list(leaves_by_path(s6["opt_state"]))
    assert not any("visual/blocks" in k or "visual/patch_embed" in k or "visual/pos_embed" in k for k in opt_paths)
    assert any("visual/merger" in k for k in opt_paths) and any("embed_tokens" in k for k in opt_paths)
    assert int(s3["step"]) == 3 and int(s6["step"]) == 6

    # the summary's held-out answers: greedy generation from the final parameters, as the generate
    # path gives from the checkpoint (restored on its own)
    from moevlm_jax import inference
    from moevlm_jax.data.records import decode_record
    from moevlm_jax.data.sources import build_source

    shown = [json.loads(line) for line in (straight / "answers.jsonl").read_text().splitlines()]
    loaded = inference.load_run(straight)
    from moevlm_jax.inference.loading import run_sections

    data_cfg = run_sections(straight)[2]
    source, _ = build_source(data_cfg, data_cfg.eval_split)
    questions = []
    for i in range(len(source)):
        questions += inference.record_questions(decode_record(source[i]))
        if len(questions) >= len(shown):
            break
    rows = inference.answer_questions(loaded.model, loaded.tokenizer, questions[:len(shown)],
                                      image_config=loaded.image_config, system_prompt=loaded.system_prompt,
                                      max_new_tokens=16)
    assert len(shown) == 4 and all(r["step"] == STEPS for r in shown)
    assert [(r["question"], r["answer"], r["generated"], r["match"]) for r in shown] == \
        [(r["question"], r["answer"], r["generated"], r["match"]) for r in rows]
    assert json.loads(json.dumps(d3))["iterator"]["batches"] == 3  # the data iterator state


def test_refuses_to_overwrite_and_names_bad_keys(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    assert main(["--recipe", recipe, "--run-dir", str(run), "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["--recipe", recipe, "--run-dir", str(tmp_path / "x"), "train.stepz=3"]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err
    assert main(["--recipe", recipe, "--model", "tiny-v512", "--run-dir", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "vocab_size 512" in err and "image_token_id" in err
    assert main(["--recipe", recipe, "--run-dir", str(tmp_path / "z"), "compute.dtipe=bfloat16"]) == 2
    assert "did you mean 'dtype'" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "xyz")
    assert jax.device_count() == 8


def test_out_of_device_memory_is_a_clear_error(tmp_path, capsys, monkeypatch):
    """A step that does not fit the device ends the run with what did not fit and what to change
    (exit 2), not an XLA traceback; any other failure still propagates."""
    from moevlm_jax.training.trainer import Trainer

    def oom(self, state, batch):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 70.00GiB.")

    monkeypatch.setattr(Trainer, "step", oom)
    recipe = _recipe(tmp_path)
    assert main(["--recipe", recipe, "--run-dir", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "out of device memory in train step 1" in err and "layout fsdp, 8 device(s), MBS 1 x" in err
    assert "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 70.00GiB" in err
    assert "compute.recompute=selective" in err and "optimizer.state_dtype=bfloat16" in err
    assert "python -m moevlm_jax.tools.memory --model tiny --layout fsdp --mbs 1" in err

    def bug(self, state, batch):
        raise ValueError("not a memory problem")

    monkeypatch.setattr(Trainer, "step", bug)
    with pytest.raises(ValueError, match="not a memory problem"):
        main(["--recipe", recipe, "--run-dir", str(tmp_path / "run2"), "--quiet"])
