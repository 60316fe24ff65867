"""Typed dataclasses from YAML mappings, with errors that name the key and the near miss.

:func:`build_dataclass` turns a mapping into a (possibly nested) dataclass, checking every value
against the field's annotation (int, float, bool, str, Optional, list/tuple/dict of those,
Literal, nested dataclasses) and collecting every problem into one :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A bad run setting; the message names every offending key."""


def near_miss(key: str, known: Sequence[str]) -> str:
    """'; did you mean X?' for the closest of ``known`` to ``key`` (difflib), or ''."""
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, where: str, errors: list[str]) -> Any:
    """``value`` checked (and mildly coerced: int -> float, '1e-4' -> float) against ``tp``."""
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        trial: list[str] = []
        for a in inner:
            trial.clear()
            out = _convert(value, a, where, trial)
            if not trial:
                return out
        if len(inner) == 1:
            errors.extend(trial)
        else:
            errors.append(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
        return value
    if origin is Literal:
        if value not in args:
            errors.append(f"{where}: {value!r} is not one of {list(args)}{near_miss(str(value), [str(a) for a in args])}")
        return value
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, where, errors)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            errors.append(f"{where}: expected a list, got {type(value).__name__} {value!r}")
            return value
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                errors.append(f"{where}: expected {len(args)} items, got {len(value)}")
                return value
            return tuple(_convert(v, a, f"{where}[{i}]", errors) for i, (v, a) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        out = [_convert(v, item, f"{where}[{i}]", errors) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple or tp is tuple else out
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, Mapping):
            errors.append(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
            return value
        kt, vt = args if args else (Any, Any)
        return {_convert(k, kt, where, errors): _convert(v, vt, f"{where}.{k}", errors) for k, v in value.items()}
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool or tp is str:
        if isinstance(value, tp):
            return value
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    elif not isinstance(tp, type):
        return value  # an annotation we do not understand: accept
    errors.append(f"{where}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def build_dataclass(cls: type, data: Any, where: str, errors: list[str] | None = None) -> Any:
    """Instance of dataclass ``cls`` from mapping ``data``; unknown keys and type errors raise
    (or append to ``errors``) with the dotted key, the expected type and the near miss."""
    own = errors is None
    errors = [] if own else errors
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        errors.append(f"{where}: expected a mapping for {cls.__name__}, got {type(data).__name__} {data!r}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            errors.append(f"unknown key '{where}.{key}'{near_miss(key, list(fields))} "
                          f"(known: {', '.join(fields)})")
            continue
        kwargs[key] = _convert(value, hints[key], f"{where}.{key}", errors)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    errors.extend(f"{where}.{n}: required and not given" for n in missing)
    obj = None
    if not errors:
        try:
            obj = cls(**kwargs)
        except (TypeError, ValueError) as e:  # the class's own __post_init__ checks
            errors.append(f"{where}: {e}")
    if own and errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return obj


def parse_value(text: str) -> Any:
    """A command-line value as YAML ('2' -> 2, 'true' -> True, '[a, b]' -> list), plus '1e-4' -> float."""
    value = yaml.safe_load(text) if text.strip() else None
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", value.strip()):
        return float(value)
    return value


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` recursively (mappings merge, everything else replaces)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def to_plain(obj: Any) -> Any:
    """Dataclasses, tuples and mappings -> YAML-safe dicts/lists/scalars."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj
