"""User CLIs next to the library: the compiled memory report of the train step (``python -m moevlm_jax.tools.memory``,
library part in ``moevlm_jax.perf.memory``) and the parameter counts (``python -m moevlm_jax.tools.params``).
Nothing in the library imports this package."""
