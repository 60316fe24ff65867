"""``python -m bench.sweep`` on CPU: the tiny model on the built-in VQA data (small images),
2 host devices, points fsdp x capture {none, step} (run) and pp x the same (deliberately failing:
MBS 1 x DP 2 = 2 rows cannot split into the pp layout's 4 pipeline microbatches). The failures are
recorded and the sweep carries on; results.csv / results.json / the plot are written; the recorded
token counts match the loader's batches (reference: a loader built here with the same settings)."""

from __future__ import annotations

import csv
import json

import numpy as np
import yaml

from bench import sweep
from tests.training.train_setup import data_config

STEPS, WARMUP, ROWS = 2, 1, 2  # MBS 1 x 2 devices (fsdp)


def test_sweep_smoke(tmp_path, capsys):
    cfg = data_config()
    cfg["source"]["num_train"] = 32
    data_path = tmp_path / "data.yaml"
    data_path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "sweep"
    rc = sweep.main(["--model", "tiny", "--layout", "fsdp,pp", "--mbs", "1", "--recompute", "selective",
                     "--capture", "none,step", "--steps", str(STEPS), "--warmup", str(WARMUP), "--data", str(data_path),
                     "--host-devices", "2", "--compiler-option", "xla_backend_optimization_level=0",
                     "--compiler-option", "xla_cpu_use_fusion_emitters=false",  # quick compiles: no figure compared
                     "--out", str(out), "dtype=float32"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "[4/4] pp mbs1 selective step: error" in printed  # progress lines, one per point

    rows = json.loads((out / "results.json").read_text())["results"]
    assert [(r["layout"], r["capture"], r["status"]) for r in rows] == [
        ("fsdp", "none", "ok"), ("fsdp", "step", "ok"), ("pp", "none", "error"), ("pp", "step", "error")]
    for r in rows[2:]:
        assert "must split into 4 microbatches" in r["message"]

    import moevlm_jax.data as data_lib  # reference counts: the same loader, batches WARMUP .. WARMUP + STEPS

    loader = data_lib.build_loader(str(data_path), batch_size=ROWS, seq_len=cfg["seq_len"])
    try:
        batches = [next(loader) for _ in range(WARMUP + STEPS)][WARMUP:]
    finally:
        loader.close()
    useful = float(sum(np.count_nonzero(b["segment_ids"] > 0) for b in batches))
    trained = float(sum(np.count_nonzero(b["loss_mask"] > 0) for b in batches))
    for r in rows[:2]:
        assert r["useful_tokens"] == useful and r["trained_tokens"] == trained and r["rows"] == ROWS
        assert r["tokens"] == STEPS * ROWS * cfg["seq_len"] and r["steps"] == STEPS
        assert np.isclose(r["tokens_per_s"], useful / (r["step_time_s"] * STEPS))
        assert r["mfu"] is None and r["devices"] == 2  # CPU: no peak FLOP/s, no MFU
        assert r["peak_source"] == "compiled memory analysis" and r["peak_bytes"] == r["mem_total_bytes"] > 0
        assert r["compile_s"] > 0 and r["compiles"] == 1 and np.isfinite(r["loss"])
        assert r["data_source"].startswith("vqa") and not r["mock_data"]
        assert "--xla_force_host_platform_device_count=2" in r["xla_flags"]
    assert "--xla_gpu_enable_command_buffer=" in rows[0]["xla_flags"]  # capture none: command buffers off
    assert "command_buffer" not in rows[1]["xla_flags"]  # step: XLA's defaults
    assert rows[0]["mem_temp_bytes"] == rows[1]["mem_temp_bytes"]  # the flags are GPU-only

    with open(out / "results.csv") as f:
        table = list(csv.DictReader(f))
    assert [t["status"] for t in table] == ["ok", "ok", "error", "error"]
    assert float(table[0]["tokens_per_s"]) == rows[0]["tokens_per_s"]
    assert (out / "throughput_vs_memory.png").read_bytes()[:4] == b"\x89PNG"
    assert min(p.name for p in (out / "logs").iterdir()).startswith("001_fsdp_mbs1_selective_none")
    lines = printed.strip().splitlines()
    assert any(ln.split()[:5] == ["pp", "1", "selective", "none", "error"] for ln in lines)


def test_a_dying_or_hanging_point_is_recorded(tmp_path):
    """A point whose process aborts (an XLA flag error kills it before Python can report) or runs
    past the timeout becomes an error row; out-of-memory messages are classified as oom."""
    from bench.sweep_point import classify

    spec = {"model": "tiny", "layout": "fsdp", "mbs": 1, "recompute": "none", "capture": "step", "steps": 1,
            "warmup": 0, "data": "vqa", "host_devices": "many"}
    row = sweep.run_point_process(spec, tmp_path, 1, timeout=120)
    assert row["status"] == "error" and row["message"].startswith("process exited with code 1: ")  # XLA exits
    assert "xla_force_host_platform_device_count" in (tmp_path / "logs" / "001_fsdp_mbs1_none_step.log").read_text()
    row = sweep.run_point_process({**spec, "host_devices": 2}, tmp_path, 2, timeout=1)
    assert row["status"] == "error" and row["message"] == "timed out after 1s"
    assert classify("XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB") == "oom"
    assert classify("ValueError: pipeline: 2 batch rows must split into 4 microbatches") == "error"


def test_settings_may_come_between_options(tmp_path, capsys):
    """KEY=VALUE compute settings before and after options parse as one list (the H200 scripts pass
    their own after the caller's); a setting that has its own option is refused before any point runs."""
    from bench.sweep import main

    argv = ["--out", str(tmp_path), "--mbs", "2", "moe.backend=hybrid", "--state-dtype", "bfloat16",
            "recompute=full"]
    assert main(argv) == 2  # parsed (argparse would have exited); refused for 'recompute'
    assert "set recompute with --recompute" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
