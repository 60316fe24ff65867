"""Issue 24: the experts' combine backward gathers each assignment's token gradient row into the expert-sorted
layout, ``dy[s] = w[src[s]] * g[src[s] // K]`` (``parallelism/permute.py`` ``_combine_bwd``). In the proxy step at
MBS 11 on an H200 it ran at ~1.3 TB/s (1.24 ms a layer, 11.2 ms a step; bench/step_h200.md run 22), a third of the
HBM's rate for a row gather of 4 KB rows. This times forms of it alone, each checked bitwise against the first:

- ``fused_index``: dy as run 22 ran it (the index arithmetic inside the gather fusion);
- ``index_barrier``: the clamped row index computed first, behind an optimization barrier (the gather fusion
  only loads through it): the library's ``_take_rows`` since run 22;
- ``u32_rows``: the rows gathered as uint32 pairs of bf16 (half the elements, 4-byte loads), then the scale;
- ``clip_mask``: ``mode="clip"`` and a multiply by the validity mask instead of ``mode="fill"``.

    python3 bench/scripts/probe_gather.py --out $OUT/gather.json     (--tokens 45056 --hidden 2048 --top-k 8)
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from moevlm_jax.tools.bench_moe import time_calls


def fused_index(g, weights, src, k):
    t = g.shape[0]
    valid = src >= 0
    g_rows = jnp.take(g, jnp.where(valid, src // k, t), axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    w_rows = jnp.take(weights.reshape(-1), jnp.where(valid, src, 0)).astype(jnp.float32)
    return (g_rows * jnp.where(valid, w_rows, 0.0)[:, None]).astype(g.dtype)


def index_barrier(g, weights, src, k):
    t = g.shape[0]
    valid = src >= 0
    idx, w = jax.lax.optimization_barrier((jnp.where(valid, src // k, t),
                                           jnp.where(valid, jnp.take(weights.reshape(-1), jnp.where(valid, src, 0)), 0)))
    g_rows = jnp.take(g, idx, axis=0, mode="fill", fill_value=0).astype(jnp.float32)
    return (g_rows * w.astype(jnp.float32)[:, None]).astype(g.dtype)


def u32_rows(g, weights, src, k):
    t, h = g.shape
    valid = src >= 0
    pairs = jax.lax.bitcast_convert_type(g.reshape(t, h // 2, 2), jnp.uint32)  # [T, H/2]
    rows = jnp.take(pairs, jnp.where(valid, src // k, t), axis=0, mode="fill", fill_value=0)
    g_rows = jax.lax.bitcast_convert_type(rows, g.dtype).reshape(-1, h).astype(jnp.float32)
    w_rows = jnp.take(weights.reshape(-1), jnp.where(valid, src, 0)).astype(jnp.float32)
    return (g_rows * jnp.where(valid, w_rows, 0.0)[:, None]).astype(g.dtype)


def clip_mask(g, weights, src, k):
    valid = src >= 0
    g_rows = jnp.take(g, jnp.maximum(src, 0) // k, axis=0, mode="clip").astype(jnp.float32)
    w_rows = jnp.take(weights.reshape(-1), jnp.maximum(src, 0), mode="clip").astype(jnp.float32)
    return (g_rows * jnp.where(valid, w_rows, 0.0)[:, None]).astype(g.dtype)


VARIANTS = {"fused_index": fused_index, "index_barrier": index_barrier, "u32_rows": u32_rows, "clip_mask": clip_mask}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=45056)  # MBS 11 x 4096
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="gather.json")
    args = ap.parse_args()
    t, h, k = args.tokens, args.hidden, args.top_k
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    weights = jnp.asarray(rng.random((t, k)), jnp.bfloat16)
    src = jnp.asarray(rng.permutation(t * k), jnp.int32)  # the sorted layout's source assignment of each row
    moved = 2 * (t * k * h * 2)  # rows read once each (token rows read K times) + written
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "shape": [t, h, k], "results": {}}
    ref = None
    for name, fn in VARIANTS.items():
        f = jax.jit(fn, static_argnums=3)
        y = jax.block_until_ready(f(g, weights, src, k))
        ref = y if ref is None else ref
        same = bool(jnp.array_equal(y, ref))
        ms = time_calls(f, (g, weights, src, k), args.iters, 1, synchronised=False)[0]
        out["results"][name] = {"ms": ms, "gb_s": moved / ms * 1e-6, "equal_to_first": same}
        print(f"{name:14s} {ms:7.3f} ms  {moved / ms * 1e-6:6.0f} GB/s  equal: {same}", flush=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
