"""Issue 24: why the MoE layer bench's pipelined time sits above its synchronised one (bench/moe_layer.md run 17: at
235B-A22B 30.355 vs 28.895 ms, and above profile_moe_layer.py's pipelined 28.958 ms on the same machine, while the
einsum ceiling's pipelined time is below its synchronised one). Times the bench's layer step
(``moevlm_jax.tools.bench_moe.layer_step``, same inputs) in one process, in this order, each the median of
``--rounds`` rounds:

- ``jit``: the bench's way (``time_calls``: ``--iters`` calls issued back to back, then one wait; and each call waited
  for, "synchronised");
- ``jit, N in flight``: the same with ``--short`` calls a round (fewer outputs alive at once);
- ``executable``: the compiled executable called directly, as profile_moe_layer.py times it;
- the einsum ceiling (as the bench runs it before the layer), then ``jit`` again (does the ceiling's run change it?);
- ``--long`` calls a round, the same calls while ``jax.profiler`` traces them (run 19: profile_moe_layer.py's traced
  30B-A3B steps took 7.46 ms against 8.06 timed untraced in the same process), and when each of ``--long`` calls
  issued back to back returns to the host.

Each line also gives the device's peak bytes in use so far and the allocator's allocation count (``memory_stats``,
where the backend has them), and ``host`` how long issuing a call takes and what the compiled program holds. Run 18
(bench/moe_layer.md): no systematic gap between the ways; the same call moved +-1.7% between blocks of calls.

    python3 bench/scripts/probe_layer_timing.py --shapes 235b-a22b --out $OUT/timing.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import jax
import jax.numpy as jnp

from moevlm_jax.tools import bench_moe as bm


def memory() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats[k] for k in ("peak_bytes_in_use", "num_allocs", "bytes_in_use") if k in stats}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="235b-a22b")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--short", type=int, default=3)
    ap.add_argument("--long", type=int, default=30, help="calls a round in the long rounds and the return-time probe")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--zipf", type=float, default=0.2)
    ap.add_argument("--out", default="timing.json")
    args = ap.parse_args()
    shapes = {**bm.SHAPES, **bm.TINY}
    out = {"device": str(jax.devices()[0]), "jax": jax.__version__, "args": vars(args), "results": {}}
    for name in args.shapes.split(","):
        shape = shapes[name]
        inp = bm.make_inputs(shape, args.tokens, args.zipf, jnp.bfloat16)
        xs = (inp["x"], inp["router"], inp["w_gate_up"], inp["w_down"], inp["probe"])
        step = bm.layer_step(shape["top_k"], backend=args.backend)
        res = out["results"][name] = {}

        def row(label, fn, inputs, iters, rounds=args.rounds):
            piped, synced, _ = bm.time_calls(fn, inputs, iters, 2, rounds=rounds)
            res[label] = dict(pipelined_ms=piped, synchronised_ms=synced, **memory())
            print(f"{name} {label:34s} pipelined {piped:8.3f} ms  synchronised {synced:8.3f} ms  {memory()}", flush=True)

        row("jit", step, xs, args.iters)
        row(f"jit, {args.long} a round", step, xs, args.long)
        with tempfile.TemporaryDirectory() as trace:  # the same calls while jax.profiler traces them
            jax.profiler.start_trace(trace)
            row("jit, traced by jax.profiler", step, xs, args.iters)
            jax.profiler.stop_trace()
        # when each of --long calls issued back to back returns to the host (ms after the first was issued): a
        # host that waits for the device inside calls shows returns spaced by the device's time per call
        t0 = time.perf_counter()
        returns, last = [], None
        for _ in range(args.long):
            last = step(*xs)  # the previous call's outputs dropped, as the bench's rounds do
            returns.append((time.perf_counter() - t0) * 1e3)
        jax.block_until_ready(last)
        done = (time.perf_counter() - t0) * 1e3
        del last
        res["returns_ms"] = dict(returns=[round(r, 3) for r in returns], all_done=round(done, 3))
        print(f"{name} call returns (ms): {[round(r, 2) for r in returns]}; all done at {done:.2f}", flush=True)
        # the host's side: how long issuing --iters calls takes before the wait (near the pipelined time: the host
        # waits inside a call, e.g. on a loop's trip count), and what the compiled program holds
        issue = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            outs = [step(*xs) for _ in range(args.iters)]
            issue.append((time.perf_counter() - t0) * 1e3 / args.iters)
            jax.block_until_ready(outs[-1])
            del outs
        text = step.lower(*xs).compile().as_text()
        res["host"] = dict(issue_ms=sorted(issue)[len(issue) // 2], whiles=text.count(" while("),
                           custom_calls=text.count("custom-call("), conditionals=text.count(" conditional("))
        print(f"{name} host {res['host']}", flush=True)
        row(f"jit, {args.short} in flight", step, xs, args.short, rounds=max(1, args.rounds * args.iters // args.short))
        row("executable", step.lower(*xs).compile(), xs, args.iters)
        e, k, h = shape["experts"], shape["top_k"], shape["hidden"]
        rows = jax.random.normal(jax.random.PRNGKey(2), (e, args.tokens * k // e, h), jnp.float32).astype(jnp.bfloat16)
        row("ceiling (balanced einsum)", bm.ceiling_step(), (rows, inp["w_gate_up"], inp["w_down"]), args.iters)
        del rows
        row("jit, after the ceiling", step, xs, args.iters)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
