"""The one configuration system: a typed tree for a run, one loader, one override parser.

``load_config(recipe, model=..., layout=..., data=..., overrides=[...])`` -> ``RunConfig`` (every
section a frozen dataclass: ``ModelConfig``, ``Layout``, ``DataConfig``, ``ComputeConfig``,
``OptimizerConfig``, ``TrainConfig``); ``load_section`` / ``load_layout`` load one section;
``help_config()`` lists every key (``python -m moevlm_jax.train --help-config``). The loader is
``schema.build``, the layering ``run``, the file resolver ``files.find_config``. Exports load lazily
(the data pipeline imports the loader without the model).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ConfigError": "moevlm_jax.config.schema", "build": "moevlm_jax.config.schema",
    "parse_override": "moevlm_jax.config.schema",
    "find_config": "moevlm_jax.config.files", "load_section": "moevlm_jax.config.files",
    "load_layout": "moevlm_jax.config.files", "CONFIG_DIR": "moevlm_jax.config.files",
    "RunConfig": "moevlm_jax.config.run", "load_config": "moevlm_jax.config.run",
    "save_config": "moevlm_jax.config.run", "help_config": "moevlm_jax.config.run",
    "default_recipe": "moevlm_jax.config.run",
    "ModelConfig": "moevlm_jax.model.config", "load_model_config": "moevlm_jax.model.config",
    "ComputeConfig": "moevlm_jax.model.compute", "DataConfig": "moevlm_jax.data.config", "Layout": "moevlm_jax.parallelism.layout",
    "OptimizerConfig": "moevlm_jax.training.config", "TrainConfig": "moevlm_jax.training.config",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'moevlm_jax.config' has no attribute {name!r}")
