"""GPU check of the chunked gated delta rule (``moevlm_jax.model.gated_deltanet.chunk_gated_delta_rule``)
on proxy35's Gated DeltaNet shapes: accuracy of the training path against float32 references, and speed.

Shapes (configs/models/proxy35.yaml): 16 key heads, 32 value heads (each key head serves 2 consecutive
value heads), key / value head dim 128, chunk 64 (``qwen3_5_gdn.GDN_CHUNK_SIZE``), rows of 4096 tokens,
4 rows packing samples of varied lengths (samples of 37, 1000, 63, 65, 1 and 2930 tokens: boundaries
inside chunks, a sample shorter than a chunk, one longer, one of a single token, the last ending the
row; four samples + 96 tokens of padding; one whole sample; one sample + 1096 tokens of padding;
``--rows N``: the first N). A row's final state is its last sample's (zero after padding), so rows 1
and 3 carry the final-state comparison.
``--small``: 2 / 4 heads of 32, rows of 512, the same kinds of segments (runs on CPU in about a
minute).

The training path (``qwen3_5_gdn.GatedDeltaNet``): q, k, v are the conv outputs in the compute dtype
(bf16), beta = sigmoid(b) in b's dtype (bf16), g = -exp(A_log) softplus(a + dt_bias) in float32,
``use_qk_l2norm=True``, ``precision=GDN_PRECISION`` (None: the backend's default for float32 matmuls;
the function computes in float32 inside and returns the output in q's dtype, bf16). Inputs are drawn as
the layer makes them: q, k, v ~ silu(N(0, 1)) (the conv's silu), b, a ~ N(0, 1), dt_bias = 1 and A_log =
log U(0.01, 16) per value head (HF's init: from a state that holds ~100 tokens to one that holds ~1).

Variants: ``bf16`` (the training path above), ``f32_default`` (the same values as float32 inputs,
``precision=GDN_PRECISION``: only the backend's float32 matmul mode differs from the reference: on
NVIDIA GPUs XLA runs DEFAULT-precision float32 dots as TF32) and the reference ``f32_highest`` (float32
inputs, ``precision=HIGHEST``). All see the same numbers: q, k, v and beta are drawn, then rounded to
bf16, so the input rounding is common to all and the errors below are the kernel's own (internal
matmul precision, bf16 storage of its output and gradients). A second, independent reference for the
forward: ``recurrent_gated_delta_rule`` (token by token, float32, HIGHEST), outputs and final states.
Gradients w.r.t. q, k, v, g and beta of ``sum(out * P) + sum(final_state * Q)`` (random P, Q; P zero
at padding) against ``f32_highest`` only (the recurrent form's backward would hold 4096 states: 34 GB).
Errors: max |x - ref| / max |ref| per tensor.

Tolerances (asserted; exit code 1 when one fails, the JSON is written either way):
- bf16 output 1e-2: its bf16 storage alone is up to half an ulp of 8 significant bits, 2^-8 = 3.9e-3
  of an element's magnitude (measured 2.3e-3 on CPU, where float32 dots are exact float32); TF32 adds
  2^-11 operand rounding in every matmul (see f32_default).
- bf16 gradients 2e-2: the output's cotangent enters rounded to bf16 and each of dq, dk, dv, dbeta
  leaves rounded to bf16: two such roundings, up to ~2^-7 = 7.8e-3 (measured up to 5.2e-3 on CPU,
  dq), plus TF32.
- final state (float32 output) 1e-2 and f32_default 1e-2 for every tensor: TF32's 2^-11 = 4.9e-4
  operand rounding accumulated over the 64-term chunk sums, the UT inverse and the chunk-to-chunk
  state recurrence (contractive: beta <= 1, unit keys, decay <= 1, so errors do not grow along the
  sequence); a few 1e-3 expected, 1e-2 flags growth or a wrong precision setting.
- f32_highest vs recurrent 1e-4: two summation orders of the same float32 math over 4096 steps
  (measured 3e-6 with --small, 8e-6 at proxy35's shapes (2 rows), on CPU).
- padding positions: output and gradients exactly 0 (padding inputs are masked before use).

Timing: median of ``--iters`` calls (after 2 warm-up calls) of the jitted function, each
``block_until_ready``; forward alone and forward + backward (value_and_grad of the loss above), for the
bf16 training path and for the float32 HIGHEST reference, and for the whole ``GatedDeltaNet`` layer
(bf16 compute, float32 parameters: projections, conv, gates, rule, gated norm, out projection; grads
w.r.t. its parameters and input).

FLOP count (``moevlm_jax.tools.flops``; per value head and token of a chunk of C tokens, the C x C
blocks computed whole, then masked): k_beta.k^T and q.k^T (C Dk MACs each), the unit-lower inverse by
recursive 2 x 2 blocks ((C^2 - 1) / 3), T.v_beta (C Dv), T.(k_beta decay) (C Dk), the intra-chunk
attention times the new values (C Dv) and three state products (w.S, q.S, k^T.v_new: Dk Dv each):
``M = C (3 Dk + 2 Dv) + (C^2 - 1) / 3 + 3 Dk Dv`` MACs; forward 2 M FLOPs, forward + backward 6 M
(backward = 2 x forward, as ``flops.gdn_core_flops_per_token``), times value heads times *all* B x S
positions (the kernel computes padding too; the model's MFU counts useful tokens only). proxy35:
M = 64 x 640 + 1365 + 49152 = 91,477 MACs, 5.85 MFLOP per token for the forward of all 32 heads. The
layer adds its projections' 2 x params FLOPs per token forward (``flops.gdn_params_per_token``; 6 x
for forward + backward). Elementwise work (exp, masks, l2norm) is not counted.

  python bench/scripts/h200_gdn_check.py OUT.json            # H200 (about 1-2 minutes with compiles)
  python bench/scripts/h200_gdn_check.py OUT.json --small    # CPU check of the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a file: the repository's packages
    sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from moevlm_jax.model.gated_deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule  # noqa: E402
from moevlm_jax.model.qwen3_5_gdn import GDN_CHUNK_SIZE, GDN_PRECISION  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST
# max |x - ref| / max |ref| against the float32 HIGHEST chunked rule unless said (module docstring: why)
TOL = {"bf16_out": 1e-2, "bf16_grads": 2e-2, "final_state": 1e-2, "f32_default": 1e-2, "chunk_vs_recurrent": 1e-4}
GRADS = ("q", "k", "v", "g", "beta")
FULL = dict(rows=[[37, 1000, 63, 65, 1, 2930], [1500, 1200, 800, 500], [4096], [3000]], seq=4096, iters=10)
SMALL = dict(rows=[[5, 100, 63, 65, 1, 278], [200, 150, 100, 40], [512], [300]], seq=512, iters=3,
             heads=(2, 4), dims=(32, 32), hidden=64)


def segment_ids(rows: list[list[int]], s: int) -> np.ndarray:
    """[B, S] ids 1.. per sample of each row, 0 for the padding after them."""
    out = np.zeros((len(rows), s), np.int32)
    for r, lens in enumerate(rows):
        if sum(lens) > s:
            raise ValueError(f"row {r}: samples {lens} exceed {s} tokens")
        pos = 0
        for i, n in enumerate(lens, 1):
            out[r, pos:pos + n] = i
            pos += n
    return out


def inputs(seg: np.ndarray, hk: int, hv: int, dk: int, dv: int, seed: int = 0) -> dict[str, jax.Array]:
    """float32 q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g, beta [B, S, Hv] as the layer makes them
    (module docstring), the bf16 ones rounded already (so both paths see the same values)."""
    b, s = seg.shape
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    bf = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    q = bf(jax.nn.silu(jax.random.normal(ks[0], (b, s, hk, dk))))
    k = bf(jax.nn.silu(jax.random.normal(ks[1], (b, s, hk, dk))))
    v = bf(jax.nn.silu(jax.random.normal(ks[2], (b, s, hv, dv))))
    a_log = jnp.log(jax.random.uniform(ks[3], (hv,), minval=0.01, maxval=16.0))
    g = -jnp.exp(a_log) * jax.nn.softplus(jax.random.normal(ks[4], (b, s, hv)) + 1.0)  # dt_bias = 1
    beta = bf(jax.nn.sigmoid(jax.random.normal(ks[5], (b, s, hv))))
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta}


def cast(x: dict[str, jax.Array], dtype) -> dict[str, jax.Array]:
    """x in the training dtypes: q, k, v, beta in ``dtype``, g float32 (as ``gdn_gates`` makes it)."""
    return {n: (a if n == "g" else a.astype(dtype)) for n, a in x.items()}


def core(precision, chunk: int):
    """Jitted (x, seg) -> (out, final state) of chunk_gated_delta_rule as the layer calls it."""
    def f(x, seg):
        return chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk, segment_ids=seg,
                                      use_qk_l2norm=True, precision=precision)

    return jax.jit(f)


def core_grad(precision, chunk: int):
    """Jitted value_and_grad w.r.t. x of (x, seg, P, Q) -> sum(out * P) + sum(final * Q)."""
    def loss(x, seg, p, qs):
        out, final = chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], chunk_size=chunk,
                                            segment_ids=seg, use_qk_l2norm=True, precision=precision)
        return jnp.sum(out.astype(jnp.float32) * p) + jnp.sum(final * qs)

    return jax.jit(jax.value_and_grad(loss))


def rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    scale = float(np.abs(ref).max())
    return float(np.abs(a - ref).max() / scale) if scale > 0 else float(np.abs(a).max())


def timed(fn, args, iters: int) -> float:
    """Median seconds of ``fn(*args)`` (jitted, compiled and run twice before timing)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def core_macs_per_token_head(c: int, dk: int, dv: int) -> float:
    """The chunked rule's MACs per token and value head (module docstring; as tools.flops counts)."""
    return c * (3 * dk + 2 * dv) + (c * c - 1) / 3 + 3 * dk * dv


def layer_case(model, seg: jax.Array, iters: int, seed: int = 0) -> dict:
    """The whole GatedDeltaNet layer of ``model`` (a Qwen35ModelConfig; bf16 compute, float32
    parameters): forward and forward + backward (grads w.r.t. parameters and input)."""
    from flax import nnx

    from moevlm_jax.model.compute import ComputeConfig
    from moevlm_jax.model.qwen3_5_gdn import GatedDeltaNet
    from moevlm_jax.tools.flops import gdn_core_flops_per_token, gdn_params_per_token, qwen3_5_shape

    cfg_text = model.text_config

    compute = ComputeConfig(dtype="bfloat16", param_dtype="float32")
    layer = GatedDeltaNet(cfg_text, compute, nnx.Rngs(seed))
    graphdef, params = nnx.split(layer)
    b, s = seg.shape
    x = jax.random.normal(jax.random.PRNGKey(seed + 1), (b, s, cfg_text.hidden_size), jnp.bfloat16)
    probe = jax.random.normal(jax.random.PRNGKey(seed + 2), (b, s, cfg_text.hidden_size), jnp.float32)

    def fwd(params, x, seg):
        return nnx.merge(graphdef, params)(x, seg)

    def loss(params, x, seg):
        return jnp.sum(fwd(params, x, seg).astype(jnp.float32) * probe)

    f = jax.jit(fwd)
    fb = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    out = f(params, x, seg)
    (val, grads) = fb(params, x, seg)
    finite = bool(np.isfinite(np.asarray(out, np.float32)).all()) and bool(
        all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads)))
    t_f, t_fb = timed(f, (params, x, seg), iters), timed(fb, (params, x, seg), iters)
    shape = qwen3_5_shape(model)
    per_token_fwd = 2 * gdn_params_per_token(shape) + gdn_core_flops_per_token(shape) / 3
    tokens = b * s
    return {"what": "GatedDeltaNet layer, bf16 compute / float32 params, grads w.r.t. params and x",
            "finite": finite, "fwd_ms": 1e3 * t_f, "fwd_bwd_ms": 1e3 * t_fb,
            "fwd_flops": per_token_fwd * tokens, "fwd_tflops_per_s": per_token_fwd * tokens / t_f / 1e12,
            "fwd_bwd_tflops_per_s": 3 * per_token_fwd * tokens / t_fb / 1e12}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="results JSON")
    p.add_argument("--small", action="store_true", help="small shapes (CPU check of the script)")
    p.add_argument("--iters", type=int, help="timed calls per case (default 10, --small 3)")
    p.add_argument("--rows", type=int, help="only the first N rows (default: all 4)")
    p.add_argument("--no-layer", action="store_true", help="skip the whole-layer timing")
    args = p.parse_args(argv)

    from moevlm_jax.model.registry import load_model_config

    model = load_model_config("proxy35")
    text = model.text_config
    case = dict(SMALL if args.small else FULL)
    case["rows"] = case["rows"][: args.rows] if args.rows else case["rows"]
    if args.small:
        import dataclasses

        (hk, hv), (dk, dv) = case["heads"], case["dims"]
        text = dataclasses.replace(text, hidden_size=case["hidden"], linear_num_key_heads=hk, linear_num_value_heads=hv,
                                   linear_key_head_dim=dk, linear_value_head_dim=dv)
        vision = dataclasses.replace(model.vision_config, out_hidden_size=case["hidden"])
        model = dataclasses.replace(model, text_config=text, vision_config=vision)
    hk, hv, dk, dv = (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
                      text.linear_value_head_dim)
    iters = args.iters or case["iters"]
    c = GDN_CHUNK_SIZE
    seg_np = segment_ids(case["rows"], case["seq"])
    seg = jnp.asarray(seg_np)
    b, s = seg_np.shape
    x = inputs(seg_np, hk, hv, dk, dv)
    valid = seg_np > 0
    kp, kq = jax.random.split(jax.random.PRNGKey(7))
    probe = jax.random.normal(kp, (b, s, hv, dv)) * jnp.asarray(valid)[:, :, None, None]
    probe_state = jax.random.normal(kq, (b, hv, dk, dv))

    result = {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
              "default_matmul_precision": str(getattr(jax.config, "jax_default_matmul_precision", None)),
              "gdn_precision": str(GDN_PRECISION),
              "shapes": {"rows": b, "seq": s, "key_heads": hk, "value_heads": hv, "key_dim": dk, "value_dim": dv,
                         "chunk": c, "segments": case["rows"], "padding_tokens": int((~valid).sum())},
              "tolerances": TOL, "small": args.small}

    # ---- accuracy: forward and gradients of each variant against the float32 HIGHEST chunked rule
    xs = {"bf16": cast(x, jnp.bfloat16), "f32": cast(x, jnp.float32)}
    variants = {"bf16": ("bf16", GDN_PRECISION), "f32_default": ("f32", GDN_PRECISION), "f32_highest": ("f32", HIGHEST)}
    runs = {name: (core(prec, c), core_grad(prec, c)) for name, (_, prec) in variants.items()}
    fwd, grads = {}, {}
    for name, (inp, _) in variants.items():
        fwd[name] = runs[name][0](xs[inp], seg)
        grads[name] = runs[name][1](xs[inp], seg, probe, probe_state)[1]
    run_rec = jax.jit(lambda x, seg: recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], segment_ids=seg,
                                                                use_qk_l2norm=True, precision=HIGHEST))
    fwd["recurrent_f32_highest"] = run_rec(xs["f32"], seg)
    ref_out, ref_state = fwd["f32_highest"]
    ref_grads = grads["f32_highest"]
    pad = ~valid
    acc: dict = {"vs_chunk_f32_highest": {}, "vs_recurrent_f32_highest": {}}
    for name in ("bf16", "f32_default"):
        out, state = fwd[name]
        acc["vs_chunk_f32_highest"][name] = {"out": rel(out, ref_out), "final_state": rel(state, ref_state),
                                             **{f"d{n}": rel(grads[name][n], ref_grads[n]) for n in GRADS}}
    rec_out, rec_state = fwd.pop("recurrent_f32_highest")
    for name in ("bf16", "f32_highest"):
        out, state = fwd[name]
        acc["vs_recurrent_f32_highest"][name] = {"out": rel(out, rec_out), "final_state": rel(state, rec_state)}
    acc["scale"] = {"out": float(np.abs(np.asarray(ref_out)).max()), "final_state": float(np.abs(np.asarray(ref_state)).max()),
                    **{f"d{n}": float(np.abs(np.asarray(ref_grads[n])).max()) for n in GRADS}}
    acc["dtypes"] = {"out": str(fwd["bf16"][0].dtype), **{f"d{n}": str(grads["bf16"][n].dtype) for n in GRADS}}
    out_b = np.asarray(fwd["bf16"][0], np.float32)
    acc["at_padding_max_abs"] = {"out": float(np.abs(out_b[pad]).max()),
                                 **{f"d{n}": float(np.abs(np.asarray(grads["bf16"][n], np.float32)[pad]).max())
                                    for n in GRADS}}
    acc["finite"] = bool(all(np.isfinite(np.asarray(a, np.float32)).all()
                             for name in variants for a in (*fwd[name], *grads[name].values())))
    result["accuracy"] = acc
    errs = acc["vs_chunk_f32_highest"]
    checks = {"finite": acc["finite"],
              "bf16 out": errs["bf16"]["out"] <= TOL["bf16_out"],
              "bf16 final state": errs["bf16"]["final_state"] <= TOL["final_state"],
              "bf16 grads": max(errs["bf16"][f"d{n}"] for n in GRADS) <= TOL["bf16_grads"],
              "f32 default precision": max(errs["f32_default"].values()) <= TOL["f32_default"],
              "chunk vs recurrent (f32)": max(acc["vs_recurrent_f32_highest"]["f32_highest"].values()) <= TOL["chunk_vs_recurrent"],
              "bf16 vs recurrent": acc["vs_recurrent_f32_highest"]["bf16"]["out"] <= TOL["bf16_out"],
              "zero at padding": max(acc["at_padding_max_abs"].values()) == 0,
              "final state compared (nonzero)": acc["scale"]["final_state"] > 0}
    result["checks"] = checks
    run_bf16, grad_b = runs["bf16"]
    run_f32, grad_f = runs["f32_highest"]
    xb, xf = xs["bf16"], xs["f32"]
    del fwd, grads, ref_out, ref_state, ref_grads, rec_out, rec_state

    # ---- timing
    from moevlm_jax.tools.flops import gdn_core_flops_per_token, qwen3_5_shape

    m = core_macs_per_token_head(c, dk, dv)
    fwd_flops = gdn_core_flops_per_token(qwen3_5_shape(model)) / 3 * b * s  # = 2 M Hv per position
    timing = {"flops": {"macs_per_token_head": m, "fwd": fwd_flops, "fwd_bwd": 3 * fwd_flops,
                        "tokens_counted": b * s, "useful_tokens": int(valid.sum())}}
    for name, run, grad, xx in (("core_bf16_default", run_bf16, grad_b, xb), ("core_f32_highest", run_f32, grad_f, xf)):
        t_f = timed(run, (xx, seg), iters)
        t_fb = timed(grad, (xx, seg, probe, probe_state), iters)
        timing[name] = {"fwd_ms": 1e3 * t_f, "fwd_bwd_ms": 1e3 * t_fb, "fwd_tflops_per_s": fwd_flops / t_f / 1e12,
                        "fwd_bwd_tflops_per_s": 3 * fwd_flops / t_fb / 1e12}
    if not args.no_layer:
        timing["layer"] = layer_case(model, seg, iters)
        checks["layer finite"] = timing["layer"]["finite"]
    result["timing"] = timing
    result["passed"] = all(checks.values())

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(report(result))
    return 0 if result["passed"] else 1


def report(r: dict) -> str:
    sh, acc, t = r["shapes"], r["accuracy"], r["timing"]
    lines = [f"chunked gated delta rule on {r['device']} ({r['platform']}, jax {r['jax']}): {sh['rows']} rows x "
             f"{sh['seq']} tokens ({sh['padding_tokens']} padding), {sh['key_heads']} key / {sh['value_heads']} value "
             f"heads, dims {sh['key_dim']} / {sh['value_dim']}, chunk {sh['chunk']}; GDN precision {r['gdn_precision']}, "
             f"default matmul precision {r['default_matmul_precision']}",
             "max |x - ref| / max |ref| (ref: the chunked rule, float32 inputs, HIGHEST; recurrent: token by token, "
             "float32, HIGHEST):",
             f"  {'tensor':<12}{'bf16 (training)':>16}{'f32 default':>13}{'bf16 vs rec.':>14}{'f32 HIGHEST vs rec.':>21}"]
    vs, rec = acc["vs_chunk_f32_highest"], acc["vs_recurrent_f32_highest"]
    for n in vs["bf16"]:
        extra = (f"{rec['bf16'][n]:>14.2e}{rec['f32_highest'][n]:>21.2e}" if n in rec["bf16"] else "")
        lines.append(f"  {n:<12}{vs['bf16'][n]:>16.2e}{vs['f32_default'][n]:>13.2e}{extra}")
    lines.append("  tolerances: " + ", ".join(f"{k} {v:.0e}" for k, v in r["tolerances"].items())
                 + f"; max |x| at padding (bf16 path): {max(acc['at_padding_max_abs'].values()):.1e}")
    fl = t["flops"]
    lines.append(f"timing (median of calls), FLOPs: fwd {fl['fwd'] / 1e9:.1f} GFLOP ({fl['macs_per_token_head']:,.0f} MACs "
                 f"a token and value head, all {fl['tokens_counted']} positions), fwd+bwd 3x:")
    lines.append(f"  {'case':<20}{'fwd ms':>9}{'TFLOP/s':>9}{'fwd+bwd ms':>12}{'TFLOP/s':>9}")
    for name in ("core_bf16_default", "core_f32_highest", "layer"):
        if name in t:
            x = t[name]
            lines.append(f"  {name:<20}{x['fwd_ms']:>9.2f}{x['fwd_tflops_per_s']:>9.2f}{x['fwd_bwd_ms']:>12.2f}"
                         f"{x['fwd_bwd_tflops_per_s']:>9.2f}")
    if "layer" in t:
        lines.append(f"  (layer: {t['layer']['what']}; its FLOPs add the projections)")
    lines.append("checks: " + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in r["checks"].items())
                 + f" -> {'PASSED' if r['passed'] else 'FAILED'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
