"""Threads for collectives on XLA:CPU host devices (``--xla_force_host_platform_device_count=N``).

XLA:CPU runs the programs of all host devices on one process-wide pair of thread pools, and its
in-process collectives (all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute)
block the thread that runs them until every device of the group has arrived. The client sizes
each pool ``max(PJRT_NPROC or NPROC or the CPU count, N)``, on the premise that one thread per
device is enough for a collective (``xla/pjrt/cpu/cpu_client.cc``: "Need at least CpuDeviceCount
threads to launch one collective"; multi-device launches are gang-scheduled one at a time for the
same reason). Within one program that premise does not hold. The thunk executor orders a device's
collectives by *scheduling* edges only (``xla/runtime/execution_graph.h``: a collective
communicator resource gives ``kScheduling``: the next collective may start once the previous one
has started), and a while loop (layer scan, loss chunks, microbatches), call or conditional that
holds collectives returns to its executor before its body is done, so the collectives after it
start while those in its body still wait; a blocking collective is also handed to the pool
whenever other thunks are ready. One device then holds two or more pool threads in collectives.
Where the pool is exactly N threads (fewer cores than devices: 8 devices on 2 cores), every thread
can end up waiting in a collective whose missing peers are queued behind them on the same pool.
That is a deadlock, which XLA ends after its termination timeout (40 s): "Termination timeout for
`all gather RendezvousKey{...}` of 40 seconds exceeded. Exiting to ensure a consistent program
state", then an abort (exit status 134). The waiting collectives are at different ops of the same
run id, which looks like collectives reached in different orders, but in-process rendezvous are
keyed by op id, so any order completes given threads: the pool size is the cause.

:func:`ensure_collective_threads` sets ``PJRT_NPROC`` (read by XLA when the CPU client is created,
before ``NPROC``) to at least ``THREADS_PER_DEVICE`` threads per host device, never fewer than the
CPU count XLA would use anyway. It must run before the jax CPU backend starts, so the entry points
call it first (``moevlm_jax.train``, the planner CLI, the benchmark CLIs, ``moevlm_jax.launch`` for
its CPU processes, the test suite's ``conftest.py``); importing a library module sets nothing.
``MOEVLM_CPU_THREADS_PER_DEVICE`` overrides the threads a device (0: XLA's pool as it
is, which the test suite keeps: ``tests/conftest.py`` says why).
:func:`check_collective_threads` (called by ``Layout.make_mesh``) warns when a CPU mesh runs on a
client that started with fewer threads.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping, MutableMapping

log = logging.getLogger(__name__)

ENV = "PJRT_NPROC"
ENV_NAMES = ("PJRT_NPROC", "NPROC")  # the order XLA reads them in (xla/pjrt/utils.cc DefaultThreadPoolSize)
# Pool threads per host device. A device holds one thread per collective it is in at once: one for each
# executor level in a collective (the entry computation, each while / call / conditional body still
# running). The tp step's deadlock (2 cores, 8 devices, 8 threads) had devices in two at once (an
# all-gather in the vision tower's layer loop and all-gathers of the entry computation); the test program
# of tests/parallelism/test_cpu_collectives.py needs 2 per device (12 threads deadlocked 5 of 5 runs, 16
# passed 5 of 5). 3 leaves a margin; the threads cost nothing measurable (tp step on 2 cores: the same
# step time with 16, 32 and 64 threads).
THREADS_PER_DEVICE = 3
# threads a host device as an integer, 0: leave XLA's pool as it is
PER_DEVICE_ENV = "MOEVLM_CPU_THREADS_PER_DEVICE"
_DEVICE_COUNT = re.compile(r"(?:^|\s)--xla_force_host_platform_device_count=(\S*)(?=\s|$)")
_warned: set[tuple[int, int]] = set()


def host_device_count(environ: Mapping[str, str] | None = None) -> int:
    """Host devices the jax CPU client will create: ``JAX_NUM_CPU_DEVICES``, else the last
    ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``, else 1."""
    env = os.environ if environ is None else environ
    num = env.get("JAX_NUM_CPU_DEVICES", "").strip()
    if num.isdigit() and int(num) > 0:
        return int(num)
    values = _DEVICE_COUNT.findall(env.get("XLA_FLAGS", ""))
    if values and values[-1].isdigit() and int(values[-1]) > 0:
        return int(values[-1])
    return 1


def cpu_count() -> int:
    """CPUs this process may run on (what XLA's ``tsl::port::MaxParallelism`` counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _configured(environ: Mapping[str, str]) -> tuple[str, int] | None:
    for name in ENV_NAMES:
        value = environ.get(name, "").strip()
        if value.lstrip("-").isdigit():
            return name, max(0, int(value))
    return None


def configured_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """The pool size ``PJRT_NPROC`` / ``NPROC`` ask XLA for (the first set to an integer), else None
    (XLA then uses :func:`cpu_count`)."""
    found = _configured(os.environ if environ is None else environ)
    return None if found is None else found[1]


def pool_threads(devices: int, environ: Mapping[str, str] | None = None) -> int:
    """Threads XLA:CPU gives each of its pools for ``devices`` host devices under ``environ``."""
    configured = configured_threads(environ)
    return max(cpu_count() if configured is None else configured, devices)


def threads_per_device(environ: Mapping[str, str] | None = None) -> int:
    """``MOEVLM_CPU_THREADS_PER_DEVICE`` when set to an integer, else THREADS_PER_DEVICE."""
    value = (os.environ if environ is None else environ).get(PER_DEVICE_ENV, "").strip()
    return int(value) if value.isdigit() else THREADS_PER_DEVICE


def required_threads(devices: int, environ: Mapping[str, str] | None = None) -> int:
    """Pool threads the collectives of ``devices`` host devices need (see the module docstring); 1 (no
    requirement) for one device or with ``MOEVLM_CPU_THREADS_PER_DEVICE=0``."""
    per = threads_per_device(environ)
    return per * devices if devices > 1 and per > 0 else 1


def _uses_cpu(environ: Mapping[str, str]) -> bool:
    platforms = [p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    return not platforms or "cpu" in platforms


def _backend_started() -> bool:
    if "jax" not in sys.modules:  # no jax yet: no backend either
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def ensure_collective_threads(environ: MutableMapping[str, str] | None = None) -> int | None:
    """Set ``PJRT_NPROC`` in ``environ`` (default ``os.environ``) so that the XLA:CPU client gets at
    least :func:`required_threads` threads for the host devices ``environ`` asks for; returns the
    pool size it leaves configured, or None when there is nothing to do (one host device, no CPU
    platform) or it is too late (the jax backend has started: :func:`check_collective_threads` warns
    then). A ``PJRT_NPROC`` / ``NPROC`` already large enough is kept; one below the need is raised,
    with a warning. The value is never below the CPU count, so intra-op parallelism is not reduced."""
    env = os.environ if environ is None else environ
    if not _uses_cpu(env) or (devices := host_device_count(env)) <= 1:
        return None
    need, have = required_threads(devices, env), pool_threads(devices, env)
    if have >= need:
        return have
    if environ is None and _backend_started():
        return None
    value = max(need, cpu_count())
    if (found := _configured(env)) is not None:
        log.warning("%s=%d: XLA:CPU collectives on %d host devices need %d threads (a smaller pool can "
                    "deadlock); setting %s=%d", *found, devices, need, ENV, value)
    env[ENV] = str(value)
    return value


def check_collective_threads(devices: int, platform: str = "cpu") -> bool:
    """Whether the XLA:CPU client (as ``os.environ`` configures it) has the threads that collectives
    over ``devices`` host devices need; warns once per device count when not (too late to fix: the
    client started with fewer threads, collectives may deadlock)."""
    if platform != "cpu" or devices <= 1:
        return True
    have, need = pool_threads(devices), required_threads(devices)
    if have >= need:
        return True
    if (devices, have) not in _warned:
        _warned.add((devices, have))
        log.warning("XLA:CPU runs %d host devices on %d threads; their collectives need %d or they may deadlock "
                    "(XLA aborts after its termination timeout): set %s=%d before jax starts, or call "
                    "moevlm_jax.parallelism.cpu_threads.ensure_collective_threads() first", devices, have, need, ENV,
                    need)
    return False
