"""Input pipeline on grain: sources, Qwen-VL image processing, tokenizer + chat template, packing,
built-in datasets (procedural VQA, shipped photographs), mock data.

Entry point: ``data.build_loader(config, batch_size=..., seq_len=..., shard_index=..., shard_count=...,
seed=..., split="train"|"heldout")`` -> ``Loader`` (an iterator of batch dicts, see ARCHITECTURE.md
"The batch" and "Data"), with ``get_state``/``set_state`` for checkpoints and ``summary()`` for the
run log. Exports load lazily (``import data`` alone imports nothing heavy).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "build_loader": "data.loader", "Loader": "data.loader", "model_inputs": "data.loader",
    "throughput_line": "data.loader", "HOST_KEYS": "data.loader", "merge_states": "data.loader",
    "MODEL_KEYS": "data.batch", "EVAL_KEYS": "data.packing",
    "DataConfig": "data.config", "ImageConfig": "data.config", "DataError": "data.config",
    "load_data_config": "data.config",
    "SKIP_REASONS": "data.sample", "QUESTION_TYPES": "data.config",
    "CHANCE": "data.vqa",
    "answer_accuracy": "data.metrics", "merge_accuracy": "data.metrics", "question_chance": "data.metrics",
    "load_tokenizer": "data.tokenizer", "has_heldout": "data.sources", "dataset_source": "data.sources",
}
__all__ = [  # noqa: RUF022 - grouped as in _EXPORTS
    "build_loader", "Loader", "model_inputs", "throughput_line", "HOST_KEYS", "merge_states", "MODEL_KEYS", "EVAL_KEYS",
    "DataConfig", "ImageConfig", "DataError", "load_data_config", "SKIP_REASONS", "QUESTION_TYPES", "CHANCE",
    "answer_accuracy", "merge_accuracy", "question_chance", "load_tokenizer", "has_heldout", "dataset_source",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'data' has no attribute {name!r}")
