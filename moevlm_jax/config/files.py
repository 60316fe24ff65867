"""The run's sections by name: which dataclass each section of a run is, and the loader of one section.

``load_section`` loads one section (model, layout, data, compute, optimizer, train) from a name, a path,
a mapping or ``{base: NAME, ...overlay}``, applies ``key=value`` overrides with the one override parser
and builds it with the one loader (``moevlm_jax.schema``: ``find_config`` resolves preset names,
``load_typed`` builds a section).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moevlm_jax.data.config import DataConfig
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import ModelConfig
from moevlm_jax.model.registry import model_config_type
from moevlm_jax.parallelism.layout import Layout
from moevlm_jax.schema import CONFIG_DIR, find_config, load_typed, resolve_reference, section_mapping
from moevlm_jax.training.config import OptimizerConfig, TrainConfig

__all__ = ["CONFIG_DIR", "REFERENCED", "SECTION_TYPES", "find_config", "load_layout", "load_section",
           "resolve_reference", "section_type"]

REFERENCED = ("model", "layout", "data")  # recipe sections given by name

# the dataclass of each run section (the model's: by its model_type, ``moevlm_jax.model.registry``)
SECTION_TYPES: dict[str, type] = {"model": ModelConfig, "layout": Layout, "data": DataConfig, "compute": ComputeConfig,
                                  "optimizer": OptimizerConfig, "train": TrainConfig}


def section_type(section: str) -> type:
    """The dataclass of run section ``section``."""
    return SECTION_TYPES[section]


def load_section(section: str, ref: Any, overrides: Iterable[str] = ()) -> Any:
    """One section (``model``, ``layout``, ``data``, ...) from a name / path / mapping (or an instance,
    returned as it is when there are no overrides), with ``key=value`` overrides relative to the
    section (a leading ``SECTION.`` is accepted)."""
    overrides = list(overrides)
    if section != "model":
        return load_typed(section_type(section), section, ref, overrides)
    if not isinstance(ref, (str, Path)) and not overrides and model_config_type(ref) is type(ref):
        return ref  # a built config of any family (moevlm_jax.model.registry)
    raw = section_mapping(section, ref, overrides)
    return load_typed(model_config_type(raw), section, raw)  # the family the resolved model_type names


def load_layout(ref: Any, overrides: Iterable[str] = ()) -> Any:
    """A ``parallelism.layout.Layout`` from a preset name (``configs/layouts/``), a path or a mapping."""
    return load_section("layout", ref, overrides)
