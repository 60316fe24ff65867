"""Qwen3.5's Gated DeltaNet layer under context parallelism (8 CPU devices) equals one device, forward
and gradients: the conv window and the recurrent state are carried from one sequence shard to the next
(parallelism.context.SequenceShards, model.gated_deltanet.chunk_gated_delta_rule_carry), never the
sequence gathered. CP 4 x FSDP 2, CP 2 x FSDP 4, and CP 2 x TP 2 (GDN heads over 'tensor', the folded
layout's split); packed rows with samples crossing every shard boundary, samples starting exactly on a
boundary (no carry), a sample ending on one, padding crossing one; chunks of 4 tokens, so a shard holds
several chunks and a chunk never spans two shards.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moevlm_jax.config import load_layout
from moevlm_jax.model import gated_deltanet, qwen3_5_gdn
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.qwen3_5_gdn import GatedDeltaNet
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.parallelism.context import SequenceShards, context_parallel_map, sequence_axes
from moevlm_jax.parallelism.logical import named_sharding, sharding_context
from tests.xla_options import FAST  # LLVM optimisations off: a third of the compile

# quick compiles (tests/xla_options.py): the one-device reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

S = 32
ACT = ("act_batch", "act_seq", "act_embed")
SEG = ("act_batch", "act_seq")
LAYOUTS = {
    "cp4": {"mesh": {"fsdp": 2, "context": 4}, "rules": [["act_batch", "fsdp"], ["act_seq", "context"]]},
    "cp2": {"mesh": {"fsdp": 4, "context": 2}, "rules": [["act_batch", "fsdp"], ["act_seq", "context"]]},
    "cp2_tp2": {"mesh": {"fsdp": 2, "context": 2, "tensor": 2},
                "rules": [["act_batch", "fsdp"], ["act_seq", "context"], ["act_heads", "tensor"],
                          ["q_heads", "tensor"]]},
}


def _segments() -> np.ndarray:
    """Rows of 32 tokens (shard boundaries at 8 / 16 / 24 under CP 4, at 16 under CP 2): samples of
    10 + 22 (crossing every boundary), 8 + 16 + 8 (starting exactly on 8 and 24), 5 + 19 + 8 (the second
    ending on 24), 12 + 14 + 6 padding (padding crossing 24), one sample of 32."""
    rows = [[10, 22], [8, 16, 8], [5, 19, 8], [12, 14], [32], [16, 16], [3, 29], [20, 12]]
    out = np.zeros((len(rows), S), np.int32)
    for r, lengths in enumerate(rows):
        t = 0
        for i, n in enumerate(lengths):
            out[r, t:t + n] = i + 1
            t += n
    return out


@pytest.fixture(scope="module")
def problem():
    cfg = load_model_config("qwen3.5-tiny").text_config  # GDN 2 key / 4 value heads of 16, conv 4
    compute = ComputeConfig(dtype="float32", param_dtype="float32")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: GatedDeltaNet(cfg, compute, nnx.Rngs(0))))
    rng = np.random.default_rng(0)

    def draw(path, v):
        name = jax.tree_util.keystr(path)
        if "A_log" in name:
            return jnp.asarray(rng.uniform(-1.0, 1.0, v.shape).astype(np.float32))
        if "scale" in name:
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(v.shape).astype(np.float32))
        return jnp.asarray(0.3 * rng.standard_normal(v.shape).astype(np.float32))

    params = jax.tree_util.tree_map_with_path(draw, abstract)
    seg = _segments()
    x = rng.standard_normal((seg.shape[0], S, cfg.hidden_size)).astype(np.float32)
    probe = rng.standard_normal(x.shape).astype(np.float32)
    return graphdef, params, jnp.asarray(x), jnp.asarray(seg), jnp.asarray(probe)


def _value_and_grads(graphdef, params, x, seg, probe):
    def loss(params, x):
        out = nnx.merge(graphdef, params)(x, seg)
        return jnp.sum(out * probe), out

    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)


def _run(problem, layout=None):
    graphdef, params, x, seg, probe = problem
    if layout is None:
        return jax.jit(lambda *a: _value_and_grads(graphdef, *a))(params, x, seg, probe), None
    layout = load_layout(layout)
    mesh = layout.make_mesh()

    def sharded(params, x, seg, probe):
        with sharding_context(mesh, layout.rules):
            assert sequence_axes(qwen3_5_gdn.HEADS) == ("context",)
            return _value_and_grads(graphdef, params, x, seg, probe)

    with sharding_context(mesh, layout.rules):
        xs, ss = named_sharding(ACT), named_sharding(SEG)
    args = (params, jax.device_put(x, xs), jax.device_put(seg, ss), jax.device_put(probe, xs))
    compiled = jax.jit(sharded).lower(*args).compile(FAST)
    return compiled(*args), compiled.as_text()


@pytest.fixture(scope="module")
def chunk4():
    """Chunks of 4 tokens (the module constant, read at trace time)."""
    saved = qwen3_5_gdn.GDN_CHUNK_SIZE
    qwen3_5_gdn.GDN_CHUNK_SIZE = 4
    yield
    qwen3_5_gdn.GDN_CHUNK_SIZE = saved


@pytest.fixture(scope="module")
def reference(problem, chunk4):
    return _run(problem)[0]


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_gdn_matches_one_device(problem, reference, chunk4, name):
    ((loss, out), (dparams, dx)), hlo = _run(problem, LAYOUTS[name])
    ((ref_loss, ref_out), (ref_dparams, ref_dx)) = reference
    assert _rel(out, ref_out) < 1e-5
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    assert _rel(dx, ref_dx) < 1e-5
    for (path, g), (_, r) in zip(jax.tree_util.tree_flatten_with_path(dparams)[0],
                                 jax.tree_util.tree_flatten_with_path(ref_dparams)[0]):
        assert _rel(g, r) < 1e-5, jax.tree_util.keystr(path)
    # the recurrence is carried, not the sequence gathered: no all-gather yields an S-long axis; the shards
    # exchange the conv window (collective-permute) and all-gather their (transition, final) states [cp, ...]
    cp = 4 if name == "cp4" else 2
    gathered = [tuple(int(d) for d in g.split(",") if d)
                for g in re.findall(r"= f32\[([0-9,]*)\][^=]*? all-gather(?:-start)?\(", hlo)]
    assert gathered and not [g for g in gathered if S in g], gathered
    assert any(g[0] == cp and len(g) == 5 for g in gathered), gathered
    assert "collective-permute" in hlo


def test_sequence_shards_fold_affine_states():
    """SequenceShards on a 4-shard mesh: from_previous shifts by one shard (zeros first), continues reads
    the boundary ids, incoming_state folds out = P (keep in) + F in shard order."""
    layout = load_layout({"mesh": {"context": 4, "fsdp": 2}, "rules": [["act_seq", "context"],
                                                                      ["act_batch", "fsdp"]]})
    mesh = layout.make_mesh()
    rng = np.random.default_rng(3)
    b, d, e = 2, 3, 2
    p = rng.standard_normal((4, b, d, d)).astype(np.float32) * 0.5
    f = rng.standard_normal((4, b, d, e)).astype(np.float32)
    seg = np.array([[1, 1, 1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 0, 0]], np.int32)  # shards of 2 tokens
    seg = np.concatenate([seg, seg], 0)  # 4 rows: 2 per fsdp rank
    p4, f4 = np.concatenate([p, p], 1), np.concatenate([f, f], 1)  # [4 shards, 4 rows, ...]

    def fn(shards: SequenceShards, seg, p, f):
        keep = shards.continues(seg)
        state = shards.incoming_state(p[:, 0], f[:, 0], keep)  # p, f local: [B, 1, D, D] (shard axis split)
        prev = shards.from_previous(seg[:, -1:])
        return state[:, None], keep[:, None].astype(jnp.int32), prev

    with sharding_context(mesh, layout.rules):
        args = (jnp.asarray(seg), jnp.asarray(np.swapaxes(p4, 0, 1)), jnp.asarray(np.swapaxes(f4, 0, 1)))
        axes = (SEG, ("act_batch", "act_seq", None, None), ("act_batch", "act_seq", None, None))
        state, keep, prev = jax.jit(lambda *a: context_parallel_map(
            fn, a, axes, (("act_batch", "act_seq", None, None), SEG, SEG)))(*args)
    keep, prev = np.asarray(keep), np.asarray(prev)
    # row 0: ids 1 1 | 1 1 | 2 2 | 2 2 -> keep [0, 1, 0, 1]; row 1: 1 1 | 1 1 | 1 1 | 0 0 -> [0, 1, 1, 0]
    np.testing.assert_array_equal(keep[:2], [[0, 1, 0, 1], [0, 1, 1, 0]])
    np.testing.assert_array_equal(prev[:2], [[0, 1, 1, 2], [0, 1, 1, 1]])
    for row in range(2):
        want, incoming = np.zeros((d, e)), []
        for j in range(4):
            want = want * keep[row, j]
            incoming.append(want)
            want = p[j, row] @ want + f[j, row]
        np.testing.assert_allclose(np.asarray(state)[row], np.stack(incoming), rtol=1e-5, atol=1e-6)


def test_carry_terms_equal_a_run_from_the_state():
    """chunk_gated_delta_rule_carry: out0 + S_in^T q_eff and transition S_in + final equal the rule run
    from S_in (packed row: the state reaches the first sample only)."""
    rng = np.random.default_rng(5)
    b, s, hk, hv, dk, dv = 1, 13, 1, 2, 4, 3
    q, k = (rng.standard_normal((b, s, hk, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((b, s, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.05, 1.0, (b, s, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (b, s, hv)).astype(np.float32)
    s_in = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)
    for seg in (None, np.array([[1] * 6 + [2] * 5 + [0] * 2], np.int32)):
        kw = dict(chunk_size=4, segment_ids=seg, use_qk_l2norm=True)
        out0, q_eff, final, trans = gated_deltanet.chunk_gated_delta_rule_carry(q, k, v, g, beta, **kw)
        want_out, want_state = gated_deltanet.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s_in, **kw)
        got = gated_deltanet.apply_incoming_state(out0, q_eff, s_in)
        assert _rel(got, want_out) < 1e-5
        assert _rel(np.einsum("bhde,bhef->bhdf", trans, s_in) + final, want_state) < 1e-5
        if seg is not None:
            assert np.all(np.asarray(trans) == 0) and np.all(np.asarray(q_eff)[0, 6:] == 0)
