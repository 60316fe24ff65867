"""Input-pipeline benchmark: samples/s and patches/s per worker at the proxy workload's shapes.

    python -m moevlm_jax.data.bench                                  # proxy preset, workers 0,1,2
    python -m moevlm_jax.data.bench --workers 1,4,8,12 --batches 96  # on the GPU machine's 16 cores
    python -m moevlm_jax.data.bench --config vqa --mock              # also time the mock source (labelled MOCK)

Self-contained and offline: the proxy preset's dataset (4 realistic JPEG images per sample, resized
to ~448x448 = ~784 patches each, ~3.7k tokens per 4096-token row) is generated into the cache
first. Each row of the table is one loader run with that many grain worker processes (0 = in
the calling process); after ``--warmup`` batches (worker start-up) ``--batches`` are timed. The
"headroom" column compares the batch rate with what a training step consuming
``--step-tokens-per-s`` (slot tokens, B*S per step) needs. Results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moevlm_jax.data.config import load_data_config
from moevlm_jax.data.loader import build_loader, throughput_line

# HF transformers + torch.compile, proxy workload, MBS 4 on one H200 (bench/README.md): 33.3k tokens/s.
HF_PROXY_TOKENS_PER_S = 33300.0


def run_one(config: str, workers: int, batches: int, warmup: int, overrides: list[str],
            step_tokens_per_s: float) -> dict[str, Any]:
    """Time ``batches`` batches of one loader with ``workers`` worker processes."""
    t_build = time.perf_counter()
    loader = build_loader(config, workers=workers, overrides=overrides)
    build_s = time.perf_counter() - t_build
    cfg = loader.config
    try:
        t0 = time.perf_counter()
        for _ in range(warmup):
            next(loader)
        warm_s = time.perf_counter() - t0
        before = loader.summary()
        t1 = time.perf_counter()
        for _ in range(batches):
            next(loader)
        seconds = time.perf_counter() - t1
        after = loader.summary()
    finally:
        loader.close()
    timed = {k: after[k] - before[k] for k in ("batches", "samples", "images", "tokens", "useful_tokens",
                                               "trained_tokens", "patch_slots", "useful_patches")}
    per = max(1, workers)
    batch_rate = timed["batches"] / seconds
    needed = step_tokens_per_s / (cfg.batch_size * cfg.seq_len)
    return {
        "config": cfg.name, "source": loader.label, "mock": loader.is_mock, "workers": workers,
        "read_threads": cfg.read_threads, "rows": cfg.batch_size, "seq_len": cfg.seq_len,
        "seconds": seconds, "build_seconds": build_s, "warmup_seconds": warm_s, **timed,
        "batches_per_s": batch_rate, "samples_per_s": timed["samples"] / seconds,
        "images_per_s": timed["images"] / seconds, "patches_per_s": timed["useful_patches"] / seconds,
        "useful_tokens_per_s": timed["useful_tokens"] / seconds,
        "samples_per_s_per_worker": timed["samples"] / seconds / per,
        "patches_per_s_per_worker": timed["useful_patches"] / seconds / per,
        "token_fill": timed["useful_tokens"] / max(1, timed["tokens"]),
        "patch_fill": timed["useful_patches"] / max(1, timed["patch_slots"]),
        "step_tokens_per_s": step_tokens_per_s, "needed_batches_per_s": needed, "headroom": batch_rate / needed,
        "throughput_line": throughput_line(
            {**after, **timed, "token_fill": timed["useful_tokens"] / max(1, timed["tokens"]),
             "patch_fill": timed["useful_patches"] / max(1, timed["patch_slots"])}, seconds),
    }


def print_table(rows: list[dict[str, Any]], stream: Any = None) -> None:
    """Results as an aligned table (mock rows say MOCK)."""
    stream = stream or sys.stdout
    head = ("source", "workers", "samples/s", "per worker", "patches/s", "per worker", "images/s",
            "tokens/s", "fill tok/patch", "headroom")
    lines = [head]
    for r in rows:
        lines.append((
            ("MOCK " if r["mock"] else "") + r["config"], str(r["workers"]), f"{r['samples_per_s']:.1f}",
            f"{r['samples_per_s_per_worker']:.2f}", f"{r['patches_per_s']:,.0f}",
            f"{r['patches_per_s_per_worker']:,.0f}",
            f"{r['images_per_s']:.1f}", f"{r['useful_tokens_per_s']:,.0f}",
            f"{r['token_fill']:.0%}/{r['patch_fill']:.0%}", f"{r['headroom']:.2f}x"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    for k, line in enumerate(lines):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(line, widths))), file=stream)
        if k == 0:
            print("  ".join("-" * w for w in widths), file=stream)
    if rows:
        r = rows[0]
        print(f"headroom: batch rate / ({r['step_tokens_per_s']:,.0f} step tokens/s / {r['rows']}x{r['seq_len']} "
              f"tokens per batch); HF+torch.compile proxy MBS 4 on one H200 = {HF_PROXY_TOKENS_PER_S:,.0f} tokens/s",
              file=stream)


def main(argv: Iterable[str] | None = None) -> int:
    """CLI entry point."""
    parser = argparse.ArgumentParser(prog="python -m moevlm_jax.data.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="proxy", help="data preset or YAML (default: proxy)")
    parser.add_argument("--workers", default="0,1,2", help="comma-separated worker counts to time")
    parser.add_argument("--batches", type=int, default=12, help="timed batches per run (at least 8 per worker)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches per run (at least 2 per worker)")
    parser.add_argument("--train-samples", type=int, default=256, help="size of the generated built-in set")
    parser.add_argument("--read-threads", type=int, default=None, help="threads per worker (default: config)")
    parser.add_argument("--step-tokens-per-s", type=float, default=50000.0,
                        help="slot tokens/s the training step consumes (HF torch.compile proxy: 33300)")
    parser.add_argument("--mock", action="store_true", help="also time the mock preset (random patches)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default bench/data_pipeline_<host>.json)")
    args = parser.parse_args(list(argv) if argv is not None else None)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    overrides = list(args.set)
    if load_data_config(args.config).kind in ("vqa", "photos", "mock"):
        overrides += [f"source.num_train={args.train_samples}"]
    if load_data_config(args.config).kind == "vqa":
        overrides += ["source.num_heldout=16"]
    if args.read_threads is not None:
        overrides += [f"read_threads={args.read_threads}"]
    print(f"preparing {args.config} ...", file=sys.stderr)
    t = time.perf_counter()
    build_loader(args.config, workers=0, overrides=overrides).close()  # generates the built-in set once
    print(f"ready in {time.perf_counter() - t:.1f}s; cpus={os.cpu_count()}", file=sys.stderr)
    rows = []
    runs = [(args.config, int(w), overrides) for w in args.workers.split(",")]
    if args.mock:
        runs += [("mock", int(w), [f"read_threads={args.read_threads}"] if args.read_threads is not None else [])
                 for w in args.workers.split(",")]
    for config, workers, ovr in runs:
        batches, warmup = max(args.batches, 8 * workers), max(args.warmup, 2 * workers)
        row = run_one(config, workers, batches, warmup, ovr, args.step_tokens_per_s)
        rows.append(row)
        print(f"  workers={workers}: {row['throughput_line']}", file=sys.stderr)
    print_table(rows)
    out = args.out or Path("bench") / f"data_pipeline_{platform.node() or 'host'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m moevlm_jax.data.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "host": platform.node(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}
    out.write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
