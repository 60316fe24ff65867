"""'hybrid' experts: dropless drop-and-pad (``backend="hybrid"`` of ``parallelism.experts``).

Each expert's first ``C`` assignments (``C`` from ``capacity_factor`` x the mean load) run as the
padded batched einsum ``[E, C, H] x [E, H, 2I]`` (the dense-matmul rate on the GPU), the overflow
(rank >= C) through the grouped matmul on a small static buffer of ``B`` rows (``hybrid_overflow``
x the assignments): one buffer ``[E*C + B, H]``, one gather in, one combine out, nothing dropped.
The grouped kernel's time follows its static row count, not the rows in use (H200: the
overflow kernel over a full-size buffer cost ~45% of the whole dropless layer for ~10% of its rows,
bench/results/moe_layer.md), hence ``B``; a batch whose overflow exceeds ``B`` runs the plain grouped
matmul on all its rows (``hybrid_or_grouped``, a per-call ``lax.cond``), so the result never
depends on the bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from moevlm_jax.parallelism.kernels import DEFAULT_KERNELS, KernelsConfig
from moevlm_jax.parallelism.permute import (
    RoutePlan,
    capacity_ffn,
    combine_rows,
    dispatch_rows,
    exclusive_cumsum,
    expert_capacity,
    expert_ffn,
    inverse_slots,
    route_plan,
    sorted_experts,
)


def hybrid_overflow_rows(rows: int, fraction: float) -> int:
    """Static rows of an overflow buffer: ``fraction`` of ``rows`` (the assignments a group is expected
    to hold), rounded up to a multiple of 8; callers cap it at their buffer's rows."""
    return max(8, math.ceil(rows * fraction / 8) * 8)


def hybrid_or_grouped(total_overflow: jax.Array, over_rows: int, max_overflow: int,
                      hybrid: Callable[[], jax.Array], grouped: Callable[[], jax.Array]) -> jax.Array:
    """``hybrid()`` when the overflow fits its static buffer, else ``grouped()`` (the plain dropless
    grouped matmul): one ``lax.cond``, decided on the device per layer call (under ``vmap``, e.g.
    pipeline stages, both run and one is selected). No branch when the buffer holds the worst case."""
    if over_rows >= max_overflow:
        return hybrid()
    return jax.lax.cond(total_overflow <= over_rows, hybrid, grouped)


def _hybrid_slot(group: jax.Array, rank: jax.Array, counts: jax.Array, cap: int) -> tuple[jax.Array, jax.Array]:
    """Buffer row of the ``rank``-th row of ``group`` in a hybrid buffer (``group * cap + rank``
    below the capacity, else after the ``G * cap`` padded rows in group order) and the overflow counts."""
    over = jnp.maximum(counts - cap, 0)
    over_start = jnp.take(exclusive_cumsum(over), group, mode="clip")
    slot = jnp.where(rank < cap, group * cap + rank, counts.shape[0] * cap + over_start + rank - cap)
    return jnp.where(group < counts.shape[0], slot, -1), over  # group E: no expert (route_plan), no row


class HybridLayout(NamedTuple):
    """The local hybrid layout (``hybrid_slots``)."""

    plan: RoutePlan  # the dropless plan (every assignment ranked within its expert)
    slot: jax.Array  # [A] buffer row of each assignment
    over_counts: jax.Array  # [E] assignments past the capacity per expert
    cap: int  # C: padded einsum rows per expert
    over_rows: int  # B: static overflow rows after the E*C padded ones

    @property
    def size(self) -> int:
        return self.over_counts.shape[0] * self.cap + self.over_rows

    @property
    def fits(self) -> jax.Array:
        """Whether this batch's overflow fits the static overflow rows."""
        return jnp.sum(self.over_counts) <= self.over_rows


def hybrid_slots(idx: jax.Array, w: jax.Array, experts: int, capacity_factor: float,
                 overflow_fraction: float) -> HybridLayout:
    """Buffer rows ``[0, E*C)`` are the padded ``[E, C]`` einsum input (each expert's first C
    assignments), rows ``E*C + ...`` the overflow in expert order."""
    cap = expert_capacity(idx.shape[0], idx.shape[1], experts, capacity_factor)
    plan = route_plan(idx, w, experts)  # no capacity: every assignment ranked within its expert
    slot, over_counts = _hybrid_slot(plan.expert, plan.rank, plan.counts, cap)
    return HybridLayout(plan, slot, over_counts, cap, min(idx.size, hybrid_overflow_rows(idx.size, overflow_fraction)))


def hybrid_buffer_ffn(rows: jax.Array, over_counts: jax.Array, cap: int, w_gate_up: jax.Array, w_down: jax.Array,
                      backend: str, kernels: KernelsConfig = DEFAULT_KERNELS) -> jax.Array:
    """Experts on a hybrid buffer ``[E*C + B, H]``: the padded einsum on the first ``E*C`` rows, the
    grouped matmul (``backend``, ``kernels``) on the ``B`` overflow rows after them."""
    e, h = w_gate_up.shape[0], rows.shape[-1]
    y_main = capacity_ffn(rows[: e * cap].reshape(e, cap, h), w_gate_up, w_down).reshape(e * cap, h)
    return jnp.concatenate([y_main, expert_ffn(rows[e * cap:], over_counts, w_gate_up, w_down, backend,
                                                  kernels=kernels)])


def local_hybrid(x: jax.Array, idx: jax.Array, w: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                 capacity_factor: float, overflow_fraction: float, backend: str,
                 kernels: KernelsConfig = DEFAULT_KERNELS) -> jax.Array:
    """All experts on this device, x ``[T, H]``, idx/w ``[T, K]`` -> ``[T, H]``: the hybrid buffer
    built straight from the routing (one gather in, one combine out), or the grouped fallback."""
    lay = hybrid_slots(idx, w, w_gate_up.shape[0], capacity_factor, overflow_fraction)

    def hybrid() -> jax.Array:
        src = inverse_slots(lay.slot, lay.size)
        rows = dispatch_rows(x, src, lay.slot, idx.shape[1])
        y = hybrid_buffer_ffn(rows, lay.over_counts, lay.cap, w_gate_up, w_down, backend, kernels)
        return combine_rows(y, w, lay.slot, src)

    return hybrid_or_grouped(jnp.sum(lay.over_counts), lay.over_rows, max(0, idx.size - lay.cap), hybrid,
                             lambda: sorted_experts(x, lay.plan, w, w_gate_up, w_down, backend, kernels))


def hybrid_sorted_ffn(rows: jax.Array, sizes: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, cap: int,
                      over_rows: int, backend: str, kernels: KernelsConfig = DEFAULT_KERNELS) -> jax.Array:
    """Hybrid experts on expert-sorted rows ``[M, H]`` (group g: ``sizes[g]`` consecutive rows, rows
    past ``sum(sizes)`` padding): each group's first ``cap`` rows by the padded einsum, the rest by
    the grouped matmul in ``over_rows`` static rows (else the grouped matmul on all rows); rows back
    in their order (padding rows zero). The receiving side of the expert-parallel dispatchers."""
    m, g = rows.shape[0], sizes.shape[0]
    r = jnp.arange(m, dtype=jnp.int32)
    group = jnp.searchsorted(jnp.cumsum(sizes), r, side="right").astype(jnp.int32)
    valid = group < g
    group = jnp.minimum(group, g - 1)
    slot, over_sizes = _hybrid_slot(group, r - jnp.take(exclusive_cumsum(sizes), group), sizes, cap)
    slot = jnp.where(valid, slot, -1)

    def hybrid() -> jax.Array:
        src = inverse_slots(slot, g * cap + over_rows)
        y = hybrid_buffer_ffn(dispatch_rows(rows, src, slot, 1), over_sizes, cap, w_gate_up, w_down, backend,
                              kernels)
        return dispatch_rows(y, slot, src, 1)  # the inverse gather: row r <- buffer row slot[r]

    return hybrid_or_grouped(jnp.sum(over_sizes), over_rows, max(0, m - cap), hybrid,
                             lambda: expert_ffn(rows, sizes, w_gate_up, w_down, backend, kernels=kernels))
