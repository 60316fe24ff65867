"""The memory report (``python -m moevlm_jax.tools.memory``): the tiny model's train step compiled on
abstract inputs (nothing materialised, no step run) under no / selective / full recompute.
Temporaries fall from none to selective to full; arguments are exactly the train state plus the
batch, and the donated state is aliased by the new state."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.perf import memory as perf_memory
from moevlm_jax.tools import memory
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.trainer import Trainer

# quick compiles (tests/xla_options.py): the same memory figures within 0.04% (tests/tools/test_plan.py)
pytestmark = pytest.mark.usefixtures("legacy_emitters")

MBS, SEQ = 2, 64


def _nbytes(tree) -> int:
    total = 0
    for x in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a threefry key: 2 x uint32
            total += 8 * int(np.prod(x.shape))
        else:
            total += int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
    return total


def test_memory_report_cli_recompute_ordering(tmp_path, capsys):
    out = tmp_path / "memory.json"
    rc = memory.main(["--model", "tiny-v512", "--layout", "fsdp", "--recompute", "none,selective,full", "--mbs",
                      str(MBS),
                      "--seq-len", str(SEQ), "--patches", "0", "--devices", "1", "--json", str(out),
                      "--compiler-option", "xla_backend_optimization_level=0", "dtype=float32"])
    assert rc == 0
    table = capsys.readouterr().out
    none, selective, full = rows = json.loads(out.read_text())
    assert [r["recompute"] for r in rows] == ["none", "selective", "full"]
    assert none["temp_bytes"] > selective["temp_bytes"] > full["temp_bytes"] > 0
    assert none["total_bytes"] > selective["total_bytes"] > full["total_bytes"]
    for r in rows:
        assert r["total_bytes"] == r["argument_bytes"] + r["output_bytes"] - r["alias_bytes"] + r["temp_bytes"]
        assert r["host_temp_bytes"] == 0  # nothing offloaded
    # reference: the arguments are the train state and the batch; the state is donated (aliased)
    trainer = Trainer.create(load_model_config("tiny-v512"), ComputeConfig(dtype="float32"), load_layout("fsdp"),
                             OptimizerConfig(), steps=1000, devices=jax.devices()[:1])
    state = trainer.abstract_state()
    batch = trainer.abstract_batch(MBS, SEQ, 0)
    assert set(batch) == {"input_ids", "positions", "segment_ids", "targets", "loss_mask"}
    assert batch["input_ids"].shape == (1, MBS, SEQ) and batch["positions"].shape == (1, 3, MBS, SEQ)
    for r in rows:  # jit drops inputs the step never reads (apply_if_finite's last_finite flag: 1 byte)
        assert 0 <= _nbytes(state) + _nbytes(batch) - r["argument_bytes"] <= 16, r
        assert 0 <= _nbytes(state) - r["alias_bytes"] <= 16, r
        assert 0 < r["output_bytes"] - r["alias_bytes"] < 4096  # + the step's scalar metrics
    lines = table.strip().splitlines()
    assert lines[1].split()[:4] == ["layout", "mbs", "recompute", "modules"]
    assert [ln.split()[2] for ln in lines[2:]] == ["none", "selective", "full"]


def test_abstract_batch_shapes_and_shardings():
    trainer = Trainer.create(load_model_config("tiny-v512"), ComputeConfig(), load_layout("fsdp"), OptimizerConfig(),
                             steps=10, grad_accum=2)
    batch = trainer.abstract_batch(2, 32, 24)
    rows = 2 * trainer.data_parallel_size
    assert trainer.data_parallel_size == len(jax.devices())
    assert batch["pixel_values"].shape == (2, rows, 24, 1536) and batch["patch_rc"].shape == (2, rows, 24, 2)
    assert batch["positions"].shape == (2, 3, rows, 32)
    assert batch["input_ids"].sharding.shard_shape(batch["input_ids"].shape) == (2, 2, 32)  # rows over all devices
    assert perf_memory.default_patches(4096) == 3072 and perf_memory.default_patches(130) == 96
