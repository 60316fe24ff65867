"""Qwen3.5's Gated DeltaNet core on a GPU: the Pallas-Triton kernel path (``parallelism/gdn_triton.py``) against
the einsum path (``model.gated_deltanet.chunk_gated_delta_rule``, ``lax.scan`` over chunks) and
flash-linear-attention's Triton kernels (fla-core's ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, torch),
in one process.

Shapes (bf16 q / k / v / beta, float32 g, chunks of 64, q/k L2 norm in the rule as the model runs it):
``proxy35`` B 4, S 4096, Hk 16, Hv 32, Dk = Dv 128 and ``row32k`` B 1, S 32768 (same heads). Rows are packed
(``--packing packed``: each row 3 samples of uneven lengths, all rows but the last with a 64-token padding
tail, as the trainer's packed batches; ``none``: no segment ids), g = log_sigmoid(N(0, 1)), beta = sigmoid(N(0, 1)) (fla's
benchmark convention).

Per shape:

- ``check``: output, final state and the gradients of q, k, v, g, beta and an initial state of
  ``sum(out * P) + sum(state * Q)`` (random P, Q) for the einsum path and the kernel path, each as max abs
  error against a float32 reference (the einsum path on the same bf16-rounded inputs upcast to float32,
  precision HIGHEST), with the reference's max abs value for scale;
- ``time_ms``: forward and forward + backward (``jax.value_and_grad`` of the same loss, no initial state, as
  the model calls it) of ``einsum`` and ``triton`` (median of ``--reps`` after warm-up, each call synchronised;
  ``compile_s``: the first call); ``fla``: fla's forward (``torch.no_grad``) and forward + backward (its
  backward may refuse the machine's Triton: the error is recorded), CUDA events, unpacked rows (fla packs
  through ``cu_seqlens``; the masks cost our kernels the same either way), and its output's max abs
  difference from the kernel path's on those unpacked rows (grouped value heads if fla takes them, else q / k
  repeated: ``fla.gva``);
- ``breakdown_ms``: the kernel path's pieces alone (:func:`breakdown`: the forward's preparation kernel, also
  at other warps, and forward kernel; the backward's XLA preparation, chunk states, reverse kernel, chunk
  gradients and the preparation's pullback);
- ``sweep`` (``--sweep``): forward and forward + backward of the kernel path per tile config (block_v,
  num_warps, num_stages, fused_output).

Every step runs in its own try/except: an error is recorded (``errors``) and the rest goes on. Writes
``gdn_kernel.json`` and ``gdn_kernel.txt`` (the table) to ``--out``. ``--smoke``: a tiny shape, 3 reps
(also on CPU, where the kernels run in Pallas' interpret mode).

Usage (repository root): ``python bench/scripts/gdn_kernel.py --out DIR [--shapes proxy35,row32k] [--sweep]
[--reps 20] [--smoke]``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch (fla) shares the GPU in this process

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

try:
    from moevlm_jax.model import gated_deltanet
except ImportError:  # run from a source tree without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from moevlm_jax.model import gated_deltanet
from moevlm_jax.parallelism import gdn_triton  # noqa: E402

SHAPES = {"proxy35": (4, 4096, 16, 32, 128, 128), "row32k": (1, 32768, 16, 32, 128, 128)}  # B, S, Hk, Hv, Dk, Dv
SMOKE = {"smoke": (2, 256, 2, 4, 64, 64)}
CHUNK = 64
GRADS = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
PREP_WARPS = (4, 8)  # the preparation kernel's warps timed in the breakdown
SWEEP = [gdn_triton.Config(block_v=bv, num_warps=w, num_stages=2, fused_output=fused)
         for fused in (True, False) for bv in (16, 32, 64) for w in (4, 8)]


def log(*a) -> None:
    print(*a, flush=True)


def _error(where: str, errors: list) -> dict:
    text = traceback.format_exc()
    log(f"  ERROR in {where}: {text.strip().splitlines()[-1][:300]}")
    errors.append({"where": where, "error": text[-4000:]})
    return {"error": text.strip().splitlines()[-1][:1000]}


def _segments(b: int, s: int, rng: np.random.Generator) -> np.ndarray:
    """Each row: 3 samples of uneven lengths (ids 1..3); every row but the last then a 64-token padding tail
    (id 0), the last ends with its third sample (so its final state is not zero)."""
    out = np.zeros((b, s), np.int32)
    for r in range(b):
        body = s - min(64, s // 4) if r < b - 1 else s
        cuts = np.sort(rng.choice(np.arange(1, body), 2, replace=False))
        for i, (a, e) in enumerate(zip((0, *cuts), (*cuts, body))):
            out[r, a:e] = i + 1
    return out


def make_inputs(shape, packing: str, seed: int = 0) -> dict:
    b, s, hk, hv, dk, dv = shape
    keys = jax.random.split(jax.random.key(seed), 8)
    bf = jnp.bfloat16
    x = {"q": jax.random.normal(keys[0], (b, s, hk, dk), bf), "k": jax.random.normal(keys[1], (b, s, hk, dk), bf),
         "v": jax.random.normal(keys[2], (b, s, hv, dv), bf),
         "g": jax.nn.log_sigmoid(jax.random.normal(keys[3], (b, s, hv), jnp.float32)),
         "beta": jax.nn.sigmoid(jax.random.normal(keys[4], (b, s, hv), jnp.float32)).astype(bf),
         "h0": 0.1 * jax.random.normal(keys[5], (b, hv, dk, dv), jnp.float32),
         "probe_out": jax.random.normal(keys[6], (b, s, hv, dv), jnp.float32),
         "probe_state": jax.random.normal(keys[7], (b, hv, dk, dv), jnp.float32)}
    x["seg"] = jnp.asarray(_segments(b, s, np.random.default_rng(seed))) if packing == "packed" else None
    return x


def rule_fn(variant: str, config: gdn_triton.Config | None = None):
    """(q, k, v, g, beta, h0, seg) -> (out, final state) of one variant."""
    if variant == "triton":
        base = functools.partial(gdn_triton.chunk_gated_delta_rule, config=config)
    elif variant == "reference":
        base = functools.partial(gated_deltanet.chunk_gated_delta_rule, precision=jax.lax.Precision.HIGHEST)
    else:
        base = gated_deltanet.chunk_gated_delta_rule

    def fn(q, k, v, g, beta, h0, seg):
        if variant == "reference":
            q, k, v, beta = (a.astype(jnp.float32) for a in (q, k, v, beta))
        return base(q, k, v, g, beta, chunk_size=CHUNK, initial_state=h0, segment_ids=seg, use_qk_l2norm=True)

    return fn


def loss_and_grads(variant: str, config=None, with_h0: bool = True):
    """jit: (inputs...) -> ((loss, (out, state)), grads of q, k, v, g, beta[, h0])."""
    fn = rule_fn(variant, config)

    def loss(q, k, v, g, beta, h0, seg, po, ps):
        out, state = fn(q, k, v, g, beta, h0, seg)
        return jnp.sum(out.astype(jnp.float32) * po) + jnp.sum(state * ps), (out, state)

    argnums = tuple(range(6 if with_h0 else 5))
    return jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True))


def _args(x: dict, with_h0: bool = True) -> tuple:
    return (x["q"], x["k"], x["v"], x["g"], x["beta"], x["h0"] if with_h0 else None, x["seg"], x["probe_out"],
            x["probe_state"])


def time_jax(fn, args, reps: int) -> dict:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return {"median": statistics.median(times), "min": min(times), "compile_s": compile_s, "reps": reps}


def check(x: dict, errors: list, variants=("einsum", "triton")) -> dict:
    """Max abs errors of the einsum and kernel paths against the float32 reference."""
    out = {}
    try:
        (_, (r_out, r_state)), r_grads = loss_and_grads("reference")(*_args(x))
        ref = {"out": r_out.astype(jnp.float32), "state": r_state, **dict(zip(GRADS, r_grads))}
        out["reference_max_abs"] = {k: float(jnp.max(jnp.abs(v))) for k, v in ref.items()}
    except Exception:
        return {"reference": _error("check/reference", errors)}
    for variant in variants:
        try:
            (_, (o, st)), grads = loss_and_grads(variant)(*_args(x))
            got = {"out": o.astype(jnp.float32), "state": st, **dict(zip(GRADS, grads))}
            out[variant] = {k: float(jnp.max(jnp.abs(got[k].astype(jnp.float32) - ref[k]))) for k in ref}
            log(f"  check {variant}: " + " ".join(f"{k} {v:.2e}" for k, v in out[variant].items()))
        except Exception:
            out[variant] = _error(f"check/{variant}", errors)
    return out


def timings(x: dict, variants, reps: int, errors: list, configs=None) -> dict:
    res = {}
    for variant in variants:
        cfg = (configs or {}).get(variant)
        name = variant if cfg is None else f"{variant}:{cfg}"
        res[variant] = {}
        for mode in ("fwd", "fwd_bwd"):
            try:
                if mode == "fwd":
                    fn = jax.jit(lambda q, k, v, g, beta, seg, f=rule_fn(variant, cfg): f(q, k, v, g, beta, None, seg))
                    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["seg"])
                else:
                    fn, args = loss_and_grads(variant, cfg, with_h0=False), _args(x, with_h0=False)
                res[variant][mode] = time_jax(fn, args, reps)
                log(f"  time {name} {mode}: {res[variant][mode]['median']:.3f} ms "
                    f"(compile {res[variant][mode]['compile_s']:.1f} s)")
            except Exception:
                res[variant][mode] = _error(f"time/{name}/{mode}", errors)
    return res


def breakdown(x: dict, reps: int, errors: list) -> dict:
    """The kernel path's pieces, each jitted alone on the default config: the forward's preparation kernel
    (``prepare``, also at other warps), the forward kernel; the backward's XLA preparation (``prepare_xla``),
    chunk states, reverse kernel, chunk gradients and the preparation's pullback."""
    res = {}
    try:
        b, s, _, dk = x["q"].shape
        t = -(-s // CHUNK) * CHUNK
        runs, valid = gdn_triton._runs(x["seg"], b, s, t)
        st = gdn_triton._Static(CHUNK, dk ** -0.5, True, None, jnp.dtype(x["q"].dtype), gdn_triton.DEFAULT_CONFIG,
                                jax.default_backend() == "cpu")
        h0 = jnp.zeros_like(x["h0"])
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        for warps in PREP_WARPS:
            stw = st._replace(config=dataclasses.replace(st.config, prep_num_warps=warps))
            prep = jax.jit(lambda q, k, v, g, beta, stw=stw: gdn_triton._prepare_kernel(
                q, k, v, g, beta, runs, valid, stw))
            name = "prepare" if warps == st.config.prep_num_warps else f"prepare_w{warps}"
            res[name] = time_jax(prep, args, reps)["median"]
        prep_xla = jax.jit(lambda q, k, v, g, beta: gdn_triton._kernel_inputs(
            gdn_triton._prepare(q, k, v, g, beta, runs, valid, st), st))
        res["prepare_xla"] = time_jax(prep_xla, args, reps)["median"]
        xk = prep_xla(*args)
        fwd = jax.jit(lambda xx: gdn_triton._recurrence(xx, h0, x["q"].dtype, st, states=False))
        res["fwd_kernel"] = time_jax(fwd, (xk,), reps)["median"]
        states = jax.jit(lambda xx: gdn_triton._recurrence(xx, h0, x["q"].dtype, st, states=True))
        res["states_kernel"] = time_jax(states, (xk,), reps)["median"]
        hs, vn, _ = states(xk)
        do = jnp.pad(x["probe_out"].astype(x["q"].dtype), ((0, 0), (0, t - s), (0, 0), (0, 0)))
        rev = jax.jit(lambda xx, do, dht: gdn_triton._reverse(xx, do, dht, st))
        res["bwd_kernel"] = time_jax(rev, (xk, do, x["probe_state"]), reps)["median"]
        dvn, dhs, _ = rev(xk, do, x["probe_state"])
        grads = jax.jit(lambda xx, hs, vn, dvn, dhs, do: gdn_triton._chunk_grads(xx, hs, vn, dvn, dhs, do, st))
        res["chunk_grads"] = time_jax(grads, (xk, hs, vn, dvn, dhs, do), reps)["median"]
        x32 = jax.jit(lambda q, k, v, g, beta: gdn_triton._prepare(q, k, v, g, beta, runs, valid, st))(*args)
        pull = jax.jit(lambda q, k, v, g, beta, ct: jax.vjp(
            lambda *a: gdn_triton._prepare(*a, runs, valid, st), q, k, v, g, beta)[1](ct))
        res["prepare_vjp"] = time_jax(pull, (*args, x32), reps)["median"]
        log("  breakdown: " + " ".join(f"{k} {v:.3f}" for k, v in res.items()))
    except Exception:
        res["error"] = _error("breakdown", errors)["error"]
    return res


def fla(x: dict, reps: int, errors: list) -> dict:
    """fla-core's chunk_gated_delta_rule (torch) on the same values, unpacked rows."""
    res = {}
    try:
        import torch
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except Exception:
        return {"error": _error("fla/import", errors)["error"]}
    try:
        import fla as fla_pkg
        res["version"] = getattr(fla_pkg, "__version__", "?")
    except Exception:
        pass
    dev = torch.device("cuda")

    def t(a, dtype):
        return torch.from_numpy(np.asarray(a.astype(jnp.float32))).to(dev, dtype)

    b, s, hk, dk = x["q"].shape
    hv = x["v"].shape[2]
    q, k, v = (t(x[n], torch.bfloat16) for n in ("q", "k", "v"))
    g, beta = t(x["g"], torch.float32), t(x["beta"], torch.bfloat16)
    do = t(x["probe_out"], torch.bfloat16)

    def call(q_, k_, v_, g_, beta_):
        return fla_rule(q_, k_, v_, g_, beta_, scale=dk ** -0.5, initial_state=None, output_final_state=True,
                        use_qk_l2norm_in_kernel=True)

    res["gva"] = True
    try:
        with torch.no_grad():
            o, _ = call(q, k, v, g, beta)
    except Exception as e:  # an fla without grouped value heads: q / k repeated per value head
        res["gva"], res["gva_error"] = False, str(e)[:500]
        q, k = (a.repeat_interleave(hv // hk, dim=2).contiguous() for a in (q, k))
    try:
        with torch.no_grad():
            o, _ = call(q, k, v, g, beta)
        torch.cuda.synchronize()
        ours, _ = jax.jit(rule_fn("triton"))(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None)
        diff = np.abs(o.float().cpu().numpy() - np.asarray(ours.astype(jnp.float32)))
        res["max_abs_diff_vs_triton_unpacked"] = float(diff.max())
        res["max_abs_triton_unpacked"] = float(np.abs(np.asarray(ours.astype(jnp.float32))).max())
        log(f"  fla vs triton (unpacked): max abs diff {res['max_abs_diff_vs_triton_unpacked']:.2e}")
    except Exception:
        res["check"] = _error("fla/check", errors)

    def time_torch(fn) -> dict:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return {"median": statistics.median(times), "min": min(times), "reps": reps}

    try:
        def fwd():
            with torch.no_grad():
                call(q, k, v, g, beta)

        res["fwd"] = time_torch(fwd)
        log(f"  time fla fwd: {res['fwd']['median']:.3f} ms")
    except Exception:
        res["fwd"] = _error("fla/fwd", errors)
    try:
        leaves = [a.detach().clone().requires_grad_(True) for a in (q, k, v, g, beta)]

        def fwd_bwd():
            for a in leaves:
                a.grad = None
            o, _ = call(*leaves)
            o.backward(do)

        res["fwd_bwd"] = time_torch(fwd_bwd)
        log(f"  time fla fwd_bwd: {res['fwd_bwd']['median']:.3f} ms")
    except Exception:
        res["fwd_bwd"] = _error("fla/fwd_bwd", errors)
    del q, k, v, g, beta, do
    torch.cuda.empty_cache()
    return res


def sweep(x: dict, reps: int, errors: list) -> list:
    rows = []
    for cfg in SWEEP:
        row = {"config": dataclasses.asdict(cfg)}
        r = timings(x, ["triton"], reps, errors, configs={"triton": cfg})["triton"]
        row.update({m: r[m].get("median") if "median" in r[m] else r[m] for m in r})
        rows.append(row)
    return rows


def _fmt(v, spec=".3f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "-"


def table(results: dict) -> str:
    lines = [f"device: {results['device']}  jax {results['jax']}  torch {results.get('torch', '-')}  "
             f"triton {results.get('triton', '-')}  fla {results.get('fla_version', '-')}", ""]
    for name, r in results["shapes"].items():
        lines.append(f"== {name}: B,S,Hk,Hv,Dk,Dv = {r['shape']}, packing {r['packing']}")
        t = r.get("time_ms", {})
        base = t.get("einsum", {}).get("fwd_bwd", {}).get("median")
        lines.append(f"{'variant':<10} {'fwd ms':>9} {'fwd+bwd ms':>11} {'x einsum':>9}")
        for variant in ("einsum", "triton", "fla"):
            v = t.get(variant, {})
            fb = v.get("fwd_bwd", {}).get("median")
            speed = base / fb if base and fb else None
            lines.append(f"{variant:<10} {_fmt(v.get('fwd', {}).get('median')):>9} {_fmt(fb):>11} "
                         f"{_fmt(speed, '.2f'):>9}")
        c = r.get("check", {})
        if "reference_max_abs" in c:
            keys = list(c["reference_max_abs"])
            lines.append("max abs error vs float32 reference: " + " ".join(f"{k:>9}" for k in keys))
            lines.append(f"{'|reference|':<36}" + " ".join(f"{c['reference_max_abs'][k]:>9.2e}" for k in keys))
            for variant in ("einsum", "triton"):
                e = c.get(variant, {})
                lines.append(f"{variant:<36}" + " ".join(f"{_fmt(e.get(k), '.2e'):>9}" for k in keys))
        if r.get("breakdown_ms"):
            lines.append("kernel path pieces (ms): " + " ".join(f"{k} {_fmt(v)}" for k, v in r["breakdown_ms"].items()))
        for row in r.get("sweep", []):
            lines.append(f"sweep {row['config']}: fwd {_fmt(row.get('fwd'))} fwd+bwd {_fmt(row.get('fwd_bwd'))}")
        lines.append("")
    lines.append(f"errors: {len(results['errors'])}" + "".join(f"\n  {e['where']}: {e['error'].strip().splitlines()[-1]}"
                                                          for e in results["errors"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for gdn_kernel.json and gdn_kernel.txt")
    p.add_argument("--shapes", default="proxy35,row32k", help=f"comma list of {list(SHAPES)}")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--packing", choices=("packed", "none"), default="packed")
    p.add_argument("--sweep", action="store_true", help=f"also time {len(SWEEP)} tile configs of the kernel path")
    p.add_argument("--no-check", action="store_true", help="skip the error check against the float32 reference")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--no-breakdown", action="store_true", help="skip the pieces")
    p.add_argument("--check-on", default=None, help="the shapes checked against float32 (default: every one)")
    p.add_argument("--variants", default="einsum,triton", help="the JAX paths timed (comma list)")
    p.add_argument("--smoke", action="store_true", help="a tiny shape, 3 reps")
    args = p.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = SMOKE if args.smoke else {n: {**SHAPES, **SMOKE}[n] for n in args.shapes.split(",")}
    check_on = set(args.check_on.split(",")) if args.check_on else set(shapes)
    reps = 3 if args.smoke else max(10, args.reps)
    results = {"device": str(jax.devices()[0]), "backend": jax.default_backend(), "jax": jax.__version__,
               "args": vars(args), "chunk": CHUNK, "shapes": {}, "errors": []}
    for mod in ("torch", "triton"):
        try:
            results[mod] = __import__(mod).__version__
        except Exception as e:
            results[mod] = f"not importable: {e}"[:200]
    errors = results["errors"]

    def dump():
        (out_dir / "gdn_kernel.json").write_text(json.dumps(results, indent=1, default=str))
        (out_dir / "gdn_kernel.txt").write_text(table(results))

    for name, shape in shapes.items():
        log(f"== {name} {shape}")
        r = results["shapes"][name] = {"shape": list(shape), "packing": args.packing}
        try:
            x = make_inputs(shape, args.packing)
        except Exception:
            r["inputs"] = _error(f"{name}/inputs", errors)
            continue
        r["time_ms"] = timings(x, args.variants.split(","), reps, errors)  # the headline first
        dump()
        if not args.no_fla and name in SHAPES:
            r["time_ms"]["fla"] = fla(x, reps, errors)
            results.setdefault("fla_version", r["time_ms"]["fla"].get("version"))
            dump()
        if not args.no_check and name in check_on:
            r["check"] = check(x, errors, args.variants.split(","))
            dump()
        if not args.no_breakdown:
            r["breakdown_ms"] = breakdown(x, reps, errors)
            dump()
        if args.sweep and not args.smoke:
            r["sweep"] = sweep(x, reps, errors)
            dump()
        del x
        jax.clear_caches()
    dump()
    log(table(results))
    log(f"wrote {out_dir / 'gdn_kernel.json'} and {out_dir / 'gdn_kernel.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
