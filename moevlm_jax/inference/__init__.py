"""Generation for Qwen3-VL-MoE: a KV-cache decoder (prefill + one compiled decode loop), greedy or
temperature + top-p sampling, the training data's chat template / tokenizer / image and video processing, and
model loading from an HF directory or a training run (``python -m moevlm_jax.generate``).

- :mod:`~moevlm_jax.inference.engine`: ``generate_ids`` (token ids), ``generate`` (chat prompts ->
  text), ``answer_questions`` (held-out (images, question, answer) -> generated answers),
  ``record_questions`` (a data record -> such questions), ``Prompt``, ``chat_prompt``;
- :mod:`~moevlm_jax.inference.kv_cache`: the cache layout (``init_cache``, ``cache_segment_ids``);
- :mod:`~moevlm_jax.inference.sampling`: ``sample_token``, ``top_p_mask``;
- :mod:`~moevlm_jax.inference.loading`: ``load_hf``, ``load_run`` -> ``Loaded``; ``model_for_generation``
  (a config + a params tree, e.g. the trainer's, -> a model under ``generation_compute``).
"""

from moevlm_jax.inference.engine import (
    TRACES,
    Generation,
    Prompt,
    Video,
    answer_questions,
    chat_prompt,
    generate,
    generate_ids,
    load_video,
    prompt_batch,
    question_text,
    record_questions,
    stop_ids_of,
)
from moevlm_jax.inference.kv_cache import cache_segment_ids, init_cache
from moevlm_jax.inference.loading import Loaded, generation_compute, load_hf, load_run, model_for_generation
from moevlm_jax.inference.sampling import sample_token, top_p_mask

__all__ = [
    "TRACES",
    "Generation",
    "Loaded",
    "Prompt",
    "Video",
    "answer_questions",
    "cache_segment_ids",
    "chat_prompt",
    "generate",
    "generate_ids",
    "generation_compute",
    "init_cache",
    "load_hf",
    "load_run",
    "load_video",
    "model_for_generation",
    "prompt_batch",
    "question_text",
    "record_questions",
    "sample_token",
    "stop_ids_of",
    "top_p_mask",
]
