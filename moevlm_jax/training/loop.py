"""The training loop: config -> mesh -> sharded state + compiled step -> loader -> steps, with the
evaluation, checkpoints, profile window, curves and generated answers hung on it as hooks -> the run summary.

``run(cfg)`` is what ``python -m moevlm_jax.train`` runs (the CLI owns the terminal: progress bar,
summary table); ``--resume`` continues the run in its directory from its newest checkpoint that
restores (``train.resume_step``: exactly that one): parameters, optimizer state, step, RNG and the
data iterator. Newer checkpoints it passed over (damaged, or newer than the step asked for) are set
aside on disk, and the log and the summary name them. The parts, each its own module:
``compile_policy`` (``train.compile``: what compiles when), ``evaluator`` (the held-out evaluation),
``hooks`` (the hook protocol and the evaluation / checkpoint / profile / plot / answers hooks),
``faults`` (stop signals, non-finite updates, the run directory's room).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

import moevlm_jax.data as data_lib
from moevlm_jax.config.run import RunConfig, save_config
from moevlm_jax.model.router import ExpertBias
from moevlm_jax.parallelism.multihost import gather_json, sum_values
from moevlm_jax.perf import flops, memory
from moevlm_jax.schema import ConfigError
from moevlm_jax.training import capture
from moevlm_jax.training import optimizer as optim
from moevlm_jax.training.checkpoint import Checkpointer, Skipped, resume_steps, set_aside
from moevlm_jax.training.compile_policy import CompilePolicy, apply_compilation_cache
from moevlm_jax.training.evaluator import Evaluator, eval_record, evaluate
from moevlm_jax.training.faults import (
    NonFiniteGuard,
    StopSignals,
    TrainingStopped,
    check_run_dir,
)
from moevlm_jax.training.hooks import (
    AnswersHook,
    CheckpointHook,
    EvalHook,
    Hook,
    LoopContext,
    PlotHook,
    ProfileHook,
)
from moevlm_jax.training.metrics import (
    MetricsWriter,
    ProfileWindow,
    Progress,
    StepTracker,
    process_age_s,
    progress_postfix,
    read_metrics,
)
from moevlm_jax.training.trainer import DeviceBatch, Trainer

__all__ = ["apply_compilation_cache", "eval_record", "evaluate", "peak_memory_gib", "run"]

log = logging.getLogger("moevlm_jax.train")


# ----------------------------------------------------------------------------- the loop

def run(cfg: RunConfig, *, stop_after: int | None = None, progress: bool | None = None,
        hooks: Sequence[Hook] = (), stop: StopSignals | None = None) -> dict[str, Any]:
    """Train per ``cfg``; returns the run summary. ``stop_after``: leave the loop after that step
    without the final checkpoint, as an interrupted run would (tests, time boxes). ``hooks``: more
    hooks, called after the train job's own (``moevlm_jax.training.hooks``). ``stop``: the stop signals'
    handler when the caller installed it already (the CLI, before auto-fit), else the run installs its own.
    A stop signal before the first step ran (start-up, data start, first compile) ends the run as soon as what
    runs returns or fails: the summary is then ``{"run_dir", "start_step", "stopped": {..., "step": None}}``."""
    with contextlib.nullcontext(stop) if stop is not None else StopSignals() as signals:
        try:
            return _run(cfg, signals, stop_after, progress, hooks)
        except Exception as e:  # before the first step: the signal ended a compile's child or a data worker
            if signals.received is None or signals.phase == "training":
                raise
            _log_interrupted(e)
            return _stopped_before_start(cfg, signals)


def _run(cfg: RunConfig, stop: StopSignals, stop_after: int | None, progress: bool | None,
         extra_hooks: Sequence[Hook]) -> dict[str, Any]:
    tr = cfg.train
    stop.phase = "start-up"
    if stop.agreed():  # during auto-fit: nothing written yet
        return _stopped_before_start(cfg, stop)
    resumable, trainer, policy, evaluator = _setup(cfg)
    abstract = trainer.abstract_state()
    # room for the checkpoints kept at once (+1 while the next is written), as many as the run writes; checked
    # before a compile starts (a process leaving with XLA compiling in a thread can crash on its way out)
    saves = (tr.steps // tr.checkpoint_every if tr.checkpoint_every else 0) + 1 if tr.checkpointing else 0
    _check_run_dir(cfg.run_dir, min(tr.keep_checkpoints + 1, saves)
                   * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)))
    if stop.agreed():
        return _stopped_before_start(cfg, stop)
    if policy.ahead:
        stop.phase = "compile"
    policy.start(trainer, abstract)  # compiles while the state initialises and the data pipeline starts
    checkpoints = CheckpointHook(Checkpointer(cfg.run_dir / "checkpoints", save_every=tr.checkpoint_every,
                                              keep=tr.keep_checkpoints, async_save=tr.async_checkpointing,
                                              stream_host_gb=tr.checkpoint_host_gb),
                                 enabled=tr.checkpointing)
    ctx, records = _context(cfg, trainer, abstract, resumable, checkpoints.checkpointer, progress)
    start = records.start
    shape = flops.ModelShape.from_config(cfg.model)
    hooks = [ProfileHook(ProfileWindow(tr.profile_dir or cfg.run_dir / "profile", tr.profile_start_step,
                                       tr.profile_steps)),
             EvalHook(evaluator, tr.steps), checkpoints, AnswersHook(tr.show_answers, evaluator.enabled), PlotHook(),
             *extra_hooks]
    if evaluator.skipped:
        ctx.summary["evals_skipped"] = evaluator.skipped
    t0 = time.perf_counter()
    step = start
    try:
        for step in range(start + 1, tr.steps + 1):
            if not _train_step(ctx, hooks, step, start, shape, stop):  # stopped before the step ran
                step -= 1
                if step > start:
                    _stop_signalled(ctx, checkpoints, stop, step)
                else:
                    ctx.summary["stopped"] = _stopped_before_start(cfg, stop)["stopped"]
                break
            stop.phase = "training"
            for hook in hooks:
                hook.on_step(ctx, step)
            # diverged: the parameters are the last good ones (non-finite updates were skipped)
            if records.diverged is not None:
                _stop_diverged(ctx, checkpoints, records.guard, step)
            if stop.agreed():  # preemption / Ctrl-C: a checkpoint of this step, then a normal exit
                _stop_signalled(ctx, checkpoints, stop, step)
                break
            if stop_after is not None and step >= stop_after:
                log.info("stopping after step %d (interrupted run)", step)
                break
        ctx.flush()
        interrupted = ((stop_after is not None and step >= stop_after and step < tr.steps)
                       or "stopped" in ctx.summary)
        if not interrupted and step > start:
            checkpoints.save_final(ctx, step)  # closes the training loader; the write waited for
            for hook in hooks:
                hook.on_end(ctx, step)
    finally:
        for hook in hooks:
            hook.close(ctx)
        records.bar.close()
        ctx.writer.close()
        loader_summary = ctx.loader.summary()
        ctx.loader.close()  # again after save_final: closing twice is a no-op
    if ctx.summary.get("stopped", {}).get("step", 0) is None:  # no step ran: no summary to make
        return _stopped_before_start(cfg, stop, start)
    for hook in hooks:
        hook.on_summary(ctx)
    return _summary(ctx, records, step, time.perf_counter() - t0, loader_summary, checkpoints.saved)


def _stopped_before_start(cfg: RunConfig, stop: StopSignals, start: int | None = None) -> dict[str, Any]:
    """The summary of a run that a stop signal ended before its first step (``start``: the step it would have
    started from, None when it stopped before knowing)."""
    return {"run_dir": str(cfg.run_dir), "start_step": start,
            "stopped": {"signal": stop.name or "another process's signal", "step": None, "checkpoint": None,
                        "line": stop.before_start_line}}


def _log_interrupted(e: BaseException) -> None:
    log.info("stopping: what ran ended with %s: %s", type(e).__name__, (str(e).splitlines() or [""])[0][:300])


def _setup(cfg: RunConfig) -> tuple[list[int], Trainer, CompilePolicy, Evaluator]:
    """Everything before the state exists: the capture flags, the compilation cache, the run directory
    (checked, config.yaml written), the steps the run may resume from, the evaluator, the compile policy
    and the trainer with its shapes reserved. Returns ``(resumable steps newest first, trainer, policy,
    evaluator)``."""
    try:  # the CLI set the flags before the backend started; in-process callers must have the same
        capture.apply_capture(cfg.compute)
    except capture.CaptureError as e:
        raise ConfigError(f"compute.capture {cfg.compute.capture}: {e}") from None
    tr = cfg.train
    apply_compilation_cache(tr.compilation_cache_dir)
    resumable = resume_steps(cfg.run_dir / "checkpoints", tr.resuming, tr.resume_step)
    _check_run_dir(cfg.run_dir)
    if jax.process_index() == 0:
        save_config(cfg, cfg.run_dir)
    evaluator = Evaluator.from_config(cfg)
    policy = CompilePolicy.from_config(cfg, evaluates=evaluator.enabled)
    frozen = optim.frozen_groups(tr.freeze_vision_model, tr.freeze_vision_projection, tr.freeze_language_model)
    trainer = Trainer.create(cfg.model, cfg.compute, cfg.layout, cfg.optimizer, steps=tr.steps,
                             grad_accum=tr.grad_accum, frozen=frozen, param_groups=tr.param_groups,
                             reuse_shapes=policy.reuse_shapes)
    _log_model(trainer, frozen, tr.param_groups)
    policy.reserve(trainer)
    if trainer.data_parallel_size != cfg.data_parallel_size:
        raise ConfigError(f"data-parallel size {trainer.data_parallel_size} != config's {cfg.data_parallel_size}")
    log.info("batch: global %d rows x %d tokens = micro %d x accumulation %d x data-parallel %d",
             cfg.global_batch_size, tr.seq_len, tr.micro_batch_size, tr.grad_accum, cfg.data_parallel_size)
    return resumable, trainer, policy, evaluator


def _context(cfg: RunConfig, trainer: Trainer, abstract: Any, resumable: list[int], ckpt: Checkpointer,
             progress: bool | None) -> tuple[LoopContext, StepRecords]:
    """The state (restored from the newest of ``resumable`` that restores, or initialised), the loader (at
    the checkpoint's data position), the metrics writer, step tracker and progress bar, all from the step
    actually restored, as one :class:`LoopContext`, and the :class:`StepRecords` its ``record`` is."""
    tr = cfg.train
    start, data_state, skipped = 0, None, []
    if resumable:
        start, state, data_state, skipped = _resume(cfg, ckpt, abstract, resumable)
    else:
        state = trainer.init_state(tr.seed, params=_pretrained(tr.init_from, cfg, trainer))
    # the data's logical shards (data.num_shards, else one per process of the run's first start), kept by
    # the checkpoint: a run resumed with another process count reads the same batches
    num_shards = int(data_state["num_shards"]) if data_state else (cfg.data.num_shards or jax.process_count())
    loader = data_lib.build_loader(cfg.data, shard_index=jax.process_index(), shard_count=jax.process_count(),
                                   num_shards=num_shards)
    if data_state:
        loader.set_state(data_state)
    primary = jax.process_index() == 0
    writer = MetricsWriter(cfg.run_dir, tensorboard=tr.tensorboard, resume_step=start if start else None,
                           primary=primary)
    tracker = StepTracker(num_devices=trainer.mesh.devices.size, peak_flops=flops.peak_flops())
    record = StepRecords(writer, tracker, Progress(tr.steps, initial=start, enabled=progress if primary else False),
                         NonFiniteGuard(cfg.optimizer.max_consecutive_skips,
                                        int(jax.device_get(optim.skipped_updates(state["opt_state"])))),
                         log_every=tr.log_every, steps=tr.steps, start=start)
    summary: dict[str, Any] = {"run_dir": str(cfg.run_dir), "start_step": start, "steps": tr.steps, "evals": []}
    if skipped:
        summary["skipped_checkpoints"] = [dataclasses.asdict(s) for s in skipped]
    return LoopContext(cfg=cfg, trainer=trainer, state=state, loader=loader, writer=writer, tracker=tracker,
                       summary=summary, primary=primary, record=record), record


def _resume(cfg: RunConfig, ckpt: Checkpointer, abstract: Any, resumable: list[int]
            ) -> tuple[int, Any, Any, list[Skipped]]:
    """``(step, state, data state, skipped)`` of the checkpoint the run resumes from: exactly
    ``train.resume_step`` (a RestoreError when it does not restore), else the newest of ``resumable`` that
    restores. Newer checkpoints are set aside (damaged ones, or those past the step asked for), so that the
    run writes those steps anew; the resume's log line names them."""
    asked = cfg.train.resume_step
    if asked is not None:
        state, data_state = ckpt.restore(abstract, step=asked)
        step, tag = asked, "superseded"
        skipped = [Skipped(s, f"newer than train.resume_step={asked}") for s in ckpt.all_steps()[::-1] if s > asked]
    else:
        restored = ckpt.restore_newest(abstract, resumable)
        step, state, data_state, skipped, tag = (restored.step, restored.state, restored.data_state,
                                                 list(restored.skipped), "damaged")
    skipped = _set_aside(ckpt, skipped, tag)
    where = cfg.run_dir / "checkpoints"
    if skipped:
        log.warning("resumed from step %d, not the newest checkpoint %d, in %s: %s", step, skipped[0].step, where,
                    "; ".join(f"{s.step} skipped ({s.reason}), kept as {s.kept_as or s.step}" for s in skipped))
    else:
        log.info("resumed from step %d (%s)", step, where)
    return step, state, data_state, skipped


def _set_aside(ckpt: Checkpointer, skipped: list[Skipped], tag: str) -> list[Skipped]:
    """``skipped``'s directories renamed ``<step>.<tag>`` by the primary process (every process waits for it),
    and the checkpointer's steps read again."""
    if not skipped:
        return []
    if jax.process_index() == 0:
        skipped = set_aside(ckpt.directory, skipped, tag)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("checkpoints set aside")
    ckpt.reload()
    return skipped


class StepRecords:
    """A finished step's record (from the tracker) -> the non-finite guard, the run's timed totals, the
    progress bar, and every ``train.log_every`` steps (and the first and last) metrics.jsonl plus a log
    line when no bar is shown. ``diverged``: the step at which too many updates in a row were skipped.

    Several processes: a record's host counts (tokens, useful tokens, FLOPs, samples, data skips) are this
    process's rows'; a logged record has them summed over the processes with the throughput window
    (``StepTracker.window``), and the bar shows between logged steps the last logged record's (run's) skips and
    throughput. ``timed`` is this process's until the summary sums it."""

    SHOWN = ("tokens_per_s", "useful_fraction", "mfu", "data_skipped")  # kept on the bar from the last logged

    def __init__(self, writer: MetricsWriter, tracker: StepTracker, bar: Progress, guard: NonFiniteGuard, *,
                 log_every: int, steps: int, start: int) -> None:
        self.writer, self.tracker, self.bar, self.guard = writer, tracker, bar, guard
        self.log_every, self.steps, self.start = log_every, steps, start
        self.timed = {"time": 0.0, "useful_tokens": 0.0, "flops": 0.0}
        self.diverged: int | None = None
        self._shown: dict[str, Any] = {}

    def __call__(self, record: dict[str, Any] | None) -> None:
        if record is None:
            return
        step = record["step"]
        if "skipped" in record and self.guard.update(step, record["skipped"]) and self.diverged is None:
            self.diverged = step
        if "step_time_s" in record:
            self.timed["time"] += record["step_time_s"]
            self.timed["useful_tokens"] += record.get("useful_tokens", 0.0)
            self.timed["flops"] += record.get("flops", 0.0)
        if not (step % self.log_every == 0 or step == self.steps or step == self.start + 1):
            self.bar.update(step, {**record, **self._shown})
            return
        record = {**record, "tokens_per_s": None, **self.tracker.window(record)}  # the run's counts
        self._shown = {k: record.get(k) for k in self.SHOWN}
        self.writer.write(step, record)
        self.bar.update(step, record)
        if self.bar.bar.disable:
            log.info("step %d/%d: %s", step, self.steps, progress_postfix(record))


def _train_step(ctx: LoopContext, hooks: Sequence[Hook], step: int, start: int, shape: flops.ModelShape,
                stop: StopSignals) -> bool:
    """One step: the next batch, its step compiled when new, the step dispatched (``ctx.state`` replaced), its
    metrics queued with the batch's counts and FLOPs (``shape``: the model's, for them); out of device memory
    becomes a ConfigError saying what to change. False, with nothing dispatched, when a stop signal came before
    the step could run: while the batch was read or its step compiled, or (the first step) any time before, also
    when the compile or the data failed then (the signal reaches the compiler's and the data's child processes)."""
    trainer, tracker = ctx.trainer, ctx.tracker
    first = step == start + 1
    try:
        if first:
            trainer.wait_ahead()  # a compile started ahead (it may have failed: the signal reached its compiler)
            stop.phase = "start-up"  # the data's first batch
            if stop.agreed():
                return False
        host = next(ctx.loader)
        batch: DeviceBatch = trainer.prepare(host)
        compiles = len(trainer.compiled)
        if first:
            stop.phase = "compile"
        if (trainer.compile_step(ctx.state, batch) or first) and stop.agreed():
            return False
    except Exception as e:
        if stop.received is not None:  # the signal ended the compile's or the data's child processes
            _log_interrupted(e)
            return False
        if memory.is_oom(e):
            raise _oom_error(ctx, step, e) from None
        raise
    for hook in hooks:
        hook.before_step(ctx, step)
    try:
        ctx.state, metrics = trainer.step(ctx.state, batch)
        if first:  # time to the first step: the one sync of the run that is not a read
            jax.block_until_ready(metrics)
            ctx.summary["first_step_s"] = process_age_s()
        for hook in hooks:
            hook.after_step(ctx, step, metrics)
        stats = host["stats"]
        # this process's rows' counts (summed over the processes when logged); trained_tokens is the step's own
        # (a device metric of the global batch)
        counts = {"tokens": batch.counts["tokens"], "useful_tokens": batch.counts["useful_tokens"],
                  "flops": flops.batch_flops(shape, host), "samples": float(stats["samples"]),
                  "data_skipped": float(sum(stats.get("skipped_total", {}).values()))}
        # a step that compiled (a new patch bucket): the interval before it holds the compile, and its own
        # starts from that late reading (the H200 read 0.549 s for 0.70 s): neither counts
        fresh = len(trainer.compiled) > compiles
        if fresh:
            tracker.discard_next_interval()
        ctx.record(tracker.push(step, metrics, counts))
        if fresh:
            tracker.discard_next_interval()
    except Exception as e:
        if not memory.is_oom(e):
            raise
        raise _oom_error(ctx, step, e) from None
    return True


def _oom_error(ctx: LoopContext, step: int, e: Exception) -> ConfigError:
    """Out of device memory in (the compile of) train step ``step``: what does not fit and what to change."""
    cfg, trainer = ctx.cfg, ctx.trainer
    tr, name = cfg.train, cfg.model.name or "MODEL"
    return ConfigError(
        f"out of device memory in train step {step} ({name}, layout "
        f"{cfg.layout.name}, {trainer.mesh.devices.size} device(s), MBS {tr.micro_batch_size} x {tr.seq_len} "
        "tokens "
        f"per data-parallel rank, param_dtype {cfg.compute.param_dtype}, optimizer state "
        f"{cfg.optimizer.state_dtype}, recompute {cfg.compute.recompute}): "
        f"{str(e).splitlines()[0][:300]}. "
        + memory.oom_advice(name, cfg.layout.name, tr.micro_batch_size, tr.seq_len))


def _stop_diverged(ctx: LoopContext, checkpoints: CheckpointHook, guard: NonFiniteGuard, step: int) -> None:
    """Too many non-finite updates in a row: a checkpoint of the last good parameters, then TrainingStopped."""
    ctx.flush()
    checkpoints.save(ctx, step, force=True)
    checkpoints.wait()
    ckpt = checkpoints.checkpointer
    raise TrainingStopped(
        f"{guard.in_a_row} optimizer updates in a row had non-finite gradients (steps {guard.first}.."
        f"{step}, optimizer.max_consecutive_skips={guard.limit}); the run stopped, checkpoint "
        f"{ckpt.latest_step()} in {ctx.run_dir / 'checkpoints'} holds the last good parameters. Lower optimizer.lr, "
        f"check the data, or raise optimizer.max_consecutive_skips")


def _stop_signalled(ctx: LoopContext, checkpoints: CheckpointHook, stop: StopSignals, step: int) -> None:
    """A stop signal every process agreed on: a checkpoint of this step, said in the summary."""
    ctx.flush()
    checkpoints.save(ctx, step, force=True)
    checkpoints.wait()
    ctx.summary["stopped"] = {"signal": stop.name or "another process's signal", "step": step,
                              "checkpoint": checkpoints.checkpointer.latest_step()}


def _summary(ctx: LoopContext, records: StepRecords, step: int, wall: float, loader_summary: dict[str, Any],
             saved: list[int]) -> dict[str, Any]:
    """The run summary: steps, wall time, compiles, loss first -> last, throughput, skips, data, checkpoints,
    peak memory (with what the hooks put there: evaluations, answers, curves)."""
    trainer, summary = ctx.trainer, ctx.summary
    # the run's totals: every process's tokens, FLOPs and data (one exchange); the timed span is this process's
    parts = gather_json({"timed": {k: records.timed[k] for k in ("useful_tokens", "flops")},
                         "data": loader_summary})
    timed = {**sum_values([p["timed"] for p in parts]), "time": records.timed["time"]}
    every = read_metrics(ctx.run_dir) if (ctx.run_dir / "metrics.jsonl").exists() else []
    losses = [r for r in every if "loss" in r]
    summary.update({
        "end_step": step, "wall_s": wall, "compiles": len(trainer.compiled), "compiled_ahead": trainer.ahead_steps,
        "evals_compiled_ahead": trainer.ahead_evals,
        "loss_first": losses[0]["loss"] if losses else None, "loss_last": losses[-1]["loss"] if losses else None,
        "first_step": losses[0]["step"] if losses else None, "last_step": losses[-1]["step"] if losses else None,
        "tokens_per_s": timed["useful_tokens"] / timed["time"] if timed["time"] else None,
        "tflops_per_device": (timed["flops"] / timed["time"] / trainer.mesh.devices.size / 1e12
                              if timed["time"] else None),
        "skipped_updates": int(jax.device_get(optim.skipped_updates(ctx.state["opt_state"]))),
        "data": data_lib.merge_summaries([p["data"] for p in parts]), "checkpoints": saved,
        "peak_memory_gib": peak_memory_gib(),
    })
    return summary


def peak_memory_gib() -> float | None:
    """The largest peak of this process's devices (``memory_stats()['peak_bytes_in_use']``) in GiB; None
    where the backend keeps no statistics (CPU)."""
    peaks = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - backends without statistics
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) / 2**30 if peaks else None


def _check_run_dir(run_dir: Path, need_bytes: int = 0) -> None:
    try:
        check_run_dir(run_dir, need_bytes)
    except OSError as e:
        raise ConfigError(str(e)) from None


def _pretrained(path: str | None, cfg: RunConfig, trainer: Trainer) -> Any:
    if not path:
        return None
    from moevlm_jax.hf import load_pretrained

    model, _ = load_pretrained(path, np.dtype(cfg.compute.param_dtype), compute=cfg.compute)
    params = nnx.to_pure_dict(nnx.state(model, (nnx.Param, ExpertBias)))  # + router state (zeros)
    have = {jax.tree_util.keystr(k): tuple(x.shape) for k, x in jax.tree_util.tree_leaves_with_path(params)}
    want = {jax.tree_util.keystr(k): tuple(x.shape)
            for k, x in jax.tree_util.tree_leaves_with_path(trainer.abstract_params)}
    if have != want:
        diff = [f"{k}: checkpoint {have.get(k, 'absent')}, model {want.get(k, 'absent')}"
                for k in sorted(have.keys() | want.keys()) if have.get(k) != want.get(k)]
        raise ConfigError(f"train.init_from {path}: the checkpoint's parameters differ from the configured model "
                          f"{cfg.model.name!r} in {len(diff)} tensors, first {'; '.join(diff[:3])}. Train the "
                          f"checkpoint's own architecture with --model {path} (or leave --model out: train.init_from "
                          "alone takes the model from the checkpoint)")
    return params


def _log_model(trainer: Trainer, frozen: set[str], groups: Any) -> None:
    sizes = optim.group_sizes(trainer.abstract_params, groups)
    total = sum(sizes.values())
    parts = ", ".join(f"{g} {n / 1e6:.2f}M{' (frozen)' if g in frozen else ''}" for g, n in sizes.items())
    log.info("model %s: %.2fM parameters (%s); compute %s, params %s", trainer.spec.model.name, total / 1e6, parts,
             trainer.spec.compute.dtype, trainer.spec.compute.param_dtype)


