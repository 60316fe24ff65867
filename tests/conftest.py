"""Test setup: 8 CPU host devices and quick XLA:CPU compiles, set before jax is imported anywhere; one data
cache and one persistent compilation cache for the run's processes (a test that points JAX at its own cache is
put back on the run's afterwards); compiled executables freed
after each module (Linux's memory-map limit); the slowest modules scheduled first over the xdist workers."""

import atexit
import gc
import os
import shutil
import tempfile

from tests.xla_options import FAST_XLA_FLAGS, LEGACY_EMITTERS

# Unoptimised LLVM code (tests/xla_options.py): the suite's compiles take ~40% less time, its small
# programs run about as fast. The tests' subprocesses inherit it; those that set their own XLA_FLAGS add it.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 " + FAST_XLA_FLAGS
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# One cache of the built-in datasets for the whole run (tests/training/train_setup.py's VQA set is generated once,
# not once a module): made by the first process (xdist's controller, or plain pytest), inherited through the
# environment by the workers and the tests' subprocesses, removed when that process exits.
if "MOEVLM_TEST_DATA_CACHE" not in os.environ:
    os.environ["MOEVLM_TEST_DATA_CACHE"] = tempfile.mkdtemp(prefix="moevlm-test-data-")
    atexit.register(shutil.rmtree, os.environ["MOEVLM_TEST_DATA_CACHE"], True)

# One persistent compilation cache for the whole run, shared like the data cache (the workers and the tests'
# subprocesses inherit it): a program compiled in one test module, worker or subprocess is loaded, not compiled
# again, by the next that builds the same program (the same tiny model's train step under the CLI, the faults,
# the checkpoints and the several-process tests; about a sixth of a run's compiles). Every program is cached (no
# minimum compile time). A test that sets its own
# ``train.compilation_cache_dir`` gets its own cache for that test (the fixture below restores this one).
if "MOEVLM_TEST_JAX_CACHE" not in os.environ:
    os.environ["MOEVLM_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="moevlm-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["MOEVLM_TEST_JAX_CACHE"], True)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ["MOEVLM_TEST_JAX_CACHE"])
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# XLA:CPU's collective threads as the train CLI sets them (parallelism/cpu_threads.py, called by the
# entry points; here before any test starts the CPU client): with XLA's own pool (one thread a device)
# collective-heavy steps deadlock where cores < devices (a tp run through the CLI in the suite aborted
# so, 2026-12-02). The suite ran with XLA's pool (MOEVLM_CPU_THREADS_PER_DEVICE=0) after four full runs
# on 2 cores (2026-12-01) lost a worker in an XLA:CPU compile with the raised pool; those crashes were
# the memory-map limit found later (the fixture below frees compiled executables), not the threads.

import jax
import pytest

from moevlm_jax.parallelism.cpu_threads import ensure_collective_threads

ensure_collective_threads()  # PJRT_NPROC for the 8 host devices, before any test starts the CPU client

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _no_compilation_cache_left_on():
    """A test that runs the train CLI in process with ``train.compilation_cache_dir`` points the whole xdist
    worker's persistent cache at its own directory: put back on the run's cache afterwards."""
    before = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != before:
        from jax.experimental.compilation_cache import compilation_cache as cc

        cc.reset_cache()
        jax.config.update("jax_compilation_cache_dir", before)


def _memory_maps() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux: no such limit to keep under
        return 0


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # Linux's default


MAX_MAP_COUNT = _max_map_count()


def _free_executables():
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True, scope="module")
def _executables_freed_after_each_module():
    """Every XLA:CPU executable keeps its JIT-compiled code in memory maps of its own (~6 for a tiny jit,
    thousands for a train step: one bound-check test left a worker at 6.3k maps, the FSDP test at 14.3k),
    and JAX's caches keep the executables alive. An xdist worker that ran half the suite passed Linux's
    ``vm.max_map_count`` (65530), the next mmap in LLVM's JIT failed and the compile aborted: "Fatal Python
    error: Aborted" in ``backend_compile_and_load`` (CI, 2026-12-02; a local full-suite run the day
    before; after a clear the same worker is back at ~930 maps). Dropped after each module (its module
    fixtures are released first)."""
    yield
    _free_executables()


@pytest.fixture(autouse=True)
def _memory_maps_well_under_the_limit():
    """Within a module too: caches dropped once a test leaves the process past half the limit."""
    yield
    if _memory_maps() > MAX_MAP_COUNT // 2:
        _free_executables()


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """Every HF reference config (tests/model/hf_reference.py) as a random HF model saved with transformers'
    save_pretrained: name -> HFFixture (config, model, path). One per session, for every test directory."""
    from tests.model.hf_reference import HFFixture, build_hf, hf_config_dicts

    out = {}
    for seed, (name, cfg) in enumerate(hf_config_dicts().items()):
        model = build_hf(cfg, seed)
        path = tmp_path_factory.mktemp(f"hf_{name}")
        model.save_pretrained(path)
        out[name] = HFFixture(name, cfg, model, str(path))
    return out


@pytest.fixture(scope="module")
def legacy_emitters():
    """Every compile of the module's tests (their module fixtures too: ``pytestmark =
    pytest.mark.usefixtures("legacy_emitters")``) with XLA:CPU's elemental fusion emitters
    (tests/xla_options.py): a third of the compile time of a train step. Only for tests whose references
    are compiled the same way. The in-memory executables are dropped before and after, so that none
    compiled one way serves the other."""
    from jax._src import compiler

    real = compiler.get_compile_options

    def get_compile_options(*args, env_options_overrides=None, **kwargs):
        return real(*args, env_options_overrides={**LEGACY_EMITTERS, **(env_options_overrides or {})}, **kwargs)

    jax.clear_caches()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compiler, "get_compile_options", get_compile_options)
        yield
    jax.clear_caches()


# Modules by their time on 2 cores, slowest first (full-suite runs; the process-level modules re-measured
# after sharing their compiles and shrinking their batches): the xdist workers start on them, each module on
# one worker (its module fixtures computed once), so that no long module is left running alone at the end;
# the rest follow in collection order (tests/bench/ and tests/plan/: the former tests/tools/ modules).
SLOW_MODULES = (  # each module's time in a full run on 2 cores (2026-12-08, shared compile cache), longest first
    "tests/parallelism/test_layouts.py",  # 221 s
    "tests/training/test_multiprocess.py",  # 159 s
    "tests/parallelism/test_layouts_cli.py",  # 144 s
    "tests/training/test_faults.py",  # 124 s
    "tests/parallelism/test_gmm_mgpu.py",  # 94 s
    "tests/plan/test_plan.py",  # 80 s
    "tests/bench/test_bench.py",  # 63 s
    "tests/training/test_reuse_shapes.py",  # 56 s
    "tests/training/test_train_fsdp.py",  # 53 s
    "tests/model/test_parity.py",  # 53 s
    "tests/plan/test_autofit.py",  # 51 s
    "tests/parallelism/test_dispatch.py",  # 50 s
    "tests/training/test_portable_checkpoints.py",  # 50 s
    "tests/inference/test_generate.py",  # 48 s
    "tests/training/test_train_cli.py",  # 48 s
    "tests/parallelism/test_pipeline.py",  # 47 s
    "tests/parallelism/test_permute.py",  # 45 s
    "tests/bench/test_hf_step.py",  # 39 s
    "tests/bench/test_sweep.py",  # 39 s
    "tests/parallelism/test_fp8_trainer.py",  # 35 s
    "tests/model/test_recompute.py",  # 34 s
    "tests/training/test_bf16_params.py",  # 30 s
    "tests/model/test_gated_deltanet.py",  # 28 s
    "tests/training/test_qwen3_5_train.py",  # 28 s
    "tests/bench/test_bench_moe.py",  # 26 s
    "tests/model/test_compute.py",  # 24 s
    "tests/bench/test_breakdown.py",  # 24 s
    "tests/plan/test_compiled.py",  # 24 s
    "tests/training/test_loop_hooks.py",  # 21 s
    "tests/parallelism/test_grouped_matmul.py",  # 21 s
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected


class _WholeModulesFirst:
    """xdist's scheduler hook, registered only where pytest-xdist is installed (plain ``pytest`` without it
    rejects an unknown ``pytest_xdist_*`` hook with INTERNALERROR)."""

    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        """Under ``-n`` (xdist's default distribution, 'load'): whole modules, in the order above."""
        if config.getvalue("dist") != "load":
            return None
        from xdist.scheduler import LoadScopeScheduling

        config.option.loadscopereorder = False
        return LoadScopeScheduling(config, log)


def pytest_configure(config):
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_WholeModulesFirst(), "moevlm-whole-modules-first")
