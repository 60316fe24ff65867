"""Input pipeline on grain: sources, Qwen-VL image processing, tokenizer + chat template, packing,
built-in datasets (procedural VQA, shipped photographs), mock data.

Entry point: ``moevlm_jax.data.build_loader(config, batch_size=..., seq_len=..., shard_index=..., shard_count=...,
seed=..., split="train"|"heldout")`` -> ``Loader`` (an iterator of batch dicts, see ARCHITECTURE.md
"The batch" and "Data"), with ``get_state``/``set_state`` for checkpoints and ``summary()`` for the
run log.
"""

from __future__ import annotations

if __name__ != "moevlm_jax.data":  # the folder is the package moevlm_jax.data, not a top-level name
    raise ImportError(f"import moevlm_jax.data (this folder is installed as moevlm_jax.data, not as {__name__!r})")

from moevlm_jax.data.batch import MODEL_KEYS
from moevlm_jax.data.config import QUESTION_TYPES, DataConfig, DataError, ImageConfig, load_data_config
from moevlm_jax.data.loader import (
    HOST_KEYS,
    Loader,
    build_loader,
    merge_states,
    merge_summaries,
    model_inputs,
    throughput_line,
)
from moevlm_jax.data.metrics import answer_accuracy, merge_accuracy, question_chance
from moevlm_jax.data.packing import EVAL_KEYS
from moevlm_jax.data.sample import SKIP_REASONS
from moevlm_jax.data.sources import dataset_source, has_heldout
from moevlm_jax.data.tokenizer import load_tokenizer
from moevlm_jax.data.vqa import CHANCE

__all__ = [
    "CHANCE", "EVAL_KEYS", "HOST_KEYS", "MODEL_KEYS", "QUESTION_TYPES", "SKIP_REASONS", "DataConfig", "DataError",
    "ImageConfig", "Loader", "answer_accuracy", "build_loader", "dataset_source", "has_heldout", "load_data_config",
    "load_tokenizer", "merge_accuracy", "merge_states", "merge_summaries", "model_inputs", "question_chance",
    "throughput_line",
]
