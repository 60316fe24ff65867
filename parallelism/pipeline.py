"""Pipeline parallelism in the GSPMD style: a layer stack split into stages over the ``stage`` mesh
axis, the batch split into microbatches, GPipe and circular (interleaved) schedules.

How it maps onto the mesh (no shard_map: everything is one SPMD program that XLA partitions):

- A stack's parameters ``[n, ...]`` (logical axis ``layers`` or ``vis_layers`` mapped to ``stage``)
  are arranged as ``[S, R, c, ...]``: stage ``s`` runs chunks ``k = r * S + s`` (``r < R`` repeats)
  of ``c`` consecutive layers each; dim 0 is pinned to ``stage``. GPipe is ``R = 1``; the circular
  schedule (``R > 1``) gives each stage ``R`` non-contiguous chunks and sends every microbatch
  around the ring ``R`` times, dividing the bubble by ``R``.
- A state buffer ``[S, mb, ...]`` holds the activation each stage works on. One iteration runs
  ``vmap`` over stages (``spmd_axis_name="stage"``, so each device runs only its stage; the stage
  body is a scan over its ``c`` layers with the remat policy) and then rolls the buffer by one
  stage (``jnp.roll`` on a stage-sharded dim: a collective-permute). Iterations are a
  ``lax.scan``: compile time does not grow with microbatches. ``T = R * M + S - 1`` iterations.
- Microbatch ``m`` of repeat ``r`` enters stage 0 at iteration ``r * M + m``. The I/O buffer
  ``[S, M, mb, ...]`` is only meaningful in its stage-0 slot (so feeding and collecting stay on the
  stage-0 devices): it holds the inputs, receives the last stage's outputs as they come round the
  ring, feeds them back for the next repeat (circular; needs ``M >= S``) and holds the final
  outputs. Backward is autodiff of the loop (all forwards, then all backwards).
- Microbatch ``m`` takes rows ``m, m + M, m + 2M, ...`` of the batch, so each microbatch's rows stay
  spread over the data axes. Batch-dependent side inputs (rotary tables, segment ids, DeepStack
  addends) are split alike; each stage picks its microbatch's slice every iteration.
- Inside the stages the layout's rules are used with ``stage`` removed from every entry (the stage
  axis is taken by the vmapped dim), so ``act_batch: [stage, data, fsdp]`` means "data parallel over
  every device" for the embedding, vision tower and LM head outside the pipeline and "microbatch
  rows over data x fsdp" inside it. Expert parallelism inside stages works as everywhere: the
  dispatcher's shard_map is batched over the stage dim by vmap's ``spmd_axis_name``.
- Uneven stages: ``stage_layers`` gives the layer count of each chunk (``S * R`` entries, in chunk
  order, summing to the model's layer count for that axis); shorter chunks are padded to the
  longest with masked identity slots (the slot runs a real layer's weights, its result is
  discarded by a select: no gradient reaches it). Stacks that are one run of layers inside a longer
  decoder (dense / MoE groups) take the intersection of their layers with each chunk.

Options (a layout's ``options.pipeline``): ``microbatches`` (default = stages; a run's config takes the
nearest count that fits its batch rows when this one does not: :func:`fit_microbatches`), ``schedule``
(``gpipe`` | ``circular``), ``repeats`` (circular; default 2), ``stage_layers`` (a list for the
decoder's ``layers`` axis, or ``{axis_name: list}``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from moevlm_jax.parallelism import logical
from moevlm_jax.parallelism.layout import PipelineOptions

log = logging.getLogger(__name__)

STAGE_AXIS = "stage"
SCHEDULES: tuple[str, ...] = ("gpipe", "circular")
PyTree = Any
LayerFn = Callable[[PyTree, PyTree, PyTree, PyTree], tuple[PyTree, PyTree]]
U = PartitionSpec.UNCONSTRAINED


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """A pipeline schedule: ``stages`` x ``repeats`` chunks, ``microbatches`` per batch, and
    optional per-chunk layer counts keyed by logical stack axis."""

    stages: int
    microbatches: int
    schedule: str = "gpipe"
    repeats: int = 1
    stage_layers: tuple[tuple[str, tuple[int, ...]], ...] = ()

    @property
    def chunks(self) -> int:
        """Layer chunks in the schedule (stages x repeats)."""
        return self.stages * self.repeats

    @property
    def iterations(self) -> int:
        """Loop iterations: ``microbatches * repeats + stages - 1``."""
        return self.microbatches * self.repeats + self.stages - 1

    def layers_for(self, axis: str) -> tuple[int, ...] | None:
        """The per-chunk layer counts given for stack axis ``axis``, or None (even split)."""
        return dict(self.stage_layers).get(axis)


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """Idle fraction of a (balanced) schedule: ``(S - 1) / (M * R + S - 1)``."""
    return (stages - 1) / (microbatches * repeats + stages - 1)


def pipeline_config(options: Any, stages: int, layer_counts: Mapping[str, int] | None = None) -> PipelineConfig:
    """The schedule a layout's options (``parallelism.layout.LayoutOptions``; its ``pipeline``) give a
    ``stages``-stage mesh, checked (and, given the model's ``layer_counts`` per stack axis, e.g.
    ``{"layers": 48}``, that stage_layers sum to them)."""
    raw = getattr(options, "pipeline", None) or PipelineOptions()
    schedule = raw.schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {SCHEDULES}, got {schedule!r}")
    repeats = int(raw.repeats if raw.repeats is not None else (2 if schedule == "circular" else 1))
    micro = int(raw.microbatches if raw.microbatches is not None else stages)
    if schedule == "gpipe" and repeats != 1:
        raise ValueError(f"pipeline: schedule 'gpipe' runs each stage once (repeats 1), got repeats {repeats}; "
                         f"use schedule 'circular' for repeats > 1")
    if repeats < 1 or micro < 1:
        raise ValueError(f"pipeline: repeats ({repeats}) and microbatches ({micro}) must be >= 1")
    if repeats > 1 and micro < stages:
        raise ValueError(f"pipeline: the circular schedule needs microbatches >= stages (a microbatch must leave "
                         f"the last stage before it re-enters the first), got {micro} < {stages}")
    table = []
    for axis, counts in sorted(raw.stage_layers_by_axis().items()):
        counts = tuple(int(c) for c in counts)
        if len(counts) != stages * repeats or min(counts) < 0:
            raise ValueError(f"pipeline: stage_layers[{axis}] needs stages x repeats = {stages * repeats} "
                             f"non-negative counts (chunk k runs on stage k % {stages}), got {list(counts)}")
        total = (layer_counts or {}).get(axis)
        if total is not None and sum(counts) != total:
            raise ValueError(f"pipeline: stage_layers[{axis}] {list(counts)} sum to {sum(counts)}, but the model "
                             f"has {total} '{axis}' layers")
        table.append((str(axis), counts))
    return PipelineConfig(stages, micro, schedule, repeats, tuple(table))


def fit_microbatches(cfg: PipelineConfig, rows: int, shards: int) -> int:
    """The microbatch count nearest ``cfg.microbatches`` (a smaller one on a tie) that splits ``rows``
    batch rows into microbatches whose rows divide over the ``shards`` devices of the data axes inside
    a stage, and that the schedule allows (circular: at least the stage count). ``cfg.microbatches``
    itself when it fits; ValueError saying why when none does."""
    fits = [m for m in range(1, rows + 1) if rows % m == 0 and (rows // m) % shards == 0
            and (cfg.repeats == 1 or m >= cfg.stages)]
    if cfg.microbatches in fits:
        return cfg.microbatches
    if not fits:
        least = cfg.stages if cfg.repeats > 1 else 1
        need = (f"the {cfg.schedule} schedule needs at least {least} microbatches (stages) of a multiple of "
                f"{shards} rows" if cfg.repeats > 1 else "a microbatch's rows must divide over them")
        raise ValueError(f"pipeline: no microbatch count fits {rows} batch rows (micro batch x data parallel) over "
                         f"the {shards} devices of the data axes inside a stage: {need}; make the rows a multiple "
                         f"of {least * shards} (train.global_batch_size, train.micro_batch_size) or use fewer "
                         f"stages or data-parallel devices")
    return min(fits, key=lambda m: (abs(m - cfg.microbatches), m))


def _stage_size(ctx: logical.ShardingContext, axis: str) -> int:
    mapped = logical.mesh_axes_for(axis, ctx.rules)
    flat = () if mapped is None else ((mapped,) if isinstance(mapped, str) else tuple(mapped))
    if STAGE_AXIS not in flat:
        return 1
    if flat != (STAGE_AXIS,):
        raise ValueError(f"pipeline: logical axis '{axis}' maps to {flat}; a pipelined stack axis maps to "
                         f"'{STAGE_AXIS}' alone")
    return ctx.mesh.shape[STAGE_AXIS]


def active_config(axis: str) -> PipelineConfig | None:
    """The pipeline for a stack whose leading logical axis is ``axis`` under the active sharding
    context, or None when the layout does not map it onto a ``stage`` axis of size > 1."""
    ctx = logical.current()
    if ctx is None or logical.in_manual_region():
        return None
    stages = _stage_size(ctx, axis)
    if stages <= 1:
        return None
    return pipeline_config(ctx.options, stages)


def inner_rules(rules: logical.Rules) -> logical.Rules:
    """The rules with the stage axis removed from every entry (inside a stage it is taken)."""
    out = []
    for name, axes in rules:
        flat = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        kept = tuple(a for a in flat if a != STAGE_AXIS)
        out.append((name, None if not kept else (kept[0] if len(kept) == 1 else kept)))
    return tuple(out)


def chunk_layers(n: int, offset: int, cfg: PipelineConfig, axis: str) -> np.ndarray:
    """Layers of a stack of ``n`` (global layers ``offset .. offset + n - 1``) in each chunk:
    ``[S * R, 2]`` int (first local layer, count), chunk ``k`` on stage ``k % S``, repeat ``k // S``."""
    c = cfg.chunks
    given = cfg.layers_for(axis)
    if given is None:
        sizes = np.full(c, n // c) + (np.arange(c) < n % c)  # as even as possible
        bounds = np.concatenate([[0], np.cumsum(sizes)])
    else:
        total = int(sum(given))
        if offset + n > total:
            raise ValueError(f"pipeline: stage_layers[{axis}] covers {total} layers, but the model has layers "
                             f"up to {offset + n}; the counts must sum to the layer count")
        bounds = np.clip(np.concatenate([[0], np.cumsum(given)]) - offset, 0, n)
    return np.stack([bounds[:-1], bounds[1:] - bounds[:-1]], axis=1).astype(np.int64)


# ----------------------------------------------------------------------------- helpers

def _pin(x: jax.Array, mesh: Any, dims: Mapping[int, Any]) -> jax.Array:
    """Constrain the named ``dims`` of x (others unconstrained)."""
    spec = [dims.get(d, U) for d in range(x.ndim)]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(*spec)))


def _split(x: jax.Array, axis: int, m: int) -> jax.Array:
    """``[.., B, ..]`` (batch at ``axis``) -> ``[M, .., B / M, ..]``; microbatch i = rows i, i+M, ..."""
    b = x.shape[axis]
    x = x.reshape(x.shape[:axis] + (b // m, m) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis + 1, 0)


def _merge(x: jax.Array, axis: int) -> jax.Array:
    """Inverse of :func:`_split`: microbatch dim 0 back into the batch at ``axis`` (of the result)."""
    m = x.shape[0]
    x = jnp.moveaxis(x, 0, axis + 1)
    return x.reshape(x.shape[:axis] + (x.shape[axis] * m,) + x.shape[axis + 2:])


def _arrange(a: jax.Array, chunks: np.ndarray, cfg: PipelineConfig, width: int) -> jax.Array:
    """Per-layer ``[n, ...]`` -> ``[S, R, width, ...]`` (chunk k = r * S + s at ``[s, r]``)."""
    s, r = cfg.stages, cfg.repeats
    n = a.shape[0]
    if np.all(chunks[:, 1] == width) and n == width * s * r:  # even: a reshape (no data movement)
        out = a.reshape((r, s, width) + a.shape[1:])
    else:
        idx = np.minimum(chunks[:, :1] + np.arange(width)[None], max(n - 1, 0)).reshape(r, s, width)
        out = jnp.take(a, jnp.asarray(idx), axis=0)
    return jnp.swapaxes(out, 0, 1) if r > 1 else out.reshape((s, 1, width) + a.shape[1:])


def describe(cfg: PipelineConfig, chunks: np.ndarray) -> str:
    """One log line: schedule, chunks, bubble and padding fractions."""
    width = max(int(chunks[:, 1].max()), 1)
    padding = 1.0 - chunks[:, 1].sum() / (width * len(chunks))
    return (f"{cfg.schedule}: {cfg.stages} stages x {cfg.repeats} repeats, {cfg.microbatches} microbatches, "
            f"{cfg.iterations} iterations, layers per chunk {chunks[:, 1].tolist()}; bubble fraction "
            f"{bubble_fraction(cfg.stages, cfg.microbatches, cfg.repeats):.3f}, padding fraction {padding:.3f}")


# ----------------------------------------------------------------------------- the loop

def run_pipeline(layer_fn: LayerFn, params: PyTree, carry: PyTree, xs: PyTree, side: PyTree, side_axes: Any,
                 cfg: PipelineConfig, *, axis: str = "layers", offset: int = 0, scan: bool = True) -> tuple[PyTree,
                                                                                                            PyTree]:
    """Pipelined ``for i in range(n): carry, y_i = layer_fn(carry, params[i], xs[i], side)``.

    params/xs: leaves ``[n, ...]``; carry: leaves ``[B, ...]``; side: batch-dependent inputs whose
    batch axis is ``side_axes`` (an int or a prefix pytree of ints); y leaves ``[B, ...]`` per layer.
    Returns the final carry (leaves ``[B, ...]``) and ys with leaves ``[n, B, ...]`` (or None).
    """
    ctx = logical.current()
    mesh, s_, m_, r_ = ctx.mesh, cfg.stages, cfg.microbatches, cfg.repeats
    n = jax.tree.leaves(params)[0].shape[0]
    chunks = chunk_layers(n, offset, cfg, axis)
    width = max(int(chunks[:, 1].max()), 1)
    padded = bool(np.any(chunks[:, 1] != width))
    log.info("pipeline over '%s' (layers %d..%d) %s", axis, offset, offset + n - 1, describe(cfg, chunks))

    rules = inner_rules(ctx.rules)
    batch_axes = tuple(a for a in logical.flat_axes(logical.mesh_axes_for("act_batch", rules)) if mesh.shape[a] > 1)
    batch_entry = None if not batch_axes else (batch_axes[0] if len(batch_axes) == 1 else batch_axes)
    rows = jax.tree.leaves(carry)[0].shape[0]
    shards = math.prod(mesh.shape[a] for a in batch_axes)
    if rows % m_ or (rows // m_) % shards:
        raise ValueError(f"pipeline: {rows} batch rows must split into {m_} microbatches whose rows divide over "
                         f"the data axes {batch_axes} ({shards} devices); change the batch size or "
                         f"options.pipeline.microbatches")

    idx = jnp.asarray(np.arange(n, dtype=np.int32)) if xs is None else xs
    slot_valid = (np.arange(width)[None] < chunks[:, 1:]).reshape(r_, s_, width).swapaxes(0, 1)
    weights = jax.tree.map(lambda a: _pin(_arrange(a, chunks, cfg, width), mesh, {0: STAGE_AXIS}), params)
    layer_xs = jax.tree.map(lambda a: _arrange(a, chunks, cfg, width), idx)
    valid = jnp.asarray(slot_valid)

    # microbatched inputs: io [S, M, mb, ...] (stage-0 slot real), side [M, ..., mb, ...]
    def to_io(a):
        mbs = _split(a, 0, m_)
        io = jnp.concatenate([mbs[None], jnp.zeros((s_ - 1,) + mbs.shape, mbs.dtype)])
        return _pin(io, mesh, {0: STAGE_AXIS, 1: None, 2: batch_entry})

    io = jax.tree.map(to_io, carry)
    state = jax.tree.map(lambda a: _pin(jnp.zeros_like(a[:, 0]), mesh, {0: STAGE_AXIS, 1: batch_entry}), io)
    side_axes = jax.tree.broadcast(side_axes, side) if side is not None else None
    side_mb = jax.tree.map(lambda a, ax: _pin(_split(a, ax, m_), mesh, {0: None, ax + 1: batch_entry}), side, side_axes)

    def stage_fn(w, lx, ok, rep, h, sd):
        if r_ > 1:
            w, lx, ok = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, rep, 0, keepdims=False), (w, lx, ok))
        else:
            w, lx, ok = jax.tree.map(lambda a: a[0], (w, lx, ok))

        def slot(hh, inputs):
            lw, x, v = inputs
            new, y = layer_fn(hh, lw, x, sd)
            if padded:
                new = jax.tree.map(lambda a, b: jnp.where(v, a, b), new, hh)
            return new, y

        if scan:
            return jax.lax.scan(slot, h, (w, lx, ok))
        ys = []
        for j in range(width):
            h, y = slot(h, jax.tree.map(lambda a, j=j: a[j], (w, lx, ok)))
            ys.append(y)
        return h, (jax.tree.map(lambda *a: jnp.stack(a), *ys) if ys[0] is not None else None)

    stages_v = jax.vmap(stage_fn, spmd_axis_name=STAGE_AXIS)
    stage_ids = jnp.arange(s_)

    def iteration(loop, t):
        state, io = loop
        k = t - stage_ids
        mb_id, rep = k % m_, jnp.clip(k // m_, 0, r_ - 1)
        first = (stage_ids == 0)
        fresh = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, t % m_, 1, keepdims=False), io)
        h = jax.tree.map(lambda f, st: jnp.where(first.reshape((-1,) + (1,) * (st.ndim - 1)), f, st), fresh, state)
        sd = jax.tree.map(lambda a, ax: _pin(jnp.take(a, mb_id, axis=0), mesh, {0: STAGE_AXIS, ax + 1: batch_entry}),
                          side_mb, side_axes)
        out, y = stages_v(weights, layer_xs, valid, rep, h, sd)
        out = jax.tree.map(lambda a: _pin(jnp.roll(a, 1, axis=0), mesh, {0: STAGE_AXIS, 1: batch_entry}), out)
        done, write = (t - (s_ - 1)) % m_, t >= s_ - 1

        def put(buf, o):
            old = jax.lax.dynamic_index_in_dim(buf, done, 1, keepdims=False)
            return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(write, o, old), done, 1)

        return (out, jax.tree.map(put, io, out)), y

    with logical.sharding_context(mesh, rules, ctx.options):
        (_, io), ys = jax.lax.scan(iteration, (state, io), jnp.arange(cfg.iterations))
    carry = jax.tree.map(lambda a: _merge(a[0], 0), io)
    if ys is None or not jax.tree.leaves(ys):
        return carry, None
    # layer i of chunk k (slot j) ran microbatch m at iteration r * M + m + s on stage s = k % S
    layer_chunk = np.repeat(np.arange(len(chunks)), chunks[:, 1])
    layer_slot = np.arange(n) - chunks[layer_chunk, 0]
    stage, rep = layer_chunk % s_, layer_chunk // s_
    t_idx = (rep * m_ + stage)[:, None] + np.arange(m_)[None]
    ys = jax.tree.map(lambda a: _merge(jnp.swapaxes(a[t_idx, stage[:, None], layer_slot[:, None]], 0, 1), 1), ys)
    return carry, ys
