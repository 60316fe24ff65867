"""The MoE benchmark runs end to end on CPU with tiny shapes and its agreement checks pass."""

import json

import jax.numpy as jnp

from moevlm_jax.tools import bench_moe


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
