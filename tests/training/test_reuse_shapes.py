"""``train.compile`` lazy (the default; reuse_shapes): the trainer pads a batch up to the largest patch axis and
loss capacity its kind has had, so that it runs the step compiled for them (one compile, not one per
combination), with the same result as the batch's own step."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.data.batch import PATCH_KEYS
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.schema import ConfigError
from moevlm_jax.training.config import OptimizerConfig, TrainConfig
from moevlm_jax.training.trainer import Trainer
from tests.training.train_setup import COMPUTE, SEQ_LEN, host_batches

# quick compiles (tests/xla_options.py): the padded and the batch's own step compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")
# rows of the steps run here: what is checked is which step runs a batch and that its result is the batch's own
ROWS = 4


def _trainer(reuse: bool) -> Trainer:
    return Trainer.create(load_model_config("tiny"), ComputeConfig.from_dict(COMPUTE), load_layout("fsdp"),
                          OptimizerConfig(lr=1e-3, warmup_steps=1), steps=4, devices=jax.devices()[:1],
                          reuse_shapes=reuse)


def _with_patches(batch, extra):
    out = dict(batch)
    for k in (k for k in PATCH_KEYS if k in batch):
        pad = [(0, 0)] * np.ndim(batch[k])
        pad[1] = (0, extra)
        out[k] = np.pad(batch[k], pad)
    return out


def test_the_largest_shapes_so_far_are_kept_per_kind():
    tr = _trainer(True)
    batch = {"pixel_values": np.ones((2, 8, 3), np.float32), "patch_rc": np.ones((2, 8, 2), np.int32),
             "patch_hw": np.ones((2, 8, 2), np.int32), "patch_segment_ids": np.ones((2, 8), np.int32)}
    wide = _with_patches(batch, 4)
    seen = []
    for kind, arrays, cap in (("train", wide, 64), ("train", batch, 32), ("eval", batch, 48), ("train", batch, None),
                              ("train", wide, 96), ("eval", batch, 40)):
        out, c = tr._reused_shapes(kind, arrays, cap)
        seen.append((out["pixel_values"].shape[1], c))
        if out["pixel_values"].shape[1] > arrays["pixel_values"].shape[1]:  # padded as the pipeline pads
            for k in (k for k in PATCH_KEYS if k in arrays):
                np.testing.assert_array_equal(out[k][:, :8], arrays[k])
                assert not out[k][:, 8:].any()
    # train: 12 patches from the first batch on; capacity 64, then None (whole rows) above any number;
    # eval keeps its own (8 patches, 48)
    assert seen == [(12, 64), (12, 64), (8, 48), (12, None), (12, None), (8, 48)]
    assert TrainConfig().reuse_shapes  # the train job's default


def test_reserved_batches_set_the_floor_before_any_is_prepared():
    """The evaluation reads its batches first and reserves them: every one then has the largest shapes."""
    tr = _trainer(True)

    def batch(patches, trained):
        mask = np.zeros((2, 256), np.float32)
        mask.flat[:trained] = 1
        return {"loss_mask": mask, "pixel_values": np.zeros((2, patches, 3), np.float32)}

    small, large = batch(8, 40), batch(12, 100)  # capacities 40 and 112 (quarter steps between powers of 2)
    tr.reserve([small, large])
    assert tr._reused_shapes("eval", dict(small), 40)[1] == 112
    assert tr._reused_shapes("eval", dict(small), 40)[0]["pixel_values"].shape == (2, 12, 3)
    assert tr._shapes == {"eval": [(12, 112)]}  # one step for all of them; the eval floor only
    plain = _trainer(False)
    plain.reserve([small, large])
    assert plain._shapes == {}


def test_a_reserved_bucket_is_the_floor_from_the_first_batch():
    """``train.compile=reserve``: the loop reserves the data's largest patch bucket for the train
    steps before the first batch; a smaller batch is padded to it, a larger one still grows it, capacity
    is untouched, eval keeps its own floor; without reuse_shapes nothing is reserved."""
    tr = _trainer(True)
    tr.reserve_patches(16)
    batch = {"pixel_values": np.ones((2, 8, 3), np.float32), "patch_rc": np.ones((2, 8, 2), np.int32),
             "patch_hw": np.ones((2, 8, 2), np.int32), "patch_segment_ids": np.ones((2, 8), np.int32)}
    out, cap = tr._reused_shapes("train", batch, 40)
    assert out["pixel_values"].shape[1] == 16 and cap == 40
    for k in (k for k in PATCH_KEYS if k in batch):  # padded as the pipeline pads
        np.testing.assert_array_equal(out[k][:, :8], batch[k])
        assert not out[k][:, 8:].any()
    assert tr._reused_shapes("train", _with_patches(batch, 12), 40)[0]["pixel_values"].shape[1] == 20
    assert tr._reused_shapes("eval", batch, 40)[0]["pixel_values"].shape[1] == 8
    plain = _trainer(False)
    plain.reserve_patches(16)
    assert plain._shapes == {} and TrainConfig().compile == "lazy"  # opt-in


def test_a_batch_over_the_reserved_bucket_does_not_pad_the_later_ones():
    """``train.compile_bucket`` below the largest: a batch over it gets a step of its own (the largest
    patch axis and capacity so far), and the batches the reserved shape holds keep running it; a batch
    neither holds gets the largest of each (a chain: each shape holds the ones before it)."""
    tr = _trainer(True)
    tr.reserve_patches(16, capacity=40)
    batch = {"pixel_values": np.ones((2, 8, 3), np.float32), "patch_segment_ids": np.ones((2, 8), np.int32)}
    seen = [(out["pixel_values"].shape[1], c) for out, c in (
        tr._reused_shapes("train", _with_patches(batch, n), cap) for n, cap in (
            (0, 40), (16, 32), (0, 40), (8, 24), (0, 64), (0, 48), (4, 40)))]
    assert seen == [(16, 40), (24, 40), (16, 40), (16, 40), (24, 64), (24, 64), (16, 40)]
    assert tr._shapes["train"] == [(16, 40), (24, 40), (24, 64)]


@pytest.mark.parametrize("bucket", [None, "smallest", "none of them"])
def test_the_loop_reserves_the_largest_bucket(monkeypatch, tmp_path, bucket):
    """The train job calls it with the data's largest bucket (``data.max_patches``) when asked, or with
    ``train.compile_bucket``, one of ``data.patch_buckets`` (else a clear error before any compile);
    stopped right after: no step needed to see the call."""
    from moevlm_jax.config.run import load_config
    from moevlm_jax.training import loop

    seen = []

    class Reserved(Exception):
        pass

    def record(self, patches, *, capacity=0, train=True):
        seen.append((patches, capacity, train))
        raise Reserved

    monkeypatch.setattr(Trainer, "reserve_patches", record)
    cfg = load_config("cpu-default", run_dir=str(tmp_path / "run"), overrides=[
        "train.steps=1", "train.checkpointing=false", "train.compile=reserve"])
    want = cfg.data.max_patches
    if bucket is not None:
        want = min(cfg.data.patch_buckets) if bucket == "smallest" else want + 1
        cfg = load_config("cpu-default", run_dir=str(tmp_path / "run"), overrides=[
            "train.steps=1", "train.checkpointing=false", "train.compile=reserve",
            f"train.compile_bucket={want}"])
    if bucket == "none of them":
        with pytest.raises(ConfigError, match="not one of data.patch_buckets"):
            loop.run(cfg, progress=False)
        assert seen == []
        return
    with pytest.raises(Reserved):
        loop.run(cfg, progress=False)
    assert seen == [(want, 0, True)]  # capacity reserved only with train.compile=ahead


def test_a_smaller_batch_runs_the_larger_compiled_step_with_its_own_result(tmp_path):
    (batch,) = host_batches(1, rows=ROWS)
    wider = _with_patches(batch, 16)  # the same samples with a larger patch bucket: the same step result
    reuse, plain = _trainer(True), _trainer(False)
    reuse.step(reuse.init_state(seed=0), reuse.prepare(wider))
    placed = reuse.prepare(batch)
    assert placed.arrays["pixel_values"].shape[-2] == wider["pixel_values"].shape[1]
    _, got = reuse.step(reuse.init_state(seed=0), placed)
    assert len([k for k in reuse.compiled if k[0] == "train"]) == 1  # one compile for both batches
    _, want = plain.step(plain.init_state(seed=0), plain.prepare(batch))
    assert placed.counts == plain.prepare(batch).counts  # tokens / useful tokens as the batch has them
    for k in ("loss", "grad_norm", "trained_tokens"):
        assert float(got[k]) == pytest.approx(float(want[k]), rel=1e-6), k


def test_a_step_compiled_ahead_runs_the_batches_of_its_shape_with_their_own_result(tmp_path):
    """``Trainer.compile_ahead`` (``train.compile=ahead``): the step compiled in a background thread from
    abstract inputs (``abstract_batch``, the reserved bucket and the largest capacity) runs the first
    batch without the jit path compiling, with the plain trainer's result; a batch of another shape
    compiles as usual."""
    from moevlm_jax.training.trainer import _train_step

    (batch,) = host_batches(1, rows=ROWS)
    patches = batch["pixel_values"].shape[1]
    ahead, plain = _trainer(True), _trainer(True)
    capacity = ahead.largest_capacity(ROWS, SEQ_LEN)
    assert capacity == SEQ_LEN * ROWS // 2  # 4 rows x 128 tokens: 256 is a capacity step
    ahead.reserve_patches(patches, capacity=capacity)
    ahead.compile_ahead(ahead.abstract_state(), ahead.abstract_batch(ROWS, SEQ_LEN, patches), capacity)
    state = ahead.init_state(seed=0)
    jitted = _train_step._cache_size()
    placed = ahead.prepare(batch)
    assert placed.capacity == capacity
    _, got = ahead.step(state, placed)
    assert ahead.ahead_steps == 1 and _train_step._cache_size() == jitted  # the jit path compiled nothing
    _, want = plain.step(plain.init_state(seed=0), plain.prepare(batch))
    for k in ("loss", "grad_norm", "trained_tokens"):
        assert float(got[k]) == pytest.approx(float(want[k]), rel=1e-6), k
    wider = ahead.prepare(_with_patches(batch, 16))  # another shape: the usual compile
    ahead.step(ahead.init_state(seed=0), wider)
    assert ahead.ahead_steps == 1 and len([k for k in ahead.compiled if k[0] == "train"]) == 2


def test_an_eval_step_compiled_ahead_runs_the_eval_batches_of_its_shape_with_their_own_result(tmp_path):
    """``Trainer.compile_eval_ahead`` (``train.compile=ahead``): the eval step compiled in a background thread after
    the train step, from abstract inputs (``abstract_eval_batch``: the train step's bucket and capacity, one
    microbatch's rows), evaluates without the jit path compiling, with the metrics and predictions of the plain
    trainer's eval of the unpadded batch; a batch of another shape compiles as usual."""
    from moevlm_jax.training.trainer import _eval_step

    (batch,) = host_batches(1, rows=ROWS)
    patches = batch["pixel_values"].shape[1] + 8  # the reserved bucket above the batch's: its rows padded
    ahead, plain = _trainer(True), _trainer(False)
    capacity = ahead.largest_capacity(ROWS, SEQ_LEN)
    ahead.reserve_patches(patches, capacity=capacity)
    ahead.reserve_patches(patches, capacity=capacity, train=False)
    abstract = ahead.abstract_state()
    ahead.compile_ahead(abstract, ahead.abstract_batch(ROWS, SEQ_LEN, patches), capacity)
    ahead.compile_eval_ahead(abstract["params"], ahead.abstract_eval_batch(ROWS, SEQ_LEN, patches), capacity)
    params = ahead.init_state(seed=0)["params"]
    jitted = _eval_step._cache_size()
    got, got_pred = ahead.evaluate(params, batch)
    assert ahead.ahead_evals == 1 and _eval_step._cache_size() == jitted  # the jit path compiled nothing
    assert [k[0] for k in ahead.compiled] == ["eval"]
    want, want_pred = plain.evaluate(plain.init_state(seed=0)["params"], batch)
    assert got["tokens"] == want["tokens"] > 0
    assert got["ce_sum"] == pytest.approx(want["ce_sum"], rel=1e-6)
    np.testing.assert_array_equal(got_pred, want_pred)
    ahead.evaluate(params, _with_patches(batch, 16))  # over the reserved bucket: the usual compile
    assert ahead.ahead_evals == 1 and len([k for k in ahead.compiled if k[0] == "eval"]) == 2


def test_a_compile_bucket_needs_a_mode_that_reserves_one():
    with pytest.raises(ValueError, match="train.compile=reserve"):
        TrainConfig(compile_bucket=512)
    assert TrainConfig(compile="ahead", compile_bucket=512).compile_bucket == 512


def test_the_loop_compiles_the_first_step_ahead(tmp_path):
    """The train job with ``train.compile=ahead``: its first step runs the executable compiled from the
    start, and its evaluation the eval step compiled after it (the abstract batches match
    the loaders' arrays: shapes, dtypes, shardings, capacity)."""
    import yaml

    from moevlm_jax.config.run import load_config
    from moevlm_jax.training import loop
    from tests.training.train_setup import data_config

    data = tmp_path / "data.yaml"
    data.write_text(yaml.safe_dump(data_config()))
    cfg = load_config("cpu-default", model="tiny", data=str(data), run_dir=str(tmp_path / "run"), overrides=[
        "train.steps=2", "train.checkpointing=false", "train.eval_every=0", "train.eval_batches=2",
        "train.show_answers=0", "train.tensorboard=false", "train.compile=ahead", "compute.dtype=float32",
        f"train.seq_len={SEQ_LEN}"])
    summary = loop.run(cfg, progress=False)
    # and the evaluation at the end ran the eval step compiled ahead, every held-out batch (no other compile)
    assert summary["compiled_ahead"] == 2 and summary["evals_compiled_ahead"] >= 1, summary
    assert summary["compiles"] == 2 and len(summary["evals"]) == 1 and summary["evals"][0]["tokens"] > 0, summary
