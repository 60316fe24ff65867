"""Host-side agreement across processes (the multi-controller runtime's view of a batch).

Each process builds its own rows of a global batch; per-batch statics that select a compiled
program (the loss capacity, the cuDNN bound check) must be the same in every process, so the
trainer agrees on them here; the counts that each process has of its own rows only (tokens, FLOPs,
samples, skips) are summed here for the records and the summary. One process: the values as they are, no
communication. Under JAX's mock GPU topology (``jax_mock_gpu_topology`` / ``mock_num_gpu_processes``: one
real process compiles the program of many, ``python -m moevlm_jax.plan.compiled``) the other processes are
this one's mirror: nothing to agree with, their values are this process's (their collectives are mocked and
return no data).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np


def mocked() -> bool:
    """Whether the processes beyond this one are JAX's mock (the mock GPU topology)."""
    flags = jax.config.values
    return bool(flags.get("jax_mock_gpu_topology")) or int(flags.get("mock_num_gpu_processes") or 0) > 0


def agreed_max(value: int) -> int:
    """The largest ``value`` over all processes (each computes a per-batch static from its own rows;
    every process must compile the same program)."""
    if jax.process_count() == 1 or mocked():
        return value
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray(value))))


def gather_json(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable ``obj``, in process order (one process: ``[obj]``); e.g. the
    data iterator states a checkpoint keeps for all processes."""
    if jax.process_count() == 1:
        return [obj]
    if mocked():
        return [obj] * jax.process_count()
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    width = agreed_max(int(data.size))
    padded = np.zeros(width, np.uint8)
    padded[: data.size] = data
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray(data.size, np.int64))).reshape(-1)
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), width)
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, sizes)]


def sum_values(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Key-by-key sums of ``parts`` (numbers, or mappings of them, nested; a key that a part lacks counts 0
    there), e.g. the processes' counts of their own rows -> the run's."""
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, Mapping):
                out[key] = sum_values([out.get(key, {}), value])
            else:
                out[key] = out.get(key, 0) + value
    return out


def summed(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (see :func:`sum_values`) summed over the processes, in every process: a collective (every
    process calls it at the same point), for what is summed once, e.g. a run's totals at its end."""
    return sum_values(gather_json(dict(values)))


# the key-value exchanges of summed_on_primary, numbered in the order every process makes them
_exchanges = itertools.count()
_KV_PREFIX = "moevlm_jax/summed"


def summed_on_primary(values: Mapping[str, Any], *, timeout_s: float = 3600.0) -> dict[str, Any]:
    """``values`` (see :func:`sum_values`) summed over the processes in process 0 (the one that writes the
    records); every other process gets its own values back. Host to host through the distributed runtime's
    key-value store: the other processes post theirs and go on, process 0 waits for them (each at the same
    point of its loop, as every process calls this in the same order); nothing runs on the devices, so
    nothing queues behind the running step. One process: ``values``, no communication."""
    count = jax.process_count()
    if count == 1:
        return dict(values)
    if mocked():
        return sum_values([values] * count)
    client = _kv_client()
    if client is None:  # no distributed runtime client to post to: a collective
        return summed(values)
    n, me = next(_exchanges), jax.process_index()
    if me != 0:
        client.key_value_set(f"{_KV_PREFIX}/{n}/{me}", json.dumps(dict(values)))
        return dict(values)
    parts = [values]
    for p in range(1, count):
        key = f"{_KV_PREFIX}/{n}/{p}"
        parts.append(json.loads(client.blocking_key_value_get(key, int(timeout_s * 1000))))
        client.key_value_delete(key)
    return sum_values(parts)


def _kv_client() -> Any:
    """The distributed runtime's client of this process (its key-value store), None when there is none."""
    from jax._src import distributed

    return distributed.global_state.client


def host_ids() -> list[int]:
    """The host of every process, by process index: ``MOEVLM_HOST_ID`` where each process sets it (processes
    sharing a host's fast links share an id; the SLURM example sets it from ``SLURM_NODEID``), else every
    process its own host (run one process per host, with all its devices)."""
    import os

    if mocked():  # each mock process one host of the topology
        return list(range(jax.process_count()))
    mine = os.environ.get("MOEVLM_HOST_ID")
    return [int(h) for h in gather_json(int(mine) if mine is not None else jax.process_index())]
