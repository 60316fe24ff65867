"""Hugging Face checkpoint import / export for Qwen3-VL-MoE.

``load_pretrained(path)`` reads an HF model directory (config.json + one or many ``*.safetensors``,
with or without ``model.safetensors.index.json``), streaming tensor by tensor into a
:class:`~moevlm_jax.model.qwen3_vl_moe.Qwen3VLMoe`. ``save_pretrained(model, config, path)`` writes a
directory that ``transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained`` loads.

- :mod:`~moevlm_jax.hf.names`: the name / layout table (:func:`checkpoint_entries`) and the
  per-tensor layout changes, including both fused-expert layouts;
- :mod:`~moevlm_jax.hf.checkpoint`: loading and saving through the ``safetensors`` library;
- :mod:`~moevlm_jax.hf.errors`: :class:`CheckpointError`.
"""

from moevlm_jax.hf.checkpoint import SafetensorsFile, abstract_model, load_pretrained, save_pretrained
from moevlm_jax.hf.errors import CheckpointError
from moevlm_jax.hf.names import Entry, checkpoint_entries

__all__ = [
    "CheckpointError",
    "Entry",
    "SafetensorsFile",
    "abstract_model",
    "checkpoint_entries",
    "load_pretrained",
    "save_pretrained",
]
