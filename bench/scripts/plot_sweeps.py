"""Merge several ``python -m bench.sweep`` results.json files into one table and one throughput-vs-memory plot.

    python bench/scripts/plot_sweeps.py runs/bench/sweep_*/results.json --out runs/bench/sweep.png

Each point's label gets its file's compute overrides that differ between the files (e.g. the
experts' backend), so points of different sweeps stay distinguishable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `bench` is not installed
from bench.sweep import format_table, plot


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def merged_rows(paths: list[Path]) -> list[dict]:
    runs = [(p, json.loads(p.read_text())) for p in paths]
    settings = [_flat(r["sweep"].get("compute", {})) for _, r in runs]
    keys = sorted({k for s in settings for k in s})
    varying = [k for k in keys if len({str(s.get(k)) for s in settings}) > 1]
    rows = []
    for (_, run), s in zip(runs, settings):
        tag = " ".join(f"{k.split('.')[-1]}={s[k]}" for k in varying if k in s)
        for r in run["results"]:
            rows.append({**r, "layout": f"{r['layout']} {tag}".strip()})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True, help="the plot (PNG)")
    p.add_argument("--title", default="")
    args = p.parse_args()
    rows = merged_rows(args.files)
    print(format_table(rows))
    print("plot:", plot(rows, args.out, args.title))


if __name__ == "__main__":
    main()
