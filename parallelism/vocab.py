"""Vocabulary-parallel embedding lookup.

GSPMD partitions ``jnp.take(table, ids)`` poorly when the table is sharded (measured on XLA:CPU:
with the table split over vocab x embed it all-gathers the token ids over the batch axes, looks up
every row of the global batch and all-reduces ``[B, S, H]``). :func:`embed_lookup` does what
Megatron's ``VocabParallelEmbedding`` does, inside ``shard_map``: the table keeps its vocabulary
shard, each device looks up the token ids that fall in its vocabulary range (zeros elsewhere), and
the partial rows are summed over the vocabulary axes: a reduce-scatter along the sequence when the
output is sequence-parallel over those axes (SP), else an all-reduce. Its FSDP-split embed
dimension is not gathered either where the ids are split over the same axes (every preset): the
ids are gathered over them instead, each device looks up its embed columns of all their rows, and an
all-to-all gives every device its own tokens' whole rows. For a [V, H] table and T tokens a device,
that moves ~2 T H elements (forward and backward) where gathering the table moved V H and its
gradient's all-reduce 2 V H in float32 (Qwen3-VL-30B-A3B: V H = 311M, T H = 8.4M a 4096-token row).
Backward: the table's gradient is a local scatter-add into its own shard, accumulated in float32
(:func:`take_rows`).

The LM head and cross-entropy need no such help: GSPMD splits the logits over the vocabulary and
reduces the logsumexp and the target logit across shards (``moevlm_jax.model.loss``;
``tests/parallelism/test_layouts.py`` checks the HLO has no vocabulary-sized all-gather).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from moevlm_jax.parallelism import logical
from moevlm_jax.parallelism.dispatch import shard_map_unchecked

OUT_AXES = ("act_batch", "act_norm_seq", "act_embed")  # the decoder's residual stream


def _entry(axes: Sequence[str]) -> object:
    axes = tuple(axes)
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``jnp.take(table, ids, axis=0)`` whose table gradient is scatter-added in float32 and cast once.
    Autodiff's own transpose scatter-adds in the table's dtype: for a bf16 table every update is a
    16-bit read-modify-write (XLA:GPU emits it as a compare-and-swap loop, the step's largest
    scatter: ~10 ms at the proxy's MBS 8, bench/results/step.md) and repeated tokens lose bits
    as they are summed in bf16. Out-of-range ids: zero rows, their gradient dropped, as ``jnp.take``."""
    return _take_rows(table.shape[0], table, ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _take_rows(vocab: int, table: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table, ids, axis=0)


def _take_rows_fwd(vocab, table, ids):
    return jnp.take(table, ids, axis=0), ids


def _take_rows_bwd(vocab, ids, g):
    rows = g.reshape(-1, g.shape[-1]).astype(jnp.float32)
    grad = jnp.zeros((vocab, g.shape[-1]), jnp.float32).at[ids.reshape(-1)].add(rows, mode="drop")
    return grad.astype(g.dtype), None


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


class LookupAxes(NamedTuple):
    """How :func:`embed_lookup` splits its work over the mesh (axis-name tuples)."""

    batch: tuple[str, ...]  # the ids' (and rows') batch axes
    ids_seq: tuple[str, ...]  # the ids' sequence axes
    scatter: tuple[str, ...]  # sequence axes the rows are reduce-scattered over (SP)
    parallel: tuple[str, ...]  # vocabulary axes each device looks up its own range on
    reduce: tuple[str, ...]  # vocabulary axes the partial rows are summed over
    spread: tuple[str, ...]  # the table's embed axes: ids gathered, rows returned by all-to-all (FSDP)


def lookup_axes(rules, mesh, table_axes: Sequence[str | None] = ("vocab", "embed"),
                out_axes: Sequence[str | None] = OUT_AXES) -> LookupAxes | None:
    """The lookup's axes under ``rules`` over ``mesh`` (a Mesh, or anything with its ``shape``: the
    planner's), or None for an embed-sharded output (no layout of ours: left to GSPMD)."""
    out = tuple(logical.logical_to_spec(out_axes, rules, mesh))
    out = out + (None,) * (3 - len(out))
    batch, seq, embed = (logical.flat_axes(e) for e in out)
    if embed:
        return None
    table_spec = tuple(logical.logical_to_spec(table_axes, rules, mesh)) + (None, None)
    vocab, table_embed = logical.flat_axes(table_spec[0]), logical.flat_axes(table_spec[1])
    # sequence axes the rows are reduce-scattered over: a trailing run of the sequence entry that the
    # table's vocabulary is split over (SP: sequence over the tensor axis, vocabulary too)
    scatter: tuple[str, ...] = ()
    while len(scatter) < len(seq) and seq[len(seq) - len(scatter) - 1] in vocab:
        scatter = (seq[len(seq) - len(scatter) - 1],) + scatter
    ids_seq = seq[:len(seq) - len(scatter)]
    # vocabulary axes the ids are split over cannot hold vocabulary shards here: gather those
    parallel = tuple(a for a in vocab if a not in batch + ids_seq)
    reduce = tuple(a for a in parallel if a not in scatter)
    # FSDP: the table's embed dimension split over axes the token ids are split over too. Rather than
    # gather the table (and, backward, all-reduce a whole float32 [V, H] gradient), the ids are gathered
    # over those axes, each device looks up its embed columns for all of them and an all-to-all returns
    # every device its own tokens' whole rows; the gradient is a local scatter-add into the table's shard
    spread = table_embed if table_embed and set(table_embed) <= set(batch + ids_seq) else ()
    return LookupAxes(batch, ids_seq, scatter, parallel, reduce, spread)


def embed_lookup(table: jax.Array, ids: jax.Array, table_axes: Sequence[str | None] = ("vocab", "embed"),
                 out_axes: Sequence[str | None] = OUT_AXES) -> jax.Array:
    """table ``[V, H]``, ids ``[B, S]`` int -> rows ``[B, S, H]`` (table dtype), sharded as ``out_axes``
    under the active layout; a plain :func:`take_rows` without one (or inside ``shard_map``)."""
    ctx = logical.current()
    if ctx is None or logical.in_manual_region():
        return take_rows(table, ids)
    ax = lookup_axes(ctx.rules, ctx.mesh, table_axes, out_axes)
    if ax is None:
        return logical.constrain(take_rows(table, ids), out_axes)
    v_local = table.shape[0] // logical.axis_size(ctx.mesh, ax.parallel or None)

    def lookup(tbl, idx):
        if not ax.parallel:
            return take_rows(tbl, idx)
        local = idx - jax.lax.axis_index(ax.parallel) * v_local
        inside = (local >= 0) & (local < v_local)
        rows = take_rows(tbl, jnp.clip(local, 0, v_local - 1))
        rows = jnp.where(inside[..., None], rows, jnp.zeros((), rows.dtype))
        if ax.reduce:
            rows = jax.lax.psum(rows, ax.reduce)
        if ax.scatter:
            rows = jax.lax.psum_scatter(rows, ax.scatter, scatter_dimension=rows.ndim - 2, tiled=True)
        return rows

    def body(tbl, idx):
        with logical.manual_region():
            if not ax.spread:
                return lookup(tbl, idx)
            every = jax.lax.all_gather(idx, ax.spread)  # [D, b, s]: the ids of the D devices of the group
            rows = jax.lax.all_to_all(lookup(tbl, every), ax.spread, 0, 0)  # [D, b, s', H / D] from each device
            return jnp.moveaxis(rows, 0, -2).reshape(*rows.shape[1:-1], -1)  # [b, s', H], columns in order

    # the mesh's size-1 axes named on the table too: its gradient needs no sum over them (shard_map's transpose
    # would otherwise emit an all-reduce over groups of one device, a copy of the gradient shard on XLA:CPU)
    ones = tuple(a for a in ctx.mesh.axis_names if ctx.mesh.shape[a] == 1)
    in_specs = (PartitionSpec(_entry(ax.parallel + ones), _entry(ax.spread)),
                PartitionSpec(_entry(ax.batch), _entry(ax.ids_seq)))
    out_spec = PartitionSpec(_entry(ax.batch), _entry(ax.ids_seq + ax.scatter), None)
    return shard_map_unchecked(body, ctx.mesh, in_specs, out_spec)(table, ids)
