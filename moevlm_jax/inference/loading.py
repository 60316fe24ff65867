"""Models for generation: an HF directory (``moevlm_jax.hf.load_pretrained``) or a training run's
checkpoint (its ``config.yaml`` model + compute + data sections and the orbax ``state`` item's
``params`` only, restored onto one device whatever layout the run trained under).

Generation uses the run's compute settings except what only training needs or what would change
the result: dropless experts (no capacity factor), no recompute / offload.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from moevlm_jax.config import ConfigError, load_section
from moevlm_jax.data.config import DataConfig, ImageConfig, VideoConfig
from moevlm_jax.data.tokenizer import Tokenizer, load_tokenizer
from moevlm_jax.hf import load_pretrained
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import ModelConfig
from moevlm_jax.model.qwen3_vl_moe import Qwen3VLMoe
from moevlm_jax.model.registry import build_model
from moevlm_jax.model.router import ExpertBias
from moevlm_jax.schema import read_yaml
from moevlm_jax.training import checkpoint as training_checkpoint

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Loaded:
    """A model ready for ``inference.generate`` with the tokenizer, image processing and system
    prompt its data used; ``source`` says where it came from, ``step`` the checkpoint step."""

    model: Qwen3VLMoe
    config: ModelConfig
    tokenizer: Tokenizer
    image_config: ImageConfig
    system_prompt: str | None = None
    source: str = ""
    step: int | None = None
    video_config: VideoConfig = dataclasses.field(default_factory=VideoConfig)


def generation_compute(compute: ComputeConfig, dtype: str | None = None) -> ComputeConfig:
    """``compute`` for generation: dropless experts (a capacity factor would drop tokens by batch
    composition), the drop-and-pad backends replaced by ``auto``, no recompute or offload (no
    backward), the dispatcher ``auto`` (local on one device); ``dtype`` overrides the compute dtype."""
    moe = compute.moe
    backend = "auto" if moe.backend in ("capacity", "hybrid") else moe.backend
    moe = dataclasses.replace(moe, capacity_factor=None, backend=backend, dispatcher="auto")
    changes: dict[str, Any] = dict(moe=moe, recompute="none", offload=(), vision_recompute=None,
                                   vision_recompute_modules=None)
    if dtype is not None:
        changes["dtype"] = dtype
    return compute.replace(**changes)


def model_for_generation(config: ModelConfig, compute: ComputeConfig, params: Any, *,
                         dtype: str | None = None) -> Qwen3VLMoe:
    """The model of ``config`` under ``generation_compute(compute, dtype)`` holding ``params`` (the
    train state's ``params`` pure dict, any sharding, e.g. the trainer's at the end of a run)."""
    compute = generation_compute(compute, dtype)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Qwen3VLMoe(config, compute, nnx.Rngs(0))))
    return nnx.merge(graphdef, params)


def default_dtype() -> str:
    """bfloat16 on a GPU, float32 elsewhere."""
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def image_config_from_hf(path: Path) -> ImageConfig:
    """Image processing from an HF directory's ``preprocessor_config.json`` (Qwen3-VL keys: ``size``
    {shortest_edge, longest_edge} or min/max_pixels, patch_size, merge_size, temporal_patch_size,
    image_mean, image_std); the defaults (Qwen3-VL's) without one."""
    file = path / "preprocessor_config.json"
    if not file.exists():
        return ImageConfig()
    raw = json.loads(file.read_text())
    size = raw.get("size") or {}
    changes = {
        "min_pixels": raw.get("min_pixels", size.get("shortest_edge")),
        "max_pixels": raw.get("max_pixels", size.get("longest_edge")),
        "patch_size": raw.get("patch_size"), "merge_size": raw.get("merge_size"),
        "temporal_patch_size": raw.get("temporal_patch_size"),
        "image_mean": tuple(raw["image_mean"]) if "image_mean" in raw else None,
        "image_std": tuple(raw["image_std"]) if "image_std" in raw else None,
    }
    return dataclasses.replace(ImageConfig(), **{k: v for k, v in changes.items() if v is not None})


def video_config_from_hf(path: Path) -> VideoConfig:
    """Video sampling from an HF directory's ``video_preprocessor_config.json`` (Qwen3-VL keys: ``fps``,
    ``min_frames``, ``max_frames``, ``size`` {shortest_edge, longest_edge}); the defaults (Qwen3-VL's) without one."""
    file = path / "video_preprocessor_config.json"
    if not file.exists():
        return VideoConfig()
    raw = json.loads(file.read_text())
    size = raw.get("size") or {}
    changes = {"fps": raw.get("fps"), "min_frames": raw.get("min_frames"), "max_frames": raw.get("max_frames"),
               "min_pixels": size.get("shortest_edge"), "max_pixels": size.get("longest_edge")}
    return dataclasses.replace(VideoConfig(), **{k: v for k, v in changes.items() if v is not None})


def hf_tokenizer_spec(path: Path) -> str:
    """The HF directory's ``tokenizer.json`` when it has one, else the offline Qwen3 tokenizer."""
    return str(path / "tokenizer.json") if (path / "tokenizer.json").exists() else "qwen3"


def load_hf(path: str | Path, *, dtype: str | None = None, compute: ComputeConfig | None = None,
            tokenizer: str | None = None) -> Loaded:
    """An HF model directory -> Loaded (parameters and compute in ``dtype``, default bfloat16 on a
    GPU and float32 elsewhere; ``compute`` overrides the other compute settings)."""

    path = Path(path)
    dtype = dtype or (compute.dtype if compute is not None else default_dtype())
    compute = generation_compute(compute or ComputeConfig(), dtype).replace(param_dtype=dtype)
    model, config = load_pretrained(path, jnp.dtype(dtype), compute=compute)
    tok = load_tokenizer(tokenizer or hf_tokenizer_spec(path))
    return Loaded(model, config, tok, image_config_from_hf(path), None, str(path),
                  video_config=video_config_from_hf(path))


def run_sections(run_dir: str | Path) -> tuple[ModelConfig, ComputeConfig, DataConfig | None]:
    """The model, compute and data sections of a run's ``config.yaml`` (each section alone: no check
    against the devices of this process, so a run of any layout loads anywhere)."""

    file = Path(run_dir) / "config.yaml"
    if not file.exists():
        raise FileNotFoundError(f"{run_dir} has no config.yaml (not a training run directory)")
    raw = read_yaml(file)
    model = load_section("model", raw.get("model"))
    compute = load_section("compute", raw.get("compute") or {})
    try:
        data = load_section("data", raw.get("data") or {})
    except ConfigError as e:  # only the tokenizer, image processing and system prompt are needed
        log.warning("%s: data section unusable (%s); default tokenizer and image processing", file, e)
        data = None
    return model, compute, data


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Finished checkpoint steps of a run, ascending."""
    ckpt = Path(run_dir) / "checkpoints"
    return [s for s in training_checkpoint.checkpoint_steps(ckpt) if (ckpt / str(s) / "state").is_dir()]


def restore_params(state_dir: str | Path, abstract_params: Any, device: jax.Device | None = None) -> Any:
    """The ``params`` subtree of a saved train state (orbax ``state`` item directory), partially
    restored (the optimizer state is never read) onto one device, in ``abstract_params``'s dtypes."""
    import orbax.checkpoint as ocp

    device = device or jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), abstract_params)
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        out = ckptr.restore(Path(state_dir).absolute(), args=ocp.args.PyTreeRestore(
            item={"params": target}, restore_args={"params": restore_args}, partial_restore=True))
    return out["params"]


def restore_run(run_dir: str | Path, step: int | None = None) -> tuple[Any, ComputeConfig, DataConfig | None, int, Any]:
    """(model config, compute, data, step, params) of checkpoint ``step`` of a training run (default: the
    newest that restores; a damaged newer one is skipped with one log line and left on disk; a ``step``
    given that does not restore is a ``RestoreError``): the ``params`` of its train state on one device, in
    the dtype they were saved in, whatever layout or process count wrote them."""

    run_dir = Path(run_dir)
    where = run_dir / "checkpoints"
    model_cfg, compute, data = run_sections(run_dir)
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {where}")
    if step is not None and int(step) not in steps:
        raise FileNotFoundError(f"no checkpoint for step {step} in {where}; have {steps}")
    abstract = nnx.eval_shape(lambda: build_model(model_cfg, compute, nnx.Rngs(0)))
    abstract_params = nnx.to_pure_dict(nnx.state(abstract, (nnx.Param, ExpertBias)))  # the train state's params

    def restore(s: int) -> Any:
        return restore_params(where / str(s) / "state", abstract_params)

    if step is not None:
        return model_cfg, compute, data, int(step), training_checkpoint.restore_exactly(restore, int(step), str(where))
    step, params, _ = training_checkpoint.first_restorable(steps, restore, str(where))
    return model_cfg, compute, data, step, params


def load_run(run_dir: str | Path, step: int | None = None, *, dtype: str | None = None,
             tokenizer: str | None = None) -> Loaded:
    """A training run directory -> Loaded: the model of its ``config.yaml`` with the ``params`` of
    checkpoint ``step`` (default: the newest that restores), on one device. ``dtype``: the compute dtype (default
    the run's); parameters keep the dtype they were saved in."""
    run_dir = Path(run_dir)
    model_cfg, compute, data, step, params = restore_run(run_dir, step)
    model = model_for_generation(model_cfg, compute, params, dtype=dtype)
    tok = load_tokenizer(tokenizer or (data.tokenizer if data is not None else "qwen3"))
    image_cfg = data.image if data is not None else ImageConfig()
    log.info("loaded %s step %d (%s)", run_dir, step, model_cfg.name or "model")
    return Loaded(model, model_cfg, tok, image_cfg, data.system_prompt if data is not None else None,
                  str(run_dir), step, data.video if data is not None else VideoConfig())
