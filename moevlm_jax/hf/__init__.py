"""Hugging Face checkpoint import / export for Qwen3-VL-MoE.

``load_pretrained(path)`` reads an HF model directory (config.json + one or many ``*.safetensors``,
with or without ``model.safetensors.index.json``), streaming tensor by tensor into a
:class:`~moevlm_jax.model.qwen3_vl_moe.Qwen3VLMoe`. ``save_pretrained(model, config, path)`` writes a
directory that ``transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained`` loads.

The name mapping is a table (:func:`checkpoint_entries`): one row per HF tensor with our parameter
path, the layer index inside a stacked parameter, and how the layout changes. Fused experts are
accepted in either layout: the hub's ``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]`` (ours,
with gate_up as ``[E, H, 2, I]``) or transformers v5's in-memory ``[E, 2I, H]`` / ``[E, H, I]``;
where both have the same shape (H == 2I, or I == H) the tensor is read as transformers does, i.e.
in its v5 layout.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from moevlm_jax.model.config import ComputeConfig, ModelConfig, load_model_config
from moevlm_jax.model.decoder import layer_groups
from moevlm_jax.model.qwen3_vl_moe import Qwen3VLMoe
from moevlm_jax.model.router import ExpertBias

log = logging.getLogger(__name__)

_ST_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_FLOAT_CODES = {"F64", "F32", "F16", "BF16"}
_CODE_OF = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor (or file) at fault."""


# ----------------------------------------------------------------------------------------------
# safetensors: a minimal streaming reader / writer (numpy + ml_dtypes; bf16 without torch)
# ----------------------------------------------------------------------------------------------


class SafetensorsFile:
    """Lazy reader of one ``.safetensors`` file: ``keys()``, ``info(key)``, ``get(key)``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if size < 8 or n <= 0 or 8 + n > size:
                    raise ValueError(f"header length {n} does not fit a file of {size} bytes")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"unreadable safetensors file {self.path}: {e}") from e
        self.metadata = header.pop("__metadata__", None) or {}
        self.header = header
        self.data_start = 8 + n
        self.data_size = size - self.data_start
        self._mm: np.memmap | None = None

    def keys(self) -> list[str]:
        """Tensor names in file order."""
        return list(self.header)

    def info(self, key: str) -> tuple[str, tuple[int, ...]]:
        """(safetensors dtype code, shape) of ``key``."""
        h = self.header[key]
        return h["dtype"], tuple(h["shape"])

    def get(self, key: str) -> np.ndarray:
        """The tensor ``key`` as a numpy array (a view of the memory-mapped file)."""
        code, shape = self.info(key)
        if code not in _ST_DTYPES:
            raise CheckpointError(f"tensor {key} in {self.path}: unsupported dtype {code}")
        dtype = _ST_DTYPES[code]
        start, end = self.header[key]["data_offsets"]
        if not 0 <= start <= end <= self.data_size or end - start != math.prod(shape) * dtype.itemsize:
            raise CheckpointError(f"tensor {key} in {self.path}: data offsets {start}..{end} do not match "
                                  f"shape {list(shape)} {code} inside {self.data_size} data bytes (truncated file?)")
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        raw = self._mm[self.data_start + start : self.data_start + end]
        return raw.view(dtype).reshape(shape)


def write_safetensors(path: str | Path, tensors: list[tuple[str, tuple[int, ...], np.dtype, Any]]) -> None:
    """Write ``(name, shape, dtype, make_array)`` tensors to ``path``, calling each ``make_array()``
    only when its bytes are written (one tensor in host memory at a time)."""
    header, offset = {}, 0
    for name, shape, dtype, _ in tensors:
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _CODE_OF[np.dtype(dtype)], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape, dtype, make in tensors:
            a = np.ascontiguousarray(make())
            if a.shape != tuple(shape) or a.dtype != np.dtype(dtype):
                raise RuntimeError(f"{name}: produced {a.shape} {a.dtype}, header says {shape} {dtype}")
            f.write(a.tobytes())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# The name / layout table
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """One HF tensor: its name, our parameter path, the stacked-layer index (or None), how the
    layout changes (``linear``: HF [out, in] <-> our kernel [in..., out...]; ``reshape``; ``gate_up`` /
    ``down``: fused experts) and its HF shape (hub layout for experts)."""

    hf_key: str
    path: tuple[Any, ...]
    layer: int | None
    kind: str
    hf_shape: tuple[int, ...]


def checkpoint_entries(config: ModelConfig) -> list[Entry]:
    """Every HF tensor of ``config``'s model, in HF state-dict order."""
    v, t = config.vision_config, config.text_config
    c, ci, cbig = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
    out: list[Entry] = []

    def add(key, path, kind, shape, layer=None):
        out.append(Entry(key, tuple(path), layer, kind, tuple(shape)))

    def linear(key, path, o, i, layer=None, bias=True):
        add(f"{key}.weight", (*path, "kernel"), "linear", (o, i), layer)
        if bias:
            add(f"{key}.bias", (*path, "bias"), "reshape", (o,), layer)

    def norm(key, path, n, layer=None, bias=True):
        add(f"{key}.weight", (*path, "scale"), "reshape", (n,), layer)
        if bias:
            add(f"{key}.bias", (*path, "bias"), "reshape", (n,), layer)

    pv = "model.visual"
    add(f"{pv}.patch_embed.proj.weight", ("visual", "patch_embed", "kernel"), "linear",
        (c, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size))
    add(f"{pv}.patch_embed.proj.bias", ("visual", "patch_embed", "bias"), "reshape", (c,))
    add(f"{pv}.pos_embed.weight", ("visual", "pos_embed"), "reshape", (v.num_position_embeddings, c))
    for i in range(v.depth):
        b, p = f"{pv}.blocks.{i}", ("visual", "blocks")
        norm(f"{b}.norm1", (*p, "norm1"), c, i)
        norm(f"{b}.norm2", (*p, "norm2"), c, i)
        linear(f"{b}.attn.qkv", (*p, "attn", "qkv"), 3 * c, c, i)
        linear(f"{b}.attn.proj", (*p, "attn", "proj"), c, c, i)
        linear(f"{b}.mlp.linear_fc1", (*p, "mlp", "linear_fc1"), ci, c, i)
        linear(f"{b}.mlp.linear_fc2", (*p, "mlp", "linear_fc2"), c, ci, i)
    norm(f"{pv}.merger.norm", ("visual", "merger", "norm"), c)
    linear(f"{pv}.merger.linear_fc1", ("visual", "merger", "linear_fc1"), cbig, cbig)
    linear(f"{pv}.merger.linear_fc2", ("visual", "merger", "linear_fc2"), v.out_hidden_size, cbig)
    for j in range(len(v.deepstack_visual_indexes)):
        b, p = f"{pv}.deepstack_merger_list.{j}", ("visual", "deepstack_merger_list")
        norm(f"{b}.norm", (*p, "norm"), cbig, j)
        linear(f"{b}.linear_fc1", (*p, "linear_fc1"), cbig, cbig, j)
        linear(f"{b}.linear_fc2", (*p, "linear_fc2"), v.out_hidden_size, cbig, j)

    pt, h, d = "model.language_model", t.hidden_size, t.head_dim
    add(f"{pt}.embed_tokens.weight", ("language_model", "embed_tokens"), "reshape", (t.vocab_size, h))
    for g, (kind, first, n) in enumerate(layer_groups(t.layer_kinds)):
        for li in range(n):
            b, p = f"{pt}.layers.{first + li}", ("language_model", "stacks", g)
            a, ab = (*p, "self_attn"), t.attention_bias
            linear(f"{b}.self_attn.q_proj", (*a, "q_proj"), t.num_attention_heads * d, h, li, ab)
            linear(f"{b}.self_attn.k_proj", (*a, "k_proj"), t.num_key_value_heads * d, h, li, ab)
            linear(f"{b}.self_attn.v_proj", (*a, "v_proj"), t.num_key_value_heads * d, h, li, ab)
            linear(f"{b}.self_attn.o_proj", (*a, "o_proj"), h, t.num_attention_heads * d, li, ab)
            norm(f"{b}.self_attn.q_norm", (*a, "q_norm"), d, li, bias=False)
            norm(f"{b}.self_attn.k_norm", (*a, "k_norm"), d, li, bias=False)
            if kind == "moe":
                e, i = t.num_experts, t.moe_intermediate_size
                add(f"{b}.mlp.experts.gate_up_proj", (*p, "mlp", "gate_up_proj"), "gate_up", (e, h, 2 * i), li)
                add(f"{b}.mlp.experts.down_proj", (*p, "mlp", "down_proj"), "down", (e, i, h), li)
                linear(f"{b}.mlp.gate", (*p, "mlp", "gate"), e, h, li, bias=False)
            else:
                for name, o, i in (("gate_proj", t.intermediate_size, h), ("up_proj", t.intermediate_size, h),
                                   ("down_proj", h, t.intermediate_size)):
                    linear(f"{b}.mlp.{name}", (*p, "mlp", name), o, i, li, bias=False)
            norm(f"{b}.input_layernorm", (*p, "input_layernorm"), h, li, bias=False)
            norm(f"{b}.post_attention_layernorm", (*p, "post_attention_layernorm"), h, li, bias=False)
    norm(f"{pt}.norm", ("language_model", "norm"), h, bias=False)
    if not config.tie_word_embeddings:
        linear("lm_head", ("lm_head",), t.vocab_size, h, bias=False)
    return out


def _transformers_shape(e: Entry) -> tuple[int, ...]:
    ex, a, b = e.hf_shape
    return (ex, b, a)  # [E, H, 2I] <-> [E, 2I, H]; [E, I, H] <-> [E, H, I]


def _to_ours(e: Entry, w: np.ndarray, target: tuple[int, ...], expert_layout: str) -> np.ndarray:
    """HF tensor -> our layout (shape ``target``); raises CheckpointError on a shape mismatch."""
    if e.kind in ("gate_up", "down"):  # our gate_up is [E, H, 2, I]: the hub's [E, H, 2I] split
        hub, tf = e.hf_shape, _transformers_shape(e)
        if w.shape == hub and (hub != tf or expert_layout == "hub"):
            return w.reshape(target)
        if w.shape == tf:
            return w.transpose(0, 2, 1).reshape(target)
        raise CheckpointError(f"tensor {e.hf_key} has shape {list(w.shape)}, expected {list(hub)} (hub layout) "
                              f"or {list(tf)} (transformers layout)")
    if w.shape != e.hf_shape:
        raise CheckpointError(f"tensor {e.hf_key} has shape {list(w.shape)}, expected {list(e.hf_shape)}")
    if e.kind == "linear":
        return w.reshape(w.shape[0], -1).T.reshape(target)
    return w.reshape(target)


def _to_hf(e: Entry, a: np.ndarray, expert_layout: str) -> np.ndarray:
    """Our array (one layer) -> the HF tensor."""
    if e.kind in ("gate_up", "down"):
        a = a.reshape(e.hf_shape)  # [E, H, 2, I] -> the hub's [E, H, 2I]
        return a if _hub_layout(e, expert_layout) else a.transpose(0, 2, 1)
    if e.kind == "linear":
        return a.reshape(-1, e.hf_shape[0]).T.reshape(e.hf_shape)
    return a.reshape(e.hf_shape)


def _hub_layout(e: Entry, expert_layout: str) -> bool:
    if expert_layout == "hub":
        return True
    if expert_layout == "transformers":
        return False
    return e.hf_shape != _transformers_shape(e)  # auto: hub unless transformers would misread it


def _hf_shape_out(e: Entry, expert_layout: str) -> tuple[int, ...]:
    if e.kind in ("gate_up", "down") and not _hub_layout(e, expert_layout):
        return _transformers_shape(e)
    return e.hf_shape


# ----------------------------------------------------------------------------------------------
# load / save
# ----------------------------------------------------------------------------------------------


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
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


def abstract_model(config: ModelConfig, compute: ComputeConfig | None = None) -> Qwen3VLMoe:
    """The model with ShapeDtypeStruct parameters (no memory allocated)."""
    return nnx.eval_shape(lambda: Qwen3VLMoe(config, compute or ComputeConfig(), nnx.Rngs(0)))


def load_pretrained(path: str | Path, dtype: Any = jnp.float32, *, compute: ComputeConfig | None = None,
                    expert_layout: str = "auto") -> tuple[Qwen3VLMoe, ModelConfig]:
    """(model, config) from an HF model directory; parameters in ``dtype``. ``compute`` defaults to
    ``dtype`` compute; ``expert_layout`` ("auto" | "hub" | "transformers") decides only tensors whose
    two layouts have the same shape ("auto" reads them as transformers does)."""
    if expert_layout not in ("auto", "hub", "transformers"):
        raise ValueError(f"expert_layout must be auto, hub or transformers, got {expert_layout!r}")
    path = Path(path)
    config = load_model_config(path)
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
    entries = {e.hf_key: e for e in checkpoint_entries(config)}
    unmapped = set(variables) - {e.path for e in entries.values()}
    if unmapped:  # the name table must cover every parameter of the model
        raise RuntimeError(f"parameters with no HF tensor: {sorted('.'.join(map(str, p)) for p in unmapped)}")
    np_dtype = np.dtype(jnp.dtype(dtype))
    buffers: dict[tuple, np.ndarray] = {}
    remaining = collections.Counter(e.path for e in entries.values())  # tensors still to read per parameter
    loaded: set[str] = set()
    for file in _checkpoint_files(path):
        st = SafetensorsFile(file)
        for key in st.keys():
            if key not in entries:
                if key == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: transformers ignores it too
                raise CheckpointError(f"unexpected tensor {key} in {file} (not part of {config.name or 'this'} model)")
            if key in loaded:
                raise CheckpointError(f"tensor {key} appears twice (again in {file})")
            e = entries[key]
            code, _ = st.info(key)
            if code not in _FLOAT_CODES:
                raise CheckpointError(f"tensor {key} in {file} has dtype {code}, expected a floating dtype")
            var = variables[e.path]
            shape = tuple(var.get_value().shape)
            target = shape if e.layer is None else shape[1:]
            w = _to_ours(e, st.get(key), tuple(target), expert_layout).astype(np_dtype)
            if e.layer is None:
                buffers[e.path] = w
            else:
                buffers.setdefault(e.path, np.empty(shape, np_dtype))[e.layer] = w
            loaded.add(key)
            remaining[e.path] -= 1
            if remaining[e.path] == 0:  # parameter complete: hand it to JAX, free the host copy
                var.set_value(jnp.asarray(buffers.pop(e.path)))
    missing = [k for k in entries if k not in loaded]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"missing tensor {missing[0]} in {path}" + (f" (also {missing[1:5]}{more})" if len(missing) > 1 else ""))
    log.info("loaded %d tensors from %s", len(loaded), path)
    return nnx.merge(graphdef, state), config


def save_pretrained(model: Qwen3VLMoe, config: ModelConfig, path: str | Path, *, max_shard_bytes: int = 5 * 2**30,
                    expert_layout: str = "auto") -> None:
    """Write an HF model directory (config.json + safetensors shards + index) that transformers
    loads. Experts go in the hub layout [E, H, 2I] / [E, I, H] ("auto": except tensors whose two
    layouts have the same shape, written as transformers keeps them), or all "hub" / "transformers"."""
    if expert_layout not in ("auto", "hub", "transformers"):
        raise ValueError(f"expert_layout must be auto, hub or transformers, got {expert_layout!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    variables = dict(nnx.to_flat_state(nnx.state(model)))
    if any(isinstance(v, ExpertBias) and bool(np.any(np.asarray(jax.device_get(v[...])) != 0))
           for v in variables.values()):
        log.warning("save_pretrained: the model's expert_bias (aux-loss-free routing) is not part of the HF "
                    "format and is dropped; HF routing of these weights differs from this model's")
    tensors = []
    for e in checkpoint_entries(config):
        if e.path not in variables:
            raise CheckpointError(f"model has no parameter {'.'.join(map(str, e.path))} for tensor {e.hf_key}")
        arr = variables[e.path][...]
        dtype = np.dtype(arr.dtype)

        def make(arr=arr, e=e):
            a = np.asarray(jax.device_get(arr if e.layer is None else arr[e.layer]))
            return _to_hf(e, a, expert_layout)

        tensors.append((e.hf_key, _hf_shape_out(e, expert_layout), dtype, make))
    shards, size = [[]], 0
    for t in tensors:
        nbytes = math.prod(t[1]) * t[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    for old in list(path.glob("*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    if len(shards) == 1:
        write_safetensors(path / "model.safetensors", shards[0])
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(path / fname, shard)
            for name, shape, dtype, _ in shard:
                weight_map[name] = fname
                total += math.prod(shape) * dtype.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    dtype_name = np.dtype(tensors[0][2]).name if tensors else "float32"
    (path / "config.json").write_text(json.dumps(config.to_hf_dict(dtype=dtype_name), indent=2))
    log.info("saved %d tensors in %d file(s) to %s", len(tensors), len(shards), path)

