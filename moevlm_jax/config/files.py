"""Config files: the one resolver of ``configs/`` and the loaders of single sections.

``find_config(kind, name)`` is the only place a preset name becomes a file
(``configs/{models,layouts,data,recipes}/NAME.yaml``; a path is taken as it is). ``load_section``
loads one section (model, layout, data, compute, optimizer, train) from a name, a path, a mapping
or ``{base: NAME, ...overlay}``, applies ``key=value`` overrides with the one override parser and
builds it with the one loader (``moevlm_jax.config.schema.build``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from moevlm_jax.config.schema import ConfigError, build, deep_merge, near_miss, parse_override, read_yaml, set_dotted

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
KIND_OF_SECTION = {"model": "models", "layout": "layouts", "data": "data", "recipe": "recipes"}
REFERENCED = ("model", "layout", "data")  # recipe sections given by name


def find_config(kind: str, name_or_path: str | Path) -> Path:
    """``configs/<kind>/NAME.yaml`` for a bare name (``tp+ep`` reads as ``tp_ep``), else the path
    itself; a missing one is a ConfigError naming the near miss and the presets."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.suffix not in (".yaml", ".yml", ".json") and "/" not in text and not path.exists():
        path = CONFIG_DIR / kind / f"{text.replace('+', '_')}.yaml"
    if not path.exists():
        names = sorted(p.stem for p in (CONFIG_DIR / kind).glob("*.yaml"))
        raise ConfigError(f"no {kind} config '{text}'{near_miss(text, names)} "
                          f"(available in configs/{kind}/: {names}; or give a .yaml path)")
    return path


# the dataclass of each run section, imported when that section is loaded (``import data`` stays light)
SECTION_TYPES = {"model": "moevlm_jax.model.config:ModelConfig", "layout": "moevlm_jax.parallelism.layout:Layout",
                 "data": "moevlm_jax.data.config:DataConfig", "compute": "moevlm_jax.model.compute:ComputeConfig",
                 "optimizer": "moevlm_jax.training.config:OptimizerConfig",
                 "train": "moevlm_jax.training.config:TrainConfig"}


def section_type(section: str) -> type:
    """The dataclass of run section ``section``."""
    import importlib

    module, name = SECTION_TYPES[section].split(":")
    return getattr(importlib.import_module(module), name)


def resolve_reference(section: str, ref: Any, sources: dict[str, str] | None = None) -> dict[str, Any]:
    """A section given as a name / path, ``{base: NAME, ...overlay}`` or an inline mapping -> its raw
    mapping (``sources[section]`` records where it came from)."""
    sources = {} if sources is None else sources
    if ref is None:
        raise ConfigError(f"the recipe names no {section}; set '{section}: NAME' or pass --{section}")
    if isinstance(ref, (str, Path)):
        path = find_config(KIND_OF_SECTION[section], ref)
        sources[section] = str(path)
        raw = read_yaml(path)
        if section in ("model", "data", "layout"):
            raw.setdefault("name", path.stem)
        return raw
    if isinstance(ref, Mapping):
        ref = dict(ref)
        if "base" in ref:
            base = resolve_reference(section, ref.pop("base"), sources)
            return deep_merge(base, ref)
        sources[section] = "inline"
        return ref
    raise ConfigError(f"{section}: expected a name, a path or a mapping, got {type(ref).__name__} {ref!r}")


def load_section(section: str, ref: Any, overrides: Iterable[str] = ()) -> Any:
    """One section (``model``, ``layout``, ``data``, ...) from a name / path / mapping (or an instance,
    returned as it is when there are no overrides), with ``key=value`` overrides relative to the
    section (a leading ``SECTION.`` is accepted)."""
    cls = section_type(section)
    if section == "model" and not isinstance(ref, (str, Path)):  # any model family (moevlm_jax.model.registry)
        from moevlm_jax.model.registry import model_config_type

        cls = type(ref) if dataclasses.is_dataclass(ref) else model_config_type(ref)
    overrides = list(overrides)
    if isinstance(ref, cls) and not overrides:
        return ref
    if isinstance(ref, cls):
        from moevlm_jax.config.schema import to_plain

        raw = to_plain(ref)
    else:
        raw = resolve_reference(section, ref) if section in KIND_OF_SECTION else dict(ref or {})
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key.removeprefix(f"{section}."), value)
    if section == "model":  # the family the resolved mapping's model_type names
        from moevlm_jax.model.registry import model_config_type

        cls = model_config_type(raw)
    return build(cls, raw, section)


def load_layout(ref: Any, overrides: Iterable[str] = ()) -> Any:
    """A ``parallelism.layout.Layout`` from a preset name (``configs/layouts/``), a path or a mapping."""
    return load_section("layout", ref, overrides)
