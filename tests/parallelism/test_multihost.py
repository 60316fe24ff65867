"""``parallelism.multihost`` under JAX's mock GPU topology (one real process compiling the program of many,
``python -m moevlm_jax.plan.compiled``): the mocked processes mirror this one, since their collectives
return no data; without the mock, one process answers alone."""

from __future__ import annotations

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
