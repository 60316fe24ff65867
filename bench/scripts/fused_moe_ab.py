"""Issue 24: the Triton dropless MoE layer (forward + backward, ``moevlm_jax.tools.bench_moe``'s layer: same inputs,
routing and ``experts_forward``) with each set of the kernel fusions of ``parallelism/permute.py`` (``FUSE``:
'gather', 'gather_dw', 'swiglu', 'swiglu_bwd'; ``none`` = no fusion, whatever the library's default) in ONE process: the ceiling (balanced batched einsum), each variant
checked against the float32 reference (output and every gradient) and timed, then timed again in ``--rounds``
alternating orders (the spread), and HF transformers' ``grouped_mm`` block on the same tokens and weights.
Prints a table per shape (median of the rounds' medians); ``--out`` writes every row as JSON.

  python bench/scripts/fused_moe_ab.py --shapes 235b-a22b,30b-a3b --out $OUT/fused_ab.json
  python bench/scripts/fused_moe_ab.py --shapes tiny --tokens 128 --iters 2 --rounds 2 --no-hf   # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for a plain `python3 script`

from moevlm_jax.tools import bench_moe as bm  # noqa: E402
from moevlm_jax.parallelism import permute  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="235b-a22b,30b-a3b")
    p.add_argument("--variants", default="none;gather;swiglu;gather,swiglu", help="';'-separated FUSE sets ('none': {})")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--zipf", type=float, default=0.2)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="timings per variant (the first right after its compile)")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if gpu else jnp.float32
    variants = args.variants.split(";")
    report = bm.Report(path=args.out, meta=dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                                                 fuse_env=sorted(permute.FUSE), variants=variants))
    summary = []
    for name in args.shapes.split(","):
        shape = {**bm.SHAPES, **bm.TINY}[name]
        h, e, k, i, t = shape["hidden"], shape["experts"], shape["top_k"], shape["inter"], args.tokens
        inp = bm.make_inputs(shape, t, args.zipf, dtype)
        xs = (inp["x"], inp["router"], inp["w_gate_up"], inp["w_down"], inp["probe"])
        base = dict(shape=name, tokens=t, hidden=h, experts=e, top_k=k, inter=i)
        flops = bm.expert_flops(t * k, h, i)
        rows = jax.random.normal(jax.random.PRNGKey(2), (e, t * k // e, h), jnp.float32).astype(dtype)
        ceil_ms, _ = bm.time_jax(bm.ceiling_step(), (rows, inp["w_gate_up"], inp["w_down"]), args.iters, args.warmup)
        report.add(dict(base, variant="ceiling (balanced einsum)", ms=ceil_ms, flops=flops))
        del rows
        ref = bm.reference(xs, k, None, dtype)
        steps, times = {}, {}
        for v in variants:
            permute.FUSE = frozenset(f for f in v.split(",") if f and f != "none")  # read when the step is traced
            step = bm.layer_step(k, backend="triton")
            # traces and compiles with this FUSE; a failure (e.g. a kernel that does not compile) is a row
            got = bm.guarded(report, base, f"triton fuse={v}", lambda: bm.time_jax(step, xs, args.iters, args.warmup))
            if got is None:
                continue
            steps[v], times[v] = step, [got[0]]
            report.add(dict(base, variant=f"triton fuse={v} round 1", ms=got[0], flops=flops, fuse=v, round=1))
            bm.check(report, base, f"triton fuse={v}", got[1], ref, dtype)
            del got
        del ref
        for r in range(2, args.rounds + 1):
            for v in (list(steps)[::-1] if r % 2 == 0 else list(steps)):
                ms, _ = bm.time_jax(steps[v], xs, args.iters, 1)
                times[v].append(ms)
                report.add(dict(base, variant=f"triton fuse={v} round {r}", ms=ms, flops=flops, fuse=v, round=r))
        hf_ms = None
        if not args.no_hf:
            idx, w = bm.jit(bm.route, static_argnums=2)(inp["x"], inp["router"], k)
            ns = argparse.Namespace(iters=args.iters, warmup=args.warmup, no_check=True)
            n0 = len(report)
            bm.guarded(report, base, "hf grouped_mm", lambda: bm.bench_hf(base, inp, idx, w, dtype, ns, report))
            hf_ms = next((r["ms"] for r in report[n0:] if r["variant"].startswith("hf") and "ms" in r), None)
        for v in steps:
            med = statistics.median(times[v])
            row = dict(base, variant=f"triton fuse={v} (median of {len(times[v])} rounds)", ms=med, flops=flops, fuse=v,
                       rounds_ms=times[v], spread_ms=max(times[v]) - min(times[v]), ceiling_ms=ceil_ms,
                       vs_hf=(hf_ms / med) if hf_ms else None)
            summary.append(report.add(row))
    print("\nsummary (median of the rounds; x ceiling = ceiling ms / ms)")
    print(f"{'shape':<10} {'fuse':<14} {'ms':>8} {'spread':>7} {'TFLOP/s':>8} {'x ceil':>7} {'x HF':>6}  rounds")
    for r in summary:
        hf = f"{r['vs_hf']:6.3f}" if r["vs_hf"] else "     -"
        print(f"{r['shape']:<10} {r['fuse']:<14} {r['ms']:8.3f} {r['spread_ms']:7.3f} {r['tflops']:8.1f} "
              f"{r['vs_ceiling']:7.3f} {hf}  {', '.join(f'{m:.3f}' for m in r['rounds_ms'])}")
    failed = [r["variant"] for r in report if r.get("ok") is False]
    if failed:
        print("FAILED:", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
