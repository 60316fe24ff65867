"""Sweep MBS x recompute x capture x layout on this machine: ``python -m bench.sweep``.

    python -m bench.sweep --model proxy --layout fsdp,tp_ep --mbs 1,2,4 \\
        --recompute none,selective,full --capture none,step,scopes --steps 10 --out bench/sweep

Megatron Bridge's point: the setting that makes a model fit is often not the one that runs
fastest, so measure them together. Each point runs in its own process (``bench.sweep_point``):
the capture's XLA flags must be set before the backend starts, and an out-of-memory or a compile
failure then costs only that point. A point compiles the train step, warms up, times ``--steps``
steady-state steps on real data (the built-in ``proxy`` set for the proxy model, else ``vqa``;
mock data only with ``--data mock``) and records useful tokens/s (non-padding tokens), trained
tokens/s, MFU (model FLOPs of ``moevlm_jax.perf.flops`` over the device's peak; none on CPU), peak
memory (the device's ``peak_bytes_in_use``, else XLA's compiled memory analysis), compile time and
status (ok / oom / error with the message). Output in ``--out``: ``results.csv``,
``results.json``, ``throughput_vs_memory.png``, ``logs/`` (each point's output) and ``points/``
(each point's spec and result); a table at the end.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from moevlm_jax.perf.memory import format_bytes
from moevlm_jax.schema import overrides_tree
from moevlm_jax.tools.memory import split_list

POINT_KEYS = ("layout", "mbs", "recompute", "capture")
CSV_COLUMNS = ("layout", "mbs", "recompute", "capture", "status", "tokens_per_s", "trained_tokens_per_s",
               "tokens_per_s_per_device", "step_time_s", "mfu", "model_tflops_per_device", "peak_bytes",
               "peak_source", "compile_s", "compiles", "loss", "mem_temp_bytes", "mem_argument_bytes",
               "mem_output_bytes", "mem_alias_bytes", "mem_host_temp_bytes", "mem_total_bytes", "seq_len", "rows",
               "devices", "device_kind", "data_source", "mock_data", "capture_flags", "wall_s", "message")


def grid(layouts: Sequence[str], mbs: Sequence[int], recompute: Sequence[str], capture: Sequence[str]
         ) -> list[dict[str, Any]]:
    """Every (layout, mbs, recompute, capture) point, layout outermost, capture innermost (so each
    capture choice is measured next to ``none`` in the same run)."""
    return [dict(zip(POINT_KEYS, p)) for p in itertools.product(layouts, mbs, recompute, capture)]


def point_name(point: Mapping[str, Any]) -> str:
    """A short label: ``fsdp mbs2 selective step``."""
    return f"{point['layout']} mbs{point['mbs']} {point['recompute']} {point['capture']}"


def _last_line(path: Path) -> str:
    lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def run_point_process(spec: Mapping[str, Any], out: Path, index: int, timeout: float, echo: Any = None,
                      poll_s: float = 30.0) -> dict[str, Any]:
    """Run one point in a child process (spec and result files in ``out/points``, its output in
    ``out/logs``; every ``poll_s`` its latest log line goes to ``echo``); a crash, a kill or a
    timeout becomes an error / oom result."""
    name = f"{index:03d}_{point_name(spec).replace(' ', '_')}"
    spec_path, result_path = out / "points" / f"{name}.spec.json", out / "points" / f"{name}.result.json"
    log_path = out / "logs" / f"{name}.log"
    for d in (spec_path.parent, log_path.parent):
        d.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=1))
    result_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    root = str(Path(__file__).resolve().parents[1])  # the child imports this checkout's packages
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with open(log_path, "w") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "bench.sweep_point", str(spec_path), str(result_path)],
                                stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        rc, shown = None, ""
        while rc is None:
            left = timeout - (time.perf_counter() - t0)
            if left <= 0:
                os.killpg(proc.pid, signal.SIGKILL)  # the child's own process group (its data workers too)
                proc.wait()
                return {"status": "error", "message": f"timed out after {timeout:.0f}s",
                        "wall_s": time.perf_counter() - t0, "log": str(log_path)}
            try:
                rc = proc.wait(timeout=min(poll_s, left))
            except subprocess.TimeoutExpired:
                line = _last_line(log_path)
                if echo is not None and line and line != shown:
                    echo(f"      {time.perf_counter() - t0:.0f}s: {line}")
                    shown = line
    if result_path.exists():
        result = json.loads(result_path.read_text())
    else:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
        if rc < 0 and -rc == signal.SIGKILL:
            status, why = "oom", "killed by SIGKILL (likely out of host memory)"
        else:
            status, why = "error", f"process exited with code {rc}"
        result = {"status": status, "message": f"{why}: {' | '.join(tail)}"[:2000], "wall_s": time.perf_counter() - t0}
    result["log"] = str(log_path)
    return result


def run_sweep(points: Sequence[Mapping[str, Any]], common: Mapping[str, Any], out: Path, *, timeout: float = 3600,
              echo: Any = print) -> list[dict[str, Any]]:
    """Run every point (``common`` holds the shared spec: model, data, steps, ...); write results as
    they come (``results.json`` / ``results.csv``), then the plot. Returns the result rows."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for i, point in enumerate(points, 1):
        echo(f"[{i}/{len(points)}] {point_name(point)} ...")
        result = run_point_process({**common, **point}, out, i, timeout, echo)
        row = {**point, **result}
        rows.append(row)
        echo(f"[{i}/{len(points)}] {point_name(point)}: {summary_line(row)} "
             f"({row.get('wall_s', 0):.0f}s; elapsed {time.perf_counter() - t_start:.0f}s)")
        write_results(rows, common, out)
    plot(rows, out / "throughput_vs_memory.png", title=f"{common['model']} on {_device_label(rows)}")
    return rows


def summary_line(row: Mapping[str, Any]) -> str:
    """'ok 1,234 tok/s, peak 1.2 GiB, compile 10s' or 'oom: message'."""
    if row["status"] != "ok":
        return f"{row['status']}: {str(row.get('message', ''))[:160]}"
    mfu = f", MFU {row['mfu']:.1%}" if row.get("mfu") is not None else ""
    return (f"ok {row['tokens_per_s']:,.0f} tok/s{mfu}, peak {format_bytes(row['peak_bytes'])}, "
            f"compile {row['compile_s']:.0f}s")


def _device_label(rows: Sequence[Mapping[str, Any]]) -> str:
    for r in rows:
        if r.get("device_kind"):
            return f"{r['devices']} x {r['device_kind']}"
    return "this machine"


def write_results(rows: Sequence[Mapping[str, Any]], common: Mapping[str, Any], out: Path) -> None:
    """results.json ({"sweep": settings, "results": rows}) and results.csv (CSV_COLUMNS)."""
    (out / "results.json").write_text(json.dumps({"sweep": dict(common), "results": list(rows)}, indent=1,
                                                 default=str))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_COLUMNS})


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The results as a text table (best throughput among ok points marked with *)."""
    ok = [r for r in rows if r["status"] == "ok"]
    best = max(ok, key=lambda r: r["tokens_per_s"]) if ok else None
    head = ["layout", "mbs", "recompute", "capture", "status", "tokens/s", "MFU", "peak mem", "compile s", "note"]
    body = []
    for r in rows:
        good = r["status"] == "ok"
        body.append([r["layout"], str(r["mbs"]), r["recompute"], r["capture"], r["status"],
                     (f"{r['tokens_per_s']:,.0f}" + ("*" if r is best else "")) if good else "-",
                     f"{r['mfu']:.1%}" if good and r.get("mfu") is not None else "n/a" if good else "-",
                     format_bytes(r.get("peak_bytes")) if good else "-",
                     f"{r['compile_s']:.1f}" if good else "-",
                     "" if good else str(r.get("message", ""))[:70]])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(head, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


def plot(rows: Sequence[Mapping[str, Any]], path: Path, title: str = "") -> Path:
    """Throughput (useful tokens/s) against peak memory per point; failed points listed below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    markers = {"none": "o", "step": "s", "scopes": "^"}
    colors = {"none": "tab:blue", "selective": "tab:orange", "full": "tab:green"}
    seen = set()
    for r in rows:
        if r["status"] != "ok":
            continue
        label = f"recompute {r['recompute']}, capture {r['capture']}"
        ax.scatter(r["peak_bytes"] / 2**30, r["tokens_per_s"], marker=markers.get(r["capture"], "D"),
                   color=colors.get(r["recompute"], "tab:gray"), s=60, label=None if label in seen else label)
        seen.add(label)
        ax.annotate(f"{r['layout']} mbs{r['mbs']}", (r["peak_bytes"] / 2**30, r["tokens_per_s"]), fontsize=7,
                    xytext=(4, 4), textcoords="offset points")
    ok = [r for r in rows if r["status"] == "ok"]
    if ok:  # from 0, with room for the labels
        ax.set_xlim(0, 1.15 * max(r["peak_bytes"] for r in ok) / 2**30)
        ax.set_ylim(0, 1.15 * max(r["tokens_per_s"] for r in ok))
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("useful tokens/s")
    ax.set_title(title or "throughput vs memory")
    ax.grid(alpha=0.3)
    if seen:
        ax.legend(fontsize=7, loc="lower right")
    failed = [f"{point_name(r)}: {r['status']}" for r in rows if r["status"] != "ok"]
    fig.tight_layout(rect=(0, 0.06 if failed else 0, 1, 1))
    if failed:
        fig.text(0.01, 0.01, "failed: " + "; ".join(failed)[:300], fontsize=7, color="tab:red", wrap=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: run the grid, print the table, write the results; 0 when every point ran (ok or not)."""
    p = argparse.ArgumentParser(prog="python -m bench.sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="proxy", help="configs/models name or path")
    p.add_argument("--layout", default="fsdp", help="layouts, comma separated")
    p.add_argument("--mbs", default="1,2,4", help="micro-batch sizes per data-parallel rank")
    p.add_argument("--recompute", default="none,selective,full")
    p.add_argument("--capture", default="none,step,scopes")
    p.add_argument("--capture-scopes", default="attn,moe_router,moe_preprocess",
                   help="scopes for capture=scopes (Megatron's names; full_iteration = everything)")
    p.add_argument("--recompute-modules", default=None, help="for selective (default core_attn)")
    p.add_argument("--steps", type=int, default=10, help="timed steady-state steps per point")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--data", default=None, help="data preset or YAML (default: proxy for the proxy model, else vqa)")
    p.add_argument("--data-set", action="append", default=[], metavar="KEY=VALUE", help="data config override")
    p.add_argument("--seq-len", type=int, default=None, help="default: the data config's")
    p.add_argument("--host-devices", type=int, default=None, help="CPU only: pretend N host devices")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per point")
    p.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE",
                   help="XLA compile option for every point (e.g. xla_backend_optimization_level=0 on CPU)")
    p.add_argument("--state-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="AdamW state dtype (bfloat16 with param_dtype=bfloat16: HF's memory footprint)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="compute settings, e.g. dtype=bfloat16")
    args = p.parse_intermixed_args(argv)  # KEY=VALUE settings may come before and after options
    compute = overrides_tree(args.overrides, prefix="compute")
    if args.recompute_modules is not None:
        compute["recompute_modules"] = split_list(args.recompute_modules)
    for key in ("recompute", "capture", "capture_scopes"):
        if key in compute:
            print(f"error: set {key} with --{key.replace('_', '-')}, not as an override", file=sys.stderr)
            return 2
    data = args.data or ("proxy" if Path(args.model).stem == "proxy" else "vqa")
    common = {"model": args.model, "data": data, "data_overrides": list(args.data_set), "seq_len": args.seq_len,
              "steps": args.steps, "warmup": args.warmup, "grad_accum": args.grad_accum, "compute": compute,
              "capture_scopes": split_list(args.capture_scopes), "host_devices": args.host_devices,
              "compiler_options": overrides_tree(args.compiler_option),
              "optimizer": {"state_dtype": args.state_dtype}}
    points = grid(split_list(args.layout), split_list(args.mbs, int), split_list(args.recompute),
                  split_list(args.capture))
    out = Path(args.out)
    print(f"sweep: {len(points)} points of {args.model} on {data} data -> {out} (each point in its own process)",
          flush=True)
    rows = run_sweep(points, common, out, timeout=args.timeout, echo=lambda s: print(s, flush=True))
    print()
    print(format_table(rows))
    print(f"\nresults: {out / 'results.csv'}, {out / 'results.json'}, plot {out / 'throughput_vs_memory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
