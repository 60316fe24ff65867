"""Test setup: 8 CPU host devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# XLA:CPU's own thread pool for the suite (MOEVLM_CPU_THREADS_PER_DEVICE=0), as CI ran it before the train CLI
# got its collective threads (parallelism/cpu_threads.py): with 3-4 threads a host device, three of three
# suite runs on 2 cores lost a worker to a crash inside an XLA:CPU compile (SIGSEGV / SIGABRT; cause not
# isolated). The CLI's setting is tested in fresh processes (tests/parallelism/test_cpu_collectives.py).
os.environ.setdefault("MOEVLM_CPU_THREADS_PER_DEVICE", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
