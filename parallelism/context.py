"""Context parallelism (CP): attention over sequence shards.

When the layout maps the attention's sequence axis (logical ``act_seq``) onto mesh axes of size
> 1 (``context``, or ``context`` and other axes), each device holds a contiguous block of S / cp
query rows. The model's attention op asks :func:`sequence_axes` whether that is the case and then
calls :func:`context_parallel_attention`, which runs its local attention inside ``shard_map``:

- ``allgather`` (default): K, V and the key segment ids are all-gathered over the CP axes, so each
  device attends its query block to the whole sequence (scores ``[S / cp, S]`` per device); the
  backward pass reduce-scatters dK and dV. Simple and exact; K/V memory grows with S.
- ``ring``: K/V blocks travel around the CP ring (``ppermute``) while each device accumulates an
  online softmax, so only one K/V block is resident at a time (XLA einsum path).

Masks are built from global token indices (query block offset = CP rank x S / cp) and the global
segment ids, so the causal mask and packed-sample boundaries are right across shards. The layout
option ``options.context_parallel: allgather | ring`` picks the variant. Load balance: with
contiguous blocks the last CP rank does most causal work; a zig-zag sequence order would even it
out (not implemented: it needs the data pipeline to permute rows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from parallelism import logical
from parallelism.dispatch import shard_map_unchecked

log = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("allgather", "ring")
# local attention: (q, k, v, q_segment_ids, kv_segment_ids, q_offset) -> out, k/v the whole sequence
Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def _spec(axes: Sequence[str | None], ctx: logical.ShardingContext) -> tuple:
    spec = tuple(logical.logical_to_spec(axes, ctx.rules, ctx.mesh))
    return spec + (None,) * (len(axes) - len(spec))


def sequence_axes(axes: Sequence[str | None], seq_dim: int = 1) -> tuple[str, ...]:
    """Mesh axes (size > 1) the active layout splits dimension ``seq_dim`` of a tensor with logical
    ``axes`` over; () without a sharding context, inside ``shard_map``, or when it is not split."""
    ctx = logical.current()
    if ctx is None or logical.in_manual_region():
        return ()
    return logical.flat_axes(_spec(axes, ctx)[seq_dim])


def context_kind(ctx: logical.ShardingContext | None = None) -> str:
    """The CP variant the layout asks for (``options.context_parallel``), default "allgather"."""
    ctx = ctx or logical.current()
    kind = getattr(getattr(ctx, "options", None), "context_parallel", "allgather")
    if kind not in KINDS:
        raise ValueError(f"layout option context_parallel must be one of {KINDS}, got {kind!r}")
    return kind


def context_parallel_attention(attend: Attend, q: jax.Array, k: jax.Array, v: jax.Array,
                               q_segment_ids: jax.Array, kv_segment_ids: jax.Array, *,
                               q_axes: Sequence[str | None], kv_axes: Sequence[str | None],
                               causal: bool, scale: float, kind: str | None = None) -> jax.Array:
    """q ``[B, S, N, D]``, k/v ``[B, S, K, D]``, segment ids ``[B, S]`` (global arrays whose sequence
    axis the layout splits over the CP axes) -> ``[B, S, N, D]`` sharded like q. ``attend`` is the
    local attention (allgather variant); ``q_axes``/``kv_axes`` the logical axes of q and k/v."""
    ctx = logical.current()
    q_spec, kv_spec = _spec(q_axes, ctx), _spec(kv_axes, ctx)
    if q_spec[:2] != kv_spec[:2]:
        raise ValueError(f"context parallel attention: q is split {q_spec[:2]} over (batch, sequence) but "
                         f"k/v {kv_spec[:2]}; the layout must split them alike")
    cp_axes = logical.flat_axes(q_spec[1])
    if not cp_axes:
        raise ValueError("context_parallel_attention called but the layout does not split the sequence")
    cp = logical.axis_size(ctx.mesh, cp_axes)
    seg_spec = PartitionSpec(q_spec[0], q_spec[1])
    kind = kind or context_kind(ctx)

    def body(q, k, v, qs, ks):
        with logical.manual_region():
            offset = jax.lax.axis_index(cp_axes) * q.shape[1]
            if kind == "ring":
                return ring_attention(q, k, v, qs, ks, axes=cp_axes, size=cp, causal=causal, scale=scale)
            k, v, ks = (jax.lax.all_gather(a, cp_axes, axis=1, tiled=True) for a in (k, v, ks))
            return attend(q, k, v, qs, ks, offset)

    fn = shard_map_unchecked(body, ctx.mesh, (PartitionSpec(*q_spec), PartitionSpec(*kv_spec),
                                              PartitionSpec(*kv_spec), seg_spec, seg_spec), PartitionSpec(*q_spec))
    return fn(q, k, v, q_segment_ids, kv_segment_ids)


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                   *, axes: tuple[str, ...], size: int, causal: bool, scale: float) -> jax.Array:
    """Per-device ring attention (inside ``shard_map``): local q ``[B, s, N, D]``, the local K/V block
    ``[B, s, K, D]`` and segment ids ``[B, s]``; K/V blocks move one CP rank per step while an online
    softmax accumulates (float32). Returns ``[B, s, N, D]``."""
    b, s, n, d = q.shape
    kh = k.shape[2]
    me = jax.lax.axis_index(axes)
    qg = q.reshape(b, s, kh, n // kh, d)
    q_pos = me * s + jnp.arange(s)
    perm = [(j, (j + 1) % size) for j in range(size)]
    neg = jnp.finfo(jnp.float32).min

    def step(carry, i):
        m, l, acc, k, v, ks = carry
        k_pos = ((me - i) % size) * s + jnp.arange(s)
        mask = q_segment_ids[:, :, None] == ks[:, None, :]
        if causal:
            mask = mask & (q_pos[:, None] >= k_pos[None, :])[None]
        mask = mask[:, None, None]  # [B, 1, 1, s, s]
        scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
        scores = jnp.where(mask, scores, neg)
        m_new = jnp.maximum(m, scores.max(-1))
        p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("bkgst,btkd->bkgsd", p, v.astype(jnp.float32))
        k, v, ks = (jax.lax.ppermute(a, axes, perm) for a in (k, v, ks))
        return (m_new, l, acc, k, v, ks), None

    init = (jnp.full((b, kh, n // kh, s), neg, jnp.float32), jnp.zeros((b, kh, n // kh, s), jnp.float32),
            jnp.zeros((b, kh, n // kh, s, d), jnp.float32), k, v, kv_segment_ids)
    (_, l, acc, *_), _ = jax.lax.scan(step, init, jnp.arange(size))
    out = acc / jnp.maximum(l, 1e-30)[..., None]  # every query sees at least itself
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, n, d).astype(q.dtype)
