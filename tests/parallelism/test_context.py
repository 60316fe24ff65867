"""Context-parallel attention on 8 CPU devices equals single-device attention (forward and
gradients), causal and bidirectional, with packed samples and padding crossing the sequence-shard
boundaries; the all-gathered variant holds [S/cp, S] score blocks, the ring variant [S/cp, S/cp]."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.model.attention import dot_product_attention
from moevlm_jax.parallelism.context import sequence_axes
from moevlm_jax.parallelism.layout import LayoutOptions
from moevlm_jax.parallelism.logical import named_sharding, sharding_context
from tests.xla_options import FAST  # LLVM optimisations off: a third of the compile

# quick compiles (tests/xla_options.py): the single-device reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

B, S, N, K, D = 4, 32, 4, 2, 16
Q_AXES = ("act_batch", "act_seq", "act_heads", "act_head_dim")
KV_AXES = ("act_batch", "act_seq", "act_kv_heads", "act_head_dim")
LAYOUTS = {
    "cp4": {"mesh": {"fsdp": 2, "context": 4}, "rules": [["act_batch", "fsdp"], ["act_seq", "context"]]},
    # CP x TP (the folded layout's attention): heads over 'tensor' too
    "cp2_tp2": {"mesh": {"fsdp": 2, "context": 2, "tensor": 2},
                "rules": [["act_batch", "fsdp"], ["act_seq", "context"], ["act_heads", "tensor"],
                          ["act_kv_heads", "tensor"]]},
}


def _segments() -> np.ndarray:
    """Packed rows: samples of 10/22, 5/19/8 tokens, one with 6 padding tokens, one whole row."""
    rows = [[1] * 10 + [2] * 22, [1] * 5 + [2] * 19 + [3] * 8, [1] * 12 + [2] * 14 + [0] * 6, [1] * 32]
    return np.asarray(rows, np.int32)


@pytest.fixture(scope="module")
def problem():
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, S, N, D))
    k = jax.random.normal(keys[1], (B, S, K, D))
    v = jax.random.normal(keys[2], (B, S, K, D))
    probe = jax.random.normal(keys[3], (B, S, N, D))
    return q, k, v, probe, jnp.asarray(_segments())


def _loss(q, k, v, seg, probe, causal):
    out = dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=causal, impl="xla",
                                logical_axes=(Q_AXES, KV_AXES))
    return jnp.sum(out * probe), out


def _run(problem, causal, layout=None, kind="allgather"):
    q, k, v, probe, seg = problem
    fn = jax.value_and_grad(_loss, argnums=(0, 1, 2), has_aux=True)
    if layout is None:
        return jax.jit(fn, static_argnums=5)(q, k, v, seg, probe, causal), None
    mesh = layout.make_mesh()

    def sharded(q, k, v, seg, probe):
        with sharding_context(mesh, layout.rules, LayoutOptions(context_parallel=kind)):
            assert sequence_axes(Q_AXES) == ("context",)
            return fn(q, k, v, seg, probe, causal)

    with sharding_context(mesh, layout.rules):
        qs, ps = named_sharding(Q_AXES), named_sharding(Q_AXES)
        ks, ss = named_sharding(KV_AXES), named_sharding(("act_batch", "act_seq"))
    args = [jax.device_put(a, s) for a, s in zip((q, k, v, seg, probe), (qs, ks, ks, ss, ps))]
    compiled = jax.jit(sharded).lower(*args).compile(FAST)
    return compiled(*args), compiled.as_text()


def _assert_close(got, want):
    (loss, out), grads = got
    (ref_loss, ref_out), ref_grads = want
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r, name in zip(grads, ref_grads, "qkv"):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5, err_msg=f"d{name}")


@pytest.fixture(scope="module")
def reference(problem):
    return {causal: _run(problem, causal)[0] for causal in (True, False)}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("kind", ["allgather", "ring"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_attention_matches_one_device(problem, reference, name, kind, causal):
    want = reference[causal]
    layout = load_layout({"name": name, **LAYOUTS[name]})
    got, hlo = _run(problem, causal, layout, kind)
    _assert_close(got, want)
    cp = layout.resolved_mesh_shape(8)["context"]
    heads = N // layout.resolved_mesh_shape(8)["tensor"]
    kv = K // layout.resolved_mesh_shape(8)["tensor"]
    blocks = {(int(a), int(b)) for a, b in re.findall(rf"f32\[\d+,{kv},{heads // kv},(\d+),(\d+)\]", hlo)}
    if kind == "allgather":  # per device: its query block against the whole (gathered) sequence
        assert (S // cp, S) in blocks and (S, S) not in blocks, blocks
    else:  # one K/V block at a time, passed around the ring
        assert (S // cp, S // cp) in blocks and (S // cp, S) not in blocks, blocks
        assert "collective-permute" in hlo


def test_no_context_axis_means_plain_attention():
    """Without a layout (or with the sequence unsplit) the op does not enter shard_map."""
    layout = load_layout({"mesh": {"fsdp": 8}, "rules": [["act_batch", "fsdp"]]})
    assert sequence_axes(Q_AXES) == ()
    with sharding_context(layout.make_mesh(), layout.rules):
        assert sequence_axes(Q_AXES) == ()
