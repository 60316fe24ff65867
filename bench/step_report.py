"""The text report of ``python -m bench.step`` (one line per run and side, ratios, loss
checks, breakdowns) and its one-line progress summaries."""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.breakdown import format_breakdown

LOSS_RTOL = {"float32": 1e-3, "bfloat16": 3e-2}  # ours vs HF cross-entropy, relative


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def ok(r: dict[str, Any]) -> bool:
    """A run that produced figures (not one recorded as out of memory or failed)."""
    return r.get("status", "ok") == "ok"


def steady_rate(timed: list[dict[str, Any]], n_dev: int, peak: float | None) -> dict[str, Any] | None:
    """Useful tokens/s and MFU over the timed steps that were not a compiled shape's first run (None
    when there were no first runs, or only first runs); with the first runs' count and mean time."""
    firsts = [s["time"] for s in timed if s["first_run"]]
    steady = [s for s in timed if not s["first_run"]]
    if not firsts or not steady:
        return None
    sec = sum(s["time"] for s in steady)
    return {"steps": len(steady), "tokens_per_s": sum(s["useful_tokens"] for s in steady) / sec,
            "mfu": sum(s["flops"] for s in steady) / sec / n_dev / peak if peak else None,
            "first_runs": len(firsts), "first_run_s": sum(firsts) / len(firsts)}


def _steady(r: dict[str, Any]) -> str:
    """The ours/HF ratio without each side's compiling / first-run steps, where it differs."""
    v = r["vs_hf"]
    if v.get("steady_ratio") is None or abs(v["steady_ratio"] - v["tokens_per_s_ratio"]) < 5e-4:
        return ""
    return f" ({v['steady_ratio']:.3f} without steps that compiled or ran a shape first)"


def summary_line(r: dict[str, Any]) -> str:
    """One line per finished run (logged as runs complete, so a killed invocation keeps them)."""
    if not ok(r):
        return f"{r.get('side', 'ours')} {r['name']}: {r['status']}: {r.get('message', '')[:300]}"
    mfu = None if r.get("mfu") is None else 100 * r["mfu"]
    gib = None if r.get("peak_bytes") is None else r["peak_bytes"] / 2**30
    return (f"{r.get('side', 'ours')} {r['name']}: {r['step_time_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:,.0f} "
            f"useful tokens/s, {r['tflops_per_device']:.1f} TFLOP/s/dev, MFU {_fmt(mfu, '.1f')}%, peak "
            f"{_fmt(gib, '.1f')} GiB, compile {_fmt(r.get('compile_s'), '.0f')} s")


def format_report(result: dict[str, Any]) -> str:
    """The table: one line per run and side, then ratios, loss checks and breakdowns."""

    dev = result["device"]
    header = (f"{'side':<11} {'run':<14} {'rows x seq':>10} {'step ms':>9} {'input ms':>8} {'useful tok/s':>12} "
              f"{'trained tok/s':>13} {'TFLOP/s/dev':>11} {'MFU':>6} {'peak GiB':>8} {'compile s':>9}")
    where = f"{result['date']} on {dev['count']} x {dev['kind']} ({dev['platform']})"
    lines = [result["command"], f"{where}; recipe {result['recipe']}, model {result['model']}",
             "useful tokens = segment_ids > 0 (padding excluded); trained = loss_mask > 0; step = loader wait + step",
             header]

    def row(side: str, r: dict[str, Any], base: dict[str, Any]) -> str:
        if not ok(r):
            return f"{side:<11} {r['name']:<14} {r['status']}: {r.get('message', '')[:120]}"
        gib = None if r.get("peak_bytes") is None else r["peak_bytes"] / 2**30
        mfu = None if r.get("mfu") is None else 100 * r["mfu"]
        return (f"{side:<11} {r['name']:<14} {base['rows']:>5} x{base['seq_len']:>4} {r['step_time_s'] * 1e3:>9.1f} "
                f"{_fmt(r.get('input_wait_s') and r['input_wait_s'] * 1e3, '.1f'):>8} {r['tokens_per_s']:>12,.0f} "
                f"{r['trained_tokens_per_s']:>13,.0f} {r['tflops_per_device']:>11.3f} {_fmt(mfu, '.1f'):>6} "
                f"{_fmt(gib, '.2f'):>8} {_fmt(r.get('compile_s'), '.1f'):>9}")

    peer = result.get("peer", {}).get("runs", [])
    for r in result["runs"]:
        lines.append(row("ours", r, r))
        lines += [row(p["side"], p, r) for p in peer if p["name"] == r["name"]]
    runs = [r for r in result["runs"] if ok(r)]
    peer_ok = [p for p in peer if ok(p)]
    for r in runs:
        if r["mock"]:
            for real in (x for x in runs if not x["mock"] and x["mbs"] == r["mbs"]):
                lines.append(f"real/mock ({real['name']} / {r['name']}): useful tokens/s ratio "
                             f"{real['tokens_per_s'] / r['tokens_per_s']:.3f}")
    for r in result["runs"]:
        if "vs_hf" in r and r["vs_hf"]["loss"] is None:
            lines.append(f"ours/HF ({r['name']}, HF best {r['vs_hf']['hf_best']}): useful tokens/s ratio "
                         f"{r['vs_hf']['tokens_per_s_ratio']:.3f}{_steady(r)}; no HF eager run to check the losses "
                         "against")
        elif "vs_hf" in r:
            v, loss = r["vs_hf"], r["vs_hf"]["loss"]
            lines.append(f"ours/HF ({r['name']}, HF best {v['hf_best']}): useful tokens/s ratio "
                         f"{v['tokens_per_s_ratio']:.3f}{_steady(r)}; cross-entropy step 1 ours {loss['ours'][0]:.6f} "
                         f"vs HF {loss['hf'][0]:.6f} (rel {loss['first_rel_diff']:.1e}, all {len(loss['ours'])} steps "
                         f"max rel {loss['max_rel_diff']:.1e}, rtol {loss['rtol']:.0e}: "
                         f"{'agree' if loss['first_step_agrees'] else 'DISAGREE'})")
        if (r.get("skipped_per_step") or [0])[-1]:
            lines.append(f"WARNING: {r['name']}: {r['skipped_per_step'][-1]} of {len(r['skipped_per_step'])} optimizer "
                         "updates skipped for non-finite gradients: this run did not train")
        if r.get("timed_compiles"):
            lines.append(f"warning: {r['name']}: {r['timed_compiles']} compiles inside timed steps")
    for label in dict.fromkeys(r["data"] for r in runs):  # each side at its best MBS
        ours = [r for r in runs if r["data"] == label]
        hf = [p for p in peer_ok if p["name"] in {r["name"] for r in result["runs"] if r["data"] == label}]
        if len(ours) > 1 and hf:
            a, b = max(ours, key=lambda r: r["tokens_per_s"]), max(hf, key=lambda p: p["tokens_per_s"])
            lines.append(f"best MBS, {label}: ours {a['tokens_per_s']:,.0f} useful tokens/s ({a['name']}) vs HF "
                         f"{b['tokens_per_s']:,.0f} ({b['side']} {b['name']}): ratio "
                         f"{a['tokens_per_s'] / b['tokens_per_s']:.3f}")
    for r in runs:
        if "breakdown" in r:
            lines += ["", f"breakdown of one step ({r['name']}):", format_breakdown(r["breakdown"])]
    if result.get("peer"):
        lines.append("HF peer: " + ", ".join(f"{k} {v}" for k, v in result["peer"]["info"].items()))
    return "\n".join(lines)


def compare_losses(ours: dict[str, Any], hf: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Cross-entropy (and the objective: + router aux loss) step by step, ours vs the HF eager run on
    the same batches from the same initial weights."""
    a, b = np.asarray(ours["ce_loss_per_step"]), np.asarray([s["ce"] for s in hf["losses"]])
    ta, tb = np.asarray(ours["loss_per_step"]), np.asarray([s["loss"] for s in hf["losses"]])
    rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-12)
    rel_total = np.abs(ta - tb) / np.maximum(np.abs(tb), 1e-12)
    tol = LOSS_RTOL[dtype]
    return {"ours": a.tolist(), "hf": b.tolist(), "ours_objective": ta.tolist(), "hf_objective": tb.tolist(),
            "first_rel_diff": float(rel[0]), "max_rel_diff": float(rel.max()),
            "max_rel_diff_objective": float(rel_total.max()), "rtol": tol,
            "first_step_agrees": bool(rel[0] <= tol), "all_steps_agree": bool(np.all(rel <= tol))}
