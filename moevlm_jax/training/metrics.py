"""Training metrics: metrics.jsonl + TensorBoard, step timing without host syncs, progress bar.

The loop never blocks on the step it just dispatched. :class:`StepTracker` keeps the device
metrics of step k and reads those of step k-1 (``jax.device_get``) when step k has been queued,
so the host waits only for work that is already finished or about to be. The wall time between
two such reads is one step's time; the first finished step (which includes compilation) and any
interval the caller marks (checkpoint, evaluation) are left out of throughput.

Throughput counts useful tokens (``segment_ids > 0``), not padding; MFU is model FLOPs
(moevlm_jax.perf.flops) / (time x devices x peak), reported only when the peak is known (GPUs, TPUs).
Several processes: the host counts of a logged step and of the window (each process's of its own rows) are
summed over the processes at logging time (``multihost.summed_on_primary``), so process 0's records are the
run's, with its devices the run's (the mesh's).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from moevlm_jax.parallelism.multihost import summed_on_primary

log = logging.getLogger(__name__)


def _scalar(x: Any) -> Any:
    """Python float/int for numpy/jax scalars and 0-d/1-element arrays; other values unchanged."""
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    arr = np.asarray(x)
    if arr.size == 1:
        item = arr.reshape(()).item()
        return float(item) if isinstance(item, float) else item
    return arr.tolist()


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat``'s start time against the boot
    clock), so a time to the first step includes Python's and jax's imports; None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5): starttime in clock ticks
        return float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


class MetricsWriter:
    """Appends one JSON object per logged step to ``metrics.jsonl`` and scalars to TensorBoard (only in
    the ``primary`` process: the others compute the same records and write nothing)."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, resume_step: int | None = None,
                 primary: bool = True) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self._file, self._tb = None, None
        if not primary:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        self._file = self.path.open("a", buffering=1)
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                log.warning("tensorboardX is not installed: metrics go to %s only", self.path)
            else:
                purge = None if resume_step is None else resume_step + 1
                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=purge)

    def _truncate_after(self, step: int) -> None:
        """Drop records past ``step`` (written after the checkpoint we resume from)."""
        kept = [line for line in self.path.read_text().splitlines()
                if line.strip() and json.loads(line).get("step", -1) <= step]
        self.path.write_text("".join(line + "\n" for line in kept))

    def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Record ``metrics`` (scalars; jax/numpy values are fetched) for ``step``; returns the record."""
        record = {"step": int(step), **{k: _scalar(v) for k, v in metrics.items() if k != "step"}}
        record["time"] = time.time()
        if self._file is None:
            return record
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, int(step))
        return record

    def flush(self) -> None:
        """Push buffered TensorBoard events and the jsonl file to disk."""
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        """Flush and close the files."""
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def plot_curves(records: list[dict[str, Any]], path: str | Path, title: str = "") -> Path | None:
    """A PNG of a run's curves against step: train loss and held-out loss (left), useful tokens/s
    (right); None when there is nothing to draw."""
    losses = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    if not losses:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    speed = [(r["step"], r["tokens_per_s"]) for r in records if r.get("tokens_per_s")]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(*zip(*losses), lw=1.2, label="train loss")
    if evals:
        left.plot(*zip(*evals), "o-", lw=1.2, label="held-out loss (answers)")
    left.set(xlabel="step", ylabel="loss", yscale="log")
    left.legend()
    left.grid(alpha=0.3)
    if speed:
        right.plot(*zip(*speed), lw=1.2, color="tab:green")
    right.set(xlabel="step", ylabel="useful tokens/s")
    right.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl file (or of ``<run_dir>/metrics.jsonl``)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class StepTracker:
    """Async step bookkeeping: push step k's device metrics, get step k-1's record back.

    ``host`` values per step (computed on the host from the numpy batch, no device sync):
    ``tokens`` (all rows x seq), ``useful_tokens`` (segment_ids > 0), optionally ``flops``
    (moevlm_jax.perf.flops.batch_flops), samples, skips. Records carry the step's own metrics plus
    throughput over the window since the last :meth:`window` call. Host values count this process's rows;
    :meth:`window` sums them over the processes (``combine``, in process 0) for the step it logs, and
    ``num_devices`` is every process's (the mesh's).
    """

    def __init__(self, *, num_devices: int = 1, peak_flops: float | None = None, skip_first: int = 2,
                 clock: Callable[[], float] = time.perf_counter,
                 combine: Callable[[dict[str, Any]], dict[str, Any]] = summed_on_primary) -> None:
        self.num_devices = num_devices
        self.peak_flops = peak_flops
        self.skip_first = skip_first
        self.clock = clock
        self.combine = combine
        self._pending: tuple[int, Any, dict[str, float]] | None = None
        self._finished: tuple[int, dict[str, float]] | None = None  # the last finished step's host values
        self._last_done: float | None = None
        self._done = 0
        self._skip = 0  # intervals still to leave out of throughput (after a checkpoint, evaluation or flush)
        self._win = dict.fromkeys(("time", "steps", "tokens", "useful_tokens", "flops"), 0.0)

    def discard_next_interval(self) -> None:
        """Leave the next step interval out of throughput (call after a checkpoint or evaluation)."""
        self._skip = max(self._skip, 1)

    def push(self, step: int, device_metrics: Any, host: Mapping[str, float] | None = None) -> dict[str, Any] | None:
        """Queue step ``step``'s (still running) metrics; return the finished previous step's record."""
        previous = self._finish()
        self._pending = (step, device_metrics, dict(host or {}))
        return previous

    def flush(self) -> dict[str, Any] | None:
        """Wait for and return the last pushed step's record (at the end of training, before an eval).
        Its interval is left out of throughput, as are the next two: a step's time is read when the
        host asks for it, which :meth:`push` does after dispatching the next step, and dispatch can
        block for part of a step (on the H200, a step of 16 accumulated microbatches: 4.6 of 5.1 s), so
        push-to-push intervals are right while one ending at a flush is short by that part (the
        summary once read 67.3k useful tokens/s for 47k), and so is the second interval after a pause,
        whose start was read late (the step after an evaluation 0.63 s against 0.69; likewise the
        second step of a run, which is why ``skip_first`` is 2: 0.06 s against 0.69 on the H200, the
        train CLI's summary 63.0k useful tokens/s for 59.4k, bench/results/first_step.md)."""
        record = self._finish(counted=False)
        self._skip = 2
        return record

    def _finish(self, counted: bool = True) -> dict[str, Any] | None:
        if self._pending is None:
            return None
        step, device_metrics, host = self._pending
        self._pending = None
        values = jax.device_get(device_metrics)  # waits for that step only
        now = self.clock()
        self._done += 1
        record: dict[str, Any] = {"step": step}
        record.update({k: _scalar(v) for k, v in (values or {}).items()})
        counted = counted and self._done > self.skip_first and self._last_done is not None and not self._skip
        self._skip = max(self._skip - 1, 0)
        if counted:
            dt = now - self._last_done
            record["step_time_s"] = dt
            self._win["time"] += dt
            self._win["steps"] += 1
            for k in ("tokens", "useful_tokens", "flops"):
                self._win[k] += float(host.get(k, 0.0))
        self._last_done = now
        record.update({k: _scalar(v) for k, v in host.items()})
        self._finished = (step, host)
        return record

    def window(self, record: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Throughput since the previous call (and reset): tokens_per_s (useful), useful_fraction,
        step_time_s, tflops_per_device, mfu (when the peak is known); none of them if no timed steps.
        With ``record`` (the last finished step's, being logged), also its host values. Both are summed over
        the processes in one exchange (``combine``): every process calls this at the same steps."""
        w, self._win = self._win, dict.fromkeys(self._win, 0.0)
        logged = record is not None and self._finished is not None and self._finished[0] == record["step"]
        host = self._finished[1] if logged else {}
        sums = self.combine({"host": {k: float(v) for k, v in host.items()},
                             "window": {k: w[k] for k in ("tokens", "useful_tokens", "flops")}})
        w.update(sums["window"])
        out: dict[str, Any] = {k: sums["host"][k] for k in host}
        if w["steps"] == 0 or w["time"] <= 0:
            return out
        out["tokens_per_s"] = w["useful_tokens"] / w["time"]
        out["tokens_per_s_per_device"] = w["useful_tokens"] / w["time"] / self.num_devices
        out["step_time_s"] = w["time"] / w["steps"]
        if w["tokens"] > 0:
            out["useful_fraction"] = w["useful_tokens"] / w["tokens"]
        if w["flops"] > 0:
            per_device = w["flops"] / w["time"] / self.num_devices
            out["tflops_per_device"] = per_device / 1e12
            if self.peak_flops:
                out["mfu"] = per_device / self.peak_flops
        return out


def batch_token_counts(batch: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Host-side counts for :meth:`StepTracker.push`: tokens, useful_tokens, trained_tokens."""
    seg = np.asarray(batch["segment_ids"])
    out = {"tokens": float(seg.size), "useful_tokens": float(np.count_nonzero(seg > 0))}
    if "loss_mask" in batch:
        out["trained_tokens"] = float(np.count_nonzero(np.asarray(batch["loss_mask"]) > 0))
    return out


def _fmt_rate(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def progress_postfix(record: Mapping[str, Any]) -> str:
    """Short status for the progress bar: loss, useful tokens/s, useful %, MFU, skips."""
    parts = []
    loss = record.get("loss")
    if isinstance(loss, (int, float)):
        parts.append(f"loss {loss:.4f}" if math.isfinite(loss) else f"loss {loss}")
    if record.get("tokens_per_s") is not None:
        parts.append(f"{_fmt_rate(record['tokens_per_s'])} tok/s")
    if record.get("useful_fraction") is not None:
        parts.append(f"useful {100 * record['useful_fraction']:.0f}%")
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    for key in ("skipped", "data_skipped"):
        if record.get(key):
            parts.append(f"{key} {int(record[key])}")
    return " | ".join(parts)


class Progress:
    """The CLI's tqdm bar over training steps (disabled when stderr is not a terminal)."""

    def __init__(self, total: int, initial: int = 0, *, enabled: bool | None = None, desc: str = "train") -> None:
        from tqdm import tqdm

        disable = None if enabled is None else not enabled
        self.step = initial
        self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, disable=disable,
                        unit="step")

    def update(self, step: int, record: Mapping[str, Any] | None = None) -> None:
        """Move the bar to ``step`` finished steps and show ``record`` (see progress_postfix)."""
        if step > self.step:
            self.bar.update(step - self.step)
            self.step = step
        if record:
            self.bar.set_postfix_str(progress_postfix(record), refresh=False)

    def close(self) -> None:
        """Close the bar."""
        self.bar.close()


class ProfileWindow:
    """Trace steps [start, start + steps) with ``jax.profiler`` into ``directory`` (off when steps == 0)."""

    def __init__(self, directory: str | Path, start: int, steps: int) -> None:
        self.directory, self.start, self.stop = str(directory), start, start + steps
        self.active = False

    def before_step(self, step: int) -> None:
        """Call before dispatching ``step``: starts the trace at the first profiled step."""
        if step == self.start and self.stop > self.start and not self.active:
            jax.profiler.start_trace(self.directory)
            self.active = True
            log.info("profiling steps %d..%d into %s", self.start, self.stop - 1, self.directory)

    def after_step(self, step: int, outputs: Any = None) -> None:
        """Call after dispatching ``step``: at the last profiled step waits for ``outputs`` and stops."""
        if self.active and step >= self.stop - 1:
            jax.block_until_ready(outputs)
            self.close()

    def close(self) -> None:
        """Stop a running trace (at exit, or early)."""
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
