"""The FP8 GEMM (``moevlm_jax.parallelism.fp8``) on a GPU: does XLA make an FP8 cuBLASLt GEMM of our dot, how fast
is it next to bf16, and how far is it from float32 (per-GEMM error)?

Shapes: the proxy decoder's dense projections (tokens 8 x 4096, hidden 2048 -> 4096 and 4096 -> 2048)
and one expert-sized GEMM. Variants per shape, forward + backward (``jax.vjp``): ``bf16`` (the plain
dot), ``fp8_tensor`` (the library's tensor recipe: per-tensor current scaling with the fp8 arrays
handed to the dot, ``fp8.tensor_gemm``), ``fp8_blockwise`` (1x128 / 128x128, quantise-dequantise: no FP8
kernel expected). For each: mean ms over ``--iters`` calls after a warm-up, TFLOP/s (3 GEMMs: 6 M K N
flops), the relative error of y, dx and dw against a float32 HIGHEST reference on the same bf16 inputs
(``rounded``: whether the error is FP8's, i.e. > 5x bf16's; a compiler that folds the fp8 converts away
would leave bf16-sized errors, see ``fp8.qdq``), and whether the compiled HLO holds an FP8 GEMM
(``__cublas$lt$matmul$f8`` or an f8e4m3 operand of a cuBLAS custom call). bench/results/fp8.md has the figures.

Usage: ``python bench/scripts/fp8_gemm.py OUT.json [--iters N] [--hlo-dir DIR]`` (on CPU too, slowly: ``--small``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from moevlm_jax.parallelism import fp8

SHAPES = {"qkv": (32768, 2048, 4096), "o_proj": (32768, 4096, 2048), "expert": (16384, 2048, 768)}
SMALL = {"qkv": (512, 256, 384), "o_proj": (512, 384, 256)}
FP8_GEMM = re.compile(r"cublas\$lt\$matmul\$f8|f8e4m3fn\[[^\]]*\][^\n]*custom_call_target=\"__cublas", re.IGNORECASE)
TARGET = re.compile(r'custom_call_target="([^"]+)"')


def _gemms(hlo: str) -> dict:
    """What the compiled module does with fp8: its custom-call targets, and the instructions that take an
    fp8 operand and are GEMMs (a dot, a cuBLAS call, or a fusion whose kind or config names a GEMM:
    XLA may emit an FP8 GEMM as a Triton fusion instead of cuBLASLt, which the pattern above misses)."""
    lines = hlo.splitlines()
    f8 = [ln.strip() for ln in lines if re.search(r"f8e[45]m[23]", ln, re.IGNORECASE)
          and re.search(r"\bdot\(|custom-call|__triton_gemm|kind=kCustom|gemm", ln)]
    return {"custom_call_targets": sorted(set(TARGET.findall(hlo))), "fp8_gemm_like": len(f8),
            "fp8_gemm_like_examples": [ln[:300] for ln in f8[:4]]}


def _fn(variant: str):
    if variant == "bf16":
        return lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    cfg = fp8.Fp8Config(recipe=variant.removeprefix("fp8_"))
    return lambda x, w: fp8.dot(x, w, 1, cfg)


def _fwd_bwd(fn):
    def f(x, w, g):
        y, vjp = jax.vjp(fn, x, w)
        return (y, *vjp(g))
    return jax.jit(f)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--small", action="store_true")
    p.add_argument("--hlo-dir", help="also write each variant's compiled HLO text here")
    p.add_argument("--variants", default="bf16,fp8_tensor,fp8_blockwise",
                   help="comma list (bf16 first: the others' `rounded` compares with it)")
    args = p.parse_args(argv)
    shapes = SMALL if args.small else SHAPES
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "shapes": {}}
    for name, (m, k, n) in shapes.items():
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        g = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
        ref = _fwd_bwd(lambda a, b: jnp.dot(a, b, precision="highest", preferred_element_type=jnp.float32))
        ry, rdx, rdw = ref(x.astype(jnp.float32), w.astype(jnp.float32), g.astype(jnp.float32))
        row = {}
        for variant in args.variants.split(","):
            f = _fwd_bwd(_fn(variant))
            hlo = f.lower(x, w, g).compile().as_text()
            out = jax.block_until_ready(f(x, w, g))
            t0 = time.perf_counter()
            for _ in range(args.iters):
                out = f(x, w, g)
            jax.block_until_ready(out)
            ms = (time.perf_counter() - t0) / args.iters * 1e3
            row[variant] = {
                "ms": round(ms, 3), "tflops": round(6 * m * k * n / ms / 1e9, 1),
                "err_y": _rel(out[0], ry), "err_dx": _rel(out[1], rdx), "err_dw": _rel(out[2], rdw),
                "fp8_gemm_in_hlo": bool(FP8_GEMM.search(hlo)), **_gemms(hlo),
            }
            if variant != "bf16":  # e4m3 operands give ~10x bf16's error: near bf16's, the rounding was compiled away
                row[variant]["rounded"] = row[variant]["err_y"] > 5 * row["bf16"]["err_y"]
            if args.hlo_dir:
                Path(args.hlo_dir).mkdir(parents=True, exist_ok=True)
                (Path(args.hlo_dir) / f"{name}_{variant}.hlo.txt").write_text(hlo)
            print(name, variant, row[variant], flush=True)
        results["shapes"][name] = {"m_k_n": [m, k, n], **row}
        with open(args.out, "w") as f:  # after every shape: a call's time limit keeps what finished
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
