"""Run settings: a recipe (model + layout + data + compute + optimizer + train) as layered YAML.

Layers, later wins (as in MaxText): the dataclass defaults below -> the recipe
(``configs/recipes/NAME.yaml`` or a path) -> the model / layout / data files it names
(``configs/{models,layouts,data}/NAME.yaml`` or paths; ``--model/--layout/--data`` replace the
names) -> command-line ``key=value`` overrides with dotted paths (``optimizer.lr=1e-4``), values
parsed as YAML. Everything is validated once, up front: unknown keys name the near miss, type
errors name the key and the expected type, and rules between fields (global batch = micro batch x
grad_accum x data-parallel size, ...) are checked with messages that say what to change.

A recipe may give ``model`` (and ``layout``, ``data``) as a name or path, as a mapping with
``base: NAME`` plus keys to overlay, or as a full inline mapping (how ``config.yaml`` in a run
directory stores it, so that file is itself a recipe: ``--recipe runs/x/config.yaml``).
The ``model``, ``data`` and ``compute`` sections are plain dicts until a schema (a dataclass, or a
callable ``dict -> object``) is registered for them with :func:`register_schema`.

The train section owns the batch shape: ``micro_batch_size`` is rows per data-parallel rank per
microbatch (Megatron's MBS), the data-parallel size is the product of the mesh axes the layout's
``act_batch`` rule names, and ``data.seq_len`` / ``data.batch_size`` (rows per host per step) are
derived from ``train.seq_len`` and the global batch (setting them directly is an error).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from moevlm_jax.training.optimizer import PARAM_GROUP_PATTERNS
from moevlm_jax.config.schema import (
    ConfigError,
    build_dataclass,
    deep_merge,
    near_miss,
    parse_value,
    to_plain,
)

__all__ = ["ConfigError", "OptimizerConfig", "TrainConfig", "RunConfig", "register_schema", "load_config",
           "build_run_config", "save_config", "add_arguments", "from_args", "default_recipe"]

log = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
SECTIONS = ("name", "description", "model", "layout", "data", "compute", "optimizer", "train")
REFERENCED = {"model": "models", "layout": "layouts", "data": "data"}
DERIVED = {"data.seq_len": "train.seq_len",
           "data.batch_size": "train.micro_batch_size / train.grad_accum (data.batch_size = global batch / processes)"}


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW + warmup/decay schedule + global-norm clipping (see moevlm_jax.training.optimizer)."""

    name: Literal["adamw"] = "adamw"
    lr: float = 3e-4
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 100
    decay_steps: int | None = None  # None: train.steps
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # regexes searched in '/'-joined parameter paths; matches get no weight decay (Megatron:
    # biases and norm weights are not decayed, embeddings are)
    no_decay_patterns: list[str] = dataclasses.field(default_factory=lambda: ["norm", "bias$"])
    clip_grad_norm: float = 1.0  # 0: no clipping
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    skip_nonfinite: bool = True  # skip updates whose gradients hold inf/nan (counted)
    max_consecutive_skips: int = 10  # after this many in a row the update is applied anyway


@dataclasses.dataclass
class TrainConfig:
    """Loop settings: steps, batch shape, logging, evaluation, checkpoints, freezing, profiling."""

    steps: int = 1000
    micro_batch_size: int = 1  # rows per data-parallel rank per microbatch (Megatron MBS)
    grad_accum: int = 1  # microbatches per step
    global_batch_size: int | None = None  # if given: must equal MBS x grad_accum x DP size
    seq_len: int = 4096
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0: no evaluation
    eval_batches: int = 0
    checkpoint_every: int = 500  # 0: only the final checkpoint
    keep_checkpoints: int = 3
    async_checkpointing: bool = True
    freeze_vision_model: bool = False
    freeze_vision_projection: bool = False
    freeze_language_model: bool = False
    # which parameters each freeze flag covers: regexes searched in '/'-joined paths
    param_groups: dict[str, list[str]] = dataclasses.field(
        default_factory=lambda: {k: list(v) for k, v in PARAM_GROUP_PATTERNS.items()}
    )
    init_from: str | None = None  # HF checkpoint directory; None: random init
    run_dir: str | None = None  # None: runs/<recipe name>
    resume: bool = False
    tensorboard: bool = True
    profile_steps: int = 0  # 0: no profile; else trace this many steps
    profile_start_step: int = 10
    profile_dir: str | None = None  # None: <run_dir>/profile
    # JAX's persistent compilation cache (compiled steps reused by later runs of the same program;
    # MaxText's jax_cache_dir); None: JAX's own setting (JAX_COMPILATION_CACHE_DIR, default off)
    compilation_cache_dir: str | None = None


@dataclasses.dataclass
class RunConfig:
    """The validated run: typed sections plus the resolved plain mapping written to config.yaml."""

    name: str
    model: Any
    layout: Any
    data: Any
    compute: Any
    optimizer: OptimizerConfig
    train: TrainConfig
    data_parallel_size: int
    resolved: dict[str, Any]
    description: str = ""

    @property
    def global_batch_size(self) -> int:
        """Rows per optimizer step over all devices: MBS x grad_accum x data-parallel size."""
        return self.train.micro_batch_size * self.train.grad_accum * self.data_parallel_size

    @property
    def run_dir(self) -> Path:
        """The run directory (config.yaml, checkpoints/, metrics.jsonl, tensorboard/)."""
        return Path(self.train.run_dir or f"runs/{self.name}")


# ----------------------------------------------------------------------------- pluggable schemas

_SCHEMAS: dict[str, Any] = {}


def register_schema(section: str, schema: type | Callable[[dict[str, Any]], Any] | None) -> None:
    """Validate section ``model``/``data``/``compute`` with a dataclass or ``dict -> obj`` callable."""
    if section not in ("model", "data", "compute"):
        raise ValueError(f"schemas are pluggable for model, data and compute, not {section!r}")
    if schema is None:
        _SCHEMAS.pop(section, None)
    else:
        _SCHEMAS[section] = schema


# ----------------------------------------------------------------------------- files and layering

def find_config(kind: str, name_or_path: str | Path) -> Path:
    """``configs/<kind>/NAME.yaml`` for a bare name, else the path itself (must exist)."""
    text = str(name_or_path)
    path = Path(text)
    if path.suffix not in (".yaml", ".yml") and "/" not in text:
        path = CONFIG_DIR / kind / f"{text.replace('+', '_')}.yaml"  # layout aliases: tp+ep = tp_ep
    if not path.exists():
        names = sorted(p.stem for p in (CONFIG_DIR / kind).glob("*.yaml"))
        raise ConfigError(f"no {kind} config '{text}'{near_miss(text, names)} "
                          f"(available in configs/{kind}/: {names}; or give a .yaml path)")
    return path


def read_yaml(path: Path) -> dict[str, Any]:
    """The mapping in a YAML file ({} when empty); anything else is an error."""
    raw = yaml.safe_load(path.read_text())
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    return raw


def _resolve_reference(section: str, ref: Any, sources: dict[str, str]) -> dict[str, Any]:
    """A name/path, a {base: NAME, ...overlay} mapping or an inline mapping -> the section dict."""
    if ref is None:
        raise ConfigError(f"the recipe names no {section}; set '{section}: NAME' or pass --{section}")
    if isinstance(ref, (str, Path)):
        path = find_config(REFERENCED[section], ref)
        sources[section] = str(path)
        return read_yaml(path)
    if isinstance(ref, Mapping):
        ref = dict(ref)
        if "base" in ref:
            base = _resolve_reference(section, ref.pop("base"), sources)
            return deep_merge(base, ref)
        sources[section] = "inline"
        return ref
    raise ConfigError(f"{section}: expected a name, a path or a mapping, got {type(ref).__name__} {ref!r}")


def set_dotted(tree: dict[str, Any], key: str, value: Any, check_typos: bool = True) -> None:
    """Set ``tree['a']['b'] = value`` for key 'a.b'. With ``check_typos``, a key that is absent but
    a near miss of a present one is an error (sections whose schema cannot name its fields); a key that
    is a present key with a word before or after it (``vision_max_segments`` next to ``max_segments``,
    ``capture_scopes`` next to ``capture``) is not."""
    parts = key.split(".")
    if parts[0] not in SECTIONS:
        raise ConfigError(f"unknown setting '{key}'{near_miss(parts[0], SECTIONS)} "
                          f"(top-level sections: {', '.join(SECTIONS)})")
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"'{key}': '{'.'.join(parts[:i + 1])}' is {child!r}, not a mapping")
        node = child
    last = parts[-1]
    prefixed = any(last.endswith("_" + str(k)) or last.startswith(str(k) + "_") for k in node)
    if len(parts) > 1 and check_typos and last not in node and not prefixed and near_miss(last, list(node)):
        raise ConfigError(f"unknown key '{key}'{near_miss(last, list(node))} "
                          f"(keys there: {', '.join(map(str, node))})")
    node[last] = value


def default_recipe(platform: str | None = None) -> str:
    """'gpu-default' on a GPU backend, else 'cpu-default'."""
    if platform is None:
        import jax

        platform = jax.default_backend()
    return "gpu-default" if platform in ("gpu", "cuda", "rocm") else "cpu-default"


# ----------------------------------------------------------------------------- validation

def _build_layout(raw: dict[str, Any], errors: list[str]) -> Any:
    from parallelism.layout import MESH_AXES, layout_from_dict

    known = ("name", "description", "mesh", "rules", "options")
    for k in raw:
        if k not in known:
            errors.append(f"unknown key 'layout.{k}'{near_miss(k, known)} (known: {', '.join(known)})")
    for axis in raw.get("mesh") or {}:
        if axis not in MESH_AXES:
            errors.append(f"unknown mesh axis 'layout.mesh.{axis}'{near_miss(axis, MESH_AXES)} "
                          f"(mesh axes: {', '.join(MESH_AXES)})")
    if errors:
        return None
    try:
        return layout_from_dict(raw, default_name=str(raw.get("name", "layout")))
    except (TypeError, ValueError) as e:
        errors.append(f"layout: {e}")
        return None


def _build_section(section: str, raw: dict[str, Any], errors: list[str]) -> Any:
    schema = _SCHEMAS.get(section)
    if schema is None:
        return raw
    if dataclasses.is_dataclass(schema):
        return build_dataclass(schema, raw, section, errors)
    try:
        return schema(raw)
    except Exception as e:  # noqa: BLE001 - any schema's own validation error becomes a config error
        errors.append(f"{section}: {e}")
        return None


def data_parallel_size(layout: Any, num_devices: int) -> int:
    """Devices the batch is split over: the product of the mesh axes the rule for 'act_batch' names."""
    from parallelism.logical import mesh_axes_for

    shape = layout.resolved_mesh_shape(num_devices)
    axes = mesh_axes_for("act_batch", layout.rules)
    flat = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    size = 1
    for a in flat:
        size *= shape[a]
    return size


def _cross_checks(opt: OptimizerConfig, tr: TrainConfig, dp: int, errors: list[str]) -> None:
    """Rules between fields; each message says which settings to change."""
    positive = {"train.steps": tr.steps, "train.micro_batch_size": tr.micro_batch_size,
                "train.grad_accum": tr.grad_accum, "train.seq_len": tr.seq_len,
                "train.log_every": tr.log_every, "train.keep_checkpoints": tr.keep_checkpoints}
    errors.extend(f"{k} must be >= 1, got {v}" for k, v in positive.items() if v < 1)
    nonneg = {"train.eval_every": tr.eval_every, "train.eval_batches": tr.eval_batches,
              "train.checkpoint_every": tr.checkpoint_every, "train.profile_steps": tr.profile_steps,
              "optimizer.warmup_steps": opt.warmup_steps, "optimizer.weight_decay": opt.weight_decay,
              "optimizer.clip_grad_norm": opt.clip_grad_norm}
    errors.extend(f"{k} must be >= 0, got {v}" for k, v in nonneg.items() if v < 0)
    if opt.lr <= 0:
        errors.append(f"optimizer.lr must be > 0, got {opt.lr}")
    if not 0.0 <= opt.min_lr_ratio <= 1.0:
        errors.append(f"optimizer.min_lr_ratio must be in [0, 1], got {opt.min_lr_ratio}")
    decay = opt.decay_steps if opt.decay_steps is not None else tr.steps
    if opt.warmup_steps > decay:  # e.g. a `--steps 3` smoke run of a recipe: allowed, but said
        log.warning("optimizer.warmup_steps=%d exceeds the decay length %d (optimizer.decay_steps, default "
                    "train.steps): the learning rate stays in warmup and never reaches optimizer.lr",
                    opt.warmup_steps, decay)
    gbs = tr.micro_batch_size * tr.grad_accum * dp
    if tr.global_batch_size is not None and tr.global_batch_size != gbs:
        per = tr.micro_batch_size * dp
        hint = (f"set train.grad_accum={tr.global_batch_size // per}" if tr.global_batch_size % per == 0
                else f"make it a multiple of micro_batch_size x data-parallel = {per}")
        errors.append(f"train.global_batch_size={tr.global_batch_size} but micro_batch_size "
                      f"{tr.micro_batch_size} x grad_accum {tr.grad_accum} x data-parallel size {dp} = "
                      f"{gbs}; {hint}, or drop global_batch_size")
    if tr.eval_every > 0 and tr.eval_batches < 1:
        errors.append(f"train.eval_every={tr.eval_every} needs train.eval_batches >= 1 (got {tr.eval_batches})")
    if tr.freeze_vision_model and tr.freeze_vision_projection and tr.freeze_language_model:
        errors.append("train.freeze_vision_model, freeze_vision_projection and freeze_language_model are "
                      "all true: nothing would be trained")
    for group in tr.param_groups:
        if group not in ("vision_model", "vision_projection"):
            errors.append(f"unknown parameter group 'train.param_groups.{group}'"
                          f"{near_miss(group, ['vision_model', 'vision_projection'])} (the language "
                          f"model is everything the two groups do not match)")
    for pattern in [*opt.no_decay_patterns, *(p for v in tr.param_groups.values() for p in v)]:
        try:
            re.compile(pattern)
        except re.error as e:
            errors.append(f"bad regex {pattern!r}: {e}")
    if tr.profile_steps > 0 and tr.profile_start_step >= tr.steps:
        errors.append(f"train.profile_start_step={tr.profile_start_step} is past train.steps={tr.steps}")


def _derive_data(raw: dict[str, Any], tr: TrainConfig, gbs: int, num_processes: int,
                 errors: list[str]) -> dict[str, Any]:
    """The train section owns the batch shape: data.seq_len = train.seq_len and data.batch_size =
    global batch / processes (rows each host loads per step)."""
    if gbs % num_processes:
        errors.append(f"global batch {gbs} does not divide over {num_processes} processes; change "
                      f"train.micro_batch_size or train.grad_accum")
        return raw
    derived = {"seq_len": tr.seq_len, "batch_size": gbs // num_processes}
    for key, value in derived.items():
        if key in raw and raw[key] != value:
            log.info("data.%s %s -> %s (derived from the train section)", key, raw[key], value)
    return {**raw, **derived}


def build_run_config(raw: Mapping[str, Any], num_devices: int = 1, num_processes: int = 1) -> RunConfig:
    """Validate a resolved mapping (sections are mappings, not names) into a RunConfig."""
    errors: list[str] = []
    for k in raw:
        if k not in SECTIONS:
            errors.append(f"unknown section '{k}'{near_miss(k, SECTIONS)} (sections: {', '.join(SECTIONS)})")
    opt = build_dataclass(OptimizerConfig, raw.get("optimizer"), "optimizer", errors)
    tr = build_dataclass(TrainConfig, raw.get("train"), "train", errors)
    layout = _build_layout(dict(raw.get("layout") or {}), errors)
    dp = 1
    if layout is not None:
        try:
            dp = data_parallel_size(layout, num_devices)
        except ValueError as e:
            errors.append(f"layout: {e}")
    data_raw = dict(raw.get("data") or {})
    if opt is not None and tr is not None:
        _cross_checks(opt, tr, dp, errors)
        if tr.global_batch_size is None:
            tr.global_batch_size = tr.micro_batch_size * tr.grad_accum * dp
        data_raw = _derive_data(data_raw, tr, tr.global_batch_size, num_processes, errors)
    model = _build_section("model", dict(raw.get("model") or {}), errors)
    data = _build_section("data", data_raw, errors)
    compute = _build_section("compute", dict(raw.get("compute") or {}), errors)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    name = str(raw.get("name") or "run")

    def plain(section: str, obj: Any, given: Any) -> Any:
        """Dataclass schemas: every field (defaults included); callables: the mapping they were given."""
        return to_plain(obj if dataclasses.is_dataclass(_SCHEMAS.get(section)) else given or {})

    resolved = {"name": name, "description": str(raw.get("description") or ""),
                "model": plain("model", model, raw.get("model")), "layout": to_plain(raw.get("layout") or {}),
                "data": plain("data", data, data_raw), "compute": plain("compute", compute, raw.get("compute")),
                "optimizer": to_plain(opt), "train": to_plain(tr)}
    return RunConfig(name=name, model=model, layout=layout, data=data, compute=compute, optimizer=opt,
                     train=tr, data_parallel_size=dp, resolved=resolved, description=resolved["description"])


def load_config(recipe: str | Path | None = None, *, model: str | None = None, layout: str | None = None,
                data: str | None = None, overrides: Sequence[str] = (), steps: int | None = None,
                run_dir: str | None = None, resume: bool | None = None, num_devices: int | None = None,
                num_processes: int | None = None, platform: str | None = None) -> RunConfig:
    """Defaults -> recipe -> model/layout/data files -> ``key=value`` overrides, validated."""
    if resume and recipe is None and run_dir and (Path(run_dir) / "config.yaml").exists():
        recipe = Path(run_dir) / "config.yaml"  # resuming: the run's own resolved config is the base
        log.info("resuming from %s", recipe)
    recipe = recipe if recipe is not None else default_recipe(platform)
    path = find_config("recipes", recipe)
    raw = read_yaml(path)
    raw.setdefault("name", path.stem if path.name != "config.yaml" else path.parent.name)
    pairs = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (e.g. optimizer.lr=1e-4)")
        key, text = item.split("=", 1)
        key = key.strip()
        if key in DERIVED:
            raise ConfigError(f"'{key}' is derived from the train section; set {DERIVED[key]} instead")
        pairs.append((key, parse_value(text)))
    refs = {"model": model, "layout": layout, "data": data}
    for key, value in pairs:  # 'model=proxy' is the same as --model proxy
        if key in REFERENCED and isinstance(value, str):
            refs[key] = value
    sources: dict[str, str] = {"recipe": str(path)}
    for section in REFERENCED:
        if refs[section] is not None:
            raw[section] = refs[section]
        raw[section] = _resolve_reference(section, raw.get(section), sources)
    for key, value in pairs:
        if key in REFERENCED and isinstance(value, str):
            continue
        section = key.split(".")[0]
        typed = section in ("optimizer", "train") or dataclasses.is_dataclass(_SCHEMAS.get(section))
        set_dotted(raw, key, value, check_typos=not typed)
    train = dict(raw.get("train") or {})
    if steps is not None:
        train["steps"] = steps
    if run_dir is not None:
        train["run_dir"] = str(run_dir)
    if resume is not None:
        train["resume"] = bool(resume)
    raw["train"] = train
    if num_devices is None or num_processes is None:
        import jax

        num_devices = jax.device_count() if num_devices is None else num_devices
        num_processes = jax.process_count() if num_processes is None else num_processes
    cfg = build_run_config(raw, num_devices, num_processes)
    log.info("config %s: model %s, layout %s, data %s", cfg.name, sources.get("model"),
             sources.get("layout"), sources.get("data"))
    return cfg


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config as YAML (a recipe that reproduces the run); returns the path."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        path = path / "config.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.resolved, sort_keys=False, default_flow_style=None))
    return path


# ----------------------------------------------------------------------------- command line

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --recipe/--model/--layout/--data/--steps/--run-dir/--resume and key=value overrides."""
    parser.add_argument("--recipe", help="configs/recipes/NAME.yaml or a path (default: by platform)")
    parser.add_argument("--model", help="configs/models/NAME.yaml or a path")
    parser.add_argument("--layout", help="configs/layouts/NAME.yaml or a path")
    parser.add_argument("--data", help="configs/data/NAME.yaml or a path")
    parser.add_argument("--steps", type=int, help="train.steps")
    parser.add_argument("--run-dir", help="train.run_dir")
    parser.add_argument("--resume", action="store_true", default=None,
                        help="continue from the latest checkpoint in the run dir")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="any setting by dotted path, e.g. optimizer.lr=1e-4 train.grad_accum=4")


def from_args(args: argparse.Namespace, num_devices: int | None = None) -> RunConfig:
    """RunConfig from the arguments :func:`add_arguments` defined."""
    return load_config(args.recipe, model=args.model, layout=args.layout, data=args.data,
                       overrides=args.overrides, steps=args.steps, run_dir=args.run_dir,
                       resume=args.resume, num_devices=num_devices)
