"""The HF <-> ours name and layout table for Qwen3.5-MoE (``Qwen3_5MoeForConditionalGeneration``).

:func:`checkpoint_entries` lists one :class:`~moevlm_jax.hf.names.Entry` per HF tensor, as
:func:`moevlm_jax.hf.names.checkpoint_entries` does for Qwen3-VL-MoE, in the names transformers'
``save_pretrained`` writes for this model:

- the routed experts one tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight
  [I, H]``, ``up_proj``, ``down_proj [H, I]``: transformers' ``qwen2_moe`` conversion fuses them
  on load and splits them again on save). Their :attr:`Entry.layer` is a tuple index into our
  stacked parameter, ``None`` standing for a whole axis: ``(layer, expert, None, 0)`` is the gate
  half of ``gate_up_proj [L, E, H, 2, I]``, ``(layer, expert)`` one expert of ``down_proj [L, E, I, H]``;
- the GDN's fused ``in_proj_qkv [2 Hk Dk + Hv Dv, H]`` and ``conv1d.weight [same, 1, K]`` are
  regrouped per key head (kinds ``gdn_qkv`` / ``gdn_conv``, :class:`GdnEntry`; the layout is in
  :mod:`moevlm_jax.model.qwen3_5_gdn`), a permutation of the same numbers: bitwise both ways;
- HF's multi-token-prediction weights (``mtp.*``, in released checkpoints) are not part of
  HF's model (``_keys_to_ignore_on_load_unexpected``) nor of ours: :data:`IGNORED_PREFIXES`.

:func:`to_ours` / :func:`to_hf` / :func:`hf_out_shape` handle these kinds and leave the rest to
:mod:`moevlm_jax.hf.names`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from moevlm_jax.hf import names
from moevlm_jax.hf.errors import CheckpointError
from moevlm_jax.hf.names import Entry
from moevlm_jax.model.decoder import layer_groups
from moevlm_jax.model.qwen3_5_config import Qwen35ModelConfig

IGNORED_PREFIXES = ("mtp.",)  # HF tensors skipped on load, as transformers skips them
_GDN_KINDS = ("gdn_qkv", "gdn_conv")


@dataclasses.dataclass(frozen=True)
class GdnEntry(Entry):
    """An Entry of the GDN's fused q/k/v channels, with (key heads, key head dim) for the regrouping."""

    groups: tuple[int, int] = (0, 0)


def checkpoint_entries(config: Qwen35ModelConfig) -> list[Entry]:
    """Every HF tensor of ``config``'s model (transformers' save_pretrained names)."""
    v, t = config.vision_config, config.text_config
    c, ci, cbig = v.hidden_size, v.intermediate_size, v.hidden_size * v.spatial_merge_size**2
    out: list[Entry] = []

    def add(key: str, path: tuple[Any, ...], kind: str, shape: tuple[int, ...], layer: Any = None) -> None:
        out.append(Entry(key, tuple(path), layer, kind, tuple(shape)))

    def linear(key: str, path: tuple[Any, ...], o: int, i: int, layer: Any = None, bias: bool = True) -> None:
        add(f"{key}.weight", (*path, "kernel"), "linear", (o, i), layer)
        if bias:
            add(f"{key}.bias", (*path, "bias"), "reshape", (o,), layer)

    def norm(key: str, path: tuple[Any, ...], n: int, layer: Any = None, bias: bool = True) -> None:
        add(f"{key}.weight", (*path, "scale"), "reshape", (n,), layer)
        if bias:
            add(f"{key}.bias", (*path, "bias"), "reshape", (n,), layer)

    # the vision tower: Qwen3-VL's entries (moevlm_jax.hf.names) without the DeepStack mergers
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

    pt, h, d = "model.language_model", t.hidden_size, t.head_dim
    hk, hv, dk, dv = t.linear_num_key_heads, t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim
    conv_dim, kw = 2 * hk * dk + hv * dv, t.linear_conv_kernel_dim
    e_count, im, ish = t.num_experts, t.moe_intermediate_size, t.shared_expert_intermediate_size
    add(f"{pt}.embed_tokens.weight", ("language_model", "embed_tokens"), "reshape", (t.vocab_size, h))
    for g, (kind, first, n) in enumerate(layer_groups(t.layer_types)):
        for li in range(n):
            b, p = f"{pt}.layers.{first + li}", ("language_model", "stacks", g)
            if kind == "linear_attention":
                la, a = f"{b}.linear_attn", (*p, "linear_attn")
                add(f"{la}.dt_bias", (*a, "dt_bias"), "reshape", (hv,), li)
                add(f"{la}.A_log", (*a, "A_log"), "reshape", (hv,), li)
                out.append(GdnEntry(f"{la}.conv1d.weight", (*a, "conv1d", "kernel"), li, "gdn_conv",
                                    (conv_dim, 1, kw), (hk, dk)))
                norm(f"{la}.norm", (*a, "norm"), dv, li, bias=False)
                linear(f"{la}.out_proj", (*a, "out_proj"), h, hv * dv, li, bias=False)
                out.append(GdnEntry(f"{la}.in_proj_qkv.weight", (*a, "in_proj_qkv", "kernel"), li, "gdn_qkv",
                                    (conv_dim, h), (hk, dk)))
                linear(f"{la}.in_proj_z", (*a, "in_proj_z"), hv * dv, h, li, bias=False)
                linear(f"{la}.in_proj_b", (*a, "in_proj_b"), hv, h, li, bias=False)
                linear(f"{la}.in_proj_a", (*a, "in_proj_a"), hv, h, li, bias=False)
            else:
                sa, a, ab = f"{b}.self_attn", (*p, "self_attn"), t.attention_bias
                linear(f"{sa}.q_proj", (*a, "q_proj"), t.num_attention_heads * d * 2, h, li, ab)
                linear(f"{sa}.k_proj", (*a, "k_proj"), t.num_key_value_heads * d, h, li, ab)
                linear(f"{sa}.v_proj", (*a, "v_proj"), t.num_key_value_heads * d, h, li, ab)
                linear(f"{sa}.o_proj", (*a, "o_proj"), h, t.num_attention_heads * d, li, ab)
                norm(f"{sa}.q_norm", (*a, "q_norm"), d, li, bias=False)
                norm(f"{sa}.k_norm", (*a, "k_norm"), d, li, bias=False)
            m, mp = f"{b}.mlp", (*p, "mlp")
            linear(f"{m}.gate", (*mp, "gate"), e_count, h, li, bias=False)
            for e in range(e_count):
                x = f"{m}.experts.{e}"
                add(f"{x}.gate_proj.weight", (*mp, "gate_up_proj"), "linear", (im, h), (li, e, None, 0))
                add(f"{x}.up_proj.weight", (*mp, "gate_up_proj"), "linear", (im, h), (li, e, None, 1))
                add(f"{x}.down_proj.weight", (*mp, "down_proj"), "linear", (h, im), (li, e))
            for name, o, i in (("gate_proj", ish, h), ("up_proj", ish, h), ("down_proj", h, ish)):
                linear(f"{m}.shared_expert.{name}", (*mp, "shared_expert", name), o, i, li, bias=False)
            linear(f"{m}.shared_expert_gate", (*mp, "shared_expert_gate"), 1, h, li, bias=False)
            norm(f"{b}.input_layernorm", (*p, "input_layernorm"), h, li, bias=False)
            norm(f"{b}.post_attention_layernorm", (*p, "post_attention_layernorm"), h, li, bias=False)
    norm(f"{pt}.norm", ("language_model", "norm"), h, bias=False)
    if not config.tie_word_embeddings:
        linear("lm_head", ("lm_head",), t.vocab_size, h, bias=False)
    return out


def _channels_to_groups(x: np.ndarray, hk: int, dk: int) -> np.ndarray:
    """[..., 2 Hk Dk + Hv Dv] in HF's order (all q, all k, all v) -> [..., Hk, 2 Dk + r Dv] per key-head group."""
    lead = x.shape[:-1]
    q, k, v = np.split(x, [hk * dk, 2 * hk * dk], axis=-1)
    return np.concatenate([a.reshape(*lead, hk, -1) for a in (q, k, v)], axis=-1)


def _groups_to_channels(x: np.ndarray, dk: int) -> np.ndarray:
    """Inverse of :func:`_channels_to_groups`: [..., Hk, 2 Dk + r Dv] -> [..., 2 Hk Dk + Hv Dv]."""
    lead = x.shape[:-2]
    parts = (x[..., :dk], x[..., dk:2 * dk], x[..., 2 * dk:])
    return np.concatenate([a.reshape(*lead, -1) for a in parts], axis=-1)


def hf_out_shape(e: Entry, expert_layout: str) -> tuple[int, ...]:
    """The shape ``e`` is written with (``expert_layout`` matters only to Qwen3-VL's fused experts)."""
    return e.hf_shape if e.kind in _GDN_KINDS else names.hf_out_shape(e, expert_layout)


def to_ours(e: Entry, w: np.ndarray, target: tuple[int, ...], expert_layout: str) -> np.ndarray:
    """HF tensor ``w`` -> our layout (shape ``target``); CheckpointError on a shape mismatch."""
    if e.kind not in _GDN_KINDS:
        return names.to_ours(e, w, target, expert_layout)
    if w.shape != e.hf_shape:
        raise CheckpointError(f"tensor {e.hf_key} has shape {list(w.shape)}, expected {list(e.hf_shape)}")
    hk, dk = e.groups
    if e.kind == "gdn_qkv":  # [C, H] -> [H, Hk, G]
        return _channels_to_groups(w.T, hk, dk).reshape(target)
    return _channels_to_groups(w.reshape(w.shape[0], -1).T, hk, dk).reshape(target)  # [C, 1, K] -> [K, Hk, G]


def to_hf(e: Entry, a: np.ndarray, expert_layout: str) -> np.ndarray:
    """Our array ``a`` (one layer / expert slice) -> the HF tensor, shape :func:`hf_out_shape`."""
    if e.kind not in _GDN_KINDS:
        return names.to_hf(e, a, expert_layout)
    _, dk = e.groups
    return _groups_to_channels(a, dk).T.reshape(e.hf_shape)  # [H | K, Hk, G] -> [C, H] | [C, 1, K]
