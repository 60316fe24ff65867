"""Benchmarks and their HF peers, run from the repository root: ``python -m bench.step``, ``python -m bench.hf_step``,
``python -m bench.moe_layer``, ``python -m bench.hf_moe_layer``, ``python -m bench.sweep``, ``python -m bench.breakdown``.
Not part of the installed package; the library never imports it."""
