"""The MoE benchmark runs end to end on CPU with tiny shapes and its agreement checks pass."""

import json

import jax.numpy as jnp

from bench import moe_layer as bench_moe


def test_bench_moe_tiny_runs_and_agrees(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = bench_moe.main(["--tiny", "--ep", "2", "--iters", "1", "--out", str(out)])
    table = capsys.readouterr().out
    assert rc == 0, table
    results = json.loads(out.read_text())["results"]
    variants = {r["variant"].split(" (")[0] for r in results}
    for name in (
        "ceiling",
        "triton",
        "ragged_dot",
        "capacity",
        "hybrid",
        "triton + capacity_factor 1.0",
        "hf grouped_mm",
        "ep2 alltoall",
        "ep2 allgather",
    ):
        assert name in variants, (name, sorted(variants))
    checks = {r["variant"]: r for r in results if r["variant"].startswith("check")}
    names = ("triton", "ragged_dot", "capacity", "hybrid", "triton+cf", "hf experts", "ep2 alltoall", "ep2 allgather",
             "ep2 alltoall hybrid")
    assert set(checks) == {f"check {name} vs f32" for name in names}
    for r in checks.values():
        assert r["ok"] and r["max_rel_err"] < 1e-4, r
    capacity = next(r for r in results if r["variant"] == "capacity")
    assert 0 < capacity["dropped_frac"] < 0.5
    hybrid = next(r for r in results if r["variant"] == "hybrid")  # the same rows past capacity, computed
    assert hybrid["overflow_frac"] == capacity["dropped_frac"] and "dropped_frac" not in hybrid
    assert all(r["ms"] > 0 for r in results if "ms" in r)
    for name in ("ceiling (balanced einsum)", "triton"):  # pipelined calls, and each call synchronised beside it
        row = next(r for r in results if r["variant"] == name)
        assert row["ms_synchronised"] > 0 and "ms synchronised per call" in table
    assert "ceiling (balanced einsum)" in table


def test_time_calls_synchronises_each_warmup_and_timed_call_then_once_a_round(monkeypatch):
    """Synchronised: every warmup and timed call waited for; pipelined: ``iters`` calls issued, one wait a round."""
    calls, waits = [], []
    monkeypatch.setattr(bench_moe.jax, "block_until_ready", lambda x: (waits.append(len(calls)), x)[1])

    def fn(a):
        calls.append(1)
        return a + len(calls)

    ms, synced, out = bench_moe.time_calls(fn, (jnp.zeros(()),), iters=4, warmup=2, rounds=3)
    assert len(calls) == 2 + 4 + 3 * 4
    assert waits == [1, 2, 3, 4, 5, 6, 10, 14, 18]
    assert float(out) == 18.0 and ms > 0 and synced > 0


def test_time_paired_alternates_rounds_with_the_ceiling_and_returns_the_layers_result(monkeypatch):
    """Warm-up: ceiling then layer, each waited for; then rounds alternate ceiling, layer, ... (``iters`` calls
    issued, one wait), ``rounds`` of each; the result is the layer's last."""
    calls, waits = [], []
    monkeypatch.setattr(bench_moe.jax, "block_until_ready", lambda x: (waits.append("".join(calls)), x)[1])

    def layer(a):
        calls.append("L")
        return a + calls.count("L")

    def ceiling(a):
        calls.append("C")
        return a - 1

    ms, ceiling_ms, out = bench_moe.time_paired(layer, (jnp.zeros(()),), ceiling, (jnp.zeros(()),), iters=2,
                                                warmup=1, rounds=2)
    assert "".join(calls) == "CL" + "CCLLCCLL"
    assert [len(w) for w in waits] == [1, 2, 4, 6, 8, 10]  # warm-up calls each, then once a round
    assert float(out) == 5.0 and ms > 0 and ceiling_ms > 0


def test_the_fastest_ceiling_row_is_the_ceiling():
    """Two ceiling rows (XLA's choice, cuBLAS): a backend's ratio is to the faster, whichever came first."""
    report = bench_moe.Report(echo=False)
    base = dict(shape="s", tokens=1)
    report.add(dict(base, variant="ceiling (balanced einsum)", ms=2.0, flops=4e9))
    report.add(dict(base, variant="ceiling (balanced einsum, cuBLAS)", ms=1.0, flops=4e9))
    report.add(dict(base, variant="ceiling (slower again)", ms=4.0, flops=4e9))
    row = report.add(dict(base, variant="triton", ms=1.6, flops=4e9))
    assert row["vs_ceiling"] == 1.0 / 1.6


def test_paired_run_reports_the_ratio_to_the_ceiling_timed_beside_it(tmp_path):
    out = tmp_path / "paired.json"
    rc = bench_moe.main(["--tiny", "--backends", "triton", "--no-hf", "--no-check", "--paired", "--rounds", "1",
                         "--iters", "1", "--out", str(out)])
    assert rc == 0
    row = next(r for r in json.loads(out.read_text())["results"] if r["variant"] == "triton")
    assert row["ms_paired"] > 0 and row["ceiling_ms_paired"] > 0
    assert row["vs_ceiling_paired"] == row["ceiling_ms_paired"] / row["ms_paired"]


def test_fp8_mode_times_bf16_qdq_and_the_kernels_with_their_errors(tmp_path, capsys):
    """``--fp8``: the layer in bf16 (float32 on CPU), quantise-dequantise and on the fp8 kernels, one process; the
    kernel's errors against qdq at float32 rounding, both FP8 rows' against bf16 at FP8's size."""
    out = tmp_path / "fp8.json"
    rc = bench_moe.main(["--tiny", "--fp8", "bf16,qdq_blockwise,kernel_blockwise", "--iters", "1", "--rounds", "1",
                         "--out", str(out)])
    table = capsys.readouterr().out
    assert rc == 0, table
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"fp8 bf16", "fp8 qdq_blockwise", "fp8 kernel_blockwise"}, table
    assert all(r["ms"] > 0 for r in rows.values())
    for name in ("fp8 qdq_blockwise", "fp8 kernel_blockwise"):
        assert len(rows[name]["rel_errs_vs_bf16"]) == 5 and min(rows[name]["rel_errs_vs_bf16"]) > 1e-2, rows[name]
    assert max(rows["fp8 kernel_blockwise"]["rel_errs_vs_qdq"]) < 1e-5
    assert bench_moe.fp8_variant("kernel_blockwise_e4m3g").grad_format == "e4m3"
