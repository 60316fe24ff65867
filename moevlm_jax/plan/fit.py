"""The planner's compiled checks and the train command's pre-flight API (``fit``): does a run fit its
devices by XLA's compiled memory analysis of its own train step, and if not, the fastest fitting change."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax

from moevlm_jax.parallelism.logical import data_parallel_size
from moevlm_jax.perf.memory import CompiledStep, compile_step, default_patches
from moevlm_jax.plan.memory import GIB, estimate_memory
from moevlm_jax.plan.report import format_table
from moevlm_jax.plan.search import (
    DTYPES,
    RECOMPUTE,
    TRAINED_FRACTION,
    Candidate,
    Estimate,
    Workload,
    candidate_compute,
    candidate_geometry,
    estimate,
    fastest_first,
    fitted_layouts,
    knobs_of,
    rank,
    settings,
    valid,
)
from moevlm_jax.plan.time import H200, Hardware, hardware_of
from moevlm_jax.training.compile_policy import CompilePolicy
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.objective import largest_capacity

log = logging.getLogger(__name__)


def compile_candidate(c: Candidate, w: Workload, devices: Sequence[Any] | None = None, *, compute: Any = None,
                      optimizer: Any = None, patches: int | None = None,
                      compiler_options: Mapping[str, Any] | None = None, hosts: Sequence[int] | None = None,
                      ahead: bool = False, dest: bool = False, steps: int = 1000) -> CompiledStep:
    """The candidate's train step compiled (never run) on ``devices`` (default: all; their count must be the
    workload's; ``hosts``: each device's host, for a mesh hybrid over hosts as a multi-host run builds it):
    ``.report`` holds XLA's memory analysis (``memory_report``) and the analytic estimate for the same
    backend, ``.compiled`` the executable. ``ahead``: the loss capacity a run compiling ahead reserves
    (``train.compile: ahead``: the largest short of whole rows) in place of the planner's expected one, and
    ``dest`` its batches' ``patch_dest``, ``steps`` its length (the schedule's): the check then compiles the very
    program the run compiles next (with ``train.compilation_cache_dir``, the run loads it: one compile of the
    step, not two)."""
    devices = list(devices if devices is not None else jax.devices())[: w.devices]
    if len(devices) < w.devices:
        raise ValueError(f"{w.devices} devices needed for the compiled check, {len(devices)} present "
                         "(CPU: --host-devices / XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    knobs = knobs_of(c, w, compute)
    platform = devices[0].platform
    comp = candidate_compute(c, w, compute)
    opt = dataclasses.replace(optimizer or OptimizerConfig(), state_dtype=c.state_dtype, grad_accum_dtype=c.accum_dtype)
    mesh = c.layout.make_mesh(devices, list(hosts)[: w.devices]) if hosts is not None else None
    step = compile_step(w.model, c.layout, comp, mbs=c.mbs, seq_len=w.seq, patches=w.patches if patches is None
                        else patches, grad_accum=c.grad_accum, devices=devices, mesh=mesh, optimizer=opt,
                        capacity=largest_capacity(c.mbs * w.seq) if ahead else knobs.loss_capacity,
                        frozen=("vision_model",) if c.freeze_vision else (), compiler_options=compiler_options,
                        dest=dest, steps=steps)
    same = dataclasses.replace(w, platform="gpu" if platform == "gpu" else "cpu")
    g = candidate_geometry(c, same)
    step.report["analytic_same_backend_bytes"] = estimate_memory(same.model, g, knobs_of(c, same, compute)).total
    step.report["platform"] = platform
    return step


def compiled_memory(c: Candidate, w: Workload, devices: Sequence[Any] | None = None, *, compute: Any = None,
                    optimizer: Any = None, patches: int | None = None,
                    compiler_options: Mapping[str, Any] | None = None, ahead: bool = False,
                    dest: bool = False, steps: int = 1000, hosts: Sequence[int] | None = None) -> dict[str, Any]:
    """XLA's compiled memory analysis of the candidate's train step (``memory_report``) on ``devices``
    (default: all; their count must be the workload's), plus the analytic estimate for the same backend
    (``ahead`` / ``dest`` / ``steps``: :func:`compile_candidate`'s)."""
    return compile_candidate(c, w, devices, compute=compute, optimizer=optimizer, patches=patches,
                             compiler_options=compiler_options, ahead=ahead, dest=dest, steps=steps,
                             hosts=hosts).report


def check_compiled(estimates: Sequence[Estimate], w: Workload, top: int, devices: Sequence[Any] | None = None,
                   compiler_options: Mapping[str, Any] | None = None, hosts: Sequence[int] | None = None) -> None:
    """Attach the compiled memory analysis to the first ``top`` estimates (in place; errors recorded;
    ``hosts``: each device's host, for meshes hybrid over hosts)."""
    for e in estimates[:top]:
        try:
            e.compiled = compiled_memory(e.candidate, w, devices, compiler_options=compiler_options, hosts=hosts)
        except Exception as err:  # noqa: BLE001 - a candidate that does not compile is reported, not fatal
            e.compiled = {"error": f"{type(err).__name__}: {err}"[:300]}


# ----------------------------------------------------------------------------- the train command's API


@dataclasses.dataclass
class Plan:
    """The answer of :func:`fit`: does the run fit, and if not the fastest fitting change and why."""

    fits: bool
    current: Estimate
    change: list[str]  # key=value overrides (empty when the run fits or nothing fits)
    reason: str
    table: list[Estimate]  # ranked alternatives (the whole table when nothing fits)
    compiled_bytes: float | None = None  # XLA's total for the run as configured
    limit_bytes: float = 0.0

    def summary(self, top: int = 8) -> str:
        """The reason, and the ranked alternatives when nothing fits (what the train command prints)."""

        text = self.reason + (f"\noverrides: {' '.join(self.change)}" if self.change else "")
        if not self.fits and not self.change and self.table:
            text += "\n" + format_table(self.table, top)
        return text


MAX_CHECKS = 2  # compiled checks of alternatives a fit makes (the first two at once: _concurrent_checks)
CALIBRATED_SLACK = 1.05  # after a check: skip a candidate over the limit by more than this, scaled by XLA / estimate


def device_memory_bytes(devices: Sequence[Any]) -> float | None:
    """The allocator's limit of the first device (``memory_stats()['bytes_limit']``), None where unknown."""
    try:
        stats = devices[0].memory_stats()
    except Exception:  # noqa: BLE001 - CPU backends raise or return None
        stats = None
    if stats and stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    return None


def workload_of(cfg: Any, devices: int, *, hosts: int = 1, device_memory_gib: float | None = None,
                platform: str = "gpu", trained_fraction: float | None = TRAINED_FRACTION,
                hw: Hardware = H200) -> Workload:
    """The workload of a RunConfig on ``devices`` devices of kind ``hw``."""
    buckets = tuple(getattr(cfg.data, "patch_buckets", ()) or ())

    patches = max(buckets) if buckets else default_patches(cfg.train.seq_len)
    image = getattr(cfg.data, "image", None)
    image_patches = 784
    if image is not None and getattr(image, "max_pixels", None):
        image_patches = max(4, int(image.max_pixels) // (image.patch_size**2))
    return Workload(model=cfg.model, devices=devices, hosts=hosts, seq=cfg.train.seq_len,
                    global_batch=cfg.global_batch_size, patches=patches, image_patches=image_patches,
                    device_memory_gib=device_memory_gib or hw.memory_gib, platform=platform, hw=hw,
                    trained_fraction=trained_fraction, dtype=cfg.compute.dtype, loss_chunk=cfg.compute.loss_chunk_size,
                    scan_layers=cfg.compute.scan_layers)


def candidate_of(cfg: Any, devices: int) -> Candidate:
    """The run as configured, as a candidate."""
    mesh = cfg.layout.resolved_mesh_shape(devices)
    layout = dataclasses.replace(cfg.layout, mesh={a: n for a, n in mesh.items() if n > 1 or a in cfg.layout.mesh}
                                 or {"fsdp": 1})
    return Candidate(layout, cfg.layout.name, cfg.train.micro_batch_size, cfg.train.grad_accum, cfg.compute.recompute,
                     tuple(cfg.compute.recompute_modules), cfg.compute.param_dtype, cfg.optimizer.state_dtype,
                     cfg.train.freeze_vision_model, cfg.compute.moe.capacity_factor, cfg.optimizer.grad_accum_dtype)


def fit(cfg: Any, devices: Sequence[Any] | None = None, *, device_memory_gib: float | None = None,
        compile: bool | tuple[float, float] = True,
        allow: Iterable[str] = ("mbs", "recompute", "layout"), top: int = 3, hosts: int = 1,
        compiler_options: Mapping[str, Any] | None = None) -> Plan:
    """Does the resolved recipe ``cfg`` (a RunConfig: ``moevlm_jax.config.load_config``) fit on ``devices``
    (default ``jax.devices()``)? Decided by XLA's compiled memory analysis of the run's own train step
    (``compile``; else the analytic estimate) against the devices' memory (``bytes_limit``; on CPU or
    where unknown ``device_memory_gib``, default 141). If not: the fastest fitting change among those
    ``allow`` names (``mbs``: MBS with the gradient accumulation that keeps the global batch;
    ``recompute``; ``dtypes``: bf16 parameters / AdamW state / gradient sum; ``layout``: other presets on these devices;
    ``freeze``: frozen vision tower; ``capacity``: drop-and-pad experts), confirmed by a compile when
    ``compile``, as ``key=value`` overrides with the reason; the ranked table when nothing fits.
    ``compile=(lo, hi)``: compile only where the estimate leaves the answer in doubt, between ``lo`` and
    ``hi`` times the usable memory (a candidate below ``lo`` is taken as fitting, one above ``hi`` as not)."""

    devices = list(devices if devices is not None else jax.devices())
    platform = "gpu" if devices[0].platform == "gpu" else "cpu"
    limit_dev = device_memory_bytes(devices)
    hw = hardware_of(devices[0].device_kind) if platform == "gpu" else H200
    w = workload_of(cfg, len(devices), hosts=hosts, device_memory_gib=device_memory_gib, platform=platform, hw=hw)
    if limit_dev is not None:  # the allocator's own limit is what a step may use
        w = dataclasses.replace(w, device_memory_gib=limit_dev / GIB / w.hw.usable_fraction)
    allow = set(allow)
    compute = cfg.compute
    # a run that compiles its step ahead (train.compile: ahead) compiles it at its reserved patch bucket and loss
    # capacity: the compiled checks take the same shapes, so that the run's compile is the check's program
    policy = CompilePolicy.from_config(cfg, evaluates=False)
    shapes = dict(patches=policy.bucket, ahead=True, dest=policy.balance_vision_rows) if policy.ahead else {}
    shapes["steps"] = cfg.train.steps
    current = estimate(candidate_of(cfg, len(devices)), w, compute)
    band = compile if isinstance(compile, tuple) else ((0.0, float("inf")) if compile else None)

    def in_doubt(e: Estimate) -> bool:
        return band is not None and band[0] <= e.memory.total / w.limit_bytes <= band[1]

    def check(e: Estimate) -> dict[str, Any]:
        return compiled_memory(e.candidate, w, devices, compute=compute, optimizer=cfg.optimizer,
                               compiler_options=compiler_options, **shapes)

    compiled_total = None
    if in_doubt(current):
        try:
            current.compiled = check(current)
            compiled_total = float(current.compiled["total_bytes"])
        except Exception as err:  # noqa: BLE001 - fall back to the estimate, say so
            current.compiled = {"error": f"{type(err).__name__}: {err}"[:300]}
            log.warning("plan: the compiled check failed (%s); using the analytic estimate", current.compiled["error"])
    if current.fits:
        used = compiled_total if compiled_total is not None else current.memory.total
        return Plan(True, current, [], f"fits: {used / GIB:.1f} of {w.limit_bytes / GIB:.1f} GiB usable "
                                       f"({'compiled' if compiled_total is not None else 'estimated'})",
                    [current], compiled_total, w.limit_bytes)
    base = current.candidate
    options = _alternatives(base, w, allow)
    ranked = rank(estimate(c, w, compute) for c in options)
    # with a band (auto-fit): the fastest first among those whose estimate fits or leaves it in doubt (the memory
    # model errs on the high side: a setting estimated a little over the limit may compile within it), at most
    # MAX_CHECKS compiled checks, after which only sure fits (estimate below the band) are taken; compile=True
    # checks every fitting candidate it meets
    banded = band is not None and math.isfinite(band[1])
    pool = [e for e in ranked if e.fits or (banded and in_doubt(e))]
    pool.sort(key=fastest_first)
    # the first checks compiled at once (XLA's compiles run beside each other; a check is about a minute of a
    # proxy-sized step on one GPU): the fastest in doubt and, when its estimate is over the limit, the fastest in
    # doubt estimated within it, the likelier fit
    early = _concurrent_checks(pool, in_doubt, w.limit_bytes) if banded else {}
    if early:
        with concurrent.futures.ThreadPoolExecutor(len(early), thread_name_prefix="fit-check") as ex:
            early = {k: ex.submit(check, e) for k, e in early.items()}
    checks = len(early)
    # XLA's total / the estimate, from the last compiled check of this run: a candidate whose estimate scaled by it
    # is still over the limit (CALIBRATED_SLACK) is not worth a check
    ratio = compiled_total / current.memory.total if compiled_total else None
    used = compiled_total if compiled_total is not None else current.memory.total
    why = (f"does not fit: {used / GIB:.1f} GiB {'compiled' if compiled_total is not None else 'estimated'} "
           f"> {w.limit_bytes / GIB:.1f} GiB usable; largest parts (estimate): "
           + ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(current.memory.parts.items(),
                                                               key=lambda kv: -kv[1])[:3]))
    for e in pool if banded else pool[: max(top, 1) * 4]:
        if in_doubt(e):
            hopeless = ratio is not None and e.memory.total * ratio > w.limit_bytes * CALIBRATED_SLACK
            if id(e) not in early and banded and (checks == MAX_CHECKS or hopeless):
                continue
            try:
                if id(e) in early:
                    e.compiled = early[id(e)].result()
                else:
                    checks += 1
                    e.compiled = check(e)
            except Exception as err:  # noqa: BLE001
                e.compiled = {"error": f"{type(err).__name__}: {err}"[:300]}
                continue
            ratio = e.compiled["total_bytes"] / e.memory.total
            if not e.fits:
                continue
        change = e.candidate.overrides(cfg, len(devices))
        total = e.compiled["total_bytes"] if e.compiled and "total_bytes" in e.compiled else e.memory.total
        reason = (f"{why}. Fastest fitting change: {' '.join(change)}: {total / GIB:.1f} GiB "
                  f"({'compiled' if e.compiled and 'total_bytes' in e.compiled else 'estimated'}), "
                  f"~{e.time.step_s * 1e3:.0f} ms a step, {e.tokens_per_s:,.0f} useful tokens/s (estimated)")
        return Plan(False, current, change, reason, ranked, compiled_total, w.limit_bytes)
    return Plan(False, current, [], f"{why}. Nothing among {len(ranked)} alternatives ({', '.join(sorted(allow))}) "
                                    "fits these devices: more devices, a shorter sequence or a smaller model",
                ranked, compiled_total, w.limit_bytes)


def _concurrent_checks(pool: Sequence[Estimate], in_doubt: Any, limit: float) -> dict[int, Estimate]:
    """The checks :func:`fit` compiles at once, by ``id``, from its pool (fastest first; a sure fit ends it, as
    the checks past it are never reached): the first candidate in doubt and, when its estimate is over ``limit``,
    the first in doubt estimated within it (the memory model errs on the high side, so the likelier fit). At most
    ``MAX_CHECKS``."""
    picks: list[Estimate] = []
    for e in pool:
        if not in_doubt(e):
            break  # a sure fit: the answer, whatever the checks after it would say
        if not picks or (picks[0].memory.total > limit >= e.memory.total):
            picks.append(e)
        if len(picks) == min(MAX_CHECKS, 2):
            break
    return {id(e): e for e in picks}


def _alternatives(base: Candidate, w: Workload, allow: set[str]) -> list[Candidate]:

    def same(layout: Any) -> tuple:  # what a layout does, whatever its name
        mesh = {a: n for a, n in layout.resolved_mesh_shape(w.devices).items() if n > 1}
        return repr(layout.rules), sorted(mesh.items()), repr(layout.options)

    layouts = [(base.preset, base.layout)]
    if "layout" in allow:  # the other presets fitted to these devices, less those that are the run's layout again
        layouts += [lp for lp in fitted_layouts(w.model, w.devices, w.hosts) if same(lp[1]) != same(base.layout)]
    recompute = RECOMPUTE if "recompute" in allow else ((base.recompute, base.recompute_modules),)
    dtypes = DTYPES if "dtypes" in allow else ((base.param_dtype, base.state_dtype),)
    freeze = (base.freeze_vision, True) if "freeze" in allow else (base.freeze_vision,)
    capacity = (base.capacity_factor, 1.25) if "capacity" in allow else (base.capacity_factor,)
    out, cache = [], {}
    for preset, layout in layouts:
        dp = data_parallel_size(layout.rules, layout.resolved_mesh_shape(w.devices))
        cands = settings(layout, dp, w.global_batch, recompute=recompute, dtypes=dtypes, freeze=freeze,
                         capacity=capacity, preset=preset,
                         accum_dtypes=("float32", "bfloat16") if "dtypes" in allow else (base.accum_dtype,))
        if "mbs" not in allow:
            cands = [c for c in cands if c.mbs == base.mbs]
        out += [c for c in cands if c != base and valid(c, w, cache) is None]
    return out
