"""Diagnosis of a profiler trace's device events by kernel name (e.g. the memsets and copies the trace
breakdown shows): per (kernel, hlo_op) the count, total and mean duration, one event's full args,
and the kernels just before and after it on the same stream.

    python bench/scripts/trace_events.py runs/bench/prof --match 'Memset|Memcpy' --steps 4 --out memsets.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `bench` is not installed
from bench.breakdown import device_events, load_trace


def summarise(events, pattern: str, steps: int, limit: int = 40) -> list[dict]:
    events = sorted(events, key=lambda e: (e["pid"], e.get("tid"), float(e["ts"])))
    rx = re.compile(pattern)
    groups: dict[tuple[str, str], dict] = {}
    for i, e in enumerate(events):
        name = str(e.get("name", ""))
        if not rx.search(name):
            continue
        op = str(e.get("args", {}).get("hlo_op"))
        g = groups.setdefault((name, op), {"kernel": name, "hlo_op": op, "count": 0, "ms": 0.0, "args": e.get("args", {}),
                                          "dur_us": [], "neighbours": collections.Counter()})
        g["count"] += 1
        g["ms"] += float(e.get("dur", 0.0)) * 1e-3
        g["dur_us"].append(float(e.get("dur", 0.0)))
        stream = (e["pid"], e.get("tid"))
        same = lambda j, stream=stream: 0 <= j < len(events) and (events[j]["pid"], events[j].get("tid")) == stream
        before = str(events[i - 1].get("name", ""))[:60] if same(i - 1) else "-"
        after = str(events[i + 1].get("name", ""))[:60] if same(i + 1) else "-"
        g["neighbours"][f"{before} | {after}"] += 1
    out = []
    for g in sorted(groups.values(), key=lambda g: -g["ms"])[:limit]:
        durs = sorted(g.pop("dur_us"))
        out.append(dict(g, ms_per_step=g["ms"] / steps, count_per_step=g["count"] / steps,
                        dur_us_min=durs[0], dur_us_median=durs[len(durs) // 2], dur_us_max=durs[-1],
                        neighbours=g["neighbours"].most_common(3)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--match", default="Memset|Memcpy")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out")
    a = p.parse_args()
    rows = summarise(device_events(load_trace(a.trace)), a.match, a.steps)
    for r in rows[:25]:
        print(f"{r['ms_per_step']:8.2f} ms/step {r['count_per_step']:6.1f}x  median {r['dur_us_median']:9.1f} us  "
              f"{r['kernel'][:30]:<30} {r['hlo_op'][:40]:<40} {r['neighbours'][0][0][:110]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
