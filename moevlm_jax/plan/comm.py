"""The planner's communication model: bytes one device moves per train step, by mesh-axis group and
collective, and the share of them that crosses hosts (``moevlm_jax.plan.search``).

Counted as the bytes a device receives (ring / all-to-all algorithms; an all-reduce counts as a
reduce-scatter plus an all-gather) for a group of ``n`` devices over a tensor of ``X`` bytes in all:
all-gather and reduce-scatter ``X (n - 1) / n``, all-reduce ``2 X (n - 1) / n``, all-to-all of
``X`` bytes a device ``X (n - 1) / n``. Per step, with ``G`` microbatches (``train.grad_accum``):

- ``fsdp_gather``: every weight sharded over FSDP axes (an ``embed`` / ``vis_embed`` dimension split
  over axes that also split the batch: ``moevlm_jax.plan.geometry.FSDP_AXES``) is all-gathered over them in
  the compute dtype (the embedding table in its parameter dtype) each microbatch: a scanned layer's
  weights once in the forward and once more in the backward (under recompute ``none`` the forward's
  copy is kept: no second gather), the embedding table for a tied LM head (and for the lookup where
  its FSDP axes do not split the ids; where they do, every preset, the lookup gathers the int32 ids
  and exchanges the rows by all-to-all instead, forward and backward: ``parallelism.vocab``), the LM
  head and the mergers once (the fused CE's gradients come with its forward); ``grad_reduce``: its
  gradient is reduce-scattered over the same axes (parameter dtype) each microbatch (the table's
  only for a tied LM head where the lookup spreads it: the lookup's is a local scatter-add), and
  the gradient of a weight replicated over token axes it is used on is all-reduced over them
  (frozen weights: gathers only).
- ``tp``: sequence parallelism's all-gather of the sequence before attention / the dense MLP and
  reduce-scatter after, forward and backward (4 per layer of ``T x H``, ``T`` the gathered
  tokens); expert tensor parallelism's token all-gather + output reduce-scatter likewise; the
  vision tower's all-reduces of its row-parallel outputs (2 a block, forward and backward); the
  vocabulary-parallel embedding's reduce-scatter and the LM head's sequence gather.
- ``ep``: the MoE layers' all-to-alls: dispatch and combine, forward and backward (4 per layer of
  the rows a device sends: T x K, or E x C with a capacity factor). Beside it, where the EP group spans
  ``H > 1`` hosts, ``ep_cross_hierarchical``: what would cross hosts under ``compute.moe.dispatcher:
  hierarchical`` (``parallelism.dispatch``; its layout maps ``exp`` to a host axis and the within-host
  axes): each token once per remote host its experts live on, ``D = (H - 1) (1 - C(E - E/H, K) / C(E, K))``
  remote hosts a token on average under uniform routing, 4 row transfers (rows there, partial sums back,
  both again in the backward) plus 2 of its routing (2 K float32) per (token, remote host): ``T D (4 H_row
  + 16 K)`` a layer call, against the flat ``4 T K (H - 1) / H H_row``; with a capacity factor the blocks
  are fixed: ``min(T, E/H x C)`` rows a remote host against ``E C (H - 1) / H``.
- ``cp``: the K/V all-gather over the context axes per layer (forward, the backward's
  reduce-scatter of d(K), d(V), and one more gather where attention is recomputed).
- ``pp``: the pipeline's per-iteration activation hand-off to the next stage, forward and backward
  (``M x R + S - 1`` iterations, bubbles included).

Host placement: devices are numbered in mesh order (``parallelism.layout.MESH_AXES`` outermost
first: stage, data, fsdp, context, expert, tensor), ``devices_per_host`` consecutive devices a host,
so the innermost axes (tensor, expert, context) stay within a host while they fit. A group's bytes
from members on other hosts cross the inter-host network (``cross_host``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from moevlm_jax.parallelism.layout import MESH_AXES
from moevlm_jax.plan.geometry import (
    DTYPE_BYTES,
    Geometry,
    axes_of,
    lookup_spread,
    shard_table,
    size_of,
)

KINDS = ("fsdp_gather", "grad_reduce", "tp", "ep", "cp", "pp")


@dataclasses.dataclass
class CommEstimate:
    """Per-device bytes per step: ``by_kind[kind][group]`` (group = mesh axes joined by 'x') and the
    part of each that crosses hosts (``cross[kind][group]``)."""

    by_kind: dict[str, dict[str, float]]
    cross: dict[str, dict[str, float]]
    # bytes across hosts the EP exchange would move under the hierarchical dispatcher (0: EP within a host)
    ep_cross_hierarchical: float = 0.0

    def total(self, kind: str | None = None) -> float:
        kinds = [kind] if kind else list(self.by_kind)
        return float(sum(sum(self.by_kind.get(k, {}).values()) for k in kinds))

    def total_cross(self, kind: str | None = None) -> float:
        kinds = [kind] if kind else list(self.cross)
        return float(sum(sum(self.cross.get(k, {}).values()) for k in kinds))

    def by_axis(self) -> dict[str, float]:
        """Bytes per mesh-axis group, all kinds together."""
        out: dict[str, float] = {}
        for groups in self.by_kind.values():
            for grp, b in groups.items():
                out[grp] = out.get(grp, 0.0) + b
        return out


def cross_host_fraction(shape: Mapping[str, int], axes: Sequence[str], devices_per_host: int) -> float:
    """Share of a group's peers (the devices differing from device 0 only along ``axes``) on other
    hosts, devices numbered in mesh order with ``devices_per_host`` consecutive devices a host."""
    return _cross_host_fraction(tuple(sorted(shape.items())), tuple(axes), devices_per_host)


def _group_devices(shape: Mapping[str, int], axes: Sequence[str]) -> list[int]:
    """The devices of device 0's group over ``axes`` (those differing from it only along them), numbered in mesh
    order (``MESH_AXES``, row-major)."""
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    idx = [MESH_AXES.index(a) for a in axes]
    return [sum(c * strides[i] for c, i in zip(coords, idx))
            for coords in itertools.product(*(range(sizes[i]) for i in idx))]


@functools.lru_cache(maxsize=4096)
def _cross_host_fraction(shape_items: tuple[tuple[str, int], ...], axes: tuple[str, ...],
                         devices_per_host: int) -> float:
    devices = _group_devices(dict(shape_items), axes)
    if len(devices) <= 1:
        return 0.0
    return sum(dev // devices_per_host != 0 for dev in devices) / (len(devices) - 1)


def hosts_spanned(shape: Mapping[str, int], axes: Sequence[str], devices_per_host: int) -> int:
    """Hosts a group over ``axes`` (device 0's) spans, devices numbered as :func:`cross_host_fraction` numbers them."""
    return len({dev // devices_per_host for dev in _group_devices(shape, axes)})


def remote_hosts_per_token(experts: int, top_k: int, hosts: int) -> float:
    """Other hosts a token's top-k experts live on, on average, with ``experts / hosts`` experts a host and the
    k experts a uniform draw without replacement: ``(H - 1) (1 - C(E - E/H, K) / C(E, K))``."""
    if hosts <= 1:
        return 0.0
    return (hosts - 1) * (1 - math.comb(experts - experts // hosts, top_k) / math.comb(experts, top_k))


def hierarchical_ep_cross(tokens: float, hidden_bytes: float, experts: int, top_k: int, hosts: int,
                          capacity: int | None = None) -> tuple[float, float]:
    """(flat, hierarchical) bytes a device receives from other hosts for one MoE layer call (forward and
    backward) of ``tokens`` rows of ``hidden_bytes``, the EP group spanning ``hosts`` hosts (module docstring)."""
    if hosts <= 1:
        return 0.0, 0.0
    remote = (hosts - 1) / hosts
    if capacity is None:
        flat = 4 * tokens * top_k * remote * hidden_bytes
        pairs = tokens * remote_hosts_per_token(experts, top_k, hosts)
    else:
        flat = 4 * experts * capacity * remote * hidden_bytes
        pairs = (hosts - 1) * min(tokens, experts // hosts * capacity)
    return flat, pairs * (4 * hidden_bytes + 2 * 2 * top_k * 4)


def _label(axes: Sequence[str]) -> str:
    return "x".join(axes)


class _Acc:
    def __init__(self, shape: Mapping[str, int], devices_per_host: int):
        self.shape, self.dph = shape, devices_per_host
        self.by_kind: dict[str, dict[str, float]] = {k: {} for k in KINDS}
        self.cross: dict[str, dict[str, float]] = {k: {} for k in KINDS}

    def add(self, kind: str, axes: Sequence[str], total_bytes: float, collective: str) -> None:
        """``total_bytes``: the tensor over the whole group (all-gather's output, reduce-scatter's input,
        all-reduce's operand) or, for all-to-all, what one device sends in all."""
        axes = tuple(a for a in axes if self.shape.get(a, 1) > 1)
        n = size_of(self.shape, axes)
        if n <= 1 or total_bytes <= 0:
            return
        b = total_bytes * (n - 1) / n * (2.0 if collective == "all_reduce" else 1.0)
        self.by_kind[kind][_label(axes)] = self.by_kind[kind].get(_label(axes), 0.0) + b
        self._cross(kind, axes, b)

    def _cross(self, kind: str, axes: Sequence[str], b: float) -> None:
        """Count the part of ``b`` (bytes a device receives from its group over ``axes``) from other hosts."""
        axes = tuple(a for a in axes if self.shape.get(a, 1) > 1)
        if not axes or b <= 0:
            return
        key = _label(axes)
        frac = cross_host_fraction(self.shape, axes, self.dph)
        if frac:
            self.cross[kind][key] = self.cross[kind].get(key, 0.0) + b * frac


def _token_axes(path: str, g: Geometry) -> tuple[str, ...]:
    """Mesh axes that split the tokens (patches) a parameter is applied to; its gradient sums over them."""
    rules, shape = g.rules, g.shape
    if path.startswith("visual/blocks") or path.startswith("visual/patch_embed") or path.startswith("visual/pos"):
        return axes_of(rules, shape, ("act_patches", None), 0)
    if path.endswith(("mlp/gate_up_proj", "mlp/down_proj")):
        experts = ("layers", "exp", "embed", None, "moe_mlp")
        skip = set(axes_of(rules, shape, experts, 1)) | set(axes_of(rules, shape, experts, 4))
        return tuple(a for a in axes_of(rules, shape, ("act_tokens", "act_embed"), 0) if a not in skip)
    res = ("act_batch", "act_norm_seq", "act_embed")
    return tuple(dict.fromkeys(axes_of(rules, shape, res, 0) + axes_of(rules, shape, res, 1)))


def step_communication(model: Any, g: Geometry, knobs: Any, devices_per_host: int) -> CommEstimate:
    """Per-device bytes per train step by collective kind and mesh-axis group (module docstring)."""
    t, v = model.text_config, model.vision_config
    shards = shard_table(model, knobs.param_dtype, knobs.expert_bias, g.rules, g.shape)
    rules, shape = g.rules, g.shape
    c, pb = DTYPE_BYTES[knobs.dtype], DTYPE_BYTES[knobs.param_dtype]
    acc = _Acc(shape, devices_per_host)
    # a stage's decoder weights (its R chunks) are gathered chunk by chunk, once per pipeline iteration
    weight_passes = g.iterations / g.repeats
    gathers = 1 if knobs.recompute == "none" else 2
    token_axes_of: dict[str, tuple[str, ...]] = {}
    spread = lookup_spread(rules, shape)  # the embedding lookup's all-to-all axes (parallelism.vocab)
    for sh in shards:
        p = sh.param
        # decoder layers inside a pipeline run once per pipeline iteration, the rest once per microbatch
        micro = knobs.grad_accum * (weight_passes if p.path.startswith("language_model/stacks/") else 1)
        if p.path.startswith("visual/") and not g.patches:
            continue
        local, fsdp = sh.local, sh.fsdp
        full = local * sh.fsdp_size
        trained = p.trainable and p.group not in knobs.frozen
        if fsdp:
            wbytes = DTYPE_BYTES[p.dtype] if p.path == "language_model/embed_tokens" else c
            reduced = trained
            if p.path == "language_model/embed_tokens":  # the lookup, and the tied LM head (fused CE: forward only)
                tied = 1 if model.tie_word_embeddings else 0
                if spread:  # the lookup gathers the ids and returns the rows by all-to-all, forward and backward
                    n_gather, reduced = tied, trained and tied > 0  # its own gradient: a local scatter-add
                    tokens = g.rows * g.seq / g.sp
                    acc.add("fsdp_gather", spread, tokens * size_of(shape, spread) * 4 * micro, "all_gather")
                    acc.add("fsdp_gather", spread, 2 * tokens * t.hidden_size * wbytes * micro, "all_to_all")
                else:
                    n_gather = 1 + tied
            elif p.path == "lm_head/kernel" or not p.path.startswith(("language_model/stacks/", "visual/blocks/")):
                n_gather = 1  # outside the remat'ed stacks: the forward's copy serves the backward
            else:
                n_gather = gathers if trained else 1
            acc.add("fsdp_gather", fsdp, full * wbytes * n_gather * micro, "all_gather")
            if reduced:
                acc.add("grad_reduce", fsdp, full * pb * micro, "reduce_scatter")
        if trained:
            kind = "vision" if p.path.startswith("visual/") else ("experts" if p.path.endswith(
                ("mlp/gate_up_proj", "mlp/down_proj")) else "text")
            if kind not in token_axes_of:
                token_axes_of[kind] = _token_axes(p.path, g)
            rep = tuple(a for a in token_axes_of[kind] if a not in sh.sharded)
            acc.add("grad_reduce", rep, local * pb * micro, "all_reduce")

    # activations
    h = t.hidden_size
    per_layer_calls = g.layer_runs(t.num_hidden_layers) * knobs.grad_accum
    tp_axes = axes_of(rules, shape, ("act_batch", "act_seq", "act_heads", "act_head_dim"), 2)
    seq_axes = axes_of(rules, shape, ("act_batch", "act_norm_seq", "act_embed"), 1)
    sp_tp = tuple(a for a in seq_axes if a in tp_axes)
    tokens_att = g.tokens_att  # per device inside attention (the sequence gathered over SP)
    if sp_tp:
        acc.add("tp", sp_tp, 4 * tokens_att * h * c * per_layer_calls, "all_gather")  # attention AG/RS, fwd + bwd
        n_dense = sum(k == "dense" for k in t.layer_kinds)
        if n_dense:
            acc.add("tp", sp_tp, 4 * tokens_att * h * c * per_layer_calls * n_dense / t.num_hidden_layers,
                    "all_gather")
        acc.add("tp", sp_tp, 4 * tokens_att * h * c * knobs.grad_accum, "all_gather")  # embedding RS + LM head AG
    elif tp_axes:  # heads split without SP: the row-parallel outputs all-reduced
        acc.add("tp", tp_axes, 2 * tokens_att * h * c * per_layer_calls, "all_reduce")
    n_moe = sum(k == "moe" for k in t.layer_kinds)
    experts = ("layers", "exp", "embed", None, "moe_mlp")
    etp_axes = axes_of(rules, shape, experts, 4)
    ep_axes = axes_of(rules, shape, experts, 1)
    moe_calls = per_layer_calls * n_moe / t.num_hidden_layers
    token_axes = axes_of(rules, shape, ("act_tokens", "act_embed"), 0)
    etp_gather = tuple(a for a in etp_axes if a in token_axes)
    if etp_gather and n_moe:  # ETP: tokens all-gathered over the ETP group, outputs reduce-scattered
        acc.add("tp", etp_gather, 4 * g.moe_tokens * h * c * moe_calls, "all_gather")
    ep_hier = 0.0
    if ep_axes and n_moe:
        k = t.num_experts_per_tok
        cap = None
        if knobs.capacity_factor is not None:
            cap = math.ceil(g.moe_tokens * k / t.num_experts * knobs.capacity_factor)
            rows = t.num_experts * cap
        else:
            rows = g.moe_tokens * k
        acc.add("ep", ep_axes, 4 * rows * h * c * moe_calls, "all_to_all")
        hosts = hosts_spanned(shape, [a for a in ep_axes if shape.get(a, 1) > 1], devices_per_host)
        ep_hier = hierarchical_ep_cross(g.moe_tokens, h * c, t.num_experts, k, hosts, cap)[1] * moe_calls
    cp_axes = axes_of(rules, shape, ("act_batch", "act_seq", "act_heads", "act_head_dim"), 1)
    if cp_axes:
        kv = 2 * g.rows * g.seq * t.num_key_value_heads / g.tp_kv * t.head_dim * c  # K and V of the whole sequence
        recomputed = knobs.recompute == "full" or (knobs.recompute == "selective"
                                                   and "core_attn" in knobs.recompute_modules)
        acc.add("cp", cp_axes, kv * (3 if recomputed else 2) * per_layer_calls, "all_gather")
    if g.patches and g.tp_vis_heads > 1:  # the ViT's row-parallel outputs (activations replicated over tensor)
        vis_tp = axes_of(rules, shape, ("vis_layers", "vis_embed", None, "vis_heads", "vis_head_dim"), 3)
        xv = g.vis_rows * g.patches * v.hidden_size * c
        acc.add("tp", vis_tp, 4 * xv * v.depth * knobs.grad_accum, "all_reduce")
    if g.stages > 1:
        carry = g.rows * g.seq / g.sp * h * c  # one microbatch's hidden state on this device
        # a collective-permute a pipeline iteration: each device passes its carry on, forward and backward
        acc.by_kind["pp"]["stage"] = acc.by_kind["pp"].get("stage", 0.0) + 2 * g.iterations * knobs.grad_accum * carry
        acc._cross("pp", ("stage",), 2 * g.iterations * knobs.grad_accum * carry)
    return CommEstimate(by_kind=acc.by_kind, cross=acc.cross, ep_cross_hierarchical=ep_hier)
