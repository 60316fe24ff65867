"""moevlm_jax: Mixture-of-Experts vision-language models (Qwen3-VL-MoE) in JAX / Flax NNX.

Subpackages by role (ARCHITECTURE.md, "Where is what"): ``model`` (modules and the model config),
``training`` (trainer, objective, optimizer, checkpoints, metrics, loop), ``config`` (the one typed
configuration and its loader), ``hf`` (Hugging Face checkpoints), ``tools`` (benchmarks, sweep,
memory report, breakdowns, FLOPs); the commands ``python -m moevlm_jax.train`` and
``moevlm_jax.launch``.
"""
