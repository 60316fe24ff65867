"""The trainer checks each batch against the cuDNN ragged bounds on the host (``DeviceBatch.bounded``)
and compiles the step without the attention's device-side fallback (``attention.rows_within_bound``)
when every row is within them; a batch over a bound gets the step with the fallback (its own compile).
The two programs give the same step (on CPU both run XLA attention; the cuDNN path's equality is
tests/model/test_attention_residuals.py's)."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.trainer import Trainer
from tests.parallelism.test_layouts import random_params
from tests.training.train_setup import COMPUTE, host_batches

# quick compiles (tests/xla_options.py): both steps compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")


def _trainer(options):
    compute = ComputeConfig.from_dict({**COMPUTE, "attention_options": options})
    return Trainer.create(load_model_config("tiny"), compute, load_layout("fsdp"),
                          OptimizerConfig(lr=1e-3, warmup_steps=1), steps=4, devices=jax.devices()[:1])


def test_rows_over_the_bound_select_the_fallback_step(tmp_path):
    (batch,) = host_batches(1, rows=2)  # 2 rows: the bound check needs rows of several images, not a full batch
    images = int(np.max(batch["patch_segment_ids"]))
    assert images >= 2  # rows holding several images: a vision bound of 1 is exceeded
    within, over = _trainer({}), _trainer({"vision_max_segments": 1})
    a, b = within.prepare(batch), over.prepare(batch)
    assert a.bounded and not b.bounded
    # the same parameters for both, drawn in numpy (the layout tests' random_params: no initialiser compiled)
    initial = random_params(load_model_config("tiny"))
    sa, ma = within.step(within.init_state(seed=0, params=initial), a)
    sb, mb = over.step(over.init_state(seed=0, params=initial), b)
    assert [k[-1] for k in within.compiled] == [True] and [k[-1] for k in over.compiled] == [False]
    for k in ("loss", "grad_norm"):
        assert float(mb[k]) == pytest.approx(float(ma[k]), rel=1e-6)
