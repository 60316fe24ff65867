"""Token permutation for the experts: sort the (token, expert) assignments once, gather each token
row once into the experts' layout, and gather it back with the routing-weight multiply fused into
the combine.

Vocabulary: ``A = T * K`` assignments, assignment ``a`` is token ``a // K``'s ``a % K``-th choice.
A *slot map* ``slot [A]`` says where each assignment's row sits in an expert-side buffer of ``S``
rows (``-1``: dropped), and ``src [S]`` is its inverse (``-1``: an empty padding row). Every
dispatcher only differs in how it computes ``slot``; moving rows is always
:func:`dispatch_rows` (a gather, whose backward is a gather plus a sum over ``K``) and
:func:`combine_rows` (a gather times the routing weights summed over ``K``, whose backward is two
gathers). Gathers need no atomics and are deterministic; the scatter-add alternative needs atomics
on GPU and a separate weight multiply pass. On the Triton backend the local sorted experts move the rows with
Pallas-Triton kernels instead (``compute.moe.kernels.permute_kernels``, ``parallelism/permute_triton.py``: the
dispatch as a scatter of each token row to its unique slots, the combine's backward in one pass), same values.

Which fusions and kernels the Triton experts use is a :class:`~moevlm_jax.parallelism.kernels.KernelsConfig`
passed down from ``experts_forward`` (``compute.moe.kernels``); what each fusion does is in :func:`expert_ffn`,
:func:`sorted_experts` and :func:`_fused_ffn`, and its measured effect in bench/results/moe_layer.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moevlm_jax.parallelism import fp8, gmm_fp8, gmm_mgpu, gmm_triton, permute_triton
from moevlm_jax.parallelism.grouped_matmul import capacity_matmul, grouped_matmul, mgpu_takes, plain_gmm, plain_tgmm
from moevlm_jax.parallelism.kernels import DEFAULT_KERNELS, KernelsConfig

MOE_PERMUTED = "moe_permuted"  # token rows in the experts' layout (the first grouped matmul's input; with the
# "gather" fusion the rows the gate_up kernel writes for d(w))
MOE_GATE_UP = "moe_gate_up"  # first grouped matmul's output (SwiGLU's input, needed by its backward)
MOE_ACT = "moe_act"  # SwiGLU output (the down projection's input)
MOE_EXPERT_OUT = "moe_expert_out"  # down projection output, before the combine (d(routing weights) needs it)
CHECKPOINT_NAMES: tuple[str, ...] = (MOE_PERMUTED, MOE_GATE_UP, MOE_ACT, MOE_EXPERT_OUT)
DROP_POLICIES: tuple[str, ...] = ("probs", "position")


@dataclasses.dataclass(frozen=True)
class RoutePlan:
    """Per-assignment routing after capacity dropping (one device's tokens)."""

    expert: jax.Array  # [A] int32 expert of each assignment, E where dropped
    rank: jax.Array  # [A] int32 rank of the assignment within its expert (policy order)
    counts: jax.Array  # [E] int32 kept assignments per expert
    dropped: jax.Array  # [] int32 number of dropped assignments


def expert_capacity(tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """Megatron's per-expert capacity ``ceil(tokens * top_k / num_experts * factor)`` (at least 1)."""
    return max(1, math.ceil(tokens * top_k / num_experts * factor))


def exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Exclusive prefix sum along ``axis`` (same shape)."""
    return jnp.cumsum(x, axis=axis) - x


def route_plan(
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    num_experts: int,
    capacity: int | None = None,
    drop_policy: str = "probs",
) -> RoutePlan:
    """Sort the ``[T, K]`` assignments once by expert; keep at most ``capacity`` per expert.

    ``drop_policy="probs"`` keeps the highest routing weights (ties: earlier token first);
    ``"position"`` keeps the earliest tokens. Without a capacity nothing is dropped. An id of
    ``num_experts`` in ``topk_idx`` is no expert (the MoE block's padding positions): such assignments
    sort last, are never kept and are not counted as dropped.
    """
    if drop_policy not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {drop_policy!r}")
    expert = topk_idx.reshape(-1).astype(jnp.int32)
    a = expert.shape[0]
    iota = jnp.arange(a, dtype=jnp.int32)
    if capacity is not None and drop_policy == "probs":
        neg_w = -topk_weights.reshape(-1).astype(jnp.float32)
        sorted_e, _, order = jax.lax.sort((expert, neg_w, iota), num_keys=3)
    else:  # stable by expert: the order a second key (iota) would give. One int32 key and a value: XLA:GPU's
        # SortRewriter makes it one CUB radix sort of pairs, where the two-key comparator was XLA's own sort (21
        # kernels, 0.10 ms a layer at the 30B-A3B shapes in a profile)
        sorted_e, order = jax.lax.sort((expert, iota), num_keys=1, is_stable=True)
    # counts from the sorted ids by search: no scatter-add (atomics into E bins on GPU). compare_all: one fused
    # [E + 1, A] comparison; the default binary search is a while loop whose predicate goes back to the host
    # every step (18 at A = 131,072: ~0.7 ms of idle device a layer on the H200)
    bounds = jnp.searchsorted(sorted_e, jnp.arange(num_experts + 1, dtype=jnp.int32), side="left",
                              method="compare_all")
    counts = jnp.diff(bounds).astype(jnp.int32)
    starts = bounds[:-1].astype(jnp.int32)
    rank_sorted = iota - jnp.take(starts, sorted_e, mode="clip")
    rank = jnp.zeros((a,), jnp.int32).at[order].set(rank_sorted, unique_indices=True)
    if capacity is None:
        return RoutePlan(expert, rank, counts, jnp.zeros((), jnp.int32))
    keep = rank < capacity
    kept = jnp.minimum(counts, capacity)
    return RoutePlan(jnp.where(keep, expert, num_experts), rank, kept, jnp.sum(counts - kept))


def sorted_slots(plan: RoutePlan) -> jax.Array:
    """Slots ``[A]`` in the expert-sorted layout of the kept assignments (``S = A``; -1 dropped)."""
    e = plan.counts.shape[0]
    starts = jnp.concatenate([exclusive_cumsum(plan.counts), jnp.sum(plan.counts, keepdims=True)])
    return jnp.where(plan.expert < e, starts[plan.expert] + plan.rank, -1)


def padded_slots(plan: RoutePlan, capacity: int) -> jax.Array:
    """Slots ``[A]`` in the drop-and-pad layout ``[E, capacity]`` (``S = E * capacity``; -1 dropped)."""
    e = plan.counts.shape[0]
    return jnp.where(plan.expert < e, plan.expert * capacity + plan.rank, -1)


def inverse_slots(slot: jax.Array, size: int) -> jax.Array:
    """``src [size]``: the assignment held by each buffer row, -1 for empty rows."""
    target = jnp.where(slot >= 0, slot, size)
    values = jnp.arange(slot.shape[0], dtype=jnp.int32)
    return jnp.full((size,), -1, jnp.int32).at[target].set(values, mode="drop", unique_indices=True)


def _take_rows(x: jax.Array, idx: jax.Array, valid: jax.Array) -> jax.Array:
    """Rows ``x[idx]`` (``[A, ...]``), zero where not ``valid``. The row index is computed once per row, behind an
    optimization barrier: fused into the gather, XLA:GPU recomputed it (e.g. the combine backward's signed
    ``src // K``, ~20 integer operations) for every element of every row, which bounded the gather by the integer
    ALUs at ~1.3 TB/s (1.24 ms a layer at the proxy's MBS 11 on an H200)."""
    rows = jax.lax.optimization_barrier(jnp.where(valid, idx, x.shape[0]))
    return jnp.take(x, rows, axis=0, mode="fill", fill_value=0)


def _sum_of_choices(x: jax.Array, slot: jax.Array, k: int) -> jax.Array:
    """``out[t] = sum_j x[slot[t*k + j]]`` in float32 (``slot`` -1: a zero term): ``[T, H]``.
    Written as ``k`` gathered ``[T, H]`` terms added one after another, an elementwise loop that reads each
    gathered row once. The ``[T, K, H]`` form summed over its middle axis made XLA:GPU write the gathered rows
    converted to float32 in a kernel of their own (twice the rows' bytes) and sum them in a second one:
    12.3 ms a step in the proxy's dispatch backward at MBS 10 on an H200."""
    idx = slot.reshape(-1, k)
    total = None
    for j in range(k):
        term = _take_rows(x, idx[:, j], idx[:, j] >= 0).astype(jnp.float32)
        total = term if total is None else total + term
    return total


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch_rows(x: jax.Array, src: jax.Array, slot: jax.Array, top_k: int) -> jax.Array:
    """Gather token rows x ``[T, H]`` into the buffer ``[S, H]`` (``src [S]``; empty rows zero)."""
    return _take_rows(x, src // top_k, src >= 0)


def _dispatch_fwd(x, src, slot, top_k):
    return dispatch_rows(x, src, slot, top_k), slot


def _dispatch_bwd(top_k, slot, g):
    return _sum_of_choices(g, slot, top_k).astype(g.dtype), None, None


dispatch_rows.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine_rows(y: jax.Array, weights: jax.Array, slot: jax.Array, src: jax.Array) -> jax.Array:
    """``out[t] = sum_k weights[t, k] * y[slot[t*K + k]]``: y ``[S, H]``, weights ``[T, K]`` -> ``[T, H]``."""
    t, k = weights.shape
    rows = _take_rows(y, slot, slot >= 0).reshape(t, k, y.shape[-1])
    out = jnp.einsum("tkh,tk->th", rows, weights, preferred_element_type=jnp.float32)
    return out.astype(y.dtype)


def _combine_fwd(y, weights, slot, src):
    return combine_rows(y, weights, slot, src), (y, weights, slot, src)


def _combine_bwd(res, g):
    y, weights, slot, src = res
    t, k = weights.shape
    rows = _take_rows(y, slot, slot >= 0).reshape(t, k, y.shape[-1])
    dw = jnp.einsum("tkh,th->tk", rows, g, preferred_element_type=jnp.float32).astype(weights.dtype)
    valid = src >= 0
    g_rows = _take_rows(g, src // k, valid).astype(jnp.float32)
    w_rows = jnp.take(weights.reshape(-1), jnp.where(valid, src, 0)).astype(jnp.float32)
    dy = (g_rows * jnp.where(valid, w_rows, 0.0)[:, None]).astype(y.dtype)
    return dy, dw, None, None


combine_rows.defvjp(_combine_fwd, _combine_bwd)


# The Triton row kernels (compute.moe.kernels.permute_kernels: "dispatch", "combine_bwd") leave the buffer's rows no
# assignment maps to unwritten, so they serve only the Triton / Mosaic expert kernels (no row past sum(group_sizes)
# read) and not FP8 (whose scales are maxima over every row).


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def dispatch_rows_kernel(x: jax.Array, src: jax.Array, slot: jax.Array, top_k: int) -> jax.Array:
    """:func:`dispatch_rows` as one Pallas-Triton kernel (``permute_triton.dispatch``: each token row read once and
    written to its slots); the buffer's rows no assignment maps to are left unwritten. Same backward."""
    return permute_triton.dispatch(x, slot, top_k, src.shape[0])


def _dispatch_kernel_fwd(x, src, slot, top_k):
    return dispatch_rows_kernel(x, src, slot, top_k), slot


dispatch_rows_kernel.defvjp(_dispatch_kernel_fwd, _dispatch_bwd)


@jax.custom_vjp
def combine_rows_kernel(y: jax.Array, weights: jax.Array, slot: jax.Array, src: jax.Array) -> jax.Array:
    """:func:`combine_rows` whose backward is one Pallas-Triton kernel (``permute_triton.combine_bwd``: g and y read
    once, d(weights) and d(y) in one pass) instead of XLA's gather and gathered-row reduction. The rows of d(y) no
    assignment maps to are left unwritten."""
    return combine_rows(y, weights, slot, src)


def _combine_kernel_bwd(res, g):
    y, weights, slot, _ = res
    dy, dw = permute_triton.combine_bwd(y, weights, slot, g)
    return dy, dw, None, None


combine_rows_kernel.defvjp(_combine_fwd, _combine_kernel_bwd)


FFN_SCOPE = "expert_ffn"  # the expert matmuls + SwiGLU in profiler traces (the rest of "experts": dispatch)


def swiglu(h: jax.Array, row_w: jax.Array | None = None) -> jax.Array:
    """``[..., 2I]`` (gate half first) -> ``[..., I]`` = silu(gate) * up, computed in float32 and rounded once.
    ``row_w [M]`` (``h [M, 2I]``): Megatron's weighted SwiGLU, each row times its routing weight before the rounding
    (fusion "mgpu_dweighted", whose backward ``gmm_mgpu.gmm_dswiglu`` with row weights computes)."""
    gate, up = jnp.split(h, 2, axis=-1)
    act = jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)
    if row_w is not None:
        act = act * row_w.astype(jnp.float32)[:, None]
    return act.astype(h.dtype)


def _fp8_gemm(matmul: Callable, lhs: jax.Array, rhs: jax.Array, q: fp8.ExpertsScope | None, *args: Any,
              **kwargs: Any) -> jax.Array:
    """``matmul(lhs, rhs [G, K, N], ...)``, in FP8 when ``q`` holds a recipe (per expert: ``rhs``'s first axis):
    quantise-dequantise around it (``compute.fp8.experts_kernel: qdq``)."""
    if q is None:
        return matmul(lhs, rhs, *args, **kwargs)
    lhs, rhs = fp8.operands(lhs, rhs, q.cfg, rhs_batch_dims=1, lhs_axes=q.row_axes, rhs_axes=q.weight_axes)
    return fp8.output(matmul(lhs, rhs, *args, **kwargs), q.cfg, q.row_axes)


def expert_ffn(
    rows: jax.Array, group_sizes: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, backend: str | None,
    zero_tail_rows: bool = True, kernels: KernelsConfig = DEFAULT_KERNELS,
) -> jax.Array:
    """SwiGLU experts on expert-sorted rows ``[M, H]``; w_gate_up ``[G, H, 2I]``, w_down ``[G, I, H]``.
    ``zero_tail_rows=False``: the caller reads no output row past ``sum(group_sizes)`` and uses no gradient
    of those input rows, so the Triton kernels may leave them unwritten (no masking passes; see
    :func:`grouped_matmul`); under an FP8 recipe they are zeroed anyway (its scales are maxima over all rows).
    ``kernels``: the Triton backend's choices. Fusion "mgpu_dswiglu" (the experts after the all-to-all / all-gather
    dispatchers, or the local ones without "mgpu_dweighted"): where the down projection's d(x) runs on the Mosaic-GPU
    kernel, SwiGLU's backward in that kernel's epilogue (:func:`_mgpu_swiglu_experts`)."""
    rows = checkpoint_name(rows, MOE_PERMUTED)
    q = fp8.experts_scope()  # the FP8 recipe of the experts being traced (parallelism.fp8.scope), or None
    if (backend == "triton" and q is None and not zero_tail_rows and kernels.fused("mgpu_dswiglu")
            and mgpu_takes("dx", rows.shape[0], w_down.shape[2], w_down.shape[1], rows.dtype, kernels)):
        with jax.named_scope(FFN_SCOPE):
            y = _mgpu_swiglu_experts(rows, w_gate_up.astype(rows.dtype), w_down.astype(rows.dtype),
                                     group_sizes.astype(jnp.int32), None, kernels)
        return checkpoint_name(y, MOE_EXPERT_OUT)
    # FP8 scales each operand by its amax over every row: unwritten rows (any values, NaN included) would set it
    gmm = functools.partial(grouped_matmul, backend=backend, zero_tail_rows=zero_tail_rows or q is not None,
                            kernels=kernels)
    if q is not None and q.cfg.experts_kernel == "triton":  # the fp8 kernels (parallelism/gmm_fp8.py), own VJP
        if backend != "triton":
            raise ValueError(f"compute.fp8.experts_kernel 'triton' runs on the experts' backend 'triton', not "
                             f"{backend!r}")

        def matmul(lhs, rhs, q, sizes):  # rows past sum(group_sizes) zero, in d(lhs) too
            return gmm_fp8.grouped_matmul(lhs, rhs, sizes, q.cfg, q.row_axes, q.weight_axes)
    else:
        def matmul(lhs, rhs, q, sizes):
            return _fp8_gemm(gmm, lhs, rhs, q, sizes)

    with jax.named_scope(FFN_SCOPE):
        h = checkpoint_name(matmul(rows, w_gate_up, q, group_sizes), MOE_GATE_UP)
        act = checkpoint_name(swiglu(h), MOE_ACT)
        y = matmul(act, w_down, q, group_sizes)
    return checkpoint_name(y, MOE_EXPERT_OUT)


def capacity_ffn(rows: jax.Array, w_gate_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU experts on the drop-and-pad buffer ``[G, C, H]`` -> ``[G, C, H]`` (batched einsum)."""
    rows = checkpoint_name(rows, MOE_PERMUTED)
    q = fp8.experts_scope()
    with jax.named_scope(FFN_SCOPE):
        h = checkpoint_name(_fp8_gemm(capacity_matmul, rows, w_gate_up, q), MOE_GATE_UP)
        act = checkpoint_name(swiglu(h), MOE_ACT)
        y = _fp8_gemm(capacity_matmul, act, w_down, q)
    return checkpoint_name(y, MOE_EXPERT_OUT)


def sorted_experts(x: jax.Array, plan: RoutePlan, w: jax.Array, w_gate_up: jax.Array, w_down: jax.Array,
                   backend: str, kernels: KernelsConfig = DEFAULT_KERNELS) -> jax.Array:
    """The grouped matmul on expert-sorted rows (``plan``'s kept assignments): sort once, gather
    once, combine with the routing weights fused in; x ``[T, H]``, w ``[T, K]`` -> ``[T, H]``. The combine reads
    only the kept rows and the gather's backward only their gradients, so the expert matmuls leave the rows past the
    kept ones unwritten (dropless: none; masking h and y cost ~1.5 ms a layer at the proxy's MBS 11 on an H200).

    On the Triton backend outside FP8, ``kernels`` chooses (in this order, the first that applies):
    - fusion "mgpu_dweighted", where the down projection's d(x) runs on the Mosaic-GPU kernel (Hopper): Megatron's
      weighted SwiGLU (the routing weights applied to act in XLA's SwiGLU pass), SwiGLU's backward and the weights'
      gradient in that d(x) epilogue, and an unweighted combine whose backward is the dispatch of g (the combine
      backward's read of the experts' output goes);
    - fusion "gather", where the gate_up forward does not run on the Mosaic-GPU kernel (drop "fwd" from
      ``kernels.mosaic_gpu`` to fuse it on Hopper too): the gate_up kernel reads the token rows through the row index
      (:func:`_fused_ffn`; no dispatch gather);
    - else the dispatch gather, the experts (:func:`expert_ffn`) and the weighted combine;
    and the rows move by the Triton row kernels of ``kernels.permute_kernels``."""
    slot = sorted_slots(plan)
    src = inverse_slots(slot, slot.shape[0])
    k = w.shape[1]
    q = fp8.experts_scope()
    # the row kernels leave rows past sum(counts) unwritten: the Triton / Mosaic expert kernels read none of them
    on_kernels = backend == "triton" and q is None
    row_dispatch = on_kernels and "dispatch" in kernels.permute_kernels
    if on_kernels and _weighted_takes(slot.shape[0], w_down, x.dtype, kernels):
        rows = (dispatch_rows_kernel if row_dispatch else dispatch_rows)(x, src, slot, k)
        valid = src >= 0
        row_w = jnp.where(valid, jnp.take(w.reshape(-1), jnp.where(valid, src, 0)), 0).astype(jnp.float32)
        with jax.named_scope(FFN_SCOPE):
            y = _mgpu_swiglu_experts(rows, w_gate_up.astype(x.dtype), w_down.astype(x.dtype),
                                     plan.counts.astype(jnp.int32), row_w, kernels)
        return sum_rows(checkpoint_name(y, MOE_EXPERT_OUT), src, slot, k, row_dispatch)
    if (on_kernels and kernels.fused("gather")
            and not mgpu_takes("fwd", slot.shape[0], x.shape[1], w_gate_up.shape[2], x.dtype, kernels)):
        y = _fused_ffn(x, jnp.where(src >= 0, src // k, 0), slot, k, plan.counts, w_gate_up, w_down, kernels)
    else:
        dispatch = dispatch_rows_kernel if row_dispatch else dispatch_rows
        y = expert_ffn(dispatch(x, src, slot, k), plan.counts, w_gate_up, w_down, backend, zero_tail_rows=False,
                       kernels=kernels)
    combine_bwd = on_kernels and "combine_bwd" in kernels.permute_kernels
    return (combine_rows_kernel if combine_bwd else combine_rows)(y, w, slot, src)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _mgpu_swiglu_experts(x: jax.Array, w_gate_up: jax.Array, w_down: jax.Array, group_sizes: jax.Array,
                         row_w: jax.Array | None, kernels: KernelsConfig) -> jax.Array:
    """The SwiGLU experts with SwiGLU's backward in the down projection's d(x) epilogue on the Mosaic-GPU kernel
    (``gmm_mgpu.gmm_dswiglu``: d(h) written, d(act) never), then d(x), d(w) of both matmuls; the forward: the gate_up
    matmul, XLA's SwiGLU, the down projection (fusion "mgpu_dswiglu"). ``row_w [M]`` (float32, fusion
    "mgpu_dweighted"): each row's routing weight applied to act in XLA's SwiGLU pass (:func:`swiglu` with ``row_w``),
    ``y = (silu(gate) * up * row_w) @ w_down[g]``; the backward's d(x) kernel gives d(row_w) too and the down d(w)
    reads the weighted act saved. Rows past ``sum(group_sizes)`` unwritten (the caller reads none)."""
    return _mgpu_swiglu_experts_fwd(x, w_gate_up, w_down, group_sizes, row_w, kernels)[0]


def _mgpu_swiglu_experts_fwd(x, w_gate_up, w_down, group_sizes, row_w, kernels):
    h = plain_gmm(x, w_gate_up, group_sizes, kernels=kernels)
    act = swiglu(h, row_w)
    y = plain_gmm(act, w_down, group_sizes, kernels=kernels)
    return y, (checkpoint_name(x, MOE_PERMUTED), w_gate_up, w_down, group_sizes, checkpoint_name(h, MOE_GATE_UP),
               checkpoint_name(act, MOE_ACT), row_w)


def _mgpu_swiglu_experts_bwd(kernels, res, g):
    x, w_gate_up, w_down, group_sizes, h, act, row_w = res
    g = g.astype(x.dtype)
    tiles = kernels.mosaic_gpu_tiles.dx
    if row_w is None:
        dh, d_row_w = gmm_mgpu.gmm_dswiglu(g, w_down, group_sizes, h, config=tiles), None
    else:
        dh, d_row_w = gmm_mgpu.gmm_dswiglu(g, w_down, group_sizes, h, row_w, config=tiles)
    dw_down = plain_tgmm(act, g, group_sizes, out_dtype=w_down.dtype, kernels=kernels)
    # rows past sum(group_sizes) unwritten (never read)
    dx = plain_gmm(dh, w_gate_up, group_sizes, trans_w=True, kernels=kernels)
    return dx, plain_tgmm(x, dh, group_sizes, out_dtype=w_gate_up.dtype, kernels=kernels), dw_down, None, d_row_w


_mgpu_swiglu_experts.defvjp(_mgpu_swiglu_experts_fwd, _mgpu_swiglu_experts_bwd)


def _weighted_takes(m: int, w_down: jax.Array, dtype: Any, kernels: KernelsConfig) -> bool:
    """Whether the local experts of ``m`` sorted rows run weighted: fusion "mgpu_dweighted" chosen and the down
    projection's d(x) on the Mosaic-GPU kernel."""
    return kernels.fused("mgpu_dweighted") and mgpu_takes("dx", m, w_down.shape[2], w_down.shape[1], dtype, kernels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def sum_rows(y: jax.Array, src: jax.Array, slot: jax.Array, top_k: int, kernel: bool) -> jax.Array:
    """The unweighted combine: ``out[t] = sum_k y[slot[t*K + k]]`` (float32 sum), y ``[S, H]`` -> ``[T, H]``, for
    experts whose output already carries the routing weights (fusion "mgpu_dweighted"). It is :func:`dispatch_rows`'
    transpose, and its backward that dispatch of g (``kernel``: the Triton row kernel, the buffer's rows no
    assignment maps to unwritten)."""
    return _sum_of_choices(y, slot, top_k).astype(y.dtype)


def _sum_rows_fwd(y, src, slot, top_k, kernel):
    return sum_rows(y, src, slot, top_k, kernel), (src, slot)


def _sum_rows_bwd(top_k, kernel, res, g):
    src, slot = res
    dy = permute_triton.dispatch(g, slot, top_k, src.shape[0]) if kernel else _take_rows(g, src // top_k, src >= 0)
    return dy, None, None


sum_rows.defvjp(_sum_rows_fwd, _sum_rows_bwd)


# ----------------------------------------------------------------------------- the "gather" fusion


def _fused_ffn(x: jax.Array, index: jax.Array, slot: jax.Array, top_k: int, group_sizes: jax.Array,
               w_gate_up: jax.Array, w_down: jax.Array, kernels: KernelsConfig) -> jax.Array:
    """:func:`expert_ffn` on the Triton kernels for rows ``x[index]`` (``x [T, H]``, ``index [A]`` int32) without
    building them first: the gate_up forward kernel reads the token rows through the index (no dispatch gather
    kernel) and, in its first column block's programs, writes the gathered rows ``[A, H]`` for the backward's d(w)
    (remat name moe_permuted, placed inside the forward rule). Its d(x) kernel writes rows in the sorted layout,
    summed back per token by ``slot`` / ``top_k`` as :func:`dispatch_rows`' backward does. Rows past
    ``sum(group_sizes)`` unwritten (the caller reads none)."""
    group_sizes = group_sizes.astype(jnp.int32)
    w_gate_up, w_down = w_gate_up.astype(x.dtype), w_down.astype(x.dtype)
    with jax.named_scope(FFN_SCOPE):
        h = checkpoint_name(_gate_up(x, w_gate_up, group_sizes, index, slot, top_k, kernels), MOE_GATE_UP)
        act = checkpoint_name(swiglu(h), MOE_ACT)
        y = grouped_matmul(act, w_down, group_sizes, backend="triton", zero_tail_rows=False, kernels=kernels)
    return checkpoint_name(y, MOE_EXPERT_OUT)


def _gate_up_config(x: jax.Array, w: jax.Array, kernels: KernelsConfig):
    return kernels.triton_config("fwd", x.shape[1], w.shape[2])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _gate_up(x, w, group_sizes, index, slot, top_k: int, kernels: KernelsConfig):
    """The first expert matmul on the Triton kernels: ``h = x[index] @ w[g]``, the rows read through the index in
    the kernel; the forward rule has the kernel write ``x[index]`` for d(w)."""
    return gmm_triton.gmm(x, w, group_sizes, rows=index, config=_gate_up_config(x, w, kernels))


def _gate_up_fwd(x, w, group_sizes, index, slot, top_k, kernels):
    out, rows = gmm_triton.gmm(x, w, group_sizes, rows=index, gathered_out=True,
                               config=_gate_up_config(x, w, kernels))
    # x[index], named here: a remat policy that saves moe_permuted keeps this residual
    return out, (checkpoint_name(rows, MOE_PERMUTED), w, group_sizes, slot)


def _gate_up_bwd(top_k, kernels, res, g):
    rows, w, group_sizes, slot = res
    dh = g.astype(rows.dtype)
    drows = plain_gmm(dh, w, group_sizes, trans_w=True, kernels=kernels)  # rows past sum(group_sizes) unwritten
    dx = _dispatch_bwd(top_k, slot, drows)[0]  # back per token: slot reads only kept (written) rows
    dw = plain_tgmm(rows, dh, group_sizes, out_dtype=w.dtype, kernels=kernels)
    return dx, dw, None, None, None


_gate_up.defvjp(_gate_up_fwd, _gate_up_bwd)
