"""Losses: chunked LM-head cross-entropy (the ``[B, S, vocab]`` logits never exist whole) and the
router losses computed from the per-layer statistics in ``aux["router"]``.

HF conventions: ``hf_labels_to_targets`` (moevlm_jax.model.batch) turns HF labels into
targets/loss_mask; HF's loss is ``sum / count`` of :func:`lm_loss`; HF's router aux loss is
:func:`load_balancing_loss` (``load_balancing_loss_func`` over all MoE layers' logits
concatenated, restricted to attention-mask tokens) and the total is ``lm + router_aux_loss_coef *
aux`` when HF is asked for router logits. Megatron's router losses (aux_loss, seq_aux_loss,
global_aux_loss, z-loss per layer) and the options that pick them live in
``moevlm_jax.model.router`` / ``ComputeConfig.router``; :func:`model_loss` adds them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from moevlm_jax.model.router import load_balancing_loss, router_losses, router_z_loss
from parallelism.logical import constrain

__all__ = ["lm_loss", "load_balancing_loss", "model_loss", "router_z_loss"]


@jax.custom_vjp
def logits_f32(hidden: jax.Array, kernel: jax.Array) -> jax.Array:
    """``[..., H] x [H, V] -> [..., V]`` float32 (accumulated in float32 from the inputs' dtype). The
    backward casts the float32 cotangent to the inputs' dtype before its two matmuls, as mixed
    precision does elsewhere: left to autodiff, a float32 cotangent times a bf16 operand is a float32
    (TF32 on the H200) GEMM at about half the bf16 rate, on the largest matmuls of the step."""
    return jnp.einsum("...h,hv->...v", hidden, kernel, preferred_element_type=jnp.float32)


def _logits_fwd(hidden: jax.Array, kernel: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return logits_f32(hidden, kernel), (hidden, kernel)


def _logits_bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    hidden, kernel = res
    g = g.astype(hidden.dtype)
    dh = jnp.einsum("...v,hv->...h", g, kernel, preferred_element_type=jnp.float32).astype(hidden.dtype)
    lead = "".join(chr(ord("a") + i) for i in range(hidden.ndim - 1))
    dk = jnp.einsum(f"{lead}h,{lead}v->hv", hidden, g, preferred_element_type=jnp.float32).astype(kernel.dtype)
    return dh, dk


logits_f32.defvjp(_logits_fwd, _logits_bwd)


def lm_loss(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, loss_mask: jax.Array,
            chunk_size: int = 2048) -> tuple[jax.Array, jax.Array]:
    """hidden ``[B, S, H]``, LM head kernel ``[H, V]``, targets ``[B, S]``, loss_mask ``[B, S]`` ->
    (sum of masked token cross-entropies, sum of the mask), both float32 scalars.

    Scans over ``n`` sequence chunks of ``chunk_size`` tokens with a rematerialised body, so only one
    chunk's logits ``[B, chunk, V]`` (float32) are live at a time, forward and backward. Chunk j
    holds positions ``j, j + n, j + 2n, ...`` (strided): a sequence split into contiguous blocks
    over devices (context parallelism) keeps each device's share in every chunk, so the scan never
    slices a sharded axis. The logits are vocabulary-parallel when the layout splits ``act_vocab``.
    """
    hidden = constrain(hidden, ("act_batch", "act_seq", "act_embed"))  # sequence-parallel stream gathered
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
        hidden.reshape(b, c, n, h).transpose(2, 0, 1, 3),
        targets.reshape(b, c, n).transpose(2, 0, 1),
        loss_mask.astype(jnp.float32).reshape(b, c, n).transpose(2, 0, 1),
    )

    @jax.checkpoint
    def chunk_loss(hc, tc, mc):
        logits = constrain(logits_f32(hc, kernel), ("act_batch", "act_seq", "act_vocab"))
        lse = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.take_along_axis(logits, tc[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return jnp.sum((lse - target_logit) * mc)

    def step(total, xs):
        return total + chunk_loss(*xs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), chunks)
    return total, jnp.sum(chunks[2])


def model_loss(model: Any, batch: Mapping[str, Any], *, dp_size: int | None = None
               ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Training loss of ``model`` (a Qwen3VLMoe) on ``batch`` (needs targets and loss_mask): mean
    token cross-entropy + the router losses per ``model.compute.router`` (``router.router_losses``;
    ``dp_size`` row groups for "aux_loss", None = from the sharding context)."""
    compute, text = model.compute, model.config.text_config
    hidden, aux = model.hidden_states(batch)
    ce_sum, count = lm_loss(hidden, model.lm_head_kernel(), jnp.asarray(batch["targets"]),
                            jnp.asarray(batch["loss_mask"]), compute.loss_chunk_size)
    ce = ce_sum / jnp.maximum(count, 1.0)
    metrics = {"ce_loss": ce, "ce_sum": ce_sum, "loss_tokens": count}
    loss = ce
    router = aux["router"]
    if router is not None:
        term, router_metrics = router_losses(router, compute.router, text.num_experts, text.num_experts_per_tok,
                                             text.router_aux_loss_coef, dp_size)
        metrics.update(router_metrics)
        loss = loss + term
    metrics["loss"] = loss
    return loss, metrics
