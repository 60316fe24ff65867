"""Names and validation of ``ComputeConfig``'s recompute, offload and capture options (kept out of
config.py; re-exported there). The policies are built by ``moevlm_jax.model.layers.remat_policy``,
the capture flags by ``moevlm_jax.capture``."""

from __future__ import annotations

from typing import Any

RECOMPUTE_MODES = ("none", "full", "selective")
# Checkpoint names (``jax.ad_checkpoint.checkpoint_name``) a recompute policy chooses among:
#   layernorm  norm outputs                core_attn  attention output before the out-projection
#   qkv_proj   q/k/v projections           attn_out   attention out-projection output
#   mlp_hidden MLP hidden (decoder: gate/up projections; vision: fc1 + activation)
#   mlp        dense / vision MLP output
#   moe_router router logits               moe        MoE block output
#   moe_act    expert activation (inside parallelism.experts.experts_forward)
CHECKPOINT_NAMES = ("layernorm", "qkv_proj", "core_attn", "attn_out", "mlp_hidden", "mlp", "moe_router", "moe", "moe_act")
# Megatron's recompute modules -> the checkpoint names they stand for
RECOMPUTE_MODULES = {
    "core_attn": ("core_attn",),
    "moe_act": ("moe_act",),
    "layernorm": ("layernorm",),
    "mlp": ("mlp_hidden", "mlp"),
    "moe": ("moe_router", "moe", "moe_act"),
}
CAPTURE_MODES = ("none", "step", "scopes")
CAPTURE_SCOPES = ("attn", "moe_router", "moe_preprocess", "full_iteration")  # Megatron's CUDA-graph scope names
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
