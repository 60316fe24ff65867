"""Model and compute configs.

``ModelConfig`` (with ``TextConfig`` and ``VisionConfig``) mirrors Hugging Face's Qwen3-VL-MoE
``config.json`` field names, so a YAML file in ``configs/models/`` has the same structure as an HF
``config.json`` and :func:`ModelConfig.from_hf_dict` / :meth:`ModelConfig.to_hf_dict` are a
rename-free round trip (keys we do not model are kept in ``extra``).

``ComputeConfig`` holds how the model runs (dtypes, attention kernel, scan, recompute / offload,
capture, MoE and router options); it is validated once at construction. All configs are frozen and
hashable, so they can live inside Flax modules that go through ``jax.jit`` as static structure.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from flax.core import FrozenDict

from moevlm_jax.model.compute import (  # noqa: F401 - re-exported: the names belong to ComputeConfig
    CAPTURE_MODES,
    CAPTURE_SCOPES,
    CHECKPOINT_NAMES,
    RECOMPUTE_MODES,
    RECOMPUTE_MODULES,
    RENAMED,
    check_attention_options,
    check_recompute_and_capture,
    checkpoint_names_of,
)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
MODEL_CONFIG_DIR = CONFIG_DIR / "models"


def freeze(value: Any) -> Any:
    """Deep-convert lists to tuples and dicts to FrozenDicts (hashable config values)."""
    if isinstance(value, Mapping):
        return FrozenDict({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of :func:`freeze`: tuples to lists and FrozenDicts to dicts (JSON/YAML-ready)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _split_known(cls: type, d: Mapping[str, Any], drop: set[str]) -> tuple[dict, dict]:
    names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    known = {k: v for k, v in d.items() if k in names}
    extra = {k: v for k, v in d.items() if k not in names and k not in drop}
    return known, extra


_DEFAULT_TEXT_ROPE = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                      "mrope_interleaved": True}


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The MoE decoder (HF ``Qwen3VLMoeTextConfig`` field names)."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    rope_parameters: Any = freeze(_DEFAULT_TEXT_ROPE)
    attention_bias: bool = False
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: tuple[int, ...] = ()
    initializer_range: float = 0.02
    extra: Any = FrozenDict()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, freeze(getattr(self, f.name)))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _check(self.num_attention_heads % self.num_key_value_heads == 0,
               f"text_config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
               f"num_key_value_heads ({self.num_key_value_heads})")
        _check(self.head_dim % 2 == 0, f"text_config: head_dim must be even, got {self.head_dim}")
        _check(sum(self.mrope_section) == self.head_dim // 2,
               f"text_config: rope_parameters.mrope_section {list(self.mrope_section)} must sum to "
               f"head_dim // 2 = {self.head_dim // 2}")
        _check(self.decoder_sparse_step >= 1, "text_config: decoder_sparse_step must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        _check(not bad, f"text_config: mlp_only_layers {bad} are not layer indexes < {self.num_hidden_layers}")
        if self.num_experts > 0:
            _check(0 < self.num_experts_per_tok <= self.num_experts,
                   f"text_config: num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                   f"1..num_experts ({self.num_experts})")
        _check(self.hidden_act == "silu", f"text_config: only hidden_act 'silu' is supported, got {self.hidden_act!r}")

    @property
    def rope_theta(self) -> float:
        """Base of the text rotary frequencies."""
        return float(self.rope_parameters.get("rope_theta", 5000000.0))

    @property
    def mrope_section(self) -> tuple[int, int, int]:
        """(t, h, w) split of the rotary frequencies (interleaved, as HF Qwen3-VL)."""
        return tuple(self.rope_parameters.get("mrope_section", (24, 20, 20)))

    @property
    def norm_topk_prob(self) -> bool:
        """Renormalise the top-k router weights to sum 1 (HF field, kept in ``extra``; default true,
        which HF's Qwen3-VL-MoE router always does)."""
        return bool(self.extra.get("norm_topk_prob", True))

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """'moe' or 'dense' for each decoder layer, exactly as HF picks the MLP type."""
        return tuple(
            "moe" if (i not in self.mlp_only_layers and self.num_experts > 0
                      and (i + 1) % self.decoder_sparse_step == 0) else "dense"
            for i in range(self.num_hidden_layers)
        )

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> TextConfig:
        """From an HF ``text_config`` dict (accepts ``num_local_experts`` and v4 ``rope_scaling``)."""
        d = dict(d)
        if "num_local_experts" in d:
            d.setdefault("num_experts", d.pop("num_local_experts"))
        if "rope_parameters" not in d or d["rope_parameters"] is None:
            rope = dict(d.pop("rope_scaling", None) or {})
            rope.setdefault("rope_type", rope.pop("type", "default"))
            rope["rope_theta"] = d.pop("rope_theta", _DEFAULT_TEXT_ROPE["rope_theta"])
            rope.setdefault("mrope_section", _DEFAULT_TEXT_ROPE["mrope_section"])
            rope.setdefault("mrope_interleaved", True)
            d["rope_parameters"] = rope
        else:
            d.pop("rope_scaling", None)
            d.pop("rope_theta", None)
        if d.get("mlp_only_layers") is None:
            d["mlp_only_layers"] = []
        known, extra = _split_known(cls, d, drop=set())
        return cls(**known, extra=extra)

    def to_hf_dict(self) -> dict[str, Any]:
        """HF ``text_config`` dict (``config.json`` layout)."""
        out = thaw(self.extra)
        out.update({f.name: thaw(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"})
        out["model_type"] = "qwen3_vl_moe_text"
        return out


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower (HF ``Qwen3VLMoeVisionConfig`` field names)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    initializer_range: float = 0.02
    rope_parameters: Any = None
    extra: Any = FrozenDict()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, freeze(getattr(self, f.name)))
        _check(self.hidden_size % self.num_heads == 0,
               f"vision_config: hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads})")
        _check(self.head_dim % 4 == 0, f"vision_config: head dim {self.head_dim} must be a multiple of 4 (2D rotary)")
        side = math.isqrt(self.num_position_embeddings)
        _check(side * side == self.num_position_embeddings,
               f"vision_config: num_position_embeddings ({self.num_position_embeddings}) must be a square")
        ds = self.deepstack_visual_indexes
        _check(len(set(ds)) == len(ds) and all(0 <= i < self.depth for i in ds),
               f"vision_config: deepstack_visual_indexes {list(ds)} must be distinct block indexes < depth {self.depth}")
        _check(self.hidden_act in _ACTS, f"vision_config: hidden_act {self.hidden_act!r} not in {sorted(_ACTS)}")

    @property
    def head_dim(self) -> int:
        """Per-head width of vision attention."""
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: in_channels * temporal_patch * patch * patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def rope_theta(self) -> float:
        """Base of the vision 2D rotary frequencies."""
        return float((self.rope_parameters or {}).get("rope_theta", 10000.0))

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> VisionConfig:
        """From an HF ``vision_config`` dict."""
        d = dict(d)
        if "num_attention_heads" in d:
            d.setdefault("num_heads", d.pop("num_attention_heads"))
        if "num_hidden_layers" in d:
            d.setdefault("depth", d.pop("num_hidden_layers"))
        known, extra = _split_known(cls, d, drop={"model_type"})
        return cls(**known, extra=extra)

    def to_hf_dict(self) -> dict[str, Any]:
        """HF ``vision_config`` dict (``config.json`` layout)."""
        out = thaw(self.extra)
        out.update({f.name: thaw(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"})
        if out["rope_parameters"] is None:
            del out["rope_parameters"]
        out["model_type"] = "qwen3_vl_moe_vision"
        return out


_ACTS = {"gelu_pytorch_tanh", "gelu", "gelu_new", "silu", "quick_gelu"}
_TOP_DROP = {"model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "name"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Qwen3-VL-MoE model config (HF ``Qwen3VLMoeConfig`` structure)."""

    text_config: TextConfig = TextConfig()
    vision_config: VisionConfig = VisionConfig()
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    name: str = ""
    extra: Any = FrozenDict()

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", freeze(self.extra))
        t, v = self.text_config, self.vision_config
        _check(v.out_hidden_size == t.hidden_size,
               f"vision_config.out_hidden_size ({v.out_hidden_size}) must equal text_config.hidden_size "
               f"({t.hidden_size})")
        _check(len(v.deepstack_visual_indexes) <= t.num_hidden_layers,
               f"{len(v.deepstack_visual_indexes)} deepstack features but only {t.num_hidden_layers} decoder layers")
        _check(0 <= self.image_token_id < t.vocab_size,
               f"image_token_id {self.image_token_id} is outside the vocabulary ({t.vocab_size})")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], name: str = "", strict: bool = False) -> ModelConfig:
        """From an HF ``config.json`` dict (or a YAML file with the same structure). Keys we do not
        model are kept in ``extra``; ``strict`` rejects those that are not known HF fields (typos)."""
        d = dict(d)
        if strict:
            _check_unknown(d)
        text = TextConfig.from_hf_dict(d.pop("text_config", None) or {})
        vision = VisionConfig.from_hf_dict(d.pop("vision_config", None) or {})
        name = name or d.get("name", "")
        known, extra = _split_known(cls, d, drop=_TOP_DROP)
        known.pop("text_config", None)
        known.pop("vision_config", None)
        known.pop("name", None)
        return cls(text_config=text, vision_config=vision, name=name, **known, extra=extra)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """HF ``config.json`` dict; ``dtype`` (e.g. "bfloat16") is recorded as the weights' dtype."""
        out = thaw(self.extra)
        out.update({
            "architectures": ["Qwen3VLMoeForConditionalGeneration"],
            "model_type": "qwen3_vl_moe",
            "text_config": self.text_config.to_hf_dict(),
            "vision_config": self.vision_config.to_hf_dict(),
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
        })
        if dtype is not None:
            out["dtype"] = dtype
            out["text_config"]["dtype"] = dtype
        return out

    def replace_text(self, **changes: Any) -> ModelConfig:
        """A copy with text_config fields changed (e.g. ``num_hidden_layers=8``)."""
        return dataclasses.replace(self, text_config=dataclasses.replace(self.text_config, **changes))


_PASSTHROUGH = {
    "text_config": {"bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "attention_dropout",
                    "output_router_logits", "sliding_window", "dtype", "torch_dtype", "norm_topk_prob",
                    "tie_word_embeddings", "model_type", "num_local_experts", "rope_theta", "rope_scaling"},
    "vision_config": {"dtype", "torch_dtype", "model_type", "num_attention_heads", "num_hidden_layers"},
    "": {"pad_token_id", "bos_token_id", "eos_token_id", "use_cache", "output_router_logits"} | _TOP_DROP,
}


def _check_unknown(d: Mapping[str, Any]) -> None:
    """Raise on keys that are neither our fields nor known HF fields, with the nearest field name."""
    import difflib

    for section, cls in (("text_config", TextConfig), ("vision_config", VisionConfig), ("", ModelConfig)):
        sub = d if not section else (d.get(section) or {})
        fields = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        for key in sub:
            if key in fields or key in _PASSTHROUGH[section] or (not section and key in ("text_config", "vision_config")):
                continue
            near = difflib.get_close_matches(key, sorted(fields), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"model config: unknown key {(section + '.' if section else '') + key!r}{hint}")


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """A ModelConfig from ``configs/models/NAME.yaml``, a YAML/JSON file, or an HF model directory
    (YAML files are strict: unknown keys are an error; HF ``config.json`` keys are kept as extras)."""
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    elif not p.exists():
        p = MODEL_CONFIG_DIR / f"{name_or_path}.yaml"
        if not p.exists():
            known = sorted(q.stem for q in MODEL_CONFIG_DIR.glob("*.yaml"))
            raise FileNotFoundError(f"no model config {name_or_path!r}: not a file or directory, and not one of {known}")
    with open(p) as f:
        d = json.load(f) if p.suffix == ".json" else yaml.safe_load(f)
    if not isinstance(d, dict):
        raise ValueError(f"{p}: expected a mapping of config fields, got {type(d).__name__}")
    is_yaml = p.suffix in (".yaml", ".yml")
    return ModelConfig.from_hf_dict(d, name=d.get("name") or (p.stem if is_yaml else p.parent.name), strict=is_yaml)


# ----------------------------------------------------------------------------------------------
# Compute config
# ----------------------------------------------------------------------------------------------

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
AUX_LOSSES = ("hf", "aux_loss", "seq_aux_loss", "global_aux_loss", "none")
ROUTER_DTYPES = ("float32", "compute")


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Router / load-balancing options (Megatron's knobs; formulas in ``moevlm_jax.model.router``).

    ``aux_loss``: "hf" (HF ``load_balancing_loss_func`` over all layers and tokens: the parity
    default) | "aux_loss" (per micro-batch per data-parallel rank) | "seq_aux_loss" (per sequence)
    | "global_aux_loss" (over the whole micro-batch, all data-parallel ranks) | "none".
    ``aux_loss_coef``: None = the model config's ``router_aux_loss_coef``. ``z_loss_coef`` >= 0.
    ``expert_bias``: aux-loss-free balancing (a per-layer bias added to the scores for top-k
    selection only), updated after each step by ``expert_bias_update_rate * sign(mean load - load)``.
    ``dtype``: router logits in "float32" (Megatron ``moe_router_dtype: fp32``) or the "compute" dtype.
    """

    aux_loss: str = "hf"
    aux_loss_coef: float | None = None
    z_loss_coef: float = 0.0
    expert_bias: bool = False
    expert_bias_update_rate: float = 1e-3
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.aux_loss == "global":
            raise ValueError("compute.router.aux_loss 'global' is now 'hf' (HF's load_balancing_loss_func); "
                             "Megatron's global-batch loss is 'global_aux_loss'")
        _check(self.aux_loss in AUX_LOSSES, f"compute.router.aux_loss must be one of {AUX_LOSSES}, got {self.aux_loss!r}")
        _check(self.dtype in ROUTER_DTYPES, f"compute.router.dtype must be one of {ROUTER_DTYPES}, got {self.dtype!r}")
        for key in ("aux_loss_coef", "z_loss_coef", "expert_bias_update_rate"):
            v = getattr(self, key)
            ok = (v is None and key == "aux_loss_coef") or (
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)
            _check(ok, f"compute.router.{key} must be a number >= 0, got {v!r}")
            if v is not None:
                object.__setattr__(self, key, float(v))
        _check(isinstance(self.expert_bias, bool), f"compute.router.expert_bias must be true or false, got {self.expert_bias!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> RouterConfig:
        """From a YAML/CLI mapping; unknown keys are an error (``z_loss_coef: null`` means 0)."""
        d = dict(d or {})
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(names))
        _check(not unknown, f"compute.router has unknown options {unknown}; known: {names}")
        if d.get("z_loss_coef", 0.0) is None:
            d["z_loss_coef"] = 0.0
        return cls(**d)

    def coef(self, model_default: float) -> float:
        """The aux-loss coefficient in use (0 when ``aux_loss`` is "none")."""
        if self.aux_loss == "none":
            return 0.0
        return float(model_default if self.aux_loss_coef is None else self.aux_loss_coef)


@dataclasses.dataclass(frozen=True)
class ComputeConfig:
    """How the model computes: dtypes, attention kernel, scan over depth, recompute, capture, MoE/router.

    ``moe`` is passed through as ``**options`` to ``parallelism.experts.experts_forward``.
    ``router`` is a :class:`RouterConfig` (given as a mapping of its fields in YAML).

    Recompute (``moevlm_jax.model.layers.remat_policy``, per scanned layer): ``recompute`` none |
    full (save only each layer's input) | selective (save the CHECKPOINT_NAMES tensors except those
    of ``recompute_modules``, Megatron's module names, and recompute the rest). ``offload``: module
    or checkpoint names whose saved tensors go to pinned host memory instead of being kept on the
    device or recomputed (any mode). ``vision_recompute`` / ``vision_recompute_modules``: the vision
    tower's own policy (None = the decoder's). ``capture`` none | step | scopes with
    ``capture_scopes`` (Megatron's CUDA-graph scope names): XLA GPU command-buffer flags, see
    ``moevlm_jax.training.capture`` (set before the backend starts; no effect on the traced program). Names and
    checks: ``moevlm_jax.model.compute``.
    """

    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    attention: str = "auto"
    attention_options: Any = FrozenDict()  # cuDNN ragged bound / head-dim padding: compute_options.ATTENTION_OPTIONS
    scan_layers: bool = True
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    offload: tuple[str, ...] = ()
    vision_recompute: str | None = None
    vision_recompute_modules: tuple[str, ...] | None = None
    capture: str = "step"
    capture_scopes: tuple[str, ...] = ("attn", "moe_router", "moe_preprocess")
    moe: Any = FrozenDict()
    router: Any = RouterConfig()
    loss_chunk_size: int = 2048

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            object.__setattr__(self, f.name, freeze(getattr(self, f.name)))
        for field in ("dtype", "param_dtype"):
            _check(getattr(self, field) in DTYPES, f"compute.{field} must be one of {DTYPES}, got {getattr(self, field)!r}")
        _check(self.attention in ATTENTION_IMPLS, f"compute.attention must be one of {ATTENTION_IMPLS}, got {self.attention!r}")
        check_recompute_and_capture(self)  # moevlm_jax.model.compute
        check_attention_options(self.attention_options)
        _check(isinstance(self.scan_layers, bool), "compute.scan_layers must be true or false")
        _check(isinstance(self.loss_chunk_size, int) and self.loss_chunk_size > 0,
               f"compute.loss_chunk_size must be a positive int, got {self.loss_chunk_size!r}")
        if not isinstance(self.router, RouterConfig):
            _check(self.router is None or isinstance(self.router, Mapping),
                   f"compute.router must be a mapping of router options, got {self.router!r}")
            object.__setattr__(self, "router", RouterConfig.from_dict(self.router))

    def stack_recompute(self, tower: str = "text") -> tuple[str, tuple[str, ...]]:
        """(mode, recompute modules) for the decoder ("text") or the vision tower ("vision")."""
        if tower == "vision":
            mode = self.recompute if self.vision_recompute is None else self.vision_recompute
            mods = self.recompute_modules if self.vision_recompute_modules is None else self.vision_recompute_modules
            return mode, mods
        return self.recompute, self.recompute_modules

    @property
    def moe_options(self) -> dict[str, Any]:
        """Keyword options for ``experts_forward``."""
        return thaw(self.moe)

    def router_option(self, key: str, default: Any = None) -> Any:
        """One router option (a :class:`RouterConfig` field; ``default`` for unknown keys)."""
        return getattr(self.router, key, default)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ComputeConfig:
        """From a YAML/CLI mapping; unknown keys are an error."""
        d = dict(d or {})
        renamed = [f"compute.{k} is now compute.{RENAMED[k]}" for k in d if k in RENAMED]
        _check(not renamed, "; ".join(renamed))
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        _check(not unknown, f"compute config has unknown keys {unknown}; known: {sorted(names)}")
        return cls(**d)

    def replace(self, **changes: Any) -> ComputeConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)
