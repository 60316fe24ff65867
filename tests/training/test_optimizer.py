"""Optimizer: schedule and AdamW numbers by hand, freezing partition, gradient accumulation."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from moevlm_jax.training import optimizer as optim
from moevlm_jax.training.config import OptimizerConfig


@pytest.mark.parametrize("kind, step, expected", [
    ("cosine", 0, 1e-4), ("cosine", 4, 5e-4), ("cosine", 9, 1e-3), ("cosine", 10, 1e-3),
    ("cosine", 35, 1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi * 0.25))),
    ("cosine", 60, 5.5e-4), ("cosine", 110, 1e-4), ("cosine", 500, 1e-4),
    ("linear", 35, 1e-3 - 9e-4 * 0.25), ("linear", 110, 1e-4),
    ("constant", 0, 1e-4), ("constant", 50, 1e-3),
])
def test_schedule_matches_hand_values(kind, step, expected):
    # lr 1e-3, 10 warmup steps (step s uses lr*(s+1)/10), decay to 1e-4 at step 110
    schedule = optim.lr_schedule(1e-3, warmup_steps=10, decay_steps=110, min_lr_ratio=0.1, kind=kind)
    assert float(schedule(step)) == pytest.approx(expected, rel=1e-5)


def _params() -> dict:
    """A pytree with Qwen3-VL-MoE-like paths."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.normal(size=shape).astype(np.float32))

    return {
        "visual": {"patch_embed": {"kernel": w(6, 4)}, "blocks": {"attn": {"qkv": {"kernel": w(2, 4, 12)}},
                                                                 "norm1": {"scale": w(2, 4)}},
                   "merger": {"linear_fc1": {"kernel": w(16, 16), "bias": w(16)}},
                   "deepstack_merger_list": {0: {"linear_fc2": {"kernel": w(16, 8)}}}},
        "language_model": {"embed_tokens": {"embedding": w(10, 8)},
                           "layers": {"mlp": {"experts": {"gate_up": w(2, 4, 8, 6)}},
                                      "input_layernorm": {"scale": w(2, 8)}}},
        "lm_head": {"kernel": w(8, 10)},
    }


def test_param_groups_and_decay_mask():
    params = _params()
    groups = dict(zip(optim.tree_paths(params), jax.tree.leaves(optim.map_with_path(
        lambda p, _: optim.param_group(p), params))))
    assert groups == {
        "language_model/embed_tokens/embedding": "language_model",
        "language_model/layers/input_layernorm/scale": "language_model",
        "language_model/layers/mlp/experts/gate_up": "language_model",
        "lm_head/kernel": "language_model",
        "visual/blocks/attn/qkv/kernel": "vision_model",
        "visual/blocks/norm1/scale": "vision_model",
        "visual/deepstack_merger_list/0/linear_fc2/kernel": "vision_projection",
        "visual/merger/linear_fc1/bias": "vision_projection",
        "visual/merger/linear_fc1/kernel": "vision_projection",
        "visual/patch_embed/kernel": "vision_model",
    }
    sizes = optim.group_sizes(params)
    assert sizes == {"vision_projection": 16 * 16 + 16 + 16 * 8, "vision_model": 24 + 96 + 8,
                     "language_model": 80 + 384 + 16 + 80}
    mask = dict(zip(optim.tree_paths(params), jax.tree.leaves(optim.decay_mask(params, ["norm", "bias$"]))))
    assert [p for p, m in mask.items() if not m] == [
        "language_model/layers/input_layernorm/scale", "visual/blocks/norm1/scale", "visual/merger/linear_fc1/bias"]


def test_adamw_two_steps_by_hand_with_clipping_and_decay_mask():
    cfg = OptimizerConfig(lr=0.1, warmup_steps=0, schedule="constant", b1=0.9, b2=0.99, eps=1e-8,
                          weight_decay=0.5, clip_grad_norm=1.0, no_decay_patterns=["bias$"])
    tx, _ = optim.make_optimizer(cfg, total_steps=10)
    p = {"kernel": jnp.array([1.0, -2.0]), "bias": jnp.array([3.0])}
    g1 = {"kernel": jnp.array([6.0, 0.0]), "bias": jnp.array([8.0])}  # norm 10 -> clipped to 1
    g2 = {"kernel": jnp.array([0.1, -0.2]), "bias": jnp.array([0.2])}  # norm 0.3 -> unchanged
    state = tx.init(p)
    u1, state = tx.update(g1, state, p)
    p1 = optax.apply_updates(p, u1)
    u2, state = tx.update(g2, state, p1)
    p2 = optax.apply_updates(p1, u2)
    # by hand, in numpy
    b1, b2, eps, lr, wd = 0.9, 0.99, 1e-8, 0.1, 0.5
    P = {k: np.asarray(v, np.float64) for k, v in p.items()}
    G1 = {k: np.asarray(v, np.float64) / 10.0 for k, v in g1.items()}
    G2 = {k: np.asarray(v, np.float64) for k, v in g2.items()}
    for key, decay in (("kernel", wd), ("bias", 0.0)):
        m, v = (1 - b1) * G1[key], (1 - b2) * G1[key] ** 2
        q1 = P[key] - lr * (m / (1 - b1) / (np.sqrt(v / (1 - b2)) + eps) + decay * P[key])
        m, v = b1 * m + (1 - b1) * G2[key], b2 * v + (1 - b2) * G2[key] ** 2
        q2 = q1 - lr * (m / (1 - b1**2) / (np.sqrt(v / (1 - b2**2)) + eps) + decay * q1)
        np.testing.assert_allclose(p1[key], q1, rtol=1e-5)
        np.testing.assert_allclose(p2[key], q2, rtol=1e-5)


def test_state_is_float32_for_bf16_params_and_nonfinite_steps_are_skipped():
    tx, _ = optim.make_optimizer(OptimizerConfig(warmup_steps=0), total_steps=10)
    p = {"w": jnp.ones((3,), jnp.bfloat16)}
    state = tx.init(p)
    assert {x.dtype for x in jax.tree.leaves(state) if x.ndim == 1} == {jnp.dtype(jnp.float32)}
    u, state = tx.update({"w": jnp.full((3,), 0.5, jnp.bfloat16)}, state, p)  # float32 updates: one rounding
    assert u["w"].dtype == jnp.float32 and int(optim.skipped_updates(state)) == 0
    u, state = tx.update({"w": jnp.array([1.0, jnp.nan, 0.0], jnp.bfloat16)}, state, p)
    assert int(optim.skipped_updates(state)) == 1 and not np.any(np.asarray(u["w"], np.float32))


@pytest.mark.parametrize("pass_norm", [False, True])
def test_apply_if_finite_matches_optax_over_finite_nonfinite_and_give_up_steps(pass_norm):
    """The library's apply_if_finite (finiteness from the global gradient norm) against optax.apply_if_finite
    (an isfinite reduction over every gradient) on the same AdamW and steps: a nan, an inf in another leaf, a
    finite step between, then three non-finite in a row with max_consecutive_errors 2 (the third is applied)."""
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    ours, ref = optim.apply_if_finite(inner, 2), optax.apply_if_finite(inner, 2)
    p = {"a": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.arange(4.0)}
    good = lambda s: {"a": jnp.full((2, 3), 0.3 * s), "b": jnp.linspace(-s, s, 4)}
    nan_a = {"a": good(1.0)["a"].at[1, 2].set(jnp.nan), "b": good(1.0)["b"]}
    inf_b = {"a": good(1.0)["a"], "b": good(1.0)["b"].at[0].set(-jnp.inf)}
    steps = [good(1.0), nan_a, good(2.0), inf_b, nan_a, inf_b, good(0.5)]
    s_ours, s_ref, p_ours, p_ref = ours.init(p), ref.init(p), p, p
    applied = []
    for g in steps:
        extra = {"grad_norm": optim.global_norm(g)} if pass_norm else {}
        u_ours, s_ours = ours.update(g, s_ours, p_ours, **extra)
        u_ref, s_ref = ref.update(g, s_ref, p_ref)
        p_ours, p_ref = optax.apply_updates(p_ours, u_ours), optax.apply_updates(p_ref, u_ref)
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), (p_ours, s_ours),
                     (p_ref, s_ref))
        applied.append(any(np.any(np.asarray(x)) for x in jax.tree.leaves(u_ours)))
    # four non-finite steps counted; skipped: the nan, the inf that opens the run of three and the nan after it; the
    # run's third (count 3 > 2, an inf in "b") is given up on and applied ("b" turns nan)
    assert [int(s_ours.total_notfinite), int(s_ours.notfinite_count)] == [4, 0]
    assert applied[:6] == [True, False, True, False, False, True] and not np.all(np.isfinite(np.asarray(p_ours["b"])))


def test_apply_if_finite_counts_a_norm_past_float32_as_nonfinite():
    """Every gradient finite (bf16 holds 1e30) but the sum of their squares past float32: skipped, as said."""
    tx = optim.apply_if_finite(optax.sgd(1.0), 10)
    p = {"w": jnp.zeros((2,), jnp.bfloat16)}
    g = {"w": jnp.array([1e30, 1.0], jnp.bfloat16)}
    u, state = tx.update(g, tx.init(p), p)
    assert bool(np.all(np.isfinite(np.asarray(g["w"], np.float32))))
    assert int(state.total_notfinite) == 1 and not np.any(np.asarray(u["w"], np.float32))


@pytest.mark.parametrize("as_nnx", [False, True])
def test_frozen_parts_get_no_grads_and_no_optimizer_state(as_nnx):
    params = _params()
    if as_nnx:  # an nnx.State of nnx.Param, as nnx.split(model, nnx.Param) returns
        params = nnx.State(jax.tree.map(lambda x: nnx.Param(x), params))
    frozen = optim.frozen_groups(freeze_vision_model=True)
    mask = optim.trainable_mask(params, frozen)
    trainable, fixed = optim.partition(params, mask)
    all_paths = optim.tree_paths(params)
    train_paths = [p for p in all_paths if not p.startswith(("visual/blocks", "visual/patch_embed"))]
    assert optim.tree_paths(trainable) == train_paths
    assert sorted(optim.tree_paths(fixed)) == sorted(set(all_paths) - set(train_paths))

    def loss(tr, fr):
        full = optim.combine(tr, fr)
        return sum(jnp.sum(x ** 2) for x in jax.tree.leaves(full))

    grads = jax.jit(jax.grad(loss))(trainable, fixed)
    assert optim.tree_paths(grads) == train_paths  # no gradient leaves for frozen parameters
    tx, _ = optim.make_optimizer(OptimizerConfig(warmup_steps=0), total_steps=10)
    state = jax.jit(tx.init)(trainable)
    n_train = optim.count_params(trainable)
    # Adam state: mu and nu of the trainable leaves only (plus scalar counters)
    assert sum(x.size for x in jax.tree.leaves(state) if x.ndim > 0) == 2 * n_train
    assert n_train == optim.count_params(params) - (24 + 96 + 8)
    updates, state = jax.jit(tx.update)(grads, state, trainable)
    new = optim.combine(optax.apply_updates(trainable, updates), fixed)
    assert jax.tree.structure(new) == jax.tree.structure(params)
    for path, a, b in zip(all_paths, jax.tree.leaves(params), jax.tree.leaves(new)):
        assert np.array_equal(a, b) == (path not in train_paths), path


def test_bad_group_name():
    with pytest.raises(ValueError, match="unknown parameter groups"):
        optim.trainable_mask(_params(), {"vision"})


def _toy_batch(rows: int = 4, seq: int = 6, dim: int = 3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, seq, dim)).astype(np.float32)
    y = rng.normal(size=(rows, seq)).astype(np.float32)
    mask = np.zeros((rows, seq), np.float32)
    for r, n in enumerate([6, 1, 3, 0][:rows]):  # unequal trained tokens per row
        mask[r, :n] = 1
    pos = np.broadcast_to(np.arange(rows * seq).reshape(1, rows, seq), (3, rows, seq)).copy()
    return {"x": x, "y": y, "loss_mask": mask, "positions": pos}


def _token_loss_sum(w, batch):
    pred = batch["x"] @ w["w"] + w["b"]
    return jnp.sum((pred - batch["y"]) ** 2 * batch["loss_mask"])


def test_accumulation_4x1_equals_one_batch_of_4():
    w = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.3)}
    batch = _toy_batch()
    total = float(batch["loss_mask"].sum())  # trained tokens of the whole global batch: 10
    ref_loss, ref_grads = jax.value_and_grad(lambda p: _token_loss_sum(p, batch) / total)(w)

    micro = optim.split_microbatches(batch, 4)
    assert micro["x"].shape == (4, 1, 6, 3) and micro["positions"].shape == (4, 3, 1, 6)
    np.testing.assert_array_equal(micro["positions"][2, :, 0], batch["positions"][:, 2])

    def loss_fn(p, mb):
        s = _token_loss_sum(p, mb)
        return s / total, {"loss_sum": s, "tokens": jnp.sum(mb["loss_mask"])}

    obj, grads, metrics = jax.jit(lambda p, m: optim.accumulate_gradients(loss_fn, p, m))(w, micro)
    np.testing.assert_allclose(obj, ref_loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["loss_sum"] / metrics["tokens"], ref_loss, rtol=1e-6)
    assert float(metrics["tokens"]) == total
    for k in w:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-6, atol=1e-7)
    # a bfloat16 sum (optimizer.grad_accum_dtype): bf16 gradients within bf16's rounding of four adds
    obj16, grads16, _ = jax.jit(lambda p, m: optim.accumulate_gradients(loss_fn, p, m, accum_dtype=jnp.bfloat16))(w,
                                                                                                                  micro)
    np.testing.assert_allclose(obj16, ref_loss, rtol=1e-6)
    for k in w:
        assert grads16[k].dtype == jnp.bfloat16
        scale = float(np.max(np.abs(ref_grads[k])))
        np.testing.assert_allclose(np.asarray(grads16[k], np.float32), ref_grads[k], rtol=0, atol=4 * 2**-8 * scale)
    # the wrong way (mean of per-microbatch means) gives another gradient on this batch
    per_mb = [jax.grad(lambda p, i=i: _token_loss_sum(p, jax.tree.map(lambda x: x[i], micro))
                       / max(float(micro["loss_mask"][i].sum()), 1.0))(w) for i in range(4)]
    assert not np.allclose(sum(g["w"] for g in per_mb) / 4, ref_grads["w"], rtol=1e-3)


def test_accumulation_sharded_matches_single_device():
    """Microbatches sharded over 8 devices (batch axis), grads constrained replicated == unsharded."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()).reshape(8), ("fsdp",))
    w = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.3)}
    batch = {k: np.concatenate([v] * 4, axis=1 if k == "positions" else 0) for k, v in _toy_batch().items()}
    total = float(batch["loss_mask"].sum())
    micro = optim.split_microbatches(batch, 2)  # [2, 8, ...]: 8 rows per microbatch, one per device
    sharded = {k: jax.device_put(v, NamedSharding(mesh, P(None, None, "fsdp") if k == "positions"
                                                    else P(None, "fsdp"))) for k, v in micro.items()}
    repl = jax.tree.map(lambda _: NamedSharding(mesh, P()), w)

    def loss_fn(p, mb):
        return _token_loss_sum(p, mb) / total, {}

    step = jax.jit(lambda p, m: optim.accumulate_gradients(loss_fn, p, m, grad_shardings=repl))
    obj, grads, _ = step(w, sharded)
    ref_loss, ref_grads = jax.value_and_grad(lambda p: _token_loss_sum(p, batch) / total)(w)
    np.testing.assert_allclose(obj, ref_loss, rtol=1e-5)
    for k in w:
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("state_dtype", ["bfloat16", "float32"])
def test_one_microbatch_in_the_parameter_dtype_updates_like_the_float32_copy(state_dtype):
    """single_dtype=None (one microbatch on one device: the trainer's choice) leaves bf16 gradients bf16,
    with the float32 path's values; AdamW (clipping, weight decay, skipping) then updates the bf16
    parameters bitwise like it does from the float32 copy, for bf16 and float32 optimizer state, and its
    updates are as wide as the state (float32 state: float32 updates, one rounding of the sum)."""
    rng = np.random.default_rng(3)
    w = {"w": jnp.asarray(rng.normal(size=(3,)), jnp.bfloat16), "b": jnp.asarray(0.3, jnp.bfloat16)}
    micro = optim.split_microbatches(_toy_batch(), 1)

    def loss_fn(p, mb):
        return _token_loss_sum(jax.tree.map(lambda x: x.astype(jnp.float32), p), mb) / 10.0, {}

    cfg = OptimizerConfig(warmup_steps=0, lr=1e-2, weight_decay=0.1, clip_grad_norm=0.5, state_dtype=state_dtype)
    tx, _ = optim.make_optimizer(cfg, total_steps=10)

    def step(single_dtype):
        def run(p, m):
            _, grads, _ = optim.accumulate_gradients(loss_fn, p, m, single_dtype=single_dtype)
            updates, _ = tx.update(grads, tx.init(p), p)
            return grads, updates, optax.apply_updates(p, updates)
        return jax.jit(run)(w, micro)

    g32, u32, p32 = step(jnp.float32)
    g16, u16, p16 = step(None)
    wide = jnp.dtype(state_dtype)
    for k in w:
        assert g32[k].dtype == jnp.float32 and g16[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(g16[k], np.float32), np.asarray(g32[k]))
        assert u32[k].dtype == jnp.float32 and u16[k].dtype == wide
        np.testing.assert_array_equal(np.asarray(u16[k], np.float32), np.asarray(u32[k]))
        assert p16[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(p16[k], np.float32), np.asarray(p32[k], np.float32))
        assert not np.array_equal(np.asarray(p16[k], np.float32), np.asarray(w[k], np.float32))  # it moved


def test_global_norm_summed_per_layer_is_the_same_norm():
    """A leaf summed as its slices along axis 0 (an unrolled stack's per-layer gradients) gives the norm of the
    whole leaf, float32 squares either way; piece counts that do not match the leaves are refused."""
    rng = np.random.default_rng(0)
    g = {"stack": jnp.asarray(rng.normal(size=(4, 8, 16)), jnp.bfloat16), "head": jnp.asarray(rng.normal(size=(16, 8)))}
    want = np.sqrt(sum(np.sum(np.square(np.asarray(x, np.float64))) for x in g.values()))
    whole = optim.global_norm(g)
    split = optim.global_norm(g, {"stack": 4, "head": 1})
    np.testing.assert_allclose(float(whole), want, rtol=1e-6)
    np.testing.assert_allclose(float(split), want, rtol=1e-6)
    with pytest.raises(ValueError, match="piece counts"):
        optim.global_norm(g, {"stack": 4})


@pytest.mark.parametrize("scan", [True, False])
def test_the_trainers_norm_pieces_are_the_unrolled_stacks_layers(scan):
    """The train step sums an unrolled stack's gradient per layer (its leaves' layer counts), nothing else."""
    from moevlm_jax.config import load_layout
    from moevlm_jax.model.compute import ComputeConfig
    from moevlm_jax.model.registry import load_model_config
    from moevlm_jax.parallelism.sharding import path_str
    from moevlm_jax.training import trainer as trainer_mod

    model = load_model_config("tiny")
    tr = trainer_mod.Trainer.create(model, ComputeConfig.from_dict({"scan_layers": scan}), load_layout("fsdp"),
                                    OptimizerConfig(), steps=2, devices=jax.devices()[:1])
    pieces = {path_str(kp): n for kp, n in jax.tree_util.tree_flatten_with_path(trainer_mod._norm_pieces(tr.spec))[0]}
    stacked = {p: n for p, n in pieces.items() if n > 1}
    if scan:
        assert not stacked
        return
    decoder = {p for p in pieces if p.startswith("language_model/stacks/")}  # one stack per layer kind
    vision = {p for p in pieces if p.startswith("visual/blocks/")}
    assert decoder and vision and set(stacked) == decoder | vision
    per_stack = {p.split("/")[2]: stacked[p] for p in decoder}
    assert sum(per_stack.values()) == model.text_config.num_hidden_layers
    assert {stacked[p] for p in vision} == {model.vision_config.depth}


def test_clipping_takes_the_callers_norm():
    """The trainer passes its logged gradient norm to the clipping (``grad_norm=``, read once): the same updates as
    the norm computed inside (float32 squares), which is optax's clip up to its bf16 squares; another norm passed
    scales by it."""
    cfg = OptimizerConfig(lr=0.1, warmup_steps=0, schedule="constant", weight_decay=0.0, clip_grad_norm=1.0)
    tx, _ = optim.make_optimizer(cfg, total_steps=10)
    p = {"a": jnp.array([1.0, -2.0], jnp.bfloat16), "b": jnp.array([3.0], jnp.bfloat16)}
    g = {"a": jnp.array([6.0, 0.0], jnp.bfloat16), "b": jnp.array([8.0], jnp.bfloat16)}  # norm 10
    norm = optim.global_norm(g)
    assert norm.dtype == jnp.float32 and float(norm) == 10.0
    inside = tx.update(g, tx.init(p), p)[0]
    passed = tx.update(g, tx.init(p), p, grad_norm=norm)[0]
    for k in p:
        np.testing.assert_array_equal(np.asarray(inside[k], np.float32), np.asarray(passed[k], np.float32))
    clip = optim.clip_by_global_norm(1.0)
    want = optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0]
    got = clip.update(g, clip.init(p))[0]
    halved = clip.update(g, clip.init(p), grad_norm=jnp.float32(20.0))[0]
    for k in p:
        np.testing.assert_allclose(np.asarray(got[k], np.float32), np.asarray(g[k], np.float32) / 10.0, rtol=4e-3)
        np.testing.assert_allclose(np.asarray(got[k], np.float32), np.asarray(want[k], np.float32), rtol=8e-3)
        np.testing.assert_allclose(np.asarray(halved[k], np.float32), np.asarray(g[k], np.float32) / 20.0, rtol=4e-3)
    small = clip.update(g, clip.init(p), grad_norm=jnp.float32(0.5))[0]  # below the threshold: unchanged
    for k in p:
        np.testing.assert_array_equal(np.asarray(small[k]), np.asarray(g[k]))
