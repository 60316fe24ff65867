"""Benchmarks and their HF peers, run from the repository root: ``python -m bench.step`` (the training step,
``--peer hf`` runs ``bench.hf_step`` beside it, ``--breakdown`` uses ``bench.breakdown`` and ``bench.trace_breakdown``),
``python -m bench.moe_layer`` (the MoE layer, with ``bench.hf_moe_layer`` as its HF peer) and ``python -m bench.sweep``
(MBS x recompute x capture x layout, one ``bench.sweep_point`` process a point).
Not part of the installed package; the library never imports it (tests/test_layering.py)."""
