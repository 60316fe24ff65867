"""The planner (issue 21): which layout and settings fit a model on N devices, and which is fastest.

For every candidate layout (the presets of ``configs/layouts/`` with their axis sizes fitted to the
devices and hosts: :func:`fitted_layouts`) and setting (MBS with the gradient accumulation that keeps
the global batch, recompute policy, parameter / AdamW-state dtypes, frozen vision, dropless vs
capacity experts: :func:`settings`), an analytic estimate of the per-device memory by part
(``moevlm_jax.plan.memory``), the per-step communication by mesh axis and across hosts
(``moevlm_jax.plan.comm``) and the step time (``moevlm_jax.plan.time``); then, for the leading candidates,
XLA's compiled memory analysis of the real train step (``moevlm_jax.plan.fit``, through
``moevlm_jax.perf.memory.memory_report``: compiles, never runs it).

Library use (the train command's pre-flight check)::

    from moevlm_jax.plan.fit import fit
    p = fit(run_config, devices=jax.devices())
    if not p.fits:
        print(p.reason, " ".join(p.change))   # e.g. compute.recompute=selective train.micro_batch_size=2 ...

The CLI is ``python -m moevlm_jax.plan`` (``moevlm_jax/plan/cli.py``); the report format and the plot
are ``moevlm_jax.plan.report``. What is measured and what is assumed: ``moevlm_jax.plan.time`` (rates, links,
overlap) and ``moevlm_jax.plan.memory`` (parts); the errors against XLA: bench/results/plans.md.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from moevlm_jax.config import load_layout
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.parallelism.layout import MESH_AXES
from moevlm_jax.parallelism.logical import data_parallel_size
from moevlm_jax.parallelism.validate import LayoutError, validate_layout
from moevlm_jax.plan.comm import CommEstimate, step_communication
from moevlm_jax.plan.geometry import Geometry, geometry
from moevlm_jax.plan.memory import GIB, MemoryEstimate, MemoryKnobs, estimate_memory
from moevlm_jax.plan.time import FILL, H200, Hardware, TimeEstimate, step_time
from moevlm_jax.training import objective

log = logging.getLogger(__name__)

PRESETS = ("fsdp", "tp", "ep", "tp_ep", "ep_etp", "cp", "folded", "pp", "pp_circular", "pp_ep")
# recompute settings a plan tries: (mode, modules) - Megatron's selective modules from model.compute
RECOMPUTE = (("none", ()), ("selective", ()), ("selective", ("core_attn",)), ("selective", ("core_attn", "experts")),
             ("full", ()))
DTYPES = (("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"))  # (params, AdamW state)
TRAINED_FRACTION = 0.437  # trained / all token slots of the proxy data (bench/results/step.md: 107,475 / 245,760)


# ----------------------------------------------------------------------------- candidates


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout (mesh sizes fitted) and one setting."""

    layout: Any  # parallelism.layout.Layout with the fitted mesh (no -1)
    preset: str  # the configs/layouts name it came from
    mbs: int
    grad_accum: int
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ()
    param_dtype: str = "float32"
    state_dtype: str = "float32"
    freeze_vision: bool = False
    capacity_factor: float | None = None
    accum_dtype: str = "float32"  # the gradient sum over microbatches (optimizer.grad_accum_dtype)

    @property
    def mesh(self) -> dict[str, int]:
        """Axis sizes > 1, outermost first (``parallelism.layout.MESH_AXES``)."""

        return {a: int(self.layout.mesh[a]) for a in MESH_AXES if int(self.layout.mesh.get(a, 1)) > 1}

    def mesh_label(self) -> str:
        label = " ".join(f"{a}{n}" for a, n in self.mesh.items()) or "1 device"
        pipe = self.layout.options.pipeline
        if pipe is not None and self.mesh.get("stage", 1) > 1:
            label += f" m{pipe.microbatches}" + (f" vp{pipe.repeats or 2}" if pipe.schedule == "circular" else "")
        return label

    def recompute_label(self) -> str:
        if self.recompute != "selective":
            return self.recompute
        return "sel[" + ",".join(self.recompute_modules) + "]"

    def overrides(self, base: Any | None = None, devices: int | None = None) -> list[str]:
        """``key=value`` overrides that set this candidate on a run (only the keys that differ from ``base``,
        a RunConfig on ``devices`` devices, when given)."""
        out: list[str] = []
        layout_mesh = {a: int(n) for a, n in self.layout.mesh.items()}
        ndev = devices or math.prod(layout_mesh.values())
        if base is None or base.layout.name != self.preset or _mesh_of(base, ndev) != self.mesh:
            out.append(f"layout={self.preset}")

            out += [f"layout.mesh.{a}={layout_mesh[a]}" for a in MESH_AXES if a in layout_mesh]
            pipe = self.layout.options.pipeline
            if pipe is not None and pipe.microbatches:
                out.append(f"layout.options.pipeline.microbatches={pipe.microbatches}")
                out.append(f"layout.options.pipeline.schedule={pipe.schedule}")
                if pipe.schedule == "circular":
                    out.append(f"layout.options.pipeline.repeats={pipe.repeats or 2}")
        pairs = [("compute.recompute", self.recompute, None if base is None else base.compute.recompute),
                 ("compute.recompute_modules", list(self.recompute_modules),
                  None if base is None else list(base.compute.recompute_modules)),
                 ("train.micro_batch_size", self.mbs, None if base is None else base.train.micro_batch_size),
                 ("train.grad_accum", self.grad_accum, None if base is None else base.train.grad_accum),
                 ("compute.param_dtype", self.param_dtype, None if base is None else base.compute.param_dtype),
                 ("optimizer.state_dtype", self.state_dtype, None if base is None else base.optimizer.state_dtype),
                 ("optimizer.grad_accum_dtype", self.accum_dtype,
                  None if base is None else base.optimizer.grad_accum_dtype),
                 ("compute.moe.capacity_factor", self.capacity_factor,
                  None if base is None else base.compute.moe.capacity_factor),
                 ("train.freeze_vision_model", self.freeze_vision,
                  None if base is None else base.train.freeze_vision_model)]
        for key, value, old in pairs:
            if key == "compute.recompute_modules" and self.recompute != "selective":
                continue
            if base is None or value != old:
                text = "null" if value is None else (str(value).lower() if isinstance(value, bool) else
                                                     "[" + ",".join(value) + "]" if isinstance(value, list) else value)
                out.append(f"{key}={text}")
        return out


def _mesh_of(cfg: Any, devices: int) -> dict[str, int]:
    try:
        shape = cfg.layout.resolved_mesh_shape(devices)
    except ValueError:
        return {}
    return {a: int(n) for a, n in shape.items() if int(n) > 1}


def _pow2(limit: int) -> list[int]:
    return [1 << i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def _with_mesh(layout: Any, mesh: Mapping[str, int], name: str, *, kv_null: bool = False,
               microbatches: int | None = None, schedule: tuple[str, int] | None = None) -> Any:
    rules = tuple(layout.rules)
    if kv_null:  # KV heads fewer than the tensor axis: replicated K/V projections (the validator's advice)
        rules = tuple((n, None if n in ("kv_heads", "act_kv_heads") else a) for n, a in rules)
    options = layout.options
    if options.pipeline is not None and microbatches is not None:
        options = dataclasses.replace(options, pipeline=dataclasses.replace(options.pipeline,
                                                                            microbatches=microbatches))
    if options.pipeline is not None and schedule is not None:
        options = dataclasses.replace(options, pipeline=dataclasses.replace(
            options.pipeline, schedule=schedule[0], repeats=schedule[1] if schedule[0] == "circular" else None))
    # every axis the preset names keeps an explicit size (1 included): as overrides they replace its -1
    sizes = {a: int(mesh.get(a, 1)) for a in (*layout.mesh, *mesh)}
    sizes = {a: n for a, n in sizes.items() if n > 1 or a in layout.mesh} or {"fsdp": 1}
    return dataclasses.replace(layout, name=name, mesh=sizes, rules=rules, options=options)


def fitted_layouts(model: Any, devices: int, hosts: int = 1, *, presets: Iterable[str] = PRESETS,
                   pin: Mapping[str, int] | None = None, pipeline: tuple[str, int] | None = None) -> list[tuple[str,
                                                                                                                Any]]:
    """(preset, Layout) pairs with the presets' axis sizes fitted to ``devices`` over ``hosts``: tensor 2 / 4 / 8
    within a host, expert over the power-of-two divisors of the expert count, context 2 / 4, pipeline 2 / 4
    stages (dividing the decoder's layers), FSDP over the rest and, across hosts, also HSDP (data over the
    hosts, FSDP within). ``pin``: axis sizes every layout must have (e.g. ``{"stage": 2, "expert": 8}``);
    ``pipeline``: (schedule, repeats) for the pipeline presets, e.g. ("circular", 12) (Megatron's VP 12)."""

    t = model.text_config
    per_host = devices // max(hosts, 1)
    experts = t.num_experts
    tps = [n for n in (2, 4, 8) if n <= per_host and per_host % n == 0 and t.num_attention_heads % n == 0]
    eps = [n for n in _pow2(min(experts, devices)) if n >= 2 and experts % n == 0 and devices % n == 0]
    cps = [n for n in (2, 4) if n <= per_host and per_host % n == 0]
    stages = [n for n in (2, 4) if devices % n == 0 and t.num_hidden_layers % n == 0]
    out: list[tuple[str, Any]] = []

    def add(preset: str, mesh: dict[str, int], **kw: Any) -> None:
        if math.prod(mesh.values()) != devices or any(n < 1 for n in mesh.values()):
            return
        if pin and any(mesh.get(a, 1) != n for a, n in pin.items()):
            return
        base = load_layout(preset)
        tensor = mesh.get("tensor", 1)
        kv_null = tensor > 1 and t.num_key_value_heads % tensor != 0 and preset != "ep_etp"
        label = preset + "[" + ",".join(f"{a}{n}" for a, n in mesh.items() if n > 1) + "]"
        if pipeline is not None and base.options.pipeline is not None:
            kw = {**kw, "schedule": pipeline}
            if pipeline[0] == "circular":
                label = label[:-1] + f",vp{pipeline[1]}]"
        out.append((preset, _with_mesh(base, mesh, label, kv_null=kv_null, **kw)))

    def dp_split(rest: int) -> list[dict[str, int]]:
        """FSDP over ``rest`` devices, and HSDP (replicas over 2, 4, .. hosts' worth of groups, FSDP within each)
        when they span hosts."""
        opts = [{"fsdp": rest}]
        for data in [d for d in _pow2(hosts) if d >= 2]:
            if rest % data == 0 and rest > data:
                opts.append({"data": data, "fsdp": rest // data})
        return opts

    for preset in presets:
        if preset == "fsdp":
            for d in dp_split(devices):
                add(preset, d)
        elif preset == "tp":
            for tp in tps:
                for d in dp_split(devices // tp):
                    add(preset, {**d, "tensor": tp})
        elif preset == "ep":
            for ep in eps:
                for d in dp_split(devices // ep):
                    add(preset, {**d, "expert": ep})
        elif preset == "tp_ep":
            for tp in [n for n in tps if n <= 4]:
                for ep in eps:
                    if devices % (tp * ep) == 0:
                        for d in dp_split(devices // (tp * ep)):
                            add(preset, {**d, "expert": ep, "tensor": tp})
        elif preset == "ep_etp":
            for ep in eps:
                if devices % (2 * ep) == 0 and 2 <= per_host and t.moe_intermediate_size % 2 == 0:
                    add(preset, {"fsdp": devices // (2 * ep), "expert": ep, "tensor": 2})
        elif preset == "cp":
            for cp in cps:
                for d in dp_split(devices // cp):
                    add(preset, {**d, "context": cp})
        elif preset == "folded":
            for cp, tp in ((2, 2), (2, 4)):
                if cp * tp <= per_host and devices % (cp * tp) == 0 and experts % (cp * tp) == 0 \
                        and t.num_attention_heads % tp == 0:
                    for d in dp_split(devices // (cp * tp)):
                        add(preset, {**d, "context": cp, "tensor": tp})
        elif preset in ("pp", "pp_circular"):
            for s in stages:
                add(preset, {"stage": s, "fsdp": devices // s}, microbatches=2 * s)
        elif preset == "pp_ep":
            for s in stages:
                rest = devices // s
                for ep in [e for e in eps if rest % e == 0]:
                    add(preset, {"stage": s, "fsdp": rest // ep, "expert": ep}, microbatches=2 * s)
    return out


def settings(layout: Any, dp: int, global_batch: int, *, recompute: Sequence[tuple[str, tuple[str, ...]]] = RECOMPUTE,
             dtypes: Sequence[tuple[str, str]] = DTYPES, freeze: Sequence[bool] = (False,),
             capacity: Sequence[float | None] = (None,), max_mbs: int = 16, preset: str = "",
             accum_dtypes: Sequence[str] = ("float32",)) -> list[Candidate]:
    """Every setting of a layout: MBS powers of two (with the gradient accumulation keeping the global batch
    = MBS x grad_accum x data-parallel size) x recompute x dtypes x frozen vision x experts; with
    accumulation and bf16 parameters also each of ``accum_dtypes`` for the gradient sum (float32 first:
    of equal estimates the ranking keeps the first)."""
    out = []
    for mbs in _pow2(max_mbs):
        if global_batch % (mbs * dp):
            continue
        ga = global_batch // (mbs * dp)
        pipe = layout.options.pipeline
        lay = layout
        if pipe is not None:  # pipeline microbatches must divide a stage's rows: MBS x stages
            stages = layout.mesh.get("stage", 1)
            rows = mbs * stages
            m = max([d for d in range(1, 2 * stages + 1) if rows % d == 0 and
                     (pipe.schedule != "circular" or d >= stages)] or [0])
            if m == 0:
                continue
            lay = dataclasses.replace(layout, options=dataclasses.replace(
                layout.options, pipeline=dataclasses.replace(pipe, microbatches=m)))
        for (rc, mods), (pd, sd), fz, cf in itertools.product(recompute, dtypes, freeze, capacity):
            for ad in accum_dtypes if ga > 1 and pd == "bfloat16" else ("float32",):
                out.append(Candidate(lay, preset or layout.name, mbs, ga, rc, tuple(mods), pd, sd, fz, cf, ad))
    return out


# ----------------------------------------------------------------------------- estimates


@dataclasses.dataclass
class Estimate:
    """A candidate's analytic estimate (and its compiled memory analysis where made)."""

    candidate: Candidate
    memory: MemoryEstimate
    comm: CommEstimate
    time: TimeEstimate
    limit_bytes: float
    tokens_per_s: float
    compiled: dict[str, Any] | None = None

    @property
    def fits(self) -> bool:
        total = self.compiled["total_bytes"] if self.compiled and "total_bytes" in self.compiled else self.memory.total
        return total <= self.limit_bytes

    @property
    def memory_gib(self) -> float:
        return self.memory.total / GIB


@dataclasses.dataclass(frozen=True)
class Workload:
    """What the plan is for: model, devices, hosts, sequence, global batch, patches, memory, hardware."""

    model: Any
    devices: int
    hosts: int = 1
    seq: int = 4096
    global_batch: int = 8
    patches: int = 0  # patch rows per batch row (the largest bucket: the memory's worst case)
    image_patches: int = 784  # patches per image (the vision attention's FLOPs)
    device_memory_gib: float = 141.0
    hw: Hardware = H200
    platform: str = "gpu"  # the attention path and XLA's storage the analytic memory assumes
    trained_fraction: float | None = TRAINED_FRACTION  # the LM head's positions (None: whole rows)
    fill: float = FILL  # useful / all token slots
    dtype: str = "bfloat16"
    loss_chunk: int = 2048
    scan_layers: bool = True

    @property
    def limit_bytes(self) -> float:
        return self.device_memory_gib * GIB * self.hw.usable_fraction

    @property
    def devices_per_host(self) -> int:
        return max(self.devices // max(self.hosts, 1), 1)


def loss_capacity(fraction: float | None, mbs: int, seq: int) -> int | None:
    """The trained-positions gather size per data-parallel rank (training.objective.loss_capacity)."""
    if fraction is None:
        return None

    return objective.loss_capacity(math.ceil(fraction * mbs * seq), mbs * seq)


def candidate_compute(c: Candidate, w: Workload, compute: Any = None) -> Any:
    """The ComputeConfig a candidate runs (``compute``: the run's, whose other fields it keeps)."""
    return _candidate_compute(c.recompute, tuple(c.recompute_modules), c.param_dtype, c.capacity_factor, w.dtype,
                              w.loss_chunk, w.scan_layers, compute)


@functools.lru_cache(maxsize=1024)
def _candidate_compute(recompute: str, modules: tuple[str, ...], param_dtype: str, capacity: float | None, dtype: str,
                       loss_chunk: int, scan_layers: bool, compute: Any) -> Any:

    base = compute or ComputeConfig(dtype=dtype, loss_chunk_size=loss_chunk, scan_layers=scan_layers)
    moe = dataclasses.replace(base.moe, capacity_factor=capacity,
                              backend="capacity" if capacity is not None and base.moe.backend == "auto"
                              else base.moe.backend)
    return base.replace(recompute=recompute, recompute_modules=modules if recompute == "selective"
                        else base.recompute_modules, param_dtype=param_dtype, moe=moe)


def knobs_of(c: Candidate, w: Workload, compute: Any = None) -> MemoryKnobs:
    """The memory knobs of a candidate (``compute``: a ComputeConfig whose other fields to keep)."""
    comp = candidate_compute(c, w, compute)
    frozen = {"vision_model"} if c.freeze_vision else set()
    return MemoryKnobs.from_compute(comp, state_dtype=c.state_dtype, frozen=frozen, grad_accum=c.grad_accum,
                                    accum_dtype=c.accum_dtype,
                                    platform=w.platform, loss_capacity=loss_capacity(w.trained_fraction, c.mbs, w.seq))


def candidate_geometry(c: Candidate, w: Workload) -> Geometry:
    return geometry(w.model, c.layout.rules, c.layout.resolved_mesh_shape(w.devices), mbs=c.mbs, seq=w.seq,
                    patches=w.patches, options=c.layout.options)


def estimate(c: Candidate, w: Workload, compute: Any = None) -> Estimate:
    """The analytic estimate of one candidate."""
    g = candidate_geometry(c, w)
    knobs = knobs_of(c, w, compute)
    mem = estimate_memory(w.model, g, knobs)
    comm = step_communication(w.model, g, knobs, w.devices_per_host)
    t = step_time(w.model, g, knobs, comm, hw=w.hw, image_patches=w.image_patches, fill=w.fill, devices=w.devices)
    tokens = w.global_batch * w.seq * w.fill / t.step_s
    return Estimate(c, mem, comm, t, w.limit_bytes, tokens)


def valid(c: Candidate, w: Workload, _cache: dict | None = None) -> str | None:
    """Why a candidate cannot run (the layout validator's first problem), or None. Its warnings (ETP while
    EP would fit, ...) are the recommendation's business here, not logged."""

    dp = data_parallel_size(c.layout.rules, c.layout.resolved_mesh_shape(w.devices))
    key = (c.layout.name, repr(c.layout.rules), repr(c.layout.options), c.mbs * dp, w.seq, w.devices, id(w.model))
    if _cache is not None and key in _cache:
        return _cache[key]
    logger = logging.getLogger("moevlm_jax.parallelism.validate")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        validate_layout(w.model, c.layout, batch_size=c.mbs * dp, seq_len=w.seq, num_devices=w.devices)
        why = None
    except (LayoutError, ValueError) as e:
        why = str(e).splitlines()[-1].strip()
    finally:
        logger.setLevel(level)
    if _cache is not None:
        _cache[key] = why
    return why


def enumerate_candidates(w: Workload, *, presets: Iterable[str] = PRESETS, pin: Mapping[str, int] | None = None,
                         pipeline: tuple[str, int] | None = None,
                         recompute: Sequence[tuple[str, tuple[str, ...]]] = RECOMPUTE,
                         dtypes: Sequence[tuple[str, str]] = DTYPES, freeze: Sequence[bool] = (False,),
                         capacity: Sequence[float | None] = (None,), max_mbs: int = 16,
                         accum_dtypes: Sequence[str] = ("float32", "bfloat16")) -> list[Candidate]:
    """Every (layout, setting) candidate for the workload that the layout validator accepts."""

    out, cache = [], {}
    for preset, layout in fitted_layouts(w.model, w.devices, w.hosts, presets=presets, pin=pin, pipeline=pipeline):
        dp = data_parallel_size(layout.rules, layout.resolved_mesh_shape(w.devices))
        for c in settings(layout, dp, w.global_batch, recompute=recompute, dtypes=dtypes, freeze=freeze,
                          capacity=capacity, max_mbs=max_mbs, preset=preset, accum_dtypes=accum_dtypes):
            if valid(c, w, cache) is None:
                out.append(c)
    return out


def fastest_first(e: Estimate) -> tuple:
    """Sort key: fastest first; of equal speed a float32 gradient sum first, then the least memory."""
    return -e.tokens_per_s, e.candidate.accum_dtype != "float32", e.memory.total


def rank(estimates: Iterable[Estimate]) -> list[Estimate]:
    """Fitting candidates first, fastest first (:func:`fastest_first`); then the rest by memory."""
    est = list(estimates)
    fit = sorted((e for e in est if e.fits), key=fastest_first)
    rest = sorted((e for e in est if not e.fits), key=lambda e: e.memory.total)
    return fit + rest


def plan(w: Workload, **kw: Any) -> list[Estimate]:
    """Every candidate's estimate, ranked (:func:`rank`)."""
    return rank(estimate(c, w) for c in enumerate_candidates(w, **kw))


__all__ = ["Candidate", "Estimate", "Workload", "enumerate_candidates", "estimate", "fastest_first", "fitted_layouts",
           "plan", "rank", "settings"]
