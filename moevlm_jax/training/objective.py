"""The trainer's objective: what one microbatch contributes to the step's loss, and the teacher-forced
eval pass.

Loss: cross-entropy summed over the trained tokens (``loss_mask``) of each microbatch, divided by the
trained tokens of the whole global batch, plus the router losses per ``ComputeConfig.router``
(averaged over microbatches, computed per microbatch as Megatron does; the per-rank "aux_loss" over
the data-parallel row groups the trainer passes in). Logits are computed only where they are needed:
the rows each data-parallel rank holds form one group, and the trained positions of each group are
gathered first (``capacity`` per group, static: the most trained tokens of a group rounded up to a
quarter step between powers of two, :func:`loss_capacity`), so the LM head works on ``[DP, capacity,
H]`` rather than ``[B, S, H]`` (same result; VQA answers are ~5% of the tokens). Groups where more
than half the positions are trained keep whole rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moevlm_jax.model import router as moe_router
from moevlm_jax.model.loss import lm_loss
from moevlm_jax.parallelism.logical import constrain

MIN_CAPACITY = 32  # smallest gathered-positions buffer per group (fewer distinct compiled shapes)


def capacity_step(n: int) -> int:
    """Smallest m * 2^k >= n with m in {4, 5, 6, 7} (quarter steps between powers of two)."""
    if n <= 4:
        return 4
    k = max((n - 1).bit_length() - 3, 0)
    return -(-n // (1 << k)) * (1 << k)


def most_trained(loss_mask: np.ndarray, groups: int, microbatches: int = 1) -> tuple[int, int]:
    """For a host loss_mask ``[rows, S]`` split into ``microbatches`` x ``groups`` consecutive row groups:
    (the most trained tokens of a group, the positions of a group)."""
    per_group = (np.asarray(loss_mask) > 0).reshape(microbatches * groups, -1)
    return int(np.max(np.count_nonzero(per_group, axis=-1), initial=0)), per_group.shape[-1]


def loss_capacity(most: int, positions: int) -> int | None:
    """Static gather size for groups of ``positions`` whose fullest holds ``most`` trained tokens (agreed
    over the processes by the trainer): ``most`` rounded up by :func:`capacity_step` (at least
    MIN_CAPACITY); None (whole rows) when that exceeds half a group's positions."""
    cap = max(MIN_CAPACITY, capacity_step(most))
    return None if 2 * cap > positions else cap


def largest_capacity(positions: int) -> int | None:
    """The largest capacity :func:`loss_capacity` gives groups of ``positions`` short of whole rows
    (None: every capacity means whole rows): every batch of that row shape fits it."""
    half = positions // 2
    if half < MIN_CAPACITY:
        return None
    k = half.bit_length() - 3  # half rounded down to a quarter step between powers of two
    return (half >> k) << k


def trained_positions(loss_mask: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """loss_mask ``[G, L]`` -> positions ``[G, C]`` int32 of the first ``C = capacity`` trained
    tokens of each group in order, and valid ``[G, C]`` bool (False past a group's trained tokens)."""
    n = loss_mask.shape[-1]
    score = jnp.where(loss_mask > 0, n - jnp.arange(n, dtype=jnp.int32), 0)
    values, idx = jax.lax.top_k(score, capacity)
    return idx.astype(jnp.int32), values > 0


def gather_trained(hidden: jax.Array, targets: jax.Array, loss_mask: jax.Array, groups: int, capacity: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """hidden ``[B, S, H]``, targets/loss_mask ``[B, S]`` -> the trained positions of each of ``groups``
    row groups (``B / groups`` consecutive rows, one data-parallel rank's): hidden ``[G, C, H]``,
    targets ``[G, C]``, mask ``[G, C]`` (0 on unused slots) and positions ``[G, C]`` (index into the
    group's flattened rows, -1 on unused slots)."""
    b, s, h = hidden.shape
    flat = (groups, b // groups * s)
    mask = loss_mask.reshape(flat)
    idx, valid = trained_positions(mask, capacity)
    # top_k's indices are distinct: a gather with unique indices, whose backward scatter needs no atomics
    # (as take_along_axis it was a 7.3 ms bf16 atomic scatter-add per H200 step, bench/results/step.md)
    hidden = hidden.reshape(*flat, h).at[jnp.arange(groups)[:, None], idx].get(unique_indices=True)
    hidden = constrain(hidden, ("act_batch", "act_seq", "act_embed"))
    targets = jnp.take_along_axis(targets.reshape(flat), idx, axis=1)
    mask = jnp.take_along_axis(mask, idx, axis=1) * valid
    return hidden, targets, mask, jnp.where(valid, idx, -1)


def ce_and_argmax(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, mask: jax.Array,
                  chunk_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """hidden ``[B, S, H]``, kernel ``[H, V]``, targets/mask ``[B, S]`` -> (masked CE sum, mask sum,
    argmax ids ``[B, S]`` int32), scanning sequence chunks so that ``[B, S, V]`` never exists whole."""
    b, s, h = hidden.shape
    c = min(chunk_size, s)
    pad = (-s) % c
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets, mask = jnp.pad(targets, ((0, 0), (0, pad))), jnp.pad(mask, ((0, 0), (0, pad)))
    n = (s + pad) // c
    xs = (hidden.reshape(b, n, c, h).swapaxes(0, 1), targets.reshape(b, n, c).swapaxes(0, 1),
          mask.astype(jnp.float32).reshape(b, n, c).swapaxes(0, 1))
    kernel = kernel.astype(hidden.dtype)

    def chunk(total, x):
        hc, tc, mc = x
        logits = jnp.einsum("bch,hv->bcv", hc, kernel, preferred_element_type=jnp.float32)
        logits = constrain(logits, ("act_batch", "act_seq", "act_vocab"))
        lse = jax.nn.logsumexp(logits, axis=-1)
        tgt = jnp.take_along_axis(logits, tc[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return total + jnp.sum((lse - tgt) * mc), jnp.argmax(logits, axis=-1).astype(jnp.int32)

    total, pred = jax.lax.scan(chunk, jnp.zeros((), jnp.float32), xs)
    return total, jnp.sum(xs[2]), pred.swapaxes(0, 1).reshape(b, n * c)[:, :s]


def microbatch_objective(model: Any, mb: Mapping[str, jax.Array], total_trained: jax.Array,
                         num_micro: int, capacity: int | None, groups: int = 1) -> tuple[jax.Array, dict[str,
                                                                                                         jax.Array]]:
    """One microbatch's share of the step objective: CE sum / trained tokens of the global batch +
    router losses / ``num_micro``; and summable metrics (ce_sum, trained_tokens, router losses).
    ``capacity``: gather that many trained positions per group of rows first (None: whole rows)."""
    compute, text = model.compute, model.config.text_config
    hidden, aux = model.hidden_states(mb)
    targets, mask = mb["targets"], mb["loss_mask"]
    if capacity is not None:
        hidden, targets, mask, _ = gather_trained(hidden, targets, mask, groups, capacity)
    with jax.named_scope("lm_head"):  # the chunked LM head + cross-entropy (profiler trace labels)
        ce_sum, count = lm_loss(hidden, model.lm_head_kernel(), targets, mask, compute.loss_chunk_size,
                                compute.logits_fp32)
    objective = ce_sum / total_trained
    metrics = {"ce_sum": ce_sum, "trained_tokens": count}
    router = aux["router"]
    if router is not None:
        # per micro-batch; "aux_loss" per data-parallel row group (``groups``), as Megatron per DP rank
        term, router_metrics = moe_router.router_losses(router, compute.router, text.num_experts,
                                                        text.num_experts_per_tok, text.router_aux_loss_coef, groups)
        objective = objective + term / num_micro
        metrics.update({k: v / num_micro for k, v in router_metrics.items()})
        metrics["router_load"] = moe_router.load_sums(router)  # summed over micro-batches: the step's loads
    return objective, metrics
