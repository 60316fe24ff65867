"""Dispatchers: where tokens are sent to experts and how expert outputs come back.

All dispatchers run one device's share inside ``jax.shard_map`` over the active mesh (or on the
whole arrays when no sharding context is active). Mesh axes come from the logical-axis rules:
``act_tokens`` -> token-row axes, ``exp`` -> expert-parallel (EP) axes, ``moe_mlp`` -> expert
tensor-parallel (ETP) axes. Per device:

1. ETP: token rows sharded over an ETP axis are all-gathered over it (each tensor rank needs
   every token of its group); at the end the partial down projections are reduce-scattered back
   (or all-reduced when tokens are replicated over the ETP axis).
2. The dispatcher on the device's token rows ``[T, H]``:
   - ``local``: all experts on this device; sort, gather, grouped matmul, combine.
   - ``alltoall``: rows go to the EP rank owning their expert and come back. Dropless: the
     sender's rows sorted by expert are exchanged with a ragged all-to-all whose offsets (from
     the all-gathered ``[EP, E]`` count matrix) land them on the receiver already sorted by
     (local expert, source), so no second permutation is needed. ``a2a_impl="ragged"`` uses
     ``jax.lax.ragged_all_to_all`` (GPU); ``"dense"`` emulates it with a fixed-size
     ``jax.lax.all_to_all`` over worst-case buffers (any backend, CPU tests). With a capacity
     factor the layout is drop-and-pad ``[E, C]`` and the exchange a plain all-to-all.
     Tokens replicated over some EP axes are split over them first and all-gathered after.
   - ``allgather``: token rows all-gathered over the EP axes, each device runs its own experts
     on all of them, partial outputs reduce-scattered back (Megatron's allgather dispatcher).
   - ``hierarchical`` (EP across hosts, HybridEP-like): the EP axes split into outer ones that may
     cross hosts (``layout.HOST_AXES``: stage, data, fsdp) and inner ones within a host. Forward:
     (1) the source deduplicates its kept assignments by destination host: one row per (token,
     host), a block of ``T`` rows a host (drop-and-pad: ``min(T, E_host C)``), and sends it with the
     token's top-k restricted to that host's experts (host-local ids, weights: ``2K`` floats a row)
     by one exchange over the outer axes (ragged on GPU, fixed-size blocks elsewhere), to the device
     of the same inner rank on that host (the relay); (2) the relay fans its rows out to the host's
     experts over the inner axes with the flat all-to-all above (dropless, or drop-and-pad with
     ``hosts x C`` rows an expert, which holds every assignment the sources kept); (3) the flat
     combine on the relay sums each row's experts of this host with the routing weights: one partial
     sum a (token, host), returned over the outer axes; (4) the source adds its hosts' partials.
     Backward: autodiff, the transposes of the same exchanges (the weights' gradients travel back
     with the metadata). Drops are decided at the source over all experts as ``alltoall`` does, so
     the two agree; cross-host rows fall by the routing's dedup factor (remote (token, expert)
     pairs / remote (token, host) pairs). Needs an outer EP axis: refused otherwise (config load and
     here), since with none it would be the flat exchange under another name.

   ``alltoall`` and ``hierarchical`` (dropless) take ``chunks`` (``compute.moe.dispatch_chunks``): a device's
   token rows split into that many independent chunks, each routed, exchanged, computed and returned on its
   own, so that XLA's asynchronous collectives and its scheduler can move one chunk while the experts compute
   another. Rows are independent, so the outputs and gradients are the unchunked ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from moevlm_jax.parallelism import logical
from moevlm_jax.parallelism.hybrid import hybrid_overflow_rows, hybrid_sorted_ffn, local_hybrid
from moevlm_jax.parallelism.kernels import DEFAULT_KERNELS, KernelsConfig
from moevlm_jax.parallelism.layout import HOST_AXES
from moevlm_jax.parallelism.permute import (
    RoutePlan,
    capacity_ffn,
    combine_rows,
    dispatch_rows,
    exclusive_cumsum,
    expert_capacity,
    expert_ffn,
    inverse_slots,
    padded_slots,
    route_plan,
    sorted_experts,
    sorted_slots,
    sum_rows,
)

DISPATCHERS: tuple[str, ...] = ("local", "alltoall", "allgather", "hierarchical")
A2A_IMPLS: tuple[str, ...] = ("ragged", "dense")
Axes = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class MoeOptions:
    """Resolved expert options (see ``parallelism.experts.experts_forward``)."""

    backend: str  # grouped-matmul backend, "capacity" (padded batched einsum) or "hybrid" (both, dropless)
    dispatcher: str
    capacity_factor: float | None
    drop_policy: str
    a2a_impl: str
    overflow_backend: str | None = None  # "hybrid": the grouped-matmul backend of the overflow rows
    hybrid_overflow: float = 0.25  # "hybrid": static overflow rows, a fraction of the expected rows
    kernels: KernelsConfig = DEFAULT_KERNELS  # the Triton backend's fusions, kernels and tiles
    chunks: int = 1  # alltoall / hierarchical, dropless: token chunks dispatched one after another (overlap)


@dataclasses.dataclass(frozen=True)
class ExpertTopology:
    """Mesh axes (size > 1 only) that shard token rows, experts (EP) and expert columns (ETP)."""

    mesh: Mesh | None = None
    token_axes: Axes = ()
    expert_axes: Axes = ()
    etp_axes: Axes = ()

    def size(self, axes: Axes) -> int:
        """Devices along ``axes``."""
        return math.prod(self.mesh.shape[a] for a in axes) if self.mesh is not None else 1

    @property
    def ep(self) -> int:
        return self.size(self.expert_axes)

    @property
    def etp(self) -> int:
        return self.size(self.etp_axes)

    @property
    def etp_token_axes(self) -> Axes:
        """ETP axes the tokens are sharded over: gathered before, reduce-scattered after."""
        return tuple(a for a in self.etp_axes if a in self.token_axes)

    @property
    def etp_replicated_axes(self) -> Axes:
        return tuple(a for a in self.etp_axes if a not in self.token_axes)

    @property
    def ep_token_axes(self) -> Axes:
        """EP axes the tokens are sharded over."""
        return tuple(a for a in self.expert_axes if a in self.token_axes)

    @property
    def ep_replicated_axes(self) -> Axes:
        """EP axes the tokens are replicated over."""
        return tuple(a for a in self.expert_axes if a not in self.token_axes)


def _entry(axes: Axes) -> Any:
    return None if not axes else (axes[0] if len(axes) == 1 else axes)


def resolve_topology(ctx: logical.ShardingContext | None) -> ExpertTopology:
    """Token / EP / ETP mesh axes under ``ctx`` (all empty without a context)."""
    if ctx is None:
        return ExpertTopology()
    tok = logical.logical_to_spec(("act_tokens", None), ctx.rules, ctx.mesh)
    wgt = logical.logical_to_spec(("exp", None, None, "moe_mlp"), ctx.rules, ctx.mesh)
    wgt = tuple(wgt) + (None,) * (4 - len(wgt))
    return ExpertTopology(
        mesh=ctx.mesh,
        token_axes=logical.flat_axes(tok[0] if len(tok) else None),
        expert_axes=logical.flat_axes(wgt[0]),
        etp_axes=logical.flat_axes(wgt[3]),
    )


# ----------------------------------------------------------------------------- collectives


def _locate(sizes: jax.Array, q: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """For rows ``q`` of P packed buffers made of slices ``sizes [P, n]``: slice, offset, valid."""
    ends = jnp.cumsum(sizes, axis=1)
    j = jax.vmap(lambda e: jnp.searchsorted(e, q, side="right"))(ends)
    valid = q[None, :] < ends[:, -1:]
    j = jnp.minimum(j, sizes.shape[1] - 1)
    within = q[None, :] - jnp.take_along_axis(ends - sizes, j, axis=1)
    return j, within, valid


def ragged_all_to_all_dense(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: Axes,
    axis_size: int,
) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` semantics (operand ``[N, H]`` -> output ``[M, H]``) from a
    fixed-size ``all_to_all`` of worst-case ``[P, N, H]`` buffers; works on every backend."""
    del recv_sizes  # equal to the senders' send_sizes by contract; those travel with the data
    p, n = axis_size, operand.shape[0]
    spd = input_offsets.shape[0] // p
    q = jnp.arange(n, dtype=jnp.int32)
    sizes = send_sizes.reshape(p, spd)
    j, within, valid = _locate(sizes, q)
    src_row = jnp.take_along_axis(input_offsets.reshape(p, spd), j, axis=1) + within
    send = jnp.take(operand, jnp.where(valid, src_row, n), axis=0, mode="fill", fill_value=0)
    recv = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # [P(source), N, H]
    meta = jnp.stack([sizes, output_offsets.reshape(p, spd)], axis=1)
    meta = jax.lax.all_to_all(meta, axis_name, 0, 0, tiled=True)  # [P(source), 2, spd]
    rj, rwithin, rvalid = _locate(meta[:, 0], q)
    target = jnp.take_along_axis(meta[:, 1], rj, axis=1) + rwithin
    target = jnp.where(rvalid, target, output.shape[0]).reshape(-1)
    return output.at[target].set(recv.reshape((p * n,) + operand.shape[1:]), mode="drop")


def exchange_offsets(counts: jax.Array, me: jax.Array, local_experts: int) -> tuple[tuple, tuple, jax.Array]:
    """Ragged all-to-all arguments from the ``[P, E]`` count matrix (row = source EP rank).

    Returns ``(forward, backward, group_sizes)``: forward/backward are ``(input_offsets,
    send_sizes, output_offsets, recv_sizes)`` for sending sorted rows to the expert owners (landing
    sorted by (local expert, source)) and sending results back; group_sizes ``[E_local]``.
    """
    p = counts.shape[0]
    el = local_experts
    per_owner = counts.reshape(p, p, el).transpose(1, 2, 0)  # [owner r, local expert j, source s]
    owner_off = exclusive_cumsum(per_owner.reshape(p, el * p), axis=1).reshape(p, el, p)
    src_starts = exclusive_cumsum(counts, axis=1)  # [source, E]: where each expert starts there
    mine = jax.lax.dynamic_slice_in_dim(counts, me * el, el, axis=1)  # [source, j]
    forward = (src_starts[me], counts[me], owner_off[:, :, me].reshape(-1), mine.reshape(-1))
    backward = (
        owner_off[me].T.reshape(-1),
        mine.reshape(-1),
        jax.lax.dynamic_slice_in_dim(src_starts, me * el, el, axis=1).reshape(-1),
        counts[me],
    )
    return forward, backward, jnp.sum(mine, axis=0)


# ----------------------------------------------------------------------------- dispatchers


def _ffn_padded(rows: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, backend: str,
                kernels: KernelsConfig = DEFAULT_KERNELS) -> jax.Array:
    """Experts on a padded ``[G, C, H]`` buffer (batched einsum, or uniform-group grouped matmul)."""
    if backend == "capacity":
        return capacity_ffn(rows, w_gate_up, w_down)
    g, c, h = rows.shape
    sizes = jnp.full((g,), c, jnp.int32)
    return expert_ffn(rows.reshape(g * c, h), sizes, w_gate_up, w_down, backend, kernels=kernels).reshape(g, c, h)


def _ffn_sorted(rows: jax.Array, sizes: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, opts: MoeOptions,
                expected_rows: int) -> jax.Array:
    """Experts on expert-sorted rows: the grouped matmul, or 'hybrid' with a capacity of
    ``capacity_factor`` x the expected rows per expert (``expected_rows`` / experts here)."""
    if opts.backend != "hybrid":
        return expert_ffn(rows, sizes, w_gate_up, w_down, opts.backend, kernels=opts.kernels)
    cap = max(1, math.ceil(expected_rows / sizes.shape[0] * opts.capacity_factor))
    over_rows = min(rows.shape[0], hybrid_overflow_rows(expected_rows, opts.hybrid_overflow))
    return hybrid_sorted_ffn(rows, sizes, w_gate_up, w_down, cap, over_rows, opts.overflow_backend, opts.kernels)


def _capacity(opts: MoeOptions, tokens: int, top_k: int, experts: int) -> int | None:
    if opts.capacity_factor is None or opts.backend == "hybrid":  # hybrid: a speed knob, nothing drops
        return None
    return expert_capacity(tokens, top_k, experts, opts.capacity_factor)


def _plan(idx: jax.Array, w: jax.Array, experts: int, opts: MoeOptions) -> tuple[RoutePlan, int | None]:
    cap = _capacity(opts, idx.shape[0], idx.shape[1], experts)
    return route_plan(idx, w, experts, cap, opts.drop_policy), cap


def local_experts(x, idx, w, w_gate_up, w_down, opts: MoeOptions) -> tuple[jax.Array, jax.Array]:
    """All E experts on this device: x ``[T, H]``, idx/w ``[T, K]`` -> (``[T, H]``, dropped)."""
    e, k, h = w_gate_up.shape[0], idx.shape[1], x.shape[1]
    if opts.backend == "hybrid":
        return local_hybrid(x, idx, w, w_gate_up, w_down, opts.capacity_factor, opts.hybrid_overflow,
                            opts.overflow_backend, opts.kernels), jnp.zeros((), jnp.int32)
    plan, cap = _plan(idx, w, e, opts)
    if opts.backend != "capacity":
        return sorted_experts(x, plan, w, w_gate_up, w_down, opts.backend, opts.kernels), plan.dropped
    slot = padded_slots(plan, cap)
    src = inverse_slots(slot, e * cap)
    rows = dispatch_rows(x, src, slot, k).reshape(e, cap, h)
    y = capacity_ffn(rows, w_gate_up, w_down).reshape(e * cap, h)
    return combine_rows(y, w, slot, src), plan.dropped


def _split_replicated(topo: ExpertTopology, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Tokens replicated over some EP axes: each rank takes its part (all-gathered again at the end)."""
    rep = topo.ep_replicated_axes
    if not rep:
        return arrays
    chunk = arrays[0].shape[0] // topo.size(rep)
    start = jax.lax.axis_index(rep) * chunk
    return tuple(jax.lax.dynamic_slice_in_dim(a, start, chunk, axis=0) for a in arrays)


def chunk_sizes(rows: int, chunks: int) -> list[int]:
    """``rows`` split into ``min(chunks, rows)`` static chunks whose sizes differ by at most one."""
    n = max(min(chunks, rows), 1)
    return [rows // n + (1 if i < rows % n else 0) for i in range(n)]


def _chunked(core: Callable[..., tuple[jax.Array, jax.Array]]) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """An EP dispatcher over this device's token rows (those replicated over EP axes split first) in
    ``opts.chunks`` chunks, each routed, exchanged, computed and returned on its own: the chunks are independent
    programs, so XLA's asynchronous collectives and its scheduler can move one chunk while the experts compute
    another. Dropless only (a capacity is per token group: chunks would change which assignments drop)."""

    def run(x, idx, w, w_gate_up, w_down, topo: ExpertTopology, opts: MoeOptions):
        x, idx, w = _split_replicated(topo, x, idx, w)
        sizes = chunk_sizes(x.shape[0], opts.chunks if opts.capacity_factor is None else 1)
        outs, dropped, start = [], jnp.zeros((), jnp.int32), 0
        for n in sizes:
            part = (jax.lax.slice_in_dim(a, start, start + n, axis=0) for a in (x, idx, w))
            out, d = core(*part, w_gate_up, w_down, topo, opts)
            outs.append(out)
            dropped, start = dropped + d, start + n
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)
        if topo.ep_replicated_axes:
            out = jax.lax.all_gather(out, topo.ep_replicated_axes, axis=0, tiled=True)
        return out, dropped

    return run


@_chunked
def _alltoall(x, idx, w, w_gate_up, w_down, topo: ExpertTopology, opts: MoeOptions):
    plan, cap = _plan(idx, w, w_gate_up.shape[0] * topo.ep, opts)
    out = _exchange_experts(x, w, plan, cap, w_gate_up, w_down, topo.expert_axes, topo.ep, opts)
    return out, plan.dropped


def _exchange_experts(x, w, plan: RoutePlan, cap: int | None, w_gate_up, w_down, axes: Axes, p: int,
                      opts: MoeOptions) -> jax.Array:
    """Rows ``x [T, H]`` to the experts ``plan`` assigns them (over the EP ``axes``, ``p`` devices; none: all
    experts here), the experts, the results back and combined with the weights ``w [T, K]``."""
    el, k, h = w_gate_up.shape[0], w.shape[1], x.shape[1]
    e = el * p
    if cap is not None:  # drop-and-pad: fixed [E, C] buffers, plain all-to-all
        slot = padded_slots(plan, cap)
        src = inverse_slots(slot, e * cap)
        rows = dispatch_rows(x, src, slot, k)  # [P * El * C, H], destination-major
        recv = jax.lax.all_to_all(rows, axes, 0, 0, tiled=True) if p > 1 else rows  # source-major
        recv = recv.reshape(p, el, cap, h).swapaxes(0, 1).reshape(el, p * cap, h)
        y = _ffn_padded(recv, w_gate_up, w_down, opts.backend, opts.kernels)
        y = y.reshape(el, p, cap, h).swapaxes(0, 1).reshape(p * el * cap, h)
        back = jax.lax.all_to_all(y, axes, 0, 0, tiled=True) if p > 1 else y
    else:  # dropless: ragged exchange of expert-sorted rows
        slot = sorted_slots(plan)
        a = slot.shape[0]
        src = inverse_slots(slot, a)
        rows = dispatch_rows(x, src, slot, k)
        if p > 1:
            counts = jax.lax.all_gather(plan.counts, axes)  # [P, E]
            fwd, bwd, sizes = exchange_offsets(counts, jax.lax.axis_index(axes), el)
            exchange = exchange_fn(opts.a2a_impl, axes, p)
            recv = exchange(rows, jnp.zeros((p * a, h), rows.dtype), *fwd)
        else:
            recv, sizes = rows, plan.counts
        y = _ffn_sorted(recv, sizes, w_gate_up, w_down, opts, expected_rows=p * a * el // e)
        back = exchange(y, jnp.zeros((a, h), y.dtype), *bwd) if p > 1 else y
    return combine_rows(back, w, slot, src)


def host_split_axes(expert_axes: Axes) -> tuple[Axes, Axes]:
    """The EP axes that may cross hosts (``parallelism.layout.HOST_AXES``: stage, data, fsdp) and those that stay
    within a host (context, expert, tensor), each in the order of ``expert_axes``: the hierarchical dispatcher's
    outer (host) and inner (intra-host) exchanges."""
    return (tuple(a for a in expert_axes if a in HOST_AXES), tuple(a for a in expert_axes if a not in HOST_AXES))


def hierarchical_problem(expert_axes: Axes, layout: str = "the layout") -> str | None:
    """Why ``dispatcher: hierarchical`` cannot run over the EP mesh axes ``expert_axes`` (those of size > 1), or
    None: it needs one that may cross hosts (the outer exchange); with none there is no host level to dedupe over
    and the flat all-to-all is the same exchange, so the setting is refused rather than silently ignored."""
    if host_split_axes(expert_axes)[0]:
        return None
    what = f"maps 'exp' to {tuple(expert_axes)}" if expert_axes else "maps 'exp' to no mesh axis of size > 1"
    return (f"compute.moe.dispatcher 'hierarchical' needs the experts split over a mesh axis that may cross hosts "
            f"({', '.join(HOST_AXES)}), but {layout} {what}, which stays within a host; map 'exp' to "
            f"[fsdp, expert] (layout ep_multinode) or use dispatcher 'alltoall'")


def _owner_ranks(owner: jax.Array, topo: ExpertTopology) -> tuple[jax.Array, jax.Array]:
    """Linear EP rank ``owner`` (over ``topo.expert_axes`` in order) -> its rank over the outer (host) axes and
    over the inner axes, as ``jax.lax.axis_index`` of those axis tuples numbers them."""
    outer_axes, _ = host_split_axes(topo.expert_axes)
    coords, rest = {}, owner
    for a in reversed(topo.expert_axes):
        rest, coords[a] = jnp.divmod(rest, topo.mesh.shape[a])
    outer = inner = jnp.zeros_like(owner)
    for a in topo.expert_axes:
        if a in outer_axes:
            outer = outer * topo.mesh.shape[a] + coords[a]
        else:
            inner = inner * topo.mesh.shape[a] + coords[a]
    return outer, inner


def host_exchanges(impl: str, outer: Axes, hosts: int, block: int, sent: jax.Array,
                   ragged: Callable[..., jax.Array] = jax.lax.ragged_all_to_all) -> tuple[Callable, Callable]:
    """The hierarchical dispatcher's exchanges over the host axes ``outer`` of buffers ``[hosts * block, ...]``
    (block o: the rows for host o, its first ``sent[o]`` valid): ``there(a, fill)`` sends block o to host o, which
    holds the blocks by source host, ``fill`` where nothing came (ragged); ``back(a)`` is the return trip.
    ``"ragged"``: only the valid rows move (``ragged``: ``jax.lax.ragged_all_to_all`` or an emulation of it);
    ``"dense"``: whole blocks by ``jax.lax.all_to_all``."""
    if impl != "ragged":

        def dense_there(a, fill):
            del fill  # every row of a block is sent
            return jax.lax.all_to_all(a, outer, 0, 0, tiled=True)

        return dense_there, functools.partial(dense_there, fill=0)
    counts = jax.lax.all_gather(sent, outer)  # [source host, destination host]
    me = jax.lax.axis_index(outer)
    starts = jnp.arange(hosts, dtype=jnp.int32) * block
    at_me = jnp.full((hosts,), me * block, jnp.int32)
    got = counts[:, me]

    def there(a, fill):
        return ragged(a, jnp.full_like(a, fill), starts, sent, at_me, got, axis_name=outer)

    def back(a):
        return ragged(a, jnp.zeros_like(a), starts, got, at_me, sent, axis_name=outer)

    return there, back


@_chunked
def _hierarchical(x, idx, w, w_gate_up, w_down, topo: ExpertTopology, opts: MoeOptions):
    """Two-level expert parallelism: each token row crosses to a host once (the hosts' experts it routes to
    deduplicated), carrying its top-k routing restricted to that host's experts; the receiving device (the relay,
    same intra-host rank as the sender) fans the rows out to the host's experts over the inner axes
    (:func:`_exchange_experts`, the flat exchange), combines them with the routing weights into one partial sum per
    (token, host), and sends that back over the outer axes, where the source sums its hosts' partials. Drops
    (capacity) are decided where the tokens live, as the flat dispatcher does, so the result equals it; the inner
    exchange is sized to drop nothing more (a relay holds <= hosts x C assignments of an expert)."""
    outer, inner = host_split_axes(topo.expert_axes)
    po, pi = topo.size(outer), topo.size(inner)
    el, k, t = w_gate_up.shape[0], idx.shape[1], x.shape[0]
    e = el * topo.ep
    eh = e // po  # experts of one host
    plan, cap = _plan(idx, w, e, opts)
    expert = plan.expert.reshape(t, k)  # e: dropped, or no expert
    kept = expert < e
    host, within = _owner_ranks(jnp.where(kept, expert, 0) // el, topo)
    host = jnp.where(kept, host, po)
    host_expert = within * el + expert % el  # the expert's id among its host's experts
    need = jnp.any(host[:, :, None] == jnp.arange(po, dtype=host.dtype), axis=1)  # [T, Po]: token t goes to host o
    # rows a host receives from one source at most: every token once (dropless), or the tokens its experts' kept
    # assignments name (each expert keeps <= C of them)
    tb = t if cap is None else min(t, eh * cap)
    rank = exclusive_cumsum(need.astype(jnp.int32), axis=0)
    slot = jnp.where(need, jnp.arange(po, dtype=jnp.int32) * tb + rank, -1).reshape(-1)  # (t, o) -> row
    src = inverse_slots(slot, po * tb)
    rows = dispatch_rows(x, src, slot, po)  # [Po * Tb, H]: host-major, each token once per host
    tok = jnp.where(src >= 0, src // po, 0)
    mine = (src >= 0)[:, None] & (jnp.take(host, tok, axis=0) == (src % po)[:, None])
    meta = jnp.concatenate([jnp.take(w, tok, axis=0).astype(jnp.float32),  # the token's weights (d(w) flows back)
                            jnp.where(mine, jnp.take(host_expert, tok, axis=0), eh).astype(jnp.float32)], axis=1)
    impl = opts.a2a_impl if cap is None else "dense"  # drop-and-pad: fixed-size blocks, as the flat exchange
    there, back = host_exchanges(impl, outer, po, tb, jnp.sum(need, axis=0, dtype=jnp.int32))
    r_rows = there(rows, 0)
    r_meta = there(meta, eh)  # ragged: rows no source sent keep no expert (eh)
    r_w, r_idx = r_meta[:, :k].astype(w.dtype), r_meta[:, k:].astype(jnp.int32)
    inner_cap = None if cap is None else po * cap
    r_plan = route_plan(r_idx, r_w, eh, inner_cap, opts.drop_policy)  # drops nothing (inner_cap holds them)
    partial = _exchange_experts(r_rows, r_w, r_plan, inner_cap, w_gate_up, w_down, inner, pi, opts)
    out = sum_rows(back(partial), src, slot, po, False)  # the hosts' partial sums
    return out, plan.dropped


def exchange_fn(impl: str, axes: Axes, p: int) -> Callable[..., jax.Array]:
    """The ragged exchange: ``jax.lax.ragged_all_to_all`` or its fixed-size emulation."""
    if impl == "ragged":
        return lambda *args: jax.lax.ragged_all_to_all(*args, axis_name=axes)
    return lambda *args: ragged_all_to_all_dense(*args, axis_name=axes, axis_size=p)


def _allgather(x, idx, w, w_gate_up, w_down, topo: ExpertTopology, opts: MoeOptions):
    axes, gather = topo.expert_axes, topo.ep_token_axes
    el, k, h = w_gate_up.shape[0], idx.shape[1], x.shape[1]
    plan, cap = _plan(idx, w, el * topo.ep, opts)  # drops decided where the tokens live
    expert, rank, counts = plan.expert, plan.rank, plan.counts[None]
    if gather:
        x, w, expert, rank = (jax.lax.all_gather(a, gather, axis=0, tiled=True) for a in (x, w, expert, rank))
        counts = jax.lax.all_gather(plan.counts, gather)  # [sources, E]
    sources, a = counts.shape[0], idx.shape[0] * k
    me = jax.lax.axis_index(axes)
    local = expert - me * el
    is_local = (local >= 0) & (local < el)
    local = jnp.clip(local, 0, el - 1)
    source = jnp.arange(sources * a, dtype=jnp.int32) // a
    if opts.backend == "capacity":
        per = sources * cap
        slot = jnp.where(is_local, local * per + source * cap + rank, -1)
        src = inverse_slots(slot, el * per)
        rows = dispatch_rows(x, src, slot, k).reshape(el, per, h)
        y = capacity_ffn(rows, w_gate_up, w_down).reshape(el * per, h)
    else:
        mine = jax.lax.dynamic_slice_in_dim(counts, me * el, el, axis=1)  # [source, j]
        offsets = exclusive_cumsum(mine.T.reshape(-1)).reshape(el, sources)
        slot = jnp.where(is_local, offsets[local, source] + rank, -1)
        src = inverse_slots(slot, sources * a)
        rows = dispatch_rows(x, src, slot, k)
        y = _ffn_sorted(rows, jnp.sum(mine, axis=0), w_gate_up, w_down, opts,
                        expected_rows=sources * a * el // (el * topo.ep))
    out = combine_rows(y, w, slot, src)
    if gather:
        out = jax.lax.psum_scatter(out, gather, scatter_dimension=0, tiled=True)
    if topo.ep_replicated_axes:
        out = jax.lax.psum(out, topo.ep_replicated_axes)
    return out, plan.dropped


# ----------------------------------------------------------------------------- entry point


def _device_fn(topo: ExpertTopology, opts: MoeOptions) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """The per-device body: ETP gather, dispatcher, ETP reduction, global dropped count."""

    def body(x, idx, w, w_gate_up, w_down):
        with logical.manual_region():
            w_gate_up = w_gate_up.reshape(*w_gate_up.shape[:2], -1)  # this shard's gate and up halves
            gathered = topo.etp_token_axes
            if gathered:
                x, idx, w = (jax.lax.all_gather(a, gathered, axis=0, tiled=True) for a in (x, idx, w))
            if opts.dispatcher == "alltoall":
                out, dropped = _alltoall(x, idx, w, w_gate_up, w_down, topo, opts)
            elif opts.dispatcher == "allgather":
                out, dropped = _allgather(x, idx, w, w_gate_up, w_down, topo, opts)
            elif opts.dispatcher == "hierarchical":
                out, dropped = _hierarchical(x, idx, w, w_gate_up, w_down, topo, opts)
            else:
                out, dropped = local_experts(x, idx, w, w_gate_up, w_down, opts)
            if topo.etp_replicated_axes:
                out = jax.lax.psum(out, topo.etp_replicated_axes)
            if gathered:
                out = jax.lax.psum_scatter(out, gathered, scatter_dimension=0, tiled=True)
            owners = tuple(a for a in topo.token_axes if a not in gathered)
            if opts.dispatcher in ("alltoall", "hierarchical"):
                owners += topo.ep_replicated_axes
            if owners:
                dropped = jax.lax.psum(dropped, owners)
            return out, dropped

    return body


def shard_map_unchecked(f: Callable, mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable:
    """``jax.shard_map`` without replication checks (collectives here are placed by hand)."""
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map  # jax < 0.7

    return shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def run_experts(
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    topo: ExpertTopology,
    opts: MoeOptions,
) -> tuple[jax.Array, jax.Array]:
    """x ``[T, H]``, topk ``[T, K]``, w_gate_up ``[E, H, 2, I]``, w_down ``[E, I, H]`` ->
    (``[T, H]``, dropped assignments ``[]``); validated inputs, resolved options."""
    body = _device_fn(topo, opts)
    if topo.mesh is None:
        return body(x, topk_idx, topk_weights, w_gate_up, w_down)
    tok = PartitionSpec(_entry(topo.token_axes), None)
    ep = _entry(topo.expert_axes) if opts.dispatcher != "local" else None
    etp = _entry(topo.etp_axes)
    specs = (tok, tok, tok, PartitionSpec(ep, None, None, etp), PartitionSpec(ep, etp, None))
    fn = shard_map_unchecked(body, topo.mesh, specs, (tok, PartitionSpec()))
    return fn(x, topk_idx, topk_weights, w_gate_up, w_down)
