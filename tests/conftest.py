"""Test setup: 8 CPU host devices, set before jax is imported anywhere; JAX's persistent compilation
cache off again after every test that turned it on."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# XLA:CPU's own thread pool for the suite (MOEVLM_CPU_THREADS_PER_DEVICE=0), as CI ran it before the train
# CLI got its collective threads (parallelism/cpu_threads.py): with 3-4 threads a host device, four of four
# full-suite runs on 2 cores (2026-12-01) lost an xdist worker to a crash inside an XLA:CPU compile
# (SIGSEGV / SIGABRT in backend_compile_and_load; cause not isolated). The CLI's setting is tested in fresh
# processes (tests/parallelism/test_cpu_collectives.py).
os.environ.setdefault("MOEVLM_CPU_THREADS_PER_DEVICE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _no_compilation_cache_left_on():
    """A test that runs the train CLI in process with ``train.compilation_cache_dir`` turns JAX's
    persistent cache on for the whole xdist worker: every later compile of that worker serialised its
    executable into that directory, and one such write crashed (SIGSEGV in ``put_executable_and_time``,
    a full-suite run on 2 cores, 2026-12-01). Turned off again here."""
    before = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != before:
        from jax.experimental.compilation_cache import compilation_cache as cc

        cc.reset_cache()
        jax.config.update("jax_compilation_cache_dir", before)
