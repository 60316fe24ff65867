"""Memory report CLI: XLA's compiled memory analysis of the train step (``moevlm_jax.perf.memory``),
one row per (layout, MBS, recompute) combination, without running a step.

    python -m moevlm_jax.tools.memory --model tiny --layout fsdp --recompute none,selective,full --mbs 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.parallelism.cpu_threads import ensure_collective_threads
from moevlm_jax.perf.memory import TOTAL, format_bytes, memory_report
from moevlm_jax.schema import overrides_tree
from moevlm_jax.training.capture import CaptureError, backend_started, merge_flags

log = logging.getLogger(__name__)


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """A text table of memory reports (one row each); host columns only where some are non-zero."""
    cols = ["argument_bytes", "output_bytes", "alias_bytes", "temp_bytes"]
    cols += [c for c in ("host_temp_bytes", "host_argument_bytes", "host_output_bytes")
             if any(r.get(c) for r in rows)]
    cols.append(TOTAL)
    head = ["layout", "mbs", "recompute", "modules", "offload"] + [c.removesuffix("_bytes")
                                                                   for c in cols] + ["compile s"]
    body = []
    for r in rows:
        modules = ",".join(r["recompute_modules"]) if r["recompute"] == "selective" else "-"
        body.append([r["layout"], str(r["mbs"]), r["recompute"], modules, ",".join(r["offload"]) or "-"]
                    + [format_bytes(r.get(c)) for c in cols] + [f"{r['compile_s']:.1f}"])
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(head, widths))]
    lines += ["  ".join(x.ljust(w) for x, w in zip(row, widths)) for row in body]
    return "\n".join(lines)


def split_list(text: str | None, cast: Any = str) -> list[Any]:
    """'a,b,c' -> [cast(a), cast(b), cast(c)] (empty / None -> [])."""
    return [cast(x.strip()) for x in (text or "").split(",") if x.strip()]


def set_host_devices(n: int | None) -> None:
    """Ask XLA for ``n`` CPU host devices (before the backend starts; CPU only)."""
    if n:

        if backend_started():
            raise CaptureError("host devices must be set before the jax backend starts")
        os.environ["XLA_FLAGS"] = merge_flags(os.environ.get("XLA_FLAGS", ""),
                                              {"--xla_force_host_platform_device_count": str(n)})


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: one compiled memory report per (layout, MBS, recompute) combination, as a table."""
    p = argparse.ArgumentParser(prog="python -m moevlm_jax.tools.memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="proxy", help="configs/models name or path")
    p.add_argument("--layout", default="fsdp", help="layout name(s), comma separated")
    p.add_argument("--recompute", default="none", help="none | full | selective, comma separated")
    p.add_argument("--recompute-modules", default=None, help="e.g. core_attn,moe_act (default: core_attn)")
    p.add_argument("--offload", default="", help="module / checkpoint names offloaded to host memory")
    p.add_argument("--vision-recompute", default=None, help="the vision tower's recompute (default: the decoder's)")
    p.add_argument("--mbs", default="1", help="micro-batch size(s) per data-parallel rank, comma separated")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--patches", type=int, default=None, help="patch rows per row (default 3/4 of seq-len; 0: text)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--devices", type=int, default=None, help="use the first N devices (default all)")
    p.add_argument("--host-devices", type=int, default=None, help="CPU only: pretend N host devices")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--compiler-option", action="append", default=[], metavar="KEY=VALUE",
                   help="XLA compile option, e.g. xla_backend_optimization_level=0 (faster CPU compiles)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="compute settings, e.g. dtype=float32")
    args = p.parse_args(argv)
    set_host_devices(args.host_devices)
    ensure_collective_threads()  # XLA:CPU host devices: pool threads for their collectives, before jax starts


    base = overrides_tree(args.overrides, prefix="compute")
    if args.recompute_modules is not None:
        base["recompute_modules"] = split_list(args.recompute_modules)
    base["offload"] = split_list(args.offload)
    if args.vision_recompute:
        base["vision_recompute"] = args.vision_recompute
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    rows = []
    for layout in split_list(args.layout):
        for mbs in split_list(args.mbs, int):
            for recompute in split_list(args.recompute):
                try:
                    compute = ComputeConfig.from_dict({**base, "recompute": recompute})
                    rows.append(memory_report(args.model, layout, compute, mbs=mbs, seq_len=args.seq_len,
                                              patches=args.patches, grad_accum=args.grad_accum, devices=devices,
                                              compiler_options=overrides_tree(args.compiler_option)))
                except Exception as e:  # noqa: BLE001 - report the point and go on
                    print(f"error: layout {layout}, mbs {mbs}, recompute {recompute}: {type(e).__name__}: {e}",
                          file=sys.stderr)
    if rows:
        print(f"train step memory per device ({rows[0]['model']}, seq {args.seq_len}, {rows[0]['patches']} patches "
              f"per row, {len(devices)} {devices[0].platform} devices; XLA compiled memory analysis, no step run)")
        print(format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
