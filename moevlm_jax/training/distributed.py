"""Several processes (hosts, or processes on one host): JAX's multi-controller runtime.

Each process runs the same program on its own devices; ``jax.distributed.initialize`` connects them
(NCCL between GPUs, gloo between CPU processes) before any device is used. Where the settings come
from, in order:

1. explicit: ``--coordinator-address HOST:PORT --num-processes N --process-id I`` or the environment
   variables ``MOEVLM_COORDINATOR_ADDRESS`` / ``MOEVLM_NUM_PROCESSES`` / ``MOEVLM_PROCESS_ID`` (what
   ``python -m moevlm_jax.launch`` sets);
2. a cluster JAX detects itself: SLURM (``srun``, ``SLURM_NTASKS`` > 1), Open MPI (``mpirun``,
   ``OMPI_COMM_WORLD_SIZE`` > 1). On Kubernetes the pod spec sets the ``MOEVLM_*`` variables (the
   process id from the Indexed Job's completion index, the coordinator from the headless service:
   examples/k8s/jobset.yaml);
3. otherwise one process: nothing to initialise.

A process that dies stops sending heartbeats; the others then fail their next coordination within
``heartbeat_timeout_seconds`` (``MOEVLM_HEARTBEAT_S``, default 30) instead of waiting in a collective
until its timeout. Only process 0 writes logs above WARNING, the progress bar, metrics and the config.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

ENV_COORDINATOR = "MOEVLM_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MOEVLM_NUM_PROCESSES"
ENV_PROCESS_ID = "MOEVLM_PROCESS_ID"
ENV_HEARTBEAT = "MOEVLM_HEARTBEAT_S"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--coordinator-address``, ``--num-processes``, ``--process-id`` (all or none)."""
    group = parser.add_argument_group("several processes (else from MOEVLM_* / SLURM / Open MPI / Kubernetes)")
    group.add_argument("--coordinator-address", help="HOST:PORT of process 0's coordinator")
    group.add_argument("--num-processes", type=int, help="processes in the run")
    group.add_argument("--process-id", type=int, help="this process's index, 0..N-1")


def _explicit(args: argparse.Namespace | None, environ: Mapping[str, str]) -> dict[str, object] | None:
    given = {"coordinator_address": getattr(args, "coordinator_address", None),
             "num_processes": getattr(args, "num_processes", None), "process_id": getattr(args, "process_id", None)}
    if all(v is None for v in given.values()):
        given = {"coordinator_address": environ.get(ENV_COORDINATOR), "num_processes": environ.get(ENV_NUM_PROCESSES),
                 "process_id": environ.get(ENV_PROCESS_ID)}
        if all(v is None for v in given.values()):
            return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        raise ValueError(f"several processes need the coordinator address, the process count and this process's "
                         f"id; missing {missing} (flags --coordinator-address --num-processes --process-id, or "
                         f"{ENV_COORDINATOR} / {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})")
    n, i = int(given["num_processes"]), int(given["process_id"])
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"process id {i} must be in 0..{n - 1} (num processes {n})")
    return {"coordinator_address": str(given["coordinator_address"]), "num_processes": n, "process_id": i}


def _cluster(environ: Mapping[str, str]) -> str | None:
    """The cluster JAX would auto-detect with more than one process, or None."""
    if "SLURM_JOB_ID" in environ and int(environ.get("SLURM_NTASKS", "1")) > 1:
        return "SLURM"
    if int(environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "Open MPI"
    return None


def initialize(args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Start the multi-controller runtime when this is one of several processes (before any device
    is used); returns the number of processes."""
    import jax

    environ = os.environ if environ is None else environ
    explicit = _explicit(args, environ)
    heartbeat = int(environ.get(ENV_HEARTBEAT, "30"))
    if explicit is not None and explicit["num_processes"] == 1:
        return 1
    if explicit is not None:
        log.info("jax.distributed: process %d of %d, coordinator %s", explicit["process_id"],
                 explicit["num_processes"], explicit["coordinator_address"])
        jax.distributed.initialize(**explicit, heartbeat_timeout_seconds=heartbeat)
    elif (cluster := _cluster(environ)) is not None:
        log.info("jax.distributed: %s cluster detected", cluster)
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
    else:
        return 1
    return jax.process_count()


def process_index() -> int:
    """This process's index (0 when jax.distributed is not running)."""
    import jax

    return jax.process_index()
