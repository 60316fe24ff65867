"""Plan a training run: which layout and settings fit a model on N devices, and which is fastest.

    python -m moevlm_jax.plan --model qwen3-vl-30b-a3b --devices 16 --hosts 2 --seq-len 4096 \\
        --global-batch 64 --data proxy --top 15 --out runs/plan-30b-16

For every layout preset (``configs/layouts/``) fitted to the devices and hosts and every setting (MBS
with the gradient accumulation that keeps the global batch, recompute none / selective / full,
float32 / bfloat16 parameters and AdamW state, frozen vision, dropless / capacity experts): the
per-device memory by part, the per-step communication by mesh axis and across hosts, and the
estimated step time and useful tokens/s (``moevlm_jax.plan.search``; what is measured and what is
assumed: ``moevlm_jax/plan/time.py``, ``moevlm_jax/plan/memory.py``). ``--compile`` adds XLA's compiled
memory analysis of the leading candidates' real train step (compiles, never runs it) for ``--devices N``
over ``--hosts``: on CPU as N host devices (``--host-devices``), on a GPU machine with fewer GPUs under JAX's
mock GPU topology (``moevlm_jax.plan.compiled``: the whole job's program compiled on one GPU); the CPU
backend's figure, marked ``*``, is for XLA:CPU's
step: its attention path and buffers differ from the GPU's, so its analytic counterpart for the same
backend is printed next to it). Writes ``plan.txt``, ``results.json``, ``results.csv`` and
``plan.png`` (estimated tokens/s against per-device memory, the memory limit as a line) to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import jax

from moevlm_jax.config import load_section
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.parallelism.cpu_threads import ensure_collective_threads
from moevlm_jax.perf.memory import default_patches
from moevlm_jax.plan import fit as planfit
from moevlm_jax.plan import report as plan_report
from moevlm_jax.plan import search as planner
from moevlm_jax.plan.compiled import prepare_backend
from moevlm_jax.plan.time import H200, HARDWARE, hardware_of, sources
from moevlm_jax.schema import overrides_tree


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moevlm_jax.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="configs/models name or path")
    p.add_argument("--devices", type=int, default=None, help="devices to plan for (default: the devices present)")
    p.add_argument("--hosts", type=int, default=1, help="hosts the devices are spread over (equal shares)")
    p.add_argument("--gpu", choices=sorted(HARDWARE), default=None,
                   help="the GPU whose rates and memory to plan for (default: the GPU present, else h200)")
    p.add_argument("--device-memory", type=float, default=None,
                   help="GiB of memory a device has (default: the device's own on a GPU, else the --gpu's)")
    p.add_argument("--inter-host-gbps", type=float, default=None,
                   help="Gb/s of network per host (default 8 x 400 InfiniBand per 8-GPU host)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens a row (default: the data's, else 4096)")
    p.add_argument("--global-batch", type=int, default=None, help="rows a step (default: 8 x devices)")
    p.add_argument("--data", default=None, help="configs/data name: sequence length, patch buckets, image size")
    p.add_argument("--patches", type=int, default=None, help="patch rows a row (default: the data's largest bucket, "
                                                             "else 3/4 of the sequence; 0: text only)")
    p.add_argument("--trained-fraction", type=float, default=None,
                   help="trained / all token slots the LM head sees (default 0.437, the proxy data's; 1: whole rows)")
    p.add_argument("--layouts", default=None, help="presets to consider, comma separated (default all)")
    p.add_argument("--mesh", default=None, help="pin axis sizes, e.g. stage=2,expert=8")
    p.add_argument("--pipeline", default=None, metavar="SCHEDULE[:REPEATS]",
                   help="the pipeline presets' schedule, e.g. circular:12 (Megatron's virtual pipeline 12) or gpipe")
    p.add_argument("--freeze-vision", choices=("off", "on", "both"), default="off")
    p.add_argument("--experts", choices=("dropless", "capacity", "both"), default="both",
                   help="dropless experts, drop-and-pad at capacity 1.25, or both")
    p.add_argument("--dtypes", default="float32/float32,float32/bfloat16,bfloat16/bfloat16",
                   help="parameter/AdamW-state dtype pairs")
    p.add_argument("--max-mbs", type=int, default=16)
    p.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                   help="the backend the analytic memory models (attention path, XLA's buffers)")
    p.add_argument("--top", type=int, default=20, help="rows shown; the first K of them are compiled with --compile")
    p.add_argument("--compile", action="store_true", help="XLA's compiled memory analysis of the leading candidates")
    p.add_argument("--compile-top", type=int, default=3, help="how many leading candidates --compile checks")
    p.add_argument("--host-devices", type=int, default=None, help="CPU: pretend N host devices (default --devices)")
    p.add_argument("--out", default=None, help="directory for plan.txt, results.json / .csv, plan.png")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="compute settings, e.g. compute.scan_layers=false")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (``python -m moevlm_jax.plan``, ``moevlm-plan``)."""
    args = parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # what the train command lets a step use
    if args.compile and (args.host_devices or args.devices):
        # the devices the compiled check needs, before jax starts: CPU host devices, or on a GPU machine with fewer
        # GPUs than --devices JAX's mock GPU topology (plan.compiled): XLA's memory for N devices on this box
        cpu = os.environ.get("JAX_PLATFORMS", "") == "cpu" or args.host_devices is not None
        prepare_backend(args.host_devices or args.devices, "cpu" if cpu else "auto", "auto")
    ensure_collective_threads()  # XLA:CPU host devices: pool threads for their collectives, before jax starts



    model = load_model_config(args.model)
    devices = args.devices or len(jax.devices())
    data = load_section("data", args.data) if args.data else None
    seq = args.seq_len or (data.seq_len if data is not None and data.seq_len else 4096)
    if args.patches is not None:
        patches = args.patches
    elif data is not None and data.patch_buckets:
        patches = max(data.patch_buckets)
    else:
        patches = default_patches(seq)
    image_patches = 784
    if data is not None and data.image.max_pixels:
        image_patches = max(4, int(data.image.max_pixels) // data.image.patch_size**2)
    d = jax.devices()[0]
    hw = HARDWARE[args.gpu] if args.gpu else (hardware_of(d.device_kind) if d.platform == "gpu" else H200)
    memory = args.device_memory
    if memory is None:
        limit = planfit.device_memory_bytes([d]) if d.platform == "gpu" and not args.gpu else None
        memory = limit / 2**30 / hw.usable_fraction if limit else hw.memory_gib
    if args.inter_host_gbps is not None:
        hw = dataclasses.replace(hw, inter_host_gbps=args.inter_host_gbps)

    compute = ComputeConfig.from_dict(overrides_tree(args.overrides, prefix="compute")) if args.overrides else None
    fraction = 0.437 if args.trained_fraction is None else (None if args.trained_fraction >= 1
                                                            else args.trained_fraction)
    w = planner.Workload(model=model, devices=devices, hosts=args.hosts, seq=seq,
                         global_batch=args.global_batch or 8 * devices, patches=patches, image_patches=image_patches,
                         device_memory_gib=memory, hw=hw, platform=args.platform, trained_fraction=fraction,
                         dtype=compute.dtype if compute else "bfloat16",
                         loss_chunk=compute.loss_chunk_size if compute else 2048,
                         scan_layers=compute.scan_layers if compute else True)
    pin = dict(kv.split("=") for kv in args.mesh.split(",")) if args.mesh else None
    pin = {k: int(v) for k, v in pin.items()} if pin else None
    presets = [x.strip().replace("+", "_") for x in args.layouts.split(",")] if args.layouts else planner.PRESETS
    freeze = {"off": (False,), "on": (True,), "both": (False, True)}[args.freeze_vision]
    capacity = {"dropless": (None,), "capacity": (1.25,), "both": (None, 1.25)}[args.experts]
    dtypes = tuple(tuple(pair.split("/")) for pair in args.dtypes.split(","))
    pipeline = None
    if args.pipeline:
        schedule, _, repeats = args.pipeline.partition(":")
        pipeline = (schedule, int(repeats or 2))
    cands = planner.enumerate_candidates(w, presets=presets, pin=pin, pipeline=pipeline, dtypes=dtypes, freeze=freeze,
                                         capacity=capacity, max_mbs=args.max_mbs)
    if not cands:
        print(f"no candidate layout fits {model.name} on {devices} devices ({args.hosts} hosts) with global batch "
              f"{w.global_batch}", file=sys.stderr)
        return 1
    estimates = planner.rank(planner.estimate(c, w, compute) for c in cands)
    if args.compile:
        per_host = max(devices // max(args.hosts, 1), 1)
        planfit.check_compiled(estimates, w, min(args.compile_top, args.top),
                               compiler_options={"xla_backend_optimization_level": 0}
                               if d.platform == "cpu" else None,
                               hosts=[int(x.id) // per_host for x in jax.devices()[:devices]])
        estimates = planner.rank(estimates)
    title = (f"plan: {model.name} on {devices} x {hw.name} ({args.hosts} host{'s' if args.hosts > 1 else ''}, "
             f"{memory:.0f} GiB, {w.limit_bytes / 2**30:.0f} usable), seq {seq}, global batch {w.global_batch}, "
             f"{patches} patches a row, {len(estimates)} candidates; analytic ({args.platform}) estimates"
             + (", XLA compiled memory (* = XLA:CPU's step)" if args.compile else ""))
    print(title)
    print(plan_report.format_table(estimates, args.top))
    print()
    print(plan_report.recommendation(estimates, w))
    print()
    print("Per host (best of each layout):")
    print(plan_report.format_per_host(estimates, w.devices_per_host))

    print()
    print(sources(hw))
    if args.compile:
        for e in estimates[: args.top]:
            if e.compiled and "total_bytes" in e.compiled:
                print(f"compiled: {e.candidate.preset} [{e.candidate.mesh_label()}] MBS {e.candidate.mbs} "
                      f"{e.candidate.recompute_label()}: XLA ({e.compiled['platform']}) "
                      f"{e.compiled['total_bytes'] / 2**30:.2f} GiB, analytic for that backend "
                      f"{e.compiled['analytic_same_backend_bytes'] / 2**30:.2f} GiB, target ({args.platform}) "
                      f"{e.memory.total / 2**30:.2f} GiB")
            elif e.compiled:
                print(f"compiled: {e.candidate.preset} [{e.candidate.mesh_label()}]: {e.compiled.get('error')}")
    if args.out:
        paths = plan_report.write(estimates, w, Path(args.out), title=title, top=args.top)
        print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
