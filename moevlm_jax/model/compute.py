"""How the model computes: the ``compute`` section of a run (``ComputeConfig``).

Dtypes, the attention kernel and its options, the layer scan, recompute (Megatron's selective
recompute as remat policies: ``moevlm_jax.model.layers.remat_policy``), offload, capture
(Megatron's CUDA-graph scopes as XLA command buffers: ``moevlm_jax.training.capture``), the experts
(``parallelism.experts.ExpertsConfig``) and the router (:class:`RouterConfig`). Frozen and
hashable: the config lives inside the Flax modules and is a static argument of the compiled steps.
Constructed directly (``ComputeConfig(dtype="float32", moe={"backend": "dense"})``: mappings of the
nested sections are accepted) or loaded with the one config loader (``ComputeConfig.from_dict``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from moevlm_jax.parallelism.experts import ExpertsConfig
from moevlm_jax.parallelism.fp8 import Fp8Config
from moevlm_jax.schema import build, coerce_fields

Dtype = Literal["float32", "bfloat16", "float16"]
RecomputeMode = Literal["none", "full", "selective"]
RECOMPUTE_MODES = ("none", "full", "selective")
# the XLA flags compute.capture sets (moevlm_jax.training.capture), which compute.xla_flags may not
XLA_FLAGS_OF_CAPTURE = ("--xla_gpu_enable_command_buffer", "--xla_gpu_graph_min_graph_size")
# Checkpoint names (``jax.ad_checkpoint.checkpoint_name``) a recompute policy chooses among:
#   layernorm  norm outputs                core_attn  attention output before the out-projection
#   qkv_proj   q/k/v projections           attn_out   attention out-projection output
#   mlp_hidden MLP hidden before its activation (decoder: gate/up projections; vision: fc1)
#   mlp        dense / vision MLP output
#   moe_router router logits               moe        MoE block output
#   moe_permuted token rows in the experts' layout     moe_gate_up  the experts' gate/up matmul output
#   moe_act    expert activation (SwiGLU)  moe_expert_out  the experts' down matmul output
#   gdn_conv   Gated DeltaNet: the causal conv's (silu) output, q | k | v before the delta rule
#   gdn_core   Gated DeltaNet: the chunked delta rule's output    gated_norm  its gated RMSNorm output
# (the moe_* inside parallelism.permute; the gdn_* and gated_norm in model.qwen3_5_gdn). Selective recompute saves
# every name not listed under a recompute module, as Megatron recomputes only those modules: a tensor the backward
# needs and no name covers (e.g. an activation's input) would make jax.checkpoint recompute the matmul behind it.
CHECKPOINT_NAMES = ("layernorm", "qkv_proj", "core_attn", "attn_out", "mlp_hidden", "mlp", "moe_router", "moe",
                    "moe_permuted", "moe_gate_up", "moe_act", "moe_expert_out", "gdn_conv", "gdn_core", "gated_norm")
# Megatron's recompute modules -> the checkpoint names they stand for
RECOMPUTE_MODULES = {
    "core_attn": ("core_attn",),
    "moe_act": ("moe_act",),
    "layernorm": ("layernorm",),
    "mlp": ("mlp_hidden", "mlp"),
    "moe": ("moe_router", "moe", "moe_permuted", "moe_gate_up", "moe_act", "moe_expert_out"),
    # not Megatron's: the expert matmuls' inputs/outputs (recompute both grouped matmuls in the backward,
    # keeping only moe_act; ~3 GB less a layer at the proxy's MBS 8: bench/results/step.md)
    "experts": ("moe_permuted", "moe_gate_up", "moe_expert_out"),
    # not Megatron's (its recompute modules predate the Gated DeltaNet): the GDN layer's mixer between its
    # projections (kept as qkv_proj) and out-projection (attn_out), as core_attn is attention's: the conv,
    # the delta rule and the gated norm run again in the backward
    "gdn": ("gdn_conv", "gdn_core", "gated_norm"),
}
CAPTURE_MODES = ("none", "step", "scopes")
CAPTURE_SCOPES = ("attn", "moe_router", "moe_preprocess", "full_iteration")  # Megatron's CUDA-graph scope names


def checkpoint_names_of(entries: Any) -> tuple[str, ...]:
    """Checkpoint names for a list of recompute-module or checkpoint names (a module name stands for
    its names in RECOMPUTE_MODULES, e.g. mlp -> mlp_hidden, mlp), in CHECKPOINT_NAMES order."""
    names = {n for e in entries for n in RECOMPUTE_MODULES.get(e, (e,))}
    return tuple(n for n in CHECKPOINT_NAMES if n in names)


def _check(ok: Any, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """The cuDNN attention's static ragged bound and head-dim padding, per tower (bench/results/attention.md)."""

    # packed segments a decoder row may hold on the ragged (THD) kernel; a row with more runs the
    # dense-mask kernel (exact, slower); the trainer checks each batch on the host
    max_segments: int = 16
    pad_head_dim: int | None = None  # zero-pad the decoder's q/k/v head dim to this (a tuned kernel); null: as is
    vision_max_segments: int | None = None  # the vision tower's bound on images a row (null: max_segments)
    vision_pad_head_dim: int | None = None  # the vision tower's head-dim padding (null: pad_head_dim)
    # the most patches one image holds (null: derived from moevlm_jax.data.image.max_pixels): the XLA attention
    # (CPU) of the vision tower then computes only a band around each image (exact; the trainer checks
    # each batch on the host and runs the whole-row attention for a batch with a longer image)
    vision_max_image_patches: int | None = None

    def __post_init__(self) -> None:
        coerce_fields(self, "compute.attention_options")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
            _check(ok and (value is not None or f.name != "max_segments"),
                   f"compute.attention_options.{f.name} must be a positive int"
                   f"{'' if f.name == 'max_segments' else ' or null'}, got {value!r}")
            _check(not f.name.endswith("pad_head_dim") or value is None or value % 8 == 0,
                   f"compute.attention_options.{f.name} must be a multiple of 8 (cuDNN's head dims), got {value!r}")

    def for_tower(self, tower: str) -> dict[str, Any]:
        """``max_segments`` / ``pad_head_dim`` for the decoder ("text") or the vision tower ("vision":
        its own values where set, else the decoder's; and ``max_segment_len``, the XLA path's bound)."""
        out = {"max_segments": self.max_segments, "pad_head_dim": self.pad_head_dim}
        if tower == "vision":
            own = {"max_segments": self.vision_max_segments, "pad_head_dim": self.vision_pad_head_dim}
            out.update({k: v for k, v in own.items() if v is not None})
            out["max_segment_len"] = self.vision_max_image_patches
        return out


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Router / load-balancing options (Megatron's knobs; formulas in ``moevlm_jax.model.router``)."""

    # hf: HF load_balancing_loss_func over all layers and tokens (the parity default) | aux_loss: per
    # micro-batch per data-parallel rank | seq_aux_loss: per sequence | global_aux_loss: over the whole
    # micro-batch, all data-parallel ranks | none
    aux_loss: Literal["hf", "aux_loss", "seq_aux_loss", "global_aux_loss", "none"] = "hf"
    aux_loss_coef: float | None = None  # null: the model config's router_aux_loss_coef
    z_loss_coef: float | None = 0.0  # ST-MoE router z-loss weight (null: 0)
    # aux-loss-free balancing: a per-layer bias added to the scores for the top-k choice only
    expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3  # bias update per step: rate * sign(mean load - load)
    dtype: Literal["float32", "compute"] = "float32"  # router logits in float32 (Megatron's fp32) or the compute dtype

    @classmethod
    def __normalize__(cls, d: dict[str, Any]) -> dict[str, Any]:
        """The retired value 'global' says what it became."""
        if d.get("aux_loss") == "global":
            raise ValueError("compute.router.aux_loss 'global' is now 'hf' (HF's load_balancing_loss_func); "
                             "Megatron's global-batch loss is 'global_aux_loss'")
        return d

    def __post_init__(self) -> None:
        coerce_fields(self, "compute.router")
        if self.z_loss_coef is None:
            object.__setattr__(self, "z_loss_coef", 0.0)
        for key in ("aux_loss_coef", "z_loss_coef", "expert_bias_update_rate"):
            v = getattr(self, key)
            ok = (v is None and key == "aux_loss_coef") or (
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
            _check(ok, f"compute.router.{key} must be a number >= 0, got {v!r}")
            if v is not None:
                object.__setattr__(self, key, float(v))

    def coef(self, model_default: float) -> float:
        """The aux-loss coefficient in use (0 when ``aux_loss`` is "none")."""
        if self.aux_loss == "none":
            return 0.0
        return float(model_default if self.aux_loss_coef is None else self.aux_loss_coef)


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """How the model computes: dtypes, attention kernel, scan over depth, recompute, capture, MoE/router."""

    dtype: Dtype = "bfloat16"  # compute dtype of activations and matmuls
    param_dtype: Dtype = "float32"  # master weights (and their gradients)
    attention: Literal["auto", "xla", "cudnn"] = "auto"  # attention kernel (auto: cuDNN on GPUs, XLA elsewhere)
    attention_options: AttentionOptions = AttentionOptions()  # the cuDNN kernel's ragged bounds and head-dim padding
    # Qwen3.5's Gated DeltaNet core (model.gated_deltanet.gated_delta_rule): auto = the Pallas-Triton kernels
    # (parallelism.gdn_triton) on GPUs for bf16 / fp16, the einsum path (xla) elsewhere; the context-parallel
    # shards always run the einsum path
    gdn_kernel: Literal["auto", "xla", "triton"] = "auto"
    scan_layers: bool = True  # scan over stacked layers (false: unrolled, no per-layer weight slices, ~2x compile)
    # the vision tower's own setting (null: scan_layers): its many small layers cost most of an unrolled
    # compile and little per-layer slicing, the decoder's few MoE layers the opposite
    vision_scan_layers: bool | None = None
    # none | full (save only each layer's input) | selective (recompute only recompute_modules)
    recompute: RecomputeMode = "none"
    # Megatron's recompute modules under selective: core_attn, moe_act, layernorm, mlp, moe (and
    # experts: the expert matmuls; gdn: Qwen3.5's conv + delta rule + gated norm); every tensor of a
    # module not listed is kept
    recompute_modules: tuple[str, ...] = ("core_attn",)
    offload: tuple[str, ...] = ()  # module or checkpoint names whose saved tensors go to pinned host memory
    vision_recompute: RecomputeMode | None = None  # the vision tower's own mode (null: the decoder's)
    vision_recompute_modules: tuple[str, ...] | None = None  # the vision tower's own modules (null: the decoder's)
    # XLA GPU command buffers standing in for CUDA graphs: none | step (the whole step) | scopes
    capture: Literal["none", "step", "scopes"] = "step"
    capture_scopes: tuple[str, ...] = ("attn", "moe_router",
                                       "moe_preprocess")  # attn, moe_router, moe_preprocess, full_iteration
    # further XLA flags the run needs, each "--xla_name=value", set with the capture's before the backend starts
    # (moevlm_jax.training.capture); not the command-buffer flags, which compute.capture sets
    xla_flags: tuple[str, ...] = ()
    moe: ExpertsConfig = ExpertsConfig()  # how the experts run: dispatcher, grouped-matmul backend, capacity
    router: RouterConfig = RouterConfig()  # router dtype and load-balancing losses
    loss_chunk_size: int = 2048  # sequence chunk of the fused LM head + cross-entropy
    # the LM head's logits written in float32 (more exact than HF); false: in the activation dtype, as HF's
    # LM head and MaxText's logits_dot_in_fp32 false (the softmax and loss stay float32; moevlm_jax.model.loss)
    logits_fp32: bool = True
    # FP8 GEMMs (Hopper): e4m3 operands, e5m2 gradients, per-tensor or blockwise current scaling, for the
    # decoder's dense GEMMs, the experts and optionally the vision tower (parallelism.fp8); recipe none: off
    fp8: Fp8Config = Fp8Config()

    __aliases__ = {"remat": "recompute", "remat_modules": "recompute_modules"}  # old names -> new

    def __post_init__(self) -> None:
        coerce_fields(self, "compute")  # types (as the loader checks them); moe={...} etc. built into their configs
        _check(isinstance(self.loss_chunk_size, int) and self.loss_chunk_size > 0,
               f"compute.loss_chunk_size must be a positive int, got {self.loss_chunk_size!r}")
        modules = tuple(RECOMPUTE_MODULES)
        for prefix in ("", "vision_"):  # the vision fields may be null: the decoder's setting
            mode, mods = getattr(self, f"{prefix}recompute"), getattr(self, f"{prefix}recompute_modules")
            _check((prefix and mode is None) or mode in RECOMPUTE_MODES,
                   f"compute.{prefix}recompute must be one of {RECOMPUTE_MODES}, got {mode!r}")
            bad = [m for m in mods or () if m not in modules]
            _check(not bad,
                   f"compute.{prefix}recompute_modules {bad} are not among Megatron's recompute modules {modules}")
        bad = [n for n in self.offload if n not in modules and n not in CHECKPOINT_NAMES]
        _check(not bad,
               f"compute.offload {bad} are neither recompute modules {modules} nor checkpoint names {CHECKPOINT_NAMES}")
        for tower in ("text", "vision"):
            mode, mods = self.stack_recompute(tower)
            both = (set(checkpoint_names_of(mods)) & set(checkpoint_names_of(self.offload))
                    if mode == "selective" else ())
            key = "vision_recompute_modules" if tower == "vision" and self.vision_recompute_modules is not None \
                else "recompute_modules"
            _check(not both, f"compute.offload and compute.{key} both name {sorted(both)}: a tensor is either "
                             "recomputed or offloaded to host memory, not both")
        _check(self.capture in CAPTURE_MODES, f"compute.capture must be one of {CAPTURE_MODES}, got {self.capture!r}")
        _check(all(s in CAPTURE_SCOPES for s in self.capture_scopes),
               f"compute.capture_scopes must be a list of {CAPTURE_SCOPES}, got {list(self.capture_scopes)}")
        _check(self.capture != "scopes" or self.capture_scopes,
               "compute.capture: scopes needs at least one compute.capture_scopes entry")
        names = set()
        for flag in self.xla_flags:
            name, eq, value = str(flag).partition("=")
            _check(isinstance(flag, str) and name.startswith("--xla_") and eq and value and " " not in flag,
                   f"compute.xla_flags entries are '--xla_<name>=<value>', got {flag!r}")
            _check(name not in XLA_FLAGS_OF_CAPTURE,
                   f"compute.xla_flags: {name} is compute.capture's (set compute.capture / capture_scopes instead)")
            _check(name not in names, f"compute.xla_flags names a flag twice: {list(self.xla_flags)}")
            names.add(name)
        _check(self.fp8.at("experts") is None or self.fp8.experts_kernel != "triton"
               or self.moe.backend in ("triton", "auto"),
               "compute.fp8.experts_kernel 'triton' (the FP8 grouped-matmul kernels) runs on compute.moe.backend "
               f"'triton' (or 'auto', which is triton on GPUs), not {self.moe.backend!r}; or set "
               "compute.fp8.experts_kernel: qdq")

    def stack_recompute(self, tower: str = "text") -> tuple[str, tuple[str, ...]]:
        """(mode, recompute modules) for the decoder ("text") or the vision tower ("vision")."""
        if tower == "vision":
            mode = self.recompute if self.vision_recompute is None else self.vision_recompute
            mods = self.recompute_modules if self.vision_recompute_modules is None else self.vision_recompute_modules
            return mode, mods
        return self.recompute, self.recompute_modules

    def stack_scan(self, tower: str = "text") -> bool:
        """Whether the decoder ("text") or the vision tower ("vision") scans over its stacked layers."""
        if tower == "vision" and self.vision_scan_layers is not None:
            return self.vision_scan_layers
        return self.scan_layers

    @property
    def moe_options(self) -> dict[str, Any]:
        """Keyword options for ``parallelism.experts.experts_forward``."""
        return self.moe.options()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ComputeConfig:
        """From a YAML / CLI mapping, by the one config loader (unknown keys named with their near miss)."""
        return build(cls, d, "compute")

    def replace(self, **changes: Any) -> ComputeConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)
