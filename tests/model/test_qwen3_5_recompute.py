"""Recompute of Qwen3.5's Gated DeltaNet layer (``compute.recompute_modules: [gdn]``), through
``layers.run_stack`` as every stack runs: what one layer saves for the backward (jax's saved residuals),
as in test_recompute.py.

- selective with no module listed keeps the GDN's own checkpoint names (gdn_conv: the conv output,
  gdn_core: the delta rule's output, gated_norm: the gated norm's output) once each, next to the
  projections (qkv_proj x 4: fused q|k|v, z, b, a), out-projection, norms and the MoE block's names;
- with ``gdn`` listed exactly those three are recomputed, everything else still kept; a full-attention
  layer (no GDN) is unchanged by ``gdn``; ``offload: [gdn]`` moves the three to host memory;
- the loss and gradients of a scanned GDN layer equal no recompute's under every policy.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals

from moevlm_jax.model import qwen3_5_gdn
from moevlm_jax.model.compute import CHECKPOINT_NAMES, RECOMPUTE_MODULES, ComputeConfig
from moevlm_jax.model.layers import run_stack, stack_modules
from moevlm_jax.model.qwen3_5_decoder import Qwen35DecoderLayer
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.model.rotary import mrope_cos_sin
from tests.xla_options import FAST  # LLVM optimisations off: a third of the compile

# quick compiles (tests/xla_options.py): every policy and its reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

CFG = load_model_config("qwen3.5-tiny").text_config
F32 = {"dtype": "float32", "param_dtype": "float32"}
B, S = 2, 16
GDN = ("gdn_conv", "gdn_core", "gated_norm")
MOE = {"moe_router": 1, "moe_permuted": 1, "moe_gate_up": 1, "moe_act": 1, "moe_expert_out": 1,
       "mlp_hidden": 2, "mlp": 1}  # routed experts + the shared expert's gate / up and down outputs
SAVED = {
    "linear_attention": {"layernorm": 2, "qkv_proj": 4, "gdn_conv": 1, "gdn_core": 1, "gated_norm": 1,
                         "attn_out": 1, **MOE},
    "full_attention": {"layernorm": 4, "qkv_proj": 3, "core_attn": 1, "attn_out": 1, **MOE},
}


@functools.cache
def _setup(kind: str, layers: int = 1):
    """(graphdef, state, x, side) of ``layers`` stacked decoder layers of ``kind``, random parameters."""
    base = ComputeConfig(**F32)
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: stack_modules(lambda r: Qwen35DecoderLayer(CFG, base, kind, r), layers, nnx.Rngs(0), "layers")))
    rng = np.random.default_rng(0)
    state = jax.tree_util.tree_map_with_path(
        lambda p, v: jnp.asarray(rng.normal(0.0, 0.1, v.shape).astype(v.dtype)), abstract)
    x = jax.random.normal(jax.random.key(0), (B, S, CFG.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(S), (3, B, S))
    cos, sin = mrope_cos_sin(positions, CFG.rotary_dim, CFG.rope_theta, CFG.mrope_section)
    seg = jnp.array([[1] * 10 + [2] * 6, [1] * 14 + [0] * 2])
    return graphdef, state, x, (cos, sin, seg)


def _loss(graphdef, side, compute):
    # a probe over the valid positions: padding (segment 0) outputs are defined by nothing (its MoE output is
    # zero, its attention keys masked for every valid token)
    w = jax.random.normal(jax.random.key(2), (B, S, CFG.hidden_size)) * (side[2] > 0)[..., None]

    def loss(state, x):
        x, _ = run_stack(nnx.merge(graphdef, state), lambda l, h, _, sd: l(h, *sd), x, None, compute, side=side)
        return jnp.sum(x * w)

    return loss


def _residuals(kind: str, **compute):
    graphdef, state, x, side = _setup(kind)
    loss = _loss(graphdef, side, ComputeConfig(**F32, scan_layers=False, **compute))
    res = [(str(aval), desc) for aval, desc in saved_residuals(loss, state, x)]
    names = collections.Counter(d.split("named '")[1].split("'")[0] for _, d in res if "named '" in d)
    return names, res


def test_gdn_names_and_module():
    assert RECOMPUTE_MODULES["gdn"] == GDN and all(n in CHECKPOINT_NAMES for n in GDN)
    with pytest.raises(ValueError, match="recompute_modules \\['gdnn'\\]"):
        ComputeConfig(recompute="selective", recompute_modules=("gdnn",))


@pytest.mark.parametrize("kind", ["linear_attention", "full_attention"])
def test_selective_gdn_recomputes_exactly_its_tensors(kind):
    kept, res = _residuals(kind, recompute="selective", recompute_modules=())
    assert dict(kept) == SAVED[kind]
    skip = ("from the argument", "from a constant", "from a literal", "output of squeeze", "named '")
    assert [d for _, d in res if not any(s in d for s in skip)] == []  # nothing but the named tensors
    got, _ = _residuals(kind, recompute="selective", recompute_modules=("gdn",))
    assert got == collections.Counter({n: c for n, c in SAVED[kind].items() if n not in GDN})
    got, _ = _residuals(kind, recompute="selective", recompute_modules=("gdn", "core_attn", "moe", "mlp"))
    assert set(got) == {"layernorm", "qkv_proj", "attn_out"}  # the GDN, attention and MoE modules recomputed


def test_gdn_offload_moves_its_tensors_to_host():
    names, res = _residuals("linear_attention", recompute="selective", recompute_modules=(), offload=("gdn",))
    assert not any(names[n] for n in GDN) and names["qkv_proj"] == 4
    host = sorted(a for a, _ in res if "<host>" in a)
    hk, hv = CFG.linear_num_key_heads, CFG.linear_num_value_heads
    group = 2 * CFG.linear_key_head_dim + hv // hk * CFG.linear_value_head_dim
    want = sorted([f"float32<host>[{B},{S},{hk},{group}]"]
                  + [f"float32<host>[{B},{S},{hv},{CFG.linear_value_head_dim}]"] * 2)
    assert host == want


def test_policies_give_the_same_loss_and_gradients(monkeypatch):
    """A GDN layer (scanned; chunks of 8 tokens, so two a row): every policy's loss and gradients equal no
    recompute's (float32: to 1e-5 of each gradient's scale)."""
    monkeypatch.setattr(qwen3_5_gdn, "GDN_CHUNK_SIZE", 8)
    graphdef, state, x, side = _setup("linear_attention")

    def run(compute):
        fn = jax.jit(jax.value_and_grad(_loss(graphdef, side, compute), argnums=(0, 1)))
        return fn.lower(state, x).compile(FAST)(state, x)

    ref, ref_grads = run(ComputeConfig(**F32))
    for policy in (dict(recompute="selective", recompute_modules=("gdn",)),
                   dict(recompute="selective", recompute_modules=()), dict(recompute="full")):
        got, grads = run(ComputeConfig(**F32, **policy))
        np.testing.assert_allclose(got, ref, rtol=1e-6, err_msg=str(policy))
        for (path, g), (_, r) in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                                     jax.tree_util.tree_flatten_with_path(ref_grads)[0]):
            err = float(np.abs(np.asarray(g) - np.asarray(r)).max() / max(np.abs(np.asarray(r)).max(), 1e-30))
            assert err < 1e-5, (policy, jax.tree_util.keystr(path), err)
