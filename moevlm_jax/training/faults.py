"""What the training loop does when something goes wrong: a stop signal, non-finite updates in a row,
an unusable run directory, a checkpoint that fails to write.

- :class:`StopSignals`: SIGTERM / SIGINT (a scheduler's preemption, Ctrl-C) ask the loop to stop after
  the current step; the loop then writes a checkpoint and returns normally (exit 0). A second signal
  exits at once (exit 128 + signal). Every process must stop at the same step (they share
  collectives), so the request is agreed across processes (``parallelism.multihost.agreed_max``).
  Before the first step (auto-fit, the state, the data start, the first compile: :attr:`StopSignals.phase`)
  a request is honoured as soon as what runs returns, or fails: a signal sent to the process group also
  ends the compiler's child processes (ptxas) and the data workers, and the error that follows is the
  stop, not a failure. Nothing ran, so nothing is saved.
- :class:`NonFiniteGuard`: updates whose gradients are not finite are skipped by the optimizer
  (``optimizer.apply_if_finite``: the parameters stay the last good ones) and counted; ``limit`` in a row
  stops the run (:class:`TrainingStopped`) after a checkpoint of that last good state.
- :func:`check_run_dir`: the run directory must be writable and have room for the checkpoints, said
  before anything compiles.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

from moevlm_jax.parallelism.multihost import agreed_max

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(RuntimeError):
    """The run cannot go on (e.g. non-finite updates in a row); the message says why and what was saved."""


class StopSignals:
    """A context manager that turns SIGTERM / SIGINT into a stop request the loop polls (:meth:`agreed`);
    outside the main thread (no signal handlers there) it does nothing. ``phase``: what the run is doing
    (``start-up``, ``compile``, ``training``: set by the loop); ``during``: the phase a signal arrived in."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.phase = "start-up"
        self.during: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None:  # the second signal: no checkpoint, out at once
            os._exit(128 + signum)
        self.received, self.during = signum, self.phase
        when = ("after this step with a checkpoint" if self.phase == "training"
                else f"once the {self.phase} is done, before the first step: nothing to save")
        log.warning("%s received: stopping %s (send it again to exit at once)", signal.Signals(signum).name, when)

    @property
    def name(self) -> str | None:
        """The signal's name (SIGTERM, SIGINT) once one arrived, else None."""
        return None if self.received is None else signal.Signals(self.received).name

    @property
    def before_start_line(self) -> str:
        """The one line a run stopped before its first step ends with."""
        by = self.name or "another process's signal"
        return f"stopped by {by} during {self.during or self.phase}: nothing to save (no step ran)"

    def agreed(self) -> bool:
        """Whether any process received a stop signal (every process gets the same answer)."""
        return bool(agreed_max(int(self.received is not None)))


class NonFiniteGuard:
    """Counts skipped (non-finite) updates in a row from each step's running total of skips."""

    def __init__(self, limit: int, total: int = 0) -> None:
        self.limit, self.total, self.in_a_row, self.first = limit, total, 0, None

    def update(self, step: int, total_skipped: float) -> bool:
        """Record step ``step``'s total of skipped updates; True when ``limit`` were skipped in a row."""
        total = int(total_skipped)
        if total > self.total:
            self.in_a_row += total - self.total
            self.first = step if self.first is None else self.first
        else:
            self.in_a_row, self.first = 0, None
        self.total = total
        return self.in_a_row >= self.limit


def check_run_dir(run_dir: Path, need_bytes: int = 0) -> None:
    """Raise OSError naming the run directory when it cannot be created or written, or when its file
    system has less free space than ``need_bytes`` (what the kept checkpoints will take)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{uuid.uuid4().hex}"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        raise OSError(f"train.run_dir {run_dir} is not writable: {e.strerror or e}; pick another --run-dir") from None
    free = shutil.disk_usage(run_dir).free
    if need_bytes and free < need_bytes:
        raise OSError(f"train.run_dir {run_dir}: {free / 2**30:.2f} GiB free, but the kept checkpoints need "
                      f"~{need_bytes / 2**30:.2f} GiB (train.keep_checkpoints x the train state); free space, "
                      f"lower train.keep_checkpoints or pick another --run-dir")
