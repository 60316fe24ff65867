"""The model families, in one place: which config class, model class and HF name table
belong to a ``model_type`` (``moevlm_jax.perf.flops.SHAPES`` maps a family to its FLOPs shape).

Every part of the stack that builds, loads, saves or counts a model asks this module rather than
naming a model class itself: the trainer (:func:`build_model`), the HF interop (:func:`hf_table`),
the tools (:func:`load_model_config`) and the run config's ``model`` section
(:func:`model_config_type`: which dataclass a raw ``model:`` mapping is built as).

A family is chosen by the HF ``model_type`` of a raw mapping (``config.json`` or a YAML file of the
same structure), or by the class of a built config. No ``model_type`` means Qwen3-VL-MoE, the
project's first family (its YAML files predate the field).

========================  ==============================  ===================================
model_type                config class                    model class
========================  ==============================  ===================================
``qwen3_vl_moe`` (none)   ``model.config.ModelConfig``    ``model.qwen3_vl_moe.Qwen3VLMoe``
``qwen3_5_moe``           ``qwen3_5_config.Qwen35ModelConfig``  ``qwen3_5_moe.Qwen35Moe``
========================  ==============================  ===================================

Everything heavier than a config (the model classes with jax / flax, the HF name tables, the FLOPs
shapes) is named as ``"module:attribute"`` and imported on first use, so that the config loader can
import this module without pulling in the model code.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moevlm_jax.model.config import ModelConfig
from moevlm_jax.model.qwen3_5_config import Qwen35ModelConfig
from moevlm_jax.schema import ConfigError, find_config, near_miss, read_yaml

DEFAULT_MODEL_TYPE = "qwen3_vl_moe"


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its HF ``model_type`` values, config class and (lazily imported) parts.

    ``model``: the nnx model class, ``model(config, compute, rngs)``; ``names``: the HF name table
    module (``checkpoint_entries(config)``, ``to_ours``, ``to_hf``, ``hf_out_shape``, optional
    ``IGNORED_PREFIXES``); ``tokenizer``: the built-in
    data tokenizer (``data.tokenizer.load_tokenizer`` name) whose ids the family's released configs use."""

    name: str
    model_types: tuple[str, ...]
    config: type
    model: str
    names: str
    tokenizer: str

    def model_class(self) -> type:
        """The model class (imported on first use)."""
        return _resolve(self.model)

    def names_module(self) -> Any:
        """The HF name / layout table module (imported on first use)."""
        return importlib.import_module(self.names)


FAMILIES: tuple[Family, ...] = (
    Family("qwen3_vl_moe", ("qwen3_vl_moe",), ModelConfig, "moevlm_jax.model.qwen3_vl_moe:Qwen3VLMoe",
           "moevlm_jax.hf.names", "qwen3"),
    Family("qwen3_5_moe", ("qwen3_5_moe",), Qwen35ModelConfig, "moevlm_jax.model.qwen3_5_moe:Qwen35Moe",
           "moevlm_jax.hf.qwen3_5_names", "qwen3.5"),
)
MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.model_types)
CONFIG_TYPES: tuple[type, ...] = tuple(f.config for f in FAMILIES)


def _resolve(ref: str) -> Any:
    module, attr = ref.split(":")
    return getattr(importlib.import_module(module), attr)


def family_for_type(model_type: str | None) -> Family:
    """The family of an HF ``model_type`` (None: Qwen3-VL-MoE); ConfigError naming the known ones."""
    model_type = DEFAULT_MODEL_TYPE if model_type is None else model_type
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ConfigError(f"model.model_type: {model_type!r} is not a known model family"
                      f"{near_miss(str(model_type), MODEL_TYPES)} (known: {', '.join(MODEL_TYPES)})")


def family_of(config: Any) -> Family:
    """The family of a built config (by class), a raw mapping (by ``model_type``) or a config class."""
    cls = config if isinstance(config, type) else type(config)
    for family in FAMILIES:
        if issubclass(cls, family.config):
            return family
    if isinstance(config, Mapping):
        return family_for_type(config.get("model_type"))
    raise TypeError(f"not a model config: {type(config).__name__} (known: "
                    f"{', '.join(c.__name__ for c in CONFIG_TYPES)})")


def model_config_type(raw: Any) -> type:
    """The config dataclass a run's raw ``model`` section is built as: by its ``model_type``
    (absent: ``ModelConfig``), or the class of an already built config. What
    ``moevlm_jax.config.run.build_run_config`` and ``config.files.load_section("model", ...)`` call."""
    if raw is None:
        return ModelConfig
    if isinstance(raw, CONFIG_TYPES):
        return type(raw)
    if not isinstance(raw, Mapping):
        raise ConfigError(f"model: expected a mapping of config fields, got {type(raw).__name__} {raw!r}")
    return family_for_type(raw.get("model_type")).config


def build_model(config: Any, compute: Any = None, rngs: Any = None) -> Any:
    """The nnx model of ``config``'s family: ``Qwen3VLMoe`` or ``Qwen35Moe`` (same interface:
    ``hidden_states``, ``forward``, ``lm_head_kernel``, the HF-style ``__call__``)."""
    return family_of(config).model_class()(config, compute, rngs)


def model_class(config: Any) -> type:
    """The nnx model class of ``config``'s family."""
    return family_of(config).model_class()


def hf_table(config: Any) -> Any:
    """The HF name / layout table module of ``config``'s family (``moevlm_jax.hf.names`` or
    ``moevlm_jax.hf.qwen3_5_names``)."""
    return family_of(config).names_module()


def checkpoint_entries(config: Any) -> list[Any]:
    """Every HF tensor of ``config``'s model (the family's name table)."""
    return hf_table(config).checkpoint_entries(config)


def data_tokenizer(config: Any) -> str:
    """The built-in data tokenizer of ``config``'s family (``qwen3`` / ``qwen3.5``): the one whose image
    and vision token ids the family's configs use (``config.run.model_data_checks`` compares them)."""
    return family_of(config).tokenizer


def from_mapping(raw: Mapping[str, Any], name: str = "", strict: bool = True) -> Any:
    """A config of the family ``raw["model_type"]`` names (HF ``config.json`` structure); ``strict``
    refuses unknown keys (YAML files), else they are kept in ``extra`` (an HF ``config.json``)."""
    return model_config_type(raw).from_hf_dict(raw, name=name, strict=strict)


def load_model_config(name_or_path: str | Path) -> Any:
    """A model config of any family from ``configs/models/NAME.yaml``, a YAML / JSON file or an HF
    model directory (its ``config.json``); YAML files are strict, ``config.json`` keeps unknown keys."""

    if isinstance(name_or_path, CONFIG_TYPES):
        return name_or_path
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    elif not p.exists():
        p = find_config("models", name_or_path)
    if p.suffix == ".json":
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read model config {p}: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{p}: expected a mapping of config fields, got {type(d).__name__}")
    else:
        d = read_yaml(p)
    is_yaml = p.suffix in (".yaml", ".yml")
    return from_mapping(d, name=d.get("name") or (p.stem if is_yaml else p.parent.name), strict=is_yaml)
