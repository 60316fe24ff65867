"""The Qwen3.5-MoE model config: HF ``Qwen3_5MoeConfig``'s shapes with its ``config.json`` field names.

``Qwen35ModelConfig`` (with ``Qwen35TextConfig`` and ``Qwen35VisionConfig``) mirrors
``transformers.Qwen3_5MoeConfig`` the way :mod:`moevlm_jax.model.config` mirrors Qwen3-VL-MoE: a YAML
file in ``configs/models/`` has the structure of an HF ``config.json`` (plus ``model_type:
qwen3_5_moe``), :meth:`Qwen35ModelConfig.from_hf_dict` / :meth:`~Qwen35ModelConfig.to_hf_dict` are a
rename-free round trip, and HF fields read but not modelled are kept in ``extra``. Defaults are
transformers' class defaults (so a ``config.json`` that omits a field means what it means to HF),
not the released checkpoint's values: those are in ``configs/models/qwen3.5-35b-a3b.yaml``.

What HF's config code does and this follows: ``layer_types`` (any pattern of "linear_attention" /
"full_attention") wins; without it, every ``full_attention_interval``-th layer (default 4) is full
attention. The rotary settings live in ``rope_parameters`` (``rope_theta``, ``partial_rotary_factor``
default 0.25, ``mrope_section`` default [11, 11, 10] as HF's rotary falls back to); HF's older top-level
``rope_theta`` / ``partial_rotary_factor`` / ``rope_scaling`` spellings are folded in. Every decoder
layer has the MoE block (routed experts + one shared expert); ``mlp_only_layers`` and
``attn_output_gate`` appear in released ``config.json`` files but HF's classes ignore them (the
attention output gate is always there), so they are passthrough fields here too.

``moevlm_jax.model.registry.load_model_config`` reads a model config of either family, by ``model_type``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

from flax.core import FrozenDict

from moevlm_jax.model.config import freeze, thaw
from moevlm_jax.schema import build, coerce_fields

MODEL_TYPE = "qwen3_5_moe"
LAYER_TYPES = ("linear_attention", "full_attention")
_ROPE_DEFAULTS = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
_HF_MROPE_SECTION = (11, 11, 10)  # Qwen3_5MoeTextRotaryEmbedding's fallback
_ACTS = {"gelu_pytorch_tanh", "gelu", "gelu_new", "silu", "quick_gelu"}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _freeze_fields(obj: Any, where: str) -> None:
    """Check every field against its annotation (as the loader does), then freeze lists / dicts."""
    coerce_fields(obj, where)
    for f in dataclasses.fields(obj):
        object.__setattr__(obj, f.name, freeze(getattr(obj, f.name)))


# fields of an HF config.json that describe the file, not the model (recomputed when saving)
_HF_FILE_KEYS = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")


@dataclasses.dataclass(frozen=True)
class Qwen35TextConfig:
    """The hybrid Gated DeltaNet / gated attention MoE decoder (HF ``Qwen3_5MoeTextConfig`` field names)."""

    vocab_size: int = 248320  # tokens in the vocabulary (embedding and LM head rows)
    hidden_size: int = 2048  # width of the residual stream
    num_hidden_layers: int = 40  # decoder layers
    num_attention_heads: int = 16  # query heads of the full-attention layers
    num_key_value_heads: int = 2  # key / value heads of the full-attention layers (GQA)
    head_dim: int = 256  # width of one full-attention head
    hidden_act: str = "silu"  # MLP / expert activation and the GDN conv activation (only silu)
    max_position_embeddings: int = 32768  # longest position the rotary tables are meant for
    initializer_range: float = 0.02  # std of the normal initialisation
    rms_norm_eps: float = 1e-6  # epsilon of every RMSNorm (zero-centred ones and the GDN gated norm)
    # rotary settings: rope_theta, partial_rotary_factor (rotated share of head_dim), mrope_section [t, h, w]
    rope_parameters: Any = freeze(_ROPE_DEFAULTS)
    attention_bias: bool = False  # biases on the full-attention q/k/v/o projections
    layer_types: tuple[str, ...] | None = None  # "linear_attention" / "full_attention" per layer (null: by interval)
    full_attention_interval: int | None = None  # every n-th layer is full attention when layer_types is absent (HF: 4)
    linear_conv_kernel_dim: int = 4  # GDN causal conv width
    linear_key_head_dim: int = 128  # GDN query / key head width
    linear_value_head_dim: int = 128  # GDN value head width
    linear_num_key_heads: int = 16  # GDN query / key heads
    linear_num_value_heads: int = 32  # GDN value heads (a multiple of the key heads)
    moe_intermediate_size: int = 512  # hidden width of one routed expert
    shared_expert_intermediate_size: int = 512  # hidden width of the shared expert (sigmoid-gated, every token)
    num_experts_per_tok: int = 8  # top-k routed experts per token
    num_experts: int = 256  # routed experts per layer
    router_aux_loss_coef: float = 0.001  # load-balancing loss weight (compute.router.aux_loss_coef overrides)
    extra: Any = FrozenDict()  # HF fields read but not modelled (kept for the round trip)

    __passthrough__ = frozenset({"bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "attention_dropout",
                                 "output_router_logits", "tie_word_embeddings", "mlp_only_layers", "attn_output_gate",
                                 "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings", "mamba_ssm_dtype",
                                 "norm_topk_prob", "decoder_sparse_step"})

    @classmethod
    def __normalize__(cls, d: dict[str, Any]) -> dict[str, Any]:
        """HF's spellings: top-level ``rope_theta`` / ``partial_rotary_factor`` / ``mrope_section`` and
        ``rope_scaling`` go into ``rope_parameters`` (its own keys win, as in HF), which gets HF's
        defaults for ``rope_type`` / ``rope_theta`` / ``partial_rotary_factor``; ``num_local_experts``.
        What describes the file (model_type, dtype) is dropped: to_hf_dict writes it."""
        d = {k: v for k, v in d.items() if k not in _HF_FILE_KEYS}
        if "num_local_experts" in d:
            d.setdefault("num_experts", d.pop("num_local_experts"))
        rope = d.pop("rope_parameters", None)
        scaling = d.pop("rope_scaling", None)
        rope = dict(rope if rope is not None else scaling or {})
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope["type"]
        for key in ("rope_theta", "partial_rotary_factor", "mrope_section"):
            if key in d:
                rope.setdefault(key, d.pop(key))
        for key, value in _ROPE_DEFAULTS.items():
            rope.setdefault(key, value)
        d["rope_parameters"] = rope
        return d

    def __post_init__(self) -> None:
        _freeze_fields(self, "model.text_config")
        if self.layer_types is None:
            every = 4 if self.full_attention_interval is None else self.full_attention_interval
            _check(every >= 1, f"text_config: full_attention_interval must be >= 1, got {every}")
            kinds = tuple("full_attention" if (i + 1) % every == 0 else "linear_attention"
                          for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", kinds)
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        _check(not bad, f"text_config: layer_types entries {bad} are not among {list(LAYER_TYPES)}")
        _check(len(self.layer_types) == self.num_hidden_layers,
               f"text_config: layer_types has {len(self.layer_types)} entries for num_hidden_layers "
               f"{self.num_hidden_layers}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0,
               f"text_config: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
               f"num_key_value_heads ({self.num_key_value_heads})")
        _check(self.linear_num_value_heads % self.linear_num_key_heads == 0,
               f"text_config: linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
               f"linear_num_key_heads ({self.linear_num_key_heads})")
        rope_type = self.rope_parameters.get("rope_type", "default")
        _check(rope_type == "default", f"text_config: only rope_parameters.rope_type 'default' is supported, got "
                                       f"{rope_type!r}")
        factor = self.partial_rotary_factor
        _check(0.0 < factor <= 1.0,
               f"text_config: rope_parameters.partial_rotary_factor must be in (0, 1], got {factor}")
        rd = self.rotary_dim
        _check(rd >= 2 and rd % 2 == 0,
               f"text_config: the rotary width int(head_dim * partial_rotary_factor) = {rd} must be even and >= 2")
        _check(len(self.mrope_section) == 3 and sum(self.mrope_section) == rd // 2,
               f"text_config: rope_parameters.mrope_section {list(self.mrope_section)} must be 3 numbers summing to "
               f"the rotary width / 2 = {rd // 2} (head_dim {self.head_dim} x partial_rotary_factor {factor})")
        _check(self.num_experts > 0, "text_config: num_experts must be > 0 (every Qwen3.5-MoE layer is MoE)")
        _check(0 < self.num_experts_per_tok <= self.num_experts,
               f"text_config: num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..num_experts "
               f"({self.num_experts})")
        _check(self.shared_expert_intermediate_size > 0, "text_config: shared_expert_intermediate_size must be > 0")
        _check(self.linear_conv_kernel_dim >= 1, "text_config: linear_conv_kernel_dim must be >= 1")
        _check(self.hidden_act == "silu", f"text_config: only hidden_act 'silu' is supported, got {self.hidden_act!r}")

    @property
    def rope_theta(self) -> float:
        """Base of the text rotary frequencies."""
        return float(self.rope_parameters.get("rope_theta", _ROPE_DEFAULTS["rope_theta"]))

    @property
    def partial_rotary_factor(self) -> float:
        """Share of ``head_dim`` the rotary rotates (the rest passes through)."""
        return float(self.rope_parameters.get("partial_rotary_factor", _ROPE_DEFAULTS["partial_rotary_factor"]))

    @property
    def rotary_dim(self) -> int:
        """Rotated width of a head: ``int(head_dim * partial_rotary_factor)`` (HF's rounding)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mrope_section(self) -> tuple[int, int, int]:
        """(t, h, w) split of the rotary frequencies (interleaved), HF's [11, 11, 10] when not given."""
        return tuple(self.rope_parameters.get("mrope_section", _HF_MROPE_SECTION))

    @property
    def norm_topk_prob(self) -> bool:
        """HF's Qwen3.5-MoE router always renormalises the top-k weights."""
        return True

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """The MLP kind of each layer, as ``TextConfig.layer_kinds``: always "moe"."""
        return ("moe",) * self.num_hidden_layers

    def to_hf_dict(self) -> dict[str, Any]:
        """HF ``text_config`` dict (``config.json`` layout)."""
        out = thaw(self.extra)
        out.update({f.name: thaw(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"})
        if out["full_attention_interval"] is None:
            del out["full_attention_interval"]
        out["model_type"] = "qwen3_5_moe_text"
        return out


@dataclasses.dataclass(frozen=True)
class Qwen35VisionConfig:
    """The vision tower (HF ``Qwen3_5MoeVisionConfig`` field names): Qwen3-VL's tower without DeepStack."""

    depth: int = 27  # vision transformer blocks
    hidden_size: int = 1152  # width of the vision tower
    hidden_act: str = "gelu_pytorch_tanh"  # vision MLP activation
    intermediate_size: int = 4304  # hidden width of the vision MLP
    num_heads: int = 16  # vision attention heads
    in_channels: int = 3  # image channels
    patch_size: int = 16  # patch side in pixels
    spatial_merge_size: int = 2  # merger: merge_size x merge_size patches become one token
    temporal_patch_size: int = 2  # frames per patch (an image is repeated to fill them)
    out_hidden_size: int = 3584  # merger output width (= text_config.hidden_size; HF's default 3584)
    num_position_embeddings: int = 2304  # learned position table rows (a square: 48 x 48)
    initializer_range: float = 0.02  # std of the normal initialisation
    rope_parameters: Any = None  # 2D rotary settings (rope_theta; default 10000, rope_type axial)
    extra: Any = FrozenDict()  # HF fields read but not modelled (kept for the round trip)

    # deepstack_visual_indexes: released config.json files carry "[]"; HF's Qwen3.5 tower has no DeepStack
    __passthrough__ = frozenset({"deepstack_visual_indexes"})

    @classmethod
    def __normalize__(cls, d: dict[str, Any]) -> dict[str, Any]:
        """HF's spellings: ``num_attention_heads`` -> num_heads, ``num_hidden_layers`` -> depth; what
        describes the file (model_type, dtype) is dropped: to_hf_dict writes it."""
        d = {k: v for k, v in d.items() if k not in _HF_FILE_KEYS}
        if "num_attention_heads" in d:
            d.setdefault("num_heads", d.pop("num_attention_heads"))
        if "num_hidden_layers" in d:
            d.setdefault("depth", d.pop("num_hidden_layers"))
        return d

    def __post_init__(self) -> None:
        _freeze_fields(self, "model.vision_config")
        _check(self.hidden_size % self.num_heads == 0,
               f"vision_config: hidden_size ({self.hidden_size}) must divide by num_heads ({self.num_heads})")
        _check(self.head_dim % 4 == 0, f"vision_config: head dim {self.head_dim} must be a multiple of 4 (2D rotary)")
        side = math.isqrt(self.num_position_embeddings)
        _check(side * side == self.num_position_embeddings,
               f"vision_config: num_position_embeddings ({self.num_position_embeddings}) must be a square")
        _check(self.hidden_act in _ACTS, f"vision_config: hidden_act {self.hidden_act!r} not in {sorted(_ACTS)}")
        rope_type = (self.rope_parameters or {}).get("rope_type", "axial")
        _check(rope_type == "axial", f"vision_config: rope_parameters.rope_type must be 'axial', got {rope_type!r}")

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

    @property
    def deepstack_visual_indexes(self) -> tuple[int, ...]:
        """No DeepStack in Qwen3.5 (what ``moevlm_jax.model.vision.VisionModel`` reads)."""
        return ()

    def to_hf_dict(self) -> dict[str, Any]:
        """HF ``vision_config`` dict (``config.json`` layout)."""
        out = thaw(self.extra)
        out.update({f.name: thaw(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "extra"})
        if out["rope_parameters"] is None:
            del out["rope_parameters"]
        out["model_type"] = "qwen3_5_moe_vision"
        return out


@dataclasses.dataclass(frozen=True)
class Qwen35ModelConfig:
    """Qwen3.5-MoE model config (HF ``Qwen3_5MoeConfig`` structure)."""

    text_config: Qwen35TextConfig = Qwen35TextConfig()  # the hybrid MoE decoder
    vision_config: Qwen35VisionConfig = Qwen35VisionConfig()  # the vision tower
    image_token_id: int = 248056  # the token that stands for one merged image patch
    video_token_id: int = 248057  # the token that stands for one merged video patch
    vision_start_token_id: int = 248053  # <|vision_start|>
    vision_end_token_id: int = 248054  # <|vision_end|>
    tie_word_embeddings: bool = False  # the LM head is the embedding transposed
    name: str = ""  # a label for logs and run directories
    # the HF model family (moevlm_jax.model.registry picks the config and model classes by it); a field,
    # so that a run's saved config.yaml loads back as this family
    model_type: Literal["qwen3_5_moe"] = MODEL_TYPE
    extra: Any = FrozenDict()  # HF fields read but not modelled (kept for the round trip)

    __passthrough__ = frozenset({"pad_token_id", "bos_token_id", "eos_token_id", "use_cache", "output_router_logits"})

    @classmethod
    def __normalize__(cls, d: dict[str, Any]) -> dict[str, Any]:
        """Drop what describes the file rather than the model (dtype, versions); model_type is checked."""
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"model_type {d['model_type']!r} is not {MODEL_TYPE!r}")
        return {k: v for k, v in d.items() if k not in _HF_FILE_KEYS or k == "model_type"}

    def __post_init__(self) -> None:
        _freeze_fields(self, "model")
        t, v = self.text_config, self.vision_config
        _check(v.out_hidden_size == t.hidden_size,
               f"vision_config.out_hidden_size ({v.out_hidden_size}) must equal text_config.hidden_size "
               f"({t.hidden_size})")
        _check(0 <= self.image_token_id < t.vocab_size,
               f"image_token_id {self.image_token_id} is outside the vocabulary ({t.vocab_size})")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], name: str = "", strict: bool = False) -> Qwen35ModelConfig:
        """From an HF ``config.json`` dict (or a YAML file with the same structure). Known HF fields we
        do not model are kept in ``extra``; ``strict`` refuses any other key (typos, with the near miss),
        else those are kept in ``extra`` too."""
        d = dict(d)
        if name:
            d["name"] = name
        return build(cls, d, "model", strict=strict)

    def to_hf_dict(self, dtype: str | None = None) -> dict[str, Any]:
        """HF ``config.json`` dict; ``dtype`` (e.g. "bfloat16") is recorded as the weights' dtype."""
        out = thaw(self.extra)
        out.update({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": MODEL_TYPE,
            "text_config": self.text_config.to_hf_dict(),
            "vision_config": self.vision_config.to_hf_dict(),
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
        })
        if dtype is not None:  # top-level only, as transformers writes a Qwen3.5 config.json
            out["dtype"] = dtype
        return out

    def replace_text(self, **changes: Any) -> Qwen35ModelConfig:
        """A copy with text_config fields changed (e.g. ``num_hidden_layers=8, layer_types=None``)."""
        return dataclasses.replace(self, text_config=dataclasses.replace(self.text_config, **changes))
