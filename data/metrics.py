"""Held-out answer accuracy from eval batches (teacher-forced exact match of the answer tokens)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from moevlm_jax.data import vqa
from moevlm_jax.data.sample import QUESTION_TYPES


def question_chance(cfg: Any) -> dict[str, float]:
    """Each question type's chance level for a ``DataConfig`` whose source is the built-in VQA set (its
    parameters decide, e.g. ``text_words``); empty for other sources (their chance shows as NaN)."""
    return vqa.chance(vqa.vqa_params(cfg.source)) if getattr(cfg.source, "kind", None) == "vqa" else {}


def answer_accuracy(batch: Mapping[str, Any], predictions: np.ndarray, chance: Mapping[str, float] | None = None
                    ) -> dict[str, dict[str, float]]:
    """Per question type: answers, exact-match correct, accuracy, chance; ``predictions`` [B, S] = argmax ids.

    ``predictions[b, s]`` is the model's prediction for ``targets[b, s]``. An answer (one
    ``answer_group`` of a row) counts as correct when every one of its tokens is predicted. Types
    come from ``answer_type`` (index into ``QUESTION_TYPES``); answers of unknown type (-1) go to
    ``other``. ``all`` aggregates every answer. ``chance``: per type (:func:`question_chance`; default
    the VQA set's default parameters).
    """
    groups = np.asarray(batch["answer_group"])
    types = np.asarray(batch["answer_type"])
    mask = np.asarray(batch["loss_mask"]) > 0
    hit = np.asarray(predictions) == np.asarray(batch["targets"])
    out: dict[str, dict[str, float]] = {}
    for r in range(groups.shape[0]):
        for g in np.unique(groups[r][mask[r] & (groups[r] > 0)]):
            sel = mask[r] & (groups[r] == g)
            t = int(types[r][sel][0])
            name = QUESTION_TYPES[t] if 0 <= t < len(QUESTION_TYPES) else "other"
            for key in (name, "all"):
                entry = out.setdefault(key, {"answers": 0, "correct": 0})
                entry["answers"] += 1
                entry["correct"] += int(hit[r][sel].all())
    return _rates(out, chance)


def merge_accuracy(parts: list[dict[str, dict[str, float]]], chance: Mapping[str, float] | None = None
                   ) -> dict[str, dict[str, float]]:
    """Sum ``answer_accuracy`` results over batches (``chance`` as there)."""
    out: dict[str, dict[str, float]] = {}
    for part in parts:
        for key, e in part.items():
            entry = out.setdefault(key, {"answers": 0, "correct": 0})
            entry["answers"] += e["answers"]
            entry["correct"] += e["correct"]
    return _rates(out, chance)


def _rates(out: dict[str, dict[str, float]], chance: Mapping[str, float] | None) -> dict[str, dict[str, float]]:
    if chance is None:
        chance = vqa.CHANCE
    for key, entry in out.items():
        entry["accuracy"] = entry["correct"] / entry["answers"]
        entry["chance"] = chance.get(key, float("nan"))
    return out
