"""The train step under FSDP against a single-device reference: the tiny model on real VQA batches
(images included) gives the same losses, gradient norms and parameters on 1 device (MBS 8), under
FSDP over 8 CPU devices (MBS 1) with unrolled layers (each layer's weight gradient behind its own barrier, the
gradient norm summed per layer; the scanned layers under FSDP over 8 devices train as one device in
tests/parallelism/test_layouts.py), with gradient accumulation 4 x MBS 1 on a 2-device FSDP mesh (= MBS 4 per
rank = the same 8-row global batch), and 2 devices at MBS 4 with the images balanced over each rank's vision rows
(``data.balance_vision_rows``). The router aux loss is off in the
objective here because Megatron-style accumulation computes it per microbatch (the logged HF aux loss is still
compared between 1 and 8 devices). One test function, so that pytest-xdist runs them all on one
worker and the reference is computed once."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.trainer import Trainer
from tests.training.train_setup import COMPUTE, host_batches, leaves_by_path

# quick compiles (tests/xla_options.py): the one-device reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

STEPS = 3
METRICS = ("loss", "ce_loss", "grad_norm", "lr", "router_aux_loss", "router_z_loss", "trained_tokens")


def _trainer(devices: int, grad_accum: int = 1, **compute_options) -> Trainer:
    compute = ComputeConfig.from_dict({**COMPUTE, "router": {"aux_loss": "none"}, **compute_options})
    optimizer = OptimizerConfig(lr=3e-3, warmup_steps=1, weight_decay=0.01)
    return Trainer.create(load_model_config("tiny"), compute, load_layout("fsdp"), optimizer, steps=10,
                          grad_accum=grad_accum, devices=jax.devices()[:devices])


def _train(trainer: Trainer, batches: list[dict], params: dict | None = None
           ) -> tuple[list[dict[str, float]], dict[str, np.ndarray], dict]:
    """Steps over ``batches`` from ``params`` (default: the trainer's own init) -> (metrics per step,
    final parameters by path, initial parameters as a host tree)."""
    state = trainer.init_state(seed=0, params=params)
    initial = jax.device_get(state["params"])
    records = []
    for batch in batches:
        state, metrics = trainer.step(state, trainer.prepare(batch))
        records.append({k: float(v) for k, v in jax.device_get(metrics).items() if k in METRICS})
    return records, leaves_by_path(state["params"]), initial


def _assert_same_run(got, want, metrics=METRICS) -> None:
    (records, params, _), (ref_records, ref_params, _) = got, want
    for step, (r, ref) in enumerate(zip(records, ref_records)):
        for k in metrics:
            assert r[k] == pytest.approx(ref[k], rel=2e-5, abs=1e-6), f"step {step}: {k} {r[k]} vs {ref[k]}"
    assert params.keys() == ref_params.keys()
    for k, v in params.items():
        np.testing.assert_allclose(v, ref_params[k], rtol=1e-4, atol=2e-5, err_msg=k)  # Adam: |update| <= lr


def test_fsdp_and_accumulation_match_one_device(tmp_path):
    """One test (one xdist worker): the runs share the reference's batches and initial state."""
    batches = host_batches(STEPS)
    reference = _train(_trainer(1), batches)  # one device, one microbatch of all 8 rows
    records, _, initial = reference
    assert records[-1]["ce_loss"] < records[0]["ce_loss"] - 0.5  # it trains (lr 3e-3 on the same small set)
    assert [r["trained_tokens"] for r in records] == [float((b["loss_mask"] > 0).sum()) for b in batches]

    # FSDP over 8 devices, MBS 1, unrolled layers (compute.scan_layers false): the per-layer gradient barriers
    # (layers.materialised_grad) and the gradient norm summed per layer (trainer._norm_pieces) change nothing;
    # initialised directly sharded (same values: partitionable RNG)
    fsdp = _trainer(8, scan_layers=False)
    assert fsdp.data_parallel_size == 8
    shardings = fsdp.state_shardings
    embed = shardings["params"]["language_model"]["embed_tokens"]
    assert tuple(embed.spec) == (None, "fsdp")  # [vocab, embed]: the model dimension over all devices
    moments = [s for path, s in jax.tree_util.tree_flatten_with_path(shardings["opt_state"])[0]
               if "embed_tokens" in jax.tree_util.keystr(path)]
    assert moments and all(s.spec == embed.spec for s in moments)  # Adam moments sharded like their parameter
    got = _train(fsdp, batches)
    for k, v in leaves_by_path(got[2]).items():
        np.testing.assert_array_equal(v, leaves_by_path(initial)[k], err_msg=k)
    _assert_same_run(got, reference)

    # accumulation: 4 microbatches x MBS 1 x DP 2 = the same 8 rows, from the same initial params
    accum = _trainer(2, grad_accum=4)
    assert accum.prepare(batches[0]).arrays["input_ids"].shape == (4, 2, batches[0]["input_ids"].shape[1])
    # the logged router losses are per-microbatch means here (as Megatron), so they are not compared
    _assert_same_run(_train(accum, batches, params=initial), reference,
                     [k for k in METRICS if not k.startswith("router")])

    # the same batches with each rank's 4 rows' images balanced over its vision rows (data.balance_vision_rows):
    # FSDP over 2 devices, MBS 4; images change rows, the run does not
    balanced = host_batches(STEPS, balance_vision_rows=True, balance_group=4)
    for b, ref in zip(balanced, batches):
        np.testing.assert_array_equal(b["input_ids"], ref["input_ids"])
    s = batches[0]["input_ids"].shape[1]
    moved = [((b["patch_dest"] // s) != 0) & (b["patch_segment_ids"] > 0) for b in balanced]
    assert any(m.any() for m in moved)  # some image is in another row's vision row
    _assert_same_run(_train(_trainer(2), balanced, params=initial), reference)
