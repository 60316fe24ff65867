"""Benchmark one MoE layer (router + dispatch + experts), forward + backward, in one run.

Compares, at Qwen3-VL-30B-A3B and 235B-A22B expert shapes with Zipf-skewed routing:
(a) the ceiling: the same FLOPs as one balanced batched einsum ``[E, T*K/E, H] x [E, H, 2I]``...,
timed as XLA compiles it by default and with XLA's Triton GEMMs off (cuBLAS for every dot; on the GPU), the faster
of the two being the ceiling (XLA's autotuner picks Triton or cuBLAS per process: bench/results/moe_layer.md),
(b) each grouped-matmul backend through ``experts_forward`` (tokamax, ragged_dot, capacity einsum,
and the grouped backend with the same capacity factor, which must equal the capacity einsum),
(c) Hugging Face transformers' ``Qwen3VLMoeTextSparseMoeBlock`` in torch with the ``grouped_mm``
experts implementation on the same tokens and weights, and with ``--ep N`` the expert-parallel
dispatchers on N devices plus the achieved ragged all-to-all bandwidth. Backends are checked for
numerical agreement; the exit code is 1 when a check fails. Timing: our calls back to back with one
synchronisation (the device time of a call, :func:`time_calls`; each synchronised call's median beside it,
``ms_synchronised``), HF's steps by CUDA events around each (the device span of a step).

GPU: ``python -m bench.moe_layer --out bench_moe.json`` (one H200), add ``--ep 2`` on two; ``--ep 8 --ep-hosts 2``
on one 8-GPU host times the hierarchical dispatcher (``fsdp`` 2 x ``expert`` 4) beside the flat one;
``--dispatch-chunks 2,4`` adds those dispatchers with their exchange in chunks (``compute.moe.dispatch_chunks``).
CPU smoke run (tiny shapes): ``python -m bench.moe_layer --tiny --ep 2`` (``--ep 8 --ep-hosts 2``).

FP8 (``--fp8 [VARIANTS]``, instead of the above): the layer forward + backward on the triton backend in bf16 and with
the experts' GEMMs in FP8 (``compute.fp8``, experts only): ``qdq_*`` quantise-dequantise around the bf16 kernels,
``kernel_*`` the fp8 kernels (``compute.fp8.experts_kernel: triton``, ``parallelism/gmm_fp8.py``), each recipe
(``tensor``, ``blockwise``; ``*_e4m3g``: e4m3 gradients, d(x) an fp8 MMA too), one process; each row's relative
errors of (y, d x, d router, d w_gate_up, d w_down) against the bf16 row's and a kernel row's against its qdq row's
(the same recipe: bf16-rounding-sized where the kernel is right). ``python -m bench.moe_layer --fp8 --out fp8.json``.

The triton backend's kernels are a ``compute.moe.kernels`` section (``moevlm_jax.parallelism.kernels``), given as
``--kernels KEY=VALUE`` (e.g. ``--kernels fusions=[gather] --kernels mosaic_gpu_tiles.dw.seg_rows=8192``) and
recorded in the JSON's ``meta.kernels``. These environment variables override it, read when the CLI starts:
``MOEVLM_MOE_FUSE`` (fusions, comma list), ``MOEVLM_PERMUTE_KERNELS`` (permute_kernels), ``MOEVLM_GMM_MGPU``
(mosaic_gpu), ``MOEVLM_GMM_MGPU_TUNE`` (``kind.field=int`` comma list: mosaic_gpu_tiles) and
``MOEVLM_GMM_TRITON_CONFIGS`` (a JSON tile file: triton_tiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moevlm_jax.parallelism.cpu_threads import ensure_collective_threads
from moevlm_jax.parallelism.experts import ExpertsConfig
from moevlm_jax.parallelism.kernels import KernelsConfig, load_triton_tiles
from moevlm_jax.schema import ConfigError, build, overrides_tree, parse_value, set_dotted, to_plain

SHAPES = {
    "30b-a3b": dict(hidden=2048, experts=128, top_k=8, inter=768),
    "235b-a22b": dict(hidden=4096, experts=128, top_k=8, inter=1536),
}
TINY = {"tiny": dict(hidden=64, experts=8, top_k=2, inter=32)}
# --fp8: bf16, then per recipe quantise-dequantise before the kernels (a kernel row's errors are against its qdq row)
FP8_VARIANTS = ("bf16", "qdq_tensor", "kernel_tensor", "qdq_blockwise", "kernel_blockwise", "qdq_blockwise_e4m3g",
                "kernel_blockwise_e4m3g")
TOL = {"bfloat16": 2e-2, "float32": 1e-4}  # relative to a float32 reference; bf16 rounding alone is ~4e-3
JIT_OPTIONS: dict[str, Any] = {}  # --tiny: {"xla_backend_optimization_level": 0}, compile time only


def jit(fn: Callable, **kwargs: Any) -> Callable:
    """jax.jit with the run's compiler options."""
    return jax.jit(fn, compiler_options=JIT_OPTIONS or None, **kwargs)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.moe_layer", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    p.add_argument("--tokens", type=int, default=16384, help="token rows per device")
    p.add_argument("--backends", default="triton,tokamax,ragged_dot,capacity,hybrid",
                   help="experts_forward backends to time")
    p.add_argument("--capacity-factor", type=float, default=1.0)
    p.add_argument("--zipf", type=float, default=0.2, help="router bias -s*log(rank+1): expert-load skew")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="pipelined rounds of --iters calls; the median is reported")
    p.add_argument("--paired", action="store_true",
                   help="also time each grouped backend in rounds alternating with the ceiling's (x ceiling from "
                        "the ceiling's rounds beside it; each switch of program costs the first calls of a round: "
                        "biased against the layer at small shapes, bench/results/moe_layer.md)")
    p.add_argument("--slow-iters", type=int, default=2, help="iterations for jax.lax.ragged_dot on GPU")
    p.add_argument(
        "--slow-tokens",
        type=int,
        default=1024,
        help="tokens for jax.lax.ragged_dot on GPU (it builds [M, G*K] and [G, M, N] buffers)",
    )
    p.add_argument("--ep", type=int, default=0, help="also run expert parallelism over this many devices")
    p.add_argument("--ep-hosts", type=int, default=1,
                   help="split the --ep devices into this many host groups (mesh fsdp x expert, 'exp' over both) and "
                        "add the hierarchical dispatcher; on one host: its cost against the flat all-to-all")
    p.add_argument("--dispatch-chunks", default="",
                   help="comma list of compute.moe.dispatch_chunks > 1 also timed for the dropless alltoall (and "
                        "hierarchical) dispatchers under --ep: one chunk's exchange overlapping another's experts")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers/torch comparison")
    p.add_argument("--no-check", action="store_true", help="skip the float32 reference checks (saves compiles)")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes and few iterations (CPU crash test)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--fp8", nargs="?", const=",".join(FP8_VARIANTS), default=None, metavar="VARIANTS",
                   help="time the layer in bf16 and with the experts in FP8 instead (comma list of "
                        f"{', '.join(FP8_VARIANTS)}; default all; bf16 first: the errors are against it)")
    p.add_argument("--kernels", action="append", default=[], metavar="KEY=VALUE",
                   help="a compute.moe.kernels setting (repeatable), e.g. fusions=[gather]; the MOEVLM_* variables "
                        "of the module docstring override these")
    args = p.parse_args(argv)
    if args.tiny:
        args.shapes, args.tokens, args.iters, args.warmup, args.slow_iters = "tiny", 128, min(args.iters, 2), 1, 1
    return args


# ----------------------------------------------------------------------------- helpers


def time_calls(fn: Callable, args: tuple, iters: int, warmup: int, rounds: int = 3,
               synchronised: bool = True) -> tuple[float, float | None, Any]:
    """Milliseconds one call of ``fn(*args)`` takes: (pipelined, synchronised or None without
    ``synchronised``, the last result).

    Pipelined: the median over ``rounds`` of ``iters`` calls issued back to back and synchronised once, as a
    training step runs its layers (the host's dispatch overlaps the device's work): the device time of a
    call, like the CUDA-event span HF's side is timed by (``bench_moe_hf``). Synchronised: the median of
    ``iters`` calls each waited for, which adds the host's round trip between calls (~1 ms at the 235B-A22B
    layer on the H200: bench/results/moe_layer.md, idle gaps between steps)."""
    out = None
    for _ in range(max(1, warmup)):
        out = jax.block_until_ready(fn(*args))
    synced = []
    for _ in range(iters if synchronised else 0):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        synced.append((time.perf_counter() - t0) * 1e3)
    piped = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        out = jax.block_until_ready(out)
        piped.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(piped), statistics.median(synced) if synced else None, out


def time_paired(fn: Callable, args: tuple, ref: Callable, ref_args: tuple, iters: int, warmup: int,
                rounds: int) -> tuple[float, float, Any]:
    """Pipelined milliseconds of one call of ``fn(*args)`` and of ``ref(*ref_args)`` (the ceiling), measured in
    alternating rounds (``iters`` calls back to back, one wait, ``rounds`` of each): the median of each side's
    rounds, and ``fn``'s last result. A drift of the device's speed over the run (clocks, power) reaches both
    sides alike, where :func:`time_calls` run once per side compares rounds taken at different times; but each round
    starts right after the other program's, which cost the 30B-A3B layer ~0.4 ms a call in rounds of 10 on the H200
    (bench/results/moe_layer.md): the ratio is biased at small shapes, and the unpaired figures stay the reported
    ones."""
    out = None
    for _ in range(max(1, warmup)):
        jax.block_until_ready(ref(*ref_args))
        out = jax.block_until_ready(fn(*args))
    times: dict[int, list[float]] = {0: [], 1: []}
    for r in range(2 * rounds):
        f, a = (ref, ref_args) if r % 2 == 0 else (fn, args)
        t0 = time.perf_counter()
        for _ in range(iters):
            res = f(*a)
        res = jax.block_until_ready(res)
        times[r % 2].append((time.perf_counter() - t0) * 1e3 / iters)
        if r % 2:
            out = res
    return statistics.median(times[1]), statistics.median(times[0]), out


def time_jax(fn: Callable, args: tuple, iters: int, warmup: int) -> tuple[float, Any]:
    """Pipelined milliseconds of one call of ``fn(*args)`` (:func:`time_calls`) and its last result."""
    ms, _, out = time_calls(fn, args, iters, warmup, synchronised=False)
    return ms, out


def rel_err(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| in float32."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    if a.sharding != b.sharding:  # e.g. an expert-parallel result against a one-device reference
        b = jax.device_put(b, a.sharding)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def expert_flops(assignments: int, hidden: int, inter: int) -> float:
    """Forward + backward FLOPs of the SwiGLU experts: 3 x (2*H*2I + 2*I*H) per assignment."""
    return 3.0 * 6.0 * assignments * hidden * inter


def make_inputs(shape: dict, tokens: int, zipf: float, dtype: Any, seed: int = 0) -> dict[str, jax.Array]:
    """Tokens with a constant feature 0 whose router column is a Zipf bias, weights, a probe."""
    h, e, i = shape["hidden"], shape["experts"], shape["inter"]

    @jit
    def build(key):
        ks = jax.random.split(key, 6)
        x = jax.random.normal(ks[0], (tokens, h), jnp.float32).at[:, 0].set(1.0)
        rank = jax.random.permutation(ks[1], e)
        router = jax.random.normal(ks[2], (e, h), jnp.float32) / np.sqrt(h)
        router = router.at[:, 0].set(-zipf * jnp.log1p(rank.astype(jnp.float32)))
        w_gate_up = jax.random.normal(ks[3], (e, h, 2 * i), jnp.float32) / np.sqrt(h)
        w_down = jax.random.normal(ks[4], (e, i, h), jnp.float32) / np.sqrt(i)
        probe = jax.random.normal(ks[5], (tokens, h), jnp.float32)
        out = dict(x=x, router=router, w_gate_up=w_gate_up, w_down=w_down, probe=probe)
        return {name: a.astype(dtype) for name, a in out.items()}

    return build(jax.random.PRNGKey(seed))


def route(x: jax.Array, router: jax.Array, top_k: int, dtype: Any = None) -> tuple[jax.Array, jax.Array]:
    """HF's router: logits rounded to the compute ``dtype`` (default x's), softmax in float32, top-k,
    renormalise, weights rounded to ``dtype`` (returned in x's dtype)."""
    dtype = dtype or x.dtype
    logits = jnp.dot(x, router.T, preferred_element_type=jnp.float32).astype(dtype)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(probs, top_k)
    return idx, (w / jnp.sum(w, axis=-1, keepdims=True)).astype(dtype).astype(x.dtype)


def kernels_config(items: list[str], environ: Mapping[str, str] | None = None) -> KernelsConfig:
    """The ``compute.moe.kernels`` section from ``--kernels KEY=VALUE`` items, overridden by the environment
    variables of the module docstring (``environ``, default ``os.environ``); checked as the train CLI checks it."""
    env = os.environ if environ is None else environ
    tree = overrides_tree(items)

    def names(var: str) -> list[str]:
        return [v for v in env[var].split(",") if v]

    for var, key in (("MOEVLM_MOE_FUSE", "fusions"), ("MOEVLM_PERMUTE_KERNELS", "permute_kernels"),
                     ("MOEVLM_GMM_MGPU", "mosaic_gpu")):
        if var in env:
            tree[key] = names(var)
    if env.get("MOEVLM_GMM_MGPU_TUNE"):
        for item in names("MOEVLM_GMM_MGPU_TUNE"):
            key, _, value = item.strip().partition("=")
            set_dotted(tree, f"mosaic_gpu_tiles.{key}", parse_value(value))
    if env.get("MOEVLM_GMM_TRITON_CONFIGS"):
        tree["triton_tiles"] = [dataclasses.asdict(t) for t in load_triton_tiles(env["MOEVLM_GMM_TRITON_CONFIGS"])]
    return build(KernelsConfig, tree, "compute.moe.kernels")


def layer_step(top_k: int, route_dtype: Any = None, **options: Any) -> Callable:
    """jit(value_and_grad) of <MoE layer(x), probe> wrt x, router, w_gate_up, w_down."""
    from moevlm_jax.parallelism.experts import experts_forward

    def loss(x, router, w_gate_up, w_down, probe):
        idx, w = route(x, router, top_k, route_dtype)
        out = experts_forward(x, idx, w, w_gate_up, w_down, **options)
        return jnp.sum(out.astype(jnp.float32) * probe.astype(jnp.float32)), out

    return jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))


def reference(inputs: tuple, top_k: int, capacity_factor: float | None, dtype: Any) -> Any:
    """The layer in float32 at highest precision on the same (rounded) inputs and the same routing:
    drop-and-pad einsum, with a capacity above the largest expert load when ``capacity_factor`` is None."""
    x, router = inputs[0], inputs[1]
    if capacity_factor is None:
        idx, _ = jit(route, static_argnums=2)(x, router, top_k)
        counts = np.bincount(np.asarray(idx).ravel(), minlength=inputs[2].shape[0])
        capacity_factor = counts.max() * len(counts) / idx.size + 1e-6  # nothing drops
    f32 = tuple(a.astype(jnp.float32) for a in inputs)
    with jax.default_matmul_precision("highest"):
        return layer_step(top_k, route_dtype=dtype, backend="capacity", capacity_factor=capacity_factor)(*f32)


CUBLAS = {"xla_gpu_enable_triton_gemm": False}  # compiler options: every dot on cuBLAS (XLA's Triton GEMMs off)


def ceiling_step(options: dict | None = None) -> Callable:
    """The same expert FLOPs as balanced batched einsums, forward + backward; ``options``: compiler options beside
    the run's (e.g. :data:`CUBLAS`)."""
    from moevlm_jax.parallelism.permute import capacity_ffn

    def loss(rows, w_gate_up, w_down):
        return jnp.sum(capacity_ffn(rows, w_gate_up, w_down).astype(jnp.float32))

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)), compiler_options={**JIT_OPTIONS, **(options or {})} or None)


# ----------------------------------------------------------------------------- report


class Report(list):
    """Result rows; each is printed as a table line when added (the CLI owns stdout)."""

    HEAD = f"{'shape':<10} {'variant':<50} {'tokens':>6} {'ms':>9} {'TFLOP/s':>8} {'x ceil':>7}  notes"

    def __init__(self, echo: bool = True, path: str | None = None, meta: dict | None = None):
        super().__init__()
        self.echo, self.ceiling, self.path, self.meta = echo, {}, path, meta or {}
        if echo:
            print(self.HEAD + "\n" + "-" * len(self.HEAD), flush=True)

    def add(self, row: dict) -> dict:
        """Append ``row`` (with ``ms``: TFLOP/s and ratio to its shape's ceiling filled in) and print it."""
        if "ms" in row and "flops" in row:
            row["tflops"] = row.pop("flops") / row["ms"] / 1e9
            if row["variant"].startswith("ceiling"):  # the fastest ceiling row of the shape
                self.ceiling[row["shape"]] = max(row["tflops"], self.ceiling.get(row["shape"], 0.0))
            elif row["shape"] in self.ceiling:
                row["vs_ceiling"] = row["tflops"] / self.ceiling[row["shape"]]
        self.append(row)
        if self.echo:
            print(self.line(row), flush=True)
        if self.path:  # rewritten after every row: a run cut short still leaves its results
            with open(self.path, "w") as f:
                json.dump(dict(meta=self.meta, results=list(self)), f, indent=1, default=float)
        return row

    @staticmethod
    def line(r: dict) -> str:
        """One table line."""
        notes = []
        for key, what in (("dropped_frac", "dropped"), ("overflow_frac", "past capacity, via grouped matmul")):
            if key in r:
                notes.append(f"{100 * r[key]:.1f}% {what}")
        if "ms_synchronised" in r:
            notes.append(f"{r['ms_synchronised']:.3f} ms synchronised per call")
        if "vs_ceiling_paired" in r:
            notes.append(f"paired with the ceiling: {r['ms_paired']:.3f} vs {r['ceiling_ms_paired']:.3f} ms, "
                         f"x ceil {r['vs_ceiling_paired']:.3f}")
        if "gbps" in r:
            notes.append(f"{r['gbps']:.1f} GB/s ({r['bytes_per_device'] / 1e6:.1f} MB/device)")
        for key, what in (("rel_errs_vs_bf16", "vs bf16"), ("rel_errs_vs_qdq", "vs qdq")):
            if key in r:
                notes.append(f"rel err {what} (y, dx, drouter, dwgu, dwd) " + " ".join(f"{v:.1e}" for v in r[key]))
        if "max_rel_err" in r:
            notes.append(f"max rel err {r['max_rel_err']:.2e} {'OK' if r['ok'] else 'FAIL'}")
        for key in ("skipped", "error"):
            if key in r:
                notes.append(f"{key}: {r[key]}")
        ms = f"{r['ms']:9.3f}" if "ms" in r else " " * 9
        tf = f"{r['tflops']:8.1f}" if "tflops" in r else " " * 8
        vc = f"{r['vs_ceiling']:7.2f}" if "vs_ceiling" in r else " " * 7
        return f"{r['shape']:<10} {r['variant'][:50]:<50} {r.get('tokens', ''):>6} {ms} {tf} {vc}  {'; '.join(notes)}"


def guarded(report: Report, base: dict, variant: str, fn: Callable[[], Any]) -> Any:
    """Run one variant; an exception (e.g. out of memory) becomes an error row, not a crash."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 - the benchmark goes on with the other variants
        report.add(dict(base, variant=variant, error=f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"))
        return None


def check(report: Report, base: dict, label: str, got: Any, ref: Any, dtype: Any) -> None:
    """Relative errors of (out, d_x, d_router, d_w_gate_up, d_w_down) against the float32 reference."""
    errs = [rel_err(got[0][1], ref[0][1])] + [rel_err(g, r) for g, r in zip(got[1], ref[1])]
    tol = TOL[jnp.dtype(dtype).name]
    report.add(dict(base, variant=f"check {label} vs f32", max_rel_err=max(errs), rel_errs=errs, ok=max(errs) < tol))


# ----------------------------------------------------------------------------- FP8


def fp8_variant(variant: str) -> Any:
    """The ``compute.fp8`` section of a ``--fp8`` variant (experts only), None for bf16."""
    from moevlm_jax.parallelism.fp8 import Fp8Config

    if variant == "bf16":
        return None
    if variant not in FP8_VARIANTS:
        raise SystemExit(f"unknown --fp8 variant {variant!r}; choose from {FP8_VARIANTS}")
    mode, recipe, *grad = variant.split("_")
    return Fp8Config(recipe=recipe, dense=False, experts=True, experts_kernel="triton" if mode == "kernel" else "qdq",
                     grad_format="e4m3" if grad else "e5m2")


def bench_fp8(name: str, shape: dict, args: argparse.Namespace, dtype: Any, report: Report) -> None:
    """The layer on the triton backend in bf16 and with the experts in FP8, errors against bf16 (and qdq)."""
    h, e, k, i, t = shape["hidden"], shape["experts"], shape["top_k"], shape["inter"], args.tokens
    inp = make_inputs(shape, t, args.zipf, dtype)
    xs = (inp["x"], inp["router"], inp["w_gate_up"], inp["w_down"], inp["probe"])
    base = dict(shape=name, tokens=t, hidden=h, experts=e, top_k=k, inter=i)
    flops = expert_flops(t * k, h, i)

    def errs(got: Any, ref: Any) -> list[float]:
        return [rel_err(got[0][1], ref[0][1])] + [rel_err(g, r) for g, r in zip(got[1], ref[1])]

    kept: dict[str, Any] = {}  # bf16's result, and a qdq result until its kernel row (weight gradients: GBs each)
    for variant in [v for v in args.fp8.split(",") if v]:
        cfg = fp8_variant(variant)

        def go(cfg=cfg, variant=variant):
            step = layer_step(k, backend="triton", kernels=args.kernels_config, fp8_config=cfg)
            ms, synced, out = time_calls(step, xs, args.iters, min(args.warmup, args.iters), rounds=args.rounds)
            row = dict(base, variant=f"fp8 {variant}", ms=ms, ms_synchronised=synced, flops=flops)
            if "bf16" in kept and variant != "bf16":
                row["rel_errs_vs_bf16"] = errs(out, kept["bf16"])
            pair = variant.replace("kernel_", "qdq_", 1)
            if variant.startswith("kernel_") and pair in kept:
                row["rel_errs_vs_qdq"] = errs(out, kept.pop(pair))
            report.add(row)
            return out

        out = guarded(report, base, f"fp8 {variant}", go)
        if out is not None and (variant == "bf16" or variant.startswith("qdq_")):
            kept[variant] = out
        del out


# ----------------------------------------------------------------------------- single device


def bench_shape(name: str, shape: dict, args: argparse.Namespace, dtype: Any, report: Report) -> None:
    """Ceiling, backends and HF for one shape on one device."""
    from moevlm_jax.parallelism.experts import experts_forward_with_stats
    from moevlm_jax.parallelism.grouped_matmul import tokamax_available

    h, e, k, i, t = shape["hidden"], shape["experts"], shape["top_k"], shape["inter"], args.tokens
    inp = make_inputs(shape, t, args.zipf, dtype)
    xs = (inp["x"], inp["router"], inp["w_gate_up"], inp["w_down"], inp["probe"])
    idx, w = jit(route, static_argnums=2)(inp["x"], inp["router"], k)
    loads = np.bincount(np.asarray(idx).ravel(), minlength=e) / (t * k / e)
    base = dict(
        shape=name,
        tokens=t,
        hidden=h,
        experts=e,
        top_k=k,
        inter=i,
        load_max=float(loads.max()),
        load_min=float(loads.min()),
    )
    flops = expert_flops(t * k, h, i)
    gpu = jax.default_backend() == "gpu"
    backends = [b for b in args.backends.split(",") if b]
    if "tokamax" in backends and not tokamax_available():
        report.add(dict(base, variant="tokamax", skipped="tokamax not importable"))
        backends.remove("tokamax")

    def timed(variant: str, step: Callable, inputs: tuple, iters: int, paired: bool = False, **extra: Any) -> Any:
        def go():
            ms, synced, out = time_calls(step, inputs, iters, min(args.warmup, iters), rounds=args.rounds)
            row = dict(base, variant=variant, ms=ms, ms_synchronised=synced, flops=flops, **extra)
            if paired:
                row["ms_paired"], row["ceiling_ms_paired"], out = time_paired(
                    step, inputs, *ceiling, iters, min(args.warmup, iters), args.rounds)
                row["vs_ceiling_paired"] = row["ceiling_ms_paired"] / row["ms_paired"]  # same FLOPs
            report.add(row)
            return out

        return guarded(report, base, variant, go)

    rows = jax.random.normal(jax.random.PRNGKey(2), (e, t * k // e, h), jnp.float32).astype(dtype)
    ceilings = {"ceiling (balanced einsum)": ceiling_step()}
    if gpu:  # XLA's autotuner may pick Triton GEMMs that run slower than cuBLAS's in the loop
        ceilings["ceiling (balanced einsum, cuBLAS)"] = ceiling_step(CUBLAS)
    best = None
    for label, fn in ceilings.items():
        timed(label, fn, (rows, inp["w_gate_up"], inp["w_down"]), args.iters)
        ms = report[-1].get("ms")
        if ms is not None and (best is None or ms < best[0]):
            best = (ms, fn)
    ceiling = (best[1] if best else ceilings["ceiling (balanced einsum)"], (rows, inp["w_gate_up"], inp["w_down"]))
    if not args.paired:
        del rows, ceiling
    ref = ref_cf = None
    if not args.no_check:
        ref = guarded(report, base, "f32 reference", lambda: reference(xs, k, None, dtype))
        ref_cf = guarded(report, base, "f32 reference", lambda: reference(xs, k, args.capacity_factor, dtype))
    grouped = None
    for backend in [b for b in backends if b != "ragged_dot" or not gpu]:
        extra, note, want = {}, {}, ref
        if backend in ("capacity", "hybrid"):  # hybrid: dropless, so its reference is the dropless one
            extra, want = dict(capacity_factor=args.capacity_factor), (ref_cf if backend == "capacity" else ref)
            _, stats = jit(
                lambda *a: experts_forward_with_stats(*a, capacity_factor=args.capacity_factor, backend="capacity")
            )(inp["x"], idx, w, inp["w_gate_up"], inp["w_down"])
            note = {"dropped_frac" if backend == "capacity" else "overflow_frac": int(stats["dropped"]) / (t * k)}
        out = timed(backend, layer_step(k, backend=backend, kernels=args.kernels_config, **extra), xs, args.iters,
                    paired=args.paired and backend not in ("capacity", "hybrid"), **note)
        if out is not None:
            grouped = grouped or (backend if backend not in ("capacity", "hybrid") else None)
            if want is not None:
                check(report, base, backend, out, want, dtype)
    if grouped is not None and "capacity" in backends:  # drop without padding, same drops as the einsum
        step = layer_step(k, backend=grouped, capacity_factor=args.capacity_factor, kernels=args.kernels_config)
        out = timed(f"{grouped} + capacity_factor {args.capacity_factor}", step, xs, args.iters)
        if out is not None and ref_cf is not None:
            check(report, base, f"{grouped}+cf", out, ref_cf, dtype)
    del ref, ref_cf
    if "ragged_dot" in backends and gpu:  # masked dense on GPU: [M, G*K] / [G, M, N] buffers, few tokens
        ts = min(t, args.slow_tokens)
        small = make_inputs(shape, ts, args.zipf, dtype)
        sx = (small["x"], small["router"], small["w_gate_up"], small["w_down"], small["probe"])
        base_s, flops_s = dict(base, tokens=ts), expert_flops(ts * k, h, i)

        def slow():
            ms, out = time_jax(layer_step(k, backend="ragged_dot"), sx, args.slow_iters, 1)
            report.add(dict(base_s, variant="ragged_dot (jax.lax, fewer tokens)", ms=ms, flops=flops_s))
            return out

        out = guarded(report, base_s, "ragged_dot (jax.lax, fewer tokens)", slow)
        if out is not None and not args.no_check:
            check(report, base_s, "ragged_dot", out, reference(sx, k, None, dtype), dtype)
    if not args.no_hf:
        guarded(report, base, "hf grouped_mm", lambda: bench_hf(base, inp, idx, w, dtype, args, report))


def bench_hf(base: dict, inp: dict, idx: jax.Array, w: jax.Array, dtype: Any, args: argparse.Namespace, report: Report):
    """transformers' Qwen3VLMoeTextSparseMoeBlock (grouped_mm experts) on the same tokens and weights;
    its experts on our routing are checked against a float32 reference."""
    from moevlm_jax.parallelism.experts import experts_forward

    try:
        from bench.hf_moe_layer import HFMoeBlock

        hf = HFMoeBlock(base["top_k"], inp["router"], inp["w_gate_up"], inp["w_down"])
    except ImportError as err:
        report.add(dict(base, variant="hf grouped_mm", skipped=f"transformers/torch: {err!r}"))
        return
    try:
        ms = hf.time_step(inp["x"], inp["probe"], args.iters, args.warmup)
        flops = expert_flops(base["tokens"] * base["top_k"], base["hidden"], base["inter"])
        report.add(dict(base, variant=f"hf grouped_mm ({hf.implementation})", ms=ms, flops=flops))
        if args.no_check:
            return
        probe = inp["probe"].astype(jnp.float32)
        wf = w.astype(jnp.float32)
        counts = np.bincount(np.asarray(idx).ravel(), minlength=base["experts"])
        no_drop = counts.max() * len(counts) / idx.size + 1e-6

        def loss(x, wgu, wd, idx, wf, probe):  # experts only, same routing, float32 drop-and-pad, no drops
            y = experts_forward(x, idx, wf, wgu, wd, backend="capacity", capacity_factor=no_drop)
            return jnp.sum(y * probe), y

        with jax.default_matmul_precision("highest"):  # routing as arguments: no 34 s constant folding
            f32 = [inp[n].astype(jnp.float32) for n in ("x", "w_gate_up", "w_down")]
            (_, y), grads = jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*f32, idx, wf, probe)
        errs = hf.experts_rel_errs(inp["x"], idx, w, inp["probe"], y, grads)
        tol = TOL[jnp.dtype(dtype).name]
        report.add(
            dict(base, variant="check hf experts vs f32", max_rel_err=max(errs), rel_errs=errs, ok=max(errs) < tol)
        )
    finally:
        hf.close()


# ----------------------------------------------------------------------------- expert parallel


def bench_ep(name: str, shape: dict, args: argparse.Namespace, dtype: Any, report: Report) -> None:
    """EP dispatchers over ``args.ep`` devices and the achieved ragged all-to-all bandwidth."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from moevlm_jax.parallelism import logical
    from moevlm_jax.parallelism.grouped_matmul import default_backend

    n, h, e, k, i, t = args.ep, shape["hidden"], shape["experts"], shape["top_k"], shape["inter"], args.tokens
    base = dict(shape=name, tokens=t, hidden=h, experts=e, top_k=k, inter=i, ep=n)
    if len(jax.devices()) < n:
        report.add(dict(base, variant=f"ep{n}", skipped=f"only {len(jax.devices())} devices"))
        return
    hosts = max(args.ep_hosts, 1)
    if n % hosts:
        report.add(dict(base, variant=f"ep{n}", skipped=f"--ep-hosts {hosts} does not divide --ep {n}"))
        return
    axes = ("fsdp", "expert") if hosts > 1 else ("expert",)
    mesh = Mesh(np.asarray(jax.devices()[:n]).reshape(hosts, n // hosts), axes) if hosts > 1 else \
        Mesh(np.asarray(jax.devices()[:n]), axes)
    rules = [("act_tokens", axes), ("exp", axes)]
    base["ep_hosts"] = hosts
    inp = make_inputs(shape, n * t, args.zipf, dtype, seed=3)
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    rows_spec, rep = PartitionSpec(axes), PartitionSpec()
    xs = (
        put(inp["x"], rows_spec),
        put(inp["router"], rep),
        put(inp["w_gate_up"], rows_spec),
        put(inp["w_down"], rows_spec),
        put(inp["probe"], rows_spec),
    )
    backend = default_backend()
    if backend == "ragged_dot" and jax.default_backend() == "gpu":
        report.add(dict(base, variant=f"ep{n}", skipped="no tokamax: jax.lax.ragged_dot does not fit at these sizes"))
        return
    results = {}
    with logical.sharding_context(mesh, rules):
        dispatchers = [("alltoall", backend), ("allgather", backend), ("alltoall", "hybrid")]
        if hosts > 1:
            dispatchers.append(("hierarchical", backend))
        chunked = [int(c) for c in args.dispatch_chunks.split(",") if c.strip() and int(c) > 1]
        dispatchers = [(d, be, 1) for d, be in dispatchers] + [
            (d, backend, c) for c in chunked for d in ("alltoall", "hierarchical") if d != "hierarchical" or hosts > 1]
        for dispatcher, be, chunks in dispatchers:
            tag = f" x{chunks} chunks" if chunks > 1 else ""
            variant = f"ep{n} {dispatcher}{tag} ({be})"
            label = f"{dispatcher}{' hybrid' * (be == 'hybrid')}{tag}"
            opts = dict(backend=be, dispatcher=dispatcher, dispatch_chunks=chunks,
                        capacity_factor=args.capacity_factor if be == "hybrid" else None, kernels=args.kernels_config)

            def go(opts=opts, variant=variant):
                ms, out = time_jax(layer_step(k, **opts), xs, args.iters, args.warmup)
                report.add(dict(base, variant=variant, ms=ms, flops=expert_flops(t * k, h, i)))
                return out

            results[label] = guarded(report, base, variant, go)
    local = tuple(jax.device_put(a, jax.devices()[0]) for a in xs)
    ref = None if args.no_check else guarded(report, base, "f32 reference", lambda: reference(local, k, None, dtype))
    for dispatcher, out in results.items():
        if out is not None and ref is not None:
            check(report, base, f"ep{n} {dispatcher}", out, ref, dtype)
    del ref, results
    guarded(report, base, "ep all-to-all bandwidth", lambda: bench_exchange(mesh, xs, base, args, dtype, report, axes))


def bench_exchange(mesh: Any, xs: tuple, base: dict, args: argparse.Namespace, dtype: Any, report: Report,
                   axes: tuple[str, ...] = ("expert",)) -> None:
    """Time the exchange alone: each device's expert-sorted rows to the devices owning the experts."""
    from jax.sharding import PartitionSpec

    from moevlm_jax.parallelism.dispatch import exchange_fn, exchange_offsets, shard_map_unchecked
    from moevlm_jax.parallelism.permute import dispatch_rows, inverse_slots, route_plan, sorted_slots

    n, e, k, h = args.ep, base["experts"], base["top_k"], base["hidden"]
    el, impl = e // n, "ragged" if jax.default_backend() == "gpu" else "dense"

    def prepare(x, router):
        idx, w = route(x, router, k)
        plan = route_plan(idx, w, e)
        slot = sorted_slots(plan)
        rows = dispatch_rows(x, inverse_slots(slot, slot.shape[0]), slot, k)
        counts = jax.lax.all_gather(plan.counts, axes)
        fwd, _, _ = exchange_offsets(counts, jax.lax.axis_index(axes), el)
        return (rows, *fwd, counts[None])

    spec, rep = PartitionSpec(axes), PartitionSpec()
    rows, *fwd, counts = jit(shard_map_unchecked(prepare, mesh, (spec, rep), (spec,) * 6))(xs[0], xs[1])
    send = exchange_fn(impl, axes, n)
    a2a = jit(
        shard_map_unchecked(lambda r, *o: send(r, jnp.zeros((n * r.shape[0], h), r.dtype), *o), mesh, (spec,) * 5, spec)
    )
    ms, _ = time_jax(a2a, (rows, *fwd), args.iters, args.warmup)
    c = np.asarray(counts)[0].reshape(n, n, el).sum(-1)  # [source, destination] rows
    off_device = (c.sum() - np.trace(c)) / n * h * jnp.dtype(dtype).itemsize
    report.add(
        dict(
            base,
            variant=f"ep{n} {impl} all-to-all of dispatched rows",
            ms=ms,
            bytes_per_device=float(off_device),
            gbps=off_device / ms / 1e6,
        )
    )
    fixed = jit(shard_map_unchecked(lambda r: jax.lax.all_to_all(r, axes, 0, 0, tiled=True), mesh, spec, spec))
    ms, _ = time_jax(fixed, (rows,), args.iters, args.warmup)
    moved = rows.shape[0] // n * h * jnp.dtype(dtype).itemsize * (n - 1) / n
    report.add(
        dict(
            base,
            variant=f"ep{n} fixed all_to_all, same rows split evenly",
            ms=ms,
            bytes_per_device=float(moved),
            gbps=moved / ms / 1e6,
        )
    )


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when every agreement check passed."""
    args = parse_args(argv)
    try:
        args.kernels_config = kernels_config(args.kernels)
    except ConfigError as e:
        raise SystemExit(str(e)) from None
    JIT_OPTIONS.clear()
    if args.tiny:
        JIT_OPTIONS["xla_backend_optimization_level"] = 0
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave room for torch
    if args.ep > 1 and "host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.ep}"
    ensure_collective_threads()  # XLA:CPU host devices: pool threads for their collectives, before jax starts
    dtype = jnp.dtype(args.dtype or ("bfloat16" if jax.default_backend() == "gpu" else "float32"))
    shapes = TINY if args.tiny else SHAPES
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in shapes]
    if unknown:
        raise SystemExit(f"unknown shapes {unknown}; choose from {list(shapes)}")
    logging.getLogger("absl").setLevel(logging.ERROR)  # tokamax's autotuning-cache notes
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    meta = dict(
        jax=jax.__version__,
        platform=jax.default_backend(),
        devices=[str(d) for d in jax.devices()],
        dtype=jnp.dtype(dtype).name,
        args={k: v for k, v in vars(args).items() if k != "kernels_config"},
        kernels=to_plain(args.kernels_config),
    )
    print(ExpertsConfig(backend="triton", kernels=args.kernels_config).kernels_summary(jax.default_backend()),
          file=sys.stderr)
    report = Report(path=args.out, meta=meta)
    for name in names:
        if args.fp8:
            bench_fp8(name, shapes[name], args, dtype, report)
            continue
        bench_shape(name, shapes[name], args, dtype, report)
        if args.ep > 1:
            bench_ep(name, shapes[name], args, dtype, report)
    failed = [r["variant"] for r in report if r.get("ok") is False or "error" in r]
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
