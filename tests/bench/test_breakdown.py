"""Qwen3.5-MoE in the step breakdowns: ``bench.breakdown`` (each component compiled on its
own; Qwen3.5's rows: gated attention, Gated DeltaNet, shared expert) and ``bench.trace_breakdown``
(kernels of a real trace by the model's named scopes: the chunked delta rule, the rest of the GDN
layer, the shared expert get their own rows). Qwen3-VL's breakdowns: test_bench.py (one ``bench.step`` run)."""

from __future__ import annotations

import jax
import numpy as np
import pytest


@pytest.fixture(scope="module")
def tiny35():
    """qwen3.5-tiny with the HF-reference vocabulary (512; image / vision tokens 500-503), float32,
    and the text batch of tests.model.hf_reference (3 rows, left padding)."""
    from flax import nnx

    from moevlm_jax.data.batch import hf_inputs_to_batch, hf_labels_to_targets
    from moevlm_jax.model import registry
    from moevlm_jax.model.compute import ComputeConfig
    from moevlm_jax.model.qwen3_5_config import Qwen35ModelConfig
    from tests.model.hf_reference import make_batches
    from tests.model.qwen3_5_reference import config_dicts

    config = Qwen35ModelConfig.from_hf_dict(config_dicts()["tiny"], name="tiny-512")
    compute = ComputeConfig(dtype="float32", param_dtype="float32", scan_layers=False)  # unrolled: faster CPU compiles
    model = registry.build_model(config, compute, nnx.Rngs(0))
    hb = make_batches()["text"]
    batch = hf_inputs_to_batch(config, hb.input_ids, attention_mask=hb.attention_mask)  # no patch slots: no vision
    assert "pixel_values" not in batch
    batch["targets"], batch["loss_mask"] = hf_labels_to_targets(hb.labels)
    return model, {k: jax.numpy.asarray(v) for k, v in batch.items()}



def test_breakdown_components_of_a_qwen3_5_step(tiny35):
    """bench.breakdown on Qwen3.5: the recorded intermediates reproduce the model's forward
    (the check the breakdown reports), the rows are the Qwen3.5 ones, and the two mixer components
    compute exactly the forward's post-mixer residuals of their layers (summed over the layers: GDN for
    the three linear-attention layers, gated attention for the full-attention one)."""
    from flax import nnx

    from bench import breakdown
    from moevlm_jax.parallelism.dispatch import ExpertTopology
    from moevlm_jax.parallelism.experts import resolve_options

    model, batch = tiny35
    assert breakdown.components_of(model) == breakdown.QWEN35_COMPONENTS
    names = [n for n, _ in breakdown.QWEN35_COMPONENTS]
    assert names[3:5] == ["decoder_attention", "gdn"] and "shared_expert" in names
    opts = resolve_options(ExpertTopology(), **model.compute.moe_options)
    graphdef, state = nnx.split(model)

    def record(st, b):
        m = nnx.merge(graphdef, st)
        return breakdown._intermediates(m, b, opts), m.hidden_states(b)[0]

    inter, hidden = jax.jit(record)(state, batch)
    assert float(np.abs(np.asarray(hidden) - np.asarray(inter["hidden"])).max()) == 0.0
    comps = {name: (fn, diff, const) for name, fn, diff, const in breakdown._components(model, batch, inter, opts)}
    # no image: no vision rows; optimizer and input wait are timed apart (run_breakdown)
    assert list(comps) == [n for n in names if n not in ("vision_encoder", "projector", "optimizer", "input_wait")]
    kinds = [kind for kind, _, _ in model.language_model.groups]
    assert kinds == ["linear_attention", "full_attention"]
    for name, kind in (("gdn", "linear_attention"), ("decoder_attention", "full_attention")):
        fn, diff, const = comps[name]
        got = np.asarray(jax.jit(fn)(*diff, *const))
        want = np.asarray(inter["groups"][kinds.index(kind)]["mid"]).sum(0)  # sum over that stack's layers
        assert got.shape == want.shape and np.abs(got - want).max() <= 1e-6 * np.abs(want).max(), name


def test_trace_rows_of_a_qwen3_5_gdn_layer(tiny35, tmp_path):
    """bench.trace_breakdown on a real XLA:CPU trace of one Qwen3.5 linear-attention decoder
    layer's forward + backward: the chunked rule, the rest of the GDN layer, the shared expert, the
    router and the experts each get their own row (the model's named scopes reach the compiled HLO)."""
    from flax import nnx

    from bench import trace_breakdown as tb
    from moevlm_jax.model.qwen3_5_decoder import Qwen35DecoderLayer

    model, _ = tiny35  # qwen3.5-tiny's layer shapes (the model's eager init ops are compiled already)
    text = model.config.text_config
    layer = Qwen35DecoderLayer(text, model.compute, "linear_attention", nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    b, s = 2, 128
    x = jax.random.normal(jax.random.PRNGKey(1), (b, s, text.hidden_size))
    seg = jax.numpy.asarray(np.repeat([[1] * 50 + [2] * 70 + [0] * 8], b, axis=0))
    cos = sin = jax.numpy.zeros((b, s, text.rotary_dim))

    def loss(params, x):
        y, _ = nnx.merge(graphdef, params)(x, cos, sin, seg)
        return jax.numpy.sum(y * y)

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(params, x).compile()
    jax.block_until_ready(compiled(params, x))
    jax.profiler.start_trace(str(tmp_path), create_perfetto_trace=True)
    for _ in range(2):
        jax.block_until_ready(compiled(params, x))
    jax.profiler.stop_trace()
    rows = tb.breakdown(tmp_path, [compiled.as_text()], steps=2)["per_step_ms"]
    for row in ("GDN delta rule (chunked)", "GDN layer (projections, conv, gates, norm)", "shared expert", "router",
                "experts (matmuls + SwiGLU)"):
        assert rows.get(row, 0) > 0, (row, rows)
    assert "decoder attention" not in rows  # a GDN layer has no attention
    assert (tb.component_of("jit(f)/transpose(jvp(decoder_gdn))/gated_delta_rule/while/body/dot")
            == "GDN delta rule (chunked)")
    assert tb.component_of("jit(f)/jvp(decoder_gdn)/conv") == "GDN layer (projections, conv, gates, norm)"
