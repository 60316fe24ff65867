"""Host-side agreement across processes (the multi-controller runtime's view of a batch).

Each process builds its own rows of a global batch; per-batch statics that select a compiled
program (the loss capacity, the cuDNN bound check) must be the same in every process, so the
trainer agrees on them here. One process: the values as they are, no communication. Under JAX's mock GPU
topology (``jax_mock_gpu_topology`` / ``mock_num_gpu_processes``: one real process compiles the program of
many, ``python -m moevlm_jax.plan.compiled``) the other processes are this one's mirror: nothing to agree
with, their values are this process's (their collectives are mocked and return no data).
"""

from __future__ import annotations

import json
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


def host_ids() -> list[int]:
    """The host of every process, by process index: ``MOEVLM_HOST_ID`` where each process sets it (processes
    sharing a host's fast links share an id; the SLURM example sets it from ``SLURM_NODEID``), else every
    process its own host (run one process per host, with all its devices)."""
    import os

    if mocked():  # each mock process one host of the topology
        return list(range(jax.process_count()))
    mine = os.environ.get("MOEVLM_HOST_ID")
    return [int(h) for h in gather_json(int(mine) if mine is not None else jax.process_index())]
