"""The main job end to end, in process: ``python -m moevlm_jax.train --recipe R --run-dir D`` on the
8 CPU devices (FSDP, MBS 1, global batch 8) with the tiny model, real VQA images, a frozen vision
tower, checkpoints every 4 steps and a final held-out evaluation.

- the run's step-8 checkpoint damaged (a data file truncated after its commit): ``--resume`` skips it with
  one log line, keeps it on disk as ``8.damaged``, continues from step 4 and logs the uninterrupted run's
  losses step for step, its summary naming the skipped checkpoint; ``--resume-step 4`` with step 8 intact
  resumes from exactly 4 (8 kept as ``8.superseded``), again with those losses;
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
    damage_checkpoint,
    data_config,
    leaves_by_path,
    logged_losses,
)

# quick compiles (tests/xla_options.py): the straight and the resumed run compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

STEPS = 8


def _recipe(tmp) -> str:
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "cli-test", "model": "tiny", "layout": "fsdp", "data": data_config(),
        "compute": COMPUTE,
        "optimizer": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.01},
        "train": {"steps": STEPS, "micro_batch_size": 1, "seq_len": SEQ_LEN, "log_every": 1, "eval_every": 0,
                  "eval_batches": 1, "checkpoint_every": 4, "keep_checkpoints": 2, "freeze_vision_model": True},
    }))
    return str(recipe)


def _restore(run_dir, step):
    with ocp.CheckpointManager((run_dir / "checkpoints").absolute(), item_names=("state", "data")) as mgr:
        out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), data=ocp.args.JsonRestore()))
    return out["state"], out["data"]


def _checkpoint_dirs(run_dir) -> list[str]:
    return sorted((p.name for p in (run_dir / "checkpoints").iterdir()), key=lambda n: (len(n), n))


def test_main_job_resume_freeze_and_outputs(tmp_path, capsys):
    """One test (one xdist worker, one compile): the uninterrupted run and its files, then two resumes in its
    directory (past a damaged step-8 checkpoint; from --resume-step 4) that log its losses again."""
    recipe = _recipe(tmp_path)
    straight = tmp_path / "straight"
    assert main(["--recipe", recipe, "--layout", "fsdp", "--run-dir", str(straight), "--quiet"]) == 0
    # the summary says how long the process took to its first step (here the test worker's age)
    assert re.search(r"first step done \d+s after the process started", capsys.readouterr().out)
    want = logged_losses(straight)
    assert sorted(want) == list(range(1, STEPS + 1)) and want[STEPS] < want[1]

    # outputs: metrics.jsonl, TensorBoard events, config.yaml (a recipe), retained checkpoints
    records = read_metrics(straight)
    assert all("tokens_per_s" in r and "trained_tokens" in r for r in records if "loss" in r)
    # throughput leaves out the first two steps (compilation; the second's start read late) and checkpoint steps
    # (null there)
    rates = {r["step"]: r["tokens_per_s"] for r in records if "loss" in r}
    assert rates[1] is None and rates[2] is None and rates[4] is None and rates[3] > 0 and rates[5] > 0
    evals = [r for r in records if "eval_accuracy" in r]
    assert len(evals) == 1 and evals[0]["step"] == STEPS and 0 <= evals[0]["eval_accuracy"] <= 1
    assert evals[0]["eval_answers"] > 0
    assert list((straight / "tensorboard").glob("events.out.tfevents.*"))
    saved = yaml.safe_load((straight / "config.yaml").read_text())
    assert saved["train"]["steps"] == STEPS and saved["model"]["name"] == "tiny"
    assert _checkpoint_dirs(straight) == ["4", "8"]

    # freezing: the vision tower is bitwise unchanged between the checkpoints, trained parts move,
    # and frozen parameters have no optimizer state
    from moevlm_jax.training.optimizer import param_group

    s4, d4 = _restore(straight, 4)
    s8, _ = _restore(straight, 8)
    p3, p6 = leaves_by_path(s4["params"]), leaves_by_path(s8["params"])
    groups = {k: param_group(k) for k in p3}
    assert {"vision_model", "vision_projection", "language_model"} <= set(groups.values())
    for k, g in groups.items():
        if g == "vision_model":
            np.testing.assert_array_equal(p6[k], p3[k], err_msg=k)
    changed = {g: any(not np.array_equal(p6[k], p3[k]) for k in p3 if groups[k] == g)
               for g in ("vision_projection", "language_model")}
    assert changed == {"vision_projection": True, "language_model": True}
    opt_paths = list(leaves_by_path(s8["opt_state"]))
    assert not any("visual/blocks" in k or "visual/patch_embed" in k or "visual/pos_embed" in k for k in opt_paths)
    assert any("visual/merger" in k for k in opt_paths) and any("embed_tokens" in k for k in opt_paths)
    assert int(s4["step"]) == 4 and int(s8["step"]) == 8

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
    assert json.loads(json.dumps(d4))["iterator"]["batches"] == 4  # the data iterator state
    _resume_past_a_damaged_checkpoint(straight, want, capsys)
    _resume_from_the_step_asked_for(straight, want, capsys)


def _loss_steps(run_dir) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir) if "loss" in r]


def _resume_past_a_damaged_checkpoint(run, want, capsys):
    """Step 8's checkpoint truncated after its commit: --resume restores step 4 (one log line for 8, no traceback),
    keeps 8 as 8.damaged, logs the uninterrupted run's losses bitwise (metrics truncated after 4, the data at 4's
    position: same program, data, parameters, optimizer state, step, RNG) and writes step 8 anew."""
    truncated = damage_checkpoint(run / "checkpoints" / str(STEPS))
    size = truncated.stat().st_size
    # reloads run/config.yaml; the generated answers were checked above
    assert main(["--run-dir", str(run), "--resume", "--quiet", "train.show_answers=0"]) == 0
    out, err = capsys.readouterr()
    skips = [ln for ln in err.splitlines() if "does not restore" in ln]
    assert len(skips) == 1 and f"checkpoint {STEPS} in" in skips[0] and "OUT_OF_RANGE" in skips[0], err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert f"resumed from step 4, not the newest checkpoint {STEPS}" in err
    assert f"steps 4 -> {STEPS} of {STEPS}" in out
    assert re.search(rf"resumed +from step 4, not the newest checkpoint: {STEPS} skipped \(.*OUT_OF_RANGE.*\), kept "
                     rf"as .*/checkpoints/{STEPS}\.damaged", out), out
    assert _loss_steps(run) == list(range(1, STEPS + 1))  # truncated after the step restored, not the one tried
    assert logged_losses(run) == want
    kept = run / "checkpoints" / f"{STEPS}.damaged" / truncated.relative_to(run / "checkpoints" / str(STEPS))
    assert kept.stat().st_size == size and _checkpoint_dirs(run) == ["4", "8", "8.damaged"]


def _resume_from_the_step_asked_for(run, want, capsys):
    """--resume-step 4 with step 8 intact: exactly 4 (8 kept as 8.superseded), the losses of the uninterrupted run;
    the key goes to config.yaml. Interrupted after step 5: the summary is what is checked."""
    assert main(["--run-dir", str(run), "--resume-step", "4", "--quiet"], stop_after=5) == 0
    out, err = capsys.readouterr()
    assert "does not restore" not in err and f"resumed from step 4, not the newest checkpoint {STEPS}" in err
    assert re.search(rf"resumed +from step 4, not the newest checkpoint: {STEPS} skipped \(newer than "
                     rf"train.resume_step=4\), kept as .*/checkpoints/{STEPS}\.superseded", out), out
    assert logged_losses(run) == {s: want[s] for s in range(1, 6)}
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["resume_step"] == 4
    assert _checkpoint_dirs(run) == ["4", "8.damaged", "8.superseded"]


def test_refuses_to_overwrite_and_names_bad_keys(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    run = tmp_path / "run"
    (run / "checkpoints" / "3").mkdir(parents=True)
    assert main(["--recipe", recipe, "--run-dir", str(run), "--quiet"]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["--recipe", recipe, "--run-dir", str(run), "--resume-step", "5", "--quiet"]) == 2
    assert "error: train.resume_step=5: no checkpoint for step 5 in" in capsys.readouterr().err
    assert not (run / "config.yaml").exists()
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
