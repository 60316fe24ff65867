"""Issue 24: where recipe h200's training-step compile goes (the time to the first step is that compile,
bench/first_step_h200.md): the step traced (Python), lowered to StableHLO, and compiled by XLA, each
timed, for the same abstract batch and loss capacity the train CLI compiles ahead (``train.compile_ahead``),
with no compilation cache. XLA flags come from the environment (one process per flag set); the recipe's
own (its capture's and ``compute.xla_flags``) are merged in as the CLI does and replace the same flags there:
to time a flag the recipe sets, override it (e.g. ``compute.xla_flags=[]`` for XLA's defaults). ``--init`` also times the state initialiser's compile, which
the CLI runs at the same time in another thread. The step's Mosaic-GPU kernels compile alone in other threads
beside the step's compile, as the CLI's compile ahead does (``--no-kernels-ahead``: inside XLA's compile only).

    XLA_FLAGS=... python3 bench/scripts/probe_compile.py --out $OUT/compile.json [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="h200")
    ap.add_argument("--init", action="store_true")
    ap.add_argument("--no-kernels-ahead", dest="kernels_ahead", action="store_false",
                    help="leave the Mosaic-GPU kernels to XLA's compile (train.compile_ahead compiles them beside it)")
    ap.add_argument("--out", default="compile.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    t_start = time.perf_counter()
    from moevlm_jax.training import capture

    capture.apply_capture(capture.recipe_compute(args.recipe, args.overrides))
    import jax

    jax.config.update("jax_compilation_cache_dir", None)
    from moevlm_jax.config import load_config
    from moevlm_jax.training.trainer import Trainer

    cfg = load_config(args.recipe, overrides=args.overrides)
    tr = cfg.train
    trainer = Trainer.create(cfg.model, cfg.compute, cfg.layout, cfg.optimizer, steps=tr.steps,
                             grad_accum=tr.grad_accum, reuse_shapes=tr.reuse_shapes)
    rows = cfg.global_batch_size // jax.process_count()
    capacity = trainer.largest_capacity(rows, tr.seq_len)
    trainer.reserve_patches(cfg.data.max_patches, capacity=capacity)
    batch = trainer.abstract_batch(tr.micro_batch_size, tr.seq_len, cfg.data.max_patches, cfg.data.balance_vision_rows)
    state = trainer.abstract_state()
    res = {"recipe": args.recipe, "overrides": args.overrides, "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "setup_s": time.perf_counter() - t_start}
    from moevlm_jax.parallelism import gmm_mgpu

    t = time.perf_counter()
    with gmm_mgpu.recording() as kernels:
        traced = trainer.lower_step(state, batch, capacity, bounded=True, trace_only=True)
    res["trace_s"] = time.perf_counter() - t
    t = time.perf_counter()
    lowered = traced.lower()
    res["lower_s"] = time.perf_counter() - t
    res["stablehlo_chars"] = len(lowered.as_text())
    res["mosaic_kernels"] = len(kernels)
    res["kernels_ahead"] = args.kernels_ahead
    t = time.perf_counter()
    # as Trainer.compile_ahead does: the step's Mosaic-GPU kernels compiled alone beside the step's compile
    ahead = kernels.compile_ahead() if args.kernels_ahead else []
    compiled = lowered.compile()
    res["compile_s"] = time.perf_counter() - t
    if ahead:
        for f in ahead:
            f.result()
        res["kernels_ahead_done_s"] = time.perf_counter() - t  # (all done by then: XLA waited for none of them)
        res["kernel_compile_s"] = sorted(kernels.compile_s)
    try:
        res["hlo_instructions"] = sum(line.startswith("  ") for line in compiled.as_text().splitlines())
    except Exception:  # noqa: BLE001 - informational only
        pass
    if args.init:
        t = time.perf_counter()
        trainer.lower_init(tr.seed).compile()
        res["init_compile_s"] = time.perf_counter() - t
    res["total_s"] = time.perf_counter() - t_start
    print(json.dumps(res))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
