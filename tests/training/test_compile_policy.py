"""``train.compile`` (moevlm_jax.training.compile_policy): the old six compile flags load as the one setting
with a deprecation warning, contradictions are errors that say what to set, and each mode makes the trainer
calls stated here by hand (which shapes are reserved, which programs compile ahead)."""
from __future__ import annotations

import logging

import jax
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.config.run import load_config
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.schema import ConfigError, build
from moevlm_jax.training.compile_policy import CompilePolicy
from moevlm_jax.training.config import OptimizerConfig, TrainConfig
from moevlm_jax.training.trainer import Trainer
from tests.training.train_setup import COMPUTE


@pytest.mark.parametrize("old, mode", [
    ({"reuse_shapes": False}, "exact"),
    ({"reuse_shapes": True}, "lazy"),
    ({"reserve_largest_bucket": False}, "lazy"),
    ({"reserve_largest_bucket": True}, "reserve"),
    ({"compile_ahead": True}, "ahead"),
    ({"reserve_largest_bucket": True, "compile_ahead": True}, "ahead"),
    ({"reserve_largest_bucket": True, "compile_ahead": True, "kernels_ahead": True, "eval_ahead": True}, "ahead"),
    # an old run's config.yaml: every flag written, at its old default
    ({"reuse_shapes": True, "reserve_largest_bucket": False, "reserve_bucket": None, "compile_ahead": False,
      "kernels_ahead": True, "eval_ahead": True}, "lazy"),
])
def test_old_compile_flags_load_as_train_compile_with_a_deprecation_warning(old, mode, caplog):
    with caplog.at_level(logging.WARNING):
        tr = build(TrainConfig, old, "train")
    assert tr.compile == mode and tr.reuse_shapes == (mode != "exact")
    flags = ", ".join(f"train.{k}={str(v).lower()}" for k, v in old.items() if k != "reserve_bucket")
    assert f"deprecated config keys {flags}: they are now train.compile={mode}" in caplog.text
    assert not hasattr(tr, "reserve_largest_bucket") and "reuse_shapes" not in TrainConfig.__dataclass_fields__


def test_the_old_reserve_bucket_is_train_compile_bucket(caplog):
    """Recipe h200's old keys: the same setting as its new ones."""
    with caplog.at_level(logging.WARNING):
        old = build(TrainConfig, {"reserve_largest_bucket": True, "reserve_bucket": 3136, "compile_ahead": True},
                    "train")
    assert "config key 'train.reserve_bucket' is deprecated: it is now 'train.compile_bucket'" in caplog.text
    assert old == build(TrainConfig, {"compile": "ahead", "compile_bucket": 3136}, "train")


@pytest.mark.parametrize("raw, says", [
    # the old check: compile_ahead needs reserve_largest_bucket (and reuse_shapes)
    ({"compile_ahead": True, "reserve_largest_bucket": False}, "set train.compile=ahead"),
    ({"compile_ahead": True, "reuse_shapes": False}, "set train.compile=ahead"),
    ({"reserve_largest_bucket": True, "reuse_shapes": False}, "set train.compile=reserve"),
    ({"reuse_shapes": False, "compile": "ahead"},
     "disagree with train.compile='ahead' (those flags are train.compile=exact); keep train.compile"),
    ({"compile_ahead": True, "compile": "reserve"}, "keep train.compile and drop the old keys"),
    ({"eval_ahead": False}, "train.eval_ahead=false is no longer a setting"),
    ({"kernels_ahead": False, "compile_ahead": True}, "train.kernels_ahead=false is no longer a setting"),
    ({"compile_bucket": 512}, "set train.compile=reserve (or ahead), or train.compile_bucket=null"),
    ({"compile": "lazy", "reserve_bucket": 512}, "train.compile_bucket=512 reserves a patch bucket"),
    ({"compile": "eager"}, "train.compile: 'eager' is not one of ['exact', 'lazy', 'reserve', 'ahead']"),
])
def test_contradicting_compile_settings_say_what_to_set(raw, says):
    with pytest.raises(ConfigError) as e:
        build(TrainConfig, raw, "train")
    assert says in str(e.value)


def test_help_config_documents_the_modes():
    from moevlm_jax.config.run import help_config

    line = next(ln for ln in help_config().splitlines() if ln.startswith("train.compile "))
    for mode in ("'exact'", "'lazy'", "'reserve'", "'ahead'"):
        assert mode in line
    assert "reuse_shapes=false is exact" in line and "compile_ahead=true ahead" in line


class RecordingTrainer:
    """The trainer calls a policy makes, recorded (a loss capacity of 96 for a whole batch)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def largest_capacity(self, rows, seq_len):
        self.calls.append(("largest_capacity", rows, seq_len))
        return 96

    def reserve_patches(self, patches, *, capacity=0, train=True):
        self.calls.append(("reserve", "train" if train else "eval", patches, capacity))

    def abstract_batch(self, mbs, seq_len, patches, balance=False):
        return ("train batch", mbs, seq_len, patches)

    def abstract_eval_batch(self, mbs, seq_len, patches, balance=False):
        return ("eval batch", mbs, seq_len, patches)

    def compile_ahead(self, state, arrays, capacity, **_):
        self.calls.append(("compile ahead", state, arrays, capacity))

    def compile_eval_ahead(self, params, arrays, capacity, **_):
        self.calls.append(("compile eval ahead", params, arrays, capacity))


def _policy(mode, *extra, evaluates=True):
    # cpu-default on the 8 test devices under FSDP: global batch 8 (MBS 1), rows of 256 tokens, patch buckets
    # 256 / 512 here (the recipe's data has [512])
    cfg = load_config("cpu-default", overrides=[f"train.compile={mode}", "data.patch_buckets=[256, 512]", *extra],
                      num_devices=8, num_processes=1)
    assert (cfg.global_batch_size, cfg.train.micro_batch_size, cfg.train.seq_len) == (8, 1, 256)
    return CompilePolicy.from_config(cfg, evaluates=evaluates)


ABSTRACT = {"params": "abstract params"}


@pytest.mark.parametrize("mode, extra, evaluates, reuse, ahead, calls", [
    ("exact", (), True, False, (), []),
    ("lazy", (), True, True, (), []),
    ("reserve", (), True, True, (), [("reserve", "train", 512, 0)]),
    ("reserve", ("train.compile_bucket=256",), True, True, (), [("reserve", "train", 256, 0)]),
    ("ahead", (), False, True, ("train",), [
        ("largest_capacity", 8, 256), ("reserve", "train", 512, 96),
        ("compile ahead", ABSTRACT, ("train batch", 1, 256, 512), 96)]),
    ("ahead", ("train.compile_bucket=256",), True, True, ("train", "eval"), [
        ("largest_capacity", 8, 256), ("reserve", "train", 256, 96),
        ("compile ahead", ABSTRACT, ("train batch", 1, 256, 256), 96),
        ("reserve", "eval", 256, 96), ("compile eval ahead", "abstract params", ("eval batch", 1, 256, 256), 96)]),
])
def test_each_mode_reserves_and_compiles_ahead_what_it_says(mode, extra, evaluates, reuse, ahead, calls):
    policy = _policy(mode, *extra, evaluates=evaluates)
    assert policy.reuse_shapes == reuse and policy.ahead == ahead
    trainer = RecordingTrainer()
    policy.reserve(trainer)
    policy.start(trainer, ABSTRACT)
    assert trainer.calls == calls


def test_a_compile_bucket_outside_the_data_buckets_is_refused():
    with pytest.raises(ConfigError, match=r"train.compile_bucket 300 is not one of data.patch_buckets \[256, 512\]"):
        _policy("reserve", "train.compile_bucket=300")


def test_the_policy_sets_the_trainers_shapes():
    """Read off a real trainer: ``exact`` pads nothing (no reserve takes), ``reserve`` puts the bucket at the
    floor of the training steps only, ``ahead`` with the largest loss capacity of a batch of 8 rows x 256
    tokens on one device short of whole rows (objective.largest_capacity: 2048 positions -> 1024)."""
    for mode, shapes in (("exact", {}), ("lazy", {}), ("reserve", {"train": [(512, 0)]}),
                         ("ahead", {"train": [(512, 1024)]})):
        policy = _policy(mode)
        trainer = Trainer.create(load_model_config("tiny"), ComputeConfig.from_dict(COMPUTE), load_layout("fsdp"),
                                 OptimizerConfig(), steps=1, devices=jax.devices()[:1],
                                 reuse_shapes=policy.reuse_shapes)
        assert trainer.reuse_shapes == (mode != "exact")
        policy.reserve(trainer)
        trainer.reserve_patches(256, capacity=None, train=False)  # an evaluation's floor: taken unless exact
        want = dict(shapes)
        if mode != "exact":
            want["eval"] = [(256, float("inf"))]
        assert trainer._shapes == want, mode


def test_gpu_default_compiles_one_training_shape_at_the_largest_bucket_ahead():
    """configs/recipes/gpu-default.yaml (on 8 GPUs: MBS 8) as recipe h200: the training step compiled ahead, every
    batch padded to the proxy data's largest patch bucket, so no larger bucket recompiles mid-run."""
    cfg = load_config("gpu-default", num_devices=8, num_processes=1)
    assert cfg.train.compile == "ahead" and cfg.train.compile_bucket is None
    policy = CompilePolicy.from_config(cfg, evaluates=cfg.train.eval_every > 0)
    largest = max(cfg.data.patch_buckets)
    assert policy.bucket == largest == 3456 and policy.ahead == ("train", "eval")
    trainer = RecordingTrainer()
    policy.reserve(trainer)
    policy.start(trainer, ABSTRACT)
    assert [c for c in trainer.calls if c[0] == "compile ahead"] == [
        ("compile ahead", ABSTRACT, ("train batch", 8, 4096, largest), 96)]
    assert ("reserve", "train", largest, 96) in trainer.calls
