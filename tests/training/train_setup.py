"""Shared set-up of the train tests: the tiny model (Qwen3 vocabulary) on a small
built-in VQA set with one patch bucket, so every run compiles one train step."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from moevlm_jax.config import CONFIG_DIR

SEQ_LEN = 128
ROWS = 8  # global batch rows: MBS 8 on 1 device, MBS 1 under FSDP on 8 devices
COMPUTE = {"dtype": "float32", "param_dtype": "float32"}


def data_config() -> dict[str, Any]:
    """The vqa preset shrunk: 160 train / 48 held-out samples, images <= 128 x 128 px, rows of
    SEQ_LEN tokens holding <= 256 patches (one patch bucket); generated once for the whole test run, in the
    run's data cache (tests/conftest.py: ``MOEVLM_TEST_DATA_CACHE``, every process of the run)."""
    raw = yaml.safe_load((CONFIG_DIR / "data" / "vqa.yaml").read_text())
    raw["source"] = {**raw["source"], "num_train": 160, "num_heldout": 48, "image_size": [64, 128]}
    raw["image"] = {"min_pixels": 4096, "max_pixels": 16384}
    raw.update(patch_buckets=[256], seq_len=SEQ_LEN, batch_size=ROWS, cache_dir=os.environ["MOEVLM_TEST_DATA_CACHE"])
    raw.pop("description", None)
    return raw


def host_batches(n: int, rows: int = ROWS, **data: Any) -> list[dict[str, Any]]:
    """The first ``n`` training batches of ``rows`` rows (numpy, as the loader gives them); ``data``: further
    data-config keys (e.g. ``balance_vision_rows``)."""
    import moevlm_jax.data as data_lib

    loader = data_lib.build_loader({**data_config(), **data}, batch_size=rows)
    try:
        return [next(loader) for _ in range(n)]
    finally:
        loader.close()


def logged_losses(run_dir: str | Path) -> dict[int, float]:
    """step -> loss of the training records a train CLI run logged to ``run_dir``/metrics.jsonl."""
    from moevlm_jax.training.metrics import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(Path(run_dir)) if "loss" in r}


def leaves_by_path(tree: Any) -> dict[str, np.ndarray]:
    """'/'-joined path -> numpy array for every leaf of ``tree``."""
    import jax

    from moevlm_jax.parallelism.sharding import path_str

    return {path_str(kp): np.asarray(x) for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def damage_checkpoint(step_dir: str | Path) -> Path:
    """Truncate the largest array data file of the checkpoint in ``step_dir`` (``checkpoints/<step>``) to half its
    size, as a full disk or a partial copy leaves it after the checkpoint was committed; returns the file."""
    files = [p for p in (Path(step_dir) / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    target = max(files, key=lambda p: p.stat().st_size)
    with open(target, "r+b") as f:
        f.truncate(target.stat().st_size // 2)
    return target
