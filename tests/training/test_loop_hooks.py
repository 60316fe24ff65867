"""The loop's hooks (moevlm_jax.training.hooks): every event fires in order, the train job's own hooks
(evaluation, checkpoints, plot) before those a caller adds, with what each put in the summary and on disk
when the next one runs; the final checkpoint streamed within train.checkpoint_host_gb."""
from __future__ import annotations

import logging
import re

import jax
import pytest
import yaml

from moevlm_jax.config.run import load_config
from moevlm_jax.training import loop
from moevlm_jax.training.checkpoint import Checkpointer
from moevlm_jax.training.hooks import Hook
from moevlm_jax.training.metrics import read_metrics
from tests.training.train_setup import data_config

# quick compiles (tests/xla_options.py)
pytestmark = pytest.mark.usefixtures("legacy_emitters")


class Recording(Hook):
    """Every event as (name, step), with what the earlier hooks had done by then; the first close of the
    training loader as ("loader_closed",); after the last step's on_step (the end of the run) the bytes of
    every tree of arrays ``jax.device_get`` copies to the host, in ``end_host_copies``."""

    def __init__(self, last_step: int) -> None:
        self.events: list[tuple] = []
        self.last_step, self.ended = last_step, False
        self.end_host_copies: list[int] = []
        self.largest_param = 0

    def device_get(self, real):
        def counted(tree):
            if self.ended:
                self.end_host_copies.append(sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)))
            return real(tree)
        return counted

    def before_step(self, ctx, step):
        if step == 1:
            close = ctx.loader.close

            def recorded_close():
                if ("loader_closed",) not in self.events:
                    self.events.append(("loader_closed",))
                close()
            ctx.loader.close = recorded_close
            self.largest_param = max(x.nbytes for x in jax.tree.leaves(ctx.state["params"]))
        self.events.append(("before_step", step))

    def after_step(self, ctx, step, metrics):
        self.events.append(("after_step", step, "loss" in metrics))

    def on_step(self, ctx, step):
        self.events.append(("on_step", step, [e["step"] for e in ctx.summary["evals"]]))
        self.ended = step == self.last_step

    def on_end(self, ctx, step):
        self.events.append(("on_end", step, [e["step"] for e in ctx.summary["evals"]], _on_disk(ctx)))

    def close(self, ctx):
        self.events.append(("close", _on_disk(ctx)))

    def on_summary(self, ctx):
        self.events.append(("on_summary", "curves" in ctx.summary,
                            [r["step"] for r in read_metrics(ctx.run_dir) if "eval_loss" in r]))


def _on_disk(ctx) -> list[str]:
    """The checkpoints written (orbax renames a step's directory into place once it is on disk)."""
    return sorted(p.name for p in (ctx.run_dir / "checkpoints").iterdir() if p.name.isdigit())


def recorded_saves(monkeypatch) -> list[dict]:
    """Each checkpoint Checkpointer.save starts: its step, whether streamed, the state's bytes and largest array,
    the host budget and the most of the state on the host at once (by the time save returns: a periodic save
    has copied all of it, a streamed one is written)."""
    saves: list[dict] = []
    save = Checkpointer.save

    def recorded(self, step, state, data_state=None, *, force=False, streamed=False):
        started = save(self, step, state, data_state, force=force, streamed=streamed)
        if started:
            sizes = [x.nbytes for x in jax.tree.leaves(state)]
            saves.append({"step": step, "streamed": streamed, "total": sum(sizes), "largest": max(sizes),
                          "budget": self.stream_host_gb * 1e9, "peak": self.last_host_peak_bytes})
        return started

    monkeypatch.setattr(Checkpointer, "save", recorded)
    return saves


def test_hooks_fire_in_order(tmp_path, monkeypatch, caplog):
    data = tmp_path / "data.yaml"
    data.write_text(yaml.safe_dump(data_config()))
    cfg = load_config("cpu-default", model="tiny", data=str(data), run_dir=str(tmp_path / "run"), overrides=[
        "train.steps=3", "train.eval_every=2", "train.eval_batches=1", "train.checkpoint_every=2",
        "train.show_answers=0", "train.tensorboard=false", "train.log_every=1", "compute.dtype=float32",
        "train.checkpoint_host_gb=0.05"])
    rec = Recording(last_step=3)
    monkeypatch.setattr(jax, "device_get", rec.device_get(jax.device_get))
    saves = recorded_saves(monkeypatch)
    with caplog.at_level(logging.INFO, logger="moevlm_jax.train"):
        summary = loop.run(cfg, progress=False, hooks=[rec])
    assert rec.events == [
        ("before_step", 1), ("after_step", 1, True), ("on_step", 1, []),
        # the evaluation every 2 steps ran before this hook's on_step
        ("before_step", 2), ("after_step", 2, True), ("on_step", 2, [2]),
        ("before_step", 3), ("after_step", 3, True), ("on_step", 3, [2]),
        # the end of the run: the training loader closed (its workers' buffers freed), the final checkpoint
        # written and on disk (its host copy freed), then the end-of-run evaluation, before this hook's on_end
        ("loader_closed",),
        ("on_end", 3, [2, 3], ["2", "3"]),
        # the checkpoints of steps 2 and 3 written and closed before this hook's close
        ("close", ["2", "3"]),
        # the metrics written and closed, the curves plotted: both evaluations in metrics.jsonl
        ("on_summary", True, [2, 3]),
    ]
    assert summary["checkpoints"] == [2, 3] and [e["step"] for e in summary["evals"]] == [2, 3]
    assert summary["end_step"] == 3 and summary["curves"]
    # the end of the run copies no tree of parameters / optimizer state to the host (the checkpoint writes
    # the device arrays' shards, the evaluation runs on the device parameters): the largest tree
    # jax.device_get brings over is at most one parameter tensor (the metrics' scalars), not the state
    assert rec.end_host_copies and max(rec.end_host_copies) <= rec.largest_param, (
        rec.end_host_copies, rec.largest_param)
    # the periodic checkpoint (step 2) copied the whole state to the host at once; the final one (step 3) was
    # streamed: at most train.checkpoint_host_gb (50 MB) of the state (121 MB) on the host at once
    assert [(s["step"], s["streamed"]) for s in saves] == [(2, False), (3, True)]
    periodic, final = saves
    assert periodic["peak"] == periodic["total"]
    assert final["largest"] <= final["peak"] <= max(final["budget"], final["largest"]) < final["total"], final
    (line,) = [r.getMessage() for r in caplog.records if "final checkpoint streamed" in r.getMessage()]
    assert re.fullmatch(r"final checkpoint streamed: at most ([\d.]+) MB of the state on the host at once "
                        r"\(of ([\d.]+) MB\)", line).groups() == (f"{final['peak'] / 1e6:.1f}",
                                                                     f"{final['total'] / 1e6:.1f}")
