"""Run settings: one typed tree (``RunConfig``) for model, layout, data, compute, optimizer and train.

Layers, later wins (as in MaxText): the dataclass defaults -> the recipe
(``configs/recipes/NAME.yaml`` or a path) -> the model / layout / data files it names
(``configs/{models,layouts,data}/NAME.yaml`` or paths; ``--model/--layout/--data`` replace the
names) -> command-line ``key=value`` overrides with dotted paths (``optimizer.lr=1e-4``), values
parsed as YAML (``moevlm_jax.schema.parse_override``, the one override parser). Everything is
validated once, up front, by the one loader (``moevlm_jax.schema.build``): unknown keys name
the near miss, type errors name the key and the expected type, and rules between fields and
sections (global batch = micro batch x grad_accum x data-parallel size; the data's tokenizer and
image processing against the model; the layout against the model's heads, experts and layers and
the batch shape) are checked here with messages that say what to change.

A recipe may give ``model`` (and ``layout``, ``data``) as a name or path, as a mapping with
``base: NAME`` plus keys to overlay, or as a full inline mapping (how ``config.yaml`` in a run
directory stores it, so that file is itself a recipe: ``--recipe runs/x/config.yaml``).

The train section owns the batch shape: ``micro_batch_size`` is rows per data-parallel rank per
microbatch (Megatron's MBS), the data-parallel size is the product of the mesh axes the layout's
``act_batch`` rule names, and ``data.seq_len`` / ``data.batch_size`` (rows per host per step) are
derived from ``train.seq_len`` and the global batch (setting them directly is an error), as is
``data.balance_group`` (the rows of one rank's microbatch). A pipeline layout's microbatch count follows
the resolved batch (:func:`fit_pipeline_batch`: the nearest count that fits, said in one log line and
recorded in config.yaml).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import yaml

from moevlm_jax.config.files import CONFIG_DIR, REFERENCED, find_config, resolve_reference
from moevlm_jax.data.config import DataConfig, DataError
from moevlm_jax.data.sources import dataset_source
from moevlm_jax.data.tokenizer import load_tokenizer
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import ModelConfig
from moevlm_jax.model.registry import load_model_config, model_config_type
from moevlm_jax.parallelism.dispatch import hierarchical_problem
from moevlm_jax.parallelism.layout import Layout
from moevlm_jax.parallelism.logical import data_parallel_size, flat_axes, mesh_axes_for
from moevlm_jax.parallelism.pipeline import pipeline_config
from moevlm_jax.parallelism.validate import LayoutError, fit_pipeline, validate_layout
from moevlm_jax.schema import (
    ConfigError,
    build,
    describe,
    format_help,
    near_miss,
    parse_override,
    raise_errors,
    read_yaml,
    set_dotted,
    to_plain,
)
from moevlm_jax.training.config import OptimizerConfig, TrainConfig

__all__ = ["CONFIG_DIR", "ConfigError", "RunConfig", "add_arguments", "build_run_config", "default_recipe",
           "from_args", "help_config", "load_config", "resolve_raw", "resumes", "save_config"]

log = logging.getLogger(__name__)

SECTIONS = ("name", "description", "model", "layout", "data", "compute", "optimizer", "train")
DERIVED = {"data.seq_len": "train.seq_len",
           "data.batch_size": "train.micro_batch_size / train.grad_accum (data.batch_size = global batch / processes)",
           "data.balance_group": "train.micro_batch_size (one data-parallel rank's microbatch)"}


@dataclasses.dataclass
class RunConfig:
    """A run: every section typed; ``data_parallel_size`` and ``resolved`` (the plain mapping written to
    config.yaml) are derived when it is loaded."""

    name: str = "run"  # the recipe's name (default run directory: runs/<name>)
    description: str = ""  # one line on what the recipe is for
    model: ModelConfig = ModelConfig()  # the model's shapes (HF config.json field names)
    layout: Layout = Layout()  # the mesh and the logical-axis rules
    data: DataConfig = DataConfig()  # the input pipeline
    compute: ComputeConfig = ComputeConfig()  # dtypes, kernels, recompute, capture, experts, router
    optimizer: OptimizerConfig = OptimizerConfig()  # AdamW and its schedule
    train: TrainConfig = TrainConfig()  # the loop: steps, batch shape, evaluation, checkpoints
    data_parallel_size: int = dataclasses.field(default=1, init=False)
    resolved: dict[str, Any] = dataclasses.field(default_factory=dict, init=False)

    @property
    def global_batch_size(self) -> int:
        """Rows per optimizer step over all devices: MBS x grad_accum x data-parallel size."""
        return self.train.micro_batch_size * self.train.grad_accum * self.data_parallel_size

    @property
    def run_dir(self) -> Path:
        """The run directory (config.yaml, checkpoints/, metrics.jsonl, tensorboard/)."""
        return Path(self.train.run_dir or f"runs/{self.name}")


def help_config() -> str:
    """Every key of a run with its type, default and meaning (``--help-config``)."""
    return format_help(list(describe(RunConfig)))


def default_recipe(platform: str | None = None) -> str:
    """'gpu-default' on a GPU backend, else 'cpu-default'."""
    if platform is None:

        platform = jax.default_backend()
    return "gpu-default" if platform in ("gpu", "cuda", "rocm") else "cpu-default"


# ----------------------------------------------------------------------------- rules between sections

def resolve_batch(tr: TrainConfig, dp: int, errors: list[str]) -> TrainConfig:
    """The batch shape as Megatron keeps it: ``train.global_batch_size`` (rows per step) is fixed when
    given; the micro batch (rows per data-parallel rank, null: the whole share of a rank) and the
    accumulation (null: derived) follow from it and the layout's data-parallel size ``dp``, so the same
    recipe trains on the same rows under every layout. Without a global batch it is MBS x accumulation x
    DP (MBS and accumulation default to 1). Returns the train section with all three set."""
    gbs, mbs, accum = tr.global_batch_size, tr.micro_batch_size, tr.grad_accum
    for key, value in (("micro_batch_size", mbs), ("grad_accum", accum), ("global_batch_size", gbs)):
        if value is not None and value < 1:
            errors.append(f"train.{key} must be >= 1, got {value}")
            return tr
    if gbs is None:
        mbs, accum = mbs or 1, accum or 1
        return dataclasses.replace(tr, micro_batch_size=mbs, grad_accum=accum, global_batch_size=mbs * accum * dp)
    if mbs is None:
        accum = accum or 1
        if gbs % (dp * accum):
            errors.append(f"train.global_batch_size={gbs} does not divide over data-parallel size {dp} x grad_accum "
                          f"{accum}; make it a multiple of {dp * accum} or use a layout with a data-parallel size "
                          "that divides it")
            return tr
        mbs = gbs // (dp * accum)
    elif accum is None:
        if gbs % (mbs * dp):
            errors.append(f"train.global_batch_size={gbs} is not a multiple of micro_batch_size {mbs} x "
                          f"data-parallel size {dp} = {mbs * dp}; set train.micro_batch_size to a divisor of "
                          f"{gbs // dp if gbs % dp == 0 else 'the global batch per rank'} (or null: derived)")
            return tr
        accum = gbs // (mbs * dp)
    elif mbs * accum * dp != gbs:
        per = mbs * dp
        hint = (f"set train.grad_accum={gbs // per} (or null: derived)" if gbs % per == 0
                else f"make it a multiple of micro_batch_size x data-parallel = {per}")
        errors.append(f"train.global_batch_size={gbs} but micro_batch_size {mbs} x grad_accum {accum} x "
                      f"data-parallel size {dp} = {mbs * accum * dp}; {hint}, or drop global_batch_size")
        return tr
    return dataclasses.replace(tr, micro_batch_size=mbs, grad_accum=accum, global_batch_size=gbs)


def fit_pipeline_batch(layout: Layout, tr: TrainConfig, dp: int, num_devices: int,
                       errors: list[str]) -> tuple[Layout, TrainConfig]:
    """A pipeline layout's microbatch count fitted to the resolved batch: the rows of a microbatch step
    (micro batch x data parallel) must split into the pipeline's microbatches with each microbatch's rows
    dividing over the data axes inside a stage. The layout's own count when it fits, else the nearest
    that does (``parallelism.validate.fit_pipeline``); when none fits the rows, the accumulation moves
    into the micro batch (same global batch) until one does. Says what changed in one log line; the
    reason in ``errors`` when nothing fits."""
    try:
        shape = layout.resolved_mesh_shape(num_devices)
    except ValueError:
        return layout, tr  # reported by the layout checks
    if shape.get("stage", 1) <= 1:
        return layout, tr
    try:
        pipeline_config(layout.options, shape["stage"])
    except ValueError:
        return layout, tr  # options the schedule refuses whatever the batch: reported by the layout checks
    mbs, accum = tr.micro_batch_size, tr.grad_accum
    reason = None
    for k in (k for k in range(1, accum + 1) if accum % k == 0):
        try:
            fitted, message = fit_pipeline(layout, shape, mbs * k * dp)
        except ValueError as e:
            reason = reason or f"layout '{layout.name}' does not fit the batch: {e}"
            continue
        if k > 1:
            split = (f"micro batch {mbs} x grad_accum {accum} -> {mbs * k} x {accum // k} (train.micro_batch_size, "
                     f"train.grad_accum) so the pipeline's microbatches fit, the global batch is kept")
            message = f"layout {layout.name}: {split}" + (f"; {message.split(': ', 1)[1]}" if message else "")
            tr = dataclasses.replace(tr, micro_batch_size=mbs * k, grad_accum=accum // k)
        if message:
            log.info("%s", message)
        return fitted, tr
    errors.append(reason)
    return layout, tr


def _cross_checks(opt: OptimizerConfig, tr: TrainConfig, errors: list[str]) -> None:
    """Rules between fields; each message says which settings to change."""
    least = {"train.steps": (tr.steps, 1), "train.seq_len": (tr.seq_len, 2), "train.log_every": (tr.log_every, 1),
             "train.keep_checkpoints": (tr.keep_checkpoints, 1)}
    errors.extend(f"{k} must be >= {low}, got {v}" for k, (v, low) in least.items() if v < low)
    nonneg = {"train.eval_every": tr.eval_every, "train.eval_batches": tr.eval_batches,
              "train.checkpoint_every": tr.checkpoint_every, "train.profile_steps": tr.profile_steps,
              "optimizer.warmup_steps": opt.warmup_steps, "optimizer.weight_decay": opt.weight_decay,
              "optimizer.clip_grad_norm": opt.clip_grad_norm}
    errors.extend(f"{k} must be >= 0, got {v}" for k, v in nonneg.items() if v < 0)
    if opt.lr <= 0:
        errors.append(f"optimizer.lr must be > 0, got {opt.lr}")
    if not 0.0 <= opt.min_lr_ratio <= 1.0:
        errors.append(f"optimizer.min_lr_ratio must be in [0, 1], got {opt.min_lr_ratio}")
    for key in ("b1", "b2"):
        if not 0.0 <= getattr(opt, key) < 1.0:
            errors.append(f"optimizer.{key} must be in [0, 1), got {getattr(opt, key)}")
    if opt.eps <= 0:
        errors.append(f"optimizer.eps must be > 0, got {opt.eps}")
    if opt.max_consecutive_skips < 1:
        errors.append(f"optimizer.max_consecutive_skips must be >= 1, got {opt.max_consecutive_skips}")
    decay = opt.decay_steps if opt.decay_steps is not None else tr.steps
    if opt.warmup_steps > decay:  # e.g. a `--steps 3` smoke run of a recipe: allowed, but said
        log.warning("optimizer.warmup_steps=%d exceeds the decay length %d (optimizer.decay_steps, default "
                    "train.steps): the learning rate stays in warmup and never reaches optimizer.lr",
                    opt.warmup_steps, decay)
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
    patterns = [("optimizer.no_decay_patterns", p) for p in opt.no_decay_patterns]
    patterns += [(f"train.param_groups.{g}", p) for g, v in tr.param_groups.items() for p in v]
    for key, pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as e:
            errors.append(f"{key}: bad regex {pattern!r}: {e}")
    if tr.profile_steps > 0 and tr.profile_start_step >= tr.steps:
        errors.append(f"train.profile_start_step={tr.profile_start_step} is past train.steps={tr.steps}")


def _experts_checks(compute: ComputeConfig, layout: Layout, shape: Mapping[str, int]) -> list[str]:
    """The experts' dispatcher against the layout (what tracing the step would otherwise find)."""

    ep_axes = tuple(a for a in flat_axes(mesh_axes_for("exp", layout.rules)) if shape.get(a, 1) > 1)
    dispatcher = compute.moe.dispatcher
    if dispatcher in ("alltoall", "allgather", "hierarchical") and not ep_axes:
        return [f"compute.moe.dispatcher '{dispatcher}' needs expert parallelism, but layout '{layout.name}' maps "
                "'exp' to no mesh axis of size > 1; use 'auto' or 'local', or a layout with EP (ep, tp_ep, ep_etp, "
                "pp_ep, ep_multinode)"]
    if dispatcher == "hierarchical":
        problem = hierarchical_problem(ep_axes, f"layout '{layout.name}'")
        return [problem] if problem else []
    return []


def model_data_checks(model: ModelConfig, data: DataConfig) -> list[str]:
    """The data's tokenizer and image processing must match the model config."""

    errors = []
    try:
        tok = load_tokenizer(data.tokenizer)
    except DataError as e:
        return [f"data.tokenizer: {e}"]
    vocab = model.text_config.vocab_size
    if tok.vocab_size > vocab:
        errors.append(f"model {model.name or ''} has vocab_size {vocab} but the data tokenizer '{data.tokenizer}' "
                      f"uses ids up to {tok.vocab_size - 1}; pick a model with that vocabulary (e.g. --model tiny, "
                      f"small or proxy for the Qwen3 tokenizer) or set model.text_config.vocab_size")
    for token, field in (("<|image_pad|>", "image_token_id"), ("<|video_pad|>", "video_token_id"),
                         ("<|vision_start|>", "vision_start_token_id"),
                         ("<|vision_end|>", "vision_end_token_id")):
        want = tok.special_tokens.get(token)
        if want is not None and getattr(model, field) != want:
            errors.append(f"model.{field} = {getattr(model, field)} but the data tokenizer has {token} = {want}")
    v, img = model.vision_config, data.image
    for ours, theirs, name in ((v.patch_size, img.patch_size, "patch_size"),
                               (v.spatial_merge_size, img.merge_size, "merge_size"),
                               (v.temporal_patch_size, img.temporal_patch_size, "temporal_patch_size")):
        if ours != theirs:
            errors.append(f"data.image.{name} = {theirs} but the model's vision_config has {ours}")
    return errors


def _with_image_bound(compute: ComputeConfig, data: DataConfig) -> ComputeConfig:
    """``compute.attention_options.vision_max_image_patches`` from the data's image processing: the most
    patches ``data.image.max_pixels`` allows an image, or an image scaled up to ``min_pixels`` and rounded
    up to the resize grid (square; the trainer checks every batch and runs a batch holding a longer image
    over whole rows), a multiple of the merge block."""
    img = data.image
    up = (math.isqrt(img.min_pixels) + img.factor) ** 2
    block = img.merge_size**2
    bound = -(-max(img.max_pixels, up) // img.patch_size**2 // block) * block
    options = dataclasses.replace(compute.attention_options, vision_max_image_patches=max(1, bound))
    return dataclasses.replace(compute, attention_options=options)


def _derive_data(raw: dict[str, Any], tr: TrainConfig, gbs: int, num_processes: int, dp: int,
                 errors: list[str]) -> dict[str, Any]:
    """The train section owns the batch shape: data.seq_len = train.seq_len, data.batch_size =
    global batch / processes (rows each host loads per step), data.balance_group = the rows of one microbatch of
    one data-parallel rank on a host."""
    if gbs % num_processes:
        errors.append(f"global batch {gbs} does not divide over {num_processes} processes; change "
                      f"train.micro_batch_size or train.grad_accum")
        return raw
    host_rows = gbs // num_processes
    # the rows of one microbatch of one data-parallel rank on this host (the trainer's row groups): images
    # balance over the vision rows of such a group only (data.balance_vision_rows)
    per_group = (tr.grad_accum or 1) * max(dp // num_processes, 1)
    derived = {"seq_len": tr.seq_len, "batch_size": host_rows,
               "balance_group": host_rows // per_group if host_rows % per_group == 0 else 1}
    for key, value in derived.items():
        if key in raw and raw[key] != value:
            log.info("data.%s %s -> %s (derived from the train section)", key, raw[key], value)
    return {**raw, **derived}


def _layout_parts(raw: Mapping[str, Any], num_devices: int, num_processes: int,
                  errors: list[str]) -> tuple[Layout | None, int]:
    """The layout and its data-parallel size over ``num_devices`` (errors appended)."""

    layout = build(Layout, raw.get("layout"), "layout", errors)
    if layout is None:
        return None, 1
    try:
        shape = layout.resolved_mesh_shape(num_devices)
        if num_processes > 1 and "MOEVLM_HOST_ID" not in os.environ:  # a host per process: the mesh must spread
            layout.host_split(shape, num_processes)
        return layout, data_parallel_size(layout.rules, shape)
    except ValueError as e:
        errors.append(str(e))
        return None, 1


def build_run_config(raw: Mapping[str, Any], num_devices: int = 1, num_processes: int = 1) -> RunConfig:
    """Validate a resolved mapping (sections are mappings, not names) into a RunConfig, with every rule
    between sections checked; all problems in one ConfigError."""

    errors: list[str] = []
    for k in raw:
        if k not in SECTIONS:
            errors.append(f"unknown section '{k}'{near_miss(k, SECTIONS)} (sections: {', '.join(SECTIONS)})")
    raw = {k: v for k, v in raw.items() if k in SECTIONS}
    opt = build(OptimizerConfig, raw.get("optimizer"), "optimizer", errors)
    tr = build(TrainConfig, raw.get("train"), "train", errors)
    layout, dp = _layout_parts(raw, num_devices, num_processes, errors)
    data_raw = dict(raw.get("data") or {})
    given = tr
    if opt is not None and tr is not None:
        _cross_checks(opt, tr, errors)
        if layout is not None:  # the batch follows the layout's data-parallel size (unknown if it failed)
            tr = resolve_batch(tr, dp, errors)
        if layout is not None and not errors:  # a pipeline's microbatches follow the batch
            layout, fitted = fit_pipeline_batch(layout, tr, dp, num_devices, errors)
            if fitted is not tr:  # the split changed: config.yaml records it
                given = dataclasses.replace(given, micro_batch_size=fitted.micro_batch_size,
                                            grad_accum=fitted.grad_accum)
            tr = fitted
        if layout is not None and tr.global_batch_size is not None and tr.micro_batch_size is not None:
            data_raw = _derive_data(data_raw, tr, tr.global_batch_size, num_processes, dp, errors)
    model = build(model_config_type(raw.get("model")), raw.get("model"), "model", errors)  # the model family
    data = build(DataConfig, data_raw, "data", errors)
    compute = build(ComputeConfig, raw.get("compute"), "compute", errors)
    if model is not None and data is not None:
        errors += model_data_checks(model, data)
    if compute is not None and data is not None and compute.attention_options.vision_max_image_patches is None:
        compute = _with_image_bound(compute, data)
    if model is not None and layout is not None and tr is not None and not errors:
        try:  # the layout against the model and the batch shape, before anything compiles
            validate_layout(model, layout, batch_size=tr.micro_batch_size * dp, seq_len=tr.seq_len,
                            num_devices=num_devices)
        except LayoutError as e:
            errors.append(str(e))
    if compute is not None and layout is not None and not errors:
        errors += _experts_checks(compute, layout, layout.resolved_mesh_shape(num_devices))
    if tr is not None and tr.init_from and not Path(tr.init_from).expanduser().is_dir():
        errors.append(f"train.init_from: {tr.init_from} is not a Hugging Face model directory")
    if errors:
        raise_errors(errors)
    cfg = RunConfig(name=str(raw.get("name") or "run"), description=str(raw.get("description") or ""),
                    model=model, layout=layout, data=data, compute=compute, optimizer=opt, train=tr)
    cfg.data_parallel_size = dp
    # config.yaml keeps the batch as given (micro batch / accumulation null stay derived), with the global
    # batch fixed: resumed under another layout, the run trains on the same rows
    recorded = dataclasses.replace(cfg, train=dataclasses.replace(given, global_batch_size=tr.global_batch_size))
    cfg.resolved = {f.name: to_plain(getattr(recorded, f.name)) for f in dataclasses.fields(cfg) if f.init}
    return cfg


# ----------------------------------------------------------------------------- layering

def _dataset_path(ref: Any) -> tuple[str, dict[str, Any]] | None:
    """``(path, data.source)`` when ``--data`` names a dataset (a LLaVA file, ArrayRecord shards, an image
    folder) rather than a data config (a name in configs/data or a .yaml path)."""
    if not isinstance(ref, (str, Path)) or str(ref).endswith((".yaml", ".yml")):
        return None
    if "/" not in str(ref) and (CONFIG_DIR / "data" / f"{ref}.yaml").exists():
        return None

    try:
        source = dataset_source(ref)
    except DataError as e:
        raise ConfigError(str(e)) from None
    return None if source is None else (str(ref), source)


def _hf_config(ref: Any) -> Path | None:
    """The ``config.json`` of a model reference that names an HF model directory or the file itself, else None."""
    if not isinstance(ref, (str, Path)):
        return None
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model: {path} is a directory without config.json (an HF model directory holds one)")
        return path / "config.json"
    return path if path.suffix == ".json" and path.is_file() else None


def resumes(resume: bool | None, resume_step: int | None = None, overrides: Sequence[str] = ()) -> bool:
    """Whether a run continues from a checkpoint: ``--resume``, ``--resume-step N``, or ``train.resume`` /
    ``train.resume_step`` among the ``key=value`` overrides."""
    given = dict(parse_override(item) for item in overrides)
    return bool(resume or resume_step is not None or given.get("train.resume")
                or given.get("train.resume_step") is not None)


def resolve_raw(recipe: str | Path | None = None, *, model: str | None = None, layout: str | None = None,
                data: str | None = None, overrides: Sequence[str] = (), steps: int | None = None,
                run_dir: str | None = None, resume: bool | None = None, resume_step: int | None = None,
                platform: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The layered raw mapping of a run (recipe -> referenced files -> overrides), before any check
    or device query: ``(raw, sources)``; ``sources`` says which file each section came from. Resuming
    (:func:`resumes`) without a recipe starts from the run directory's ``config.yaml``, less the
    ``train.resume_step`` an earlier start asked for."""
    resuming = resumes(resume, resume_step, overrides)
    own = resuming and recipe is None and run_dir and (Path(run_dir) / "config.yaml").exists()
    if own:
        recipe = Path(run_dir) / "config.yaml"  # resuming: the run's own resolved config is the base
        log.info("resuming from %s", recipe)
    recipe = recipe if recipe is not None else default_recipe(platform)
    path = find_config("recipes", recipe)
    raw = read_yaml(path)
    if own and isinstance(raw.get("train"), dict):
        raw["train"].pop("resume_step", None)
    raw.setdefault("name", path.stem if path.name != "config.yaml" else path.parent.name)
    pairs = []
    for item in overrides:
        key, value = parse_override(item)
        if key in DERIVED:
            raise ConfigError(f"'{key}' is derived from the train section; set {DERIVED[key]} instead")
        if key.split(".")[0] not in SECTIONS:
            raise ConfigError(f"unknown setting '{key}'{near_miss(key.split('.')[0], SECTIONS)} "
                              f"(top-level sections: {', '.join(SECTIONS)})")
        pairs.append((key, value))
    refs = {"model": model, "layout": layout, "data": data}
    for key, value in pairs:  # 'model=proxy' is the same as --model proxy
        if key in REFERENCED and isinstance(value, str):
            refs[key] = value
    init_from = next((value for key, value in pairs if key == "train.init_from"), None)
    if init_from and refs["model"] is None and not resuming:  # fine-tuning an HF checkpoint: its architecture
        refs["model"] = str(init_from)
        log.info("model: %s's config.json (train.init_from; --model to take another)", init_from)
    sources: dict[str, str] = {"recipe": str(path)}
    dataset = _dataset_path(refs["data"])
    if dataset is not None:  # --data PATH: the recipe's data settings with this dataset as the source
        refs["data"] = None
    for section in REFERENCED:
        if refs[section] is not None:
            raw[section] = refs[section]
        hf = _hf_config(raw.get(section)) if section == "model" else None
        if hf is not None:  # an HF model directory or its config.json: HF's keys beyond ours are kept as extra
            raw[section] = to_plain(load_model_config(hf))
            sources[section] = str(hf)
            continue
        raw[section] = resolve_reference(section, raw.get(section), sources)
    if dataset is not None:
        where, source = dataset
        raw["data"] = {**raw["data"], "name": Path(where).name, "source": source}
        sources["data"] = where
    for key, value in pairs:
        if key in REFERENCED and isinstance(value, str):
            continue
        set_dotted(raw, key, value)
    train = dict(raw.get("train") or {})
    if steps is not None:
        train["steps"] = steps
    if run_dir is not None:
        train["run_dir"] = str(run_dir)
    if resume is not None:
        train["resume"] = bool(resume)
    if resume_step is not None:
        train["resume_step"] = resume_step
    raw["train"] = train
    return raw, sources


def load_config(recipe: str | Path | None = None, *, model: str | None = None, layout: str | None = None,
                data: str | None = None, overrides: Sequence[str] = (), steps: int | None = None,
                run_dir: str | None = None, resume: bool | None = None, resume_step: int | None = None,
                num_devices: int | None = None, num_processes: int | None = None,
                platform: str | None = None) -> RunConfig:
    """Defaults -> recipe -> model/layout/data files -> ``key=value`` overrides, validated."""
    raw, sources = resolve_raw(recipe, model=model, layout=layout, data=data, overrides=overrides, steps=steps,
                               run_dir=run_dir, resume=resume, resume_step=resume_step, platform=platform)
    if num_devices is None or num_processes is None:

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
    """Add --recipe/--model/--layout/--data/--steps/--run-dir/--resume/--resume-step and key=value overrides."""
    parser.add_argument("--recipe", help="configs/recipes/NAME.yaml or a path (default: by platform)")
    parser.add_argument("--model", help="configs/models/NAME.yaml or a path")
    parser.add_argument("--layout", help="configs/layouts/NAME.yaml or a path")
    parser.add_argument("--data", help="configs/data/NAME.yaml or a path")
    parser.add_argument("--steps", type=int, help="train.steps")
    parser.add_argument("--run-dir", help="train.run_dir")
    parser.add_argument("--resume", action="store_true", default=None,
                        help="train.resume: continue from the newest checkpoint in the run dir that restores")
    parser.add_argument("--resume-step", type=int, metavar="N",
                        help="train.resume_step: continue from exactly checkpoint N (implies --resume)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="any setting by dotted path, e.g. optimizer.lr=1e-4 train.grad_accum=4 "
                             "(--help-config lists them all)")


def from_args(args: argparse.Namespace, num_devices: int | None = None) -> RunConfig:
    """RunConfig from the arguments :func:`add_arguments` defined."""
    return load_config(args.recipe, model=args.model, layout=args.layout, data=args.data,
                       overrides=args.overrides, steps=args.steps, run_dir=args.run_dir,
                       resume=args.resume, resume_step=args.resume_step, num_devices=num_devices)
