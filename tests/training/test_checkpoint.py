"""Checkpoints: sharded save/restore (same and different sharding), retention, iterator state, resume; a
damaged checkpoint (a data file truncated after its commit) skipped for the newest that restores, kept on disk;
a streamed save within its host budget; a checkpoint of the StandardSave format restored."""

from __future__ import annotations

import json
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moevlm_jax.schema import ConfigError
from moevlm_jax.training import optimizer as optim
from moevlm_jax.training.checkpoint import (
    Checkpointer,
    RestoreError,
    Skipped,
    abstract_like,
    error_reason,
    first_restorable,
    resume_steps,
    set_aside,
)
from moevlm_jax.training.config import OptimizerConfig
from tests.training.train_setup import damage_checkpoint


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def _train_state(mesh: Mesh, spec_w: P) -> dict:
    """params (sharded), AdamW state on a frozen/trainable partition, step and a typed rng key."""
    params = {
        "visual": {"blocks": {"w": jnp.arange(16 * 8, dtype=jnp.float32).reshape(16, 8) / 7}},
        "language_model": {"w": jnp.arange(32 * 8, dtype=jnp.float32).reshape(32, 8) - 5.0,
                           "norm": jnp.linspace(0.5, 1.5, 8, dtype=jnp.float32)},
    }
    shard = {"visual": {"blocks": {"w": NamedSharding(mesh, spec_w)}},
             "language_model": {"w": NamedSharding(mesh, spec_w), "norm": NamedSharding(mesh, P())}}
    params = jax.device_put(params, shard)
    trainable, _ = optim.partition(params, optim.trainable_mask(params, {"vision_model"}))
    tx, _ = optim.make_optimizer(OptimizerConfig(warmup_steps=0), total_steps=10)
    opt_state = tx.init(trainable)
    grads = jax.tree.map(lambda x: jnp.cos(x), trainable)
    _, opt_state = tx.update(grads, opt_state, trainable)  # non-trivial moments
    return {"params": params, "opt_state": opt_state, "step": jnp.asarray(7, jnp.int32),
            "rng": jax.random.key(42)}


def _assert_bitwise_equal(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b) and len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))


def test_sharded_round_trip_same_and_other_sharding(tmp_path):
    mesh = _mesh((8,), ("fsdp",))
    state = _train_state(mesh, P("fsdp"))
    data_state = {"next_index": np.int64(123), "epoch": 1, "shard": [0, 2]}
    with Checkpointer(tmp_path / "ckpt", save_every=5, keep=3) as ckpt:
        assert ckpt.save(10, state, data_state)
    # a fresh manager, as after a restart
    ckpt = Checkpointer(tmp_path / "ckpt", save_every=5, keep=3)
    assert ckpt.latest_step() == 10
    restored, it = ckpt.restore(abstract_like(state))
    _assert_bitwise_equal(restored, state)
    assert it == {"next_index": 123, "epoch": 1, "shard": [0, 2]}
    assert restored["params"]["language_model"]["w"].sharding == state["params"]["language_model"]["w"].sharding

    # onto another mesh and layout: 2 x 4, model dimension over "fsdp", rows over "data"
    mesh2 = _mesh((2, 4), ("data", "fsdp"))
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
            mesh2, P("data", "fsdp") if x.ndim == 2 else P())), state)
    restored2, _ = ckpt.restore(target, step=10)
    _assert_bitwise_equal(restored2, state)
    w = restored2["params"]["language_model"]["w"]
    assert w.sharding.spec == P("data", "fsdp") and w.addressable_shards[0].data.shape == (16, 2)
    ckpt.close()


def test_retention_interval_and_force(tmp_path):
    mesh = _mesh((8,), ("fsdp",))
    state = {"w": jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("fsdp"))), "step": jnp.asarray(0)}
    with Checkpointer(tmp_path, save_every=2, keep=2, async_save=True) as ckpt:
        started = [ckpt.save(s, {**state, "step": jnp.asarray(s)}, {"s": s}) for s in range(1, 8)]
        assert started == [False, True, False, True, False, True, False]
        assert ckpt.save(7, {**state, "step": jnp.asarray(7)}, {"s": 7}, force=True)  # final save
        assert not ckpt.save(7, state, force=True)  # an existing step is not rewritten
        ckpt.wait()
        assert ckpt.all_steps() == [6, 7]
    ckpt = Checkpointer(tmp_path, save_every=2, keep=2)
    assert ckpt.all_steps() == [6, 7]
    restored, it = ckpt.restore(abstract_like(state), step=6)
    assert int(restored["step"]) == 6 and it == {"s": 6}
    with pytest.raises(FileNotFoundError, match="no checkpoint for step 2"):
        ckpt.restore(abstract_like(state), step=2)
    ckpt.close()


def test_iterator_state_bytes_and_none(tmp_path):
    state = {"x": jnp.arange(4.0)}
    grain_like = b'{"last_seen_indices": {"0": 17}, "last_worker_index": 0}'
    with Checkpointer(tmp_path, save_every=1, keep=5) as ckpt:
        ckpt.save(1, state, grain_like)
        ckpt.save(2, state, None)
    ckpt = Checkpointer(tmp_path)
    assert ckpt.restore(abstract_like(state), step=1)[1] == grain_like
    assert ckpt.restore(abstract_like(state), step=2)[1] is None
    ckpt.close()


def test_resume_rules(tmp_path):
    assert resume_steps(tmp_path / "nothing", resume=False) == []
    assert resume_steps(tmp_path / "nothing", resume=True) == []
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        ckpt.save(3, {"x": jnp.zeros(2)})
        ckpt.save(5, {"x": jnp.zeros(2)})
    assert resume_steps(tmp_path, resume=True) == [5, 3]  # newest first: the order they are tried in
    assert resume_steps(tmp_path, resume=True, step=3) == [3]
    with pytest.raises(ConfigError, match=r"train.resume_step=4: no checkpoint for step 4 .*have \[3, 5\]"):
        resume_steps(tmp_path, resume=True, step=4)
    with pytest.raises(FileExistsError, match="pass --resume"):
        resume_steps(tmp_path, resume=False)


def _two_checkpoints(directory):
    """Checkpoints 4 and 8 of a small state (different values) with their data positions; the states."""
    states = {s: {"w": jnp.arange(64 * 64, dtype=jnp.float32).reshape(64, 64) * s, "b": jnp.full(3, s, jnp.int32)}
              for s in (4, 8)}
    with Checkpointer(directory, save_every=4, keep=3, async_save=False) as ckpt:
        for s, state in states.items():
            assert ckpt.save(s, state, {"batches": s})
    return states


def test_a_damaged_checkpoint_is_skipped_with_one_line_and_kept(tmp_path, caplog, capsys):
    states = _two_checkpoints(tmp_path)
    truncated = damage_checkpoint(tmp_path / "8")
    size = truncated.stat().st_size
    ckpt = Checkpointer(tmp_path, save_every=4, keep=3)
    with caplog.at_level(logging.INFO, logger="moevlm_jax.training.checkpoint"):
        restored = ckpt.restore_newest(abstract_like(states[4]))
    assert restored.step == 4 and restored.data_state == {"batches": 4}
    _assert_bitwise_equal(restored.state, states[4])
    (skipped,) = restored.skipped
    assert skipped.step == 8 and "OUT_OF_RANGE" in skipped.reason and len(skipped.reason) <= 300
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "checkpoint 8" in warnings[0] and skipped.reason in warnings[0]
    assert "Traceback" not in capsys.readouterr().err
    assert truncated.stat().st_size == size and ckpt.all_steps() == [4, 8]  # left as it was

    # asked for explicitly: no fallback, the reason in one message
    with pytest.raises(RestoreError, match=r"checkpoint 8 in .* does not restore: .*OUT_OF_RANGE"):
        ckpt.restore(abstract_like(states[8]), step=8)
    # set aside (renamed, never deleted), the step can be written again; a second time gets its own name
    (moved,) = set_aside(tmp_path, restored.skipped, "damaged")
    assert moved.kept_as == str(tmp_path / "8.damaged") and (tmp_path / "8.damaged" / "state").is_dir()
    ckpt.reload()
    assert ckpt.all_steps() == [4] and resume_steps(tmp_path, resume=True) == [4]
    assert ckpt.save(8, states[8], {"batches": 8}, force=True)
    ckpt.wait()
    assert ckpt.restore_newest(abstract_like(states[8])).step == 8
    assert set_aside(tmp_path, [Skipped(8, "again")], "damaged")[0].kept_as == str(tmp_path / "8.damaged-2")
    ckpt.close()


def test_none_restores_lists_every_step_tried(tmp_path):
    states = _two_checkpoints(tmp_path)
    for step in (4, 8):
        damage_checkpoint(tmp_path / str(step))
    with Checkpointer(tmp_path) as ckpt:
        with pytest.raises(RestoreError) as e:
            ckpt.restore_newest(abstract_like(states[4]))
    tried = r"no checkpoint in .* restores \(tried 8, 4\): 8: .*OUT_OF_RANGE.*; 4: .*OUT_OF_RANGE"
    assert re.search(tried, str(e.value))


def test_first_restorable_reason_is_the_innermost_cause():
    def restore(step):
        if step > 2:
            try:
                raise ValueError(f"OUT_OF_RANGE: byte range of step {step}\nmore detail")
            except ValueError as e:
                raise Exception("Encountered error while reading array index: " + "x" * 5000) from e
        return {"step": step}

    step, out, skipped = first_restorable([1, 3, 2, 4], restore, "here")
    assert (step, out) == (2, {"step": 2})
    assert [(s.step, s.reason) for s in skipped] == [(4, "ValueError: OUT_OF_RANGE: byte range of step 4"),
                                                     (3, "ValueError: OUT_OF_RANGE: byte range of step 3")]
    assert error_reason(RuntimeError("y" * 1000)).endswith("...") and len(error_reason(RuntimeError("y" * 1000))) == 300


def _host_bytes(x) -> int:
    """What a one-process save copies of ``x`` to the host: its data, a PRNG key's as its key data."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    return np.asarray(x).nbytes


def test_a_streamed_save_holds_at_most_its_budget_on_the_host(tmp_path):
    mesh = _mesh((8,), ("fsdp",))
    state = _train_state(mesh, P("fsdp"))  # arrays sharded over the 8 devices, replicated ones, scalars, a key
    state["embed"] = jax.device_put(jnp.arange(256 * 64, dtype=jnp.float32).reshape(256, 64) / 3,
                                    NamedSharding(mesh, P("fsdp")))  # 64 KiB: larger than the budget
    sizes = [_host_bytes(x) for x in jax.tree.leaves(state)]
    total, largest, budget = sum(sizes), max(sizes), 2000
    assert largest == 65536 and total - largest > budget  # the rest alone is over the budget too
    with Checkpointer(tmp_path, save_every=1, keep=3, stream_host_gb=budget / 1e9) as ckpt:
        assert ckpt.save(1, state, {"at": 1})  # periodic: the whole state copied to the host before save returns
        ckpt.wait()
        assert (ckpt.last_host_peak_bytes, ckpt.last_state_bytes, ckpt.host_bytes.held) == (total, total, 0)
        assert ckpt.save(2, state, {"at": 2}, streamed=True)
        assert ckpt.all_steps() == [1, 2]  # on disk when save returns
        peak = ckpt.last_host_peak_bytes
        assert ckpt.last_state_bytes == total and ckpt.host_bytes.held == 0 and not ckpt.host_bytes.unknown
        # the largest array alone in its batch, every other batch under the budget
        assert largest <= peak <= max(budget, largest) and peak < total, (peak, total)
    ckpt = Checkpointer(tmp_path)
    for step in (1, 2):
        restored, it = ckpt.restore(abstract_like(state), step=step)
        _assert_bitwise_equal(restored, state)
        assert it == {"at": step}
    assert restored["embed"].sharding == state["embed"].sharding
    ckpt.close()


def test_an_orbax_that_cannot_stream_saves_whole_and_says_so(tmp_path, monkeypatch, caplog):
    """Without the pinned orbax's transfer priorities (an environment that ignores pyproject's pin) the state is
    saved with orbax's plain PyTree handler: a streamed save is an ordinary one, waited for, said in one warning,
    and it restores exactly."""
    from moevlm_jax.training import checkpoint as ckpt_lib

    monkeypatch.setattr(ckpt_lib, "_TransferPriority", None)
    state = _train_state(_mesh((8,), ("fsdp",)), P("fsdp"))
    with caplog.at_level(logging.WARNING, logger="moevlm_jax"), Checkpointer(tmp_path, stream_host_gb=1e-6) as ckpt:
        assert not ckpt.streams
        assert ckpt.save(3, state, {"at": 3}, force=True, streamed=True) and ckpt.all_steps() == [3]
        restored, it = ckpt.restore(abstract_like(state), step=3)
    _assert_bitwise_equal(restored, state)
    assert it == {"at": 3}
    assert [r.getMessage() for r in caplog.records if "cannot stream" in r.getMessage()] == [
        f"checkpoint: orbax {ocp.__version__} cannot stream a save (pyproject asks for >= 0.12.8): step 3 is saved "
        "with one host copy of the state"]


def _files(step_dir):
    """The files of a checkpoint but its array data (content-named), as relative paths."""
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*")
                  if p.is_file() and "d" not in p.relative_to(step_dir).parts)


def test_a_checkpoint_written_by_standard_save_restores(tmp_path):
    """Checkpoints before streamed saves were written with StandardSave (StandardCheckpointHandler): the same
    files as now (only the handler's name in the step's metadata differs), and they restore."""
    state = _train_state(_mesh((8,), ("fsdp",)), P("fsdp"))
    old = ocp.CheckpointManager(tmp_path / "old", options=ocp.CheckpointManagerOptions(create=True),
                                item_names=("state", "data"))
    old.save(5, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                        data=ocp.args.JsonSave({"iterator": {"next_index": 40}})))
    old.close()
    with Checkpointer(tmp_path / "old") as ckpt:
        restored = ckpt.restore_newest(abstract_like(state))
    assert restored.step == 5 and restored.data_state == {"next_index": 40} and not restored.skipped
    _assert_bitwise_equal(restored.state, state)

    with Checkpointer(tmp_path / "new", async_save=False) as ckpt:
        assert ckpt.save(5, state, {"next_index": 40}, force=True, streamed=True)
    old_dir, new_dir = tmp_path / "old" / "5", tmp_path / "new" / "5"
    assert _files(old_dir) == _files(new_dir) and "state/array_metadatas/process_0" in _files(new_dir)
    assert json.loads((old_dir / "state" / "_METADATA").read_text()) == \
        json.loads((new_dir / "state" / "_METADATA").read_text())
