"""Hugging Face checkpoint import / export for every model family (Qwen3-VL-MoE, Qwen3.5-MoE).

``load_pretrained(path)`` reads an HF model directory (config.json + one or many ``*.safetensors``,
with or without ``model.safetensors.index.json``), streaming tensor by tensor into the model of the
family config.json's ``model_type`` names (:mod:`moevlm_jax.model.registry`:
:class:`~moevlm_jax.model.qwen3_vl_moe.Qwen3VLMoe` or :class:`~moevlm_jax.model.qwen3_5_moe.Qwen35Moe`).
``save_pretrained(model, config, path)`` writes a directory that transformers'
``Qwen3VLMoeForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration`` loads.

- :func:`checkpoint_entries` (any family, by the registry); :mod:`~moevlm_jax.hf.names` (Qwen3-VL) and
  :mod:`~moevlm_jax.hf.qwen3_5_names` (Qwen3.5): the name / layout tables and the per-tensor layout
  changes, including both fused-expert layouts;
- :mod:`~moevlm_jax.hf.checkpoint`: loading and saving through the ``safetensors`` library;
- :mod:`~moevlm_jax.hf.errors`: :class:`CheckpointError`.
"""

from moevlm_jax.hf.checkpoint import (
    SafetensorsFile,
    abstract_model,
    checkpoint_entries,
    load_pretrained,
    save_pretrained,
)
from moevlm_jax.hf.errors import CheckpointError
from moevlm_jax.hf.names import Entry

__all__ = [
    "CheckpointError",
    "Entry",
    "SafetensorsFile",
    "abstract_model",
    "checkpoint_entries",
    "load_pretrained",
    "save_pretrained",
]
