"""Token permutation, capacity dropping and the single-device experts against dense references."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.parallelism import permute
from moevlm_jax.parallelism.experts import experts_forward, experts_forward_with_stats
from moevlm_jax.parallelism.hybrid import hybrid_slots
from moevlm_jax.parallelism.kernels import KernelsConfig
from moevlm_jax.parallelism.permute import CHECKPOINT_NAMES, expert_capacity, route_plan
from tests.parallelism.moe_reference import (
    assert_close,
    dense_reference,
    make_problem,
    value_and_grads,
)
from tests.xla_options import FAST

# quick compiles (tests/xla_options.py): the dense references compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

# Six tokens, top-2 of three experts, capacity 2 per expert (capacity_factor 0.5: ceil(12/3*0.5)).
HAND_IDX = np.array([[0, 1], [0, 2], [1, 0], [0, 1], [2, 0], [1, 2]], np.int32)
HAND_W = np.array([[0.6, 0.4], [0.7, 0.3], [0.55, 0.45], [0.9, 0.1], [0.8, 0.2], [0.5, 0.5]], np.float32)
# expert 0 gets tokens 0 (.6), 1 (.7), 2 (.45), 3 (.9), 4 (.2); expert 1: 0 (.4), 2 (.55), 3 (.1),
# 5 (.5); expert 2: 1 (.3), 4 (.8), 5 (.5).
HAND_KEEP = {
    # earliest two tokens of each expert: e0 {0, 1}, e1 {0, 2}, e2 {1, 4}
    "position": np.array([[1, 1], [1, 1], [1, 0], [0, 0], [1, 0], [0, 0]], bool),
    # two highest weights: e0 {3 (.9), 1 (.7)}, e1 {2 (.55), 5 (.5)}, e2 {4 (.8), 5 (.5)}
    "probs": np.array([[0, 0], [1, 0], [1, 0], [1, 0], [1, 0], [1, 1]], bool),
}


@pytest.mark.parametrize("policy", ["position", "probs"])
def test_route_plan_drops_by_hand(policy):
    plan = route_plan(jnp.asarray(HAND_IDX), jnp.asarray(HAND_W), 3, capacity=2, drop_policy=policy)
    kept = np.asarray(plan.expert).reshape(6, 2) < 3
    np.testing.assert_array_equal(kept, HAND_KEEP[policy])
    np.testing.assert_array_equal(np.asarray(plan.counts), [2, 2, 2])
    assert int(plan.dropped) == 6


def test_route_plan_ranks_without_capacity():
    plan = route_plan(jnp.asarray(HAND_IDX), jnp.asarray(HAND_W), 4)
    np.testing.assert_array_equal(np.asarray(plan.counts), [5, 4, 3, 0])
    # rank = order of the token among the expert's tokens
    np.testing.assert_array_equal(np.asarray(plan.rank).reshape(6, 2), [[0, 0], [1, 0], [1, 2], [3, 2], [1, 4], [3, 2]])
    assert int(plan.dropped) == 0


def test_dropless_route_plan_sorts_on_one_key_in_token_order():
    """The dropless plan's sort has one int32 key (expert) and a value, stable: the form XLA:GPU hands to CUB's radix
    sort. Each expert's assignments keep token order: ranks equal numpy's stable argsort's, on many ties."""
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 6, (300, 2)).astype(np.int32)  # ~100 assignments an expert
    idx[:, 1] = (idx[:, 0] + 1 + rng.integers(0, 5, 300)) % 6  # two distinct experts a token
    w = jnp.asarray(rng.random((300, 2)), jnp.float32)
    sorts = [e for e in jax.make_jaxpr(lambda i, w: route_plan(i, w, 6).rank)(jnp.asarray(idx), w).eqns
             if e.primitive.name == "sort"]
    assert len(sorts) == 1 and sorts[0].params["num_keys"] == 1 and sorts[0].params["is_stable"]
    plan = route_plan(jnp.asarray(idx), w, 6)
    flat = idx.reshape(-1)
    order = np.argsort(flat, kind="stable")
    want = np.empty_like(flat)
    for e in range(6):
        members = order[flat[order] == e]
        want[members] = np.arange(len(members))
    np.testing.assert_array_equal(np.asarray(plan.rank), want)
    np.testing.assert_array_equal(np.asarray(plan.counts), np.bincount(flat, minlength=6))


def test_expert_capacity_is_megatrons_formula():
    assert expert_capacity(16384, 8, 128, 1.0) == 1024
    assert expert_capacity(6, 2, 3, 0.5) == 2
    assert expert_capacity(10, 1, 4, 1.1) == 3  # ceil(2.75)


@pytest.mark.parametrize("backend", ["capacity", "ragged_dot", "dense", "triton"])
@pytest.mark.parametrize("policy", ["position", "probs"])
def test_capacity_dropping_matches_hand_computation(backend, policy):
    _, _, _, w_gate_up, w_down = make_problem(seed=3, t=6, h=8, e=3, i=4, k=2)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((6, 8), np.float32))
    idx, w = jnp.asarray(HAND_IDX), jnp.asarray(HAND_W)
    opts = dict(backend=backend, capacity_factor=0.5, drop_policy=policy)
    out, stats = jax.jit(lambda *a: experts_forward_with_stats(*a, **opts))(x, idx, w, w_gate_up, w_down)
    assert int(stats["dropped"]) == 6 and int(stats["assignments"]) == 12
    keep = jnp.asarray(HAND_KEEP[policy])
    got = value_and_grads(lambda *a: experts_forward(*a, **opts), x, idx, w, w_gate_up, w_down)
    want = value_and_grads(lambda *a: dense_reference(*a, keep=keep), x, idx, w, w_gate_up, w_down)
    assert_close(out, want[0], what="forward")
    assert_close(got[0], want[0], what="forward")
    assert_close(got[1], want[1], what=f"{backend}/{policy}")


@pytest.mark.parametrize("routing", ["random", "one", "skewed"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 8.0])
def test_hybrid_is_dropless_and_matches_dense_reference(factor, routing):
    """backend 'hybrid': the padded einsum up to the capacity, the grouped matmul past it (factor
    0.5: most assignments overflow; 8.0: none do); every assignment computed, nothing dropped."""
    x, idx, w, w_gate_up, w_down = make_problem(seed=1, routing=routing)
    opts = dict(backend="hybrid", capacity_factor=factor)
    _, stats = jax.jit(lambda *a: experts_forward_with_stats(*a, **opts))(x, idx, w, w_gate_up, w_down)
    assert int(stats["dropped"]) == 0
    got = value_and_grads(lambda *a: experts_forward(*a, **opts), x, idx, w, w_gate_up, w_down)
    want = value_and_grads(dense_reference, x, idx, w, w_gate_up, w_down)
    assert_close(got[0], want[0], what=f"hybrid {factor}/{routing} forward")
    assert_close(got[1], want[1], what=f"hybrid {factor}/{routing}")
    if routing == "one" and factor < 4:  # every first choice is expert 0: its 64 assignments overflow
        counts = np.bincount(np.asarray(idx).ravel(), minlength=w_gate_up.shape[0])
        assert counts.max() > expert_capacity(x.shape[0], idx.shape[1], w_gate_up.shape[0], factor)


@pytest.mark.parametrize(("routing", "factor", "overflow", "overflowed", "fits"), [
    ("random", 1.0, 0.25, 10, True),  # 10 overflow rows in the 32-row static buffer: the hybrid branch
    ("random", 0.5, 0.25, 64, False),  # 64 > 32: the grouped matmul on all rows
    ("one", 1.0, 0.25, 48, False),
    ("skewed", 1.0, 1.0, 80, True),  # the buffer holds all 128 assignments: no branch at all
])
def test_hybrid_overflow_buffer_or_grouped_fallback(routing, factor, overflow, overflowed, fits):
    """The 'hybrid' overflow buffer has ``hybrid_overflow`` x A static rows (A = 128 here: 32 at 0.25);
    a batch whose overflow exceeds it takes the plain grouped matmul. Both branches equal the
    dense reference, forward and gradients, and nothing drops."""
    x, idx, w, w_gate_up, w_down = make_problem(seed=1, routing=routing)
    lay = hybrid_slots(idx, w, w_gate_up.shape[0], factor, overflow)
    assert lay.over_rows == math.ceil(idx.size * overflow / 8) * 8
    assert int(jnp.sum(lay.over_counts)) == overflowed and bool(lay.fits) == fits
    counts = np.bincount(np.asarray(idx).ravel(), minlength=w_gate_up.shape[0])  # hand count of the overflow
    assert int(np.maximum(counts - lay.cap, 0).sum()) == overflowed
    opts = dict(backend="hybrid", capacity_factor=factor, hybrid_overflow=overflow)
    jaxpr = str(jax.make_jaxpr(lambda *a: experts_forward(*a, **opts))(x, idx, w, w_gate_up, w_down))
    assert ("cond[" in jaxpr) == (overflow < 1.0)
    got = value_and_grads(lambda *a: experts_forward(*a, **opts), x, idx, w, w_gate_up, w_down)
    want = value_and_grads(dense_reference, x, idx, w, w_gate_up, w_down)
    assert_close(got[0], want[0], what=f"hybrid {routing}/{factor}/{overflow} forward")
    assert_close(got[1], want[1], what=f"hybrid {routing}/{factor}/{overflow}")


@pytest.mark.parametrize("routing", ["random", "one", "skewed"])
@pytest.mark.parametrize("backend", ["ragged_dot", "dense", "capacity", "triton"])
def test_local_experts_match_dense_reference(backend, routing):
    x, idx, w, w_gate_up, w_down = make_problem(seed=1, routing=routing)
    # capacity 8x the mean load is T*K: nothing can drop, so drop-and-pad must equal dropless
    opts = dict(backend=backend, capacity_factor=8.0 if backend == "capacity" else None)
    got = value_and_grads(lambda *a: experts_forward(*a, **opts), x, idx, w, w_gate_up, w_down)
    want = value_and_grads(dense_reference, x, idx, w, w_gate_up, w_down)
    assert_close(got[0], want[0], what=f"{backend}/{routing} forward")
    assert_close(got[1], want[1], what=f"{backend}/{routing}")


def test_dispatch_backward_and_combine_are_float32_sums_rounded_once():
    """dispatch_rows' backward (each token's K gathered gradient rows summed) and combine_rows (K rows times
    their weights summed) add in float32 and round once: in bf16 they equal the float64 sums rounded to bf16,
    dropped assignments (slot -1) and empty buffer rows (src -1) adding nothing."""
    rng = np.random.default_rng(0)
    t, k, h, s = 12, 4, 16, 56
    slot = rng.permutation(s)[: t * k].astype(np.int32)
    slot[[3, 10, 25]] = -1  # dropped
    src = np.full(s, -1, np.int32)
    src[slot[slot >= 0]] = np.flatnonzero(slot >= 0)
    g = rng.normal(size=(s, h)).astype(np.float32)
    y = rng.normal(size=(s, h)).astype(np.float32)
    w = rng.uniform(size=(t, k)).astype(np.float32)
    bf = lambda a: jnp.asarray(a, jnp.bfloat16)  # noqa: E731
    g16, y16, w16 = (np.asarray(bf(a), np.float64) for a in (g, y, w))
    rows = np.where((slot >= 0)[:, None], g16[np.maximum(slot, 0)], 0.0).reshape(t, k, h)
    _, vjp = jax.vjp(lambda x: permute.dispatch_rows(x, jnp.asarray(src), jnp.asarray(slot), k), bf(np.zeros((t, h))))
    (dx,) = jax.jit(vjp)(bf(g))
    assert dx.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(bf(rows.sum(axis=1)), np.float32))
    out = jax.jit(permute.combine_rows)(bf(y), bf(w), jnp.asarray(slot), jnp.asarray(src))
    rows = np.where((slot >= 0)[:, None], y16[np.maximum(slot, 0)], 0.0).reshape(t, k, h)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(bf((rows * w16[:, :, None]).sum(axis=1)), np.float32))


def test_gate_up_accepts_split_layout():
    x, idx, w, w_gate_up, w_down = make_problem(seed=2)
    e, h, two_i = w_gate_up.shape
    split = w_gate_up.reshape(e, h, 2, two_i // 2)
    got = jax.jit(experts_forward)(x, idx, w, split, w_down)
    assert_close(got, dense_reference(x, idx, w, w_gate_up, w_down))


def test_bfloat16_inputs_keep_dtype_and_agree():
    x, idx, w, w_gate_up, w_down = make_problem(seed=4)
    out = jax.jit(experts_forward)(x.astype(jnp.bfloat16), idx, w, w_gate_up, w_down)
    assert out.dtype == jnp.bfloat16
    want = dense_reference(x, idx, w, w_gate_up, w_down)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=0.05, rtol=0.05)


def test_remat_names_are_on_the_expert_activations():
    x, idx, w, w_gate_up, w_down = make_problem()
    text = str(jax.make_jaxpr(lambda *a: experts_forward(*a))(x, idx, w, w_gate_up, w_down))
    for name in CHECKPOINT_NAMES:
        assert f"name={name}" in text
    policy = jax.checkpoint_policies.save_only_these_names("moe_act")
    f = jax.checkpoint(lambda *a: experts_forward(*a), policy=policy)
    got = value_and_grads(f, x, idx, w, w_gate_up, w_down)
    assert_close(got[1], value_and_grads(dense_reference, x, idx, w, w_gate_up, w_down)[1])


FUSIONS = [(), ("gather",)]  # the fusions that apply on CPU (the mgpu_* ones need Hopper: test_gmm_mgpu.py)


def _triton(fuse=("gather",), **opts):
    """experts_forward on the Triton backend with the fusions ``fuse`` (compute.moe.kernels.fusions)."""
    return lambda *a: experts_forward(*a, backend="triton", kernels=KernelsConfig(fusions=fuse), **opts)


def _kernels(fn, *args, policy=None):
    """The Pallas kernels (by name, with their count) in the jaxpr of fn's gradient, and the jaxpr's text."""
    f = fn if policy is None else jax.checkpoint(fn, policy=policy)
    text = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 2, 3, 4)))(*args))
    names = re.findall(r"name=((?:t?gmm)\w*)", text)
    return {n: names.count(n) for n in names}, text


def _compiled_kernels(fn, args, policy):
    """Kernel name -> count of its loops in the compiled gradient (interpret mode: each Pallas kernel is a while
    loop named after it; XLA has dropped the recomputations whose results nothing uses)."""
    f = fn if policy is None else jax.checkpoint(fn, policy=policy)
    step = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)), argnums=(0, 2, 3, 4)), compiler_options=FAST)
    hlo = step.lower(*args).compile().as_text()
    names = re.findall(r"= .*\bwhile\(.*op_name=\"[^\"]*/((?:t?gmm)\w*)/", hlo)
    return {n: names.count(n) for n in names}


def _expected_kernels(fuse):
    return {"gmm_gather" if "gather" in fuse else "gmm", "gmm", "gmm_trans", "tgmm"}


@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_fused_triton_experts_match_dense_reference(routing):
    """The Triton experts with each set of fusions (compute.moe.kernels.fusions): output and every gradient against
    the dense float32 reference; 'skewed' routing leaves half the experts empty and the groups uneven."""
    x, idx, w, w_gate_up, w_down = make_problem(seed=5, routing=routing)
    want = value_and_grads(dense_reference, x, idx, w, w_gate_up, w_down)
    for fuse in FUSIONS:
        fn = _triton(fuse)
        assert set(_kernels(fn, x, idx, w, w_gate_up, w_down)[0]) == _expected_kernels(fuse), fuse
        got = value_and_grads(fn, x, idx, w, w_gate_up, w_down)
        assert_close(got[0], want[0], what=f"fuse {fuse} forward")
        assert_close(got[1], want[1], what=f"fuse {fuse}")


def test_default_gather_fusion_gives_way_to_the_mosaic_forward(monkeypatch):
    """The default kernels: the gate_up forward fuses the row gather (Triton) unless it runs on the Mosaic-GPU
    kernel (grouped_matmul.mgpu_takes), then the rows are gathered first; with "fwd" dropped from
    compute.moe.kernels.mosaic_gpu the gather is fused again."""
    x, idx, w, w_gate_up, w_down = make_problem(seed=5)
    monkeypatch.setattr(permute, "mgpu_takes",  # a Hopper GPU that takes every shape, as the kernels choose
                        lambda kind, m, k, n, dtype, kernels: kind == "fwd" and kind in kernels.mosaic_gpu)
    for kernels, fused in ((KernelsConfig(), False), (KernelsConfig(mosaic_gpu=("dx", "dw")), True)):
        fn = lambda *a, kernels=kernels: experts_forward(*a, backend="triton", kernels=kernels)  # noqa: E731
        got = set(_kernels(fn, x, idx, w, w_gate_up, w_down)[0])
        assert got == _expected_kernels(("gather",) if fused else ()), (kernels.mosaic_gpu, got)
    monkeypatch.setattr(permute, "mgpu_takes", lambda *a: False)  # e.g. not on Hopper: the fusion as before
    fn = lambda *a: experts_forward(*a, backend="triton")  # noqa: E731
    assert set(_kernels(fn, x, idx, w, w_gate_up, w_down)[0]) == _expected_kernels(("gather",))


def test_fused_triton_experts_with_drops_and_in_bfloat16():
    """Rows past the kept assignments (a capacity drops: the sorted buffer has padding rows the kernels leave
    unwritten) and bfloat16: the fused layer equals the unfused Triton layer."""
    x, idx, w, w_gate_up, w_down = make_problem(seed=6, routing="skewed")
    for dtype, opts, tol in ((jnp.float32, dict(capacity_factor=0.5), 2e-5), (jnp.bfloat16, {}, 2e-2)):
        args = (x.astype(dtype), idx, w.astype(dtype), w_gate_up.astype(dtype), w_down.astype(dtype))
        want = None
        for fuse in FUSIONS:
            out, grads = value_and_grads(_triton(fuse, **opts), *args)
            got = [np.asarray(a, np.float32) for a in (out, *grads)]
            want = want or got  # the unfused layer's
            for name, a, b in zip(("out", "d_x", "d_w", "d_w_gate_up", "d_w_down"), got, want):
                assert np.isfinite(a).all(), name
                assert np.linalg.norm(a - b) <= tol * np.linalg.norm(b), f"{jnp.dtype(dtype).name} {opts} {fuse} {name}"


def test_fused_triton_experts_under_remat_policies():
    """Every remat name is still placed with the "gather" fusion (moe_permuted: the rows the gate_up kernel
    writes); a policy that saves them all runs no kernel twice; the gradients are right whether the policy saves
    one name or all of them."""
    x, idx, w, w_gate_up, w_down = make_problem(seed=7)
    fn = _triton(("gather",))
    _, text = _kernels(fn, x, idx, w, w_gate_up, w_down)
    for name in CHECKPOINT_NAMES:
        assert f"name={name}" in text
    save_all = jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES)
    args = (x, idx, w, w_gate_up, w_down)
    plain = _compiled_kernels(fn, args, None)
    assert any(name.startswith("gmm_gather") for name in plain), plain
    assert _compiled_kernels(fn, args, save_all) == plain
    want = value_and_grads(dense_reference, x, idx, w, w_gate_up, w_down)[1]
    for names in (("moe_act",), CHECKPOINT_NAMES):
        f = jax.checkpoint(fn, policy=jax.checkpoint_policies.save_only_these_names(*names))
        assert_close(value_and_grads(f, x, idx, w, w_gate_up, w_down)[1], want, what=f"saving {names}")


def test_option_errors_name_the_problem():
    x, idx, w, w_gate_up, w_down = make_problem()
    cases = [
        (dict(backend="capacity"), "needs capacity_factor"),
        (dict(backend="hybrid"), "needs capacity_factor"),
        (dict(capacity_factor=0.0), "capacity_factor must be"),
        (dict(backend="hybrid", capacity_factor=1.0, hybrid_overflow=0), "hybrid_overflow must be > 0"),
        (dict(drop_policy="random"), "drop_policy must be"),
        (dict(dispatcher="alltoall"), "needs expert parallelism"),
        (dict(backend="cutlass"), "unknown grouped-matmul backend"),
        (dict(capacity=2), "unknown options"),
        (dict(kernels={"fusions": ["swiglu"]}), "'swiglu' was removed"),
        (dict(kernels={"permute_kernels": ["dispatc"]}), "did you mean 'dispatch'"),
    ]
    for opts, message in cases:
        with pytest.raises(ValueError, match=message):
            experts_forward(x, idx, w, w_gate_up, w_down, **opts)
    with pytest.raises(ValueError, match=r"w_gate_up must be \[E=8, H=16, 2I=16\]"):
        experts_forward(x, idx, w, w_gate_up[:, :, :10], w_down)


def _poisoned_gmm(gmm, fill=float("nan")):
    """gmm_triton.gmm whose outputs' rows past sum(group_sizes) are ``fill`` (NaN, or a huge value), as
    uninitialised GPU memory may be (the interpret mode on CPU starts its output buffers at zero)."""
    def run(x, w, group_sizes, *args, **kwargs):
        out = gmm(x, w, group_sizes, *args, **kwargs)
        m = kwargs["rows"].shape[0] if kwargs.get("rows") is not None else x.shape[0]
        rows = jnp.arange(m)[:, None] < jnp.sum(group_sizes)
        poison = lambda a: jnp.where(rows, a, fill).astype(a.dtype) if a.shape[0] == m else a  # noqa: E731
        return tuple(poison(a) for a in out) if isinstance(out, tuple) else poison(out)
    return run


@pytest.mark.parametrize("fuse", FUSIONS)
def test_sorted_experts_never_read_the_unwritten_rows(monkeypatch, fuse):
    """The sorted experts leave the expert matmuls' rows past the kept assignments unwritten (no masking pass):
    with a capacity that drops, those rows made NaN in every kernel output, the layer's output and all its
    gradients still equal the dense reference with the same drops."""
    monkeypatch.setattr(permute.gmm_triton, "gmm", _poisoned_gmm(permute.gmm_triton.gmm))
    _, _, _, w_gate_up, w_down = make_problem(seed=3, t=6, h=8, e=3, i=4, k=2)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((6, 8), np.float32))
    idx, w = jnp.asarray(HAND_IDX), jnp.asarray(HAND_W)
    opts = dict(backend="triton", capacity_factor=0.5, drop_policy="position", kernels=KernelsConfig(fusions=fuse))
    got = value_and_grads(lambda *a: experts_forward(*a, **opts), x, idx, w, w_gate_up, w_down)
    want = value_and_grads(lambda *a: dense_reference(*a, keep=jnp.asarray(HAND_KEEP["position"])),
                           x, idx, w, w_gate_up, w_down)
    for a in jax.tree.leaves(got):
        assert np.isfinite(np.asarray(a)).all()
    assert_close(got[0], want[0], what="forward")
    assert_close(got[1], want[1], what=f"grads, fuse {fuse}")


def test_fp8_experts_zero_the_unwritten_rows(monkeypatch):
    """Under a per-tensor FP8 recipe the operands' scales are maxima over every row: the sorted experts zero the
    unwritten rows there (1e30 in every kernel output here: NaN would not show it on XLA:CPU, whose max skips NaN,
    and a NaN maximum gives scale 1), and the layer equals the unpoisoned one."""
    from moevlm_jax.parallelism import fp8

    _, _, _, w_gate_up, w_down = make_problem(seed=3, t=6, h=8, e=3, i=4, k=2)
    x = jnp.asarray(np.random.default_rng(7).standard_normal((6, 8), np.float32))
    idx, w = jnp.asarray(HAND_IDX), jnp.asarray(HAND_W)
    cfg = fp8.Fp8Config(recipe="tensor")
    opts = dict(backend="triton", capacity_factor=0.5, drop_policy="position", fp8_config=cfg,
                kernels=KernelsConfig(fusions=()))
    want = value_and_grads(lambda *a: experts_forward(*a, **opts), x, idx, w, w_gate_up, w_down)
    monkeypatch.setattr(permute.gmm_triton, "gmm", _poisoned_gmm(permute.gmm_triton.gmm, 1e30))
    got = value_and_grads(lambda *a: experts_forward(*a, **opts), x, idx, w, w_gate_up, w_down)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.isfinite(np.asarray(a)).all()
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_route_plan_id_e_is_neither_kept_nor_dropped():
    e = 4
    idx = jnp.asarray([[0, 1], [e, e], [0, 1], [e, e]], jnp.int32)
    w = jnp.full((4, 2), 0.5, jnp.float32)
    plan = route_plan(idx, w, e)
    assert plan.counts.tolist() == [2, 2, 0, 0] and int(plan.dropped) == 0
    assert permute.sorted_slots(plan).tolist() == [0, 2, -1, -1, 1, 3, -1, -1]
    tight = route_plan(idx, w, e, capacity=1)  # one of each expert's two valid assignments dropped, no more
    assert tight.counts.tolist() == [1, 1, 0, 0] and int(tight.dropped) == 2
    assert (np.asarray(tight.expert)[[2, 3, 6, 7]] == e).all()
