"""The one configuration loader: typed dataclasses from YAML mappings, errors that name the key.

:func:`build` turns a mapping into a (nested) dataclass, checking every value against the field's
annotation (int, float, bool, str, Optional, Literal, list / tuple / dict of those, nested
dataclasses, and tagged unions: a union of dataclasses told apart by their ``kind`` field) and
collecting every problem -- unknown keys with their near miss, wrong types, the classes' own
``__post_init__`` checks -- into one :class:`ConfigError`. Every section of a run (model, layout,
data, compute, optimizer, train) is a dataclass loaded by this one function.

Optional class-level hooks of a config dataclass:
- ``__aliases__ = {"old": "new"}``: a renamed key; the old name still loads, with a deprecation warning.
- ``__passthrough__ = frozenset({...})``: keys that are kept in the class's ``extra`` field rather than
  refused (Hugging Face ``config.json`` fields we read but do not model); ``strict=False`` keeps every
  unknown key there (an HF checkpoint's own config).
- ``__normalize__(raw) -> raw`` (a classmethod): rewrites the raw mapping before its keys are read
  (HF's alternative spellings of a field).

A field's one-line meaning (``--help-config``) is the comment on its line, or the comment lines just
above it, in the class's source: :func:`describe` lists every key with type, default and meaning.

The preset files: :func:`find_config` is the only place a preset name becomes a file
(``configs/{models,layouts,data,recipes}/NAME.yaml``; a path is taken as it is); :func:`load_typed` loads one
section's dataclass from a name, a path, a mapping or ``{base: NAME, ...overlay}`` with ``key=value``
overrides. This module imports no other part of the project: every section's module (model, data,
parallelism, training) may use it, and ``moevlm_jax.config`` assembles the sections into a run.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import io
import logging
import re
import tokenize
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad run setting; the message names every offending key and what to do."""


def near_miss(key: str, known: Sequence[str]) -> str:
    """'; did you mean X?' for the closest of ``known`` to ``key`` (difflib), or ''."""
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def type_name(tp: Any) -> str:
    """A readable annotation: ``int | None``, ``list[str]``, ``'a' | 'b'``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else type_name(a) for a in args)
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]" if args else getattr(origin, "__name__",
                                                                                           str(origin))
    if dataclasses.is_dataclass(tp):
        return tp.__name__
    return "any" if tp is Any else getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def tagged_variants(tp: Any) -> dict[str, type] | None:
    """``{kind: class}`` when ``tp`` is a union of dataclasses each with a ``kind: Literal[...]`` field."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    members = [a for a in typing.get_args(tp) if a is not type(None)]
    out = {}
    for m in members:
        if not dataclasses.is_dataclass(m):
            return None
        kind = typing.get_type_hints(m).get("kind")
        if typing.get_origin(kind) is not Literal:
            return None
        out.update({str(k): m for k in typing.get_args(kind)})
    return out


def convert(value: Any, tp: Any, where: str, errors: list[str], strict: bool = True) -> Any:
    """``value`` checked (and mildly coerced: int -> float, '1e-4' -> float, list -> tuple) against ``tp``."""
    if tp is Any or tp is object:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    variants = tagged_variants(tp)
    if variants is not None:
        if isinstance(value, tuple(variants.values())):
            return value
        if not isinstance(value, Mapping) or "kind" not in value:
            errors.append(f"{where}: expected a mapping with 'kind' (one of {list(variants)}), got {value!r}")
            return None
        kind = str(value["kind"])
        if kind not in variants:
            errors.append(f"{where}.kind: {kind!r} is not one of {list(variants)}{near_miss(kind, list(variants))}")
            return None
        return build(variants[kind], value, where, errors, strict=strict)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        trial: list[str] = []
        for a in inner:
            trial.clear()
            out = convert(value, a, where, trial, strict)
            if not trial:
                return out
        if len(inner) == 1:
            errors.extend(trial)
        else:
            errors.append(f"{where}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")
        return value
    if origin is Literal:
        if value not in args:
            errors.append(f"{where}: {value!r} is not one of "
                          f"{list(args)}{near_miss(str(value), [str(a) for a in args])}")
        return value
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where, errors, strict=strict)
    if origin in (list, tuple, Sequence) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            errors.append(f"{where}: expected a list, got {type(value).__name__} {value!r}")
            return value
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                errors.append(f"{where}: expected {len(args)} items, got {len(value)}")
                return value
            return tuple(convert(v, a, f"{where}[{i}]", errors) for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        out = [convert(v, item, f"{where}[{i}]", errors) for i, v in enumerate(value)]
        return tuple(out) if origin is tuple or tp is tuple else out
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            errors.append(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
            return value
        kt, vt = args if args else (Any, Any)
        return {convert(k, kt, where, errors): convert(v, vt, f"{where}.{k}", errors) for k, v in value.items()}
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
        return value  # an annotation this loader does not model: accepted as given
    errors.append(f"{where}: expected {type_name(tp)}, got {type(value).__name__} {value!r}")
    return value


def _init_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def build(cls: type, data: Any, where: str, errors: list[str] | None = None, *, strict: bool = True) -> Any:
    """Instance of dataclass ``cls`` from mapping ``data`` (None = all defaults); unknown keys, type
    errors and the class's own checks raise one ConfigError (or are appended to ``errors``), each
    naming the dotted key, with the near miss. ``strict=False``: unknown keys go to ``extra``."""
    own = errors is None
    errors = [] if own else errors
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        errors.append(f"{where}: expected a mapping for {cls.__name__}, got {type(data).__name__} {data!r}")
        return raise_errors(errors) if own else None
    raw = dict(data)
    if hasattr(cls, "__normalize__"):
        try:
            raw = cls.__normalize__(raw)
        except (TypeError, ValueError) as e:
            errors.append(f"{where}: {e}")
            return raise_errors(errors) if own else None
    for old, new in getattr(cls, "__aliases__", {}).items():
        if old in raw:
            log.warning("config key '%s.%s' is deprecated: it is now '%s.%s'", where, old, where, new)
            if new in raw:
                errors.append(f"{where}: both '{old}' (deprecated) and '{new}' are given; keep '{new}'")
            raw[new] = raw.pop(old)
    hints = typing.get_type_hints(cls)
    fields = _init_fields(cls)
    passthrough = getattr(cls, "__passthrough__", frozenset())
    kwargs: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        if key == "extra" and "extra" in fields:
            continue  # merged below with the passthrough keys
        if key in fields:
            kwargs[key] = convert(value, hints[key], f"{where}.{key}", errors, strict)
        elif "extra" in fields and (key in passthrough or not strict):
            extra[key] = value
        else:
            known = [f for f in fields if f != "extra"]
            errors.append(f"unknown key '{where}.{key}'{near_miss(key, known)} (known: {', '.join(known)})")
    if extra or "extra" in raw:
        kwargs["extra"] = {**dict(raw.get("extra") or {}), **extra}
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    errors.extend(f"{where}.{n}: required and not given" for n in missing)
    obj = None
    if not errors:
        try:
            obj = cls(**kwargs)
        except (TypeError, ValueError) as e:  # the class's own __post_init__ checks
            errors.append(str(e) if str(e).startswith(where) else f"{where}: {e}")
    if own and errors:
        raise_errors(errors)
    return obj


def coerce_fields(obj: Any, where: str) -> None:
    """Check (and normalise: lists to tuples, ints to floats, mappings to nested configs) every field of
    a frozen config dataclass against its annotation; call it first in ``__post_init__`` so that direct
    construction (``ComputeConfig(dtype="fp8")``) is refused as the loader would refuse it. Raises
    ValueError naming each bad key."""
    errors: list[str] = []
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.name == "extra" or not f.init:
            continue
        value = getattr(obj, f.name)
        converted = convert(value, hints[f.name], f"{where}.{f.name}", errors)
        if converted is not value and not errors:
            object.__setattr__(obj, f.name, converted)
    if errors:
        raise ValueError("; ".join(errors))


def raise_errors(errors: Sequence[str]) -> Any:
    """Raise one ConfigError for every problem: one line for one error, else a line each."""
    if len(errors) == 1:
        raise ConfigError(f"invalid config: {errors[0]}")
    raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


# ----------------------------------------------------------------------------- documentation

@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: meaning}`` from the class source: the comment on the field's line(s), else the
    comment lines just above it."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    names = set(_init_fields(cls))
    out: dict[str, str] = {}
    starts = [i for i, ln in enumerate(lines, 1) if re.match(r"\s+(\w+)\s*:", ln)
              and re.match(r"\s+(\w+)\s*:", ln).group(1) in names]
    for n, start in enumerate(starts):
        name = re.match(r"\s+(\w+)\s*:", lines[start - 1]).group(1)
        if name in out:
            continue
        end = starts[n + 1] if n + 1 < len(starts) else len(lines) + 1
        # the field's own lines end where a method or decorator starts (the last field's comment is not
        # one inside __post_init__)
        end = next((i for i in range(start + 1, end) if re.match(r"\s+(def |@)", lines[i - 1])), end)
        own = [comments[i] for i in range(start, end) if i in comments
               and not lines[i - 1].lstrip().startswith("#")]
        if own:
            out[name] = own[0]
            continue
        above, i = [], start - 1
        while i >= 1 and lines[i - 1].lstrip().startswith("#"):
            above.insert(0, comments.get(i, ""))
            i -= 1
        if above:
            out[name] = " ".join(above)
    return out


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return ""
    return yaml.safe_dump(to_plain(value), default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def describe(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """Every key of ``cls`` (nested sections and each variant of a tagged union included) as
    ``(dotted key, type, default, meaning)``."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for name, f in _init_fields(cls).items():
        if name == "extra":
            continue
        key, tp = f"{prefix}{name}", hints[name]
        variants = tagged_variants(tp)
        if dataclasses.is_dataclass(tp):
            yield key, tp.__name__, "", docs.get(name, "")
            yield from describe(tp, key + ".")
        elif variants is not None:
            yield key, "one of: " + ", ".join(f"kind={k}" for k in variants), "", docs.get(name, "")
            for kind, variant in variants.items():
                yield from describe(variant, f"{key}[kind={kind}].")
        else:
            yield key, type_name(tp), _default_text(f), docs.get(name, "")


def format_help(rows: Sequence[tuple[str, str, str, str]]) -> str:
    """The rows of :func:`describe` as an aligned text table."""
    head = ("key", "type", "default", "meaning")
    widths = [min(max(len(r[i]) for r in [head, *rows]), cap) for i, cap in enumerate((52, 34, 28, 10**6))]
    lines = []
    for r in [head, *rows]:
        cells = [c if len(c) <= w else c[: w - 1] + "~" for c, w in zip(r, widths)]
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(lines)


# ----------------------------------------------------------------------------- overrides and files

def parse_value(text: str) -> Any:
    """A command-line value as YAML ('2' -> 2, 'true' -> True, '[a, b]' -> list), plus '1e-4' -> float."""
    value = yaml.safe_load(text) if text.strip() else None
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", value.strip()):
        return float(value)
    return value


def parse_override(item: str) -> tuple[str, Any]:
    """``'a.b=VALUE'`` -> ``('a.b', parsed VALUE)`` (the one ``key=value`` parser)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not key=value (e.g. optimizer.lr=1e-4)")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override '{item}': '{key}' is not a dotted key (e.g. optimizer.lr=1e-4)")
    return key, parse_value(text)


def set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    """``tree['a']['b'] = value`` for key 'a.b' (missing mappings are created; the typed build then
    names a key that does not exist)."""
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"'{key}': '{'.'.join(parts[:i + 1])}' is {child!r}, not a mapping")
        node = child
    node[parts[-1]] = value


def overrides_tree(items: Sequence[str], prefix: str = "") -> dict[str, Any]:
    """``key=value`` items as a nested mapping (``a.b=1`` -> ``{"a": {"b": 1}}``; a leading ``prefix.``
    on a key is dropped): a section's overrides, or XLA compile options."""
    tree: dict[str, Any] = {}
    for item in items:
        key, value = parse_override(item)
        set_dotted(tree, key.removeprefix(f"{prefix}.") if prefix else key, value)
    return tree


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping in a YAML file ({} when empty); anything else is an error naming the file."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return raw


def deep_merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``over`` laid on ``base`` recursively (mappings merge, everything else replaces)."""
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def to_plain(obj: Any) -> Any:
    """Dataclasses, tuples and mappings -> YAML-safe dicts / lists / scalars."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


# -- preset files ---------------------------------------------------------------------------------------

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
KIND_OF_SECTION = {"model": "models", "layout": "layouts", "data": "data", "recipe": "recipes"}


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


def section_mapping(section: str, ref: Any, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The raw mapping of section ``section`` from a name / path / mapping / built dataclass, with
    ``key=value`` overrides relative to the section (a leading ``SECTION.`` is accepted) applied."""
    if dataclasses.is_dataclass(ref) and not isinstance(ref, type):
        raw = to_plain(ref)
    else:
        raw = resolve_reference(section, ref) if section in KIND_OF_SECTION else dict(ref or {})
    for item in overrides:
        key, value = parse_override(item)
        set_dotted(raw, key.removeprefix(f"{section}."), value)
    return raw


def load_typed(cls: type, section: str, ref: Any, overrides: Sequence[str] = ()) -> Any:
    """Section ``section`` as dataclass ``cls`` (:func:`section_mapping`, then :func:`build`); an
    instance of ``cls`` without overrides is returned as it is."""
    overrides = list(overrides)
    if isinstance(ref, cls) and not overrides:
        return ref
    return build(cls, section_mapping(section, ref, overrides), section)
