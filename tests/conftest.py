"""Test setup: 8 CPU host devices and threads for their collectives, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from parallelism.cpu_threads import ensure_collective_threads  # noqa: E402

# PJRT_NPROC: XLA:CPU's default pool of one thread per device (on machines with fewer cores than the 8
# devices) deadlocks the collectives of the 3D layouts' steps (parallelism/cpu_threads.py)
ensure_collective_threads()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
