"""Losses: chunked LM-head cross-entropy (the ``[B, S, vocab]`` logits never exist whole) and the
router losses computed from the per-layer statistics in ``aux["router"]``.

HF conventions: ``hf_labels_to_targets`` (moevlm_jax.model.batch) turns HF labels into
targets/loss_mask; HF's loss is ``sum / count`` of :func:`lm_loss`; HF's router aux loss is
:func:`load_balancing_loss` (``load_balancing_loss_func`` over all MoE layers' logits
concatenated, restricted to attention-mask tokens) and the total is ``lm + router_aux_loss_coef *
aux`` when HF is asked for router logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from parallelism.logical import constrain


def lm_loss(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, loss_mask: jax.Array,
            chunk_size: int = 2048) -> tuple[jax.Array, jax.Array]:
    """hidden ``[B, S, H]``, LM head kernel ``[H, V]``, targets ``[B, S]``, loss_mask ``[B, S]`` ->
    (sum of masked token cross-entropies, sum of the mask), both float32 scalars.

    Scans over sequence chunks of ``chunk_size`` with a rematerialised body, so only one chunk's
    logits ``[B, chunk, V]`` (float32) are live at a time, forward and backward.
    """
    b, s, h = hidden.shape
    c = min(chunk_size, s)
    pad = (-s) % c
    if pad:
        hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        loss_mask = jnp.pad(loss_mask, ((0, 0), (0, pad)))
    n = (s + pad) // c
    kernel = kernel.astype(hidden.dtype)
    chunks = (
        hidden.reshape(b, n, c, h).swapaxes(0, 1),
        targets.reshape(b, n, c).swapaxes(0, 1),
        loss_mask.astype(jnp.float32).reshape(b, n, c).swapaxes(0, 1),
    )

    @jax.checkpoint
    def chunk_loss(hc, tc, mc):
        logits = jnp.einsum("bch,hv->bcv", hc, kernel, preferred_element_type=jnp.float32)
        logits = constrain(logits, ("act_batch", "act_seq", "act_vocab"))
        lse = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.take_along_axis(logits, tc[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return jnp.sum((lse - target_logit) * mc)

    def step(total, xs):
        return total + chunk_loss(*xs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), chunks)
    return total, jnp.sum(chunks[2])


def load_balancing_loss(router: Mapping[str, jax.Array], num_experts: int) -> jax.Array:
    """HF ``load_balancing_loss_func`` from router stats (leading layer axis): ``E * sum_e f_e * P_e``
    with f_e = top-k assignments to e / (layers * tokens), P_e = summed probability / (layers * tokens)."""
    total = jnp.sum(router["tokens"])
    f = jnp.sum(router["expert_counts"], axis=(0, 1)) / total
    p = jnp.sum(router["prob_sums"], axis=(0, 1)) / total
    return num_experts * jnp.sum(f * p)


def router_z_loss(router: Mapping[str, jax.Array]) -> jax.Array:
    """ST-MoE z-loss: mean over layers of the token-mean of logsumexp(router logits)^2."""
    per_layer = jnp.sum(router["z_sums"], axis=1) / jnp.maximum(jnp.sum(router["tokens"], axis=1), 1.0)
    return jnp.mean(per_layer)


def model_loss(model: Any, batch: Mapping[str, Any]) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Training loss of ``model`` (a Qwen3VLMoe) on ``batch`` (needs targets and loss_mask):
    mean token cross-entropy + router aux loss (+ z-loss) per ``model.compute.router``."""
    compute, text = model.compute, model.config.text_config
    hidden, aux = model.hidden_states(batch)
    ce_sum, count = lm_loss(hidden, model.lm_head_kernel(), jnp.asarray(batch["targets"]),
                            jnp.asarray(batch["loss_mask"]), compute.loss_chunk_size)
    ce = ce_sum / jnp.maximum(count, 1.0)
    metrics = {"ce_loss": ce, "ce_sum": ce_sum, "loss_tokens": count}
    loss = ce
    router = aux["router"]
    if router is not None:
        metrics["router_aux_loss"] = load_balancing_loss(router, text.num_experts)
        metrics["router_z_loss"] = router_z_loss(router)
        if compute.router_option("aux_loss", "global") == "global":
            coef = compute.router_option("aux_loss_coef")
            coef = text.router_aux_loss_coef if coef is None else coef
            loss = loss + coef * metrics["router_aux_loss"]
        z_coef = compute.router_option("z_loss_coef") or 0.0
        if z_coef:
            loss = loss + z_coef * metrics["router_z_loss"]
    metrics["loss"] = loss
    return loss, metrics
