"""JAX's own Mosaic-GPU grouped matmuls against this project's Pallas-Triton kernels, one matmul at a time (issue 24).

JAX ships Hopper (wgmma + TMA, persistent) grouped-matmul kernels as Pallas examples:
``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot`` (forward; d(x) with ``transpose_rhs``) and
``transposed_ragged_dot_mgpu.transposed_ragged_dot`` (d(w): the rows contracted). This probe times them over tile
configs on the layer bench's row count and skewed routing, next to ``parallelism.gmm_triton`` with its tuned
configs and the same FLOPs as one balanced batched einsum per matmul (the ceiling, cuBLAS), all in one process;
each Mosaic result is checked against the Triton kernel's (norm-wise relative error over the kept rows).
This project's ``parallelism.gmm_mgpu`` (forward and d(x) at several configs, the down projection's d(x) with
SwiGLU's backward after it or in its epilogue
(``gmm_dswiglu``) at the down shapes, d(w) ``tgmm`` with NaN rows past the groups as well) runs at several configs;
JAX's ragged kernels with ``--jax`` (d(w): one config without). ``--dense`` also times JAX's warp-specialised dense
Hopper matmul (``hopper_matmul_mgpu``) against ``jnp.dot`` on the forward's [rows, K] x [K, N]: what a
warp-specialised grouped kernel could reach.

Timing: ``--iters`` calls back to back, one synchronisation (the device time of a call in a stream of them),
median of three such rounds.

  python bench/scripts/probe_mgpu_gmm.py --shapes gate_up_235b,down_235b,gate_up,down --out $OUT/mgpu.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from probe_step_parts import timeit
from probe_tokamax import SHAPES, bf16_inputs, error_text, probe_arguments, rel

from moevlm_jax.parallelism import gmm_mgpu as gm
from moevlm_jax.parallelism import gmm_triton as gt

# ragged_dot (fwd, dx): (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
RAGGED = [(128, 192, 64, 4, 4), (128, 128, 64, 5, 8)]  # the fastest two of run 13's first call
# parallelism.gmm_mgpu (fwd, dx): (tile_m, tile_n per compute warpgroup, tile_k, max_concurrent_steps, grid_tile_width,
# epi_tile_m, epi_tile_n, align, epi_buffers, chain, delay_release, wg_m): the defaults first, then the warpgroups on
# row halves (3 and 4 steps in flight) and chained tiles at 4 (moe_layer.md run 19 timed chain at 2 and 4 and one wgmma
# in flight at 3 and 4: no gain)
OURS = [(128, 128, 64, 3, 8, 64, 64, 8, 2, 0, 0, 0), (128, 128, 64, 3, 8, 64, 64, 8, 2, 0, 0, 1),
        (128, 128, 64, 4, 8, 64, 64, 8, 2, 0, 0, 1), (128, 128, 64, 4, 8, 64, 64, 8, 2, 1, 0, 0)]
# transposed_ragged_dot (dw): block_m x block_n = the output tile, block_k = rows per step (run 13's best first;
# all four with --jax)
TRANSPOSED = [(128, 128, 64, 4, 4), (128, 192, 64, 4, 4), (128, 128, 64, 5, 8), (128, 128, 64, 3, 8)]
# parallelism.gmm_mgpu.tgmm (dw): (tile_m, tile_n per compute warpgroup, tile_k, max_concurrent_steps, grid_tile_width,
# epi_tile_m, epi_tile_n, epi_buffers, epi_swizzle, cluster_m, seg_rows): the default (streamed, 16,384-row segments, one
# 128 x 128 epilogue slab per warpgroup, 3 steps in flight: moe_layer.md run 19) first, then run 18's default (64 x 64
# slabs, 2 buffers, 4 in flight), its epilogue swizzled, and the per-group kernel (runs 14-16 timed its swizzled
# epilogue and CTA pairs: -5%..+1%)
OURS_DW = [(128, 128, 64, 3, 4, 128, 128, 1, False, 1, 16384), (128, 128, 64, 4, 4, 64, 64, 2, False, 1, 16384),
           (128, 128, 64, 4, 4, 64, 64, 2, True, 1, 16384), (128, 128, 64, 4, 4, 64, 64, 2, False, 1, 0)]

def name(kind: str, cfg: tuple) -> str:
    """A short label of one of :data:`OURS` / :data:`OURS_DW` (the fields they vary)."""
    if kind == "dw":
        return f"tgmm mcs{cfg[3]} epi{cfg[5]}x{cfg[6]}/{cfg[7]} swz{int(cfg[8])} cl{cfg[9]} seg{cfg[10]}"
    return f"mcs{cfg[3]} align{cfg[7]} epi/{cfg[8]} chain{cfg[9]} delay{cfg[10]} wg_m{cfg[11]}"


def main() -> int:
    p = probe_arguments(420.0)
    p.add_argument("--dense", action="store_true")
    p.add_argument("--kinds", default="fwd,dx,dw")
    p.add_argument("--first", type=int, default=0, help="only the first N configs of ours per kind (0: all)")
    p.add_argument("--jax", action="store_true", help="JAX's ragged_dot_mgpu (fwd, dx) and all four d(w) configs")
    args = p.parse_args()
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    t_start = time.perf_counter()
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": args.rows, "groups": args.groups,
            "iters": args.iters}
    rows: list[dict] = []

    def record(row: dict, fn, inputs, flops, ref=None, valid=None):
        if time.perf_counter() - t_start > args.budget:
            row["skipped"] = "budget"
            rows.append(row)
            return None
        out = None
        try:
            t0 = time.perf_counter()
            fn = jax.jit(fn)
            ms = statistics.median(timeit(fn, inputs, 3, args.iters))
            out = fn(*inputs)
            row.update(ms=ms, tflops=flops / ms / 1e9, first_s=time.perf_counter() - t0)
            if ref is not None:
                row["rel_err_vs_triton"] = rel(out, ref, valid)
        except Exception as e:  # noqa: BLE001 - an unsupported config is a result
            row["error"] = error_text(e)
            traceback.print_exc(limit=1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        return out

    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        m, g = args.rows, args.groups
        x, w, dy, sizes_np = bf16_inputs(m, g, k, n)
        gs = jnp.asarray(sizes_np)
        valid = jnp.arange(m) < int(sizes_np.sum())
        fl = 2.0 * int(sizes_np.sum()) * k * n
        base = dict(shape=shape, k=k, n=n, load_max_over_mean=float(sizes_np.max() / sizes_np.mean()))
        c = m // g
        xb, dyb = x.reshape(g, c, k), dy.reshape(g, c, n)
        ceilings = {"fwd": (lambda a, b: jnp.einsum("gck,gkn->gcn", a, b), (xb, w)),
                    "dx": (lambda a, b: jnp.einsum("gcn,gkn->gck", a, b), (dyb, w)),
                    "dw": (lambda a, b: jnp.einsum("gck,gcn->gkn", a, b), (xb, dyb))}
        triton = {"fwd": (lambda a, b, s: gt.gmm(a, b, s), (x, w, gs)),
                  "dx": (lambda a, b, s: gt.gmm(a, b, s, trans_w=True), (dy, w, gs)),
                  "dw": (lambda a, b, s: gt.tgmm(a, b, s), (x, dy, gs))}
        for kind in args.kinds.split(","):
            record(dict(base, kernel=kind, variant="ceiling: balanced batched einsum"), *ceilings[kind], 2.0 * m * k * n)
            ref = record(dict(base, kernel=kind, variant="triton (gmm_triton.CONFIGS)"), *triton[kind], fl)
            for cfg in ((TRANSPOSED if args.jax else TRANSPOSED[:1]) if kind == "dw" else RAGGED if args.jax else ()):
                kw = dict(zip(("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n"), cfg))
                if kind == "dw":
                    fn = lambda a, b, s, kw=kw: transposed_ragged_dot_mgpu.transposed_ragged_dot(a, b, group_sizes=s, **kw)  # noqa: E731
                    inputs = (x, dy, gs)
                else:
                    fn = lambda a, b, s, kw=kw, t=kind == "dx": ragged_dot_mgpu.ragged_dot(  # noqa: E731
                        a, b, group_sizes=s, transpose_rhs=t, **kw)
                    inputs = (x, w, gs) if kind == "fwd" else (dy, w, gs)
                record(dict(base, kernel=kind, variant=f"mgpu {cfg}", config=list(cfg)), fn, inputs, fl,
                       ref, None if kind == "dw" else valid)
            for cfg in (OURS_DW if kind == "dw" else OURS)[:args.first or None]:
                c = gm.TConfig(*cfg) if kind == "dw" else gm.Config(*cfg)
                ok = gm.tsupported(m, k, n, c) if kind == "dw" else gm.supported(m, *((n, k) if kind == "dx" else (k, n)), c)
                if not ok:
                    continue
                if kind == "dw":
                    fn, inputs = (lambda a, b, s, c=c: gm.tgmm(a, b, s, config=c)), (x, dy, gs)  # noqa: E731
                else:
                    fn = lambda a, b, s, c=c, t=kind == "dx": gm.gmm(a, b, s, trans_w=t, config=c)  # noqa: E731
                    inputs = (x, w, gs) if kind == "fwd" else (dy, w, gs)
                record(dict(base, kernel=kind, variant=f"gmm_mgpu {name(kind, cfg)}", config=list(cfg)), fn, inputs, fl, ref,
                       None if kind == "dw" else valid)
            if kind == "dx" and shape.startswith("down") and gm.supported(m, n, k, gm.CONFIGS["dx"]):
                # the down projection's d(x) [m, I], then SwiGLU's backward at h [m, 2I]; or that in its epilogue
                from moevlm_jax.parallelism.permute import swiglu
                hh = jax.random.normal(jax.random.key(9), (m, 2 * k), jnp.float32).astype(jnp.bfloat16)
                unfused = record(dict(base, kernel=kind, variant="gmm_mgpu d(x), then XLA's SwiGLU backward"),
                                 lambda a, b, s, h: jax.vjp(swiglu, h)[1](gm.gmm(a, b, s, trans_w=True))[0],
                                 (dy, w, gs, hh), fl, None, None)
                fused = record(dict(base, kernel=kind, variant="gmm_mgpu.gmm_dswiglu (SwiGLU's backward in the epilogue)"),
                               lambda a, b, s, h: gm.gmm_dswiglu(a, b, s, h), (dy, w, gs, hh), fl, None, None)
                rw = jax.random.uniform(jax.random.key(10), (m,), jnp.float32, 0.05, 1.0)
                weighted = record(dict(base, kernel=kind, variant="gmm_mgpu.gmm_dswiglu with row weights (+ their grad)"),
                                  lambda a, b, s, h, r: gm.gmm_dswiglu(a, b, s, h, r), (dy, w, gs, hh, rw), fl, None,
                                  None)
                if fused is not None and unfused is not None:
                    row = dict(base, kernel=kind, variant="gmm_dswiglu vs gmm + SwiGLU's backward",
                               dh_rel_err=rel(fused, unfused, valid))
                    if weighted is not None:  # d(h), d(row_w) of act_w = silu(gate) * up * row_w, JAX's gradient
                        def act_w(h, r):
                            gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
                            return (jax.nn.silu(gate) * up * r[:, None]).astype(h.dtype)
                        dh_w, drw = jax.vjp(act_w, hh, rw)[1](jax.jit(gm.gmm, static_argnames="trans_w")(
                            dy, w, gs, trans_w=True))
                        row.update(weighted_dh_rel_err=rel(weighted[0], dh_w, valid),
                                   d_row_w_rel_err=rel(weighted[1][:, None], drw[:, None], valid))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            if kind == "dw":  # rows past sum(group_sizes) hold NaN (the experts may leave them unwritten): no NaN out
                cut = sizes_np.copy()
                last = int(np.nonzero(cut)[0][-1])
                cut[last] -= min(1000, int(cut[last]))
                cut[[3, 7]] = 0  # and two empty groups: zero gradients
                tail = (jnp.arange(m) >= int(cut.sum()))[:, None]
                xn, dyn = jnp.where(tail, jnp.nan, x).astype(x.dtype), jnp.where(tail, jnp.nan, dy).astype(dy.dtype)
                want = gt.tgmm(x, dy, jnp.asarray(cut))
                for cfg in OURS_DW[:args.first or None]:
                    c = gm.TConfig(*cfg)
                    if not gm.tsupported(m, k, n, c):
                        continue
                    row = dict(base, kernel=kind, variant=f"{name(kind, cfg)} NaN rows past the groups")
                    try:
                        got = jax.jit(lambda a, b, s, c=c: gm.tgmm(a, b, s, config=c))(xn, dyn, jnp.asarray(cut))
                        row.update(finite=bool(jnp.isfinite(got.astype(jnp.float32)).all()),
                                   empty_zero=bool((got[jnp.asarray([3, 7])] == 0).all()),
                                   rel_err_vs_triton=rel(got, want))
                    except Exception as e:  # noqa: BLE001
                        row["error"] = error_text(e)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del ref
        if args.dense:
            from jax.experimental.pallas.ops.gpu import hopper_matmul_mgpu as hm
            w0 = w[0]
            record(dict(base, kernel="dense", variant="jnp.dot [rows, K] x [K, N]"), jnp.dot, (x, w0), 2.0 * m * k * n)
            for tm, tn, tk, steps, width in ((128, 128, 64, 4, 1), (128, 128, 64, 4, 8), (128, 256, 64, 3, 4)):
                cfg = hm.TuningConfig(tile_m=tm, tile_n=tn, tile_k=tk, max_concurrent_steps=steps, grid_tile_width=width)
                record(dict(base, kernel="dense", variant=f"hopper_matmul_mgpu {(tm, tn, tk, steps, width)} (2 wg on N)"),
                       lambda a, b, cfg=cfg: hm.matmul(a, b, None, cfg), (x, w0), 2.0 * m * k * n)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"\n{'shape':<13} {'kernel':<5} {'variant':<44} {'ms':>7} {'TFLOP/s':>8} {'rel err':>9}")
    for r in rows:
        print(f"{r['shape']:<13} {r['kernel']:<5} {r['variant'][:44]:<44} {r.get('ms', float('nan')):>7.3f} "
              f"{r.get('tflops', float('nan')):>8.1f} {r.get('rel_err_vs_triton', float('nan')):>9.2e} "
              f"{r.get('error', r.get('skipped', ''))[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
