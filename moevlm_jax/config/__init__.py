"""The one configuration system: a typed tree for a run, one loader, one override parser.

``load_config(recipe, model=..., layout=..., data=..., overrides=[...])`` -> ``RunConfig`` (every
section a frozen dataclass: ``ModelConfig``, ``Layout``, ``DataConfig``, ``ComputeConfig``,
``OptimizerConfig``, ``TrainConfig``); ``load_section`` / ``load_layout`` load one section;
``help_config()`` lists every key (``python -m moevlm_jax.train --help-config``). The loader and the
preset resolver are ``moevlm_jax.schema`` (``build``, ``find_config``; it imports no other part of the
project, so every section's module uses it), the section types ``files``, the layering ``run``. This
package sits above the sections it assembles: nothing in model, data, parallelism or training's step
imports it.
"""

from __future__ import annotations

from moevlm_jax.config.files import CONFIG_DIR, find_config, load_layout, load_section
from moevlm_jax.config.run import RunConfig, default_recipe, help_config, load_config, save_config
from moevlm_jax.data.config import DataConfig
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import ModelConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.parallelism.layout import Layout
from moevlm_jax.schema import ConfigError, build, parse_override
from moevlm_jax.training.config import OptimizerConfig, TrainConfig

__all__ = [
    "CONFIG_DIR", "ComputeConfig", "ConfigError", "DataConfig", "Layout", "ModelConfig", "OptimizerConfig",
    "RunConfig", "TrainConfig", "build", "default_recipe", "find_config", "help_config", "load_config",
    "load_layout", "load_model_config", "load_section", "parse_override", "save_config",
]
