"""The pieces together, as the train step uses them: a toy model trained with freezing, gradient
accumulation, AdamW, async metrics and a checkpoint; stopping at step 3 and resuming must give
bitwise the same parameters as running 6 steps straight."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moevlm_jax.training import optimizer as optim
from moevlm_jax.training.checkpoint import Checkpointer, abstract_like
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.metrics import (
    MetricsWriter,
    StepTracker,
    batch_token_counts,
    read_metrics,
)

GRAD_ACCUM, ROWS, SEQ, DIM = 2, 8, 4, 8


class ToyData:
    """A deterministic iterator with get_state/set_state, like a grain DatasetIterator."""

    def __init__(self) -> None:
        self.index = 0

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(self.index)
        self.index += 1
        seg = (rng.random((GRAD_ACCUM * ROWS, SEQ)) < 0.8).astype(np.int32)
        return {"x": rng.normal(size=(GRAD_ACCUM * ROWS, SEQ, DIM)).astype(np.float32),
                "y": rng.normal(size=(GRAD_ACCUM * ROWS, SEQ)).astype(np.float32),
                "segment_ids": seg, "loss_mask": seg.astype(np.float32)}

    def get_state(self) -> dict:
        return {"index": self.index}

    def set_state(self, state: dict) -> None:
        self.index = state["index"]


def _setup():
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))
    rng = np.random.default_rng(0)
    params = {"visual": {"blocks": {"w": rng.normal(size=(DIM, DIM)).astype(np.float32)},
                         "merger": {"w": rng.normal(size=(DIM, DIM)).astype(np.float32)}},
              "language_model": {"w": rng.normal(size=(DIM,)).astype(np.float32)}}
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, P("fsdp")), params)
    params = jax.device_put(params, shardings)
    mask = optim.trainable_mask(params, optim.frozen_groups(freeze_vision_model=True))
    tx, schedule = optim.make_optimizer(OptimizerConfig(lr=1e-2, warmup_steps=2), total_steps=6)
    trainable, _ = optim.partition(params, mask)
    state = {"params": params, "opt_state": jax.jit(tx.init)(trainable), "step": jnp.asarray(0, jnp.int32),
             "rng": jax.random.key(0)}

    def loss_fn(trainable, frozen, mb, total):
        p = optim.combine(trainable, frozen)
        h = jnp.tanh(mb["x"] @ p["visual"]["blocks"]["w"]) @ p["visual"]["merger"]["w"]
        err = (h @ p["language_model"]["w"] - mb["y"]) ** 2 * mb["loss_mask"]
        return jnp.sum(err) / total, {"loss_sum": jnp.sum(err), "trained_tokens": jnp.sum(mb["loss_mask"])}

    # fixed state shardings (out_shardings), so a restored state compiles to the very same program
    state_shardings = jax.tree.map(
        lambda x: x.sharding if isinstance(x.sharding, NamedSharding) else NamedSharding(mesh, P()), state)
    state = jax.device_put(state, state_shardings)

    @jax.jit
    def train_step(state, micro):
        trainable, frozen = optim.partition(state["params"], mask)
        total = jnp.maximum(jnp.sum(micro["loss_mask"]), 1.0)  # trained tokens of the global batch
        obj, grads, sums = optim.accumulate_gradients(
            lambda tr, mb: loss_fn(tr, frozen, mb, total), trainable, micro)
        updates, opt_state = tx.update(grads, state["opt_state"], trainable)
        params = optim.combine(optax.apply_updates(trainable, updates), frozen)
        metrics = {"loss": obj, "grad_norm": optax.tree.norm(grads), "lr": schedule(state["step"]),
                   "skipped": optim.skipped_updates(opt_state), **sums}
        rng, _ = jax.random.split(state["rng"])
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}
        return jax.lax.with_sharding_constraint(new, state_shardings), metrics

    return mesh, state, train_step


def _run(state, train_step, data, start, stop, writer, ckpt=None):
    tracker = StepTracker(num_devices=8)
    for step in range(start, stop):
        batch = next(data)
        state, metrics = train_step(state, optim.split_microbatches(batch, GRAD_ACCUM))
        record = tracker.push(step, metrics, batch_token_counts(batch))
        if record:
            writer.write(record["step"], {**record, **tracker.window()})
        if ckpt is not None and ckpt.save(step + 1, state, data.get_state()):
            tracker.discard_next_interval()
    record = tracker.flush()
    writer.write(record["step"], record)
    return state


def test_stop_and_resume_equals_straight_run(tmp_path):
    _, state0, train_step = _setup()
    with MetricsWriter(tmp_path / "straight", tensorboard=False) as w:
        straight = _run(state0, train_step, ToyData(), 0, 6, w)

    with MetricsWriter(tmp_path / "run", tensorboard=False) as w, \
            Checkpointer(tmp_path / "run" / "checkpoints", save_every=3, keep=2) as ckpt:
        _run(state0, train_step, ToyData(), 0, 4, w, ckpt)  # saves after step 3 (state.step == 3)
    # a new process: fresh state of the same shapes, restore, continue the data where it stopped
    _, fresh, _ = _setup()
    with Checkpointer(tmp_path / "run" / "checkpoints", save_every=3, keep=2) as ckpt:
        assert ckpt.all_steps() == [3]
        state, data_state = ckpt.restore(abstract_like(fresh))
    data = ToyData()
    data.set_state(data_state)
    assert int(state["step"]) == 3 and data.index == 3
    with MetricsWriter(tmp_path / "run", tensorboard=False, resume_step=2) as w:
        resumed = _run(state, train_step, data, 3, 6, w)

    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(resumed)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # frozen vision blocks never moved; trained parts did
    np.testing.assert_array_equal(straight["params"]["visual"]["blocks"]["w"],
                                  state0["params"]["visual"]["blocks"]["w"])
    assert not np.array_equal(straight["params"]["visual"]["merger"]["w"], state0["params"]["visual"]["merger"]["w"])
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "run")
    assert [r["step"] for r in b] == list(range(6))
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["lr"] for r in a][:2] == pytest.approx([5e-3, 1e-2]) and a[5]["lr"] < a[2]["lr"]
    assert all(r["skipped"] == 0 and r["trained_tokens"] == r["useful_tokens"] for r in a)
