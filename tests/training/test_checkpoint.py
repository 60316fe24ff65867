"""Checkpoints: sharded save/restore (same and different sharding), retention, iterator state, resume."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moevlm_jax.training import optimizer as optim
from moevlm_jax.training.checkpoint import Checkpointer, abstract_like, resume_step
from moevlm_jax.training.config import OptimizerConfig


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
    assert resume_step(tmp_path / "nothing", resume=False) is None
    assert resume_step(tmp_path / "nothing", resume=True) is None
    with Checkpointer(tmp_path, save_every=1) as ckpt:
        ckpt.save(3, {"x": jnp.zeros(2)})
        ckpt.save(5, {"x": jnp.zeros(2)})
    assert resume_step(tmp_path, resume=True) == 5
    with pytest.raises(FileExistsError, match="pass --resume"):
        resume_step(tmp_path, resume=False)
