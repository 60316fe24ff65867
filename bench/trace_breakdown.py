"""Per-component time of the real training step, from a profiler trace (``bench --profile``).

``bench.breakdown`` times each component as its own program; this module instead attributes
the kernels of the *actual* step: every device event of a ``jax.profiler`` Perfetto trace
(``perfetto_trace.json.gz``, written with ``create_perfetto_trace=True``) names the HLO instruction
it ran (``args.hlo_op``, ``args.hlo_module``); the compiled step's HLO text maps each instruction to
its ``op_name`` metadata, i.e. the JAX name stack, which carries the model's named scopes
(``vision_encoder``, ``projector``, ``embed``, ``decoder_attention``, ``router``, ``experts`` with
``expert_ffn`` inside, ``lm_head``, ``optimizer``; Qwen3.5: ``decoder_gdn`` around a Gated DeltaNet
layer with ``gated_delta_rule`` around its chunked rule inside, ``shared_expert``). Backward and recomputed ops keep
the scope names (``transpose(jvp(decoder_attention))``), so each component's row is forward + backward.
Kernel time in no scope (residual adds, norms between blocks, casts, the loss gather) is "other";
step time not covered by any kernel is "device idle" (launch gaps, host waits): the rows add up to
the measured step by construction (an event whose ``hlo_op`` is unknown but whose ``tf_op`` / ``name``
argument is itself a name stack is attributed by that). Which events are device kernels: threads named ``Stream #...``
of ``/device:...`` processes (GPU); where there are none (XLA:CPU), the events with an ``hlo_op``.
Under command buffers (``capture`` step / scopes; XLA's default) kernels inside a CUDA graph carry the
graph's name as ``hlo_op`` or none: fusion kernels are still found by their kernel name (the fusion's
name with '.' -> '_'), library kernels (cuBLAS, Pallas) are counted "unmatched" / "unattributed":
profile with ``compute.capture=none`` (the bench applies it: no command buffers) to see them all.

CLI: ``python -m bench.trace_breakdown TRACE_DIR HLO.txt [HLO2.txt ...] --steps N``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

# (component, scope) in match order: the first scope found in an op's name stack wins
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("experts (matmuls + SwiGLU)", "expert_ffn"),
    ("permutation / dispatch", "experts"),
    ("router", "router"),
    ("decoder attention", "decoder_attention"),
    ("GDN delta rule (chunked)", "gated_delta_rule"),  # Qwen3.5: inside decoder_gdn, so before it
    ("GDN layer (projections, conv, gates, norm)", "decoder_gdn"),
    ("shared expert", "shared_expert"),
    ("projector / mergers", "projector"),
    ("vision encoder", "vision_encoder"),
    ("LM head + loss", "lm_head"),
    ("token embedding", "embed"),
    ("optimizer update", "optimizer"),
)
OTHER, UNATTRIBUTED, IDLE = "other (norms, residuals, casts, ...)", "unattributed (no hlo_op)", "device idle"
UNMATCHED = "unmatched (hlo_op not in the step's HLO)"
TOP = 25  # the largest kernels of the other / unmatched / unattributed rows, kept for diagnosis
TOP_PER_COMPONENT = 6  # the largest kernels of each row
# kernel kinds by kernel name, first match wins: what a row's time is made of
KINDS: tuple[tuple[str, str], ...] = (
    ("attention", r"cudnn|sdpa|fmha|flash|attention"),
    ("gemm", r"gemm|xmma|nvjet|cutlass|cublas|matmul|gmm|dot"),
    ("copy", r"memcpy|copy"),
    ("memset", r"memset"),
    ("collective", r"nccl|all_reduce|all_gather|all_to_all|reduce_scatter"),
    ("scatter / gather", r"scatter|gather"),
    ("reduction fusion", r"reduce"),
)


def kernel_kind(kernel: str) -> str:
    """A kernel's kind from its name (``KINDS``; else "elementwise / other")."""
    low = kernel.lower()
    return next((kind for kind, pattern in KINDS if re.search(pattern, low)), "elementwise / other")

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{([^}]*)\}", re.MULTILINE)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_MODULE = re.compile(r"^HloModule\s+([\w.\-]+)", re.MULTILINE)


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its ``op_name`` metadata (the JAX name stack), from an HLO module's text."""
    out = {}
    for m in _INSTR.finditer(hlo_text):
        name = _OP_NAME.search(m.group(2))
        if name:
            out[m.group(1)] = name.group(1)
    return out


def module_name(hlo_text: str) -> str | None:
    m = _MODULE.search(hlo_text)
    return m.group(1) if m else None


def component_of(op_name: str | None) -> str:
    """The component of an op by its name stack (``OTHER`` when in no known scope)."""
    if op_name:
        parts = set(re.split(r"[/()]", op_name))
        for component, scope in COMPONENTS:
            if scope in parts:
                return component
    return OTHER


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The events of a Perfetto/Chrome trace (``.json`` or ``.json.gz``, or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        found = sorted(path.rglob("perfetto_trace.json*")) or sorted(path.rglob("*.trace.json*"))
        if not found:
            raise FileNotFoundError(f"no perfetto_trace.json(.gz) under {path}: profile with create_perfetto_trace")
        path = found[-1]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def device_events(events: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The complete (``ph == "X"``) events of the device kernels (see the module docstring)."""
    procs = {e["pid"]: e["args"].get("name", "") for e in events if e.get("ph") == "M"
             and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"].get("name", "") for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    complete = [e for e in events if e.get("ph") == "X" and not str(e.get("name", "")).startswith("end: ")]
    streams = [e for e in complete if procs.get(e["pid"], "").startswith("/device:")
               and threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
    if streams:
        return streams
    return [e for e in complete if "hlo_op" in e.get("args", {})]


def attribute(events: Iterable[Mapping[str, Any]], hlo_texts: Iterable[str]) -> dict[str, Any]:
    """Kernel time per component (seconds, summed over the events) for the step's HLO modules."""
    names: dict[str, dict[str, str]] = {}
    for text in hlo_texts:
        names.setdefault(module_name(text) or "", {}).update(op_names(text))
    merged = {k: v for table in names.values() for k, v in table.items()}  # events without a module
    # kernels inside a command buffer carry the buffer's name as hlo_op ("command_buffer_763", not in the
    # HLO); a fusion's kernel is named after the fusion with '.' -> '_' ("input_reduce_fusion_75")
    by_kernel = {k.replace(".", "_"): v for k, v in merged.items()}
    seconds: dict[str, float] = collections.defaultdict(float)
    top: dict[tuple[str, str, str, str], float] = collections.defaultdict(float)
    per_kernel: dict[tuple[str, str], list] = {}  # (component, kernel) -> [seconds, an op_name]
    kinds: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    other_modules: dict[str, float] = collections.defaultdict(float)
    span = [float("inf"), 0.0]
    for e in events:
        args = e.get("args", {})
        dur = float(e.get("dur", 0.0)) * 1e-6  # trace times are microseconds
        module, op = args.get("hlo_module"), args.get("hlo_op")
        if module is not None and module not in names:
            other_modules[module] += dur  # another program (e.g. the data pipeline's), not the step
            continue
        span = [min(span[0], float(e["ts"]) * 1e-6), max(span[1], (float(e["ts"]) + float(e.get("dur", 0))) * 1e-6)]
        table = names.get(module, {}) if module is not None else merged
        stack = table.get(op) if op is not None else None
        if stack is None:  # some GPU traces carry the name stack itself (args "tf_op" / "name")
            stack = next((str(args[k]) for k in ("tf_op", "name") if "/" in str(args.get(k, ""))), None)
        if stack is None:
            stack = by_kernel.get(str(e.get("name", "")))
        if stack is None:
            component = UNATTRIBUTED if op is None else UNMATCHED
        else:
            component = component_of(stack)
        seconds[component] += dur
        kernel = str(e.get("name", ""))[:120]
        kinds[component][kernel_kind(kernel)] += dur
        slot = per_kernel.setdefault((component, kernel), [0.0, (stack or "")[-160:]])
        slot[0] += dur
        if component in (OTHER, UNMATCHED, UNATTRIBUTED):
            top[(component, str(e.get("name", ""))[:120], str(op), (stack or "")[-200:])] += dur
    largest = sorted(top.items(), key=lambda kv: -kv[1])[:TOP]
    by_component: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for (component, kernel), (dur, stack) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0]):
        if len(by_component[component]) < TOP_PER_COMPONENT:
            by_component[component].append({"kernel": kernel, "op_name": stack, "s": dur})
    return {"seconds": dict(seconds), "other_modules_s": dict(other_modules),
            "kinds_s": {c: dict(k) for c, k in kinds.items()}, "top_per_component_s": dict(by_component),
            "top_unscoped": [{"row": k[0], "kernel": k[1], "hlo_op": k[2], "op_name": k[3], "s": v}
                             for k, v in largest],
            "span_s": max(0.0, span[1] - span[0]) if span[1] else 0.0}


def idle_gaps(events: Iterable[Mapping[str, Any]], steps: int, min_us: float = 2.0, top: int = 10) -> dict[str, Any]:
    """Where the device waits: gaps of at least ``min_us`` between the kernels of all streams together
    (a kernel on one stream covers another's gap), grouped by the kernels on either side (name and
    hlo_op), per step. The largest gap of each step is usually the step boundary (dispatch of the next
    step, the loader); the others are in-step waits, e.g. a ``lax.cond``'s predicate read by the host.
    Returns ``gap_ms`` (per step, all gaps), ``count`` (per step), ``largest_ms`` (the ``steps``
    largest single gaps, i.e. ~one a step) and ``sites`` (the ``top`` groups by time)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), e) for e in events)
    label = lambda e: f"{str(e.get('name', ''))[:48]} [{e.get('args', {}).get('hlo_op')}]"  # noqa: E731
    sites: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    singles: list[float] = []
    end, last = None, None
    for start, stop, e in spans:
        if end is not None and start - end >= min_us:
            sites[(label(last), label(e))].append(start - end)
            singles.append(start - end)
        if end is None or stop > end:
            end, last = stop, e
    per = max(steps, 1)
    ranked = sorted(sites.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"gap_ms": sum(singles) * 1e-3 / per, "count": len(singles) / per,
            "largest_ms": [g * 1e-3 for g in sorted(singles, reverse=True)[:per]],
            "sites": [{"before": b, "after": a, "ms_per_step": sum(g) * 1e-3 / per, "count_per_step": len(g) / per,
                       "max_us": max(g)} for (b, a), g in ranked]}


def breakdown(trace: str | Path, hlo_texts: Sequence[str], steps: int, step_time_s: float | None = None
              ) -> dict[str, Any]:
    """Per-step ms per component from the trace of ``steps`` steps; ``device idle`` = step time
    (measured, or the traced span / steps) minus the kernel time."""
    events = device_events(load_trace(trace))
    got = attribute(events, hlo_texts)
    per_step = {k: 1e3 * v / steps for k, v in got["seconds"].items()}
    order = [c for c, _ in COMPONENTS] + [OTHER, UNMATCHED, UNATTRIBUTED]
    rows = {k: per_step[k] for k in order if k in per_step}
    busy = sum(rows.values())
    step_ms = 1e3 * (step_time_s if step_time_s is not None else got["span_s"] / steps)
    rows[IDLE] = step_ms - busy
    top = [dict(t, ms_per_step=1e3 * t.pop("s") / steps) for t in got["top_unscoped"]]
    kinds = {c: {k: 1e3 * v / steps for k, v in sorted(got["kinds_s"][c].items(), key=lambda kv: -kv[1])}
             for c in rows if c in got["kinds_s"]}
    top_per = {c: [dict(t, ms_per_step=1e3 * t.pop("s") / steps) for t in got["top_per_component_s"][c]]
               for c in rows if c in got["top_per_component_s"]}
    return {"per_step_ms": rows, "kernel_ms": busy, "step_ms": step_ms, "steps": steps, "top_unscoped": top,
            "kinds_ms": kinds, "top_per_component": top_per, "idle_gaps": idle_gaps(events, steps),
            "other_programs_ms": {k: 1e3 * v / steps for k, v in got["other_modules_s"].items()}}


def format_table(result: Mapping[str, Any]) -> str:
    rows = result["per_step_ms"]
    width = max(len(k) for k in rows) + 2
    step = result["step_ms"]
    lines = [f"{'component (from the profiler trace)':<{width}}{'ms/step':>10}{'share':>8}"]
    lines += [f"{k:<{width}}{v:>10.2f}{v / step:>8.1%}" for k, v in rows.items()]
    lines.append(f"{'step':<{width}}{step:>10.2f}{1:>8.0%}")
    if result.get("kinds_ms"):
        lines.append("kernel kinds per component (ms/step):")
        lines += [f"  {c[:34]:<34} " + ", ".join(f"{k} {v:.1f}" for k, v in kinds.items())
                  for c, kinds in result["kinds_ms"].items()]
    gaps = result.get("idle_gaps")
    if gaps and gaps["count"]:
        lines.append(f"device idle gaps: {gaps['gap_ms']:.2f} ms/step in {gaps['count']:.0f} gaps a step; largest "
                     + ", ".join(f"{g:.2f}" for g in gaps["largest_ms"][:4]) + " ms; by the kernels around them:")
        lines += [f"  {g['ms_per_step']:8.2f} ms/step {g['count_per_step']:6.1f}x  max {g['max_us']:8.1f} us  "
                  f"{g['before'][:60]} -> {g['after'][:60]}" for g in gaps["sites"][:8]]
    if result.get("top_unscoped"):
        lines.append("largest kernels outside the named scopes (ms/step, row, kernel, hlo_op, op_name tail):")
        lines += [f"  {t['ms_per_step']:8.2f}  {t['row'][:10]:<10} {t['kernel'][:40]:<40} {t['hlo_op'][:28]:<28} "
                  f"{t['op_name'][-90:]}" for t in result["top_unscoped"][:12]]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.trace_breakdown", description=__doc__.splitlines()[0])
    p.add_argument("trace", help="perfetto_trace.json(.gz) or a directory holding one")
    p.add_argument("hlo", nargs="+", help="the compiled step's HLO text file(s) (bench --profile writes them)")
    p.add_argument("--steps", type=int, required=True, help="steps the trace holds")
    p.add_argument("--step-ms", type=float, help="measured step time (default: the traced span / steps)")
    args = p.parse_args(argv)
    result = breakdown(args.trace, [Path(h).read_text() for h in args.hlo], args.steps,
                       None if args.step_ms is None else args.step_ms / 1e3)
    print(format_table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
