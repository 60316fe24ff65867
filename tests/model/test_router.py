"""Router options (Megatron's): each load-balancing loss and the z-loss against hand computation,
per-DP-rank vs per-sequence vs global differences, the aux-loss-free expert bias (selection only,
no gradient, the update rule, stacking, checkpoint/HF handling), expert-load metrics, and a short
CPU training run where the expert bias balances a skewed router."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moevlm_jax.model import router as R
from moevlm_jax.model.compute import ComputeConfig, RouterConfig
from moevlm_jax.model.config import TextConfig
from moevlm_jax.model.moe import SparseMoeBlock
from moevlm_jax.model.qwen3_vl_moe import Qwen3VLMoe
from moevlm_jax.model.registry import load_model_config

TINY_TEXT = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "moe_intermediate_size": 8,
             "num_experts": 8, "num_experts_per_tok": 2,
             "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [4, 2, 2]}}


def _build(make, seed: int = 0) -> nnx.Module:
    """``make()`` built abstractly, then filled with N(0, 0.05) parameters and zero expert biases
    (eager random init costs seconds per shape on CPU)."""
    graphdef, params, rest = nnx.split(nnx.eval_shape(make), nnx.Param, ...)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape) * 0.05, s.dtype), params)
    return nnx.merge(graphdef, params, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rest))


def _stats(logits: np.ndarray, valid: np.ndarray, k: int) -> dict:
    """Router stats [L, B, ...] for logits [L, B, S, E] through the model's route/router_stats."""
    def one(layer):
        probs, _, top_i = R.route(layer, k)
        return R.router_stats(layer, probs, top_i, jnp.asarray(valid), layer.shape[-1])

    return jax.jit(jax.vmap(one))(jnp.asarray(logits))


# ----------------------------------------------------------------------------- config


def test_router_config_validation():
    assert ComputeConfig().router == RouterConfig()  # "hf" is the parity default
    c = ComputeConfig(router={"aux_loss": "seq_aux_loss", "expert_bias": True, "z_loss_coef": 1e-3})
    assert isinstance(c.router, RouterConfig) and c.router.aux_loss == "seq_aux_loss"
    assert hash(c) == hash(ComputeConfig(router=RouterConfig(aux_loss="seq_aux_loss", expert_bias=True,
                                                             z_loss_coef=1e-3)))
    assert c.router.expert_bias is True and RouterConfig(aux_loss="none").coef(0.01) == 0.0
    assert RouterConfig(aux_loss_coef=0.1).coef(0.01) == 0.1 and RouterConfig().coef(0.01) == 0.01
    for bad, match in (({"aux_loss": "global"}, "now 'hf'"), ({"aux_loss": "seq"}, "compute.router.aux_loss"),
                       ({"z_loss": 1}, "unknown key 'compute.router.z_loss'"), ({"expert_bias_update_rate": -1},
                                                                                "expert_bias_update_rate"),
                       ({"expert_bias": "yes"}, "expert_bias"), ({"dtype": "bf16"}, "compute.router.dtype")):
        with pytest.raises(ValueError, match=match):
            ComputeConfig(router=bad)


# ----------------------------------------------------------------------------- losses


def test_losses_on_a_handmade_routing():
    """E=2, K=1, one layer, two rows of two tokens. Row 0 routes both tokens to expert 0 with probs
    (.9,.1), (.8,.2); row 1 both to expert 1 with (.3,.7), (.4,.6).
    seq:    row 0: f=(1,0), p=(.85,.15) -> 2*.85 = 1.7; row 1: f=(0,1), p=(.35,.65) -> 1.3; mean 1.5.
    global: f=(.5,.5), p=(.6,.4) -> 2*(.3+.2) = 1.0. aux_loss with 2 DP ranks (a row each) = seq;
    with 1 rank = global. hf: E * sum_e (C_e/T)(P_e/T), no 1/K: equal to global here (K=1)."""
    probs = np.array([[[0.9, 0.1], [0.8, 0.2]], [[0.3, 0.7], [0.4, 0.6]]], np.float32)
    router = _stats(np.log(probs)[None], np.ones((2, 2), bool), k=1)
    np.testing.assert_array_equal(router["expert_counts"][0], [[2, 0], [0, 2]])

    def per_layer(kind: str, dp: int = 1) -> float:
        return float(R.aux_loss_per_layer(router, kind, 2, 1, dp)[0])

    assert per_layer("seq_aux_loss") == pytest.approx(1.5, rel=1e-6)
    assert per_layer("global_aux_loss") == pytest.approx(1.0, rel=1e-6)
    assert per_layer("aux_loss", 2) == pytest.approx(1.5, rel=1e-6)
    assert per_layer("aux_loss", 1) == pytest.approx(1.0, rel=1e-6)
    assert float(R.load_balancing_loss(router, 2)) == pytest.approx(1.0, rel=1e-6)
    # z-loss: logits log(p) have logsumexp 0 -> z = 0; shifted logits log(p) + 1 -> z = 1 per token
    assert float(R.router_z_loss(_stats(np.log(probs)[None] + 1.0, np.ones((2, 2), bool), 1))) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="data-parallel groups"):
        R.aux_loss_per_layer(router, "aux_loss", 2, 1, 3)


def _np_switch(logits: np.ndarray, valid: np.ndarray, k: int) -> float:
    """Megatron switch_load_balancing_loss_func on tokens [N, E] (valid ones only), from scratch."""
    x = logits[valid]
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1)[:, :k]
    routing_map = np.zeros_like(p)
    np.put_along_axis(routing_map, top, 1.0, axis=-1)
    t, e = x.shape
    return float(np.sum(p.sum(0) * routing_map.sum(0)) * e / (k * t * t))


def test_megatron_losses_match_token_level_reference():
    """Random routing, 3 layers, 4 rows (2 DP ranks of 2 rows), padding; each loss from the router
    stats equals the token-level numpy computation, and the three kinds differ on this case."""
    rng = np.random.default_rng(0)
    layers, b, s, e, k = 3, 4, 6, 8, 2
    logits = (rng.standard_normal((layers, b, s, e)) * 2 + np.linspace(0, 3, e)).astype(np.float32)
    valid = np.ones((b, s), bool)
    valid[1, 4:] = valid[3, :2] = False
    router = _stats(logits, valid, k)
    ref = {
        "seq_aux_loss": [np.mean([_np_switch(logits[l, r], valid[r], k) for r in range(b)]) for l in range(layers)],
        "global_aux_loss": [_np_switch(logits[l].reshape(b * s, e), valid.reshape(-1), k) for l in range(layers)],
        "aux_loss": [np.mean([_np_switch(logits[l, g:g + 2].reshape(2 * s, e), valid[g:g + 2].reshape(-1), k)
                              for g in (0, 2)]) for l in range(layers)],
    }
    for kind, want in ref.items():
        np.testing.assert_allclose(R.aux_loss_per_layer(router, kind, e, k, dp_size=2), want, rtol=1e-5)
        term, metrics = R.router_losses(router, RouterConfig(aux_loss=kind, aux_loss_coef=0.1), e, k, 0.001, dp_size=2)
        np.testing.assert_allclose(term, 0.1 * np.sum(want), rtol=1e-5)  # Megatron: coef * sum over layers
        np.testing.assert_allclose(metrics["router_aux_loss"], np.mean(want), rtol=1e-5)  # logged: layer mean
    means = sorted(np.mean(v) for v in ref.values())
    assert means[1] - means[0] > 0.02 and means[2] - means[1] > 0.02, ref  # three different numbers
    # z-loss: coef * sum over layers of the token mean of logsumexp^2 (valid tokens only)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    z = [(lse[l] ** 2)[valid].mean() for l in range(layers)]
    term, metrics = R.router_losses(router, RouterConfig(aux_loss="none", z_loss_coef=0.01), e, k, 0.001)
    np.testing.assert_allclose(term, 0.01 * np.sum(z), rtol=1e-5)
    np.testing.assert_allclose(metrics["router_z_loss"], np.mean(z), rtol=1e-5)
    # hf (default): coef * HF's number; "none" adds nothing but still reports it
    term, metrics = R.router_losses(router, RouterConfig(), e, k, 0.001)
    np.testing.assert_allclose(term, 0.001 * R.load_balancing_loss(router, e), rtol=1e-6)
    assert float(R.router_losses(router, RouterConfig(aux_loss="none"), e, k, 0.001)[0]) == 0.0


def test_aux_loss_groups_are_the_layouts_data_parallel_ranks():
    """The per-rank aux loss's row groups (the trainer passes them in): the mesh axes act_batch maps to."""
    from moevlm_jax.config import load_layout
    from moevlm_jax.parallelism.logical import data_parallel_size

    for name, want in (("fsdp", 8), ("tp", 4), ("cp", 2), ("pp", 8), ("ep", 8)):
        layout = load_layout(name)
        assert data_parallel_size(layout.rules, layout.make_mesh()) == want, name


# ----------------------------------------------------------------------------- expert bias


def test_expert_bias_changes_selection_not_weights():
    p = np.array([[0.5, 0.3, 0.2]], np.float32)
    logits = jnp.asarray(np.log(p))
    bias = jnp.asarray([0.0, 0.0, 0.5])
    _, w, i = R.route(logits, 1, bias=bias)
    assert int(i[0, 0]) == 2 and float(w[0, 0]) == pytest.approx(1.0)  # renormalised over the chosen one
    _, w, i = R.route(logits, 1, bias=bias, norm_topk_prob=False)
    assert float(w[0, 0]) == pytest.approx(0.2)  # the unbiased probability, not 0.7
    _, w, i = R.route(logits, 2, bias=bias)
    assert set(np.asarray(i[0]).tolist()) == {0, 2}
    np.testing.assert_allclose(w[0], p[0, np.asarray(i[0])] / 0.7, rtol=1e-6)
    _, _, i0 = R.route(logits, 2)
    assert set(np.asarray(i0[0]).tolist()) == {0, 1}


def test_expert_bias_in_block_no_gradient_and_unbiased_aux_counts():
    cfg = TextConfig(**TINY_TEXT)
    block = _build(lambda: SparseMoeBlock(cfg, ComputeConfig(dtype="float32", router={"expert_bias": True}),
                                          nnx.Rngs(0)))
    assert isinstance(block.expert_bias, R.ExpertBias) and block.expert_bias.get_metadata()["out_sharding"] == ("exp",)
    block.expert_bias[...] = jnp.asarray([0, 0, 0, 0, 0, 0, 0, 1.0])  # everyone picks expert 7
    x = jax.random.normal(jax.random.key(1), (2, 5, 16))
    valid = jnp.ones((2, 5), bool)
    _, stats = nnx.jit(lambda m: m(x, valid))(block)
    assert float(stats["expert_counts"][:, 7].sum()) == 10.0  # biased selection
    assert float(stats["aux_counts"][:, 7].sum()) < 10.0  # aux losses see the unbiased top-k
    assert float(stats["expert_counts"].sum()) == float(stats["aux_counts"].sum()) == 20.0

    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x, valid)[0] ** 2)))(block)  # default: Params only
    assert not nnx.to_flat_state(nnx.state(grads, R.ExpertBias))
    graphdef, params, bias = nnx.split(block, nnx.Param, R.ExpertBias)
    gb = jax.jit(jax.grad(lambda b: jnp.sum(nnx.merge(graphdef, params, b)(x, valid)[0] ** 2)))(bias)
    assert all(float(jnp.abs(v).max()) == 0.0 for v in jax.tree.leaves(gb))


def test_bias_update_rule_and_stacked_layers():
    b = R.bias_step(jnp.zeros((1, 4)), jnp.asarray([[3.0, 1.0, 2.0, 6.0]]), 0.1)  # mean 3
    np.testing.assert_allclose(b, [[0.0, 0.1, 0.1, -0.1]])  # at the mean: no change
    # a model with a dense layer between MoE stacks: the biases follow the MoE layer order
    config = load_model_config("tiny-v512").replace_text(mlp_only_layers=(1,))
    compute = ComputeConfig(router={"expert_bias": True})
    model = nnx.eval_shape(lambda: Qwen3VLMoe(config, compute, nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(nnx.state(model, R.ExpertBias)))
    assert {p: v.get_value().shape for p, v in flat.items()} == {
        ("language_model", "stacks", 0, "mlp", "expert_bias"): (1, 8),
        ("language_model", "stacks", 2, "mlp", "expert_bias"): (2, 8)}
    assert all(v.get_metadata()["out_sharding"] == ("layers", "exp") for v in flat.values())
    params = {"language_model": {"stacks": {0: {"mlp": {"expert_bias": jnp.zeros((1, 8)), "w": jnp.ones(2)}},
                                            2: {"mlp": {"expert_bias": jnp.zeros((2, 8))}}}}}
    counts = jnp.zeros((3, 2, 8)).at[0, :, 0].set(5.0).at[2, :, 7].set(5.0)  # router stats [L, B, E]
    new = R.update_expert_bias(params, {"expert_counts": counts}, 0.5)
    s = new["language_model"]["stacks"]
    np.testing.assert_allclose(s[0]["mlp"]["expert_bias"][0], [-0.5] + [0.5] * 7)
    np.testing.assert_allclose(s[2]["mlp"]["expert_bias"][0], np.zeros(8))  # layer 1 of the MoE layers: idle
    np.testing.assert_allclose(s[2]["mlp"]["expert_bias"][1], [0.5] * 7 + [-0.5])
    np.testing.assert_array_equal(s[0]["mlp"]["w"], [1, 1])
    with pytest.raises(ValueError, match="MoE layers"):
        R.update_expert_bias(params, counts[:2], 0.5)
    mask = R.exclude_expert_bias(jax.tree.map(lambda _: True, params))
    assert mask["language_model"]["stacks"][0]["mlp"] == {"expert_bias": False, "w": True}


def test_expert_bias_is_state_of_the_train_state_and_not_of_hf_files(tmp_path):
    from moevlm_jax.config import load_layout
    from moevlm_jax.hf import load_pretrained, save_pretrained
    from moevlm_jax.training.config import OptimizerConfig
    from moevlm_jax.training.trainer import Trainer

    config = load_model_config("tiny-v512")
    compute = ComputeConfig(dtype="float32", router={"expert_bias": True})
    trainer = Trainer.create(config, compute, load_layout("fsdp"), OptimizerConfig(), steps=2)
    state = trainer.abstract_state()  # what checkpoints save and restore
    path = ("language_model", "stacks", 0, "mlp", "expert_bias")
    leaf = state["params"]
    for k in path:
        leaf = leaf[k]
    assert leaf.shape == (4, 8) and leaf.dtype == jnp.float32
    assert "expert_bias" not in str(jax.tree_util.tree_flatten_with_path(state["opt_state"])[0])
    assert trainer.trainable_mask["language_model"]["stacks"][0]["mlp"]["expert_bias"] is False
    # HF files have no bias: saving drops it (with a warning when non-zero), loading starts at zero
    model = _build(lambda: Qwen3VLMoe(config, compute, nnx.Rngs(0)))
    R.update_expert_bias(model, jnp.arange(32.0).reshape(4, 8), 0.1)
    save_pretrained(model, config, tmp_path)
    loaded, _ = load_pretrained(tmp_path, compute=compute)
    np.testing.assert_array_equal(loaded.language_model.stacks[0].mlp.expert_bias[...], np.zeros((4, 8)))
    np.testing.assert_array_equal(loaded.language_model.stacks[0].mlp.gate.kernel[...],
                                  model.language_model.stacks[0].mlp.gate.kernel[...])


# ----------------------------------------------------------------------------- load metrics


def test_expert_load_metrics_and_dropped_fraction():
    m = R.expert_load_metrics({"expert_counts": jnp.asarray([[4.0, 0, 0, 0], [1, 1, 1, 1]])}, per_layer=True)
    assert float(m["moe/load_max_over_mean"]) == 2.5 and float(m["moe/load_max_over_mean_worst"]) == 4.0
    assert float(m["moe/load_min_over_mean"]) == 0.5 and float(m["moe/load_max_over_mean/layer_1"]) == 1.0
    cfg = TextConfig(**TINY_TEXT)
    compute = ComputeConfig(dtype="float32", moe={"capacity_factor": 0.5})
    block = _build(lambda: SparseMoeBlock(cfg, compute, nnx.Rngs(0)))
    _, stats = nnx.jit(lambda m, x: m(x, jnp.ones((2, 8), bool)))(block, jax.random.normal(jax.random.key(0), (2, 8,
                                                                                                               16)))
    load = R.load_sums({k: v[None] for k, v in stats.items()})
    frac = float(R.expert_load_metrics(load)["moe/dropped_fraction"])
    assert float(load["assignments"][0]) == 32.0 and 0.4 <= frac < 1.0  # capacity ceil(16*2/8*.5)=2 of 4 avg


# ----------------------------------------------------------------------------- training run


def _skewed_runs(runs: list[tuple[float, int]], seed: int = 0) -> list[list[float]]:
    """A single MoE block trained with Adam on a regression target, its router skewed (a constant
    input feature pushes experts 0 and 1), the expert bias updated each step at ``rate``, for each
    (rate, steps) of ``runs`` from the same start; returns max/mean expert load per step."""
    cfg = TextConfig(**TINY_TEXT)
    block = _build(lambda: SparseMoeBlock(cfg, ComputeConfig(dtype="float32", router={"expert_bias": True}),
                                          nnx.Rngs(seed)), seed)
    kernel = np.random.default_rng(seed + 1).normal(size=(16, 8)).astype(np.float32) * 0.5
    kernel[0] = [3.0, 2.5, 0, 0, 0, 0, 0, 0]
    block.gate.kernel[...] = jnp.asarray(kernel)
    graphdef, params, bias = nnx.split(block, nnx.Param, R.ExpertBias)
    rng = np.random.default_rng(seed)
    w_target = jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float32)
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(params, bias, opt, x, rate):
        def loss_fn(p):
            y, stats = nnx.merge(graphdef, p, bias)(x, jnp.ones(x.shape[:2], bool))
            return jnp.mean((y - jnp.tanh(x @ w_target)) ** 2), stats

        (_, stats), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt = tx.update(g, opt, params)
        load = R.load_sums({k: v[None] for k, v in stats.items()})  # one MoE layer
        bias = R.update_expert_bias(bias, load, rate)
        return optax.apply_updates(params, updates), bias, opt, R.expert_load_metrics(load)["moe/load_max_over_mean"]

    out = []
    for rate, steps in runs:
        p, b, o, ratios = params, bias, opt, []
        for i in range(steps):
            x = np.random.default_rng(100 + i).normal(size=(16, 64, 16)).astype(np.float32) * 0.5
            x[..., 0] = 1.0
            p, b, o, ratio = step(p, b, o, jnp.asarray(x), jnp.float32(rate))
            ratios.append(float(ratio))
        out.append(ratios)
    return out


def test_expert_bias_balances_a_skewed_router():
    """E=8, K=2, 1024 tokens a step: routing starts on experts 0/1 (max/mean load > 3.5, 4 = all on
    two experts); 50 steps of Adam + bias updates at rate 0.0075 bring it under 1.5; without the
    bias (rate 0) it stays above 3."""
    balanced, control = _skewed_runs([(0.0075, 50), (0.0, 20)])
    assert balanced[0] > 3.5, balanced[:3]
    assert np.mean(balanced[-5:]) < 1.5, balanced[-10:]
    assert min(control) > 3.0, control
