"""The Qwen3-VL-MoE model: vision tower (``vision``), decoder (``decoder``, ``moe``), attention and
rotary ops, MRoPE position ids, host-side batch construction (``batch``), losses (``loss``) and the
top-level ``qwen3_vl_moe.Qwen3VLMoe``."""
