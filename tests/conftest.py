"""Test setup: 8 CPU host devices and threads for their collectives, set before jax is imported
anywhere; JAX's persistent compilation cache off again after every test that turned it on."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from parallelism.cpu_threads import ensure_collective_threads  # noqa: E402

# PJRT_NPROC: XLA:CPU's default pool of one thread per device (on machines with fewer cores than the 8
# devices) deadlocks collective-heavy steps (parallelism/cpu_threads.py); the train CLI does the same
ensure_collective_threads()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _no_compilation_cache_left_on():
    """A test that runs the train CLI in process with ``train.compilation_cache_dir`` turns JAX's
    persistent cache on for the whole xdist worker; every later compile of that worker then went through
    the cache's serialising path, where XLA:CPU crashed (SIGSEGV / SIGABRT in
    ``_compile_and_write_cache``, four full-suite runs on 2 cores, 2026-12-01). Turned off again here."""
    before = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != before:
        from jax.experimental.compilation_cache import compilation_cache as cc

        cc.reset_cache()
        jax.config.update("jax_compilation_cache_dir", before)
