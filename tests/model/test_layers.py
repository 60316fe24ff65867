"""Pieces against hand-computed references: attention masking, chunked LM loss, router losses
(vs HF's load_balancing_loss_func), MRoPE layout, logical axis names on every parameter."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
    load_balancing_loss_func,
)

import moevlm_jax.parallelism as parallelism
from moevlm_jax.model.attention import dot_product_attention
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.layers import CHECKPOINT_NAMES, remat_policy
from moevlm_jax.model.loss import lm_loss, load_balancing_loss, router_z_loss
from moevlm_jax.model.moe import route, router_stats
from moevlm_jax.model.qwen3_vl_moe import Qwen3VLMoe
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.model.rotary import mrope_section_index


def test_attention_segments_causal_gqa():
    rng = np.random.default_rng(0)
    b, s, n, k, d = 2, 7, 4, 2, 8
    q, kk, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((b, s, n, d), (b, s, k, d), (b, s, k, d)))
    seg = np.array([[0, 0, 1, 1, 1, 2, 2], [1, 1, 1, 1, 2, 2, 0]])
    for causal in (True, False):
        out = np.asarray(dot_product_attention(jnp.asarray(q), jnp.asarray(kk), jnp.asarray(v),
                                               q_segment_ids=jnp.asarray(seg),
                                               kv_segment_ids=jnp.asarray(seg), causal=causal, impl="xla"))
        ref = np.zeros_like(out)
        for bi in range(b):
            for i in range(s):
                keys = [j for j in range(s) if seg[bi, j] == seg[bi, i] and (j <= i or not causal)]
                for h in range(n):
                    kh = h // (n // k)
                    logits = np.array([q[bi, i, h] @ kk[bi, j, kh] for j in keys]) / np.sqrt(d)
                    p = np.exp(logits - logits.max())
                    ref[bi, i, h] = (p / p.sum()) @ v[bi, keys, kh]
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


def test_chunked_lm_loss_and_grad_match_dense():
    rng = np.random.default_rng(1)
    b, s, h, vocab = 2, 11, 8, 13
    hidden = jnp.asarray(rng.standard_normal((b, s, h)), jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((h, vocab)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (b, s)), jnp.int32)
    mask = jnp.asarray(rng.random((b, s)) < 0.7, jnp.float32)

    def dense(hd, kn):
        logp = jax.nn.log_softmax(hd @ kn, axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask)

    total, count = lm_loss(hidden, kernel, targets, mask, chunk_size=4)  # 11 = 4 + 4 + 3 (padded)
    logits = np.asarray(hidden @ kernel, np.float64)
    lse = np.log(np.exp(logits).sum(-1))
    ref = ((lse - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]) * np.asarray(mask)).sum()
    np.testing.assert_allclose(total, ref, rtol=1e-5)
    assert count == mask.sum()
    g = jax.grad(lambda hd, kn: lm_loss(hd, kn, targets, mask, chunk_size=4)[0], argnums=(0, 1))(hidden, kernel)
    g_ref = jax.grad(dense, argnums=(0, 1))(hidden, kernel)
    for a, r in zip(g, g_ref):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-5)


def _dot_operand_dtypes(jaxpr) -> list[tuple[str, ...]]:
    """Operand dtypes of every dot_general in a jaxpr and its sub-jaxprs (scan, remat, custom_vjp)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for sub in jax.core.subjaxprs(eqn) if hasattr(jax.core, "subjaxprs") else ():
            found += _dot_operand_dtypes(sub)
        for val in eqn.params.values():
            for j in (val if isinstance(val, (tuple, list)) else (val,)):
                inner = getattr(j, "jaxpr", j)
                if hasattr(inner, "eqns"):
                    found += _dot_operand_dtypes(inner)
    return found


def test_lm_loss_backward_matmuls_run_in_bf16():
    """bf16 hidden and kernel: three vocabulary GEMMs per chunk (logits, d(hidden), d(kernel); no
    recomputed logits), all bf16 x bf16 (autodiff had float32 x bf16, TF32 on the GPU); the gradients
    stay within bf16 rounding of the float32 ones, and scale with the loss's cotangent."""
    rng = np.random.default_rng(4)
    hidden = jnp.asarray(rng.standard_normal((2, 64, 16)), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((16, 32)) * 0.3, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, 32, (2, 64)), jnp.int32)
    mask = jnp.asarray(rng.random((2, 64)) < 0.5, jnp.float32)
    grad = jax.grad(lambda hd, kn: lm_loss(hd, kn, targets, mask, chunk_size=16)[0], argnums=(0, 1))
    dots = _dot_operand_dtypes(jax.make_jaxpr(grad)(hidden, kernel).jaxpr)
    assert dots == [("bfloat16", "bfloat16")] * 3, dots
    f32 = grad(hidden.astype(jnp.float32), kernel.astype(jnp.float32))
    for got, want in zip(grad(hidden, kernel), f32):
        err = jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want)
        assert float(err) < 1e-2, float(err)
    scaled = jax.grad(lambda hd, kn: 3.0 * lm_loss(hd, kn, targets, mask, chunk_size=16)[0], argnums=(0, 1))
    for got, want in zip(scaled(hidden.astype(jnp.float32), kernel.astype(jnp.float32)), f32):
        np.testing.assert_allclose(got, 3.0 * want, rtol=1e-5, atol=1e-6)


def test_lm_loss_with_logits_in_the_activation_dtype_is_hfs():
    """compute.logits_fp32 false: the logits rounded to bf16 as HF's LM head writes them, then a float32
    cross-entropy (HF's loss upcasts): the loss equals that reference to float32 rounding, differs from the
    float32-logits loss by the bf16 rounding, and the gradients stay within bf16 rounding of the float32 ones."""
    rng = np.random.default_rng(5)
    hidden = jnp.asarray(rng.standard_normal((2, 40, 16)), jnp.bfloat16)
    kernel = jnp.asarray(rng.standard_normal((16, 48)) * 0.5, jnp.bfloat16)
    targets = jnp.asarray(rng.integers(0, 48, (2, 40)), jnp.int32)
    mask = jnp.asarray(rng.random((2, 40)) < 0.6, jnp.float32)

    def hf(hd, kn):
        logits = jnp.einsum("bsh,hv->bsv", hd, kn, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.sum(jnp.take_along_axis(logp, targets[..., None], -1)[..., 0] * mask)

    loss = lambda hd, kn, fp32: lm_loss(hd, kn, targets, mask, chunk_size=16, fp32_logits=fp32)[0]  # noqa: E731
    got, want, f32 = float(loss(hidden, kernel, False)), float(hf(hidden, kernel)), float(loss(hidden, kernel, True))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got != f32 and abs(got - f32) < 1e-2 * abs(f32)
    grads = jax.grad(loss, argnums=(0, 1))(hidden, kernel, False)
    ref = jax.grad(loss, argnums=(0, 1))(hidden.astype(jnp.float32), kernel.astype(jnp.float32), True)
    for g, r in zip(grads, ref):
        assert g.dtype == jnp.bfloat16
        assert float(jnp.linalg.norm(g.astype(jnp.float32) - r) / jnp.linalg.norm(r)) < 1e-2


def test_router_losses_match_hf_load_balancing():
    rng = np.random.default_rng(2)
    layers, b, s, e, k = 3, 2, 5, 6, 2
    logits = rng.standard_normal((layers, b, s, e)).astype(np.float32) * 2
    mask = np.ones((b, s), np.int64)
    mask[1, :2] = 0
    stats = []
    for layer_logits in logits:
        probs, _, top_i = route(jnp.asarray(layer_logits), k)
        stats.append(router_stats(jnp.asarray(layer_logits), probs, top_i, jnp.asarray(mask > 0), e))
    router = jax.tree.map(lambda *a: jnp.stack(a), *stats)
    ref = load_balancing_loss_func(tuple(torch.tensor(x.reshape(b * s, e)) for x in logits), e, k, torch.tensor(mask))
    np.testing.assert_allclose(load_balancing_loss(router, e), ref.item(), rtol=1e-5)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    z_ref = np.mean([(lse[i] ** 2 * mask).sum() / mask.sum() for i in range(layers)])
    np.testing.assert_allclose(router_z_loss(router), z_ref, rtol=1e-5)


def test_route_renormalises_top_k():
    logits = jnp.asarray([[0.0, 1.0, 2.0, 3.0]])
    probs, w, i = route(logits, 2)
    p = np.exp([0.0, 1.0, 2.0, 3.0]) / np.exp([0.0, 1.0, 2.0, 3.0]).sum()
    np.testing.assert_allclose(probs[0], p, rtol=1e-6)
    np.testing.assert_array_equal(i[0], [3, 2])
    np.testing.assert_allclose(w[0], p[[3, 2]] / p[[3, 2]].sum(), rtol=1e-6)


def test_mrope_interleaved_layout():
    """HF Qwen3-VL: frequency j uses h if j % 3 == 1 and j < 3*sec_h, w if j % 3 == 2 and j < 3*sec_w, else t."""
    sel = mrope_section_index(128, (24, 20, 20))
    expect = [1 if j % 3 == 1 and j < 60 else 2 if j % 3 == 2 and j < 60 else 0 for j in range(64)]
    np.testing.assert_array_equal(sel, expect)


def test_remat_policy_names():
    assert remat_policy(ComputeConfig(recompute="none")) is None
    assert remat_policy(ComputeConfig(recompute="full")) is jax.checkpoint_policies.nothing_saveable
    assert set(CHECKPOINT_NAMES) >= {"core_attn", "moe_act", "layernorm", "mlp", "moe", "moe_router"}
    with pytest.raises(ValueError, match="recompute_modules"):
        ComputeConfig(recompute="selective", recompute_modules=("attention",))


def test_every_parameter_has_logical_axes():
    vocab = set(re.findall(r"\w+", parallelism.__doc__.split("activations")[0].split("parameters")[1]))
    model = nnx.eval_shape(lambda: Qwen3VLMoe(load_model_config("tiny-v512"), ComputeConfig(), nnx.Rngs(0)))
    specs = nnx.get_partition_spec(nnx.state(model))
    for path, var in nnx.to_flat_state(nnx.state(model)):
        names = var.get_metadata()["out_sharding"]
        assert len(names) == len(var.get_value().shape), path
        assert {n for n in names if n is not None} <= vocab, (path, names)
        if "blocks" in path:
            assert names[0] == "vis_layers", path
        if "stacks" in path:
            assert names[0] == "layers", path
    lm = dict(nnx.to_flat_state(specs))
    assert tuple(lm[("language_model", "stacks", 0, "mlp", "gate_up_proj")].get_value()) == ("layers", "exp", "embed",
                                                                                             None, "moe_mlp")
    assert tuple(lm[("language_model", "stacks", 0, "self_attn", "q_proj", "kernel")].get_value()) == (
        "layers", "embed", "q_heads", "head_dim")


def test_activation_constraints_trace_under_a_layout():
    """Every ``constrain`` call names as many axes as its tensor has (traced under the fsdp layout
    on 8 CPU devices; shapes only, nothing compiled)."""
    from moevlm_jax.config import load_layout
    from moevlm_jax.data.batch import hf_inputs_to_batch
    from moevlm_jax.parallelism.logical import sharding_context

    config = load_model_config("tiny-v512")
    model = nnx.eval_shape(lambda: Qwen3VLMoe(config, ComputeConfig(dtype="float32"), nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    ids = np.full((8, 16), 7)
    ids[:, 2], ids[:, 3:7], ids[:, 7] = 502, 500, 503
    grids = np.tile([[1, 4, 4]], (8, 1))
    batch = hf_inputs_to_batch(config, ids, np.zeros((128, 1536), np.float32), grids)
    layout = load_layout("fsdp")
    with sharding_context(layout.make_mesh(), layout.rules):
        logits, aux = jax.eval_shape(lambda st: nnx.merge(graphdef, st).forward(batch), state)
    assert logits.shape == (8, 16, 512)
    assert aux["router"]["expert_counts"].shape == (4, 8, 8)


def test_bias_add_gradient_is_the_float32_column_sum():
    """bias_add: forward y + b; gradients: y's is the cotangent, b's the float32 sum of the cotangent over the
    leading dims, rounded once (a multi-dim bias as the qkv projection's [3, N, D]); under jit and vmap."""
    from moevlm_jax.model.layers import bias_add
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    y = jax.random.normal(k1, (4, 37, 3, 2, 8), jnp.bfloat16)
    b = jax.random.normal(k2, (3, 2, 8), jnp.bfloat16)
    g = jax.random.normal(k3, y.shape, jnp.bfloat16)
    out, vjp = jax.vjp(jax.jit(bias_add), y, b)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(y + b, np.float32))
    gy, gb = vjp(g)
    np.testing.assert_array_equal(np.asarray(gy, np.float32), np.asarray(g, np.float32))
    ref = np.asarray(g, np.float64).sum(axis=(0, 1))
    np.testing.assert_array_equal(np.asarray(gb, np.float32), np.asarray(jnp.asarray(ref,
                                                                                     jnp.float32).astype(jnp.bfloat16),
                                                                         np.float32))
    gbv = jax.vmap(lambda yy, bb: jax.vjp(bias_add, yy, bb)[1](g[0])[1])(y, jnp.stack([b] * 4))
    np.testing.assert_allclose(np.asarray(gbv[1], np.float32), np.asarray(g[0], np.float32).sum(0), rtol=1e-2,
                               atol=1e-2)
