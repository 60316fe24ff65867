"""Issue 24: the LM head + cross-entropy alone at the proxy step's shapes (MBS 11: ~16k trained positions in 8 chunks
of 2048, vocabulary 151,936), forward + backward, in the library's forms and one not in it:

- ``fp32``: ``lm_loss`` as recipe h200 runs it (``compute.logits_fp32`` true: float32 logits; max, sum of exps and the
  target's logit are three reductions over them, bench/step_h200.md run 22);
- ``bf16``: ``compute.logits_fp32`` false (the logits written in bf16 as HF's LM head; softmax in float32);
- ``online_fp32`` / ``online_bf16``: the chunk's (max, sum of exps, target logit) in one variadic reduction (an
  online logsumexp: one read of the logits instead of three), then d(logits) as the library computes it.

Each is checked against ``fp32`` (loss and gradients) and timed (``bench_moe.time_calls``: calls back to back, median of 3
rounds of ``--iters``).

    python3 bench/scripts/probe_lm_head.py --out $OUT/lm_head.json     (--positions 16384 --chunk 2048)
"""

from __future__ import annotations

import argparse
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from moevlm_jax.model import loss as loss_lib
from moevlm_jax.tools.bench_moe import time_calls


def _online_stats(logits: jax.Array, is_target: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logsumexp, target logit) over the last axis in one variadic reduction."""
    def combine(a, b):
        (m1, s1, t1), (m2, s2, t2) = a, b
        m = jnp.maximum(m1, m2)
        e1 = jnp.where(m1 == -jnp.inf, 0.0, jnp.exp(m1 - m))
        e2 = jnp.where(m2 == -jnp.inf, 0.0, jnp.exp(m2 - m))
        return m, s1 * e1 + s2 * e2, t1 + t2

    ones = jnp.ones_like(logits)
    tgt = jnp.where(is_target, logits, 0.0)
    init = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(0.0))
    m, s, t = jax.lax.reduce((logits, ones, tgt), init, combine, (logits.ndim - 1,))
    return m + jnp.log(s), t


def online_chunk_ce(h, kernel, t, m, grads, fp32_logits=True):
    out = jnp.float32 if fp32_logits else h.dtype
    logits = jnp.einsum("bch,hv->bcv", h, kernel, preferred_element_type=out).astype(jnp.float32)
    is_target = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 2) == t[..., None].astype(jnp.int32)
    lse, tgt = _online_stats(logits, is_target)
    ce = jnp.sum((lse - tgt) * m)
    if not grads:
        return ce, None, None
    p = jnp.exp(logits - lse[..., None])
    dlogits = ((p - is_target.astype(jnp.float32)) * m[..., None]).astype(h.dtype)
    dh = jnp.einsum("bcv,hv->bch", dlogits, kernel, preferred_element_type=jnp.float32).astype(h.dtype)
    dk = jnp.einsum("bch,bcv->hv", h, dlogits, preferred_element_type=jnp.float32)
    return ce, dh, dk


def run(variant: str, hidden, kernel, targets, mask, chunk: int):
    fp32 = variant.endswith("fp32")
    orig = loss_lib._chunk_ce
    if variant.startswith("online"):  # traced with the one-pass chunk in the library's scan and custom VJP
        loss_lib._chunk_ce = online_chunk_ce
    try:
        return jax.value_and_grad(lambda h, k: loss_lib.lm_loss(h, k, targets, mask, chunk, fp32)[0],
                                  argnums=(0, 1))(hidden, kernel)
    finally:
        loss_lib._chunk_ce = orig


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--positions", type=int, default=16384)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--variants", default="fp32,bf16,online_fp32,online_bf16")
    ap.add_argument("--out", default="lm_head.json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.standard_normal((1, args.positions, args.hidden)), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((args.hidden, args.vocab)) * 0.02, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, args.vocab, (1, args.positions)), jnp.int32)
    mask = jnp.ones((1, args.positions), jnp.float32)
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "args": vars(args), "results": {}}
    ref = None
    for name in args.variants.split(","):
        f = jax.jit(functools.partial(run, name, chunk=args.chunk))
        val, grads = jax.block_until_ready(f(hidden, kernel, targets, mask))
        if ref is None:
            ref = (val, grads)
        rel = [float(jnp.linalg.norm(a.astype(jnp.float32) - b.astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))
               for a, b in zip(grads, ref[1])]
        ms = time_calls(f, (hidden, kernel, targets, mask), args.iters, 1, synchronised=False)[0]
        row = {"ms": ms, "loss": float(val), "loss_rel_vs_fp32": abs(float(val) - float(ref[0])) / abs(float(ref[0])),
               "grad_rel_vs_fp32": rel}
        out["results"][name] = row
        print(f"{name:12s} {row['ms']:8.3f} ms  loss {row['loss']:.6f}  vs fp32 {row['loss_rel_vs_fp32']:.2e}  "
              f"grads {rel[0]:.2e} {rel[1]:.2e}", flush=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
