"""What one device holds and computes under a layout: the planner's shared geometry
(``moevlm_jax.plan.search``; memory in ``moevlm_jax.plan.memory``, communication in ``moevlm_jax.plan.comm``).

Everything is derived from the same things the trainer uses: the model config, the layout's
logical-axis rules (``parallelism.logical.logical_to_spec``) and the mesh axis sizes; nothing is
compiled and no device is needed, so a plan can be made for a machine we do not have
(``mesh_shape`` = axis sizes, e.g. ``{"fsdp": 8, "expert": 8}``).

``Geometry`` holds the per-device sizes every part of the plan reads: rows, tokens in the residual
stream / inside attention / in the experts' layout, heads and widths after tensor / expert splits,
the pipeline's stages and microbatches. ``param_table`` lists every parameter with its logical axes
(the abstract model, as the trainer builds it) and ``local_elements`` gives its per-device shard.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from flax import nnx

from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.qwen3_vl_moe import Qwen3VLMoe
from moevlm_jax.parallelism.layout import MESH_AXES
from moevlm_jax.parallelism.logical import (
    Rules,
    data_parallel_size,
    flat_axes,
    logical_to_spec,
    normalize_rules,
)
from moevlm_jax.parallelism.sharding import path_str
from moevlm_jax.parallelism.vocab import lookup_axes
from moevlm_jax.training.optimizer import param_group

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# logical parameter axes that split a weight the way data parallelism does (ZeRO-3 / FSDP: the
# weight is gathered before use, its gradient reduce-scattered); every other split is model parallel
FSDP_AXES = frozenset({"embed", "vis_embed", "patch_in", "norm"})


def axes_of(rules: Rules, shape: Mapping[str, int], logical: Sequence[str | None], dim: int) -> tuple[str, ...]:
    """Mesh axes (size > 1) that dimension ``dim`` of a tensor with these logical axes is split over."""
    return _axes_of(tuple(rules), tuple(sorted(shape.items())), tuple(logical), dim)


@functools.lru_cache(maxsize=65536)
def _axes_of(rules: Rules, shape: tuple[tuple[str, int], ...], logical: tuple[str | None, ...],
             dim: int) -> tuple[str, ...]:
    spec = tuple(logical_to_spec(logical, rules, types.SimpleNamespace(shape=dict(shape))))
    return flat_axes(spec[dim]) if dim < len(spec) else ()


def size_of(shape: Mapping[str, int], axes: Sequence[str]) -> int:
    """Devices the mesh axes ``axes`` span."""
    return math.prod(int(shape[a]) for a in axes)


def lookup_spread(rules: Rules, shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes the embedding lookup spreads the table's embed dimension over (ids gathered, rows
    returned by all-to-all: ``parallelism.vocab.lookup_axes``); () where it gathers the table instead."""

    ax = lookup_axes(tuple(rules), types.SimpleNamespace(shape=dict(shape)))
    return ax.spread if ax is not None else ()


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter: '/'-joined path, global shape, logical axes, dtype, trainable group."""

    path: str
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    dtype: str
    group: str  # vision_model | vision_projection | language_model (training.optimizer.param_group)
    trainable: bool = True  # False for the router's expert bias (no gradient, no optimizer state)

    @property
    def elements(self) -> int:
        return math.prod(self.shape)


@functools.lru_cache(maxsize=16)
def param_table(model: Any, param_dtype: str = "float32", expert_bias: bool = False) -> tuple[ParamInfo, ...]:
    """Every parameter of the model (``Qwen3VLMoe`` built abstractly, as the trainer does) with its
    logical axes; no memory is allocated (235B-A22B takes a few seconds)."""


    compute = ComputeConfig(param_dtype=param_dtype, router={"expert_bias": expert_bias})
    state = nnx.state(nnx.eval_shape(lambda: Qwen3VLMoe(model, compute, nnx.Rngs(0))))
    flat = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    out = []
    for (kp, leaf), var in zip(flat, variables):
        path = path_str(kp)
        names = tuple(var.get_metadata().get("out_sharding") or (None,) * len(leaf.shape))
        out.append(ParamInfo(path, tuple(int(s) for s in leaf.shape), names, str(leaf.dtype), param_group(path),
                             trainable=type(var).__name__ != "ExpertBias"))
    return tuple(out)


def local_elements(p: ParamInfo, rules: Rules, shape: Mapping[str, int]) -> float:
    """Elements of ``p`` one device holds (its shard under the rules)."""
    n = p.elements
    for dim in range(len(p.shape)):
        n /= size_of(shape, axes_of(rules, shape, p.axes, dim))
    return n


def sharded_axes(p: ParamInfo, rules: Rules, shape: Mapping[str, int]) -> frozenset[str]:
    """Every mesh axis ``p`` is split over."""
    out: set[str] = set()
    for dim in range(len(p.shape)):
        out.update(axes_of(rules, shape, p.axes, dim))
    return frozenset(out)


def fsdp_axes(p: ParamInfo, rules: Rules, shape: Mapping[str, int]) -> tuple[str, ...]:
    """Mesh axes ``p`` is sharded over through a data-parallel (FSDP) logical axis."""
    out: list[str] = []
    for dim, name in enumerate(p.axes):
        if name in FSDP_AXES:
            out += axes_of(rules, shape, p.axes, dim)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Per-device sizes of one (model, layout, mesh, MBS, sequence, patches) point."""

    shape: dict[str, int]  # mesh axis sizes (every axis of parallelism.layout.MESH_AXES)
    rules: Rules
    mbs: int  # rows per data-parallel rank per microbatch
    seq: int
    patches: int  # patch rows per batch row (0: text only)
    dp: int  # devices the batch rows are split over (act_batch)
    rows: int  # decoder rows one device runs per microbatch (outside a pipeline: mbs)
    sp: int  # split of the residual stream's sequence (act_norm_seq: SP x CP)
    cp: int  # split of the sequence inside attention / MLP / LM head (act_seq)
    tp_q: int  # split of the query heads (act_heads)
    tp_kv: int  # split of the KV heads (act_kv_heads)
    tp_mlp: int  # split of the dense MLP width (act_mlp)
    tp_vocab: int  # split of the vocabulary (act_vocab: logits) and of the LM head weight
    ep: int  # expert parallel size (exp)
    etp: int  # expert tensor parallel size (moe_mlp)
    moe_tokens: int  # token rows one device routes per MoE layer call (after the ETP gather)
    vis_rows: int  # batch rows of the vision tower on one device
    tp_vis_heads: int
    tp_vis_mlp: int
    stages: int  # pipeline stages (1: no pipeline)
    microbatches: int  # pipeline microbatches (1: no pipeline)
    repeats: int  # circular pipeline repeats
    vision_pipelined: bool = False

    @property
    def tokens_res(self) -> float:
        """Decoder tokens of the residual stream one device holds per microbatch (per layer call)."""
        return self.rows * self.seq / self.sp

    @property
    def tokens_att(self) -> float:
        """Tokens inside attention / the dense MLP on one device (the sequence gathered over SP)."""
        return self.rows * self.seq / self.cp

    @property
    def out_tokens_res(self) -> float:
        """Residual-stream tokens a device holds outside the decoder's pipeline (embedding, final norm, LM
        head: data parallel over every batch axis, the stages included)."""
        return self.mbs * self.seq / self.sp

    @property
    def out_tokens_att(self) -> float:
        """Tokens a device holds outside the pipeline with the sequence gathered over SP."""
        return self.mbs * self.seq / self.cp

    @property
    def iterations(self) -> int:
        """A pipeline's loop iterations per microbatch of the step (M x R + S - 1; 1 without a pipeline)."""
        return self.microbatches * self.repeats + self.stages - 1 if self.stages > 1 else 1

    def layer_runs(self, layers: int) -> float:
        """Decoder layer executions on one device per microbatch of the step: each pipeline iteration runs one
        chunk of ``layers / (S x R)`` layers (bubbles included); without a pipeline every layer once."""
        return layers * self.iterations / (self.stages * self.repeats) if self.stages > 1 else float(layers)

    @property
    def stage_layers_factor(self) -> float:
        """Residual sets a pipeline stage keeps per layer it holds, relative to unpipelined rows: the
        GPipe loop saves every iteration (M x R + S - 1 of them, bubbles included)."""
        if self.stages == 1:
            return 1.0
        return (self.microbatches * self.repeats + self.stages - 1) / (self.microbatches * self.repeats)


def geometry(model: Any, rules: Sequence[Sequence[Any]], shape: Mapping[str, int], *, mbs: int, seq: int,
             patches: int, options: Any = None) -> Geometry:
    """The per-device sizes of a point (see :class:`Geometry`); ``options`` a LayoutOptions."""

    rules = normalize_rules(rules)
    shape = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    dp = data_parallel_size(rules, shape)
    t = model.text_config
    res = ("act_batch", "act_norm_seq", "act_embed")
    att = ("act_batch", "act_seq", "act_heads", "act_head_dim")
    kv = ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")
    batch_axes = axes_of(rules, shape, res, 0)
    sp = size_of(shape, axes_of(rules, shape, res, 1))
    cp = size_of(shape, axes_of(rules, shape, att, 1))
    experts = ("layers", "exp", "embed", None, "moe_mlp")
    ep_axes, etp_axes = axes_of(rules, shape, experts, 1), axes_of(rules, shape, experts, 4)
    token_axes = axes_of(rules, shape, ("act_tokens", "act_embed"), 0)
    # pipeline: the decoder layers over 'stage'; inside a stage the rules drop 'stage'
    stage_axes = axes_of(rules, shape, ("layers",), 0)
    stages = size_of(shape, stage_axes) if stage_axes == ("stage",) else 1
    m, repeats = 1, 1
    rows = mbs
    if stages > 1:
        pipe = getattr(options, "pipeline", None)
        m = int(getattr(pipe, "microbatches", None) or stages)
        schedule = getattr(pipe, "schedule", "gpipe")
        repeats = int(getattr(pipe, "repeats", None) or (2 if schedule == "circular" else 1))
        inner = size_of(shape, tuple(a for a in batch_axes if a != "stage"))
        rows = mbs * dp / inner / m  # rows of one pipeline microbatch on one device
        token_axes = tuple(a for a in token_axes if a != "stage")
    global_rows = (mbs * dp / m) if stages > 1 else mbs * dp
    tok_split = size_of(shape, token_axes)
    gathered = size_of(shape, tuple(a for a in etp_axes if a in token_axes))
    replicated_ep = size_of(shape, tuple(a for a in ep_axes if a not in token_axes))
    moe_tokens = global_rows * seq / tok_split * gathered / replicated_ep
    vis_axes = axes_of(rules, shape, ("act_patches", None), 0)
    vis = ("vis_layers", "vis_embed", None, "vis_heads", "vis_head_dim")
    vis_layers_axes = axes_of(rules, shape, ("vis_layers",), 0)
    del t
    return Geometry(
        shape=shape, rules=rules, mbs=mbs, seq=seq, patches=patches, dp=dp, rows=rows, sp=sp, cp=cp,
        tp_q=size_of(shape, axes_of(rules, shape, att, 2)), tp_kv=size_of(shape, axes_of(rules, shape, kv, 2)),
        tp_mlp=size_of(shape, axes_of(rules, shape, ("act_batch", "act_seq", "act_mlp"), 2)),
        tp_vocab=size_of(shape, axes_of(rules, shape, ("act_batch", "act_seq", "act_vocab"), 2)),
        ep=size_of(shape, ep_axes), etp=size_of(shape, etp_axes), moe_tokens=moe_tokens,
        vis_rows=mbs * dp / max(size_of(shape, vis_axes), 1),
        tp_vis_heads=size_of(shape, axes_of(rules, shape, vis, 3)),
        tp_vis_mlp=size_of(shape, axes_of(rules, shape, ("vis_layers", "vis_embed", "vis_mlp"), 2)),
        stages=stages, microbatches=m, repeats=repeats, vision_pipelined=vis_layers_axes == ("stage",) and stages > 1,
    )


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    """A parameter under a layout: its per-device elements, FSDP axes and every axis it is split over."""

    param: ParamInfo
    local: float
    fsdp: tuple[str, ...]
    fsdp_size: int
    sharded: frozenset[str]


def shard_table(model: Any, param_dtype: str, expert_bias: bool, rules: Rules,
                shape: Mapping[str, int]) -> tuple[ShardInfo, ...]:
    """Every parameter's shard under the layout (cached per model, dtype, rules and mesh)."""
    return _shard_table(model, param_dtype, expert_bias, tuple(rules), tuple(sorted(shape.items())))


@functools.lru_cache(maxsize=512)
def _shard_table(model: Any, param_dtype: str, expert_bias: bool, rules: Rules,
                 shape_items: tuple[tuple[str, int], ...]) -> tuple[ShardInfo, ...]:
    shape = dict(shape_items)
    out = []
    for p in param_table(model, param_dtype, expert_bias):
        fsdp = fsdp_axes(p, rules, shape)
        out.append(ShardInfo(p, local_elements(p, rules, shape), fsdp, size_of(shape, fsdp),
                             sharded_axes(p, rules, shape)))
    return tuple(out)
