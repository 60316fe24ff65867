"""Reading and writing HF model directories through the ``safetensors`` library.

:func:`load_pretrained` first maps every tensor to its file from the headers alone, then fills one
parameter at a time, reading its tensors one by one (for a stacked parameter, one layer each into its
``[L, ...]`` host buffer) and handing it to JAX, which frees the host copy, before the next: at most
one parameter plus one tensor in host memory. :func:`save_pretrained` builds one shard at a time (at most
``max_shard_bytes`` of tensors, or one larger tensor), writes it with
:func:`safetensors.numpy.save_file` and drops it before building the next.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy
from flax import nnx

from moevlm_jax.hf import names
from moevlm_jax.hf.errors import CheckpointError
from moevlm_jax.hf.names import Entry, check_expert_layout
from moevlm_jax.model import registry
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import ModelConfig
from moevlm_jax.model.qwen3_5_config import Qwen35ModelConfig
from moevlm_jax.model.qwen3_5_moe import Qwen35Moe
from moevlm_jax.model.qwen3_vl_moe import Qwen3VLMoe
from moevlm_jax.model.router import ExpertBias

log = logging.getLogger(__name__)

_FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16"})
_INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header


# ----------------------------------------------------------------------------------------------
# model families: the registry (moevlm_jax.model.registry) picks the model class and name table
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Family:
    """What differs between the model families here: the model class and the name / layout table."""

    model: type
    entries: Callable[[Any], list[Entry]]
    to_ours: Callable[..., np.ndarray]
    to_hf: Callable[..., np.ndarray]
    hf_out_shape: Callable[..., tuple[int, ...]]
    ignored_prefixes: tuple[str, ...] = ()  # HF tensors skipped on load (transformers skips them too)


def _family(config: Any) -> _Family:
    table = registry.hf_table(config)
    return _Family(registry.model_class(config), table.checkpoint_entries, table.to_ours, table.to_hf,
                   table.hf_out_shape, tuple(getattr(table, "IGNORED_PREFIXES", ())))


def checkpoint_entries(config: Any) -> list[Entry]:
    """The HF tensor table of any family's config (``hf.names`` / ``hf.qwen3_5_names``, by the registry)."""
    return registry.checkpoint_entries(config)


def _index(layer: Any) -> Any:
    """An Entry's ``layer`` as a numpy index: an int, or a tuple with None for a whole axis."""
    if isinstance(layer, tuple):
        return tuple(slice(None) if i is None else i for i in layer)
    return layer


def _indexed_shape(shape: tuple[int, ...], layer: Any) -> tuple[int, ...]:
    """The shape of ``parameter[layer]`` for a parameter of ``shape`` (no memory touched)."""
    return np.broadcast_to(np.zeros((), np.int8), shape)[_index(layer)].shape


# ----------------------------------------------------------------------------------------------
# safetensors files
# ----------------------------------------------------------------------------------------------


class SafetensorsFile:
    """One ``.safetensors`` file opened with :func:`safetensors.safe_open` (memory-mapped, read lazily):
    ``keys()``, ``info(key)``, ``get(key)``; whatever safetensors raises becomes a CheckpointError
    naming the file. Use as a context manager to release the mapping."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._file = safetensors.safe_open(str(self.path), framework="numpy")
        except (OSError, safetensors.SafetensorError) as e:
            raise CheckpointError(_overrun(self.path) or f"unreadable safetensors file {self.path}: {e}") from e

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._file.__exit__(typ, exc, tb)

    def keys(self) -> list[str]:
        """Tensor names (safetensors lists them sorted)."""
        return list(self._file.keys())

    def info(self, key: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype code, e.g. ``"BF16"``, shape) of ``key``, without reading its data."""
        try:
            s = self._file.get_slice(key)
            return s.get_dtype(), tuple(s.get_shape())
        except safetensors.SafetensorError as e:
            raise CheckpointError(f"tensor {key} in {self.path}: {e}") from e

    def get(self, key: str) -> np.ndarray:
        """The tensor ``key`` as a numpy array of its stored shape (its own host copy; bf16 via ml_dtypes)."""
        try:
            return self._file.get_tensor(key)
        except (safetensors.SafetensorError, TypeError, ValueError) as e:
            raise CheckpointError(f"tensor {key} in {self.path}: {e}") from e


def _overrun(path: Path) -> str | None:
    """For a file safetensors refused: "tensor ... data offsets ..." for the first tensor whose data runs
    past the end of the file (a truncated file), else None."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(size - 8, _MAX_HEADER):
                return None
            header = json.loads(f.read(n))
        for key, h in header.items():
            start, end = (h["data_offsets"] if key != "__metadata__" else (0, 0))
            if 8 + n + end > size:
                return (f"tensor {key} in {path}: data offsets {start}..{end} run past the {max(size - 8 - n, 0)} "
                        f"data bytes of the file (truncated file?)")
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return None


def _save_file(tensors: dict[str, np.ndarray], path: Path) -> None:
    """Write ``tensors`` to ``path`` atomically (a temp name, then ``os.replace``)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        safetensors.numpy.save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a temp name, then ``os.replace``)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _checkpoint_files(path: Path) -> list[Path]:
    """The ``*.safetensors`` files of ``path``: those the index names, else all of them."""
    index = path / _INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"unreadable index {index}: {e}") from e
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    for f in files:
        if not f.exists():
            raise CheckpointError(f"unreadable safetensors file {f}: listed in the index but missing")
    return files


def _locate(path: Path, config: ModelConfig, entries: dict[str, Entry],
            files: list[SafetensorsFile], ignored: tuple[str, ...] = ()) -> dict[str, SafetensorsFile]:
    """The file holding each tensor of ``entries`` (from the headers alone); CheckpointError for an
    unexpected, duplicated or missing tensor."""
    where: dict[str, SafetensorsFile] = {}
    for st in files:
        for key in st.keys():
            if key not in entries:
                if key == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: transformers ignores it too
                if key.startswith(ignored):
                    continue  # e.g. Qwen3.5's mtp.* weights: not part of the model
                raise CheckpointError(f"unexpected tensor {key} in {st.path} "
                                      f"(not part of {config.name or 'this'} model)")
            if key in where:
                raise CheckpointError(f"tensor {key} appears twice (again in {st.path})")
            where[key] = st
    missing = [k for k in entries if k not in where]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        also = f" (also {missing[1:5]}{more})" if len(missing) > 1 else ""
        raise CheckpointError(f"missing tensor {missing[0]} in {path}{also}")
    return where


# ----------------------------------------------------------------------------------------------
# load / save
# ----------------------------------------------------------------------------------------------


def abstract_model(config: ModelConfig | Qwen35ModelConfig,
                   compute: ComputeConfig | None = None) -> Qwen3VLMoe | Qwen35Moe:
    """The model (of the config's family) with ShapeDtypeStruct parameters (no memory allocated)."""
    model = _family(config).model
    return nnx.eval_shape(lambda: model(config, compute or ComputeConfig(), nnx.Rngs(0)))


def load_pretrained(path: str | Path, dtype: Any = jnp.float32, *, compute: ComputeConfig | None = None,
                    expert_layout: str = "auto") -> tuple[Qwen3VLMoe | Qwen35Moe, ModelConfig | Qwen35ModelConfig]:
    """(model, config) from an HF model directory, of the family config.json's ``model_type`` names
    (``qwen3_5_moe``: Qwen35Moe, else Qwen3VLMoe); parameters in ``dtype``. ``compute`` defaults to
    ``dtype`` compute; ``expert_layout`` ("auto" | "hub" | "transformers") decides only tensors whose
    two layouts have the same shape ("auto" reads them as transformers does)."""
    check_expert_layout(expert_layout)
    path = Path(path)
    config = registry.load_model_config(path)
    family = _family(config)
    name = jnp.dtype(dtype).name
    compute = compute or ComputeConfig(dtype=name, param_dtype=name)
    if compute.param_dtype != name:
        compute = compute.replace(param_dtype=name)
    model = abstract_model(config, compute)
    graphdef, state = nnx.split(model)
    variables = dict(nnx.to_flat_state(state))
    for vpath, var in list(variables.items()):
        if isinstance(var, ExpertBias):  # router state HF checkpoints do not have: starts at zero
            var.set_value(jnp.zeros(var.get_value().shape, var.get_value().dtype))
            del variables[vpath]
    entries = {e.hf_key: e for e in family.entries(config)}
    unmapped = set(variables) - {e.path for e in entries.values()}
    if unmapped:  # the name table must cover every parameter of the model
        raise RuntimeError(f"parameters with no HF tensor: {sorted('.'.join(map(str, p)) for p in unmapped)}")
    np_dtype = np.dtype(jnp.dtype(dtype))
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(SafetensorsFile(f)) for f in _checkpoint_files(path)]
        where = _locate(path, config, entries, files, family.ignored_prefixes)
        by_param: dict[tuple[Any, ...], list[Entry]] = collections.defaultdict(list)
        for e in entries.values():
            by_param[e.path].append(e)
        for vpath, param_entries in by_param.items():  # one parameter in host memory at a time
            var = variables[vpath]
            shape = tuple(var.get_value().shape)
            buffer: np.ndarray | None = None if param_entries[0].layer is None else np.empty(shape, np_dtype)
            for e in param_entries:
                st = where[e.hf_key]
                code, _ = st.info(e.hf_key)
                if code not in _FLOAT_CODES:
                    raise CheckpointError(f"tensor {e.hf_key} in {st.path} has dtype {code}, expected a floating dtype")
                target = shape if e.layer is None else _indexed_shape(shape, e.layer)
                w = family.to_ours(e, st.get(e.hf_key), target, expert_layout).astype(np_dtype, copy=False)
                if buffer is None:
                    buffer = w
                else:
                    buffer[_index(e.layer)] = w
                del w
            var.set_value(jnp.asarray(buffer))  # parameter complete: hand it to JAX, free the host copy
            del buffer
    log.info("loaded %d tensors from %s", len(entries), path)
    return nnx.merge(graphdef, state), config


def _hf_tensor(e: Entry, value: jax.Array, shape: tuple[int, ...], expert_layout: str,
               to_hf: Callable[..., np.ndarray] = names.to_hf) -> np.ndarray:
    """HF tensor ``e`` (``shape``, contiguous, on the host) from our parameter ``value`` ([L, ...] if stacked)."""
    a = np.asarray(jax.device_get(value if e.layer is None else value[_index(e.layer)]))
    out = np.ascontiguousarray(to_hf(e, a, expert_layout))
    if out.shape != shape:
        raise RuntimeError(f"{e.hf_key}: produced shape {out.shape}, the table says {shape}")
    return out


def save_pretrained(model: Qwen3VLMoe | Qwen35Moe, config: ModelConfig | Qwen35ModelConfig, path: str | Path, *,
                    max_shard_bytes: int = 5 * 2**30, expert_layout: str = "auto") -> None:
    """Write an HF model directory (config.json + safetensors shards + index) that transformers
    loads. Experts go in the hub layout [E, H, 2I] / [E, I, H] ("auto": except tensors whose two
    layouts have the same shape, written as transformers keeps them), or all "hub" / "transformers"."""
    check_expert_layout(expert_layout)
    family = _family(config)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    variables = dict(nnx.to_flat_state(nnx.state(model)))
    if any(isinstance(v, ExpertBias) and bool(np.any(np.asarray(jax.device_get(v[...])) != 0))
           for v in variables.values()):
        log.warning("save_pretrained: the model's expert_bias (aux-loss-free routing) is not part of the HF "
                    "format and is dropped; HF routing of these weights differs from this model's")
    # plan the shards from shapes alone: (entry, HF shape, dtype, bytes)
    plan: list[tuple[Entry, tuple[int, ...], np.dtype, int]] = []
    for e in family.entries(config):
        if e.path not in variables:
            raise CheckpointError(f"model has no parameter {'.'.join(map(str, e.path))} for tensor {e.hf_key}")
        dtype = np.dtype(variables[e.path][...].dtype)
        shape = family.hf_out_shape(e, expert_layout)
        plan.append((e, shape, dtype, math.prod(shape) * dtype.itemsize))
    shards: list[list[tuple[Entry, tuple[int, ...], np.dtype, int]]] = [[]]
    size = 0
    for t in plan:
        if shards[-1] and size + t[3] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t[3]
    for old in list(path.glob("*.safetensors")) + list(path.glob(_INDEX)):
        old.unlink()
    names = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for fname, shard in zip(names, shards):  # one shard's tensors in host memory at a time
        tensors = {e.hf_key: _hf_tensor(e, variables[e.path][...], shape, expert_layout, family.to_hf)
                   for e, shape, _, _ in shard}
        _save_file(tensors, path / fname)
        del tensors
    if len(shards) > 1:
        weight_map = {e.hf_key: fname for fname, shard in zip(names, shards) for e, _, _, _ in shard}
        index = {"metadata": {"total_size": sum(t[3] for t in plan)}, "weight_map": weight_map}
        _write_text(path / _INDEX, json.dumps(index, indent=2))
    dtype_name = plan[0][2].name if plan else "float32"
    _write_text(path / "config.json", json.dumps(config.to_hf_dict(dtype=dtype_name), indent=2))
    log.info("saved %d tensors in %d file(s) to %s", len(plan), len(shards), path)
