"""Per HLO op of a profiled program: device ms, the bytes its instruction reads and writes (output and operand
shapes of the compiled HLO) and the bandwidth that gives. Memory-bound fusions far below the HBM's ~4,800 GB/s
(H200) are what is left to win in the elementwise and reduction rows of a step's breakdown.

    python bench/scripts/op_bandwidth.py runs/bench/prof --hlo 'runs/bench/prof/*/train_step_*.hlo.txt' --steps 4 --out ops.json

"""

from __future__ import annotations

import argparse
import glob
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `bench` is not installed

from moevlm_jax.parallelism.hlo import shape_bytes  # noqa: E402


def hlo_table(text: str) -> tuple[dict[str, str], dict[str, int]]:
    """op_name (by instruction name, and with '.' -> '_' as kernels are named) and the bytes each instruction reads
    and writes: its output shape(s) plus its operands' (looked up by name: instruction names are unique in a
    module), i.e. what a memory-bound fusion moves at least once; a slice twice its output. An upper bound where a
    fusion reads only part of an operand in other ways (a gather's table, a dynamic slice inside a larger fusion)."""
    ops, out, lines = {}, {}, {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.-]+) = (.*)$", text, re.MULTILINE):
        name, rest = m.group(1), m.group(2)
        on = re.search(r'op_name="([^"]+)"', rest)
        if on:
            ops.setdefault(name, on.group(1))
            ops.setdefault(name.replace(".", "_"), on.group(1))
        kind = re.match(r"(\(.*?\)|\S+)\s+([\w-]+)\(", rest)
        if kind and name not in out:
            out[name] = int(shape_bytes(kind.group(1)))
            lines[name] = rest[kind.end():]
    nbytes = {}
    for name, args in lines.items():
        depth, end = 1, 0
        for i, ch in enumerate(args):  # the operand list: up to the parenthesis that closes the call
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                end = i
                break
        operands = re.findall(r"%([\w.-]+)", args[:end])
        if "slice" in name.split(".")[0]:  # a (dynamic-)slice reads only what it writes, not its whole operand
            nbytes[name] = 2 * out[name]
        else:
            nbytes[name] = out[name] + sum(out.get(o, 0) for o in operands)
    return ops, nbytes


def op_rows(events, ops: dict[str, str], nbytes: dict[str, int], steps: int = 1, n: int = 60) -> list[dict]:
    """The ``n`` longest HLO ops (ms per step), with bytes and GB/s where the op is in the HLO."""
    per_op: dict[str, list] = {}
    for e in events:
        op = str(e.get("args", {}).get("hlo_op", "")) or str(e.get("name"))
        row = per_op.setdefault(op, [0.0, str(e.get("name")), 0])
        row[0] += float(e.get("dur", 0.0)) * 1e-3 / steps
        row[2] += 1
    rows = []
    for op, (ms, kernel, count) in sorted(per_op.items(), key=lambda kv: -kv[1][0])[:n]:
        b = nbytes.get(op)
        calls = count / steps
        rows.append({"hlo_op": op, "kernel": kernel, "ms": ms, "calls": calls, "bytes": b,
                     "gb_s": b * calls / ms * 1e-6 if b and ms else None, "op_name": ops.get(op, ops.get(kernel, ""))})
    return rows


def print_rows(rows: list[dict]) -> None:
    print("    ms/step  MB/call   GB/s  calls  hlo_op                             op_name", flush=True)
    for r in rows:
        mb = f"{r['bytes'] / 1e6:8.1f}" if r["bytes"] else "       ?"
        bw = f"{r['gb_s']:6.0f}" if r["gb_s"] else "     ?"
        print(f"    {r['ms']:7.3f} {mb} {bw} {r['calls']:6.1f}  {r['hlo_op'][:34]:34s} {r['op_name'][-70:]}", flush=True)


def main():
    from bench.breakdown import device_events, load_trace
    ap = argparse.ArgumentParser()
    ap.add_argument("trace", help="a profile directory (perfetto_trace.json.gz under it) or the trace file")
    ap.add_argument("--hlo", required=True, help="glob of the profiled programs' compiled HLO text")
    ap.add_argument("--steps", type=int, default=1, help="profiled steps (the ms are per step)")
    ap.add_argument("--top", type=int, default=150)
    ap.add_argument("--out", default="ops.json")
    args = ap.parse_args()
    ops, nbytes = {}, {}
    for f in sorted(glob.glob(args.hlo)):
        o, b = hlo_table(Path(f).read_text())
        ops.update(o)
        nbytes.update(b)
    rows = op_rows(device_events(load_trace(args.trace)), ops, nbytes, args.steps, args.top)
    print_rows(rows)
    with open(args.out, "w") as f:
        json.dump({"trace": args.trace, "steps": args.steps, "ops": rows}, f, indent=1)


if __name__ == "__main__":
    main()
