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

Recurrent layers (Qwen3.5's Gated DeltaNet) carry a state along the sequence instead of attending
to it. :func:`context_parallel_map` runs a model function on each device's sequence shard inside
``shard_map`` and hands it a :class:`SequenceShards`, the collectives that carry from one shard to the
next: :meth:`~SequenceShards.from_previous` (a tensor of the previous shard, e.g. the conv's last
K - 1 inputs: one ``ppermute``), :meth:`~SequenceShards.continues` (whether a row's first token
continues the sample the previous shard ended with: a sample starting exactly on the boundary
restarts the carry) and :meth:`~SequenceShards.incoming_state` (the state entering this shard when
each shard maps its incoming state affinely, ``out = P in + F``: every shard computes its own
(P, F) from a zero state in parallel, they are all-gathered over the CP axes, and each device folds
the maps of the shards before it; the model then adds the incoming state's share to its outputs).
The model's math stays in the model; nothing here knows what the state means.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from moevlm_jax.parallelism import logical
from moevlm_jax.parallelism.dispatch import shard_map_unchecked

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


class SequenceShards:
    """Inside :func:`context_parallel_map`: this device's place among the sequence shards of its rows
    (``index`` of ``size``, in sequence order over the CP mesh ``axes``) and the collectives that carry
    from one shard to the next."""

    def __init__(self, axes: tuple[str, ...], size: int):
        self.axes, self.size = axes, size

    @property
    def index(self) -> jax.Array:
        """This shard's position in the sequence (0 .. size - 1)."""
        return jax.lax.axis_index(self.axes)

    def from_previous(self, x: jax.Array) -> jax.Array:
        """The previous shard's ``x`` (any shape; zeros on the first shard): one ``ppermute``."""
        return jax.lax.ppermute(x, self.axes, [(j, j + 1) for j in range(self.size - 1)])

    def continues(self, segment_ids: jax.Array) -> jax.Array:
        """Bool ``[B]``: row b's first token continues the (non-padding) sample the previous shard's
        row b ends with; False on the first shard and where a sample starts on the boundary."""
        first, last = segment_ids[:, 0], self.from_previous(segment_ids[:, -1])
        return (self.index > 0) & (first == last) & (first != 0)

    def incoming_state(self, transition: jax.Array, final: jax.Array, keep: jax.Array) -> jax.Array:
        """The state entering this shard, for a recurrence each shard applies affinely to the state it
        receives (after ``keep``): ``out_j = transition_j @ (keep_j * in_j) + final_j`` with
        transition ``[..., D, D]``, final ``[..., D, E]`` (``final``: shard j's outgoing state from a zero
        incoming one) and keep ``[B]`` (:meth:`continues`; the leading axis of the others is B).
        Returns ``keep * in`` ``[..., D, E]`` (zeros on the first shard), float32.

        The (transition, final) pairs of all shards are all-gathered over the CP axes ([cp, ...]: D x
        (D + E) floats per row and head) and folded in sequence order on every device (cp - 1 small
        matmuls); differentiable (the gather's transpose is a reduce-scatter)."""
        transition, final = transition.astype(jnp.float32), final.astype(jnp.float32)
        gather = lambda a: jax.lax.all_gather(a, self.axes, axis=0, tiled=False)
        p_all, f_all, k_all = gather(transition), gather(final), gather(keep.astype(jnp.float32))
        expand = lambda k: k.reshape(k.shape + (1,) * (final.ndim - 1))
        state, incoming = jnp.zeros_like(final), [jnp.zeros_like(final)]
        for j in range(self.size - 1):  # state entering shard j + 1 (before its keep)
            state = jnp.einsum("...de,...ef->...df", p_all[j], expand(k_all[j]) * state) + f_all[j]
            incoming.append(state)
        return expand(keep.astype(jnp.float32)) * jnp.stack(incoming)[self.index]


def context_parallel_map(fn: Callable[..., Any], args: Sequence[jax.Array], in_axes: Sequence[Sequence[str | None]],
                         out_axes: Any, *, seq_dim: int = 1) -> Any:
    """``fn(shards, *local_args)`` on each device's block of ``args`` inside ``shard_map``: every arg
    split as its logical axes ``in_axes`` say under the active layout (batch rows, the sequence over
    the CP axes, heads...), the outputs reassembled by ``out_axes`` (one axes tuple, or a tuple of
    them for a tuple of outputs). ``shards`` is the :class:`SequenceShards` of the CP axes that the
    first arg's dimension ``seq_dim`` is split over (which must be split)."""
    ctx = logical.current()
    cp_axes = logical.flat_axes(_spec(in_axes[0], ctx)[seq_dim])
    if not cp_axes:
        raise ValueError("context_parallel_map called but the layout does not split the sequence")
    shards = SequenceShards(cp_axes, logical.axis_size(ctx.mesh, cp_axes))
    return _shard_mapped(lambda *local: fn(shards, *local), args, in_axes, out_axes, ctx)


def per_device_map(fn: Callable[..., Any], args: Sequence[jax.Array], in_axes: Sequence[Sequence[str | None]],
                   out_axes: Any) -> Any:
    """``fn(*local_args)`` on each device's block of ``args`` inside ``shard_map`` (split and reassembled as
    :func:`context_parallel_map` does), for ops the SPMD partitioner cannot split (Pallas kernels: it would
    gather their operands and run the whole op on every device); ``fn(*args)`` itself without a sharding
    context or inside ``shard_map``. ``fn`` must be exact on any block the layout makes (e.g. whole rows and
    whole heads: a ``None`` axis is never split)."""
    ctx = logical.current()
    if ctx is None or logical.in_manual_region():
        return fn(*args)
    return _shard_mapped(fn, args, in_axes, out_axes, ctx)


def _shard_mapped(fn: Callable[..., Any], args: Sequence[jax.Array], in_axes: Sequence[Sequence[str | None]],
                  out_axes: Any, ctx: logical.ShardingContext) -> Any:
    single = bool(out_axes) and not isinstance(out_axes[0], (tuple, list))
    specs_out = PartitionSpec(*_spec(out_axes, ctx)) if single else tuple(PartitionSpec(*_spec(a, ctx))
                                                                         for a in out_axes)

    def body(*local):
        with logical.manual_region():
            return fn(*local)

    in_specs = tuple(PartitionSpec(*_spec(a, ctx)) for a in in_axes)
    return shard_map_unchecked(body, ctx.mesh, in_specs, specs_out)(*args)
