"""Input pipeline on grain: sources, Qwen-VL image processing, tokenizer + chat template, packing,
built-in datasets (procedural VQA, shipped photographs), mock data.

Entry point: ``data.build_loader(config, batch_size=..., seq_len=..., shard_index=..., shard_count=...,
seed=..., split="train"|"heldout")`` -> ``Loader`` (an iterator of batch dicts, see ARCHITECTURE.md
"The batch" and "Data"), with ``get_state``/``set_state`` for checkpoints and ``summary()`` for the
run log. Exports load lazily (``import data`` alone imports nothing heavy).
"""

from __future__ import annotations

if __name__ != "moevlm_jax.data":  # the folder is the package moevlm_jax.data, not a top-level name
    raise ImportError(f"import moevlm_jax.data (this folder is installed as moevlm_jax.data, not as {__name__!r})")

import importlib
from typing import Any

_EXPORTS = {
    "build_loader": "moevlm_jax.data.loader", "Loader": "moevlm_jax.data.loader", "model_inputs": "moevlm_jax.data.loader",
    "throughput_line": "moevlm_jax.data.loader", "HOST_KEYS": "moevlm_jax.data.loader", "merge_states": "moevlm_jax.data.loader",
    "MODEL_KEYS": "moevlm_jax.data.batch", "EVAL_KEYS": "moevlm_jax.data.packing",
    "DataConfig": "moevlm_jax.data.config", "ImageConfig": "moevlm_jax.data.config", "DataError": "moevlm_jax.data.config",
    "load_data_config": "moevlm_jax.data.config",
    "SKIP_REASONS": "moevlm_jax.data.sample", "QUESTION_TYPES": "moevlm_jax.data.config",
    "CHANCE": "moevlm_jax.data.vqa",
    "answer_accuracy": "moevlm_jax.data.metrics", "merge_accuracy": "moevlm_jax.data.metrics", "question_chance": "moevlm_jax.data.metrics",
    "load_tokenizer": "moevlm_jax.data.tokenizer", "has_heldout": "moevlm_jax.data.sources", "dataset_source": "moevlm_jax.data.sources",
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
