"""``parallelism.multihost`` under JAX's mock GPU topology (one real process compiling the program of many,
``python -m moevlm_jax.plan.compiled``): the mocked processes mirror this one, since their collectives
return no data; without the mock, one process answers alone."""

from __future__ import annotations

import itertools

import jax
import pytest

from moevlm_jax.parallelism import multihost


@pytest.fixture
def mock_topology():
    before = jax.config.values.get("jax_mock_gpu_topology") or ""
    jax.config.update("jax_mock_gpu_topology", "1x8x1")  # read only when a GPU client starts
    yield
    jax.config.update("jax_mock_gpu_topology", before)


def test_one_process_answers_alone():
    assert not multihost.mocked()
    assert multihost.agreed_max(3) == 3 and multihost.gather_json({"a": 1}) == [{"a": 1}]
    assert multihost.host_ids() == [0]


def test_mocked_processes_mirror_this_one(mock_topology, monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 8)  # what the GPU client reports under "1x8x1"
    assert multihost.mocked()
    assert multihost.agreed_max(3) == 3
    assert multihost.gather_json({"a": 1}) == [{"a": 1}] * 8
    assert multihost.host_ids() == list(range(8))  # each mock process one host of the topology


def test_sum_values_sums_key_by_key_nested():
    parts = [{"tokens": 1024.0, "skipped": {"too_long": 2}}, {"tokens": 1024.0, "skipped": {"bad_record": 1},
                                                              "samples": 3}]
    assert multihost.sum_values(parts) == {"tokens": 2048.0, "skipped": {"too_long": 2, "bad_record": 1},
                                           "samples": 3}
    assert multihost.sum_values([]) == {}


class _Store:
    """The distributed runtime client's key-value calls that ``summed_on_primary`` makes, in memory."""

    def __init__(self):
        self.kv: dict[str, str] = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.kv
        self.kv[key] = value

    def blocking_key_value_get(self, key, timeout_in_ms):
        assert timeout_in_ms > 0
        return self.kv[key]  # the other processes posted first (a real store waits for them)

    def key_value_delete(self, key):
        del self.kv[key]


def test_summed_on_primary_through_the_key_value_store(monkeypatch):
    """Two processes' counts: process 1 posts its own and goes on with them; process 0 reads them, sums and
    deletes the key; no device collective (the gather is never called)."""
    store, me = _Store(), [1]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: me[0])
    monkeypatch.setattr(multihost, "_kv_client", lambda: store)
    monkeypatch.setattr(multihost, "gather_json", lambda obj: pytest.fail("a collective"))
    theirs = {"host": {"tokens": 1024.0, "data_skipped": 1.0}, "window": {"useful_tokens": 900.0}}
    ours = {"host": {"tokens": 1024.0, "data_skipped": 0.0}, "window": {"useful_tokens": 1000.0}}
    for process, values in ((1, theirs), (0, ours)):
        me[0] = process
        # each process numbers its exchanges alike (the same calls in the same order)
        monkeypatch.setattr(multihost, "_exchanges", itertools.count(7))
        got = multihost.summed_on_primary(values)
        if process == 1:
            assert got == theirs and list(store.kv) == ["moevlm_jax/summed/7/1"]
    assert got == {"host": {"tokens": 2048.0, "data_skipped": 1.0}, "window": {"useful_tokens": 1900.0}}
    assert store.kv == {}  # read and deleted


def test_summed_one_process_and_mocked(mock_topology, monkeypatch):
    values = {"tokens": 8.0, "skipped": {"too_long": 1}}
    assert multihost.summed_on_primary(values) == values and multihost.summed(values) == values
    monkeypatch.setattr(jax, "process_count", lambda: 4)  # the mock's processes mirror this one
    assert multihost.summed_on_primary(values) == {"tokens": 32.0, "skipped": {"too_long": 4}}
