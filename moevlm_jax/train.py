"""The main job: ``python -m moevlm_jax.train [--recipe R] [--model M] [--layout L] [--data D]
[--steps N] [--run-dir DIR] [--resume | --resume-step N] [key=value ...]`` (``--help-config``: every key).

config (moevlm_jax.config, validated once) -> auto-fit (moevlm_jax.plan.autofit: a run that
does not fit the devices gets the planner's fastest fitting settings, said in words) -> mesh over all devices
(the layout) -> sharded train state + compiled step (moevlm_jax.training.trainer) -> grain loader (this host's
shard) -> loop:
step, metrics (metrics.jsonl, TensorBoard, progress bar), held-out evaluation, async orbax
checkpoints, profile window -> summary table (moevlm_jax.training.loop). ``--resume`` continues the
run in ``--run-dir`` from its newest checkpoint that restores (``--resume-step N``: exactly checkpoint N):
parameters, optimizer state, step, RNG and the data iterator.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from typing import Any

from moevlm_jax.config.run import add_arguments, from_args, help_config, resumes
from moevlm_jax.data.config import DataError
from moevlm_jax.parallelism.cpu_threads import ensure_collective_threads
from moevlm_jax.schema import ConfigError
from moevlm_jax.training import capture, distributed
from moevlm_jax.training.checkpoint import RestoreError
from moevlm_jax.training.faults import StopSignals, TrainingStopped

log = logging.getLogger("moevlm_jax.train")


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run table: steps, time, loss first -> last, throughput, skips, held-out accuracy."""
    def fmt(x: Any, spec: str = ".4f") -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    d = summary.get("data", {})
    lines = ["", f"run {summary['run_dir']}: steps {summary['start_step']} -> {summary['end_step']} of "
             f"{summary['steps']} in {summary['wall_s']:.0f}s ({summary['compiles']} compiled batch shapes"
             + (", the first compiled ahead" if summary.get("compiled_ahead") else "")
             + (", the evaluation's too" if summary.get("evals_compiled_ahead") else "")
             + (f"; first step done {summary['first_step_s']:.0f}s after the process started"
                if summary.get("first_step_s") is not None else "") + ")",
             f"  loss            {fmt(summary['loss_first'])} (step {summary['first_step']}) -> "
             f"{fmt(summary['loss_last'])} (step {summary['last_step']})",
             f"  throughput      {fmt(summary['tokens_per_s'], ',.0f')} useful tokens/s, "
             f"{fmt(summary['tflops_per_device'], '.3f')} model TFLOP/s per device"
             + (f", peak memory {summary['peak_memory_gib']:.1f} GiB a device" if summary.get("peak_memory_gib")
                else ""),
             f"  data            {d.get('source', '?')}: {d.get('samples', 0)} samples, token fill "
             f"{d.get('token_fill', 0):.1%}, patch fill {d.get('patch_fill', 0):.1%}",
             f"  skipped         samples {d.get('skipped') or 'none'}; optimizer updates {summary['skipped_updates']}"]
    if summary.get("evals"):
        last = summary["evals"][-1]
        lines.append(f"  held-out (step {last['step']}) loss {last['loss']:.4f} on answer tokens")
        lines.append(f"    {'question':<10} {'answers':>8} {'accuracy':>9} {'chance':>7}")
        for key, e in sorted(last["accuracy"].items(), key=lambda kv: (kv[0] == "all", kv[0])):
            lines.append(f"    {key:<10} {e['answers']:>8} {e['accuracy']:>9.1%} {fmt(e['chance'], '.1%'):>7}")
    if summary.get("answers"):
        lines.append(f"  answers         held-out questions, generated (greedy) next to the truth "
                     f"({summary['run_dir']}/answers.jsonl)")
        for r in summary["answers"]:
            mark = "" if r["match"] is None else ("  ok" if r["match"] else "  x")
            lines.append(f"    {r['question'][:60]!r:<62} truth {str(r['answer'])!r:<10} model "
                         f"{r['generated'][:40]!r}{mark}")
    if summary.get("evals_skipped"):
        lines.append(f"  held-out        skipped: {summary['evals_skipped']}")
    if summary.get("curves"):
        lines.append(f"  curves          {summary['curves']} (loss, held-out loss, tokens/s against step)")
    if summary.get("skipped_checkpoints"):
        lines.append(f"  resumed         from step {summary['start_step']}, not the newest checkpoint: "
                     + "; ".join(f"{s['step']} skipped ({s['reason']}), kept as {s['kept_as'] or s['step']}"
                                 for s in summary["skipped_checkpoints"]))
    if summary.get("checkpoints"):
        lines.append(f"  checkpoints     {summary['checkpoints']} in {summary['run_dir']}/checkpoints")
    return "\n".join(lines)


class _TqdmHandler(logging.StreamHandler):
    """Log lines that do not break the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must not raise
            self.handleError(record)


def setup_logging(level: int = logging.INFO) -> None:
    """INFO logs of this project to stderr (above the progress bar); other libraries at WARNING."""
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in ("moevlm_jax", "data", "parallelism"):
        logging.getLogger(name).setLevel(level)


def print_error(e: BaseException) -> None:
    """A configuration error on stderr: one ``error:`` line per problem, each naming its key."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # "invalid config:" or "layout 'tp' does not fit ...:"
        head = lines[0][:-1].removeprefix("invalid config").lstrip(": ")
        lines = [f"{head}: {ln}" if head else ln for ln in lines[1:]]
    for line in lines:
        print(f"error: {line}", file=sys.stderr)
    if getattr(e, "table", None):  # auto-fit found nothing that fits: the planner's table as it prints it
        print(e.table, file=sys.stderr)


def main(argv: list[str] | None = None, *, stop_after: int | None = None) -> int:
    """CLI entry: parse, validate, train, print the summary table; 2 on a config error."""
    ensure_collective_threads()  # XLA:CPU host devices: pool threads for their collectives, before jax starts
    parser = argparse.ArgumentParser(prog="python -m moevlm_jax.train", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    distributed.add_arguments(parser)
    parser.add_argument("--no-auto-fit", dest="auto_fit", action="store_false",
                        help="run the recipe as written even where it does not fit the devices (by default a run "
                             "that does not fit gets the planner's fastest fitting MBS / recompute / dtypes / layout)")
    parser.add_argument("--device-memory", type=float, metavar="GIB",
                        help="GiB a device has, for auto-fit (default: the allocator's limit on GPU, the "
                             "machine's memory over the devices on CPU)")
    parser.add_argument("--quiet", action="store_true", help="warnings only")
    parser.add_argument("--help-config", action="store_true",
                        help="list every setting (key, type, default, meaning) and exit")
    args = parser.parse_args(argv)
    if args.help_config:
        print(help_config())
        return 0
    setup_logging(logging.WARNING if args.quiet else logging.INFO)
    # JAX preallocates 75% of a GPU by default; a training step may use 95% (the rest: NCCL, cuDNN, the
    # command buffers). An explicit setting wins.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    try:  # the capture's XLA flags, then the processes connected, before anything starts the jax backend
        capture.apply_capture(capture.recipe_compute(args.recipe, args.overrides, run_dir=args.run_dir,
                                                     resume=resumes(args.resume, args.resume_step,
                                                                    args.overrides)))
        if distributed.initialize(args) > 1 and distributed.process_index() > 0:
            setup_logging(logging.WARNING)  # one process logs the run; the others only their warnings
    except (ValueError, capture.CaptureError) as e:
        print_error(e)
        return 2
    # SIGTERM / SIGINT from here on: a stop request (training.faults), honoured before the first step too
    with StopSignals() as stop:
        try:
            from moevlm_jax.data.sources import prepare_in_background
            from moevlm_jax.plan.autofit import auto_fit
            from moevlm_jax.training.loop import apply_compilation_cache, run

            cfg = from_args(args)
            # a new machine makes the built-in data set while the fit check and the step compile
            prepare_in_background(cfg.data)
            try:
                if args.auto_fit:  # the persistent cache first: a rerun loads the fit check's compiles too
                    apply_compilation_cache(cfg.train.compilation_cache_dir)
                    cfg = auto_fit(cfg, lambda change: from_args(argparse.Namespace(
                        **{**vars(args), "overrides": [*args.overrides, *change]})),
                        device_memory_gib=args.device_memory,
                        report=print if distributed.process_index() == 0 else (lambda _: None))
            except Exception as e:  # a fit check's compile the signal ended (its compiler's child processes)
                if stop.received is None:
                    raise
                log.info("stopping: auto-fit ended with %s: %s", type(e).__name__, (str(e).splitlines() or [""])[0])
            summary = run(cfg, stop_after=stop_after, stop=stop)
        except (ConfigError, FileExistsError) as e:
            print_error(e)
            return 2
        except (TrainingStopped, DataError, RestoreError) as e:  # the run cannot go on: why, and what was saved
            print_error(e)
            return 1
    if distributed.process_index() > 0:
        return 0
    stopped = summary.get("stopped")
    if stopped and stopped["step"] is None:  # before the first step: no run to summarise
        print(stopped["line"])
        return 0
    print(format_summary(summary))
    if stopped:
        if stopped["checkpoint"] is None:  # train.checkpointing=false: nothing to resume from
            print(f"stopped by {stopped['signal']} after step {stopped['step']}: no checkpoint written "
                  f"(train.checkpointing=false), so the run cannot be resumed")
        else:
            print(f"stopped by {stopped['signal']} after step {stopped['step']}: checkpoint {stopped['checkpoint']} in "
                  f"{summary['run_dir']}/checkpoints; continue with --resume --run-dir {summary['run_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
