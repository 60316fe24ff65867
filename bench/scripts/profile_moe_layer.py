"""Per-pass time of one MoE layer, forward + backward: the layer of
``bench.moe_layer`` (same inputs, routing and ``experts_forward``), with the router in a
``router`` scope and the experts in ``experts`` (the model's scopes, ``moevlm_jax.model.moe``), timed,
then traced with ``jax.profiler`` with command buffers off (every kernel keeps its HLO instruction,
``moevlm_jax.training.capture`` 'none'). Each device kernel is put in one pass by its HLO instruction:
the six grouped matmuls by kernel name and output shape; the rest by its name stack and opcode
(routing, sort, the slot / inverse-slot scatters, dispatch and combine gathers, SwiGLU and the row
masks inside ``expert_ffn``, the loss outside). Prints ms per layer step per pass; ``--out`` writes the
table and the largest kernels as JSON, ``--tar`` the traces and HLO texts (re-read with
``--from-tar``, no GPU: ``python bench/scripts/profile_moe_layer.py --from-tar moe_profile.tgz``).

  python bench/scripts/profile_moe_layer.py --shapes 235b-a22b --out runs/bench/moe_profile.json --tar runs/bench/moe_profile.tgz
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `bench` is not installed
if "--from-tar" not in sys.argv:  # before jax is imported
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\([^)]*\)|\S+)\s+([\w\-]+)\((.*)$", re.MULTILINE)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SHAPE = re.compile(r"\[([\d,]*)\]")


def instructions(hlo_text: str) -> dict[str, dict]:
    """HLO instruction name -> its opcode, result dims and ``op_name`` (the JAX name stack)."""
    out = {}
    for m in _INSTR.finditer(hlo_text):
        _name, shape, opcode, rest = m.groups()
        op = _OP_NAME.search(rest)
        first = _SHAPE.search(shape)  # a tuple's (a multi-output fusion's) first element
        dims = [int(d) for d in first.group(1).split(",") if d] if first else []
        out[m.group(1)] = {"opcode": opcode, "dims": dims, "op_name": op.group(1) if op else "", "line": m.group(0)[:300]}
    return out


def classify(kernel: str, info: dict | None, shape: dict) -> str:
    """The pass of one device kernel (``shape``: hidden, inter of the layer)."""
    h, i2 = shape["hidden"], 2 * shape["inter"]
    low = kernel.lower()
    info = info or {}
    dims, stack, line = info.get("dims", []), info.get("op_name", ""), info.get("line", "")
    parts = set(re.split(r"[/()\[\]]", stack))
    if "gmm" in low or (info.get("opcode") == "custom-call" and ("gmm" in stack or "gmm" in line)):
        if len(dims) == 3:
            return "GEMM gate_up d(w) (tgmm)" if dims[1:] == [h, i2] else "GEMM down d(w) (tgmm)"
        if "gmm_trans" in low or "gmm_trans" in stack or "gmm_trans" in line:
            return "GEMM gate_up d(x)" if dims[-1:] == [h] else "GEMM down d(x)"
        return "GEMM gate_up fwd" if dims[-1:] == [i2] else "GEMM down fwd"
    if "mosaic_gpu" in low and "expert_ffn" in parts:  # parallelism.gmm_mgpu's kernels (named "kernel")
        if len(dims) == 3:
            return "GEMM gate_up d(w) (tgmm)" if dims[1:] == [h, i2] else "GEMM down d(w) (tgmm)"
        if "transpose" in stack:  # the backward: d(x) of gate_up [M, H], of down [M, I]
            return "GEMM gate_up d(x)" if dims[-1:] == [h] else "GEMM down d(x)"
        return "GEMM gate_up fwd" if dims[-1:] == [i2] else "GEMM down fwd"
    if re.match(r"(dispatch|combine_bwd)", low):  # parallelism.permute_triton's kernels
        return "row kernels: dispatch / combine bwd (Triton)"
    if not info:
        return "unmatched"
    if "router" in parts:
        return "routing (logits, softmax, top-k; fwd + bwd)"
    if "expert_ffn" in parts:
        if "searchsorted" in stack or "cumsum" in stack:
            return "tile tables (expert_ffn, searchsorted)"
        return "SwiGLU + row masks (expert_ffn, non-GEMM)"
    if "experts" in parts:
        if "sort" in parts:
            return "sort (route_plan)"
        if "scatter" in stack or info.get("opcode") == "scatter":
            return "scatters (rank, inverse slots, d(x) sum)"
        if "cumsum" in stack or "searchsorted" in stack or "reduce_window" in stack:
            return "counts / offsets (searchsorted, cumsum)"
        if "gather" in stack or "_take" in stack or info.get("opcode") == "gather" or "dynamic_slice" in stack:
            return "gathers: dispatch / combine rows (fwd + bwd)"
        if "dot_general" in stack or "reduce_sum" in stack:
            return "combine weighted sums (fwd + bwd)"
        return "experts: other (slots, converts, copies)"
    return "outside the layer (loss, probe, casts)"


def passes(trace_dir: Path, hlo_text: str, steps: int, shape: dict) -> dict:
    """Per pass: ms per step, kernel count per step, and the largest kernels."""
    from bench.breakdown import device_events, idle_gaps, load_trace

    table = instructions(hlo_text)
    by_kernel = {k.replace(".", "_"): v for k, v in table.items()}
    ms: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    kernels: dict[tuple, float] = collections.defaultdict(float)
    span = [float("inf"), 0.0]
    events = device_events(load_trace(trace_dir))
    for e in events:
        args = e.get("args", {})
        op = args.get("hlo_op")
        info = table.get(op) if op else by_kernel.get(str(e.get("name", "")))
        p = classify(str(e.get("name", "")), info, shape)
        dur = float(e.get("dur", 0.0)) * 1e-3
        ms[p] += dur
        count[p] += 1
        kernels[(p, str(e.get("name", ""))[:80], str(op), (info or {}).get("op_name", "")[-140:],
                 str((info or {}).get("dims")))] += dur
        span = [min(span[0], float(e["ts"])), max(span[1], float(e["ts"]) + float(e.get("dur", 0.0)))]
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:60]
    return {"per_step_ms": {k: v / steps for k, v in sorted(ms.items(), key=lambda kv: -kv[1])},
            "kernels_per_step": {k: count[k] / steps for k in ms},
            "kernel_ms": sum(ms.values()) / steps, "span_ms": (span[1] - span[0]) * 1e-3 / steps,
            "top_kernels": [dict(zip(("pass", "kernel", "hlo_op", "op_name", "dims"), k), ms_per_step=v / steps)
                            for k, v in top],
            "idle_gaps": idle_gaps(events, steps)}


def table_text(name: str, res: dict) -> str:
    lines = [(f"{name}: timed {res.get('ms', float('nan')):.3f} ms/step (median), kernels {res['kernel_ms']:.3f} ms/step, "
              f"traced span {res['span_ms']:.3f} ms/step"),
             f"  {'pass':<48} {'ms/step':>9} {'share':>7} {'kernels':>8}"]
    total = res["kernel_ms"]
    for k, v in res["per_step_ms"].items():
        lines.append(f"  {k:<48} {v:>9.3f} {v / total:>7.1%} {res['kernels_per_step'][k]:>8.1f}")
    gaps = res.get("idle_gaps")
    if gaps:  # the largest gap of each step is the step boundary (host dispatch between timed steps)
        lines.append(f"  device idle: {gaps['gap_ms']:.3f} ms/step in {gaps['count']:.0f} gaps (largest, ~one a step: "
                     + ", ".join(f"{g:.3f}" for g in gaps["largest_ms"]) + " ms); by the kernels around them:")
        lines += [f"    {g['ms_per_step']:7.3f} ms/step {g['count_per_step']:5.1f}x  {g['before'][:50]} -> {g['after'][:50]}"
                  for g in gaps["sites"][:8]]
    lines.append("  largest kernels (ms/step, pass, kernel, hlo_op, dims, op_name tail):")
    lines += [f"    {t['ms_per_step']:7.3f}  {t['pass'][:26]:<26} {t['kernel'][:34]:<34} {t['hlo_op'][:24]:<24} "
              f"{t['dims']:<18} {t['op_name'][-70:]}" for t in res["top_kernels"][:25]]
    return "\n".join(lines)


def profile_shape(name: str, args: argparse.Namespace, workdir: Path) -> dict:
    import jax
    import jax.numpy as jnp
    from bench import moe_layer as bm
    from moevlm_jax.parallelism.experts import experts_forward

    shape = {**bm.SHAPES, **bm.TINY}[name]
    k = shape["top_k"]
    inp = bm.make_inputs(shape, args.tokens, args.zipf, jnp.bfloat16)
    xs = (inp["x"], inp["router"], inp["w_gate_up"], inp["w_down"], inp["probe"])

    def loss(x, router, w_gate_up, w_down, probe):
        with jax.named_scope("router"):
            idx, w = bm.route(x, router, k)
        with jax.named_scope("experts"):
            out = experts_forward(x, idx, w, w_gate_up, w_down, backend=args.backend)
        return jnp.sum(out.astype(jnp.float32) * probe.astype(jnp.float32)), out

    def build():
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)).lower(*xs).compile()

    t0 = time.perf_counter()
    step = build()
    compile_s = time.perf_counter() - t0
    hlo = step.as_text()
    ms, _ = bm.time_jax(step, xs, args.iters, 2)
    trace = workdir / f"trace_{name}"
    jax.profiler.start_trace(str(trace), create_perfetto_trace=True)
    out = None
    for _ in range(args.steps):  # --pipelined: issued back to back, as the bench times them, one wait at the end
        out = step(*xs) if args.pipelined else jax.block_until_ready(step(*xs))
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    (workdir / f"layer_{name}.hlo.txt").write_text(hlo)
    res = passes(trace, hlo, args.steps, shape)
    flops = bm.expert_flops(args.tokens * k, shape["hidden"], shape["inter"])
    res.update(shape=name, ms=ms, tflops=flops / ms / 1e9, compile_s=compile_s, steps=args.steps, tokens=args.tokens,
               backend=args.backend, device=jax.devices()[0].device_kind, jax=jax.__version__,
               pipelined=args.pipelined)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="235b-a22b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--zipf", type=float, default=0.2)
    p.add_argument("--backend", default="triton")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--steps", type=int, default=5, help="traced layer steps")
    p.add_argument("--pipelined", action="store_true",
                   help="trace the steps issued back to back (one wait at the end) instead of each waited for")
    p.add_argument("--out")
    p.add_argument("--tar", help="write the traces and HLO texts here (.tgz)")
    p.add_argument("--from-tar", help="re-classify a --tar file's traces (no GPU)")
    args = p.parse_args()
    results = {}
    if args.from_tar:
        from bench import moe_layer as bm

        with tempfile.TemporaryDirectory() as d:
            with tarfile.open(args.from_tar) as t:
                t.extractall(d, filter="data")
            old = json.loads((Path(d) / "moe_profile.json").read_text()) if (Path(d) / "moe_profile.json").exists() else {}
            for hlo in sorted(Path(d).glob("layer_*.hlo.txt")):
                name = hlo.name[len("layer_"):-len(".hlo.txt")]
                prev = old.get(name, {})
                res = passes(Path(d) / f"trace_{name}", hlo.read_text(), prev.get("steps", args.steps),
                                 {**bm.SHAPES, **bm.TINY}[name])
                results[name] = {**{k: v for k, v in prev.items() if k not in res}, **res}
                print(table_text(name, results[name]), flush=True)
    else:
        workdir = Path(tempfile.mkdtemp(prefix="moe_profile_"))
        for name in args.shapes.split(","):
            results[name] = profile_shape(name, args, workdir)
            print(table_text(name, results[name]), flush=True)
            if args.out:  # after every shape: a run cut short keeps what it finished
                Path(args.out).write_text(json.dumps(results, indent=1))
            if args.tar:
                (workdir / "moe_profile.json").write_text(json.dumps(results, indent=1))
                with tarfile.open(args.tar, "w:gz") as t:
                    for f in sorted(workdir.iterdir()):
                        t.add(f, arcname=f.name)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
