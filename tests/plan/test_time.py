"""The planner's step-time model (moevlm_jax/plan/time.py) against the steps measured on the GPUs we have, and
auto-fit's choice among settings whose estimate leaves the fit in doubt (moevlm_jax/plan/fit.py).

Measured (bench/results/step.md, 2026-12-07; the proxy model on the proxy data, bf16 parameters and AdamW state,
selective recompute keeping every named tensor): one H200 at MBS 11, 61,095 useful tokens/s (the scale factor's
point); one H100 80 GB at MBS 4, 51,728 and at MBS 2, 36,425 (recipe h200 without accumulation); one H100 with
gpu-default's global batch of 64 at MBS 1 x 64 with a bf16 gradient sum, 35.0k (auto-fit's choice before the
weights' per-microbatch traffic was modelled, issue 60's first run).
"""

from __future__ import annotations

import threading
import time

import jax
import pytest

from moevlm_jax.config.run import load_config
from moevlm_jax.plan import fit as plan_fit
from moevlm_jax.plan import search
from moevlm_jax.plan.memory import GIB
from moevlm_jax.plan.time import H100, H200, hardware_of

# (GPU, MBS, grad_accum, measured useful tokens/s)
MEASURED = [(H200, 11, 1, 61095.0), (H100, 4, 1, 51728.0), (H100, 2, 1, 36425.0), (H100, 1, 64, 35000.0)]
WITHIN = 0.20  # the estimate's distance from each measured rate (the MBS-2 point, 1.15x, is the farthest)


def _estimate(hw, mbs: int, accum: int):
    cfg = load_config("h200", overrides=[f"train.micro_batch_size={mbs}", f"train.grad_accum={accum}",
                                         f"train.global_batch_size={mbs * accum}",
                                         "optimizer.grad_accum_dtype=bfloat16"],
                      num_devices=1, num_processes=1, platform="gpu")
    w = plan_fit.workload_of(cfg, 1, device_memory_gib=hw.memory_gib, platform="gpu", hw=hw)
    return search.estimate(plan_fit.candidate_of(cfg, 1), w, cfg.compute)


def test_the_model_ranks_the_measured_steps_as_measured_and_within_20_percent():
    est = {(hw.name, mbs, accum): _estimate(hw, mbs, accum).tokens_per_s for hw, mbs, accum, _ in MEASURED}
    for hw, mbs, accum, measured in MEASURED:
        got = est[(hw.name, mbs, accum)]
        assert abs(got / measured - 1) <= WITHIN, (hw.name, mbs, accum, got, measured)
    h100 = sorted((m for m in MEASURED if m[0] is H100), key=lambda m: -m[3])
    assert [est[("H100", m[1], m[2])] for m in h100] == sorted((est[("H100", m[1], m[2])] for m in h100),
                                                               reverse=True)


def test_microbatches_pay_the_weights_each_time():
    """Same rows, same FLOPs: 64 microbatches of 1 row read the weights 64 times, 16 of 4 rows 16 times."""
    one, four = _estimate(H100, 1, 64), _estimate(H100, 4, 16)
    assert one.time.compute["weights"] == pytest.approx(4 * four.time.compute["weights"], rel=1e-6)
    assert one.time.compute["dense"] == pytest.approx(four.time.compute["dense"], rel=1e-6)
    # an H100 moves memory-bound bytes at 3.35 of the H200's 4.8 TB/s, computes alike
    h200 = _estimate(H200, 4, 16)
    assert four.time.compute["weights"] / h200.time.compute["weights"] == pytest.approx(4.8 / 3.35, rel=1e-6)
    assert four.time.compute["dense"] == pytest.approx(h200.time.compute["dense"], rel=1e-6)


@pytest.mark.parametrize("kind,name", [("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"),
                                       ("NVIDIA H100 PCIe", "H100"), ("cpu", "H200"), (None, "H200")])
def test_hardware_from_the_device_kind(kind, name):
    assert hardware_of(kind).name == name


@pytest.mark.parametrize("ratio", [0.8, 1.2], ids=["estimate_high", "estimate_low"])
def test_auto_fit_checks_faster_settings_estimated_over_the_limit_at_most_twice(monkeypatch, ratio):
    """The memory model errs: a setting estimated up to SURE_FAILS x the limit is compiled when it is faster than
    every estimated fit, and taken when XLA's analysis fits. The first checks run at once: the fastest setting in
    the band and, when it is estimated over the limit, the fastest in the band estimated within it (both compiling
    at the same time); each check calibrates the estimate (XLA / estimate), a later candidate still over the limit
    by CALIBRATED_SLACK after it is not compiled; at most MAX_CHECKS checks, then only sure fits (estimate below
    the band) are taken. XLA's analysis stood in by ``ratio`` x the estimate."""
    cfg = load_config("cpu-default", overrides=["train.global_batch_size=32", "train.micro_batch_size=4",
                                                "train.grad_accum=1", "compute.recompute=none"], num_devices=8)
    devices = jax.devices()
    allow = ("mbs", "recompute", "dtypes")
    w = plan_fit.workload_of(cfg, len(devices), device_memory_gib=1e4, platform="cpu")
    as_written = search.estimate(plan_fit.candidate_of(cfg, len(devices)), w, cfg.compute)
    ests = [search.estimate(c, w, cfg.compute) for c in plan_fit._alternatives(as_written.candidate, w, set(allow))]

    def est(c):
        return next(e for e in ests if e.candidate == c)

    limit = as_written.memory.total / 1.3  # the run as written beyond the band: no check of it
    limit_gib = limit / GIB / H200.usable_fraction
    band = (0.75, 1.25)
    in_band = sorted((e for e in ests if e.memory.total <= band[1] * limit), key=search.fastest_first)
    fastest = in_band[0]
    assert fastest.memory.total > limit  # the fastest setting in the band is estimated over the limit
    # the fastest estimated within the limit, still in doubt (above the band's floor), before any sure fit
    likely = next(e for e in in_band if e.memory.total <= limit)
    assert likely.memory.total >= band[0] * limit
    calls, running, most = [], [0], [0]
    lock = threading.Lock()

    def compiled_memory(candidate, *a, **k):
        with lock:
            calls.append(candidate)
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.5)  # a compile's time: a check started beside it runs meanwhile
        with lock:
            running[0] -= 1
        return {"total_bytes": ratio * est(candidate).memory.total}

    monkeypatch.setattr(plan_fit, "compiled_memory", compiled_memory)
    plan = plan_fit.fit(cfg, devices, device_memory_gib=limit_gib, compile=band, allow=allow)
    assert not plan.fits and 2 <= len(calls) <= plan_fit.MAX_CHECKS, (len(calls), plan.reason)
    assert calls[:2] in ([fastest.candidate, likely.candidate], [likely.candidate, fastest.candidate])
    assert most[0] == 2  # the two compiled at once
    for c in calls[2:]:  # later checks only where the calibrated estimate leaves a chance
        assert ratio * est(c).memory.total <= plan_fit.CALIBRATED_SLACK * limit
    chosen = next((e for e in ests if e.candidate.overrides(cfg, len(devices)) == plan.change), None)
    if ratio < 1:  # XLA's analysis fits the fastest: taken on its word
        assert chosen is fastest and "(compiled)" in plan.reason, plan.reason
    else:  # the fastest does not fit by XLA's analysis; the likelier one does (1.2 x its estimate) or a sure fit
        assert chosen is not fastest, plan.reason
        if ratio * likely.memory.total <= limit:
            assert chosen is likely, plan.reason
        assert (chosen.candidate in calls and ratio * chosen.memory.total <= limit) \
            or chosen.memory.total < band[0] * limit, plan.reason
