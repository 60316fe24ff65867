"""Metrics: jsonl + TensorBoard contents, resume truncation, async step tracker throughput and MFU."""

from __future__ import annotations

import struct
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.training.metrics import (
    MetricsWriter,
    ProfileWindow,
    Progress,
    StepTracker,
    batch_token_counts,
    progress_postfix,
    read_metrics,
)


def _tensorboard_scalars(run_dir: Path) -> dict[tuple[str, int], float]:
    """(tag, step) -> value from the TFRecord event files under run_dir/tensorboard."""
    from tensorboardX.proto import event_pb2

    out = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out[(v.tag, event.step)] = v.simple_value
    return out


def test_jsonl_and_tensorboard_contents(tmp_path):
    with MetricsWriter(tmp_path) as w:
        w.write(10, {"loss": jnp.asarray(2.5), "tokens_per_s": np.float32(1234.5), "lr": 1e-3, "note": "x"})
        w.write(20, {"loss": 2.25, "tokens_per_s": 1500.0, "skipped": np.int32(1)})
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [10, 20]
    assert records[0]["loss"] == 2.5 and records[0]["tokens_per_s"] == 1234.5 and records[0]["note"] == "x"
    assert records[1]["skipped"] == 1 and isinstance(records[1]["skipped"], int) and "time" in records[1]
    tb = _tensorboard_scalars(tmp_path)
    assert tb[("loss", 10)] == 2.5 and tb[("loss", 20)] == 2.25 and tb[("tokens_per_s", 10)] == 1234.5
    assert tb[("lr", 10)] == pytest.approx(1e-3) and ("note", 10) not in tb


def test_without_tensorboardx_metrics_still_go_to_jsonl(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails, as on a bare GPU machine
    with MetricsWriter(tmp_path) as w:
        w.write(1, {"loss": 1.5})
    assert read_metrics(tmp_path)[0]["loss"] == 1.5 and not (tmp_path / "tensorboard").exists()


def test_resume_drops_records_after_the_checkpoint(tmp_path):
    with MetricsWriter(tmp_path, tensorboard=False) as w:
        for s in range(1, 6):
            w.write(s, {"loss": float(s)})
    with MetricsWriter(tmp_path, tensorboard=False, resume_step=3) as w:
        w.write(4, {"loss": 40.0})
    assert [(r["step"], r["loss"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == \
        [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_step_tracker_async_pattern_and_throughput():
    # times the tracker reads: completions, except at a flush (see below)
    times = iter([100.0, 101.0, 101.5, 102.5, 110.0, 110.5, 114.0, 115.0, 116.0])
    tracker = StepTracker(num_devices=2, peak_flops=1e3, clock=lambda: next(times))
    host = {"tokens": 100.0, "useful_tokens": 80.0, "flops": 600.0}
    assert tracker.push(0, {"loss": jnp.asarray(3.0)}, host) is None  # step 0 still running
    r0 = tracker.push(1, {"loss": jnp.asarray(2.0)}, host)  # reads step 0 while step 1 runs
    assert r0["step"] == 0 and r0["loss"] == 3.0 and "step_time_s" not in r0  # compile step left out
    r1 = tracker.push(2, {"loss": jnp.asarray(1.5)}, host)
    # the run's second interval is left out too: its start (step 0's end) was read late
    assert r1["step"] == 1 and "step_time_s" not in r1 and r1["useful_tokens"] == 80.0
    r2 = tracker.push(3, {"loss": jnp.asarray(1.0)}, host)
    assert r2["step_time_s"] == 0.5
    r3 = tracker.push(4, {"loss": jnp.asarray(0.5)}, host)
    assert r3["step_time_s"] == 1.0
    w = tracker.window()  # steps 2 and 3: 160 useful tokens in 1.5 s
    assert w["tokens_per_s"] == pytest.approx(160 / 1.5)
    assert w["tokens_per_s_per_device"] == pytest.approx(80 / 1.5)
    assert w["useful_fraction"] == pytest.approx(0.8) and w["step_time_s"] == pytest.approx(0.75)
    assert w["mfu"] == pytest.approx(1200 / 1.5 / 2 / 1e3)  # flops / time / devices / peak
    tracker.discard_next_interval()  # e.g. a checkpoint was written here
    tracker.push(5, {"loss": jnp.asarray(0.25)}, host)  # step 4 interval (7.5 s) is not counted
    # a flush reads its step's end, while pushes read the previous step's end late by however long
    # dispatching the next step blocked: the flushed interval (0.5 s here) and the next two are not counted
    last = tracker.flush()
    assert last["step"] == 5 and "step_time_s" not in last and tracker.flush() is None
    assert tracker.window() == {}  # nothing counted since the last window
    tracker.push(6, {"loss": jnp.asarray(0.2)}, host)
    assert "step_time_s" not in tracker.push(7, {"loss": jnp.asarray(0.1)}, host)  # step 6: after the flush
    assert "step_time_s" not in tracker.push(8, {"loss": jnp.asarray(0.1)}, host)  # step 7: its start read late
    assert tracker.push(9, {"loss": jnp.asarray(0.1)}, host)["step_time_s"] == pytest.approx(1.0)  # step 8
    w = tracker.window()
    assert w["step_time_s"] == pytest.approx(1.0) and w["tokens_per_s"] == pytest.approx(80 / 1.0)
    assert "mfu" not in StepTracker(peak_flops=None).window()


def test_step_tracker_window_sums_host_counts_over_processes():
    """Two processes of one run, each pushing its half of the rows: the logged step's host counts and the
    window's throughput and MFU come from the processes' sums (one exchange per window), over the mesh's
    devices; the device metrics (already global) are left as they are."""
    calls = []

    def two_processes(values):  # the other process had the same counts
        calls.append(values)
        return {part: {k: 2 * v for k, v in d.items()} for part, d in values.items()}

    times = iter([0.0, 1.0, 2.0, 3.0, 4.0])
    tracker = StepTracker(num_devices=8, peak_flops=1e3, clock=lambda: next(times), combine=two_processes)
    half = {"tokens": 1024.0, "useful_tokens": 800.0, "flops": 4000.0, "samples": 5.0, "data_skipped": 1.0}
    record = None
    for step in range(5):
        record = tracker.push(step, {"loss": jnp.asarray(1.0), "trained_tokens": jnp.asarray(1500.0)}, half)
    assert record["step"] == 3 and record["tokens"] == 1024.0  # this process's, until logged
    logged = tracker.window(record)  # steps 2 and 3 timed: 1 s each
    assert len(calls) == 1
    assert logged["tokens"] == 2048.0 and logged["useful_tokens"] == 1600.0 and logged["samples"] == 10.0
    assert logged["data_skipped"] == 2.0 and "trained_tokens" not in logged and "loss" not in logged
    assert logged["tokens_per_s"] == pytest.approx(1600.0) and logged["useful_fraction"] == pytest.approx(800 / 1024)
    assert logged["tokens_per_s_per_device"] == pytest.approx(200.0)
    assert logged["mfu"] == pytest.approx(2 * 4000.0 / 8 / 1e3)
    assert tracker.window() == {} and len(calls) == 2  # an empty window is still one exchange for every process


def test_batch_counts_and_progress_text():
    seg = np.array([[1, 1, 2, 0], [1, 0, 0, 0]])
    mask = np.array([[0, 1, 1, 0], [1, 0, 0, 0]], np.float32)
    assert batch_token_counts({"segment_ids": seg, "loss_mask": mask}) == \
        {"tokens": 8.0, "useful_tokens": 4.0, "trained_tokens": 3.0}
    text = progress_postfix({"loss": 1.23456, "tokens_per_s": 23900.0, "useful_fraction": 0.9, "mfu": 0.215,
                             "skipped": 2, "data_skipped": 0})
    assert text == "loss 1.2346 | 23.9k tok/s | useful 90% | MFU 21.5% | skipped 2"
    bar = Progress(total=10, initial=2, enabled=False)
    bar.update(5, {"loss": 1.0})
    assert bar.step == 5
    bar.close()


def test_profile_window_traces_only_its_steps(tmp_path):
    window = ProfileWindow(tmp_path / "profile", start=2, steps=2)
    x = jnp.ones((16, 16))
    for step in range(5):
        window.before_step(step)
        assert window.active == (step in (2, 3))
        x = x @ x / 16
        window.after_step(step, x)
    assert not window.active
    assert len(list((tmp_path / "profile").rglob("*.xplane.pb"))) == 1
    off = ProfileWindow(tmp_path / "none", start=0, steps=0)
    off.before_step(0)
    assert not off.active and not (tmp_path / "none").exists()


def test_process_age_counts_from_the_process_start():
    """The time to the first step counts from the process's start (imports included): a child that
    sleeps 1.5 s before it asks is at least 1.5 s old, and no older than the parent saw it live."""
    import subprocess
    import sys
    import time

    code = ("import time; time.sleep(1.5); from moevlm_jax.training.metrics import process_age_s; "
            "print(process_age_s())")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    outer = time.monotonic() - t0
    age = float(out.strip().splitlines()[-1])
    assert 1.5 <= age <= outer + 0.05  # clock ticks of 10 ms
