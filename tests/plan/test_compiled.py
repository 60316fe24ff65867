"""The compiled plan (``python -m moevlm_jax.plan.compiled``) on the 8 CPU devices as 2 hosts of 4 "GPUs": the
tiny model's real train step under fsdp and ep, one compile each (the CLI run in process, shared by every
test here; the auto-fit's compiled check below gets the fsdp step from JAX's cache):

- the CLI writes the table and JSON; each layout has XLA's memory, the planner's estimate beside it, a
  fit against the H100's memory, collectives with their predicted time at the stated link rates;
- fsdp: parameters all-gathered and gradients reduced over 'fsdp' (XLA:CPU's all-reduce + per-device
  slice, XLA:GPU's reduce-scatter), within and across the two hosts;
- ep: the experts' all-to-all over 'expert', within a host (expert 4 x fsdp 2: the hosts split fsdp);
- ``fit`` compiles the run it is given (the train command's pre-flight check), its analytic estimate for
  the same backend within 10% of XLA's.
"""

from __future__ import annotations

import json

import jax
import pytest

from moevlm_jax.config import load_config
from moevlm_jax.parallelism import hlo
from moevlm_jax.plan import compiled
from moevlm_jax.plan import fit as plan_fit

pytestmark = pytest.mark.usefixtures("legacy_emitters")  # quick compiles (tests/xla_options.py)
COMPILE = {"xla_backend_optimization_level": 0}  # what the CLI passes on CPU: the fit check shares its compile
OVERRIDES = ["train.seq_len=128", "train.global_batch_size=8", "data.patch_buckets=[64]", "compute.dtype=bfloat16",
             "compute.loss_chunk_size=64", "compute.recompute=selective"]


@pytest.fixture(scope="module")
def run(tmp_path_factory, legacy_emitters):
    out = tmp_path_factory.mktemp("compiled")
    rc = compiled.main(["--recipe", "cpu-default", "--model", "tiny", "--layouts", "fsdp,ep", "--gpus", "8",
                        "--gpus-per-host", "4", "--gpu", "h100", "--out", str(out), *OVERRIDES])
    data = json.loads((out / "compiled.json").read_text())
    return rc, out, {r["layout"]: r for r in data["rows"]}, data["title"]


def test_cli_writes_the_table_and_json_with_memory_beside_the_planner(run):
    rc, out, rows, title = run
    assert rc == 0, rows
    assert set(rows) == {"fsdp", "ep"} and not any("error" in r for r in rows.values()), rows
    assert title.startswith("compiled plan: tiny on 8 x H100 (2 hosts of 4), compiled on 8 cpu devices")
    text = (out / "compiled.txt").read_text()
    assert text.splitlines()[1].split()[:3] == ["layout", "mesh", "fits"] and "collectives a step" in text
    assert (out / "fsdp.hlo.txt").read_text().startswith("HloModule")
    for r in rows.values():
        assert r["platform"] == "cpu" and r["gpus"] == 8 and r["hosts"] == 2
        assert r["temp_bytes"] > 0 and r["peak_bytes"] >= r["total_bytes"] > r["temp_bytes"]
        assert r["fits"] and r["limit_bytes"] == pytest.approx(80 * 2**30 * 0.95)  # H100 datasheet x usable
        assert r["planner_bytes"] > 0 and r["planner_comm_bytes"] > 0 and r["trip_counts_known"]
        assert 0.5 < r["planner_same_backend_bytes"] / r["total_bytes"] < 2  # same order (the 10% check: below)
        # the predicted time is the collectives' at the stated rates: something crosses hosts, at InfiniBand's rate
        links = compiled.Links(**r["links"])
        assert r["comm_across_bytes"] > 0 and r["comm_within_bytes"] > 0
        assert r["comm_s"] == pytest.approx(sum(compiled.comm_time(hlo.Collective(**c), links)
                                                for c in r["instructions"]))
        assert r["comm_s"] >= r["comm_across_bytes"] / links.ib_bytes
        assert r["comm_bytes"] == pytest.approx(r["comm_within_bytes"] + r["comm_across_bytes"])


def _kinds(row):
    return {(c["kind"], c["axes"], c["sliced"]) for c in row["collectives"]}


def test_fsdp_gathers_parameters_and_reduces_gradients_over_fsdp(run):
    _, _, rows, _ = run
    kinds = _kinds(rows["fsdp"])
    assert ("all-gather", "fsdp", False) in kinds
    assert ("reduce-scatter", "fsdp", False) in kinds or ("all-reduce", "fsdp", True) in kinds, kinds
    gathers = [c for c in rows["fsdp"]["instructions"] if c["kind"] == "all-gather"]
    assert any(c["runs"] > 1 for c in gathers)  # the scanned layers' weights: once a layer
    # fsdp over 2 hosts of 4: 4 of a device's 7 peers are on the other host
    total = sum(c["bytes"] for c in gathers)
    assert sum(c["across"] for c in gathers) == pytest.approx(total * 4 / 7)


def test_ep_exchanges_tokens_by_all_to_all_within_a_host(run):
    _, _, rows, _ = run
    assert rows["ep"]["mesh"] == {"fsdp": 2, "expert": 4}
    a2a = [c for c in rows["ep"]["collectives"] if c["kind"] == "all-to-all" and c["axes"] == "expert"]
    assert a2a and a2a[0]["runs"] >= 4 * 4  # dispatch and combine, forward and backward, 4 MoE layers
    assert a2a[0]["bytes"] > 0 and a2a[0]["across"] == 0


def test_fit_compiles_the_run_it_is_given(run):
    """The pre-flight check proper: XLA's memory analysis of the run's own step; the analytic figure
    for the same backend within 10% of it (the same step as the CLI's fsdp row: from JAX's cache)."""
    cfg = load_config("cpu-default", model="tiny", layout="fsdp", overrides=OVERRIDES, num_devices=8)
    p = plan_fit.fit(cfg, jax.devices(), device_memory_gib=100.0, compile=True, compiler_options=COMPILE)
    assert p.fits and p.compiled_bytes and "compiled" in p.reason
    assert p.compiled_bytes == run[2]["fsdp"]["total_bytes"]
    analytic = p.current.compiled["analytic_same_backend_bytes"]
    assert abs(analytic / p.compiled_bytes - 1) <= 0.10, (analytic, p.compiled_bytes)


def test_mock_topology_and_target(monkeypatch):
    assert compiled.mock_topology(8, 1) == "1x8x1" and compiled.mock_topology(16, 2) == "1x8x2"
    # the entry point on a 1-GPU machine asked for 8 (as before a backend starts): mock topology, no sharded autotuning
    monkeypatch.setattr(compiled, "backend_started", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=x")
    try:
        assert compiled.prepare_backend(8, "auto", "auto", local_gpus=1) == ("gpu", "1x8x1")
        assert jax.config.read("jax_mock_gpu_topology") == "1x8x1"
    finally:
        jax.config.update("jax_mock_gpu_topology", "")
    import os

    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=x --xla_gpu_shard_autotuning=false"
    assert compiled.prepare_backend(8, "auto", "auto", local_gpus=8) == ("gpu", None)  # 8 present: no mock
    with pytest.raises(ValueError):
        compiled.mock_topology(8, 3)
    t = compiled.Target(16, 8, "h200")
    assert t.hosts == 2 and t.memory == 141.0 and t.link_rates.ib_bytes == 50e9
    with pytest.raises(ValueError):
        compiled.Target(12, 8)
    ring = hlo.Collective("all-reduce", "x", "c", 1, 100.0, 8, ("fsdp",), False, 175.0, 75.0, 100.0)
    a2a = hlo.Collective("all-to-all", "x", "c", 1, 100.0, 8, ("expert",), False, 87.5, 37.5, 50.0)
    links = compiled.Links(nvlink_gb_s=100.0, ib_gbit_s=400.0)
    assert compiled.comm_time(ring, links) == 175.0 / 50e9  # a ring over hosts: InfiniBand's pace
    assert compiled.comm_time(a2a, links) == max(37.5 / 100e9, 50.0 / 50e9)


def test_predicted_step_adds_the_compiled_collectives_to_the_planners_compute(run):
    """Each row's predicted step: the planner's compute plus the compiled collectives at the link rates, FSDP
    gathers / gradient reductions hidden behind up to OVERLAP of the layers' compute, the rest (here EP's
    all-to-all) exposed; tokens/s per GPU and MFU from it (hand-computed from the row's own numbers)."""
    from moevlm_jax.plan.time import OVERLAP

    _, out, rows, _ = run
    for r in rows.values():
        links = compiled.Links(**r["links"])
        found = [hlo.Collective(**c) for c in r["instructions"]]
        dp = sum(compiled.comm_time(c, links) for c in found
                 if c.kind in compiled.RING and c.axes and set(c.axes) <= {"fsdp", "data"})
        rest = r["comm_s"] - dp
        assert r["predicted_exposed_comm_s"] >= rest + (1 - OVERLAP) * dp - 1e-12
        assert r["predicted_exposed_comm_s"] <= rest + dp + 1e-12
        assert r["predicted_step_s"] == pytest.approx(r["predicted_compute_s"] + r["predicted_exposed_comm_s"])
        tokens = 8 * 128 * 0.914 / r["predicted_step_s"] / r["gpus"]  # OVERRIDES: 8 rows of 128; the proxy fill
        assert r["predicted_tokens_per_s_per_gpu"] == pytest.approx(tokens)
        assert 0 < r["predicted_mfu"] < 1
    assert rows["ep"]["predicted_exposed_comm_s"] > 0  # the experts' all-to-all is on the critical path
    text = (out / "compiled.txt").read_text()
    assert "pred tok/s/GPU" in text.splitlines()[1]
