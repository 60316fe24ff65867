"""Vocabulary-parallel embedding lookup.

GSPMD partitions ``jnp.take(table, ids)`` poorly when the table is sharded (measured on XLA:CPU:
with the table split over vocab x embed it all-gathers the token ids over the batch axes, looks up
every row of the global batch and all-reduces ``[B, S, H]``). :func:`embed_lookup` does what
Megatron's ``VocabParallelEmbedding`` does, inside ``shard_map``: the table keeps its vocabulary
shard (the embed dimension is gathered, as FSDP gathers any weight), each device looks up the
token ids that fall in its vocabulary range (zeros elsewhere), and the partial rows are summed
over the vocabulary axes: a reduce-scatter along the sequence when the output is sequence-parallel
over those axes (SP), else an all-reduce. Backward: the table's gradient is a local scatter-add
into its own shard, accumulated in float32 (:func:`take_rows`).

The LM head and cross-entropy need no such help: GSPMD splits the logits over the vocabulary and
reduces the logsumexp and the target logit across shards (``moevlm_jax.model.loss``;
``tests/parallelism/test_layouts.py`` checks the HLO has no vocabulary-sized all-gather).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from parallelism import logical
from parallelism.dispatch import shard_map_unchecked


def _entry(axes: Sequence[str]) -> object:
    axes = tuple(axes)
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``jnp.take(table, ids, axis=0)`` whose table gradient is scatter-added in float32 and cast once.
    Autodiff's own transpose scatter-adds in the table's dtype: for a bf16 table every update is a
    16-bit read-modify-write (XLA:GPU emits it as a compare-and-swap loop, the step's largest
    scatter: ~10 ms at the proxy's MBS 8, bench/step_h200.md run 14) and repeated tokens lose bits
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


def embed_lookup(table: jax.Array, ids: jax.Array, table_axes: Sequence[str | None] = ("vocab", "embed"),
                 out_axes: Sequence[str | None] = ("act_batch", "act_norm_seq", "act_embed")) -> jax.Array:
    """table ``[V, H]``, ids ``[B, S]`` int -> rows ``[B, S, H]`` (table dtype), sharded as ``out_axes``
    under the active layout; a plain :func:`take_rows` without one (or inside ``shard_map``)."""
    ctx = logical.current()
    if ctx is None or logical.in_manual_region():
        return take_rows(table, ids)
    out = tuple(logical.logical_to_spec(out_axes, ctx.rules, ctx.mesh))
    out = out + (None,) * (3 - len(out))
    batch, seq, embed = (logical.flat_axes(e) for e in out)
    table_spec = tuple(logical.logical_to_spec(table_axes, ctx.rules, ctx.mesh))
    vocab = logical.flat_axes(table_spec[0] if table_spec else None)
    if embed:  # an embed-sharded output is no layout of ours: leave it to GSPMD
        return logical.constrain(take_rows(table, ids), out_axes)
    # sequence axes the rows are reduce-scattered over: a trailing run of the sequence entry that the
    # table's vocabulary is split over (SP: sequence over the tensor axis, vocabulary too)
    scatter: tuple[str, ...] = ()
    while len(scatter) < len(seq) and seq[len(seq) - len(scatter) - 1] in vocab:
        scatter = (seq[len(seq) - len(scatter) - 1],) + scatter
    ids_seq = seq[:len(seq) - len(scatter)]
    # vocabulary axes the ids are split over cannot hold vocabulary shards here: gather those
    parallel = tuple(a for a in vocab if a not in batch + ids_seq)
    reduce = tuple(a for a in parallel if a not in scatter)
    v_local = table.shape[0] // logical.axis_size(ctx.mesh, parallel or None)

    def body(tbl, idx):
        with logical.manual_region():
            if not parallel:
                return take_rows(tbl, idx)
            local = idx - jax.lax.axis_index(parallel) * v_local
            inside = (local >= 0) & (local < v_local)
            rows = take_rows(tbl, jnp.clip(local, 0, v_local - 1))
            rows = jnp.where(inside[..., None], rows, jnp.zeros((), rows.dtype))
            if reduce:
                rows = jax.lax.psum(rows, reduce)
            if scatter:
                rows = jax.lax.psum_scatter(rows, scatter, scatter_dimension=1, tiled=True)
            return rows

    in_specs = (PartitionSpec(_entry(parallel), None), PartitionSpec(_entry(batch), _entry(ids_seq)))
    out_spec = PartitionSpec(_entry(batch), _entry(ids_seq + scatter), None)
    return shard_map_unchecked(body, ctx.mesh, in_specs, out_spec)(table, ids)
