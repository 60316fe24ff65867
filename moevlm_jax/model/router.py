"""The MoE router: softmax scores in float32, top-k (optionally through the aux-loss-free expert
bias), renormalisation; the per-row routing statistics; every router loss computed from them; the
expert-bias update; expert-load metrics for logging.

Router statistics (``aux["router"]``, one leading axis over the MoE layers ``L``, rows ``B``):
``expert_counts [L, B, E]`` top-k assignments, ``prob_sums [L, B, E]`` summed softmax scores,
``tokens [L, B]``, ``z_sums [L, B]`` summed logsumexp(logits)^2, all over valid tokens
(``segment_ids > 0``); with the expert bias also ``aux_counts [L, B, E]`` (top-k of the unbiased
scores, which the aux losses use, as Megatron); with a capacity factor ``dropped [L, B]`` and
``assignments [L, B]`` (each call's global counts spread evenly over its rows, so row sums add up).

Losses, per MoE layer ``l`` (E experts, top-k K; ``C_e`` counts, ``P_e`` prob sums and ``T``
tokens summed over a set of rows), ``switch(rows) = E / (K * T^2) * sum_e C_e * P_e`` =
``E * sum_e f_e * p_e`` with ``f_e = C_e / (K T)``, ``p_e = P_e / T`` (Megatron
``switch_load_balancing_loss_func``):

- ``hf``: HF ``load_balancing_loss_func``: ``E * sum_e (C_e / (L T)) * (P_e / (L T))`` with the
  sums over all layers and rows together (one number, no 1/K: balanced = K).
- ``aux_loss``: per layer the mean over data-parallel row groups (rows of one DP shard) of
  ``switch(group)``.
- ``seq_aux_loss``: per layer the mean over rows (sequences) with tokens of ``switch(row)``.
- ``global_aux_loss``: per layer ``switch(all rows of the micro-batch)`` (all DP ranks).
- z-loss per layer: ``sum_tokens lse^2 / T`` over the micro-batch.

The objective adds ``coef * sum_l loss_l`` (Megatron attaches each layer's loss) for the Megatron
types and ``coef * hf`` for "hf"; the logged ``router_aux_loss`` / ``router_z_loss`` are the
mean over layers (Megatron's logged values) or the HF number.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moevlm_jax.model.compute import RouterConfig
from moevlm_jax.parallelism.sharding import path_str

log = logging.getLogger(__name__)

PyTree = Any
BIAS_NAME = "expert_bias"  # attribute of SparseMoeBlock holding the ExpertBias


class ExpertBias(nnx.Variable):
    """Aux-loss-free routing bias ``[E]`` float32 per MoE layer (``[layers, E]`` stacked), added to
    the router scores for top-k selection only. Model state, not a parameter: no gradient, no
    optimizer state; changed only by :func:`update_expert_bias`; saved with the parameters."""


# ----------------------------------------------------------------------------- routing


def route(logits: jax.Array, top_k: int, *, bias: jax.Array | None = None,
          norm_topk_prob: bool = True) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Router logits ``[..., E]`` -> softmax probs ``[..., E]`` f32, top-k weights ``[..., K]`` f32
    and expert ids ``[..., K]`` int32 (HF's Qwen3VLMoeTextTopKRouter). ``bias`` ``[E]`` is added to
    the probs for the top-k choice only; the weights are the unbiased probs (renormalised to sum 1
    when ``norm_topk_prob``)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if bias is None:
        top_w, top_i = jax.lax.top_k(probs, top_k)
    else:
        _, top_i = jax.lax.top_k(probs + jax.lax.stop_gradient(bias.astype(jnp.float32)), top_k)
        top_w = jnp.take_along_axis(probs, top_i, axis=-1)
    if norm_topk_prob:
        top_w = top_w / jnp.sum(top_w, axis=-1, keepdims=True)
    return probs, top_w, top_i.astype(jnp.int32)


def _counts(top_i: jax.Array, w: jax.Array, num_experts: int) -> jax.Array:
    onehot = jax.nn.one_hot(top_i, num_experts, dtype=jnp.float32).sum(axis=-2)  # [B, S, E]
    return jnp.einsum("bse,bs->be", onehot, w)


def router_stats(logits: jax.Array, probs: jax.Array, top_i: jax.Array, valid: jax.Array, num_experts: int,
                 *, aux_top_i: jax.Array | None = None) -> dict[str, jax.Array]:
    """Per-row routing sums over valid tokens: logits/probs ``[B, S, E]``, top_i ``[B, S, K]``,
    valid ``[B, S]`` -> expert_counts ``[B, E]``, prob_sums ``[B, E]``, tokens ``[B]``, z_sums
    ``[B]`` (+ aux_counts ``[B, E]`` from ``aux_top_i``, the unbiased top-k, when given)."""
    w = valid.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
    out = {
        "expert_counts": _counts(top_i, w, num_experts),
        "prob_sums": jnp.einsum("bse,bs->be", probs, w),
        "tokens": jnp.sum(w, axis=-1),
        "z_sums": jnp.sum(jnp.square(lse) * w, axis=-1),
    }
    if aux_top_i is not None:
        out["aux_counts"] = _counts(aux_top_i, w, num_experts)
    return out


# ----------------------------------------------------------------------------- losses


def load_balancing_loss(router: Mapping[str, jax.Array], num_experts: int) -> jax.Array:
    """HF ``load_balancing_loss_func`` from router stats (leading layer axis): ``E * sum_e f_e * P_e``
    with f_e = top-k assignments to e / (layers * tokens), P_e = summed probability / (layers * tokens)."""
    total = jnp.sum(router["tokens"])
    f = jnp.sum(router.get("aux_counts", router["expert_counts"]), axis=(0, 1)) / total
    p = jnp.sum(router["prob_sums"], axis=(0, 1)) / total
    return num_experts * jnp.sum(f * p)


def router_z_loss(router: Mapping[str, jax.Array]) -> jax.Array:
    """ST-MoE z-loss: mean over layers of the token-mean of logsumexp(router logits)^2."""
    return jnp.mean(z_loss_per_layer(router))


def z_loss_per_layer(router: Mapping[str, jax.Array]) -> jax.Array:
    """Per-layer z-loss ``[L]``: sum of logsumexp^2 over valid tokens / valid tokens (all rows)."""
    return jnp.sum(router["z_sums"], axis=1) / jnp.maximum(jnp.sum(router["tokens"], axis=1), 1.0)


def _switch(counts: jax.Array, prob_sums: jax.Array, tokens: jax.Array, num_experts: int, top_k: int) -> jax.Array:
    """``E / (K T^2) * sum_e C_e P_e`` over the last axis; counts/prob_sums ``[..., E]``, tokens ``[...]``."""
    t = jnp.maximum(tokens, 1.0)
    return num_experts * jnp.sum(counts * prob_sums, axis=-1) / (top_k * t * t)


def _masked_mean(values: jax.Array, tokens: jax.Array) -> jax.Array:
    """Mean over the last axis of ``values`` where ``tokens > 0``."""
    has = (tokens > 0).astype(jnp.float32)
    return jnp.sum(values * has, axis=-1) / jnp.maximum(jnp.sum(has, axis=-1), 1.0)


def aux_loss_per_layer(router: Mapping[str, jax.Array], kind: str, num_experts: int, top_k: int,
                       dp_size: int = 1) -> jax.Array:
    """Megatron load-balancing loss per MoE layer ``[L]`` for ``kind`` in aux_loss | seq_aux_loss |
    global_aux_loss (formulas in the module docstring); ``dp_size`` row groups for "aux_loss"."""
    counts = router.get("aux_counts", router["expert_counts"])  # [L, B, E]
    probs, tokens = router["prob_sums"], router["tokens"]  # [L, B, E], [L, B]
    if kind == "seq_aux_loss":
        return _masked_mean(_switch(counts, probs, tokens, num_experts, top_k), tokens)
    if kind == "global_aux_loss":
        dp_size = 1
    elif kind != "aux_loss":
        raise ValueError(f"aux_loss_per_layer: kind must be aux_loss, seq_aux_loss or global_aux_loss, got {kind!r}")
    n_layers, rows, e = counts.shape
    if dp_size < 1 or rows % dp_size:
        raise ValueError(f"aux_loss: {rows} rows do not split into {dp_size} data-parallel groups")
    g = dp_size
    c = counts.reshape(n_layers, g, rows // g, e).sum(2)
    p = probs.reshape(n_layers, g, rows // g, e).sum(2)
    t = tokens.reshape(n_layers, g, rows // g).sum(2)
    return _masked_mean(_switch(c, p, t, num_experts, top_k), t)


def router_losses(router: Mapping[str, jax.Array], cfg: RouterConfig, num_experts: int, top_k: int,
                  model_coef: float, dp_size: int = 1) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The router part of the objective for one micro-batch and its metrics: (coef-weighted aux +
    z terms, {router_aux_loss, router_z_loss, router_loss}). ``model_coef`` is the model config's
    ``router_aux_loss_coef`` (used when ``cfg.aux_loss_coef`` is None); ``dp_size``: the data-parallel
    row groups (Megatron's DP ranks) of the per-rank "aux_loss", given by the trainer."""
    if cfg.aux_loss in ("hf", "none"):
        aux_metric = load_balancing_loss(router, num_experts)
        aux_term = aux_metric
    else:
        per_layer = aux_loss_per_layer(router, cfg.aux_loss, num_experts, top_k, dp_size)
        aux_metric, aux_term = jnp.mean(per_layer), jnp.sum(per_layer)
    z_layers = z_loss_per_layer(router)
    coef = cfg.coef(model_coef)
    term = jnp.zeros((), jnp.float32)
    if coef:
        term = term + coef * aux_term
    if cfg.z_loss_coef:
        term = term + cfg.z_loss_coef * jnp.sum(z_layers)
    return term, {"router_aux_loss": aux_metric, "router_z_loss": jnp.mean(z_layers), "router_loss": term}


# ----------------------------------------------------------------------------- expert bias


def is_expert_bias_path(key_path: Any) -> bool:
    """Whether a jax key path (pure dict or nnx.State) leads to an ExpertBias value."""
    return path_str(key_path).split("/")[-1] == BIAS_NAME


def layer_counts(router_or_counts: Mapping[str, jax.Array] | jax.Array) -> jax.Array:
    """Top-k assignments per layer and expert ``[L, E]`` from router stats (rows summed) or counts."""
    c = router_or_counts["expert_counts"] if isinstance(router_or_counts, Mapping) else router_or_counts
    c = jnp.asarray(c, jnp.float32)
    return c.sum(axis=1) if c.ndim == 3 else c


def bias_step(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """``bias + rate * sign(mean_e(counts) - counts)``: bias/counts ``[..., E]`` (DeepSeek-V3's rule)."""
    counts = counts.astype(jnp.float32)
    offset = jnp.mean(counts, axis=-1, keepdims=True) - counts
    return (bias.astype(jnp.float32) + rate * jnp.sign(offset)).astype(bias.dtype)


def update_expert_bias(tree: PyTree, router_stats: Mapping[str, jax.Array] | jax.Array, rate: float) -> PyTree:
    """The expert biases moved towards balance by one step's loads (call once per optimizer step
    with the step's router stats summed over micro-batches: ``expert_counts`` ``[L, E]`` or
    ``[L, B, E]``, or that array). ``tree`` is a bias array ``[L, E]``, a params pure dict or
    nnx.State holding ``.../expert_bias`` leaves (MoE layer order = flatten order; returns a new
    tree), or an nnx Module (updated in place and returned)."""
    counts = layer_counts(router_stats)
    if isinstance(tree, nnx.Module):
        state = nnx.state(tree, ExpertBias)
        nnx.update(tree, update_expert_bias(state, counts, rate))
        return tree
    if isinstance(tree, (jax.Array, np.ndarray)):
        if tree.shape != counts.shape:
            raise ValueError(f"update_expert_bias: bias {tree.shape} and counts {counts.shape} differ")
        return bias_step(tree, counts, rate)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    used, out = 0, []
    for kp, leaf in flat:
        if is_expert_bias_path(kp):
            n = leaf.shape[0] if leaf.ndim == 2 else 1
            rows = counts[used:used + n]
            if rows.shape[0] != n:
                break
            out.append(bias_step(leaf, rows.reshape(leaf.shape), rate))
            used += n
        else:
            out.append(leaf)
    if used != counts.shape[0] or len(out) != len(flat):
        raise ValueError(f"update_expert_bias: counts for {counts.shape[0]} MoE layers but the tree's "
                         f"expert_bias leaves cover {used} (is compute.router.expert_bias on?)")
    return jax.tree_util.tree_unflatten(treedef, out)


def exclude_expert_bias(mask: PyTree) -> PyTree:
    """A trainable mask (tree of bools) with False at every ``expert_bias`` leaf."""
    return jax.tree_util.tree_map_with_path(lambda kp, m: False if is_expert_bias_path(kp) else m, mask)


# ----------------------------------------------------------------------------- logging


def load_sums(router: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """What a step sums over micro-batches for the bias update and load metrics: expert_counts
    ``[L, E]`` (+ dropped, assignments ``[L]`` under a capacity factor)."""
    out = {"expert_counts": layer_counts(router)}
    for k in ("dropped", "assignments"):
        if k in router:
            out[k] = jnp.sum(router[k], axis=1)
    return out


def expert_load_metrics(load: Mapping[str, jax.Array], per_layer: bool = False) -> dict[str, jax.Array]:
    """Scalars for metrics.jsonl from :func:`load_sums` (or ``aux["router"]``): ``moe/load_max_over_mean``
    (max over experts / mean tokens per expert, mean over layers), ``moe/load_max_over_mean_worst``
    (worst layer), ``moe/load_min_over_mean`` (mean over layers), ``moe/dropped_fraction`` (capacity
    factor set); ``per_layer`` adds ``moe/load_max_over_mean/layer_{i}`` (i = MoE layer index)."""
    counts = layer_counts(load)  # [L, E]
    mean = jnp.maximum(jnp.mean(counts, axis=-1), 1e-9)
    ratio = jnp.max(counts, axis=-1) / mean
    out = {"moe/load_max_over_mean": jnp.mean(ratio), "moe/load_max_over_mean_worst": jnp.max(ratio),
           "moe/load_min_over_mean": jnp.mean(jnp.min(counts, axis=-1) / mean)}
    if "dropped" in load and "assignments" in load:
        dropped, assigned = jnp.asarray(load["dropped"]), jnp.asarray(load["assignments"])
        if dropped.ndim == 2:  # raw router stats [L, B]
            dropped, assigned = dropped.sum(1), assigned.sum(1)
        out["moe/dropped_fraction"] = jnp.sum(dropped) / jnp.maximum(jnp.sum(assigned), 1.0)
    if per_layer:
        out.update({f"moe/load_max_over_mean/layer_{i}": ratio[i] for i in range(ratio.shape[0])})
    return out
