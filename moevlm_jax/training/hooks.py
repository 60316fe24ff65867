"""What hangs on the training loop: a small hook protocol and the train job's hooks.

The loop (``moevlm_jax.training.loop.run``) calls every hook, in list order, at each event:

- ``before_step(ctx, step)``: before the step is dispatched;
- ``after_step(ctx, step, metrics)``: right after it is dispatched (``metrics`` still on the device);
- ``on_step(ctx, step)``: once the step's metrics are queued (evaluation, periodic checkpoints);
- ``on_end(ctx, step)``: a run that did all its steps, after the final checkpoint (the last evaluation,
  the generated answers): the training loader is closed by then and the checkpoint on disk, so that
  neither its worker processes nor the state's host copy share the host with them;
- ``close(ctx)``: always, also on an error (the profiler's trace, pending checkpoint writes);
- ``on_summary(ctx)``: a run that returned normally (finished, stopped or interrupted), once everything
  is closed (the curves' picture).

The train job's hooks, in its order: :class:`ProfileHook`, :class:`EvalHook`, :class:`CheckpointHook`,
:class:`AnswersHook`, :class:`PlotHook`; ``loop.run(cfg, hooks=[...])`` appends more. A hook that takes
time out of the step interval (an evaluation, a checkpoint write) calls ``ctx.pause()`` so that throughput
leaves that interval out.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import moevlm_jax.data as data_lib
from moevlm_jax.parallelism.multihost import gather_json
from moevlm_jax.training.checkpoint import Checkpointer
from moevlm_jax.training.evaluator import Evaluator, eval_record
from moevlm_jax.training.metrics import (
    MetricsWriter,
    ProfileWindow,
    StepTracker,
    plot_curves,
    read_metrics,
)

if TYPE_CHECKING:
    from moevlm_jax.config.run import RunConfig
    from moevlm_jax.training.trainer import Trainer

log = logging.getLogger("moevlm_jax.train")


@dataclasses.dataclass
class LoopContext:
    """What a hook may read or use: the run's config, trainer, current ``state`` (the loop replaces it
    each step), the training loader, the metrics writer and step tracker, the summary being built, whether
    this is the primary process, and ``record`` (a finished step record -> progress bar, metrics.jsonl,
    logs)."""

    cfg: RunConfig
    trainer: Trainer
    state: Any
    loader: Any
    writer: MetricsWriter
    tracker: StepTracker
    summary: dict[str, Any]
    primary: bool
    record: Callable[[dict[str, Any] | None], None]

    @property
    def run_dir(self) -> Path:
        return self.cfg.run_dir

    def flush(self) -> None:
        """Wait for the last dispatched step and record it (before anything that reads the state)."""
        self.record(self.tracker.flush())

    def pause(self) -> None:
        """Leave the next step interval out of throughput (it holds this hook's work)."""
        self.tracker.discard_next_interval()


class Hook:
    """A loop hook: every event a no-op unless overridden (see the module docstring)."""

    def before_step(self, ctx: LoopContext, step: int) -> None:
        pass

    def after_step(self, ctx: LoopContext, step: int, metrics: Any) -> None:
        pass

    def on_step(self, ctx: LoopContext, step: int) -> None:
        pass

    def on_end(self, ctx: LoopContext, step: int) -> None:
        pass

    def close(self, ctx: LoopContext) -> None:
        pass

    def on_summary(self, ctx: LoopContext) -> None:
        pass


class ProfileHook(Hook):
    """``train.profile_steps`` steps from ``train.profile_start_step`` traced with the JAX profiler."""

    def __init__(self, window: ProfileWindow) -> None:
        self.window = window

    def before_step(self, ctx: LoopContext, step: int) -> None:
        self.window.before_step(step)

    def after_step(self, ctx: LoopContext, step: int, metrics: Any) -> None:
        self.window.after_step(step, metrics)

    def close(self, ctx: LoopContext) -> None:
        self.window.close()


class EvalHook(Hook):
    """The evaluator every ``train.eval_every`` steps and at the end: its record in metrics.jsonl, its result
    in ``summary["evals"]``."""

    def __init__(self, evaluator: Evaluator, last_step: int) -> None:
        self.evaluator, self.last_step = evaluator, last_step

    def on_step(self, ctx: LoopContext, step: int) -> None:
        if self.evaluator.due(step, self.last_step):
            ctx.flush()
            self._evaluate(ctx, step, final=False)
            ctx.pause()

    def on_end(self, ctx: LoopContext, step: int) -> None:
        if self.evaluator.enabled:
            self._evaluate(ctx, step, final=True)

    def _evaluate(self, ctx: LoopContext, step: int, final: bool) -> None:
        result = self.evaluator(ctx.trainer, ctx.state["params"], step, final=final)
        ctx.writer.write(step, eval_record(result))
        ctx.summary["evals"].append({"step": step, **result})


class CheckpointHook(Hook):
    """Periodic checkpoints (``train.checkpoint_every``) of the state and the data iterator; :meth:`save` a
    forced one (the end of a run, a stop signal, non-finite updates); none at all with
    ``enabled=False`` (``train.checkpointing=false``). ``saved``: the kept steps once closed."""

    def __init__(self, checkpointer: Checkpointer, enabled: bool = True) -> None:
        self.checkpointer, self.enabled = checkpointer, enabled
        self.saved: list[int] = []

    def on_step(self, ctx: LoopContext, step: int) -> None:
        if self.save(ctx, step):
            ctx.pause()

    def save(self, ctx: LoopContext, step: int, force: bool = False) -> bool:
        """Start a checkpoint (periodic, or ``force``); a failed write is reported and training goes on with
        the previous checkpoints kept. Returns whether one started."""
        if not self.enabled:
            return False
        try:  # every process's data shards in one state (the primary writes it), so any process count resumes
            data_state = data_lib.merge_states(gather_json(ctx.loader.get_state()))
        except Exception as e:  # noqa: BLE001 - as below
            return self._failed(step, e)
        return self._write(ctx, step, data_state, force)

    def save_final(self, ctx: LoopContext, step: int) -> bool:
        """The end of a run's checkpoint with the least host memory alongside: the data iterator's state read,
        then the training loader closed (its worker processes and the batches they buffer gone before the
        state is copied to the host), then the state streamed to disk (at most ``train.checkpoint_host_gb`` of
        it on the host at once, see :meth:`Checkpointer.save`) and waited for, before the final evaluation and
        the answers run. The loader is closed also without checkpointing. Returns whether a checkpoint was
        written."""
        data_state, failed = None, None
        if self.enabled:
            try:
                data_state = data_lib.merge_states(gather_json(ctx.loader.get_state()))
            except Exception as e:  # noqa: BLE001 - as save
                failed = e
        ctx.loader.close()
        if not self.enabled:
            return False
        if failed is not None:
            return self._failed(step, failed)
        started = self._write(ctx, step, data_state, force=True, streamed=True)
        self.wait()
        if started and step in self.checkpointer.all_steps() and self.checkpointer.streams:
            ckpt = self.checkpointer
            log.info("final checkpoint streamed: at most %.1f MB of the state on the host at once (of %.1f MB)",
                     ckpt.last_host_peak_bytes / 1e6, ckpt.last_state_bytes / 1e6)
        return started

    def _write(self, ctx: LoopContext, step: int, data_state: Any, force: bool, streamed: bool = False) -> bool:
        try:  # orbax writes each process's own shards of the device arrays (no gather to one host)
            return self.checkpointer.save(step, ctx.state, data_state, force=force, streamed=streamed)
        except Exception as e:  # noqa: BLE001 - a disk / storage fault must not lose the run
            return self._failed(step, e)

    def _failed(self, step: int, e: BaseException) -> bool:
        log.error("checkpoint at step %d failed (%s: %s); the previous checkpoints %s are kept", step,
                  type(e).__name__, str(e).splitlines()[0][:300], self.checkpointer.all_steps())
        return False

    def wait(self) -> None:
        """Wait for pending writes; an asynchronous write that failed is reported, not raised."""
        try:
            self.checkpointer.wait()
        except Exception as e:  # noqa: BLE001 - as save
            log.error("a checkpoint write failed (%s: %s); the checkpoints on disk are %s", type(e).__name__,
                      str(e).splitlines()[0][:300], self.checkpointer.all_steps())

    def close(self, ctx: LoopContext) -> None:
        self.wait()
        self.saved = self.checkpointer.all_steps()
        self.checkpointer.close()


class AnswersHook(Hook):
    """At the end of a run that evaluates: the first ``count`` held-out questions answered by greedy
    generation, in ``summary["answers"]`` and ``<run_dir>/answers.jsonl`` (``train.show_answers``)."""

    def __init__(self, count: int, enabled: bool) -> None:
        self.count, self.enabled = count, enabled and count > 0

    def on_end(self, ctx: LoopContext, step: int) -> None:
        if not self.enabled:
            return
        try:
            ctx.summary["answers"] = answers(ctx.cfg, ctx.state, self.count)
            if ctx.primary and ctx.summary["answers"]:
                path = ctx.run_dir / "answers.jsonl"
                path.write_text("".join(json.dumps({"step": step, **r}) + "\n" for r in ctx.summary["answers"]))
        except Exception as e:  # noqa: BLE001 - a demonstration must never fail a finished run
            log.warning("answers not generated: %s: %s", type(e).__name__, str(e).splitlines()[0][:300])


class PlotHook(Hook):
    """The curves of metrics.jsonl as ``<run_dir>/curves.png`` (primary process), named in
    ``summary["curves"]``."""

    def on_summary(self, ctx: LoopContext) -> None:
        if not ctx.primary:
            return
        cfg = ctx.cfg
        every = read_metrics(ctx.run_dir) if (ctx.run_dir / "metrics.jsonl").exists() else []
        try:
            title = f"{cfg.name}: {cfg.model.name}, layout {cfg.layout.name}"
            png = plot_curves(every, ctx.run_dir / "curves.png", title)
            ctx.summary["curves"] = str(png) if png else None
        except Exception as e:  # noqa: BLE001 - a plot must never fail a finished run
            log.warning("curves.png not written: %s", e)


def answers(cfg: RunConfig, state: Any, count: int) -> list[dict[str, Any]] | None:
    """The first ``count`` questions of the held-out split answered by greedy generation (every process
    runs it: the parameters are global arrays) -> rows ``{"question", "answer", "generated", "match"}``;
    None (with the reason logged) for a model family generation does not cover."""
    from moevlm_jax import inference
    from moevlm_jax.data.records import RecordError
    from moevlm_jax.data.sample import read_record
    from moevlm_jax.data.sources import build_source
    from moevlm_jax.data.tokenizer import load_tokenizer
    from moevlm_jax.model import registry

    if registry.family_of(cfg.model).name != "qwen3_vl_moe":
        log.info("answers: generation covers Qwen3-VL-MoE models (python -m moevlm_jax.generate); none shown")
        return None
    t = time.perf_counter()
    source, _ = build_source(cfg.data, cfg.data.eval_split)
    questions: list[Any] = []
    for i in range(len(source)):
        if len(questions) >= count:
            break
        try:  # a shard record, or a LLaVA / messages JSON entry
            record = read_record(source[i])
        except RecordError:
            continue  # counted by the pipeline; nothing to ask
        questions += inference.record_questions(record)[: count - len(questions)]
    model = inference.model_for_generation(cfg.model, cfg.compute, state["params"])
    rows = inference.answer_questions(model, load_tokenizer(cfg.data.tokenizer), questions, image_config=cfg.data.image,
                                      video_config=cfg.data.video, system_prompt=cfg.data.system_prompt,
                                      max_new_tokens=16)
    log.info("answers: %d held-out questions generated (%.1fs)", len(rows), time.perf_counter() - t)
    return rows
