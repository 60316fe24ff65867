"""The training loop: config -> mesh -> sharded state + compiled step -> loader -> steps, metrics,
evaluation, checkpoints, profile window -> the run summary.

``run(cfg)`` is what ``python -m moevlm_jax.train`` runs (the CLI owns the terminal: progress bar,
summary table); ``--resume`` continues the run in its directory from its latest checkpoint:
parameters, optimizer state, step, RNG and the data iterator.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

import moevlm_jax.data as data_lib
from moevlm_jax.config.run import RunConfig, save_config
from moevlm_jax.model.router import ExpertBias
from moevlm_jax.parallelism.multihost import gather_json
from moevlm_jax.perf import flops, memory
from moevlm_jax.schema import ConfigError
from moevlm_jax.training import capture
from moevlm_jax.training import optimizer as optim
from moevlm_jax.training.checkpoint import Checkpointer, resume_step
from moevlm_jax.training.faults import NonFiniteGuard, StopSignals, TrainingStopped, check_run_dir
from moevlm_jax.training.metrics import (
    MetricsWriter,
    ProfileWindow,
    Progress,
    StepTracker,
    plot_curves,
    process_age_s,
    progress_postfix,
    read_metrics,
)
from moevlm_jax.training.trainer import Trainer

log = logging.getLogger("moevlm_jax.train")


# ----------------------------------------------------------------------------- evaluation

def evaluate(trainer: Trainer, params: Any, data_cfg: Any, *, rows: int, batches: int) -> dict[str, Any]:
    """Held-out split: teacher-forced loss on the answer tokens and exact-match answer accuracy per
    question type (``data.answer_accuracy``) over the first ``batches`` batches of ``rows`` rows."""
    loader = data_lib.build_loader(data_cfg, batch_size=rows, split="heldout", shard_index=jax.process_index(),
                                   shard_count=jax.process_count())
    ce = tokens = 0.0
    parts = []
    try:
        held = [batch for _, batch in zip(range(batches), loader)]
        trainer.reserve(held)  # one compiled eval step for all of them (train.reuse_shapes)
        for batch in held:
            metrics, pred = trainer.evaluate(params, batch)
            ce, tokens = ce + metrics["ce_sum"], tokens + metrics["tokens"]
            parts.append(data_lib.answer_accuracy(batch, pred))
    finally:
        loader.close()
    accuracy = data_lib.merge_accuracy(parts, data_lib.question_chance(data_cfg)) if parts else {}
    return {"loss": ce / max(tokens, 1.0), "tokens": tokens, "accuracy": accuracy}


def eval_record(result: dict[str, Any]) -> dict[str, float]:
    """Flat metrics of an evaluation: eval_loss, eval_accuracy, eval_accuracy_<type>, eval_answers."""
    out = {"eval_loss": result["loss"]}
    for key, e in result["accuracy"].items():
        name = "eval_accuracy" if key == "all" else f"eval_accuracy_{key}"
        out[name] = e["accuracy"]
    out["eval_answers"] = result["accuracy"].get("all", {}).get("answers", 0)
    return out


def apply_compilation_cache(path: str | None) -> Path | None:
    """Point JAX's persistent compilation cache at ``path`` (``train.compilation_cache_dir``, ``~``
    expanded, created): a later run of the same program on the same devices loads its compiled steps
    instead of compiling them (unrolled layers take ~60 s a batch shape on the H200, bench/step_h200.md).
    The cache is re-checked, so this works in a process that compiled already. None: unchanged."""
    if not path:
        return None
    from jax.experimental.compilation_cache import compilation_cache as cc

    where = Path(path).expanduser()
    where.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != str(where):
        cc.reset_cache()  # JAX decides once per process whether a cache is used
        cc.set_cache_dir(str(where))
        log.info("compilation cache: %s", where)
    return where


# ----------------------------------------------------------------------------- the loop

def run(cfg: RunConfig, *, stop_after: int | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Train per ``cfg``; returns the run summary. ``stop_after``: leave the loop after that step
    without the final checkpoint, as an interrupted run would (tests, time boxes)."""
    try:  # the CLI set the flags before the backend started; in-process callers must have the same
        capture.apply_capture(cfg.compute)
    except capture.CaptureError as e:
        raise ConfigError(f"compute.capture {cfg.compute.capture}: {e}") from None
    tr = cfg.train
    apply_compilation_cache(tr.compilation_cache_dir)
    run_dir = cfg.run_dir
    ckpt_dir = run_dir / "checkpoints"
    start = resume_step(ckpt_dir, tr.resume) or 0
    _check_run_dir(run_dir)
    if jax.process_index() == 0:
        save_config(cfg, run_dir)
    frozen = optim.frozen_groups(tr.freeze_vision_model, tr.freeze_vision_projection, tr.freeze_language_model)
    trainer = Trainer.create(cfg.model, cfg.compute, cfg.layout, cfg.optimizer, steps=tr.steps,
                             grad_accum=tr.grad_accum, frozen=frozen, param_groups=tr.param_groups,
                             reuse_shapes=tr.reuse_shapes)
    _log_model(trainer, frozen, tr.param_groups)
    ahead = None  # (batch, capacity) of the training step compiled from the start (train.compile_ahead)
    if tr.reserve_largest_bucket:
        if not tr.reuse_shapes:
            log.warning("train.reserve_largest_bucket has no effect with train.reuse_shapes=false")
        elif cfg.data.patch_buckets:
            bucket = tr.reserve_bucket or cfg.data.max_patches
            if bucket not in cfg.data.patch_buckets:
                raise ConfigError(f"train.reserve_bucket {bucket} is not one of data.patch_buckets "
                                  f"{list(cfg.data.patch_buckets)}")
            rows = cfg.global_batch_size // jax.process_count()
            capacity = trainer.largest_capacity(rows, tr.seq_len) if tr.compile_ahead else 0
            trainer.reserve_patches(bucket, capacity=capacity)
            log.info("train steps padded to the patch bucket %d (train.reserve_largest_bucket; largest %d)",
                     bucket, cfg.data.max_patches)
            if tr.compile_ahead:
                ahead = trainer.abstract_batch(tr.micro_batch_size, tr.seq_len, bucket,
                                               cfg.data.balance_vision_rows), capacity
        elif tr.compile_ahead:
            log.warning("train.compile_ahead has no effect: the data has no patch buckets (data.patch_buckets)")
    if trainer.data_parallel_size != cfg.data_parallel_size:
        raise ConfigError(f"data-parallel size {trainer.data_parallel_size} != config's {cfg.data_parallel_size}")
    log.info("batch: global %d rows x %d tokens = micro %d x accumulation %d x data-parallel %d",
             cfg.global_batch_size, tr.seq_len, tr.micro_batch_size, tr.grad_accum, cfg.data_parallel_size)
    abstract = trainer.abstract_state()
    # room for the checkpoints kept at once (+1 while the next is written), as many as the run writes; checked
    # before a compile starts (a process leaving with XLA compiling in a thread can crash on its way out)
    saves = (tr.steps // tr.checkpoint_every if tr.checkpoint_every else 0) + 1 if tr.checkpointing else 0
    _check_run_dir(run_dir, min(tr.keep_checkpoints + 1, saves)
                   * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract)))
    evals = data_lib.has_heldout(cfg.data)
    if ahead is not None:  # compiles while the state initialises and the data pipeline starts
        trainer.compile_ahead(abstract, *ahead, kernels_ahead=tr.kernels_ahead)
        if evals and (tr.eval_every or tr.eval_batches) and tr.eval_ahead:  # then the eval step, for the same rows
            trainer.reserve_patches(bucket, capacity=ahead[1], train=False)
            trainer.compile_eval_ahead(abstract["params"], trainer.abstract_eval_batch(
                tr.micro_batch_size, tr.seq_len, bucket, cfg.data.balance_vision_rows), ahead[1],
                kernels_ahead=tr.kernels_ahead)
    ckpt = Checkpointer(ckpt_dir, save_every=tr.checkpoint_every, keep=tr.keep_checkpoints,
                        async_save=tr.async_checkpointing)
    data_state = None
    if start:
        state, data_state = ckpt.restore(abstract, step=start)
        log.info("resumed from step %d (%s)", start, ckpt_dir)
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
    writer = MetricsWriter(run_dir, tensorboard=tr.tensorboard, resume_step=start if start else None, primary=primary)
    tracker = StepTracker(num_devices=trainer.mesh.devices.size, peak_flops=flops.peak_flops())
    shape = flops.ModelShape.from_config(cfg.model)
    profile = ProfileWindow(tr.profile_dir or run_dir / "profile", tr.profile_start_step, tr.profile_steps)
    bar = Progress(tr.steps, initial=start, enabled=progress if primary else False)
    eval_rows = tr.micro_batch_size * cfg.data_parallel_size // jax.process_count()
    summary: dict[str, Any] = {"run_dir": str(run_dir), "start_step": start, "steps": tr.steps, "evals": []}
    t0 = time.perf_counter()
    timed = {"time": 0.0, "useful_tokens": 0.0, "flops": 0.0}
    guard = NonFiniteGuard(cfg.optimizer.max_consecutive_skips,
                           int(jax.device_get(optim.skipped_updates(state["opt_state"]))))
    diverged: list[int] = []

    def handle(record: dict[str, Any] | None) -> None:
        if record is None:
            return
        step = record["step"]
        if "skipped" in record and guard.update(step, record["skipped"]) and not diverged:
            diverged.append(step)
        if "step_time_s" in record:
            timed["time"] += record["step_time_s"]
            timed["useful_tokens"] += record.get("useful_tokens", 0.0)
            timed["flops"] += record.get("flops", 0.0)
        bar.update(step, record)
        if step % tr.log_every == 0 or step == tr.steps or step == start + 1:
            record = {**record, "tokens_per_s": None, **tracker.window()}
            writer.write(step, record)
            if not bar.bar.disable:
                return
            log.info("step %d/%d: %s", step, tr.steps, progress_postfix(record))

    save = _save if tr.checkpointing else (lambda *a, **k: False)  # train.checkpointing=false: none written
    if not evals and (tr.eval_every or tr.eval_batches):
        log.warning("evaluation skipped: the %s source has no held-out split and data.heldout_fraction is 0 "
                    "(give the source a held-out split, or a data.heldout_fraction > 0)", cfg.data.kind)
        summary["evals_skipped"] = "no held-out split"
    step = start
    with StopSignals() as stop:
        try:
            for step in range(start + 1, tr.steps + 1):
                host = next(loader)
                batch = trainer.prepare(host)
                profile.before_step(step)
                try:
                    compiles = len(trainer.compiled)
                    state, metrics = trainer.step(state, batch)
                    if step == start + 1:  # time to the first step: the one sync of the run that is not a read
                        jax.block_until_ready(metrics)
                        summary["first_step_s"] = process_age_s()
                    profile.after_step(step, metrics)
                    skipped = host["stats"].get("skipped_total", {})
                    # a step that compiled (a new patch bucket): the interval before it holds the compile, and
                    # its own starts from that late reading (the H200 read 0.549 s for 0.70 s): neither counts
                    fresh = len(trainer.compiled) > compiles
                    if fresh:
                        tracker.discard_next_interval()
                    handle(tracker.push(step, metrics, {**batch.counts, "flops": flops.batch_flops(shape, host),
                                                        "data_skipped": float(sum(skipped.values()))}))
                    if fresh:
                        tracker.discard_next_interval()
                except Exception as e:  # out of device memory: say what does not fit and what to change
                    if not memory.is_oom(e):
                        raise
                    name = cfg.model.name or "MODEL"
                    raise ConfigError(
                        f"out of device memory in train step {step} ({name}, layout {cfg.layout.name}, "
                        f"{trainer.mesh.devices.size} device(s), MBS {tr.micro_batch_size} x {tr.seq_len} tokens per "
                        f"data-parallel rank, param_dtype {cfg.compute.param_dtype}, optimizer state "
                        f"{cfg.optimizer.state_dtype}, recompute {cfg.compute.recompute}): "
                        f"{str(e).splitlines()[0][:300]}. "
                        + memory.oom_advice(name, cfg.layout.name, tr.micro_batch_size, tr.seq_len)) from None
                if evals and tr.eval_every and step % tr.eval_every == 0 and step != tr.steps:
                    handle(tracker.flush())
                    _eval(trainer, state, cfg.data, eval_rows, tr.eval_batches, step, writer, summary)
                    tracker.discard_next_interval()
                if save(ckpt, step, state, loader):
                    tracker.discard_next_interval()
                if diverged:  # the parameters are the last good ones: updates with non-finite gradients were skipped
                    handle(tracker.flush())
                    save(ckpt, step, state, loader, force=True)
                    _wait(ckpt)
                    raise TrainingStopped(
                        f"{guard.in_a_row} optimizer updates in a row had non-finite gradients (steps {guard.first}.."
                        f"{step}, optimizer.max_consecutive_skips={guard.limit}); the run stopped, checkpoint "
                        f"{ckpt.latest_step()} in {ckpt_dir} holds the last good parameters. Lower optimizer.lr, "
                        f"check the data, or raise optimizer.max_consecutive_skips")
                if stop.agreed():  # preemption / Ctrl-C: a checkpoint of this step, then a normal exit
                    handle(tracker.flush())
                    save(ckpt, step, state, loader, force=True)
                    _wait(ckpt)
                    summary["stopped"] = {"signal": stop.name or "another process's signal", "step": step,
                                          "checkpoint": ckpt.latest_step()}
                    break
                if stop_after is not None and step >= stop_after:
                    log.info("stopping after step %d (interrupted run)", step)
                    break
            handle(tracker.flush())
            interrupted = (stop_after is not None and step >= stop_after and step < tr.steps) or "stopped" in summary
            if not interrupted and step > start:
                save(ckpt, step, state, loader, force=True)
                if evals and (tr.eval_every or tr.eval_batches):
                    _eval(trainer, state, cfg.data, eval_rows, max(tr.eval_batches, 1), step, writer, summary)
                if evals and (tr.eval_every or tr.eval_batches) and tr.show_answers:
                    try:
                        summary["answers"] = _answers(cfg, state, tr.show_answers)
                        if primary and summary["answers"]:
                            path = run_dir / "answers.jsonl"
                            path.write_text("".join(json.dumps({"step": step, **r}) + "\n" for r in summary["answers"]))
                    except Exception as e:  # noqa: BLE001 - a demonstration must never fail a finished run
                        log.warning("answers not generated: %s: %s", type(e).__name__, str(e).splitlines()[0][:300])
        finally:
            profile.close()
            bar.close()
            _wait(ckpt)
            saved = ckpt.all_steps()
            ckpt.close()
            writer.close()
            loader_summary = loader.summary()
            loader.close()
    wall = time.perf_counter() - t0
    every = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    records = [r for r in every if "loss" in r]
    if primary:  # the curves as a picture, named in the summary
        try:
            png = plot_curves(every, run_dir / "curves.png", f"{cfg.name}: {cfg.model.name}, layout {cfg.layout.name}")
            summary["curves"] = str(png) if png else None
        except Exception as e:  # noqa: BLE001 - a plot must never fail a finished run
            log.warning("curves.png not written: %s", e)
    summary.update({
        "end_step": step, "wall_s": wall, "compiles": len(trainer.compiled), "compiled_ahead": trainer.ahead_steps,
        "evals_compiled_ahead": trainer.ahead_evals,
        "loss_first": records[0]["loss"] if records else None, "loss_last": records[-1]["loss"] if records else None,
        "first_step": records[0]["step"] if records else None, "last_step": records[-1]["step"] if records else None,
        "tokens_per_s": timed["useful_tokens"] / timed["time"] if timed["time"] else None,
        "tflops_per_device": (timed["flops"] / timed["time"] / trainer.mesh.devices.size / 1e12
                              if timed["time"] else None),
        "skipped_updates": int(jax.device_get(optim.skipped_updates(state["opt_state"]))),
        "data": loader_summary, "checkpoints": saved, "peak_memory_gib": peak_memory_gib(),
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


def _save(ckpt: Checkpointer, step: int, state: Any, loader: Any, force: bool = False) -> bool:
    """Start a checkpoint (periodic, or ``force``); a failed write is reported and training goes on with
    the previous checkpoints kept."""
    try:  # every process's data shards in one state (the primary writes it), so any process count resumes
        return ckpt.save(step, state, data_lib.merge_states(gather_json(loader.get_state())), force=force)
    except Exception as e:  # noqa: BLE001 - a disk / storage fault must not lose the run
        log.error("checkpoint at step %d failed (%s: %s); the previous checkpoints %s are kept", step,
                  type(e).__name__, str(e).splitlines()[0][:300], ckpt.all_steps())
        return False


def _wait(ckpt: Checkpointer) -> None:
    """Wait for pending writes; an asynchronous write that failed is reported, not raised."""
    try:
        ckpt.wait()
    except Exception as e:  # noqa: BLE001 - as _save
        log.error("a checkpoint write failed (%s: %s); the checkpoints on disk are %s", type(e).__name__,
                  str(e).splitlines()[0][:300], ckpt.all_steps())


def _eval(trainer: Trainer, state: Any, data_cfg: Any, rows: int, batches: int, step: int,
          writer: MetricsWriter, summary: dict[str, Any]) -> None:
    t = time.perf_counter()
    result = evaluate(trainer, state["params"], data_cfg, rows=rows, batches=batches)
    record = eval_record(result)
    writer.write(step, record)
    summary["evals"].append({"step": step, **result})
    acc = result["accuracy"].get("all", {})
    log.info("eval at step %d: loss %.4f, accuracy %.1f%% over %d answers (%.1fs)", step, result["loss"],
             100 * acc.get("accuracy", float("nan")), acc.get("answers", 0), time.perf_counter() - t)


def _answers(cfg: RunConfig, state: Any, count: int) -> list[dict[str, Any]] | None:
    """The first ``count`` questions of the held-out split answered by greedy generation (every process
    runs it: the parameters are global arrays) -> rows ``{"question", "answer", "generated", "match"}``;
    None (with the reason logged) for a model family generation does not cover."""
    from moevlm_jax import inference
    from moevlm_jax.data.records import decode_record
    from moevlm_jax.data.sources import build_source
    from moevlm_jax.data.tokenizer import load_tokenizer
    from moevlm_jax.model import registry

    if registry.family_of(cfg.model).name != "qwen3_vl_moe":
        log.info("answers: generation covers Qwen3-VL-MoE models (python -m moevlm_jax.generate); none shown")
        return None
    t = time.perf_counter()
    source, _ = build_source(cfg.data, cfg.data.eval_split)
    questions = []
    for i in range(len(source)):
        if len(questions) >= count:
            break
        questions += inference.record_questions(decode_record(source[i]))[: count - len(questions)]
    model = inference.model_for_generation(cfg.model, cfg.compute, state["params"])
    rows = inference.answer_questions(model, load_tokenizer(cfg.data.tokenizer), questions, image_config=cfg.data.image,
                                      system_prompt=cfg.data.system_prompt, max_new_tokens=16)
    log.info("answers: %d held-out questions generated (%.1fs)", len(rows), time.perf_counter() - t)
    return rows


def _pretrained(path: str | None, cfg: RunConfig, trainer: Trainer) -> Any:
    if not path:
        return None
    from moevlm_jax.hf import load_pretrained

    model, _ = load_pretrained(path, np.dtype(cfg.compute.param_dtype), compute=cfg.compute)
    params = nnx.to_pure_dict(nnx.state(model, (nnx.Param, ExpertBias)))  # + router state (zeros)
    want = jax.tree.map(lambda x: x.shape, trainer.abstract_params)
    if jax.tree.map(lambda x: x.shape, params) != want:
        raise ConfigError(f"train.init_from {path}: parameter shapes differ from the configured model")
    return params


def _log_model(trainer: Trainer, frozen: set[str], groups: Any) -> None:
    sizes = optim.group_sizes(trainer.abstract_params, groups)
    total = sum(sizes.values())
    parts = ", ".join(f"{g} {n / 1e6:.2f}M{' (frozen)' if g in frozen else ''}" for g, n in sizes.items())
    log.info("model %s: %.2fM parameters (%s); compute %s, params %s", trainer.spec.model.name, total / 1e6, parts,
             trainer.spec.compute.dtype, trainer.spec.compute.param_dtype)


