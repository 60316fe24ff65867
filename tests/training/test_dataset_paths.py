"""Datasets passed directly (``--data PATH``) and sources without a held-out split.

- ``data.sources.dataset_source`` infers the kind from the path (a LLaVA file, ArrayRecord shards,
  an image folder) and says what it expected when it cannot tell;
- ``heldout_slice``: the held-out samples of a source without a split are the same every time,
  disjoint from the training ones, and together they are the whole source;
- the train CLI with ``--data train.json`` (a LLaVA file without a held-out file) trains, evaluates
  on the held-out slice and ends cleanly with its curves as a PNG; with ``--data images/`` (an image
  folder with captions) and ``data.heldout_fraction=0`` it trains and skips evaluation with a notice.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

from moevlm_jax.data.config import DataError
from moevlm_jax.data.sources import HELDOUT_SLICE_MAX, dataset_source, heldout_slice
from moevlm_jax.train import main
from moevlm_jax.training.metrics import read_metrics
from tests.data.images import jpeg_bytes
from tests.training.train_setup import COMPUTE, SEQ_LEN, data_config

# quick compiles (tests/xla_options.py): no reference compiled elsewhere
pytestmark = pytest.mark.usefixtures("legacy_emitters")


def test_the_kind_follows_the_path(tmp_path):
    (tmp_path / "a.jsonl").write_text("{}\n")
    assert dataset_source(tmp_path / "a.jsonl") == {"kind": "llava", "path": str(tmp_path / "a.jsonl")}
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "train-00000-of-00002.array_record").write_bytes(b"")
    assert dataset_source(shards) == {"kind": "arrayrecord", "paths": [str(shards / "*.array_record*")]}
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "x.jpg").write_bytes(jpeg_bytes(32, 32))
    assert dataset_source(pics) == {"kind": "image_folder", "path": str(pics)}
    assert dataset_source(tmp_path / "nothing-here") is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="cannot tell what dataset this folder is"):
        dataset_source(other)
    with pytest.raises(DataError, match="LLaVA .json / .jsonl"):
        dataset_source(other / "notes.txt")


def test_the_heldout_slice_is_fixed_disjoint_and_complete():
    for n, fraction, held_n in ((1000, 0.02, 20), (10, 0.02, 1), (10**6, 0.02, HELDOUT_SLICE_MAX), (1, 0.5, 0)):
        train, held = heldout_slice(n, fraction)
        again = heldout_slice(n, fraction)
        assert len(held) == held_n and np.array_equal(held, again[1]) and np.array_equal(train, again[0])
        assert not set(train.tolist()) & set(held.tolist()) and len(train) + len(held) == n
    assert len(heldout_slice(100, 0.0)[1]) == 0


def _llava(tmp_path, n=24):
    img = tmp_path / "images"
    img.mkdir()
    entries = []
    for k in range(n):
        (img / f"{k}.jpg").write_bytes(jpeg_bytes(64 + 4 * (k % 5), 48 + 4 * (k % 3), seed=k))
        entries.append({"image": f"images/{k}.jpg", "conversations": [
            {"from": "human", "value": "<image>\nWhat number is this?"}, {"from": "gpt", "value": f"It is {k}."}]})
    path = tmp_path / "train.json"
    path.write_text(json.dumps(entries))
    return path


def _folder(tmp_path, n=16):
    folder = tmp_path / "pics"
    folder.mkdir()
    for k in range(n):
        (folder / f"p{k}.jpg").write_bytes(jpeg_bytes(60 + 4 * (k % 4), 60, seed=100 + k))
    (folder / "captions.jsonl").write_text("\n".join(json.dumps({"file_name": f"p{k}.jpg", "text": f"Picture {k}."})
                                                     for k in range(n)))
    return folder


def _recipe(tmp_path) -> str:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "paths", "model": "tiny", "layout": "fsdp", "data": data_config(),
        "compute": COMPUTE, "optimizer": {"lr": 3e-3, "warmup_steps": 1},
        "train": {"steps": 2, "global_batch_size": 8, "seq_len": SEQ_LEN, "log_every": 1, "eval_every": 0,
                  "eval_batches": 1, "checkpoint_every": 0, "checkpointing": False,
                  # no generated answers (nothing here reads them; a failed one never fails the run): their prefill
                  # and decode programs compile for each run's held-out prompts
                  "show_answers": 0},
    }))
    return str(recipe)


def test_data_paths_train_and_a_source_without_heldout_ends_cleanly(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    run = tmp_path / "llava-run"
    assert main(["--recipe", recipe, "--data", str(_llava(tmp_path)), "--run-dir", str(run), "--quiet"]) == 0
    out = capsys.readouterr().out
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["data"]["source"]["kind"] == "llava" and saved["data"]["seq_len"] == SEQ_LEN  # the recipe's settings
    evals = [r for r in read_metrics(run) if "eval_loss" in r]
    assert len(evals) == 1 and np.isfinite(evals[0]["eval_loss"])  # the held-out slice: 1 of 24 samples
    assert f"curves          {run / 'curves.png'}" in out and (run / "curves.png").stat().st_size > 10_000

    run = tmp_path / "folder-run"
    assert main(["--recipe", recipe, "--data", str(_folder(tmp_path)), "--run-dir", str(run), "--quiet",
                 "data.heldout_fraction=0"]) == 0
    out = capsys.readouterr()
    assert "held-out        skipped: no held-out split" in out.out
    assert "evaluation skipped" in out.err
    losses = [r["loss"] for r in read_metrics(run) if "loss" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert not [r for r in read_metrics(run) if "eval_loss" in r]
