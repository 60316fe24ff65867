"""``python -m bench.step`` end to end on CPU, in one invocation (one compiled train step):
real and mock data, the HF transformers peer, the per-component breakdown and a profiler trace, with the
experts through the 'hybrid' backend (dropless: the peer's losses hold; the breakdown builds its buffer).

Shapes: the tiny model, one device, one row of 60 tokens (below twice the smallest loss capacity,
so the loss gathers whole rows on every batch), real VQA images and mock patches in the same patch
bucket: the real and the mock run share one compiled step. Checks are consistency checks: the
JSON's figures against the dumped batches (hand counts), flops.py, and each other; both sides'
losses step by step; no timing thresholds.
"""

from __future__ import annotations

import json
import os
import statistics

import numpy as np
import pytest
import yaml

from bench import step as bench
from bench import step_report as bench_report
from bench.breakdown import COMPONENTS
from bench.hf_step import hf_batch, load_steps, text_positions
from moevlm_jax.config import CONFIG_DIR
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.perf import flops

SEQ_LEN, WARMUP, STEPS = 60, 1, 2
# the experts as the 'hybrid' backend (padded part + overflow; dropless, so the HF peer's losses still hold): the
# breakdown then times the experts the step runs through that backend's buffer
HYBRID = ("compute.moe.backend=hybrid", "compute.moe.capacity_factor=0.5")


def _configs(tmp) -> tuple[str, str]:
    real = yaml.safe_load((CONFIG_DIR / "data" / "vqa.yaml").read_text())
    real.pop("description")
    real["source"] = {**real["source"], "num_train": 24, "num_heldout": 4, "image_size": [64, 128]}
    real.update(image={"min_pixels": 4096, "max_pixels": 16384}, patch_buckets=[128], cache_dir=str(tmp / "cache"))
    recipe = {"name": "bench-test", "model": "tiny", "layout": "fsdp", "data": real,
              "compute": {"dtype": "float32", "param_dtype": "float32"},
              "optimizer": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.01},
              "train": {"steps": 100, "micro_batch_size": 1, "seq_len": SEQ_LEN}}
    mock = yaml.safe_load((CONFIG_DIR / "data" / "mock_small.yaml").read_text())
    mock["source"].update(grid=[1, 4, 4])
    mock.update(patch_buckets=[128])
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (tmp / "mock.yaml").write_text(yaml.safe_dump(mock))
    return str(tmp / "recipe.yaml"), str(tmp / "mock.yaml")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    recipe, mock = _configs(tmp)
    out = tmp / "bench.json"
    with pytest.MonkeyPatch.context() as mp:  # our side's process: unoptimised XLA:CPU code compiles ~2x faster
        mp.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0")
        rc = bench.main(["--recipe", recipe, "--mock-data", mock, "--devices", "1", "--data", "real,mock",
                         "--warmup", str(WARMUP), "--steps", str(STEPS), "--peer", "hf", "--breakdown",
                         "--breakdown-iters", "1",
                         "--profile", str(tmp / "profile"), "--work-dir", str(tmp / "work"), "--out", str(out),
                         "--quiet", *HYBRID])
    return rc, json.loads(out.read_text()), tmp


def test_throughput_is_counted_from_the_batches(run):
    rc, result, _ = run
    assert rc == 0
    shape = flops.ModelShape.from_config(load_model_config("tiny"))
    assert [r["name"] for r in result["runs"]] == ["real mbs1", "mock mbs1"]
    for r in result["runs"]:
        batches = load_steps(r["batch_dir"])
        assert len(batches) == WARMUP + STEPS and r["timed"] == list(range(WARMUP, WARMUP + STEPS))
        useful = [int(np.count_nonzero(b["segment_ids"] > 0)) for b in batches]
        trained = [int(np.count_nonzero(b["loss_mask"] > 0)) for b in batches]
        assert r["useful_tokens_per_step"] == useful and r["trained_tokens_per_step"] == trained
        assert r["flops_per_step"] == [flops.batch_flops(shape, b) for b in batches]
        timed = r["timed"]
        seconds = sum(r["time_per_step"][i] for i in timed)
        assert r["useful_tokens"] == sum(useful[i] for i in timed) < SEQ_LEN * STEPS  # padding excluded
        assert r["tokens_per_s"] == pytest.approx(r["useful_tokens"] / seconds, rel=1e-12)
        assert r["trained_tokens_per_s"] == pytest.approx(sum(trained[i] for i in timed) / seconds, rel=1e-12)
        want = sum(r["flops_per_step"][i] for i in timed) / seconds / 1e12
        assert r["tflops_per_device"] == pytest.approx(want, rel=1e-12)
        assert r["step_time_s"] == statistics.median(r["time_per_step"][i] for i in timed)
        assert r["mfu"] is None and r["peak_bytes"] is None  # CPU: no known peak, no memory stats
        assert r["compiled_shapes"] == 1 and r["timed_compiles"] == 0
        # one shape (one patch bucket, one loss capacity): only the first step ran it for the first time
        assert r["first_run_per_step"] == [True] + [False] * (WARMUP + STEPS - 1)
        assert len(set(r["shape_per_step"])) == 1 and r["shape_per_step"][0].startswith("patches 128, loss capacity ")
        # every update applied (a run whose updates are skipped for non-finite gradients trains nothing)
        assert r["skipped_per_step"] == [0] * (WARMUP + STEPS) and all(np.isfinite(r["grad_norm_per_step"]))
        assert all(g > 0 for g in r["grad_norm_per_step"])
        assert all(w > 0 for w in r["input_per_step"]) and all(t > 0 for t in r["time_per_step"])
    assert result["runs"][0]["compile_s"] > 0 and not result["runs"][0]["mock"] and result["runs"][1]["mock"]


class _Batch:
    def __init__(self, k: int) -> None:
        self.arrays, self.capacity, self.bounded, self.k = {"input_ids": np.zeros((1, 4 + k % 2))}, None, True, k


@pytest.mark.parametrize("trace", [False, True])
def test_steps_run_as_the_trainer_runs_them(trace):
    """bench.run_steps: batch k+1 read and placed and step k+1 dispatched before step k is waited
    for (as moevlm_jax.train runs), except before the profiler trace starts (the warm-up drained
    first); every step finished once, in order, with its own batch and its shape's first run marked."""
    events: list[tuple] = []

    class Trainer:
        def prepare(self, host):
            events.append(("prepare", host))
            return _Batch(host)

        def step(self, state, batch):
            events.append(("dispatch", batch.k))
            return state + 1, {"step": batch.k}

    def finish(k, batch, host, metrics, info):
        assert k == batch.k == host == metrics["step"] and info["compiles"] == 0
        events.append(("wait", k, info["first_run"]))

    total, warmup = 5, 2
    start = (lambda: events.append(("trace",))) if trace else None
    assert bench.run_steps(Trainer(), 0, iter(range(total)), total, warmup, finish, start) == total
    waits = [e for e in events if e[0] == "wait"]
    assert waits == [("wait", k, k < 2) for k in range(total)]  # two shapes, alternating
    at = {e[:2]: n for n, e in enumerate(events)}
    ahead = [at[("dispatch", k + 1)] < at[("wait", k)] for k in range(total - 1)]
    assert ahead == [not (trace and k == warmup - 1) for k in range(total - 1)]
    assert all(at[("prepare", k)] < at[("dispatch", k)] for k in range(total))
    if trace:  # the trace starts after the warm-up steps are finished, before step `warmup` is read
        assert at[("wait", warmup - 1)] < events.index(("trace",)) < at[("prepare", warmup)]


def test_real_and_mock_ratio(run):
    _, result, _ = run
    real, mock = result["runs"]
    assert "MOCK DATA" in mock["data_source"] and "MOCK" not in real["data_source"]
    report = bench_report.format_report(result)
    assert f"useful tokens/s ratio {real['tokens_per_s'] / mock['tokens_per_s']:.3f}" in report
    assert "real/mock (real mbs1 / mock mbs1)" in report


def test_hf_peer_trains_the_same_batches_to_the_same_losses(run):
    rc, result, _ = run
    assert rc == 0
    assert result["peer"]["info"]["modes"] == ["eager"] and result["peer"]["info"]["dtype"] == "float32"
    real, mock = result["runs"]
    # the peer repeats the first --data item's runs (real data); the mock run is ours alone
    assert [p["name"] for p in result["peer"]["runs"]] == [real["name"]] and "vs_hf" not in mock
    for r in [real]:
        hf = [p for p in result["peer"]["runs"] if p["name"] == r["name"]]
        assert len(hf) == 1 and hf[0]["useful_tokens"] == r["useful_tokens"] and hf[0]["timed"] == r["timed"]
        loss = r["vs_hf"]["loss"]
        assert loss["ours"] == r["ce_loss_per_step"] and len(loss["hf"]) == WARMUP + STEPS
        # same initial weights, same batches, same AdamW steps: the same losses (float32), step by step
        assert loss["first_rel_diff"] < 1e-6 and loss["max_rel_diff"] < 1e-5, loss
        assert loss["max_rel_diff_objective"] < 1e-5 and loss["all_steps_agree"]  # CE + router aux loss
        assert loss["ours"][-1] < loss["ours"][0]  # it trains: later steps see updated weights on both sides
        assert r["vs_hf"]["tokens_per_s_ratio"] == pytest.approx(r["tokens_per_s"] / hf[0]["tokens_per_s"])


def test_breakdown_covers_every_component(run):
    _, result, _ = run
    assert "breakdown" in result["runs"][0] and "breakdown" not in result["runs"][1]  # first data variant only
    bd = result["runs"][0]["breakdown"]
    names = [c["name"] for c in bd["components"]]
    assert names == [n for n, _ in COMPONENTS]
    assert all(c["present"] and c["seconds"] > 0 for c in bd["components"])
    assert bd["sum_s"] == pytest.approx(sum(c["seconds"] for c in bd["components"]))
    assert bd["step_time_s"] == result["runs"][0]["step_time_s"]
    assert bd["diff_pct"] == pytest.approx(100 * (bd["sum_s"] - bd["step_time_s"]) / bd["step_time_s"])
    wait = bd["components"][-1]
    assert wait["name"] == "input_wait" and wait["seconds"] == result["runs"][0]["input_wait_s"]
    assert bd["compute_sum_s"] == pytest.approx(bd["sum_s"] - wait["seconds"]) and bd["step_compute_s"] > 0
    assert bd["compute_diff_pct"] == pytest.approx(100 * (bd["compute_sum_s"] / bd["step_compute_s"] - 1))
    assert bd["forward_check_max_abs"] < 1e-4  # the recorded intermediates reproduce the model's forward
    # the step's experts backend: its dispatch and experts components build the hybrid buffer (padded part + overflow)
    assert bd["experts_backend"] == "hybrid"
    assert "breakdown of one step (real mbs1)" in bench_report.format_report(result)


def test_profile_trace_written(run):
    _, result, tmp = run
    for r in result["runs"]:
        assert r["profile"] and list((tmp / "profile").glob(f"{r['name'].replace(' ', '_')}/**/*.xplane.pb"))
        # the real step's kernels per component (bench.trace_breakdown): the model's named scopes
        # reach the compiled HLO and the trace, and the rows add up to the mean timed step
        tbd = r["trace_breakdown"]
        rows = tbd["per_step_ms"]
        for component in ("vision encoder", "decoder attention", "experts (matmuls + SwiGLU)", "LM head + loss",
                          "optimizer update"):
            assert rows.get(component, 0) > 0, (component, rows)
        timed = r["timed"]
        assert tbd["steps"] == len(timed)
        assert tbd["step_ms"] == pytest.approx(1e3 * sum(r["time_per_step"][i] for i in timed) / len(timed))
        assert sum(rows.values()) == pytest.approx(tbd["step_ms"])


def test_hf_inputs_of_a_packed_row():
    seg = np.array([[1, 1, 1, 2, 2, 0, 0], [1, 1, 1, 1, 0, 0, 0]])
    assert text_positions(seg).tolist() == [[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6]]
    ids = np.arange(7)[None].repeat(2, 0)
    batch = {"input_ids": ids, "segment_ids": seg, "targets": ids + 1, "loss_mask": (seg > 0) * 1.0,
             "positions": np.zeros((3, 2, 7), np.int32), "patch_segment_ids": np.zeros((2, 4), np.int32)}
    hf = hf_batch(batch)
    assert hf["position_ids"].shape == (4, 2, 7)  # packed row: the text-position row leads
    assert hf["labels"].tolist()[1] == [-100, 1, 2, 3, 4, -100, -100]  # labels[t + 1] = targets[t]
    assert "pixel_values" not in hf
    assert hf_batch({**batch, "segment_ids": (seg > 0) * 1})["position_ids"].shape == (3, 2, 7)


def test_data_variants_route_overrides():
    args = bench.parse_args(["--data", "real,mock", "data.image.max_pixels=1", "mock.source.turns=[2,2]",
                             "train.seq_len=8"])
    real, mock = bench.variants(args, "cpu-default")
    assert (real.data, mock.data) == (None, "mock_small")
    assert real.overrides == ["data.image.max_pixels=1", "train.seq_len=8"]
    assert mock.overrides == ["train.seq_len=8", "data.source.turns=[2,2]"]


def test_out_of_memory_is_recorded_and_the_sweep_goes_on(monkeypatch):
    """An MBS that does not fit is a result (status oom, in the table), not the end of the run; other
    errors still stop it. The peer then repeats only the runs that produced figures."""
    calls = []

    def fake_run_one(args, cfg, variant, devices, dump, breakdown):
        calls.append(cfg.train.micro_batch_size)
        if cfg.train.micro_batch_size == 4:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB")
        return {"side": "ours", "name": f"{variant.label} mbs{cfg.train.micro_batch_size}", "data": variant.label,
                "mbs": cfg.train.micro_batch_size, "status": "ok", "step_time_s": 0.5, "tokens_per_s": 10.0,
                "tflops_per_device": 1.0}

    monkeypatch.setattr(bench, "run_one", fake_run_one)
    args = bench.parse_args(["--mbs", "1,4", "--data", "real"])
    args.argv = ["--mbs", "1,4"]
    result = bench.run_ours(args)
    assert calls == [1, 4]
    ok_run, oom = result["runs"]
    assert oom["status"] == "oom" and "RESOURCE_EXHAUSTED" in oom["message"] and oom["name"] == "real mbs4"
    assert bench.peer_runs(result["runs"]) == [ok_run]
    assert "real mbs4      oom: RESOURCE_EXHAUSTED" in bench_report.format_report(
        {**result, "runs": [oom], "command": "c", "date": "d"})

    def broken(*a, **k):
        raise ValueError("a bug, not a full device")

    monkeypatch.setattr(bench, "run_one", broken)
    with pytest.raises(ValueError, match="a bug"):
        bench.run_ours(args)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_hf_peer_compiles_each_block_and_undoes_it(family):
    """The HF peer's compiled mode: torch.compile on every vision block and decoder layer (in place,
    nothing traced until called; Qwen3.5: GDN and gated attention layers alike), undone after the run
    so a later eager run is eager."""
    from bench.hf_step import compile_blocks, uncompile_blocks
    from tests.model import hf_reference, qwen3_5_reference

    if family == "qwen3_vl":
        model = hf_reference.build_hf(hf_reference.hf_config_dicts()["tiny"], 0)
    else:
        model = qwen3_5_reference.tiny_hf(["linear_attention", "full_attention"])
        assert {type(b.linear_attn if hasattr(b, "linear_attn") else b.self_attn).__name__
                for b in model.model.language_model.layers} == {"Qwen3_5MoeGatedDeltaNet", "Qwen3_5MoeAttention"}
    blocks = [*model.model.visual.blocks, *model.model.language_model.layers]
    assert len(blocks) == model.config.vision_config.depth + model.config.text_config.num_hidden_layers
    assert all(b._compiled_call_impl is None for b in blocks)
    assert compile_blocks(model) is model
    assert all(b._compiled_call_impl is not None for b in blocks)
    assert model._compiled_call_impl is None  # the model itself (image scatter, DeepStack) stays eager
    uncompile_blocks(model)
    assert all(b._compiled_call_impl is None for b in blocks)


def test_capture_is_applied_before_the_backend_starts(tmp_path, capsys):
    """The bench sets the recipe's compute.capture XLA flags like the train CLI; in a process whose
    jax backend already runs with other flags it refuses with the flag it needs (exit 2), instead of
    timing a different capture than the one asked for."""
    import jax

    jax.devices()  # the backend is up: the flags can no longer change
    recipe, _ = _configs(tmp_path)
    rc = bench.main(["--recipe", recipe, "--devices", "1", "--steps", "1", "--quiet", "compute.capture=none"])
    assert rc == 2
    assert "--xla_gpu_enable_command_buffer=" in capsys.readouterr().err


def test_steady_rate_leaves_out_first_runs():
    """Hand-computed: a 1.0 s first run and two 0.5 s steps of 100 useful tokens and 10 FLOPs each."""
    from bench.step_report import steady_rate

    steps = [dict(time=1.0, first_run=True, useful_tokens=100, flops=10.0)]
    steps += [dict(time=0.5, first_run=False, useful_tokens=100, flops=10.0)] * 2
    assert steady_rate(steps, 1, 100.0) == {"steps": 2, "tokens_per_s": 200.0, "mfu": 0.2, "first_runs": 1,
                                            "first_run_s": 1.0}
    assert steady_rate(steps[1:], 1, 100.0) is None and steady_rate(steps[:1], 1, None) is None


def test_hf_steps_that_compiled_are_left_out_of_its_steady_rate(monkeypatch):
    """HF's torch.compile traces a new graph for each new shape (real data: several shapes), inside
    the timed steps: those steps are marked and left out of the HF side's ``steady`` rate, as ours
    leaves out each compiled shape's first run. A compiled function with dynamo's "eager" backend
    (no C++ compiler needed) on shapes 3, 3, 5, 5, 3: steps 0 and 2 trace a graph."""
    import torch

    from bench import hf_step as bench_hf

    f = torch.compile(lambda x: (x * 2).sum(), backend="eager", dynamic=False)
    sizes = [3, 3, 5, 5, 3]
    monkeypatch.setattr(bench_hf, "load_steps", lambda d: [{"n": n} for n in sizes])
    runner = object.__new__(bench_hf.Peer)
    runner.torch, runner.cuda = torch, False
    runner.tensors = lambda b: b
    runner.step = lambda forward, host, lr: {"loss": float(forward(torch.ones(host["n"]))), "ce": 0.0, "aux": 0.0}
    run = {"name": "r", "batch_dir": "-", "lrs": [0.1] * 5, "timed": [1, 2, 3, 4], "useful_tokens": [100] * 5,
           "trained_tokens": [50] * 5, "flops": [1.0] * 5}
    got = runner._run(run, "compile", f)
    assert got["compiled_per_step"] == [True, False, True, False, False]
    t = got["step_times_s"]
    assert got["steady"]["steps"] == 3 and got["steady"]["first_runs"] == 1
    assert got["steady"]["tokens_per_s"] == pytest.approx(300 / (t[1] + t[3] + t[4]))
    assert got["tokens_per_s"] == pytest.approx(400 / sum(t[1:]))
