"""Grouped-matmul kernels on the GPU, one matmul at a time (issue 6): this project's Pallas-Triton
kernels (``parallelism.gmm_triton``) over a few tile configs, against tokamax's Mosaic-GPU kernels with
the configs ``parallelism.grouped_matmul`` uses, and the same FLOPs as one balanced batched einsum (the
ceiling), all in one process on the same skewed routing; each result checked against a float32
reference (norm-wise relative error, as bench/scripts/probe_tokamax.py).

  out [M, N] = x @ w[g]  (fwd)    dx [M, K] = dy @ w[g]^T  (dx)    dw [G, K, N] = x_g^T dy_g  (dw)

``--best-out FILE`` writes the fastest accurate Triton config per kernel and shape (the format of
``MOEVLM_GMM_TRITON_CONFIGS``, read by ``parallelism.gmm_triton``; the first shape's are the defaults,
unless ``--keyed-only``: then only the "KIND:KxN" keys, and the other shapes keep ``CONFIGS``' defaults).
The file is rewritten after each shape, so a probe cut short keeps the shapes it finished. After its
configs, each kernel's default config (``gmm_triton.CONFIGS``) and its fastest are timed once more: the
best is chosen by each config's mean over its timings, and the spread of the repeats says what margin
is noise.

  python bench/scripts/probe_gmm.py --out $OUT/gmm_probe.json --best-out $OUT/gmm_triton_configs.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from probe_tokamax import (
    SHAPES,
    accuracy,
    bf16_inputs,
    error_text,
    probe_arguments,
    references,
    timed,
)

from moevlm_jax.parallelism import gmm_triton as gt

# (block_m, block_n, block_k, num_warps, num_stages); for dw block_m is the rows per step and
# block_k x block_n the output tile
FWD = [(128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3),
       (64, 128, 64, 4, 4), (128, 64, 64, 4, 4), (128, 256, 64, 8, 4), (256, 128, 64, 8, 4)]  # the last tried for the 235B shapes: slower there (bench/moe_layer.md run 8)
DW = [(64, 128, 128, 8, 3), (64, 128, 128, 4, 4), (32, 128, 128, 4, 4), (128, 128, 128, 8, 3),
      (64, 256, 128, 8, 3), (64, 128, 256, 8, 3), (64, 64, 128, 4, 4), (128, 128, 64, 8, 3)]
ACCURATE = 5e-3  # bf16 inputs and output vs float32: ~1.7e-3 measured for correct kernels


def _fastest(rows: list[dict], shape: str, kind: str) -> list | None:
    """The accurate Triton config of ``kind`` at ``shape`` with the lowest mean time over its timings."""
    times: dict[tuple, list[float]] = {}
    for r in rows:
        if r["shape"] == shape and r["kernel"] == kind and "config" in r and "ms" in r and r.get("rel_err", 1.0) < ACCURATE:
            times.setdefault(tuple(r["config"]), []).append(r["ms"])
    return list(min(times, key=lambda c: sum(times[c]) / len(times[c]))) if times else None


def main() -> int:
    p = probe_arguments(300.0)
    p.add_argument("--no-tokamax", action="store_true")
    p.add_argument("--best-out")
    p.add_argument("--keyed-only", action="store_true", help="--best-out: only the per-shape keys, no defaults")
    args = p.parse_args()
    t_start = time.perf_counter()
    bf16 = jnp.bfloat16
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": args.rows, "groups": args.groups}
    rows: list[dict] = []

    def record(row: dict, fn, inputs, ref, valid, flops, sizes_np) -> None:
        if time.perf_counter() - t_start > args.budget:
            row["skipped"] = "budget"
            rows.append(row)
            return
        try:
            t0 = time.perf_counter()
            ms, out = timed(jax.jit(fn), inputs, args.iters)
            row.update(ms=ms, tflops=flops / ms / 1e9, first_s=time.perf_counter() - t0)
            if ref is not None:
                row.update(accuracy(row["kernel"], out, ref, valid, sizes_np))
        except Exception as e:  # noqa: BLE001 - an unsupported config is a result
            row["error"] = error_text(e)
            traceback.print_exc(limit=2)
        rows.append(row)
        print(json.dumps(row), flush=True)

    tok = None
    if not args.no_tokamax:
        try:
            from tokamax._src.ops.ragged_dot import base
            from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as pmg

            from moevlm_jax.parallelism.grouped_matmul import TOKAMAX_SM90_CONFIGS
            dims = {"fwd": base.DEFAULT_RAGGED_DOT_DIM_NUMS, "dx": base.TRANS_RHS_RAGGED_DOT_DIM_NUMS,
                    "dw": base.RAGGED_CONTRACTING_DOT_DIM_NUMS}

            def tok(kind):
                op = pmg.PallasMosaicGpuRaggedDot(config=pmg.Config(**TOKAMAX_SM90_CONFIGS["dw" if kind == "dw" else "fwd"]))
                return lambda a, b, gs: op(a, b, group_sizes=gs, ragged_dot_dimension_numbers=dims[kind], precision=None,
                                           preferred_element_type=bf16, activation=None)
        except Exception as e:  # noqa: BLE001
            meta["tokamax_error"] = repr(e)

    best: dict = {}  # per kernel (generic: the first shape's) and per kernel and shape ("KIND:KxN", gt.config_for)
    fields = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        m, g = args.rows, args.groups
        if time.perf_counter() - t_start > args.budget:  # its float32 references alone take tens of seconds
            rows.append(dict(shape=shape, kernel="all", variant="all", skipped="budget"))
            continue
        x, w, dy, sizes_np = bf16_inputs(m, g, k, n)
        gs = jnp.asarray(sizes_np)
        t_ref = time.perf_counter()
        ref = dict(zip(("fwd", "dx", "dw"), jax.block_until_ready(references(x, w, dy, sizes_np)[:3])))
        meta[f"reference_s_{shape}"] = time.perf_counter() - t_ref
        valid = jnp.arange(m) < int(sizes_np.sum())
        fl = 2.0 * int(sizes_np.sum()) * k * n
        inputs = {"fwd": (x, w, gs), "dx": (dy, w, gs), "dw": (x, dy, gs)}
        base_row = dict(shape=shape, load_max_over_mean=float(sizes_np.max() / sizes_np.mean()))
        xb = x.reshape(g, m // g, k)
        record(dict(base_row, kernel="fwd", variant="ceiling: balanced batched einsum"),
               lambda a, b: jnp.einsum("gck,gkn->gcn", a, b), (xb, w), None, None, 2.0 * m * k * n, sizes_np)
        for kind in ("fwd", "dx", "dw"):
            if tok is not None:
                record(dict(base_row, kernel=kind, variant="tokamax (grouped_matmul configs)"), tok(kind), inputs[kind],
                       ref[kind], valid, fl, sizes_np)
            def run(c, again=False, kind=kind, ref=ref):
                cfg = gt.Config(*c)
                if kind == "dw":
                    fn = lambda a, b, s, cfg=cfg: gt.tgmm(a, b, s, config=cfg)  # noqa: E731
                else:
                    fn = lambda a, b, s, cfg=cfg, t=kind == "dx": gt.gmm(a, b, s, trans_w=t, config=cfg)  # noqa: E731
                record(dict(base_row, kernel=kind, variant=f"triton {c}" + " again" * again, config=list(c)), fn,
                       inputs[kind], ref[kind], valid, fl, sizes_np)

            for c in (DW if kind == "dw" else FWD):
                run(c)
            keyed = gt.config_for(kind, *((n, k) if kind == "dx" else (k, n)))
            fastest = _fastest(rows, shape, kind)
            again = [dataclasses.astuple(gt.CONFIGS[kind]), dataclasses.astuple(keyed)] + ([tuple(fastest)] if fastest else [])
            for c in dict.fromkeys(again):  # the kernel's default, this shape's entry in CONFIGS, the fastest
                run(c, again=True)
        del ref
        sizes = {"fwd": (k, n), "dx": (n, k), "dw": (k, n)}
        for kind in ("fwd", "dx", "dw"):
            fastest = _fastest(rows, shape, kind)
            if any(r.get("skipped") for r in rows if r["shape"] == shape and r["kernel"] == kind):
                continue  # cut short by the budget: no choice from a partial list (it would override CONFIGS)
            if fastest:
                cfg = dict(zip(fields, fastest))
                if not args.keyed_only:
                    best.setdefault(kind, cfg)
                best[f"{kind}:{sizes[kind][0]}x{sizes[kind][1]}"] = cfg
        if args.best_out and best:  # after every shape: a probe cut short keeps what it finished
            with open(args.best_out, "w") as f:
                json.dump(best, f, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows, "best": best}, f, indent=1)
    print(f"\n{'shape':<8} {'kernel':<4} {'variant':<40} {'ms':>7} {'TFLOP/s':>8} {'rel err':>9}")
    for r in rows:
        print(f"{r['shape']:<8} {r['kernel']:<4} {r['variant'][:40]:<40} {r.get('ms', float('nan')):>7.3f} "
              f"{r.get('tflops', float('nan')):>8.1f} {r.get('rel_err', float('nan')):>9.2e} "
              f"{r.get('error', r.get('skipped', ''))[:80]}")
    print("best triton configs:", json.dumps(best))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows, "best": best}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
