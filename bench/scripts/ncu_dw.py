"""Issue 24: what bounds the experts' d(w) kernels, by Nsight Compute's counters (run under ``ncu``).

Runs, once each after a warm-up call, the 235B-A22B gate_up weight gradient (x [131072, 4096], dy [131072, 3072],
128 groups sized by the layer bench's Zipf routing) three ways: ``gmm_mgpu.tgmm`` per group (``seg_rows=0``),
streamed over 16,384-row segments (the default since bench/moe_layer.md run 18), and the same FLOPs as one balanced
batched einsum on cuBLAS (the ceiling's d(w), ``[E, rows/E, K]^T x [E, rows/E, N]``). Under ``ncu`` each kernel's
duration, SM / tensor-pipe / L2 / DRAM throughput (% of peak) and L2 and DRAM bytes say whether the kernel is
L2-bandwidth, HBM or issue bound. ``--only NAME`` runs one of them (its warm-up call, then the profiled one), so that
``ncu --replay-mode application`` (the script re-run per counter pass: kernel replay saves and restores the GBs of
device memory and did not finish in 170 s, bench/moe_layer.md run 18) can pick the second matching kernel:

    bash bench/scripts/h200_ncu_dw.sh      # the three, each under ncu, in one device call
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from moevlm_jax.tools import bench_moe as bm
from moevlm_jax.parallelism import gmm_mgpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["per_group", "streamed", "einsum"], default=None)
    args = ap.parse_args()
    shape = bm.SHAPES["235b-a22b"]
    tokens, k = 16384, shape["top_k"]
    inp = bm.make_inputs(shape, tokens, 0.2, jnp.bfloat16)
    if args.only == "einsum":  # no routing GEMM before the profiled kernels: the einsum's are the only ones
        sizes = jnp.full((shape["experts"],), tokens * k // shape["experts"], jnp.int32)
    else:
        idx, _ = jax.jit(bm.route, static_argnums=2)(inp["x"], inp["router"], k)
        sizes = jnp.asarray(np.bincount(np.asarray(idx).ravel(), minlength=shape["experts"]), jnp.int32)
    m, h, n = tokens * k, shape["hidden"], 2 * shape["inter"]
    key = jax.random.split(jax.random.PRNGKey(3), 2)
    x = jax.random.normal(key[0], (m, h), jnp.bfloat16)
    dy = jax.random.normal(key[1], (m, n), jnp.bfloat16)
    base = gmm_mgpu.CONFIGS["dw"]
    e = shape["experts"]
    fns = {
        "per_group": jax.jit(lambda a, b, s: gmm_mgpu.tgmm(a, b, s, config=dataclasses.replace(base, seg_rows=0))),
        "streamed": jax.jit(lambda a, b, s: gmm_mgpu.tgmm(a, b, s, config=dataclasses.replace(base, seg_rows=16384))),
        "einsum": jax.jit(lambda a, b, s: jnp.einsum("erk,ern->ekn", a.reshape(e, -1, h), b.reshape(e, -1, n)),
                          compiler_options=bm.CUBLAS),
    }
    if args.only:
        fns = {args.only: fns[args.only]}
    print("group rows: min", int(sizes.min()), "max", int(sizes.max()), "sum", int(sizes.sum()), flush=True)
    for name, fn in fns.items():
        jax.block_until_ready(fn(x, dy, sizes))  # compile + warm-up
    for name, fn in fns.items():
        print("==", name, flush=True)
        jax.block_until_ready(fn(x, dy, sizes))


if __name__ == "__main__":
    main()
