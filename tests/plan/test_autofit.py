"""Auto-fit (moevlm_jax/plan/autofit.py) through the train CLI, in process, on the 8 CPU devices
with the tiny model and real VQA images, under a deliberately small per-device memory limit
(``--device-memory``):

- a run that does not fit gets the planner's fastest fitting change, says what it changed and why,
  keeps the global batch, saves the changed settings in its config.yaml, and trains; the planner
  judges the changed run to fit the same limit;
- where nothing fits, the command stops with exit status 2 and the planner's table;
- ``--no-auto-fit`` runs the recipe as written (no plan, no change);
- a run that compiles its step ahead (``train.compile: ahead``) whose fit is in doubt: the compiled check
  compiles the run's own program (its patch bucket, loss capacity and schedule), so that with
  ``train.compilation_cache_dir`` the run loads it: the step compiled once, not twice.
"""

from __future__ import annotations

import math

import jax
import pytest
import yaml

from moevlm_jax.config.run import load_config
from moevlm_jax.plan.fit import fit
from moevlm_jax.plan.time import H200
from moevlm_jax.train import main
from moevlm_jax.training.metrics import read_metrics
from tests.training.train_setup import COMPUTE, SEQ_LEN, data_config

# quick compiles (tests/xla_options.py): no reference compiled elsewhere
pytestmark = pytest.mark.usefixtures("legacy_emitters")

STEPS = 2
GLOBAL_BATCH = 16


def _recipe(tmp) -> str:
    recipe = tmp / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "autofit-test", "model": "tiny", "layout": "fsdp", "data": data_config(),
        "compute": {**COMPUTE, "recompute": "none"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"steps": STEPS, "global_batch_size": GLOBAL_BATCH, "micro_batch_size": 2, "grad_accum": None,
                  "seq_len": SEQ_LEN, "log_every": 1, "eval_every": 0, "eval_batches": 0, "checkpoint_every": 0},
    }))
    return str(recipe)


def test_a_run_that_does_not_fit_is_fitted_said_and_trained(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    cfg = load_config(recipe, num_devices=8)
    as_written = fit(cfg, jax.devices(), device_memory_gib=1000.0, compile=False).current.memory.total
    # the recipe's estimate 1.4x the limit: no compile needed to see it does not fit (autofit.SURE_FAILS)
    limit_gib = as_written / 1.4 / 2**30 / H200.usable_fraction
    expected = fit(cfg, jax.devices(), device_memory_gib=limit_gib, compile=False)
    assert not expected.fits and expected.change, expected.reason

    run_dir = tmp_path / "run"
    assert main(["--recipe", recipe, "--run-dir", str(run_dir), "--device-memory", str(limit_gib), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "auto-fit: does not fit" in out and "Fastest fitting change" in out, out
    said = next(line for line in out.splitlines() if line.startswith("auto-fit: running with"))
    saved = load_config(run_dir / "config.yaml", num_devices=8)
    assert saved.global_batch_size == GLOBAL_BATCH  # the rows a step trains on are the recipe's
    for item in said.removeprefix("auto-fit: running with ").split(" (")[0].split():
        key, value = item.split("=", 1)
        if key == "layout":
            assert saved.layout.name == value
            continue
        section, *path = key.split(".")
        obj = getattr(saved, "optimizer" if section == "optimizer" else section)
        for name in path:
            obj = obj[name] if isinstance(obj, dict) else getattr(obj, name)
        obj = list(obj) if isinstance(obj, tuple) else obj
        assert str(obj).lower().replace("'", "").replace(" ", "") == value.lower().replace("null", "none"), (key, obj)
    assert len(said.split()) > 3  # at least one setting changed (each checked above)
    assert fit(saved, jax.devices(), device_memory_gib=limit_gib, compile=False).fits
    losses = [r["loss"] for r in read_metrics(run_dir) if "loss" in r]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)


def test_nothing_fits_stops_with_the_table_and_no_auto_fit_keeps_the_recipe(tmp_path, capsys, monkeypatch):
    recipe = _recipe(tmp_path)
    assert main(["--recipe", recipe, "--run-dir", str(tmp_path / "none"), "--device-memory", "1e-4", "--quiet"]) == 2
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "error: the run does not fit 8 CPU device(s)" in text and "Nothing among" in text, text
    assert any(line.split()[:3] == ["#", "fits", "layout"] for line in text.splitlines()), text  # the table
    assert not (tmp_path / "none" / "metrics.jsonl").exists()  # stopped before the first step

    # --no-auto-fit: the recipe as written reaches the loop (which is not run here: the training
    # itself is what the test above checks), and nothing is planned or printed
    import moevlm_jax.plan.autofit as autofit
    import moevlm_jax.training.loop as loop

    seen = []
    monkeypatch.setattr(autofit, "auto_fit", lambda *a, **k: pytest.fail("auto-fit ran under --no-auto-fit"))
    monkeypatch.setattr(loop, "run", lambda cfg, **k: seen.append(cfg) or {"stopped": None, **_SUMMARY})
    assert main(["--recipe", recipe, "--run-dir", str(tmp_path / "kept"), "--device-memory", "1e-4",
                 "--no-auto-fit", "--quiet"]) == 0
    assert "auto-fit" not in capsys.readouterr().out
    assert (seen[0].train.micro_batch_size, seen[0].compute.recompute) == (2, "none")


_SUMMARY = {"run_dir": "r", "start_step": 0, "end_step": 0, "steps": STEPS, "wall_s": 0.0, "compiles": 0,
            "loss_first": None, "loss_last": None, "first_step": None, "last_step": None, "tokens_per_s": None,
            "tflops_per_device": None, "skipped_updates": 0, "data": {}, "evals": []}


def test_the_compiled_check_is_the_program_the_run_compiles_ahead(tmp_path, capsys):
    import jax.monitoring

    recipe = tmp_path / "recipe.yaml"
    cache = tmp_path / "jax_cache"
    recipe.write_text(yaml.safe_dump({
        "name": "autofit-ahead", "model": "tiny", "layout": "fsdp", "data": data_config(), "compute": COMPUTE,
        "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"steps": 1, "global_batch_size": 8, "seq_len": SEQ_LEN, "eval_every": 0, "eval_batches": 0,
                  "checkpointing": False, "tensorboard": False, "show_answers": 0, "compile": "ahead",
                  "compilation_cache_dir": str(cache)},
    }))
    cfg = load_config(str(recipe), num_devices=8)
    estimated = fit(cfg, jax.devices(), device_memory_gib=1000.0, compile=False).current.memory.total
    limit_gib = estimated / 2**30 / H200.usable_fraction  # the estimate at the usable memory: in doubt, compiled
    hits = []

    def listen(event, **_):
        hits.append(event)

    jax.monitoring.register_event_listener(listen)
    try:
        assert main(["--recipe", str(recipe), "--run-dir", str(tmp_path / "run"), "--device-memory", str(limit_gib),
                     "--quiet"]) == 0
    finally:
        jax.monitoring.unregister_event_listener(listen)
    assert "auto-fit" not in capsys.readouterr().out  # it fits as written (XLA's figure decided)
    steps = [p for p in cache.iterdir() if p.name.startswith("jit__train_step")]
    # one train-step program in the cache: the check's compile, which the run's compile ahead loaded
    assert len(steps) == 1 and hits.count("/jax/compilation_cache/cache_hits") >= 1, (steps, hits)
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [1]
