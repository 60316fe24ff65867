"""bf16 parameters (HF's setting, and what fits a 6B model with its optimizer on one GPU) train
through the same step as float32 ones: the AdamW state in the configured dtype, updates skipped on
non-finite gradients (the two branches of ``optimizer.apply_if_finite``'s cond must agree in dtype), parameters
staying bf16; from the same initial weights the losses track the float32-parameter run's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.trainer import Trainer
from tests.parallelism.test_layouts import random_params
from tests.training.train_setup import host_batches

# quick compiles (tests/xla_options.py): the float32-parameter run compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

STEPS = 3
# 4 rows a step: the step's cost follows its rows (the 151936-token LM head, bf16 matmuls on CPU); the checks
# compare losses of the same batches (bf16 vs float32 within 2%, measured < 1e-3) and a drop of > 0.3 (~0.9 here)
ROWS = 4


def _run(param_dtype: str, state_dtype: str, batches: list, params=None):
    compute = ComputeConfig.from_dict({"dtype": "bfloat16", "param_dtype": param_dtype})
    optimizer = OptimizerConfig(lr=3e-3, warmup_steps=1, weight_decay=0.01, state_dtype=state_dtype)
    trainer = Trainer.create(load_model_config("tiny"), compute, load_layout("fsdp"), optimizer, steps=10,
                             devices=jax.devices()[:2])
    state = trainer.init_state(seed=0, params=params)
    initial = jax.device_get(state["params"])
    losses, skipped = [], []
    for b in batches:
        state, metrics = trainer.step(state, trainer.prepare(b))
        m = jax.device_get(metrics)
        losses.append(float(m["ce_loss"]))
        skipped.append(int(m["skipped"]))
    return losses, skipped, state, initial


def test_bf16_params_train_like_float32_params(tmp_path):
    batches = host_batches(STEPS, rows=ROWS)
    # initial parameters drawn in numpy (the layout tests' random_params: no initialiser compiled)
    ref_losses, _, _, initial = _run("float32", "float32", batches, params=random_params(load_model_config("tiny")))
    bf16_init = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, initial)
    for state_dtype in ("float32", "bfloat16"):
        losses, skipped, state, _ = _run("bfloat16", state_dtype, batches, params=bf16_init)
        floats = [x for x in jax.tree.leaves(state["params"]) if jnp.issubdtype(x.dtype, jnp.floating)]
        assert floats and all(x.dtype == jnp.bfloat16 for x in floats)
        moments = [x for x in jax.tree.leaves(state["opt_state"]) if jnp.issubdtype(x.dtype, jnp.floating)
                   and x.ndim > 1]
        assert moments and all(x.dtype == jnp.dtype(state_dtype) for x in moments), state_dtype
        assert skipped == [0] * STEPS and all(np.isfinite(losses))
        # step 1 sees the bf16-rounded initial weights; later steps bf16 updates: close, not equal
        np.testing.assert_allclose(losses, ref_losses, rtol=2e-2, err_msg=state_dtype)
        assert losses[-1] < losses[0] - 0.3  # it trains
    assert ref_losses[-1] < ref_losses[0] - 0.3
