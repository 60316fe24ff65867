"""XLA:CPU settings that make the suite's compiles quick (no jax import here: conftest reads this before
jax starts).

- ``FAST_XLA_FLAGS`` (every process of the suite, tests/conftest.py): unoptimised LLVM code for the same
  HLO; XLA's HLO passes, fusion and buffer assignment are unchanged.
- ``LEGACY_EMITTERS``: XLA:CPU's elemental (pre-MLIR) fusion emitters, a third of the compile time of a
  train step. The emitted code rounds some elementwise functions differently in the last bits, so it is
  for tests whose references are compiled alike (a layout against one device, a resumed run against the
  straight one, a run against its own first steps), never for parity with HF / torch. XLA's memory figures
  (buffer assignment) stay within 0.04% of the default emitters' (2026-12-02), so the planner's 10% checks
  use it too. Through the ``legacy_emitters`` fixture (all compiles of a test), ``compile(FAST)`` dicts and
  ``LEGACY_EMITTERS_FLAG`` in the XLA_FLAGS of a test's subprocesses.
"""

# as compile options (``.compile(FAST)``, ``jax.jit(..., compiler_options=FAST)``) and as XLA_FLAGS
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
FAST_XLA_FLAGS = " ".join(f"--{k}={str(v).lower()}" for k, v in FAST.items())
LEGACY_EMITTERS = {"xla_cpu_use_fusion_emitters": False}
LEGACY_EMITTERS_FLAG = "--xla_cpu_use_fusion_emitters=false"
