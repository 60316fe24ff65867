"""Probe tokamax's Mosaic-GPU ragged dot on the H200 (issue 6): accuracy of each of the three
matmuls of a grouped-matmul forward + backward against a float32 reference on the same bf16
inputs, and speed under a few kernel configs.

  out  [M, N]    = x [M, K] @ w[g(m)] [K, N]           (forward; DEFAULT dims)
  dx   [M, K]    = dout [M, N] @ w[g(m)]^T             (d lhs; TRANS_RHS dims)
  dw   [G, K, N] = sum over rows of group g: x^T dout  (d rhs; RAGGED_CONTRACTING dims)

bench/moe_layer.md found the MoE layer's expert-weight gradients 3.5e-2 off (norm-wise) under
tokamax while the output and d(x) matched: this isolates which kernel, whether group boundaries
that are not multiples of the kernel's token block matter, and whether the output dtype does.
Each variant is guarded (an unsupported config is recorded, not fatal) and the run stops starting
new variants after ``--budget`` seconds. Prints a table; ``--out`` writes JSON.

  python bench/scripts/probe_tokamax.py --out $OUT/tokamax_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {"gate_up": (2048, 1536), "down": (768, 2048),  # 30B-A3B experts: (K, N) of each matmul
          "gate_up_235b": (4096, 3072), "down_235b": (1536, 4096)}  # 235B-A22B (probe_gmm.py --shapes)


def group_sizes(m: int, g: int, seed: int, align: int = 0) -> np.ndarray:
    """Skewed sizes (log-normal weights, two empty groups) summing to at most ``m``; with ``align``
    each size is rounded down to a multiple of it (the rows left over are padding)."""
    rng = np.random.default_rng(seed)
    w = np.exp(rng.normal(0.0, 0.6, g))
    w[rng.choice(g, 2, replace=False)] = 0.0
    sizes = rng.multinomial(m, w / w.sum())
    if align:
        sizes = sizes // align * align
    return sizes.astype(np.int32)


def bf16_inputs(m: int, g: int, k: int, n: int) -> tuple[jax.Array, jax.Array, jax.Array, np.ndarray]:
    """The grouped-matmul probes' operands (probe_gmm.py, probe_mgpu_gmm.py): x [m, k], w [g, k, n] (scaled by
    1/sqrt(k)), dy [m, n] in bf16, and the skewed group sizes of :func:`group_sizes` (seed 1)."""
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    bf16 = jnp.bfloat16
    x = jax.random.normal(key[0], (m, k), jnp.float32).astype(bf16)
    w = (jax.random.normal(key[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(bf16)
    dy = jax.random.normal(key[2], (m, n), jnp.float32).astype(bf16)
    return x, w, dy, group_sizes(m, g, seed=1)


def padded_index(sizes: np.ndarray, m: int) -> np.ndarray:
    """[G, C] row indices of each group (C = largest group), ``m`` (a zero row) where padded."""
    c = int(sizes.max())
    idx = np.full((len(sizes), c), m, np.int32)
    start = 0
    for gi, s in enumerate(sizes):
        idx[gi, :s] = np.arange(start, start + s)
        start += s
    return idx


def references(x, w, dout, sizes):
    """float32 highest-precision out, dx, dw on the same (bf16-valued) inputs."""
    m = x.shape[0]
    idx = jnp.asarray(padded_index(sizes, m))
    valid = jnp.arange(m) < int(sizes.sum())

    @jax.jit
    def ref(x, w, dout):
        xf, wf, df = (a.astype(jnp.float32) for a in (x, w, dout))
        xp = jnp.concatenate([xf, jnp.zeros((1, xf.shape[1]), jnp.float32)])[idx]  # [G, C, K]
        dp = jnp.concatenate([df, jnp.zeros((1, df.shape[1]), jnp.float32)])[idx]  # [G, C, N]
        hi = jax.lax.Precision.HIGHEST
        outp = jnp.einsum("gck,gkn->gcn", xp, wf, precision=hi)
        dxp = jnp.einsum("gcn,gkn->gck", dp, wf, precision=hi)
        dw = jnp.einsum("gck,gcn->gkn", xp, dp, precision=hi)
        flat = idx.reshape(-1)
        out = jnp.zeros((m + 1, outp.shape[-1]), jnp.float32).at[flat].set(outp.reshape(-1, outp.shape[-1]))[:m]
        dx = jnp.zeros((m + 1, dxp.shape[-1]), jnp.float32).at[flat].set(dxp.reshape(-1, dxp.shape[-1]))[:m]
        return out, dx, dw

    out, dx, dw = ref(x, w, dout)
    return out, dx, dw, valid


def rel(a, b, valid=None) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    if valid is not None:
        a, b = a * valid[:, None], b * valid[:, None]
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def per_group_rel(a, b) -> np.ndarray:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm((a - b).reshape(len(a), -1), axis=1) / np.maximum(np.linalg.norm(b.reshape(len(b), -1), axis=1), 1e-30)


def accuracy(kind: str, out, ref, valid, sizes_np: np.ndarray) -> dict:
    """Norm-wise relative error vs the float32 reference; for d(w) also per group (non-empty ones)."""
    if kind != "dw":
        return {"rel_err": rel(out, ref, valid)}
    pg = per_group_rel(out, ref)[sizes_np > 0]
    return {"rel_err": rel(out, ref), "group_rel_err_max": float(pg.max()),
            "group_rel_err_median": float(np.median(pg))}


def error_text(e: Exception) -> str:
    """One line for an unsupported config's exception (a result, not a failure)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}" if str(e) else type(e).__name__


def timed(fn, args, iters: int) -> tuple[float, object]:
    out = jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, out


def probe_arguments(budget: float) -> argparse.ArgumentParser:
    """The grouped-matmul probes' shared arguments (this probe and probe_gmm.py)."""
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=131072, help="token rows (tokens x top-k)")
    p.add_argument("--groups", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--budget", type=float, default=budget, help="seconds; no new variant starts after this")
    p.add_argument("--shapes", default="gate_up,down")
    p.add_argument("--out")
    return p


def main() -> int:
    p = probe_arguments(240.0)
    args = p.parse_args()

    import tokamax
    from tokamax._src.ops.ragged_dot import base
    from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as pmg

    try:
        from tokamax._src.ops.ragged_dot import triton as ttr
    except Exception as e:  # noqa: BLE001 - recorded, the mosaic variants still run
        ttr, triton_error = None, repr(e)
    else:
        triton_error = None
    t_start = time.perf_counter()
    rows: list[dict] = []
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "tokamax": tokamax.__version__,
            "rows": args.rows, "groups": args.groups, "triton_error": triton_error}
    print(json.dumps(meta), flush=True)
    bf16 = jnp.bfloat16
    dims = {"fwd": base.DEFAULT_RAGGED_DOT_DIM_NUMS, "dx": base.TRANS_RHS_RAGGED_DOT_DIM_NUMS,
            "dw": base.RAGGED_CONTRACTING_DOT_DIM_NUMS}

    def mosaic(cfg=None):
        return pmg.PallasMosaicGpuRaggedDot(config=None if cfg is None else pmg.Config(**cfg))

    def triton(cfg=None):
        return ttr.TritonRaggedDot(config=None if cfg is None else ttr.Config(**cfg))

    def variant(shape, kind, label, op, out_dtype, inputs, ref, sizes_np, valid, flops, **extra):
        row = {"shape": shape, "kernel": kind, "variant": label, "out_dtype": jnp.dtype(out_dtype).name, **extra}
        if time.perf_counter() - t_start > args.budget:
            row["skipped"] = "budget"
            rows.append(row)
            return
        a, b, gs = inputs

        @jax.jit
        def f(a, b, gs):
            return op(a, b, group_sizes=gs, ragged_dot_dimension_numbers=dims[kind], precision=None,
                      preferred_element_type=out_dtype, activation=None)
        try:
            ms, out = timed(f, (a, b, gs), args.iters)
            row.update(ms=ms, tflops=flops / ms / 1e9, **accuracy(kind, out, ref, valid, sizes_np))
        except Exception as e:  # noqa: BLE001 - an unsupported config is a result
            row["error"] = error_text(e)
            traceback.print_exc(limit=2)
        rows.append(row)
        print(json.dumps(row), flush=True)

    fwd_cfgs = [None,
                dict(block_m=128, block_n=64, block_k=64, num_stages=4, split_k=1, persistent=False),
                dict(block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1, persistent=True),
                dict(block_m=128, block_n=128, block_k=64, num_stages=4, split_k=1, persistent=True),
                dict(block_m=64, block_n=128, block_k=64, num_stages=4, split_k=1, persistent=True)]
    dw_cfgs = [None,
               dict(block_m=128, block_n=64, block_k=64, num_stages=4, split_k=1),
               dict(block_m=128, block_n=128, block_k=64, num_stages=4, split_k=1),
               dict(block_m=64, block_n=128, block_k=128, num_stages=3, split_k=1)]
    for shape in args.shapes.split(","):
        k, n = SHAPES[shape]
        m, g = args.rows, args.groups
        key = jax.random.split(jax.random.PRNGKey(0), 3)
        x = jax.random.normal(key[0], (m, k), jnp.float32).astype(bf16)
        w = (jax.random.normal(key[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(bf16)
        dout = jax.random.normal(key[2], (m, n), jnp.float32).astype(bf16)
        flops = 2.0 * m * k * n
        for align in (0, 128):
            sizes_np = group_sizes(m, g, seed=1, align=align)
            gs = jnp.asarray(sizes_np)
            ref_out, ref_dx, ref_dw, valid = references(x, w, dout, sizes_np)
            common = dict(align=align, load_max_over_mean=float(sizes_np.max() / sizes_np.mean()),
                          valid_rows=int(sizes_np.sum()))
            fl = flops * sizes_np.sum() / m
            cfgs = [(c, "fwd") for c in (fwd_cfgs if align == 0 else fwd_cfgs[:1])]
            for cfg in [c for c, _ in cfgs]:
                variant(shape, "fwd", f"mosaic {cfg or 'heuristic'}", mosaic(cfg), bf16, (x, w, gs), ref_out,
                        sizes_np, valid, fl, **common)
            variant(shape, "dx", "mosaic heuristic", mosaic(), bf16, (dout, w, gs), ref_dx, sizes_np, valid, fl, **common)
            for cfg in (dw_cfgs if align == 0 else dw_cfgs[:1]):
                for out_dtype in ((bf16, jnp.float32) if cfg is None else (bf16,)):
                    variant(shape, "dw", f"mosaic {cfg or 'heuristic'}", mosaic(cfg), out_dtype, (x, dout, gs), ref_dw,
                            sizes_np, valid, fl, **common)
            if ttr is not None:
                variant(shape, "fwd", "triton heuristic", triton(), bf16, (x, w, gs), ref_out, sizes_np, valid, fl, **common)
                for out_dtype in (bf16, jnp.float32):
                    variant(shape, "dw", "triton heuristic", triton(), out_dtype, (x, dout, gs), ref_dw, sizes_np, valid,
                            fl, **common)
            # XLA's own batched einsum on the same FLOPs, balanced: the ceiling the kernels chase
            if align == 0:
                xb = x.reshape(g, m // g, k)
                ms, _ = timed(jax.jit(lambda a, b: jnp.einsum("gck,gkn->gcn", a, b)), (xb, w), args.iters)
                rows.append({"shape": shape, "kernel": "fwd", "variant": "ceiling: balanced batched einsum", "ms": ms,
                             "tflops": flops / ms / 1e9})
                print(json.dumps(rows[-1]), flush=True)
            del ref_out, ref_dx, ref_dw
    print(f"\n{'shape':<8} {'kernel':<4} {'align':>5} {'variant':<100} {'out':<8} {'ms':>7} {'TFLOP/s':>8} {'rel err':>9}")
    for r in rows:
        print(f"{r['shape']:<8} {r['kernel']:<4} {r.get('align', ''):>5} {r['variant'][:100]:<100} {r.get('out_dtype', ''):<8} "
              f"{r.get('ms', float('nan')):>7.3f} {r.get('tflops', float('nan')):>8.1f} {r.get('rel_err', float('nan')):>9.2e} "
              f"{r.get('error', r.get('skipped', ''))[:80]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
