"""Layout validation before compiling: does this layout fit this model, mesh and batch shape?

:func:`validate_layout` checks, and reports every problem at once in one :class:`LayoutError`
whose lines name the model field (or batch dimension), its size, the logical axis, the mesh axes
and their sizes, and what to change:

- the mesh: known mesh axes, one ``-1`` at most, axis sizes multiplying to the device count;
- the rules: known logical-axis names (``parallelism.LOGICAL_AXES``) and mesh-axis names;
- divisibility of every model dimension a rule splits: attention heads, KV heads (with the
  replication hint below), head_dim, hidden sizes, MLP / expert intermediate sizes, experts,
  vocabulary, and the vision tower's heads / widths; the same for the activation axes;
- divisibility of the batch shape: rows over ``act_batch``, the sequence over ``act_norm_seq`` /
  ``act_seq`` (sequence and context parallelism), MoE token rows over ``act_tokens``;
- the pipeline options (``parallelism.pipeline.pipeline_config``), when the layout has them.

KV heads fewer than the tensor axis (e.g. 4 KV heads, TP 8) are an error, not silently replicated:
the message says to map ``kv_heads`` and ``act_kv_heads`` to null (each tensor rank then computes
every KV head, as Megatron does when TP > query groups) or to lower TP.

Warnings (logged and returned): expert tensor parallelism while expert parallelism alone would fit
(Megatron Bridge's guide: prefer EP to ETP), and MoE token rows sharded otherwise than the batch
and residual-sequence axes (every MoE layer then reshuffles its rows).
"""

from __future__ import annotations

import logging
import math
import types
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

import parallelism
from parallelism.layout import MESH_AXES, Layout, resolve_mesh_shape
from parallelism.logical import flat_axes, Rules, logical_to_spec

log = logging.getLogger(__name__)

KV_HINT = ("map kv_heads and act_kv_heads to null in the layout to replicate the K/V projections on "
           "every tensor rank (Megatron's choice when TP > KV heads), or lower the tensor axis")


class LayoutError(ValueError):
    """A layout that cannot run this model or batch shape; the message lists every problem."""


def _split(axes: Sequence[str | None], dim: int, rules: Rules, shape: dict[str, int]) -> tuple[str, ...]:
    """Mesh axes (size > 1) dimension ``dim`` of a tensor with logical ``axes`` is split over."""
    spec = tuple(logical_to_spec(axes, rules, types.SimpleNamespace(shape=shape)))
    return flat_axes(spec[dim]) if dim < len(spec) else ()


def model_checks(model: Any) -> list[tuple[str, int, tuple[str | None, ...], int]]:
    """(model field, size, logical axes of a tensor holding it, dimension) for every split dimension."""
    t, v = model.text_config, model.vision_config
    q = ("layers", "embed", "q_heads", "head_dim")
    kv = ("layers", "embed", "kv_heads", "head_dim")
    out = [
        ("text_config.num_attention_heads", t.num_attention_heads, q, 2),
        ("text_config.num_key_value_heads", t.num_key_value_heads, kv, 2),
        ("text_config.head_dim", t.head_dim, q, 3),
        ("text_config.hidden_size", t.hidden_size, q, 1),
        ("text_config.vocab_size", t.vocab_size, ("vocab", "embed"), 0),
        ("text_config.hidden_size", t.hidden_size, ("vocab", "embed"), 1),
        ("text_config.vocab_size", t.vocab_size, ("embed", "vocab"), 1),
        ("text_config.num_attention_heads", t.num_attention_heads, ("act_batch", "act_seq", "act_heads", "act_head_dim"), 2),
        ("text_config.num_key_value_heads", t.num_key_value_heads, ("act_batch", "act_seq", "act_kv_heads", "act_head_dim"), 2),
        ("text_config.vocab_size", t.vocab_size, ("act_batch", "act_seq", "act_vocab"), 2),
        ("text_config.hidden_size", t.hidden_size, ("act_batch", "act_norm_seq", "act_embed"), 2),
    ]
    kinds = set(t.layer_kinds)
    if "dense" in kinds:
        out += [("text_config.intermediate_size", t.intermediate_size, ("layers", "embed", "mlp"), 2),
                ("text_config.intermediate_size", t.intermediate_size, ("act_batch", "act_seq", "act_mlp"), 2)]
    if "moe" in kinds:
        experts = ("layers", "exp", "embed", None, "moe_mlp")
        out += [("text_config.num_experts", t.num_experts, experts, 1),
                ("text_config.hidden_size", t.hidden_size, experts, 2),
                ("text_config.moe_intermediate_size", t.moe_intermediate_size, experts, 4),
                ("text_config.num_experts", t.num_experts, ("layers", "embed", "exp"), 2)]
    big = v.hidden_size * v.spatial_merge_size**2
    out += [
        ("vision_config.num_heads", v.num_heads, ("vis_layers", "vis_embed", None, "vis_heads", "vis_head_dim"), 3),
        ("vision_config.hidden_size", v.hidden_size, ("vis_layers", "vis_embed", None, "vis_heads", "vis_head_dim"), 1),
        ("vision_config.head_dim", v.head_dim, ("vis_layers", "vis_embed", None, "vis_heads", "vis_head_dim"), 4),
        ("vision_config.intermediate_size", v.intermediate_size, ("vis_layers", "vis_embed", "vis_mlp"), 2),
        ("vision_config.hidden_size x spatial_merge_size^2 (merger)", big, ("vis_embed", "vis_mlp"), 0),
        ("vision_config.hidden_size x spatial_merge_size^2 (merger)", big, ("vis_embed", "vis_mlp"), 1),
        ("vision_config.patch_dim", v.patch_dim, ("patch_in", "vis_embed"), 0),
        ("vision_config.out_hidden_size", v.out_hidden_size, ("vis_mlp", "embed"), 1),
    ]
    return out


def batch_checks(batch_size: int | None, seq_len: int | None) -> list[tuple[str, int, tuple[str | None, ...], int]]:
    """(batch dimension, size, logical axes, dimension) for the batch shape's split dimensions."""
    out = []
    if batch_size is not None:
        out.append(("batch rows (micro batch x data parallel)", batch_size, ("act_batch", "act_norm_seq", "act_embed"), 0))
    if seq_len is not None:
        out += [("sequence length", seq_len, ("act_batch", "act_norm_seq", "act_embed"), 1),
                ("sequence length", seq_len, ("act_batch", "act_seq", "act_heads", "act_head_dim"), 1)]
    if batch_size is not None and seq_len is not None:
        out.append(("MoE token rows (batch rows x sequence)", batch_size * seq_len, ("act_tokens", "act_embed"), 0))
    return out


def _mesh_shape(layout: Layout, mesh: Mesh | None, num_devices: int | None, errors: list[str]) -> dict[str, int] | None:
    if mesh is not None:
        return {a: int(n) for a, n in mesh.shape.items()}
    n = num_devices if num_devices is not None else jax.device_count()
    try:
        return resolve_mesh_shape(layout.mesh, n, layout.name)
    except ValueError as e:
        errors.append(str(e))
        return None


def _rule_errors(layout: Layout) -> list[str]:
    errors = []
    for name, axes in layout.rules:
        if name not in parallelism.LOGICAL_AXES:
            errors.append(f"rule [{name}, ...]: unknown logical axis '{name}' (known: {', '.join(parallelism.LOGICAL_AXES)})")
        bad = [a for a in flat_axes(axes) if a not in MESH_AXES]
        if bad:
            errors.append(f"rule [{name}, {axes}]: unknown mesh axes {bad} (mesh axes: {', '.join(MESH_AXES)})")
    return errors


def _describe(axes: tuple[str, ...], shape: dict[str, int]) -> str:
    return " x ".join(f"{a}={shape[a]}" for a in axes)


def validate_layout(model: Any, layout: Layout, mesh: Mesh | None = None, batch_size: int | None = None,
                    seq_len: int | None = None, *, num_devices: int | None = None) -> list[str]:
    """Check ``layout`` (over ``mesh``, or its own mesh shape over ``num_devices``, default all
    devices) against ``model`` (a ModelConfig) and the global batch shape ``[batch_size, seq_len]``
    of one microbatch step. Raises LayoutError listing every problem; returns the warnings."""
    errors = _rule_errors(layout)
    shape = _mesh_shape(layout, mesh, num_devices, errors)
    warnings: list[str] = []
    if shape is not None and not errors:
        seen = set()
        for what, size, axes, dim in model_checks(model) + batch_checks(batch_size, seq_len):
            split = _split(axes, dim, layout.rules, shape)
            n = math.prod(shape[a] for a in split)
            if n > 1 and size % n and (what, split) not in seen:
                seen.add((what, split))
                msg = (f"{what} = {size} does not divide over the {n} devices of mesh axes {_describe(split, shape)} "
                       f"that logical axis '{axes[dim]}' maps to")
                if axes[dim] in ("kv_heads", "act_kv_heads"):
                    msg += f"; {KV_HINT}"
                else:
                    msg += f"; change the rule for '{axes[dim]}' or the mesh, or make it a multiple of {n}"
                errors.append(msg)
        if layout.options.pipeline is not None:
            try:
                from parallelism.pipeline import pipeline_config

                pipeline_config(layout.options, shape.get("stage", 1))
            except ValueError as e:
                errors.append(str(e))
        warnings = _warnings(model, layout, shape)
    if errors:
        raise LayoutError(f"layout '{layout.name}' does not fit model '{getattr(model, 'name', '') or 'model'}'"
                          + (f" on mesh {_describe(tuple(a for a in shape if shape[a] > 1), shape) or '1 device'}"
                             if shape else "") + ":\n  " + "\n  ".join(errors))
    for w in warnings:
        log.warning("layout %s: %s", layout.name, w)
    return warnings


def _warnings(model: Any, layout: Layout, shape: dict[str, int]) -> list[str]:
    out = []
    t = model.text_config
    experts = ("layers", "exp", "embed", None, "moe_mlp")
    if "moe" in set(t.layer_kinds):
        ep_axes, etp_axes = _split(experts, 1, layout.rules, shape), _split(experts, 4, layout.rules, shape)
        ep, etp = (math.prod(shape[a] for a in ax) for ax in (ep_axes, etp_axes))
        if etp > 1 and t.num_experts % (ep * etp) == 0:
            out.append(f"expert tensor parallelism over {_describe(etp_axes, shape)} while the {t.num_experts} experts "
                       f"would divide over EP = {ep * etp} alone; the guide prefers EP (whole experts, no per-layer "
                       f"gather / reduce-scatter of tokens over the ETP group): map 'exp' over those axes instead of "
                       f"'moe_mlp'")
        tokens = _split(("act_tokens", "act_embed"), 0, layout.rules, shape)
        rows = (_split(("act_batch", "act_norm_seq", "act_embed"), 0, layout.rules, shape)
                + _split(("act_batch", "act_norm_seq", "act_embed"), 1, layout.rules, shape))
        if tokens != rows:
            out.append(f"MoE token rows are split over {tokens or '()'} but the residual stream's [batch, sequence] "
                       f"over {rows or '()'}: every MoE layer reshuffles its rows; set act_tokens to {list(rows)}")
    return out
