"""GPU probe: environment versions + packed (segment) attention paths through cuDNN vs XLA.

Run on the H200: python bench/scripts/probe_attention.py --out $OUT/attn.json (--cases, below; tokamax's kernels
need it on the path: source bench/scripts/gpu_env.sh first)
Checks each variant against an XLA float32 reference, then times forward and forward+backward.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def segment_offsets(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """seqlens [B, M] and start offsets [B, M+1] (-1 padded) of segments 1..M in each row."""
    ids = jnp.arange(1, max_segments + 1, dtype=segment_ids.dtype)
    onehot = segment_ids[:, :, None] == ids[None, None, :]  # [B, S, M]
    seqlens = onehot.sum(axis=1).astype(jnp.int32)  # [B, M]
    first = jnp.argmax(onehot, axis=1).astype(jnp.int32)  # [B, M]
    present = seqlens > 0
    offsets = jnp.where(present, first, -1)
    seqlens = jnp.where(present, seqlens, -1)
    offsets = jnp.concatenate([offsets, jnp.full_like(offsets[:, :1], -1)], axis=1)
    return seqlens, offsets


def ref_attention(q, k, v, segment_ids, causal):
    """XLA reference in float32 with a dense segment (+causal) mask. q [B,S,N,D], k/v [B,S,Nk,D]."""
    b, s, n, d = q.shape
    nk = k.shape[2]
    qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
    kf = jnp.repeat(kf, n // nk, axis=2)
    vf = jnp.repeat(vf, n // nk, axis=2)
    logits = jnp.einsum("bqnd,bknd->bnqk", qf, kf) / np.sqrt(d)
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, :, None] > 0)
    if causal:
        mask &= jnp.tril(jnp.ones((s, s), bool))[None]
    logits = jnp.where(mask[:, None], logits, -1e30)
    p = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bnqk,bknd->bqnd", p, vf)
    return jnp.where((segment_ids > 0)[:, :, None, None], out, 0.0)


def cudnn_packed(q, k, v, segment_ids, causal, max_segments, scale=None):
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    seqlens, offsets = segment_offsets(segment_ids, max_segments)
    out = dot_product_attention(
        q, k, v, q_seqlen=seqlens, kv_seqlen=seqlens, q_offsets=offsets, kv_offsets=offsets,
        scale=1.0 / np.sqrt(q.shape[-1]) if scale is None else scale,
        mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK, qkv_layout="BTNH")
    return jnp.where((segment_ids > 0)[:, :, None, None], out, 0).astype(q.dtype)


def padded(fn, to):
    """fn on q/k/v zero-padded along the head dim to ``to`` (scale kept at the true head dim's), the
    output sliced back: the same attention, run by a kernel tuned for a larger head dim."""
    def run(q, k, v, s, c):
        d = q.shape[-1]
        pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, to - d)])
        return fn(pad(q), pad(k), pad(v), s, c, scale=1.0 / np.sqrt(d))[..., :d]
    return run


def cudnn_dense_mask(q, k, v, segment_ids, causal):
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="cudnn")


def xla_dense_mask(q, k, v, segment_ids, causal):
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal, implementation="xla")


def cudnn_per_image(q, k, v, segment_ids, causal, images_per_row, scale=None):
    b, s, n, d = q.shape
    r = lambda x: x.reshape(b * images_per_row, s // images_per_row, x.shape[2], d)
    out = jax.nn.dot_product_attention(r(q), r(k), r(v), is_causal=causal, implementation="cudnn", scale=scale)
    return out.reshape(b, s, n, d)


def segment_ranges(segment_ids):
    """[B, T] contiguous segment ids (0 = padding) -> (k_start, k_end) [B, T]: the key range each query may see
    (its segment; a padding query sees only itself, its output is zeroed after). tokamax's ``Mask`` takes these
    per query row and skips key blocks outside them."""
    b, t = segment_ids.shape
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    first = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    last = jnp.concatenate([segment_ids[:, 1:] != segment_ids[:, :-1], jnp.ones((b, 1), bool)], axis=1)
    start = jax.lax.cummax(jnp.where(first, pos, 0), axis=1)
    end = jax.lax.cummin(jnp.where(last, pos + 1, t), axis=1, reverse=True)
    pad = segment_ids == 0
    return jnp.where(pad, pos, start), jnp.where(pad, pos + 1, end)


def check_ranges(segment_ids):
    """The ranges reproduce the segment mask on the segments' queries (numpy, once per case)."""
    seg = np.asarray(segment_ids)
    ks, ke = (np.asarray(x) for x in segment_ranges(segment_ids))
    cols = np.arange(seg.shape[1])
    got = (cols[None, None, :] >= ks[:, :, None]) & (cols[None, None, :] < ke[:, :, None])
    want = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    assert np.array_equal(got[seg > 0], want[seg > 0]), "segment_ranges disagrees with the segment mask"


def tokamax_ranges(impl):
    """tokamax's flash attention (``impl``: mosaic_gpu, the Hopper kernel; triton) with each query's key range
    from its segment (no dense mask: blocks outside the ranges are skipped)."""
    def run(q, k, v, segment_ids, causal, scale=None):
        from tokamax._src.ops.attention import api, base

        ks, ke = segment_ranges(segment_ids)
        mask = base.Mask(k_start=ks[:, None, :], k_end=ke[:, None, :], is_causal=causal)
        out = api.IMPLEMENTATIONS[impl](q, k, v, bias=None, mask=mask,
                                        logits_scale=1.0 / np.sqrt(q.shape[-1]) if scale is None else scale,
                                        precision=None, logits_soft_cap=None, q_sharding=None)
        return jnp.where((segment_ids > 0)[:, :, None, None], out, 0).astype(q.dtype)
    return run


def timeit(f, *args, iters=20):
    out = f(*args)
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def make_segments(b, s, lens):
    seg = np.zeros((b, s), np.int32)
    for r in range(b):
        pos = 0
        for i, L in enumerate(lens):
            seg[r, pos:pos + L] = i + 1
            pos += L
    return jnp.asarray(seg)


def run_case(name, b, s, n, nk, d, lens, causal, variants, results):
    key = jax.random.PRNGKey(0)
    kq, kk, kv, kg = jax.random.split(key, 4)
    q = jax.random.normal(kq, (b, s, n, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, nk, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, nk, d), jnp.bfloat16)
    g = jax.random.normal(kg, (b, s, n, d), jnp.bfloat16)
    seg = make_segments(b, s, lens)
    check_ranges(seg)
    useful = sum(L * L for L in lens) * (0.5 if causal else 1.0)
    flops_fwd = 4 * b * n * d * useful
    ref = jax.jit(lambda q, k, v: ref_attention(q, k, v, seg, causal))(q, k, v)
    for vname, fn in variants.items():
        row = {"case": name, "variant": vname}
        try:
            f = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, seg, causal))
            out = f(q, k, v)
            valid = (seg > 0)[:, :, None, None]
            err = jnp.linalg.norm(jnp.where(valid, out.astype(jnp.float32) - ref, 0)) / jnp.linalg.norm(ref)
            row["rel_err"] = float(err)
            t = timeit(f, q, k, v)

            def loss(q, k, v, fn=fn):
                o = fn(q, k, v, seg, causal)
                return jnp.sum((o * g).astype(jnp.float32))

            fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
            tb = timeit(fb, q, k, v)
            row.update(fwd_ms=t * 1e3, fwdbwd_ms=tb * 1e3,
                       fwd_tflops=flops_fwd / t / 1e12, fwdbwd_tflops=3.5 * flops_fwd / tb / 1e12)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        results.append(row)
        print(json.dumps(row), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attn.json")
    ap.add_argument("--cases", default="dec,vis", help="dec,vis (the first probe) and/or bounds,vis_pad "
                    "(segment bounds at the step's MBS 8; the vision head dim 72 padded for faster kernels), "
                    "tokamax (the proxy step's MBS 10: the library's cuDNN ragged kernel vs tokamax's flash "
                    "attention with per-query key ranges)")
    args = ap.parse_args()
    cases = set(args.cases.split(","))
    env = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()]}
    for mod in ("flax", "optax", "orbax.checkpoint", "transformers", "torch", "grain", "tokamax"):
        try:
            m = __import__(mod, fromlist=["_"])
            env[mod] = getattr(m, "__version__", "?")
        except Exception as e:  # noqa: BLE001
            env[mod] = f"missing: {type(e).__name__}: {str(e)[:120]}"
    print(json.dumps(env), flush=True)
    results = []
    dec = {
        "cudnn_packed_M8": lambda q, k, v, s, c: cudnn_packed(q, k, v, s, c, 8),
        "cudnn_packed_M64": lambda q, k, v, s, c: cudnn_packed(q, k, v, s, c, 64),
        "cudnn_dense_mask": cudnn_dense_mask,
        "cudnn_causal_nomask": lambda q, k, v, s, c: jax.nn.dot_product_attention(
            q, k, v, is_causal=c, implementation="cudnn"),
        "xla_dense_mask": xla_dense_mask,
    }
    # decoder: B=2, S=4096, 32 q / 4 kv heads, hd 128; one doc a row, then 4 docs of ~1k + padding
    if "dec" in cases:
        run_case("dec_1doc", 2, 4096, 32, 4, 128, [4096], True, dec, results)
        run_case("dec_4docs", 2, 4096, 32, 4, 128, [1500, 1200, 800, 500], True, dec, results)
    if "bounds" in cases:  # the proxy step's decoder: one sample a row (~3.9k tokens + padding), MBS 8
        bound = {f"cudnn_packed_M{m}": functools.partial(cudnn_packed, max_segments=m) for m in (1, 2, 4, 16)}
        run_case("dec_1doc_b8", 8, 4096, 32, 4, 128, [3900], True, bound, results)
    if "vis_pad" in cases:  # the proxy step's vision tower: 8 rows of 4 images x 784 patches, hd 72
        pk = lambda m: lambda q, k, v, s, c, scale=None: cudnn_packed(q, k, v, s, c, m, scale)
        pi = lambda q, k, v, s, c, scale=None: cudnn_per_image(q, k, v, s, c, 4, scale)
        vp = {"cudnn_packed_M16": pk(16), "cudnn_packed_M4": pk(4), "cudnn_per_image": pi}
        for to in (80, 96, 128):
            vp[f"cudnn_packed_M4_pad{to}"] = padded(pk(4), to)
        vp["cudnn_packed_M16_pad128"] = padded(pk(16), 128)
        vp["cudnn_per_image_pad128"] = padded(pi, 128)
        run_case("vis_4img_b8", 8, 3136, 16, 16, 72, [784] * 4, False, vp, results)
        run_case("vis_3img_b8", 8, 3456, 16, 16, 72, [1024, 1200, 1100], False,
                 {k: vp[k] for k in ("cudnn_packed_M16", "cudnn_packed_M4", "cudnn_packed_M4_pad128")}, results)
    vis = {
        "cudnn_packed_M8": lambda q, k, v, s, c: cudnn_packed(q, k, v, s, c, 8),
        "cudnn_per_image": lambda q, k, v, s, c: cudnn_per_image(q, k, v, s, c, 4),
        "xla_dense_mask": xla_dense_mask,
    }
    # vision: 4 images of 784 patches per row, 16 heads, hd 72, bidirectional
    if "vis" in cases:
        run_case("vis_4img", 4, 3136, 16, 16, 72, [784] * 4, False, vis, results)
    if "tokamax" in cases:  # recipe h200's shapes at MBS 10: is a Hopper flash kernel faster at head dim 72?
        pk = lambda m: lambda q, k, v, s, c, scale=None: cudnn_packed(q, k, v, s, c, m, scale)
        tk = {"cudnn_packed_M4 (the library's vision bound)": pk(4), "tokamax_mosaic_gpu": tokamax_ranges("mosaic_gpu"),
              "tokamax_triton": tokamax_ranges("triton")}
        run_case("vis_4img_b10", 10, 3136, 16, 16, 72, [784] * 4, False, tk, results)
        run_case("vis_3img_b10", 10, 3456, 16, 16, 72, [1024, 1200, 1100], False, tk, results)
        td = {"cudnn_packed_M2 (the library's decoder bound)": pk(2), "tokamax_mosaic_gpu": tokamax_ranges("mosaic_gpu")}
        run_case("dec_1doc_b10", 10, 4096, 32, 4, 128, [3900], True, td, results)
    with open(args.out, "w") as f:
        json.dump({"env": env, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
