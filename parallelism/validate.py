"""Layout validation before compiling: does this layout fit this model, mesh and batch shape?

:func:`validate_layout` checks, and reports every problem at once in one :class:`LayoutError`
whose lines name the model field (or batch dimension), its size, the logical axis, the mesh axes
and their sizes, and what to change:

- the mesh: known mesh axes, one ``-1`` at most, axis sizes multiplying to the device count;
- the rules: known logical-axis names (``parallelism.LOGICAL_AXES``) and mesh-axis names;
- divisibility of every model dimension a rule splits: attention heads, KV heads (with the
  replication hint below), head_dim, hidden sizes, MLP / expert intermediate sizes, experts,
  vocabulary, and the vision tower's heads / widths; the same for the activation axes;
- Qwen3.5-MoE's hybrid decoder (a text config with ``linear_num_key_heads``): the Gated DeltaNet key
  and value heads (both split along ``q_heads`` / ``act_heads``, as the layer stores them per key-head
  group) and head widths, and the shared expert's width (``mlp`` / ``act_mlp``);
- divisibility of the batch shape: rows over ``act_batch``, the sequence over ``act_norm_seq`` /
  ``act_seq`` (sequence and context parallelism), MoE token rows over ``act_tokens``; under context
  parallelism each sequence shard must hold the GDN conv's window (``linear_conv_kernel_dim - 1``
  tokens: it is passed on from the previous shard);
- the pipeline options (``parallelism.pipeline.pipeline_config``), when the layout has them, and
  every decoder stack (a run of consecutive layers of one kind: dense / MoE, or Qwen3.5's
  linear / full attention) dividing over the mesh axes ``layers`` maps to (its weights are stored
  split over the stages). :func:`fit_pipeline` (the run config's step before validating) first moves a
  pipeline's microbatch count to the nearest that fits the batch rows, saying so.

KV heads fewer than the tensor axis (e.g. 4 KV heads, TP 8) are an error, not silently replicated:
the message says to map ``kv_heads`` and ``act_kv_heads`` to null (each tensor rank then computes
every KV head, as Megatron does when TP > query groups) or to lower TP.

Warnings (logged and returned): expert tensor parallelism while expert parallelism alone would fit
(Megatron Bridge's guide: prefer EP to ETP), and MoE token rows sharded otherwise than the batch
and residual-sequence axes (every MoE layer then reshuffles its rows).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

import moevlm_jax.parallelism as parallelism
from moevlm_jax.parallelism.layout import MESH_AXES, Layout, PipelineOptions, resolve_mesh_shape
from moevlm_jax.parallelism.logical import Rules, flat_axes, logical_to_spec, mesh_axes_for
from moevlm_jax.parallelism.pipeline import fit_microbatches, inner_rules, pipeline_config

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
        ("text_config.num_attention_heads", t.num_attention_heads, ("act_batch", "act_seq", "act_heads",
                                                                    "act_head_dim"), 2),
        ("text_config.num_key_value_heads", t.num_key_value_heads, ("act_batch", "act_seq", "act_kv_heads",
                                                                    "act_head_dim"), 2),
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
    out += _hybrid_checks(t)
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


def _hybrid_checks(t: Any) -> list[tuple[str, int, tuple[str | None, ...], int]]:
    """Qwen3.5's Gated DeltaNet heads / widths and shared expert (model.qwen3_5_gdn, qwen3_5_decoder):
    in_proj_qkv ``[layers, embed, Hk, G]`` and the conv ``[layers, K, Hk, G]`` split Hk along q_heads,
    in_proj_z ``[layers, embed, Hv, Dv]`` / out_proj split Hv (and Dv along head_dim); inside the layer
    q / k ``[B, S, Hk, Dk]``, v / z ``[B, S, Hv, Dv]`` and the gates ``[B, S, Hv]`` along act_heads."""
    if getattr(t, "linear_num_key_heads", None) is None:
        return []
    out = []
    if "linear_attention" in set(getattr(t, "layer_types", ()) or ()):
        hk, hv = t.linear_num_key_heads, t.linear_num_value_heads
        qkv, z = ("layers", "embed", "q_heads", None), ("layers", "embed", "q_heads", "head_dim")
        heads = ("act_batch", "act_seq", "act_heads", "act_head_dim")
        out += [("text_config.linear_num_key_heads (GDN query / key heads)", hk, qkv, 2),
                ("text_config.linear_num_value_heads (GDN value heads)", hv, z, 2),
                ("text_config.linear_value_head_dim", t.linear_value_head_dim, z, 3),
                ("text_config.hidden_size", t.hidden_size, qkv, 1),
                ("text_config.linear_num_key_heads (GDN query / key heads)", hk, heads, 2),
                ("text_config.linear_num_value_heads (GDN value heads)", hv, heads, 2),
                ("text_config.linear_key_head_dim", t.linear_key_head_dim, heads, 3),
                ("text_config.linear_value_head_dim", t.linear_value_head_dim, heads, 3)]
    width = getattr(t, "shared_expert_intermediate_size", 0) or 0
    if width:
        out += [("text_config.shared_expert_intermediate_size", width, ("layers", "embed", "mlp"), 2),
                ("text_config.shared_expert_intermediate_size", width, ("act_batch", "act_seq", "act_mlp"), 2)]
    return out


def layer_stacks(t: Any) -> list[tuple[str, int, int]]:
    """The decoder's stacks: ``(kind, first layer, count)`` per run of consecutive layers of one kind
    (Qwen3.5: ``layer_types``; Qwen3-VL: dense / MoE ``layer_kinds``), as the model stores them."""
    import itertools

    kinds = tuple(getattr(t, "layer_types", None) or t.layer_kinds)
    out, first = [], 0
    for kind, run in itertools.groupby(kinds):
        n = len(list(run))
        out.append((kind, first, n))
        first += n
    return out


def _stack_errors(model: Any, layout: Layout, shape: dict[str, int]) -> list[str]:
    """Each decoder stack's layer count over the mesh axes ``layers`` maps to (pipeline stages)."""
    split = _split(("layers", "embed"), 0, layout.rules, shape)
    n = math.prod(shape[a] for a in split)
    if n <= 1:
        return []
    stacks = layer_stacks(model.text_config)
    bad = [(k, f, c) for k, f, c in stacks if c % n]
    if not bad:
        return []
    listed = ", ".join(f"layers {f}..{f + c - 1} ({c} {k})" for k, f, c in bad)
    return [f"decoder stacks {listed} do not divide over the {n} devices of mesh axes {_describe(split, shape)} that "
            f"logical axis 'layers' maps to: each run of consecutive layers of one kind is one stack whose weights "
            f"are stored split over the stages; use a layer pattern whose runs are multiples of {n}, or fewer stages"]


def batch_checks(batch_size: int | None, seq_len: int | None) -> list[tuple[str, int, tuple[str | None, ...], int]]:
    """(batch dimension, size, logical axes, dimension) for the batch shape's split dimensions."""
    out = []
    if batch_size is not None:
        out.append(("batch rows (micro batch x data parallel)", batch_size, ("act_batch", "act_norm_seq", "act_embed"),
                    0))
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
            errors.append(f"layout.rules [{name}, ...]: unknown logical axis '{name}' "
                          f"(known: {', '.join(parallelism.LOGICAL_AXES)})")
        bad = [a for a in flat_axes(axes) if a not in MESH_AXES]
        if bad:
            errors.append(f"layout.rules [{name}, {axes}]: unknown mesh axes {bad} (mesh axes: {', '.join(MESH_AXES)})")
    return errors


def _describe(axes: tuple[str, ...], shape: dict[str, int]) -> str:
    return " x ".join(f"{a}={shape[a]}" for a in axes)


def stage_row_axes(layout: Layout, shape: dict[str, int]) -> tuple[tuple[str, ...], int]:
    """The mesh axes (of size > 1) a pipeline microbatch's rows are split over inside a stage, and their
    device count."""
    inner = tuple(a for a in flat_axes(mesh_axes_for("act_batch", inner_rules(layout.rules))) if shape[a] > 1)
    return inner, math.prod(shape[a] for a in inner)


def fit_pipeline(layout: Layout, shape: dict[str, int], batch_size: int) -> tuple[Layout, str | None]:
    """``layout`` with its pipeline's microbatch count made to fit ``batch_size`` rows a microbatch step
    (micro batch x data parallel) over mesh ``shape``: unchanged (message None) when it fits or the mesh
    has no stages, else the nearest count that fits (``parallelism.pipeline.fit_microbatches``) and one
    line saying what changed and why. ValueError (the reason) when no count fits."""
    stages = shape.get("stage", 1)
    if stages <= 1:
        return layout, None
    cfg = pipeline_config(layout.options, stages)
    inner, shards = stage_row_axes(layout, shape)
    m = fit_microbatches(cfg, batch_size, shards)
    if m == cfg.microbatches:
        return layout, None
    pipe = dataclasses.replace(layout.options.pipeline or PipelineOptions(), microbatches=m)
    fitted = dataclasses.replace(layout, options=dataclasses.replace(layout.options, pipeline=pipe))
    if batch_size % cfg.microbatches:
        why = f"do not split into {cfg.microbatches} microbatches"
    else:
        why = (f"in {cfg.microbatches} microbatches of {batch_size // cfg.microbatches} rows do not divide over the "
               f"{shards} devices of {' x '.join(inner)} inside a stage")
    message = (f"layout {layout.name}: pipeline microbatches {cfg.microbatches} -> {m} "
               f"(layout.options.pipeline.microbatches): {batch_size} batch rows (micro batch x data parallel) "
               f"{why}; {m} microbatches of {batch_size // m} rows fit, the global batch is kept")
    return fitted, message


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
        errors += _stack_errors(model, layout, shape)
        errors += _context_errors(model, layout, shape, seq_len)
        if layout.options.pipeline is not None:
            try:

                cfg = pipeline_config(layout.options, shape.get("stage", 1))
                if batch_size is not None and cfg.stages > 1:  # what the schedule needs of the batch rows
                    inner, shards = stage_row_axes(layout, shape)
                    if batch_size % cfg.microbatches or (batch_size // cfg.microbatches) % shards:
                        errors.append(f"pipeline: {batch_size} batch rows (micro batch x data parallel) must split "
                                      f"into {cfg.microbatches} microbatches (layout.options.pipeline.microbatches) "
                                      f"whose rows divide over the data axes {inner} inside a stage ({shards} "
                                      f"devices); make the global batch a multiple of {cfg.microbatches * shards} "
                                      f"rows per step (train.global_batch_size) or change the microbatches")
            except ValueError as e:
                errors.append(str(e))
        warnings = _warnings(model, layout, shape)
    if errors:
        head = (f"layout '{layout.name}' does not fit model '{getattr(model, 'name', '') or 'model'}'"
                + (f" on mesh {_describe(tuple(a for a in shape if shape[a] > 1), shape) or '1 device'}" if shape
                   else ""))
        raise LayoutError(f"{head}: {errors[0]}" if len(errors) == 1 else head + ":\n  " + "\n  ".join(errors))
    for w in warnings:
        log.warning("layout %s: %s", layout.name, w)
    return warnings


def _context_errors(model: Any, layout: Layout, shape: dict[str, int], seq_len: int | None) -> list[str]:
    """Under context parallelism a GDN sequence shard receives the previous shard's last K - 1 conv
    inputs, so it must hold at least that many tokens (parallelism.context, model.qwen3_5_gdn)."""
    t = model.text_config
    if seq_len is None or "linear_attention" not in set(getattr(t, "layer_types", ()) or ()):
        return []
    split = _split(("act_batch", "act_seq", "act_heads", "act_head_dim"), 1, layout.rules, shape)
    n = math.prod(shape[a] for a in split)
    window = t.linear_conv_kernel_dim - 1
    if n > 1 and seq_len % n == 0 and seq_len // n < window:
        return [f"sequence length = {seq_len} over the {n} devices of mesh axes {_describe(split, shape)} that "
                f"logical axis 'act_seq' maps to leaves {seq_len // n} tokens a shard, fewer than the "
                f"{window} the GDN conv window (text_config.linear_conv_kernel_dim - 1) carries from one "
                f"shard to the next; use a longer sequence or a smaller context axis"]
    return []


def _warnings(model: Any, layout: Layout, shape: dict[str, int]) -> list[str]:
    out = []
    t = model.text_config
    experts = ("layers", "exp", "embed", None, "moe_mlp")
    if "moe" in set(t.layer_kinds):
        ep_axes, etp_axes = _split(experts, 1, layout.rules, shape), _split(experts, 4, layout.rules, shape)
        ep, etp = (math.prod(shape[a] for a in ax) for ax in (ep_axes, etp_axes))
        if etp > 1 and t.num_experts % (ep * etp) == 0:
            out.append(f"expert tensor parallelism over {_describe(etp_axes, shape)} while the {t.num_experts} "
                       f"experts would divide over EP = {ep * etp} alone; the guide prefers EP (whole experts, no "
                       "per-layer gather / reduce-scatter of tokens over the ETP group): map 'exp' over those axes "
                       "instead of 'moe_mlp'")
        tokens = _split(("act_tokens", "act_embed"), 0, layout.rules, shape)
        rows = (_split(("act_batch", "act_norm_seq", "act_embed"), 0, layout.rules, shape)
                + _split(("act_batch", "act_norm_seq", "act_embed"), 1, layout.rules, shape))
        if tokens != rows:
            out.append(f"MoE token rows are split over {tokens or '()'} but the residual stream's [batch, sequence] "
                       f"over {rows or '()'}: every MoE layer reshuffles its rows; set act_tokens to {list(rows)}")
    return out
