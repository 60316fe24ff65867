"""The model config: Qwen3-VL-MoE's shapes with Hugging Face's ``config.json`` field names.

``ModelConfig`` (with ``TextConfig`` and ``VisionConfig``) mirrors HF's ``Qwen3VLMoeConfig``, so a
YAML file in ``configs/models/`` has the structure of an HF ``config.json`` and
:meth:`ModelConfig.from_hf_dict` / :meth:`ModelConfig.to_hf_dict` are a rename-free round trip (HF
fields we read but do not model are kept in ``extra``). It is loaded by the one config loader
(``moevlm_jax.schema.build``); HF's alternative spellings (``num_local_experts``,
``rope_theta`` / ``rope_scaling``, ``num_attention_heads`` of the vision tower) are normalised
first. All configs are frozen and hashable: they live inside Flax modules that go through
``jax.jit`` as static structure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from flax.core import FrozenDict

from moevlm_jax.schema import build, coerce_fields


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


def _check_sizes(obj: Any, where: str, positive: tuple[str, ...], nonnegative: tuple[str, ...]) -> None:
    """Sizes that must be > 0 (or >= 0), each named with its key."""
    for name in positive:
        v = getattr(obj, name)
        _check(v is None or v > 0, f"{where}.{name} must be > 0, got {v}")
    for name in nonnegative:
        v = getattr(obj, name)
        _check(v >= 0, f"{where}.{name} must be >= 0, got {v}")


def _freeze_fields(obj: Any, where: str) -> None:
    coerce_fields(obj, where)
    for f in dataclasses.fields(obj):
        object.__setattr__(obj, f.name, freeze(getattr(obj, f.name)))


_DEFAULT_TEXT_ROPE = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [24, 20, 20],
                      "mrope_interleaved": True}
_ACTS = {"gelu_pytorch_tanh", "gelu", "gelu_new", "silu", "quick_gelu"}


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The MoE decoder (HF ``Qwen3VLMoeTextConfig`` field names)."""

    vocab_size: int = 151936  # tokens in the vocabulary (embedding and LM head rows)
    hidden_size: int = 2048  # width of the residual stream
    intermediate_size: int = 6144  # hidden width of the dense (non-MoE) MLP layers
    num_hidden_layers: int = 48  # decoder layers
    num_attention_heads: int = 32  # query heads
    num_key_value_heads: int = 4  # key / value heads (GQA: query heads share them)
    head_dim: int | None = 128  # width of one attention head (None: hidden_size / heads)
    hidden_act: str = "silu"  # MLP activation (SwiGLU: only silu)
    max_position_embeddings: int = 262144  # longest position the rotary tables are meant for
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm
    # rotary settings: rope_theta, mrope_section [t, h, w] (sums to head_dim / 2), mrope_interleaved
    rope_parameters: Any = freeze(_DEFAULT_TEXT_ROPE)
    attention_bias: bool = False  # biases on the q/k/v/o projections
    decoder_sparse_step: int = 1  # every n-th layer is MoE (1: all, unless in mlp_only_layers)
    moe_intermediate_size: int = 768  # hidden width of one expert
    num_experts_per_tok: int = 8  # top-k experts per token
    num_experts: int = 128  # experts per MoE layer (0: a dense model)
    router_aux_loss_coef: float = 0.001  # load-balancing loss weight (compute.router.aux_loss_coef overrides)
    mlp_only_layers: tuple[int, ...] = ()  # layer indexes that use the dense MLP
    initializer_range: float = 0.02  # std of the normal initialisation
    extra: Any = FrozenDict()  # HF fields read but not modelled (kept for the round trip)

    __passthrough__ = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "attention_dropout",
                                 "output_router_logits", "sliding_window", "dtype", "torch_dtype", "norm_topk_prob",
                                 "tie_word_embeddings", "model_type"})

    @classmethod
    def __normalize__(cls, d: dict[str, Any]) -> dict[str, Any]:
        """HF's spellings: ``num_local_experts``; v4 ``rope_theta`` / ``rope_scaling`` -> ``rope_parameters``."""
        d = dict(d)
        if "num_local_experts" in d:
            d.setdefault("num_experts", d.pop("num_local_experts"))
        if "rope_parameters" not in d or d["rope_parameters"] is None:
            if "rope_theta" in d or "rope_scaling" in d or "rope_parameters" in d:
                rope = dict(d.pop("rope_scaling", None) or {})
                rope.setdefault("rope_type", rope.pop("type", "default"))
                rope["rope_theta"] = d.pop("rope_theta", _DEFAULT_TEXT_ROPE["rope_theta"])
                rope.setdefault("mrope_section", _DEFAULT_TEXT_ROPE["mrope_section"])
                rope.setdefault("mrope_interleaved", True)
                d["rope_parameters"] = rope
        else:
            d.pop("rope_scaling", None)
            if "rope_theta" in d:  # a given theta wins over the one inside rope_parameters
                d["rope_parameters"] = {**dict(d["rope_parameters"]), "rope_theta": d.pop("rope_theta")}
        if "mlp_only_layers" in d and d["mlp_only_layers"] is None:
            d["mlp_only_layers"] = []
        return d

    def __post_init__(self) -> None:
        _freeze_fields(self, "model.text_config")
        _check_sizes(self, "model.text_config", ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                                 "num_attention_heads", "num_key_value_heads", "head_dim",
                                                 "max_position_embeddings", "moe_intermediate_size"),
                     ("num_experts", "num_experts_per_tok"))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _check(self.num_attention_heads % self.num_key_value_heads == 0,
               f"model.text_config.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
               f"num_key_value_heads ({self.num_key_value_heads})")
        _check(self.head_dim % 2 == 0, f"model.text_config.head_dim must be even, got {self.head_dim}")
        _check(sum(self.mrope_section) == self.head_dim // 2,
               f"model.text_config.rope_parameters.mrope_section {list(self.mrope_section)} must sum to "
               f"head_dim // 2 = {self.head_dim // 2}")
        _check(self.decoder_sparse_step >= 1, "model.text_config.decoder_sparse_step must be >= 1")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        _check(not bad, f"model.text_config.mlp_only_layers {bad} are not layer indexes < {self.num_hidden_layers}")
        if self.num_experts > 0:
            _check(0 < self.num_experts_per_tok <= self.num_experts,
                   f"model.text_config.num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                   f"1..num_experts ({self.num_experts})")
        _check(self.hidden_act == "silu",
               f"model.text_config.hidden_act: only 'silu' is supported, got {self.hidden_act!r}")

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

    def to_hf_dict(self) -> dict[str, Any]:
        """HF ``text_config`` dict (``config.json`` layout)."""
        out = thaw(self.extra)
        out.update({f.name: thaw(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"})
        out["model_type"] = "qwen3_vl_moe_text"
        return out


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The vision tower (HF ``Qwen3VLMoeVisionConfig`` field names)."""

    depth: int = 27  # vision transformer blocks
    hidden_size: int = 1152  # width of the vision tower
    hidden_act: str = "gelu_pytorch_tanh"  # vision MLP activation
    intermediate_size: int = 4304  # hidden width of the vision MLP
    num_heads: int = 16  # vision attention heads
    in_channels: int = 3  # image channels
    patch_size: int = 16  # patch side in pixels
    spatial_merge_size: int = 2  # merger: merge_size x merge_size patches become one token
    temporal_patch_size: int = 2  # frames per patch (an image is repeated to fill them)
    out_hidden_size: int = 2048  # merger output width (= text_config.hidden_size)
    num_position_embeddings: int = 2304  # learned position table rows (a square: 48 x 48)
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)  # blocks whose outputs feed decoder layers 0, 1, 2
    initializer_range: float = 0.02  # std of the normal initialisation
    rope_parameters: Any = None  # 2D rotary settings (rope_theta; default 10000)
    extra: Any = FrozenDict()  # HF fields read but not modelled (kept for the round trip)

    __passthrough__ = frozenset({"dtype", "torch_dtype", "model_type"})

    @classmethod
    def __normalize__(cls, d: dict[str, Any]) -> dict[str, Any]:
        """HF's spellings: ``num_attention_heads`` -> num_heads, ``num_hidden_layers`` -> depth."""
        d = dict(d)
        if "num_attention_heads" in d:
            d.setdefault("num_heads", d.pop("num_attention_heads"))
        if "num_hidden_layers" in d:
            d.setdefault("depth", d.pop("num_hidden_layers"))
        return d

    def __post_init__(self) -> None:
        _freeze_fields(self, "model.vision_config")
        _check_sizes(self, "model.vision_config", ("depth", "hidden_size", "intermediate_size", "num_heads",
                                                   "in_channels",
                                                   "patch_size", "spatial_merge_size", "temporal_patch_size",
                                                   "out_hidden_size", "num_position_embeddings"), ())
        _check(self.hidden_size % self.num_heads == 0,
               f"model.vision_config.num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size})")
        _check(self.head_dim % 4 == 0,
               f"model.vision_config.num_heads: head dim {self.head_dim} must be a multiple of 4 (2D rotary)")
        side = math.isqrt(self.num_position_embeddings)
        _check(side * side == self.num_position_embeddings,
               f"model.vision_config.num_position_embeddings ({self.num_position_embeddings}) must be a square")
        ds = self.deepstack_visual_indexes
        _check(len(set(ds)) == len(ds) and all(0 <= i < self.depth for i in ds),
               f"model.vision_config.deepstack_visual_indexes {list(ds)} must be distinct block indexes < depth "
               f"{self.depth}")
        _check(self.hidden_act in _ACTS, f"model.vision_config.hidden_act {self.hidden_act!r} not in {sorted(_ACTS)}")

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

    def to_hf_dict(self) -> dict[str, Any]:
        """HF ``vision_config`` dict (``config.json`` layout)."""
        out = thaw(self.extra)
        out.update({f.name: thaw(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"})
        if out["rope_parameters"] is None:
            del out["rope_parameters"]
        out["model_type"] = "qwen3_vl_moe_vision"
        return out


# fields of an HF config.json that describe the file, not the model (recomputed when saving)
_HF_FILE_KEYS = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Qwen3-VL-MoE model config (HF ``Qwen3VLMoeConfig`` structure)."""

    text_config: TextConfig = TextConfig()  # the MoE decoder
    vision_config: VisionConfig = VisionConfig()  # the vision tower
    image_token_id: int = 151655  # the token that stands for one merged image patch
    video_token_id: int = 151656  # the token that stands for one merged video patch
    vision_start_token_id: int = 151652  # <|vision_start|>
    vision_end_token_id: int = 151653  # <|vision_end|>
    tie_word_embeddings: bool = False  # the LM head is the embedding transposed
    name: str = ""  # a label for logs and run directories
    extra: Any = FrozenDict()  # HF fields read but not modelled (kept for the round trip)

    __passthrough__ = frozenset({"pad_token_id", "bos_token_id", "eos_token_id", "use_cache", "output_router_logits"})

    @classmethod
    def __normalize__(cls, d: dict[str, Any]) -> dict[str, Any]:
        """Drop what describes the file rather than the model (model type, dtype, versions)."""
        return {k: v for k, v in d.items() if k not in _HF_FILE_KEYS}

    def __post_init__(self) -> None:
        coerce_fields(self, "model")
        object.__setattr__(self, "extra", freeze(self.extra))
        t, v = self.text_config, self.vision_config
        _check(v.out_hidden_size == t.hidden_size,
               f"model.vision_config.out_hidden_size ({v.out_hidden_size}) must equal text_config.hidden_size "
               f"({t.hidden_size})")
        _check(len(v.deepstack_visual_indexes) <= t.num_hidden_layers,
               f"model.vision_config.deepstack_visual_indexes: {len(v.deepstack_visual_indexes)} deepstack features "
               f"but only {t.num_hidden_layers} decoder layers")
        _check(0 <= self.image_token_id < t.vocab_size,
               f"model.image_token_id {self.image_token_id} is outside the vocabulary (model.text_config.vocab_size "
               f"{t.vocab_size})")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], name: str = "", strict: bool = False) -> ModelConfig:
        """From an HF ``config.json`` dict (or a YAML file with the same structure). Known HF fields we
        do not model are kept in ``extra``; ``strict`` refuses any other key (typos, with the near miss),
        else those are kept in ``extra`` too (an HF checkpoint may carry fields of other versions)."""
        d = dict(d)
        if name:
            d["name"] = name
        return build(cls, d, "model", strict=strict)

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
