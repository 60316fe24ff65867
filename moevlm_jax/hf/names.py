"""The HF <-> ours name and layout table for Qwen3-VL-MoE.

:func:`checkpoint_entries` lists one :class:`Entry` per HF tensor: its name, our parameter path, the
layer index inside a stacked parameter, and how the layout changes; :func:`to_ours` / :func:`to_hf`
apply that change to one tensor. Fused experts are accepted in either layout: the hub's
``gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]`` (ours, with gate_up as ``[E, H, 2, I]``) or
transformers v5's in-memory ``[E, 2I, H]`` / ``[E, H, I]``; where both have the same shape
(H == 2I, or I == H) the tensor is read as transformers does, i.e. in its v5 layout.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from moevlm_jax.hf.errors import CheckpointError
from moevlm_jax.model.config import ModelConfig
from moevlm_jax.model.decoder import layer_groups

EXPERT_LAYOUTS = ("auto", "hub", "transformers")
_EXPERT_KINDS = ("gate_up", "down")


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


def check_expert_layout(expert_layout: str) -> None:
    """Raise ValueError unless ``expert_layout`` is one of :data:`EXPERT_LAYOUTS`."""
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be auto, hub or transformers, got {expert_layout!r}")


def checkpoint_entries(config: ModelConfig) -> list[Entry]:
    """Every HF tensor of ``config``'s model, in HF state-dict order."""
    v, t = config.vision_config, config.text_config
    c, ci, cbig = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
    out: list[Entry] = []

    def add(key: str, path: tuple[Any, ...], kind: str, shape: tuple[int, ...], layer: int | None = None) -> None:
        out.append(Entry(key, tuple(path), layer, kind, tuple(shape)))

    def linear(key: str, path: tuple[Any, ...], o: int, i: int, layer: int | None = None, bias: bool = True) -> None:
        add(f"{key}.weight", (*path, "kernel"), "linear", (o, i), layer)
        if bias:
            add(f"{key}.bias", (*path, "bias"), "reshape", (o,), layer)

    def norm(key: str, path: tuple[Any, ...], n: int, layer: int | None = None, bias: bool = True) -> None:
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
    """The transformers-v5 shape of an expert tensor: [E, H, 2I] -> [E, 2I, H]; [E, I, H] -> [E, H, I]."""
    ex, a, b = e.hf_shape
    return (ex, b, a)


def _hub_layout(e: Entry, expert_layout: str) -> bool:
    """Whether expert tensor ``e`` is written in the hub layout (``auto``: unless transformers would misread it)."""
    if expert_layout == "hub":
        return True
    if expert_layout == "transformers":
        return False
    return e.hf_shape != _transformers_shape(e)


def hf_out_shape(e: Entry, expert_layout: str) -> tuple[int, ...]:
    """The shape ``e`` is written with under ``expert_layout``."""
    if e.kind in _EXPERT_KINDS and not _hub_layout(e, expert_layout):
        return _transformers_shape(e)
    return e.hf_shape


def to_ours(e: Entry, w: np.ndarray, target: tuple[int, ...], expert_layout: str) -> np.ndarray:
    """HF tensor ``w`` -> our layout (shape ``target``, one layer); raises CheckpointError on a shape mismatch."""
    if e.kind in _EXPERT_KINDS:  # our gate_up is [E, H, 2, I]: the hub's [E, H, 2I] split
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


def to_hf(e: Entry, a: np.ndarray, expert_layout: str) -> np.ndarray:
    """Our array ``a`` (one layer) -> the HF tensor, shape :func:`hf_out_shape`."""
    if e.kind in _EXPERT_KINDS:
        a = a.reshape(e.hf_shape)  # [E, H, 2, I] -> the hub's [E, H, 2I]
        return a if _hub_layout(e, expert_layout) else a.transpose(0, 2, 1)
    if e.kind == "linear":
        return a.reshape(-1, e.hf_shape[0]).T.reshape(e.hf_shape)
    return a.reshape(e.hf_shape)
