"""Issue 24: the experts' row movement alone at the MoE layer bench's shapes (16,384 tokens, top-8 of 128 experts,
Zipf-skewed routing): the dispatch into the expert-sorted layout and the combine's backward, as XLA runs them
(``parallelism/permute.py``: ``dispatch_rows``, ``_combine_bwd``) and as the Pallas-Triton kernels at several configs
(``parallelism/permute_triton.py``). Every kernel config is checked against XLA's: the dispatched rows and d(y)
bitwise on the rows assignments map to, d(weights) by its largest difference relative to XLA's largest value.
GB/s counts [A, H] bf16 passes: the dispatch 2 (read, write), the combine backward 3 (y, g's rows, dy).

    python3 bench/scripts/probe_permute.py --out $OUT/permute.json     (--shapes 235b-a22b,30b-a3b --iters 20)
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from moevlm_jax.tools.bench_moe import time_calls
from moevlm_jax.parallelism import permute, permute_triton

HIDDEN = {"235b-a22b": 4096, "30b-a3b": 2048}
CONFIGS = [  # block_a, block_h, num_warps, num_stages
    (32, 256, 4, 2), (32, 512, 4, 2), (16, 512, 4, 2), (64, 256, 8, 2), (32, 512, 8, 3), (64, 128, 4, 3),
    (128, 128, 8, 2), (8, 1024, 4, 2),
]


def inputs(tokens: int, hidden: int, top_k: int, experts: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, experts)) + np.log(1.0 / np.arange(1, experts + 1))[None, :]  # Zipf-ish
    idx = np.argsort(-logits, axis=1)[:, :top_k]
    w = jnp.asarray(rng.random((tokens, top_k)), jnp.bfloat16)
    plan = permute.route_plan(jnp.asarray(idx, jnp.int32), w, experts)
    slot = permute.sorted_slots(plan)
    src = permute.inverse_slots(slot, slot.shape[0])
    y = jnp.asarray(rng.standard_normal((tokens * top_k, hidden)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    return x, y, w, slot, src, g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="235b-a22b,30b-a3b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="combine.json")
    args = ap.parse_args()
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "results": {}}
    for shape in args.shapes.split(","):
        h, k = HIDDEN[shape], args.top_k
        x, y, w, slot, src, g = inputs(args.tokens, h, k, args.experts)
        used = np.asarray(src >= 0)
        rows_gb = args.tokens * k * h * 2 / 1e9  # one [A, H] bf16 pass
        res = out["results"][shape] = {"hidden": h, "rows_gb": rows_gb}

        def timed(name, fn, *xs, moved_passes=None):
            f = jax.jit(fn)
            ms, _, val = time_calls(f, xs, args.iters, 2, synchronised=False)
            r = {"ms": ms}
            if moved_passes:
                r["gb_s"] = moved_passes * rows_gb / ms * 1e3
            res[name] = r
            print(f"{shape} {name:36s} {ms:7.3f} ms" + (f"  {r['gb_s']:6.0f} GB/s" if moved_passes else ""), flush=True)
            return val, r

        def trial(name, fn, *xs, moved_passes):
            try:
                return timed(name, fn, *xs, moved_passes=moved_passes)
            except Exception as e:  # noqa: BLE001 - a config Triton cannot compile is reported, not fatal
                res[name] = {"error": str(e)[:300]}
                print(f"{shape} {name}: {str(e)[:200]}", flush=True)
                return None, None

        rows_ref, _ = timed("dispatch gather (xla)", lambda x, src, slot: permute.dispatch_rows(x, src, slot, k),
                            x, src, slot, moved_passes=2)
        rows_ref = np.asarray(rows_ref)[used]
        for c in CONFIGS:
            name = "dispatch triton a{} h{} w{} s{}".format(*c)
            rows, r = trial(name, lambda x, slot, cfg=permute_triton.Config(*c): permute_triton.dispatch(
                x, slot, k, slot.shape[0], config=cfg), x, slot, moved_passes=2)
            if rows is not None:
                r["equal"] = bool(np.array_equal(np.asarray(rows)[used], rows_ref))
                print(f"    equal {r['equal']}", flush=True)
        (dy_ref, dw_ref), _ = timed("combine bwd (xla)", lambda y, w, slot, src, g: permute._combine_bwd(
            (y, w, slot, src), g)[:2], y, w, slot, src, g, moved_passes=3)
        timed("combine bwd dy only (xla)", lambda y, w, slot, src, g: permute._combine_bwd(
            (y, w, slot, src), g)[0], y, w, slot, src, g, moved_passes=2)
        timed("combine fwd (xla)", lambda y, w, slot, src: permute.combine_rows(y, w, slot, src), y, w, slot, src,
              moved_passes=1)
        dy_ref, dw_ref = np.asarray(dy_ref)[used], np.asarray(dw_ref, np.float32)
        for c in CONFIGS:
            name = "combine bwd triton a{} h{} w{} s{}".format(*c)
            out_c, r = trial(name, lambda y, w, slot, g, cfg=permute_triton.Config(*c): permute_triton.combine_bwd(
                y, w, slot, g, config=cfg), y, w, slot, g, moved_passes=3)
            if out_c is None:
                continue
            dy, dw = out_c
            r["dy_equal"] = bool(np.array_equal(np.asarray(dy)[used], dy_ref))
            r["dw_max_rel"] = float(np.abs(np.asarray(dw, np.float32) - dw_ref).max() / np.abs(dw_ref).max())
            print(f"    dy equal {r['dy_equal']}  dw max rel {r['dw_max_rel']:.2e}", flush=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
