"""Held-out evaluation of the train job: an :class:`Evaluator` built from the run's data config.

Teacher-forced loss on the answer tokens and exact-match answer accuracy per question type
(``data.answer_accuracy``) over the first ``train.eval_batches`` batches of the held-out split, every
``train.eval_every`` steps and at the end of a run (``moevlm_jax.training.hooks.EvalHook`` hangs it on the
loop). A source without a held-out split (and ``data.heldout_fraction`` 0) evaluates nothing, said once.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import jax

import moevlm_jax.data as data_lib

if TYPE_CHECKING:
    from moevlm_jax.config.run import RunConfig
    from moevlm_jax.training.trainer import Trainer

log = logging.getLogger("moevlm_jax.train")


def evaluate(trainer: Trainer, params: Any, data_cfg: Any, *, rows: int, batches: int) -> dict[str, Any]:
    """Held-out split: teacher-forced loss on the answer tokens and exact-match answer accuracy per
    question type (``data.answer_accuracy``) over the first ``batches`` batches of ``rows`` rows (this
    process's) -> ``{"loss", "tokens", "accuracy": {type: {"accuracy", "answers", "chance"}}}``."""
    loader = data_lib.build_loader(data_cfg, batch_size=rows, split="heldout", shard_index=jax.process_index(),
                                   shard_count=jax.process_count())
    ce = tokens = 0.0
    parts = []
    try:
        held = [batch for _, batch in zip(range(batches), loader)]
        trainer.reserve(held)  # one compiled eval step for all of them (train.compile: all but exact)
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


class Evaluator:
    """The run's evaluation: ``data_cfg``'s held-out split, ``batches`` batches of ``rows`` rows (this
    process's share of one microbatch over the data-parallel ranks) every ``every`` steps (0: at the end
    only) and at the end when either is set. ``has_heldout``: the source has a held-out split."""

    def __init__(self, data_cfg: Any, *, every: int, batches: int, rows: int, has_heldout: bool) -> None:
        self.data_cfg, self.every, self.batches, self.rows = data_cfg, every, batches, rows
        self.requested = bool(every or batches)
        self.enabled = has_heldout and self.requested

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Evaluator:
        """The evaluation ``cfg`` asks for (``train.eval_every`` / ``train.eval_batches``) on its data."""
        tr = cfg.train
        return cls(cfg.data, every=tr.eval_every, batches=tr.eval_batches,
                   rows=tr.micro_batch_size * cfg.data_parallel_size // jax.process_count(),
                   has_heldout=data_lib.has_heldout(cfg.data))

    @property
    def skipped(self) -> str | None:
        """Why an evaluation the config asks for cannot run (logged by the loop), else None."""
        if self.requested and not self.enabled:
            log.warning("evaluation skipped: the %s source has no held-out split and data.heldout_fraction is 0 "
                        "(give the source a held-out split, or a data.heldout_fraction > 0)", self.data_cfg.kind)
            return "no held-out split"
        return None

    def due(self, step: int, last_step: int) -> bool:
        """A periodic evaluation after ``step`` (the last step's is the end-of-run evaluation)."""
        return self.enabled and bool(self.every) and step % self.every == 0 and step != last_step

    def __call__(self, trainer: Trainer, params: Any, step: int, *, final: bool = False) -> dict[str, Any]:
        """Evaluate ``params`` after ``step`` (``final``: at least one batch) and log it; returns
        :func:`evaluate`'s result."""
        t = time.perf_counter()
        batches = max(self.batches, 1) if final else self.batches
        result = evaluate(trainer, params, self.data_cfg, rows=self.rows, batches=batches)
        acc = result["accuracy"].get("all", {})
        log.info("eval at step %d: loss %.4f, accuracy %.1f%% over %d answers (%.1fs)", step, result["loss"],
                 100 * acc.get("accuracy", float("nan")), acc.get("answers", 0), time.perf_counter() - t)
        return result
