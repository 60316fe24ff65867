"""The planner's output: the ranked table, per-host memory / communication, the plot, the
recommendation in Megatron Bridge's performance guide's terms (``moevlm_jax.plan.search``)."""

from __future__ import annotations

import csv
import json
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moevlm_jax.plan.memory import GIB
from moevlm_jax.plan.time import sources

GB = 1e9
PART_COLUMNS = (("params", ("params",)), ("opt", ("optimizer",)), ("grads", ("gradients",)),
                ("act", ("activations", "saved_weights")),
                ("transient", ("lm_head", "embedding", "gathered_weights", "moe_dispatch", "attention", "batch",
                               "xla_temporaries")))


def _experts(c: Any) -> str:
    return "dropless" if c.capacity_factor is None else f"cap {c.capacity_factor:g}"


def _dtypes(c: Any) -> str:
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    accum = getattr(c, "accum_dtype", "float32")
    return f"{short[c.param_dtype]}/{short[c.state_dtype]}" + ("" if accum == "float32" else f" acc {short[accum]}")


def comm_summary(e: Any) -> str:
    """'fsdp 12.3 expert 4.5' GB per step per device by mesh-axis group."""
    return " ".join(f"{grp} {b / GB:.1f}" for grp, b in sorted(e.comm.by_axis().items(), key=lambda kv: -kv[1])
                    if b > 0.005 * GB) or "-"


def row(e: Any, i: int) -> dict[str, Any]:
    """One table row as plain values (CSV / JSON)."""
    c = e.candidate
    parts = {name: sum(e.memory.parts.get(k, 0.0) for k in keys) / GIB for name, keys in PART_COLUMNS}
    out = {"rank": i, "fits": e.fits, "layout": c.preset, "mesh": c.mesh_label(), "mbs": c.mbs,
           "grad_accum": c.grad_accum,
           "recompute": c.recompute_label(), "dtypes": _dtypes(c), "vision": "frozen" if c.freeze_vision else "trained",
           "experts": _experts(c), "step_s": e.time.step_s, "tokens_per_s": e.tokens_per_s,
           "memory_gib": e.memory.total / GIB, **{f"{k}_gib": v for k, v in parts.items()},
           "comm_gb": e.comm.total() / GB, "cross_host_gb": e.comm.total_cross() / GB, "comm_by_axis": comm_summary(e),
           "ep_cross_host_gb": e.comm.total_cross("ep") / GB,
           "ep_cross_host_hierarchical_gb": e.comm.ep_cross_hierarchical / GB,
           "overrides": " ".join(c.overrides())}
    if e.compiled:
        out["compiled_gib"] = e.compiled.get("total_bytes", float("nan")) / GIB if "total_bytes" in e.compiled else None
        out["compiled_platform"] = e.compiled.get("platform")
        out["analytic_same_backend_gib"] = (e.compiled.get("analytic_same_backend_bytes") or 0) / GIB or None
        out["compiled_error"] = e.compiled.get("error")
    return out


def format_table(estimates: Sequence[Any], top: int = 20) -> str:
    """The ranked table as text (the first ``top`` rows)."""
    head = ["#", "fits", "layout", "mesh", "mbs x ga", "recompute", "p/opt", "vision", "experts", "step ms",
            "tok/s", "GiB", "params", "opt", "grads", "act", "trans", "comm GB", "x-host GB", "by axis (GB)"]
    body = []
    compiled = any(e.compiled for e in estimates[:top])
    if compiled:
        head[12:12] = ["XLA GiB"]
    for i, e in enumerate(estimates[:top], 1):
        r = row(e, i)
        cells = [str(i), "yes" if r["fits"] else "NO", r["layout"], r["mesh"], f"{r['mbs']} x {r['grad_accum']}",
                 r["recompute"], r["dtypes"], r["vision"], r["experts"], f"{r['step_s'] * 1e3:.0f}",
                 f"{r['tokens_per_s']:,.0f}", f"{r['memory_gib']:.1f}"]
        if compiled:
            if e.compiled and e.compiled.get("total_bytes"):
                cells.append(f"{e.compiled['total_bytes'] / GIB:.1f}" + ("" if e.compiled.get("platform") == "gpu"
                                                                        else "*"))
            else:
                cells.append("err" if e.compiled else "-")
        cells += [f"{r[k + '_gib']:.1f}" for k, _ in PART_COLUMNS]
        cells += [f"{r['comm_gb']:.1f}", f"{r['cross_host_gb']:.1f}", r["comm_by_axis"]]
        body.append(cells)
    widths = [max(len(x) for x in col) for col in zip(head, *body)] if body else [len(h) for h in head]
    lines = ["  ".join(x.rjust(w) if j in (0, 9, 10, 11, 12) else x.ljust(w) for j, (x, w) in enumerate(zip(r, widths)))
             for r in [head] + body]
    return "\n".join(lines)


def per_host(e: Any, devices_per_host: int) -> dict[str, Any]:
    """One host's memory (devices x per-device) and its per-step communication, by mesh-axis group, in all
    and across hosts."""
    by_axis = e.comm.by_axis()
    cross: dict[str, float] = {}
    for groups in e.comm.cross.values():
        for grp, b in groups.items():
            cross[grp] = cross.get(grp, 0.0) + b
    keep = 0.05 * GB / devices_per_host  # groups moving less than 50 MB a host a step are left out
    return {"memory_gib": e.memory.total / GIB * devices_per_host,
            "memory_by_part_gib": {k: v / GIB * devices_per_host for k, v in e.memory.parts.items() if v},
            "comm_gb": {g: b / GB * devices_per_host for g, b in by_axis.items() if b >= keep},
            "cross_host_gb": {g: b / GB * devices_per_host for g, b in cross.items() if b >= keep},
            "crossing_axes": sorted(g for g, b in cross.items() if b >= keep)}


def ep_hierarchical_note(e: Any, devices_per_host: int) -> str:
    """'; EP across hosts: flat X GB, hierarchical Y GB' a host a step, where the EP group spans hosts."""
    flat, hier = e.comm.total_cross("ep"), e.comm.ep_cross_hierarchical
    if not hier:
        return ""
    return (f"; EP across hosts: flat {flat / GB * devices_per_host:.1f} GB, hierarchical "
            f"{hier / GB * devices_per_host:.1f} GB (compute.moe.dispatcher=hierarchical, exp over [fsdp, expert])")


def format_per_host(estimates: Sequence[Any], devices_per_host: int, *, one_per_preset: bool = True) -> str:
    """Per-host memory and communication for the best candidate of each preset (dropless experts and the
    vision tower trained where such a candidate fits)."""
    seen, lines = set(), []
    exact = [e for e in estimates if e.candidate.capacity_factor is None and not e.candidate.freeze_vision]
    fitting_presets = {e.candidate.preset for e in exact if e.fits}
    ordered = [e for e in exact if e.fits] + [e for e in estimates if e.candidate.preset not in fitting_presets]
    for e in ordered:
        key = e.candidate.preset if one_per_preset else id(e)
        if key in seen:
            continue
        seen.add(key)
        h = per_host(e, devices_per_host)
        c = e.candidate
        lines.append(f"- {c.preset} [{c.mesh_label()}], MBS {c.mbs} x {c.grad_accum}, {c.recompute_label()}, "
                     f"{_dtypes(c)}, {_experts(c)}{', vision frozen' if c.freeze_vision else ''}"
                     f"{'' if e.fits else ' (does not fit)'}: {h['memory_gib']:.0f} GiB a host "
                     f"({e.memory.total / GIB:.1f} a device), {e.tokens_per_s:,.0f} tokens/s; "
                     f"per step a host moves " + ", ".join(f"{g} {b:.1f} GB" for g, b in
                                                            sorted(h["comm_gb"].items(), key=lambda kv: -kv[1]))
                     + "; across hosts: " + (", ".join(f"{g} {b:.1f} GB" for g, b in
                                                      sorted(h["cross_host_gb"].items(), key=lambda kv: -kv[1]))
                                             or "nothing")
                     + ep_hierarchical_note(e, devices_per_host))
    return "\n".join(lines)


def _pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, tokens/s) points no other point beats on both (less memory and more tokens/s)."""
    out, best = [], -1.0
    for m, t in sorted(points):
        if t > best:
            out.append((m, t))
            best = t
    return out


def headline(estimates: Sequence[Any]) -> Any | None:
    """The recommendation's candidate: the fastest fitting one with dropless experts and the vision tower
    trained (the training unchanged), else the fastest fitting one."""
    fitting = [e for e in estimates if e.fits]
    exact = [e for e in fitting if e.candidate.capacity_factor is None and not e.candidate.freeze_vision]
    return (exact or fitting or [None])[0]


def plot(estimates: Sequence[Any], limit_gib: float, path: Path, title: str) -> None:
    """Estimated useful tokens/s against per-device memory: every candidate as a faint dot, each layout
    preset's Pareto front as a line, the memory limit as a vertical line, compiled totals (where made)
    as crosses, the recommended candidate circled."""

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 6))
    presets = sorted({e.candidate.preset for e in estimates})
    markers = "osD^v<>pPX*h"
    for i, preset in enumerate(presets):
        pts = [(e.memory.total / GIB, e.tokens_per_s) for e in estimates if e.candidate.preset == preset]
        line = ax.plot(*zip(*_pareto(pts)), marker=markers[i % len(markers)], ms=4, lw=1.2, label=preset)[0]
        ax.scatter(*zip(*pts), s=4, alpha=0.15, color=line.get_color())
    comp = [e for e in estimates if e.compiled and e.compiled.get("total_bytes")]
    if comp:
        ax.scatter([e.compiled["total_bytes"] / GIB for e in comp], [e.tokens_per_s for e in comp], marker="x",
                   color="black", s=40, label="XLA compiled memory")
    ax.axvline(limit_gib, color="red", linestyle="--", label=f"usable memory {limit_gib:.0f} GiB")
    best = headline(estimates)
    if best is not None:
        c = best.candidate
        ax.scatter([best.memory.total / GIB], [best.tokens_per_s], s=160, facecolors="none", edgecolors="black")
        ax.annotate(f"recommended: {c.preset} [{c.mesh_label()}] MBS {c.mbs} {c.recompute_label()}",
                    (best.memory.total / GIB, best.tokens_per_s), textcoords="offset points", xytext=(12, -16),
                    fontsize=8, ha="left")
    ax.set_xscale("log")
    ax.set_xlabel("per-device memory, GiB (analytic estimate; log scale)")
    ax.set_ylabel("estimated useful tokens/s (whole job)")
    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+.0f}%"


def recommendation(estimates: Sequence[Any], w: Any) -> str:
    """The plan's advice in the guide's terms, with the reason in words."""
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        least = min(estimates, key=lambda e: e.memory.total) if estimates else None
        tail = (f" The smallest candidate, {least.candidate.preset} [{least.candidate.mesh_label()}] MBS "
                f"{least.candidate.mbs} {least.candidate.recompute_label()} {_dtypes(least.candidate)}, needs "
                f"{least.memory.total / GIB:.1f} GiB a device against {w.limit_bytes / GIB:.1f} usable." if least
                else "")
        return ("Nothing fits: more devices (FSDP, EP and PP divide the parameters, gradients and optimizer state), "
                "a shorter sequence, or a smaller model." + tail)
    # the headline keeps the training the same: dropless experts, the vision tower trained (the table ranks all)
    exact = [e for e in fitting if e.candidate.capacity_factor is None and not e.candidate.freeze_vision]
    best = headline(estimates)
    c = best.candidate
    lines = [f"Fastest fitting: {c.preset} [{c.mesh_label()}], MBS {c.mbs} x grad_accum {c.grad_accum}, recompute "
             f"{c.recompute_label()}, {_dtypes(c)} parameters / AdamW state, {_experts(c)} experts: "
             f"~{best.time.step_s * 1e3:.0f} ms a step, {best.tokens_per_s:,.0f} useful tokens/s, "
             f"{best.memory.total / GIB:.1f} of {w.limit_bytes / GIB:.0f} GiB usable a device (estimates).",
             f"  overrides: {' '.join(c.overrides())}"]
    if best.memory.total > 0.95 * w.limit_bytes:
        lines.append("  (within 5% of the usable memory: confirm with --compile, or on the machine: XLA's compiled "
                     "memory analysis decides)")
    capped = next((e for e in fitting if e.candidate.capacity_factor is not None and not e.candidate.freeze_vision),
                  None)
    if capped is not None and capped.tokens_per_s > best.tokens_per_s:
        lines.append(f"- Drop-and-pad experts (capacity {capped.candidate.capacity_factor:g}; they drop assignments, "
                     "~10% on the proxy data: bench/results/sweep.md) would be "
                     f"{_pct(capped.tokens_per_s, best.tokens_per_s)}"
                     f": {capped.candidate.preset} [{capped.candidate.mesh_label()}] MBS {capped.candidate.mbs} "
                     f"{capped.candidate.recompute_label()}, {capped.memory.total / GIB:.1f} GiB.")
    fsdp = next((e for e in exact or fitting if e.candidate.preset == "fsdp"), None)
    if fsdp is not None:
        f = fsdp.candidate
        lines.append(f"- FSDP first (bring-up, memory-first tuning): {f.mesh_label()}, MBS {f.mbs}, "
                     f"{f.recompute_label()}, {_dtypes(f)} fits in {fsdp.memory.total / GIB:.1f} GiB at "
                     f"{fsdp.tokens_per_s:,.0f} tokens/s"
                     + (f" ({_pct(best.tokens_per_s, fsdp.tokens_per_s)} for the fastest layout once stable)."
                        if c.preset != "fsdp" else "; it is also the fastest here."))
    else:
        lines.append("- FSDP alone does not fit these devices: start from the fastest fitting layout above.")
    if c.preset != "fsdp":
        lines.append(f"- 3D once stable: {c.preset} moves {best.comm.total() / GB:.1f} GB a device a step "
                     f"({best.comm.total_cross() / GB:.1f} GB across hosts) against FSDP's "
                     + (f"{fsdp.comm.total() / GB:.1f} ({fsdp.comm.total_cross() / GB:.1f})" if fsdp else "n/a")
                     + "; validate its losses against FSDP's on the same batches first (tests/parallelism).")
    etp = next((e for e in fitting if e.candidate.preset == "ep_etp"), None)
    ep_fit = next((e for e in fitting if e.candidate.preset in ("ep", "tp_ep", "pp_ep")), None)
    if etp is not None and ep_fit is not None:
        lines.append(f"- ETP only when EP alone does not fit: EP fits ({ep_fit.candidate.preset} "
                     f"[{ep_fit.candidate.mesh_label()}], {ep_fit.memory.total / GIB:.1f} GiB), so keep whole experts "
                     f"(ETP adds a token gather + reduce-scatter a layer: {etp.tokens_per_s:,.0f} vs "
                     f"{ep_fit.tokens_per_s:,.0f} tokens/s).")
    elif etp is not None:
        lines.append("- EP alone does not fit: ETP (ep_etp) is needed here.")
    dph = w.devices_per_host
    if c.mesh.get("expert", 1) * c.mesh.get("tensor", 1) > dph:
        inside = next((e for e in fitting if e.candidate.mesh.get("expert", 1) > 1 and
                       e.candidate.mesh.get("expert", 1) * e.candidate.mesh.get("tensor", 1) <= dph), None)
        lines.append(f"- EP within the NVLink domain: this EP group spans hosts ({c.mesh.get('expert')} x tensor "
                     f"{c.mesh.get('tensor', 1)} > {dph} GPUs a host); its all-to-alls cross InfiniBand"
                     + (f"; the best EP within a host is {inside.candidate.preset} [{inside.candidate.mesh_label()}] "
                        f"at {inside.tokens_per_s:,.0f} tokens/s ({_pct(inside.tokens_per_s, best.tokens_per_s)})."
                        if inside else "; no EP layout within a host fits."))
    elif c.mesh.get("expert", 1) > 1:
        lines.append(f"- EP within the NVLink domain: expert {c.mesh['expert']} stays within a host of {dph} GPUs.")
    same = [e for e in fitting if e.candidate.layout.name == c.layout.name and not e.candidate.freeze_vision
            and e.candidate.capacity_factor == c.capacity_factor]
    near = sorted(same, key=lambda e: -e.tokens_per_s)[:4]
    if near:
        pts = "; ".join(f"MBS {e.candidate.mbs} {e.candidate.recompute_label()} {_dtypes(e.candidate)} "
                        f"{e.tokens_per_s:,.0f} tok/s {e.memory.total / GIB:.0f} GiB" for e in near)
        mbs = ",".join(str(m) for m in sorted({e.candidate.mbs for e in near}))
        rc = ",".join(sorted({e.candidate.recompute for e in near}))
        lines.append(f"- Sweep MBS x recompute x CUDA-graph scope together (the estimates do not model capture): "
                     f"nearest here {pts}. Measure: python -m bench.sweep --model "
                     f"{getattr(w.model, 'name', 'MODEL')} --layout {c.preset} --mbs {mbs} --recompute {rc} "
                     "--capture none,step,scopes")
    frozen = next((e for e in fitting if e.candidate.freeze_vision
                   and e.candidate.capacity_factor == c.capacity_factor),
                  None)
    if frozen is not None:
        f = frozen.candidate
        lines.append("- Freeze the vision stack for decoder-focused work (train.freeze_vision_model=true): no "
                     f"gradients, optimizer state or residuals for the tower; best frozen {f.preset} "
                     f"[{f.mesh_label()}] MBS {f.mbs} {f.recompute_label()}: {frozen.tokens_per_s:,.0f} tokens/s at "
                     f"{frozen.memory.total / GIB:.1f} GiB ({_pct(frozen.tokens_per_s, best.tokens_per_s)}; trained: "
                     f"{best.memory.total / GIB:.1f} GiB).")
    elif w.patches:
        lines.append("- Freeze the vision stack for decoder-focused work (train.freeze_vision_model=true): no "
                     "gradients, optimizer state or residuals for the tower (plan with --freeze-vision both to see "
                     "the gain).")
    return "\n".join(lines)


def write(estimates: Sequence[Any], w: Any, out: Path, *, title: str, top: int) -> dict[str, Path]:
    """results.json / results.csv / plan.png / plan.txt under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [row(e, i) for i, e in enumerate(estimates, 1)]
    (out / "results.json").write_text(json.dumps(rows, indent=1, default=str))
    with open(out / "results.csv", "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        wr.writeheader()
        wr.writerows(rows)
    plot(estimates, w.limit_bytes / GIB, out / "plan.png", title)

    text = "\n\n".join([title, format_table(estimates, top), recommendation(estimates, w),
                        "Per host (best of each layout):\n" + format_per_host(estimates, w.devices_per_host),
                        sources(w.hw)])
    (out / "plan.txt").write_text(text + "\n")
    return {"json": out / "results.json", "csv": out / "results.csv", "plot": out / "plan.png",
            "text": out / "plan.txt"}
