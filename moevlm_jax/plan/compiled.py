"""The compiled plan: a run's real train step compiled (never run) for a target of N GPUs, with XLA's memory
per device and the collectives in the compiled program, beside the planner's analytic estimate.

    python -m moevlm_jax.plan.compiled --recipe gpu-default --model qwen3-vl-30b-a3b --layouts fsdp,ep \\
        --gpus 8 --gpus-per-host 8 --gpu h100 --out runs/compiled-30b-8

For each layout the run (recipe -> model / layout / data -> ``key=value`` overrides, as the train command
loads it) becomes the planner's candidate (``plan.fit.candidate_of``) and its train step is lowered on
abstract inputs (``ShapeDtypeStruct`` with their shardings: no parameter is allocated) and compiled by the
same code the auto-fit's compiled check uses (``plan.fit.compile_candidate`` -> ``perf.memory.compile_step``
-> ``Trainer.lower_step``), on a mesh hybrid over the target's hosts as a multi-host run builds it.
Reported per device: XLA's ``memory_analysis()`` (arguments, outputs, aliased, temporaries, peak) against the
GPU's memory, the planner's estimate for the same setting, and every collective of ``compiled.as_text()``
(``parallelism.hlo``: kind, mesh axes, runs a step with loops' trip counts, bytes within / across hosts).

Devices. On CPU the target's devices are XLA host devices (``--xla_force_host_platform_device_count``: the
memory figures are XLA:CPU's, whose attention path and buffers differ from the GPU's; the collectives are the
same SPMD program's). On a GPU machine with fewer GPUs than asked, the entry point makes JAX's GPU client
present the devices of ``gpus / local`` mock processes (``jax_mock_gpu_topology`` = ``1 x (gpus / local) x
local``) before the backend starts, with ``--xla_gpu_shard_autotuning=false`` (sharded GEMM autotuning waits
forever on the mocked processes' results: openxla/xla#28959), so the whole job's program compiles on one GPU.

Collective time (``comm_time``), per device per step, at the link rates of ``Links`` (datasheet one-way
rates; ``efficiency`` scales both, default 1: a lower bound): a ring collective (all-gather, reduce-scatter,
all-reduce; bytes as ``parallelism.hlo`` counts them, e.g. all-reduce ``2 (n - 1) / n X``) runs at NVLink's rate
within a host and at the per-GPU InfiniBand rate when its group spans hosts (every ring link carries the same
bytes; the slowest sets the pace); an all-to-all or permute sends to every peer at once:
``max(within / NVLink, across / InfiniBand)``. Collectives are summed one after the other, with no overlap
with compute or each other: the time the step would spend if nothing hid them.

Predicted step (``predicted_step``; columns "pred"): the local shard cannot run a program whose collectives are
mocked, so one device's compute is the planner's time model (``plan.time``: kernel rates measured on the H100 /
H200, scaled to the measured recipe-h200 step) and the compiled collectives are added at the link rates, FSDP
gathers and gradient reductions hidden behind up to ``plan.time.OVERLAP`` of the layers' compute as the planner
assumes, the rest exposed; useful tokens/s per GPU and MFU (model FLOPs without recompute over the dense bf16 peak)
follow. On one GPU (no collectives) it is the planner's step, checked against the measured steps in
tests/plan/test_time.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import jax

from moevlm_jax.config import load_config
from moevlm_jax.parallelism import hlo
from moevlm_jax.parallelism.cpu_threads import ensure_collective_threads
from moevlm_jax.plan.fit import candidate_of, compile_candidate, device_memory_bytes, workload_of
from moevlm_jax.plan.memory import GIB
from moevlm_jax.plan.search import candidate_geometry, estimate, knobs_of
from moevlm_jax.plan.time import H200, HARDWARE, OVERLAP, model_flops
from moevlm_jax.training.capture import backend_started, merge_flags

RING = ("all-gather", "reduce-scatter", "all-reduce")


@dataclasses.dataclass(frozen=True)
class Links:
    """A GPU's link rates, one way (datasheet)."""

    nvlink_gb_s: float = 450.0  # GB/s a GPU sends within a host (NVLink 4: 900 GB/s both ways)
    ib_gbit_s: float = 400.0  # Gb/s a GPU sends to other hosts (one 400 Gb/s InfiniBand NIC a GPU)
    efficiency: float = 1.0  # share of the rates a collective reaches (1: the datasheet's, a lower bound on time)

    @property
    def nvlink_bytes(self) -> float:
        return self.nvlink_gb_s * 1e9 * self.efficiency

    @property
    def ib_bytes(self) -> float:
        return self.ib_gbit_s / 8 * 1e9 * self.efficiency


@dataclasses.dataclass(frozen=True)
class Gpu:
    """A target GPU: its memory and links (datasheet)."""

    name: str
    memory_gib: float
    links: Links = Links()


GPUS = {"h100": Gpu("H100", 80.0), "h200": Gpu("H200", H200.memory_gib)}  # SXM, DGX-style hosts


@dataclasses.dataclass(frozen=True)
class Target:
    """What to compile for: ``gpus`` of type ``gpu`` (``GPUS``), ``gpus_per_host`` to a host."""

    gpus: int = 8
    gpus_per_host: int = 8
    gpu: Literal["h100", "h200"] = "h100"
    memory_gib: float | None = None  # default: the GPU's
    links: Links | None = None  # default: the GPU's

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_host < 1 or self.gpus % min(self.gpus_per_host, self.gpus):
            raise ValueError(f"{self.gpus} GPUs do not make whole hosts of {self.gpus_per_host}")

    @property
    def hosts(self) -> int:
        return max(self.gpus // self.gpus_per_host, 1)

    @property
    def spec(self) -> Gpu:
        return GPUS[self.gpu]

    @property
    def memory(self) -> float:
        return self.memory_gib if self.memory_gib is not None else self.spec.memory_gib

    @property
    def link_rates(self) -> Links:
        return self.links or self.spec.links


def comm_time(c: hlo.Collective, links: Links) -> float:
    """Seconds a step spends in collective ``c`` on one device (module docstring)."""
    if c.kind in RING:
        return c.bytes / (links.ib_bytes if c.across > 0 else links.nvlink_bytes)
    return max(c.within / links.nvlink_bytes, c.across / links.ib_bytes)


DP_AXES = frozenset({"data", "fsdp"})  # ring collectives over these alone: FSDP gathers and gradient reductions


def predicted_step(planned: Any, found: Sequence[hlo.Collective], links: Links) -> dict[str, float]:
    """One device's step: the planner's compute (its time model, ``plan.time``) plus the compiled program's
    collectives at the link rates, exposed as the planner assumes (``plan.time.step_time``): ring collectives over
    the data-parallel axes alone (FSDP gathers, gradient reductions) hide behind up to ``OVERLAP`` of the layers'
    compute, every other collective (tensor, expert, context, pipeline, all-to-all) is on the critical path."""
    compute = planned.time.compute_s
    layers = compute - planned.time.compute.get("optimizer", 0.0)
    hidable = sum(comm_time(c, links) for c in found if c.kind in RING and c.axes and set(c.axes) <= DP_AXES)
    other = sum(comm_time(c, links) for c in found) - hidable
    exposed = max(hidable - OVERLAP * layers, (1 - OVERLAP) * hidable) + other
    return {"compute_s": compute, "exposed_comm_s": exposed, "step_s": compute + exposed}


def compiled_layout(cfg: Any, target: Target, devices: Sequence[Any] | None = None, *,
                    compiler_options: Mapping[str, Any] | None = None, hlo_path: Path | None = None) -> dict[str, Any]:
    """One layout's row: the run ``cfg`` (a RunConfig for ``target.gpus`` devices) compiled on the first
    ``target.gpus`` of ``devices`` (default all), XLA's memory, the collectives and the planner's estimate
    (``hlo_path``: the compiled HLO text is written there too)."""
    devices = list(devices if devices is not None else jax.devices())[: target.gpus]
    n, hosts = target.gpus, target.hosts
    hw = HARDWARE[target.gpu]
    w = workload_of(cfg, n, hosts=hosts, device_memory_gib=target.memory, platform="gpu", hw=hw)
    cand = candidate_of(cfg, n)
    planned = estimate(cand, w, cfg.compute)
    host_of = [int(d.id) // target.gpus_per_host for d in devices]
    step = compile_candidate(cand, w, devices, compute=cfg.compute, optimizer=cfg.optimizer,
                             compiler_options=compiler_options, hosts=host_of)
    mesh = step.trainer.mesh
    text = step.compiled.as_text()
    if hlo_path is not None:
        hlo_path.parent.mkdir(parents=True, exist_ok=True)
        hlo_path.write_text(text)
    found, known = hlo.collectives(text, mesh.axis_names, mesh.devices.shape,
                                   hlo.mesh_hosts(mesh, target.gpus_per_host))
    links = target.link_rates
    rows = hlo.summarize(found)
    for r in rows:
        r["time_s"] = sum(comm_time(c, links) for c in found if c.kind == r["kind"] and c.sliced == r["sliced"]
                          and ("x".join(c.axes) or "-") == r["axes"])
    pred = predicted_step(planned, found, links)
    flops = model_flops(w.model, candidate_geometry(cand, w), knobs_of(cand, w, cfg.compute), w.image_patches, w.fill)
    rep = step.report
    limit = target.memory * GIB * H200.usable_fraction
    if devices[0].platform == "gpu" and target.spec.name.lower() in devices[0].device_kind.lower():
        limit = device_memory_bytes(devices) or limit  # the allocator's own limit on the target GPU
    # XLA's total (arguments + outputs - aliased + temporaries: perf.memory) or its own peak where larger
    # (XLA:CPU's peak leaves the temporaries out)
    peak = float(max(rep["total_bytes"], rep.get("peak_memory_bytes") or 0))
    return {
        "layout": cfg.layout.name, "mesh": {a: s for a, s in mesh.shape.items() if s > 1}, "gpus": n, "hosts": hosts,
        "gpu": target.spec.name, "platform": devices[0].platform, "mbs": cand.mbs, "grad_accum": cand.grad_accum,
        "seq_len": w.seq, "patches": rep["patches"], "recompute": cand.recompute_label(),
        "fits": peak <= limit, "limit_bytes": limit, "peak_bytes": peak,
        **{k: rep[k] for k in ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes")},
        "xla_peak_bytes": rep.get("peak_memory_bytes"),
        "planner_bytes": planned.memory.total, "planner_same_backend_bytes": rep["analytic_same_backend_bytes"],
        "comm_bytes": sum(c.bytes for c in found), "comm_within_bytes": sum(c.within for c in found),
        "comm_across_bytes": sum(c.across for c in found), "comm_s": sum(comm_time(c, links) for c in found),
        "planner_comm_bytes": planned.comm.total(), "planner_across_bytes": planned.comm.total_cross(),
        "trip_counts_known": known, "collectives": rows, "instructions": [c.as_dict() for c in found],
        "links": dataclasses.asdict(links), "compile_s": rep["compile_s"],
        "predicted_compute_s": pred["compute_s"], "predicted_exposed_comm_s": pred["exposed_comm_s"],
        "predicted_step_s": pred["step_s"],
        "predicted_tokens_per_s_per_gpu": w.global_batch * w.seq * w.fill / pred["step_s"] / n,
        "predicted_mfu": flops / pred["step_s"] / n / hw.peak_flops,
    }


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g}"


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line a layout, then its collectives by kind and mesh axes."""
    head = ["layout", "mesh", "fits", "peak GiB", "limit GiB", "planner GiB", "temp GiB", "comm GB", "within GB",
            "across GB", "comm ms", "planner comm GB", "planner across GB", "pred step ms", "pred tok/s/GPU",
            "pred MFU"]
    body, detail = [], []
    for r in rows:
        if "error" in r:
            body.append([r["layout"], "-", "error"] + ["-"] * (len(head) - 3))
            detail.append(f"{r['layout']}: {r['error']}")
            continue
        mesh = "x".join(f"{a}{s}" for a, s in r["mesh"].items()) or "1"
        body.append([r["layout"], mesh, "yes" if r["fits"] else "NO", f"{r['peak_bytes'] / GIB:.2f}",
                     f"{r['limit_bytes'] / GIB:.1f}", f"{r['planner_bytes'] / GIB:.2f}",
                     f"{r['temp_bytes'] / GIB:.2f}", _gb(r["comm_bytes"]), _gb(r["comm_within_bytes"]),
                     _gb(r["comm_across_bytes"]), f"{r['comm_s'] * 1e3:.2f}", _gb(r["planner_comm_bytes"]),
                     _gb(r["planner_across_bytes"]), f"{r['predicted_step_s'] * 1e3:.1f}",
                     f"{r['predicted_tokens_per_s_per_gpu']:,.0f}", f"{r['predicted_mfu']:.1%}"])
        detail.append(f"{r['layout']} collectives a step per device ({r['platform']} compile, "
                      f"{'trip counts from XLA' if r['trip_counts_known'] else 'some trip counts inferred'}"
                      + ("; '+ slice': an all-reduce each device slices, XLA:GPU's reduce-scatter"
                         if any(c["sliced"] for c in r["collectives"]) else "") + "):")
        for c in r["collectives"]:
            kind = c["kind"] + (" + slice" if c["sliced"] else "")
            detail.append(f"  {kind:<20} over {c['axes']:<14} {c['instructions']:>3} ops {c['runs']:>5} runs  "
                          f"{_gb(c['bytes']):>8} GB  within {_gb(c['within']):>8}  across {_gb(c['across']):>8}  "
                          f"{c['time_s'] * 1e3:8.3f} ms")
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(wd) for x, wd in zip(head, widths))]
    lines += ["  ".join(x.ljust(wd) for x, wd in zip(row, widths)) for row in body]
    return "\n".join(lines + [""] + detail)


# ----------------------------------------------------------------------------- the entry point


def gpus_present() -> int:
    """GPUs this process would see, without starting a backend: ``CUDA_VISIBLE_DEVICES`` where set, else the
    ``/dev/nvidiaN`` device files."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([x for x in visible.split(",") if x.strip() and x.strip() != "-1"])
    try:
        return sum(1 for f in os.listdir("/dev") if re.fullmatch(r"nvidia\d+", f))
    except OSError:
        return 0


def mock_topology(gpus: int, local: int) -> str:
    """``jax_mock_gpu_topology`` for ``gpus`` devices from processes of ``local`` GPUs each."""
    if local < 1 or gpus % local:
        raise ValueError(f"{gpus} GPUs are not a whole number of mock processes of {local} local GPUs")
    return f"1x{gpus // local}x{local}"


def prepare_backend(gpus: int, platform: str, mock: str, local_gpus: int | None = None) -> tuple[str, str | None]:
    """Before the backend starts: the devices the compile needs. ``platform`` cpu | gpu | auto (gpu where
    GPUs are present); CPU: ``gpus`` host devices; GPU with fewer than ``gpus`` present (``mock`` auto) or
    ``mock`` on: the mock topology and no sharded autotuning. Returns the platform and the mock topology. Where the
    backend has started already (called in process, e.g. tests), nothing changes: its devices are used as they are."""
    if backend_started():
        return jax.devices()[0].platform, None
    local = local_gpus if local_gpus is not None else gpus_present()
    platform = ("gpu" if local else "cpu") if platform == "auto" else platform
    if platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "--xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = merge_flags(flags, {"--xla_force_host_platform_device_count": str(gpus)})
        ensure_collective_threads()
        return platform, None
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # what the train command lets a step use
    topology = None
    if mock == "on" or (mock == "auto" and gpus > max(local, 1)):
        topology = mock_topology(gpus, max(local, 1))
        jax.config.update("jax_mock_gpu_topology", topology)
        os.environ["XLA_FLAGS"] = merge_flags(os.environ.get("XLA_FLAGS", ""),
                                              {"--xla_gpu_shard_autotuning": "false"})
    return platform, topology


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m moevlm_jax.plan.compiled", description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=None, help="configs/recipes name or path (default: gpu-default)")
    p.add_argument("--model", default=None, help="configs/models name or path (default: the recipe's)")
    p.add_argument("--layouts", default=None, help="layout presets, comma separated (default: the recipe's)")
    p.add_argument("--data", default=None, help="configs/data name (default: the recipe's)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs of the target")
    p.add_argument("--gpus-per-host", type=int, default=8)
    p.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="the target GPU (memory, link rates)")
    p.add_argument("--device-memory", type=float, default=None, help="GiB a GPU has (default: the GPU's)")
    p.add_argument("--nvlink-gb-s", type=float, default=None, help="GB/s one way a GPU sends within a host")
    p.add_argument("--ib-gbit-s", type=float, default=None, help="Gb/s one way a GPU sends to other hosts")
    p.add_argument("--efficiency", type=float, default=1.0, help="share of the link rates collectives reach")
    p.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto",
                   help="where to compile (auto: GPU where present, else CPU host devices)")
    p.add_argument("--mock", choices=("auto", "on", "off"), default="auto",
                   help="GPU: mock the target's processes (auto: when fewer GPUs are present than --gpus)")
    p.add_argument("--local-gpus", type=int, default=None, help="GPUs a mock process has (default: those present)")
    p.add_argument("--out", default=None, help="directory for compiled.txt, compiled.json and LAYOUT.hlo.txt")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="run settings, e.g. train.global_batch_size=8")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point (``python -m moevlm_jax.plan.compiled``)."""
    args = parse_args(argv)
    platform, topology = prepare_backend(args.gpus, args.platform, args.mock, args.local_gpus)
    default = GPUS[args.gpu].links
    links = Links(args.nvlink_gb_s or default.nvlink_gb_s, args.ib_gbit_s or default.ib_gbit_s, args.efficiency)
    target = Target(args.gpus, args.gpus_per_host, args.gpu, args.device_memory, links)
    devices = jax.devices()
    if len(devices) < target.gpus:
        print(f"error: {target.gpus} devices needed, {len(devices)} {devices[0].platform} devices present",
              file=sys.stderr)
        return 2
    layouts = [x.strip() for x in args.layouts.split(",")] if args.layouts else [None]
    options = {"xla_backend_optimization_level": 0} if platform == "cpu" else None
    rows = []
    for layout in layouts:
        try:
            cfg = load_config(args.recipe or "gpu-default", model=args.model, layout=layout, data=args.data,
                              overrides=args.overrides, num_devices=target.gpus, num_processes=target.hosts)
            hlo_path = Path(args.out) / f"{cfg.layout.name}.hlo.txt" if args.out else None
            rows.append(compiled_layout(cfg, target, devices, compiler_options=options, hlo_path=hlo_path))
        except Exception as e:  # noqa: BLE001 - report the layout and go on
            traceback.print_exc()
            rows.append({"layout": layout or "(recipe's)", "error": f"{type(e).__name__}: {e}"[:600]})
    ok = next((r for r in rows if "error" not in r), None)
    title = (f"compiled plan: {args.model or args.recipe or 'gpu-default'} on {target.gpus} x {target.spec.name} "
             f"({target.hosts} host{'s' if target.hosts > 1 else ''} of {min(target.gpus_per_host, target.gpus)}), "
             f"compiled on {len(devices)} {devices[0].platform} devices"
             + (f" ({devices[0].device_kind}, mock topology {topology})" if topology else "")
             + (f"; MBS {ok['mbs']} x accumulation {ok['grad_accum']}, seq {ok['seq_len']}, {ok['patches']} patches "
                f"a row" if ok else "")
             + f"; links NVLink {links.nvlink_gb_s:g} GB/s, InfiniBand {links.ib_gbit_s:g} Gb/s a GPU one way, "
               f"x{links.efficiency:g}; XLA memory analysis per device, the planner's estimate beside it")
    text = title + "\n" + format_table(rows)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "compiled.txt").write_text(text + "\n")
        (out / "compiled.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1, default=str))
        print(f"\nwrote {out / 'compiled.txt'}, {out / 'compiled.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
