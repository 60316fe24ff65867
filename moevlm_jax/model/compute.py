"""Names and validation of ``ComputeConfig``'s recompute, offload and capture options (kept out of
config.py; re-exported there). The policies are built by ``moevlm_jax.model.layers.remat_policy``,
the capture flags by ``moevlm_jax.training.capture``."""

from __future__ import annotations

from typing import Any

RECOMPUTE_MODES = ("none", "full", "selective")
# Checkpoint names (``jax.ad_checkpoint.checkpoint_name``) a recompute policy chooses among:
#   layernorm  norm outputs                core_attn  attention output before the out-projection
#   qkv_proj   q/k/v projections           attn_out   attention out-projection output
#   mlp_hidden MLP hidden before its activation (decoder: gate/up projections; vision: fc1)
#   mlp        dense / vision MLP output
#   moe_router router logits               moe        MoE block output
#   moe_permuted token rows in the experts' layout     moe_gate_up  the experts' gate/up matmul output
#   moe_act    expert activation (SwiGLU)  moe_expert_out  the experts' down matmul output
# (the moe_* inside parallelism.permute). Selective recompute saves every name not listed under a
# recompute module, as Megatron recomputes only those modules: a tensor the backward needs and no name
# covers (e.g. an activation's input) would make jax.checkpoint recompute the matmul behind it.
CHECKPOINT_NAMES = ("layernorm", "qkv_proj", "core_attn", "attn_out", "mlp_hidden", "mlp", "moe_router", "moe",
                    "moe_permuted", "moe_gate_up", "moe_act", "moe_expert_out")
# Megatron's recompute modules -> the checkpoint names they stand for
RECOMPUTE_MODULES = {
    "core_attn": ("core_attn",),
    "moe_act": ("moe_act",),
    "layernorm": ("layernorm",),
    "mlp": ("mlp_hidden", "mlp"),
    "moe": ("moe_router", "moe", "moe_permuted", "moe_gate_up", "moe_act", "moe_expert_out"),
    # not Megatron's: the expert matmuls' inputs/outputs (recompute both grouped matmuls in the backward,
    # keeping only moe_act; ~3 GB less a layer at the proxy's MBS 8: bench/step_h200.md, after run 8)
    "experts": ("moe_permuted", "moe_gate_up", "moe_expert_out"),
}
CAPTURE_MODES = ("none", "step", "scopes")
CAPTURE_SCOPES = ("attn", "moe_router", "moe_preprocess", "full_iteration")  # Megatron's CUDA-graph scope names
# compute.attention_options: the cuDNN attention's static ragged bound (segments a row; a row with more
# runs the dense-mask kernel) and a head dim to zero-pad q/k/v to (a kernel tuned for it; None: as is),
# for the decoder and, with the "vision_" prefix, the vision tower (null: the decoder's value)
ATTENTION_OPTIONS = {"max_segments": 16, "pad_head_dim": None, "vision_max_segments": None, "vision_pad_head_dim": None}
RENAMED = {"remat": "recompute", "remat_modules": "recompute_modules"}  # old compute keys -> new


def checkpoint_names_of(entries: Any) -> tuple[str, ...]:
    """Checkpoint names for a list of recompute-module or checkpoint names (a module name stands for
    its names in RECOMPUTE_MODULES, e.g. mlp -> mlp_hidden, mlp), in CHECKPOINT_NAMES order."""
    names = {n for e in entries for n in RECOMPUTE_MODULES.get(e, (e,))}
    return tuple(n for n in CHECKPOINT_NAMES if n in names)


def _check(ok: Any, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_recompute_and_capture(c: Any) -> None:
    """Validate a ComputeConfig's recompute / offload / capture fields (list fields already tuples);
    raises ValueError naming the field."""
    modules = tuple(RECOMPUTE_MODULES)
    for prefix in ("", "vision_"):  # the vision fields may be null: the decoder's setting
        mode, mods = getattr(c, f"{prefix}recompute"), getattr(c, f"{prefix}recompute_modules")
        null = " or null" if prefix else ""
        _check((prefix and mode is None) or mode in RECOMPUTE_MODES,
               f"compute.{prefix}recompute must be one of {RECOMPUTE_MODES}{null}, got {mode!r}")
        _check((prefix and mods is None) or isinstance(mods, tuple),
               f"compute.{prefix}recompute_modules must be a list of {modules}{null}, got {mods!r}")
        bad = [m for m in mods or () if m not in modules]
        _check(not bad, f"compute.{prefix}recompute_modules {bad} are not among Megatron's recompute modules {modules}")
    _check(isinstance(c.offload, tuple), f"compute.offload must be a list of names, got {c.offload!r}")
    bad = [n for n in c.offload if n not in modules and n not in CHECKPOINT_NAMES]
    _check(not bad, f"compute.offload {bad} are neither recompute modules {modules} nor checkpoint names {CHECKPOINT_NAMES}")
    for tower in ("text", "vision"):
        mode, mods = c.stack_recompute(tower)
        both = set(checkpoint_names_of(mods)) & set(checkpoint_names_of(c.offload)) if mode == "selective" else ()
        own = tower == "vision" and c.vision_recompute_modules is not None
        key = "vision_recompute_modules" if own else "recompute_modules"
        _check(not both, f"compute.offload and compute.{key} both name {sorted(both)}: a tensor is either "
                         "recomputed or offloaded to host memory, not both")
    _check(c.capture in CAPTURE_MODES, f"compute.capture must be one of {CAPTURE_MODES}, got {c.capture!r}")
    _check(isinstance(c.capture_scopes, tuple) and all(s in CAPTURE_SCOPES for s in c.capture_scopes),
           f"compute.capture_scopes must be a list of {CAPTURE_SCOPES}, got {c.capture_scopes!r}")
    _check(c.capture != "scopes" or c.capture_scopes,
           "compute.capture: scopes needs at least one compute.capture_scopes entry")


def check_attention_options(options: Any) -> None:
    """Validate ``compute.attention_options`` (a mapping; keys and defaults: ATTENTION_OPTIONS)."""
    _check(hasattr(options, "items"), f"compute.attention_options must be a mapping, got {options!r}")
    bad = sorted(set(options) - set(ATTENTION_OPTIONS))
    _check(not bad, f"compute.attention_options: unknown keys {bad}; known: {sorted(ATTENTION_OPTIONS)}")
    for key, value in options.items():
        ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
        _check(ok and (value is not None or key != "max_segments"),
               f"compute.attention_options.{key} must be a positive int{'' if key == 'max_segments' else ' or null'}, got {value!r}")
        _check(not key.endswith("pad_head_dim") or value is None or value % 8 == 0,
               f"compute.attention_options.{key} must be a multiple of 8 (cuDNN's head dims), got {value!r}")


def attention_kwargs(options: Any, tower: str) -> dict[str, Any]:
    """``max_segments`` / ``pad_head_dim`` of ``compute.attention_options`` for the decoder ("text")
    or the vision tower ("vision": its own values where set, else the decoder's)."""
    merged = {**ATTENTION_OPTIONS, **dict(options)}
    out = {k: merged[k] for k in ("max_segments", "pad_head_dim")}
    if tower == "vision":
        out.update({k: merged[f"vision_{k}"] for k in out if merged[f"vision_{k}"] is not None})
    return out
