"""Losses: chunked LM-head cross-entropy (the ``[B, S, vocab]`` logits never exist whole) and the
router losses computed from the per-layer statistics in ``aux["router"]``.

HF conventions: ``hf_labels_to_targets`` (data.batch) turns HF labels into
targets/loss_mask; HF's loss is ``sum / count`` of :func:`lm_loss`; HF's router aux loss is
:func:`load_balancing_loss` (``load_balancing_loss_func`` over all MoE layers' logits
concatenated, restricted to attention-mask tokens) and the total is ``lm + router_aux_loss_coef *
aux`` when HF is asked for router logits. Megatron's router losses (aux_loss, seq_aux_loss,
global_aux_loss, z-loss per layer) and the options that pick them live in
``moevlm_jax.model.router`` / ``ComputeConfig.router``; the trainer's objective
(``moevlm_jax.training.objective``) adds them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from moevlm_jax.model.router import load_balancing_loss, router_z_loss
from moevlm_jax.parallelism.logical import constrain, split_counts

__all__ = ["lm_loss", "load_balancing_loss", "router_z_loss"]


VOCAB_ACT = ("act_batch", "act_seq", "act_vocab")
HEAD_ACT = ("act_embed", "act_vocab")  # the LM head kernel as the chunks' GEMMs read it
HEAD_PARAM = ("embed", "vocab")  # the LM head kernel's parameter axes: its gradient's sum
# d(kernel) summed over each device's own rows and positions: [batch shards, sequence shards, H, V], reduced once
HEAD_PARTIAL = ("act_batch", "act_seq", None, "act_vocab")


def _chunk_ce(h: jax.Array, kernel: jax.Array, t: jax.Array, m: jax.Array, grads: bool, fp32_logits: bool = True,
              shards: tuple[int, int] = (1, 1)):
    """One chunk: logits (bf16 GEMM, float32 accumulation) written in float32, or with ``fp32_logits`` False
    rounded to the inputs' dtype as HF's LM head writes them; the softmax and the masked CE sum in float32.
    With ``grads`` also d(CE)/d(logits) = (softmax - onehot) * mask in the inputs' dtype, d(h) and d(kernel);
    d(kernel) ``[x, y, H, V]`` with ``shards`` (x, y): the batch rows and chunk positions the layout splits
    into x and y parts, each part's own sum (:data:`HEAD_PARTIAL`), else ``[H, V]``."""
    out = jnp.float32 if fp32_logits else h.dtype
    logits = jnp.einsum("bch,hv->bcv", h, kernel, preferred_element_type=out)
    logits = constrain(logits, VOCAB_ACT).astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t[..., None].astype(jnp.int32)
    ce = jnp.sum((lse - jnp.sum(jnp.where(is_target, logits, 0.0), axis=-1)) * m)
    if not grads:
        return ce, None, None
    p = jnp.exp(logits - lse[..., None])
    dlogits = constrain(((p - is_target.astype(jnp.float32)) * m[..., None]).astype(h.dtype), VOCAB_ACT)
    dh = jnp.einsum("bcv,hv->bch", dlogits, kernel, preferred_element_type=jnp.float32).astype(h.dtype)
    if shards == (1, 1):
        return ce, dh, jnp.einsum("bch,bcv->hv", h, dlogits, preferred_element_type=jnp.float32)
    (x, y), (b, c) = shards, h.shape[:2]
    hs, ds = (a.reshape(x, b // x, y, c // y, a.shape[-1]) for a in (h, dlogits))
    return ce, dh, constrain(jnp.einsum("xbych,xbycv->xyhv", hs, ds, preferred_element_type=jnp.float32), HEAD_PARTIAL)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def chunked_ce(hc: jax.Array, kernel: jax.Array, tc: jax.Array, mc: jax.Array, fp32_logits: bool = True) -> jax.Array:
    """Masked cross-entropy summed over chunks: hc ``[n, B, c, H]``, kernel ``[H, V]``, tc / mc
    ``[n, B, c]`` -> float32 scalar. One chunk's logits live at a time; ``fp32_logits`` as in
    :func:`lm_loss`.

    Fused linear cross-entropy (as Liger's / Megatron's): under differentiation the forward scan also
    computes each chunk's d(hidden) and accumulates d(kernel) in float32, from the logits it already
    holds, and the backward only scales them. Against autodiff of a rematerialised chunk that saves
    the recomputed logits GEMM (3 vocabulary GEMMs instead of 4), and every GEMM runs in the inputs'
    dtype: autodiff multiplied the float32 logits' cotangent into bf16 operands, i.e. float32 (TF32 on
    the H200) GEMMs at about half the bf16 rate, on the step's largest matmuls."""
    kernel = constrain(kernel, HEAD_ACT)

    def step(total, xs):
        h, t, m = xs
        return total + _chunk_ce(h, kernel, t, m, grads=False, fp32_logits=fp32_logits)[0], None

    return jax.lax.scan(step, jnp.zeros((), jnp.float32), (hc, tc, mc))[0]


def _chunked_ce_fwd(hc, kernel, tc, mc, fp32_logits):
    """The forward that also accumulates d(kernel). Where the layout splits the batch rows or the positions,
    each device sums its own chunks' d(kernel) (a carry of its part, :data:`HEAD_PARTIAL`) and the sum over
    devices is one reduce-scatter to the kernel's parameter axes after the scan: a carry summed over devices
    would be all-reduced whole ([H, V] float32) for every chunk. The kernel is constrained here, in the rule
    (not differentiated), so it is gathered once for all chunks and its cotangent keeps the parameter's axes."""
    kernel = constrain(kernel, HEAD_ACT)
    x, y = split_counts(("act_batch", "act_seq"))
    shards = (x, y) if hc.shape[1] % x == 0 and hc.shape[2] % y == 0 else (1, 1)

    def step(carry, xs):
        total, dk = carry
        h, t, m = xs
        ce, dh, dk_c = _chunk_ce(h, kernel, t, m, grads=True, fp32_logits=fp32_logits, shards=shards)
        return (total + ce, dk + dk_c), dh

    dk0 = (jnp.zeros(kernel.shape, jnp.float32) if shards == (1, 1)
           else constrain(jnp.zeros((*shards, *kernel.shape), jnp.float32), HEAD_PARTIAL))
    init = (jnp.zeros((), jnp.float32), dk0)
    (total, dk), dh = jax.lax.scan(step, init, (hc, tc, mc))
    if shards != (1, 1):
        dk = constrain(jnp.sum(dk, axis=(0, 1)), HEAD_PARAM)
    return total, (dh, dk, jnp.zeros((0,), kernel.dtype))  # the last: kernel's dtype, as an array


def _chunked_ce_bwd(fp32_logits, res, g):
    dh, dk, kernel_like = res
    return (g * dh).astype(dh.dtype), (g * dk).astype(kernel_like.dtype), None, None


chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


def lm_loss(hidden: jax.Array, kernel: jax.Array, targets: jax.Array, loss_mask: jax.Array,
            chunk_size: int = 2048, fp32_logits: bool = True) -> tuple[jax.Array, jax.Array]:
    """hidden ``[B, S, H]``, LM head kernel ``[H, V]``, targets ``[B, S]``, loss_mask ``[B, S]`` ->
    (sum of masked token cross-entropies, sum of the mask), both float32 scalars.

    Scans over ``n`` sequence chunks of ``chunk_size`` tokens (:func:`chunked_ce`), so only one
    chunk's logits ``[B, chunk, V]`` (float32) are live at a time, forward and backward. Chunk j
    holds positions ``j, j + n, j + 2n, ...`` (strided): a sequence split into contiguous blocks
    over devices (context parallelism) keeps each device's share in every chunk, so the scan never
    slices a sharded axis. The logits are vocabulary-parallel when the layout splits ``act_vocab``.

    ``fp32_logits`` (``compute.logits_fp32``): the logits GEMM writes float32 (more exact than HF); False:
    it writes the activations' dtype, as HF's LM head (and MaxText's ``logits_dot_in_fp32: false``) do before
    their float32 loss: half the bytes in each pass over a chunk's ``[B, c, vocab]`` logits.
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
    mc = loss_mask.astype(jnp.float32).reshape(b, c, n).transpose(2, 0, 1)
    total = chunked_ce(hidden.reshape(b, c, n, h).transpose(2, 0, 1, 3), kernel.astype(hidden.dtype),
                       targets.reshape(b, c, n).transpose(2, 0, 1), mc, fp32_logits)
    return total, jnp.sum(mc)
