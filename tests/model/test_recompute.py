"""Recompute policies through ``layers.run_stack`` (the path every stack takes, pipelined or not), on the
layers of both model families: the tiny Qwen3-VL model's decoder layers (MoE / dense) and vision blocks,
and qwen3.5-tiny's decoder layers (Gated DeltaNet "linear_attention" / gated "full_attention", each with
routed + shared experts):

- what each policy saves for the backward pass (jax's saved residuals of one unrolled layer), per kind
  of layer: selective with no module listed keeps exactly the layer's checkpoint names (and nothing
  else); a Megatron module name (and ``gdn``: Qwen3.5's conv output gdn_conv, delta-rule output gdn_core
  and gated-norm output gated_norm) removes exactly its own checkpointed tensors; a full-attention layer
  (no GDN) is unchanged by ``gdn``; full saves none, none saves more than selective, offloaded names move
  to host memory (``offload: [gdn]`` too), the vision tower follows its own policy;
- every policy (none / full / selective variants / offload, decoder and vision; Qwen3.5: a scanned GDN
  layer) gives the loss and gradients of no recompute (float32, scanned stacks). Host offload runs on the
  CPU backend (the residual is a ``<host>`` array there), so the offload policies are run, not only built;
- under the ``pp`` layout the pipeline stages trace the same policies.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import name_p, remat_p, saved_residuals

from moevlm_jax.model import qwen3_5_gdn
from moevlm_jax.model.compute import CHECKPOINT_NAMES, RECOMPUTE_MODULES, ComputeConfig
from moevlm_jax.model.decoder import DecoderLayer
from moevlm_jax.model.layers import remat_policy, run_stack, stack_modules
from moevlm_jax.model.qwen3_5_decoder import Qwen35DecoderLayer
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.model.rotary import mrope_cos_sin
from moevlm_jax.model.vision import VisionBlock
from tests.xla_options import FAST  # LLVM optimisations off: a third of the compile

# quick compiles (tests/xla_options.py): every policy and its reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

CFG = load_model_config("tiny-v512")
CFG35 = load_model_config("qwen3.5-tiny").text_config
F32 = {"dtype": "float32", "param_dtype": "float32"}
B, S, P = 2, 16, 16  # rows, tokens, patches
GDN = ("gdn_conv", "gdn_core", "gated_norm")
QWEN35_KINDS = ("linear_attention", "full_attention")
# Qwen3.5's MoE block: routed experts + the shared expert's gate / up and down outputs
MOE35 = {"moe_router": 1, "moe_permuted": 1, "moe_gate_up": 1, "moe_act": 1, "moe_expert_out": 1,
         "mlp_hidden": 2, "mlp": 1}
# What one layer saves under selective with no recompute module (reference: the layers' code):
# Qwen3-VL decoder: input / post-attention RMSNorm + q_norm + k_norm outputs, q/k/v, attention output,
# o_proj output; MoE: router logits, the experts' permuted rows, gate/up output, activation and down
# output (so no grouped matmul runs again in the backward); dense: gate and up projections.
# Vision: norm1 / norm2, fused qkv, attention output, proj output, fc1 output (GELU's input).
# Qwen3.5 GDN layer: its own names once each, next to the projections (qkv_proj x 4: fused q|k|v, z, b,
# a), out-projection, norms and the MoE block's names; its full-attention layer as Qwen3-VL's (gated).
SAVED = {
    "moe": {"layernorm": 4, "qkv_proj": 3, "core_attn": 1, "attn_out": 1, "moe_router": 1, "moe_permuted": 1,
            "moe_gate_up": 1, "moe_act": 1, "moe_expert_out": 1},
    "dense": {"layernorm": 4, "qkv_proj": 3, "core_attn": 1, "attn_out": 1, "mlp_hidden": 2},
    "vision": {"layernorm": 2, "qkv_proj": 1, "core_attn": 1, "attn_out": 1, "mlp_hidden": 1},
    "linear_attention": {"layernorm": 2, "qkv_proj": 4, "gdn_conv": 1, "gdn_core": 1, "gated_norm": 1,
                         "attn_out": 1, **MOE35},
    "full_attention": {"layernorm": 4, "qkv_proj": 3, "core_attn": 1, "attn_out": 1, **MOE35},
}
# per kind: the modules recomputed one at a time (each drops exactly its names); modules recomputed
# together and the names left (Qwen3-VL: every module, the exact counts; Qwen3.5: the GDN, attention
# and MoE modules, the names)
ALL = tuple(RECOMPUTE_MODULES)
SELECTIVE = {
    "moe": (ALL, ALL, {"qkv_proj": 3, "attn_out": 1}),
    "dense": (ALL, ALL, {"qkv_proj": 3, "attn_out": 1}),
    "vision": (ALL, ALL, {"qkv_proj": 1, "attn_out": 1}),
    "linear_attention": (("gdn",), ("gdn", "core_attn", "moe", "mlp"), {"layernorm", "qkv_proj", "attn_out"}),
    "full_attention": (("gdn",), ("gdn", "core_attn", "moe", "mlp"), {"layernorm", "qkv_proj", "attn_out"}),
}


def _stack(make, axis: str):
    """2 stacked layers with random parameters (numpy: compiling the model's init takes seconds);
    norm scales around 1, everything else around 0."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: stack_modules(make, 2, nnx.Rngs(0), axis)))
    rng = np.random.default_rng(0)

    def fill(path, v):
        value = rng.normal(0.0, 0.1, v.shape).astype(v.dtype)
        return jnp.asarray(value + 1.0 if "scale" in jax.tree_util.keystr(path) else value)

    return graphdef, jax.tree_util.tree_map_with_path(fill, abstract)


@functools.cache
def _setup(kind: str):
    """(graphdef, 2-layer state, x, side, body) for tiny decoder (moe / dense) or vision layers."""
    base = ComputeConfig(**F32)
    keys = jax.random.split(jax.random.key(1), 4)
    if kind == "vision":
        v = CFG.vision_config
        graphdef, state = _stack(lambda r: VisionBlock(v, base, r), "vis_layers")
        x = jax.random.normal(keys[0], (B, P, v.hidden_size))
        angles = jax.random.uniform(keys[1], (B, P, v.head_dim), maxval=6.0)
        seg = jnp.array([[1] * 12 + [2] * 4, [1] * 16])
        side = (jnp.cos(angles), jnp.sin(angles), seg)
        return graphdef, state, x, side, lambda blk, h, _, side: (blk(h, *side), None)
    t = CFG.text_config
    graphdef, state = _stack(lambda r: DecoderLayer(t, base, kind, r), "layers")
    x = jax.random.normal(keys[0], (B, S, t.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(S), (3, B, S))
    cos, sin = mrope_cos_sin(positions, t.head_dim, t.rope_theta, t.mrope_section)
    seg = jnp.array([[1] * 10 + [2] * 6, [1] * 14 + [0] * 2])
    return graphdef, state, x, (cos, sin, seg), lambda layer, h, _, side: layer(h, *side)


def _loss_fn(kind: str, compute: ComputeConfig, layers: int = 1):
    """(loss(state, x), state, x): the first ``layers`` layers through run_stack, a linear read-out
    (so the residuals are the layers' own)."""
    graphdef, state, x, side, body = _setup(kind)
    state = jax.tree.map(lambda a: a[:layers], state)
    w = jax.random.normal(jax.random.key(2), x.shape)

    def loss(state, x):
        out, _ = run_stack(nnx.merge(graphdef, state), body, x, None, compute, side=side)
        return jnp.sum(out * w)

    return loss, state, x


@functools.cache
def _setup35(kind: str):
    """(graphdef, state, x, side) of one Qwen3.5 decoder layer of ``kind`` (stacked), random parameters."""
    base = ComputeConfig(**F32)
    graphdef, abstract = nnx.split(nnx.eval_shape(
        lambda: stack_modules(lambda r: Qwen35DecoderLayer(CFG35, base, kind, r), 1, nnx.Rngs(0), "layers")))
    rng = np.random.default_rng(0)
    state = jax.tree_util.tree_map_with_path(
        lambda p, v: jnp.asarray(rng.normal(0.0, 0.1, v.shape).astype(v.dtype)), abstract)
    x = jax.random.normal(jax.random.key(0), (B, S, CFG35.hidden_size))
    positions = jnp.broadcast_to(jnp.arange(S), (3, B, S))
    cos, sin = mrope_cos_sin(positions, CFG35.rotary_dim, CFG35.rope_theta, CFG35.mrope_section)
    seg = jnp.array([[1] * 10 + [2] * 6, [1] * 14 + [0] * 2])
    return graphdef, state, x, (cos, sin, seg)


def _loss35(graphdef, side, compute):
    # a probe over the valid positions: padding (segment 0) outputs are defined by nothing (its MoE output is
    # zero, its attention keys masked for every valid token)
    w = jax.random.normal(jax.random.key(2), (B, S, CFG35.hidden_size)) * (side[2] > 0)[..., None]

    def loss(state, x):
        x, _ = run_stack(nnx.merge(graphdef, state), lambda l, h, _, sd: l(h, *sd), x, None, compute, side=side)
        return jnp.sum(x * w)

    return loss


def _residuals(kind: str, **compute) -> tuple[collections.Counter, list[tuple[str, str]]]:
    """(count of each checkpoint name saved on the device, [(aval, description)] of all residuals)
    of one unrolled layer of ``kind`` (either family's) under ``compute``."""
    compute = ComputeConfig(**F32, scan_layers=False, **compute)
    if kind in QWEN35_KINDS:
        graphdef, state, x, side = _setup35(kind)
        loss = _loss35(graphdef, side, compute)
    else:
        loss, state, x = _loss_fn(kind, compute)
    res = [(str(aval), desc) for aval, desc in saved_residuals(loss, state, x)]
    names = collections.Counter(d.split("named '")[1].split("'")[0] for _, d in res if "named '" in d)
    return names, res


def _host(res):
    return sorted(aval.replace("<host>", "") for aval, _ in res if "<host>" in aval)


def _unnamed(res):
    """Residuals other than inputs, closed-over constants and per-layer parameter slices."""
    skip = ("from the argument", "from a constant", "from a literal", "output of squeeze", "named '")
    return [d for _, d in res if not any(s in d for s in skip)]


@pytest.mark.parametrize("kind", ["moe", "dense", "vision", *QWEN35_KINDS])
def test_each_recompute_module_drops_exactly_its_tensors(kind):
    recompute = "vision_recompute" if kind == "vision" else "recompute"
    modules = "vision_recompute_modules" if kind == "vision" else "recompute_modules"
    saved, res = _residuals(kind, **{recompute: "selective", modules: ()})
    assert dict(saved) == SAVED[kind]
    assert _unnamed(res) == []  # selective keeps nothing but the named tensors
    one_at_a_time, together, left = SELECTIVE[kind]
    for module in one_at_a_time:
        got, _ = _residuals(kind, **{recompute: "selective", modules: (module,)})
        want = collections.Counter({n: c for n, c in SAVED[kind].items() if n not in RECOMPUTE_MODULES[module]})
        assert got == want, module
    got, _ = _residuals(kind, **{recompute: "selective", modules: together})
    assert (dict(got) if isinstance(left, dict) else set(got)) == left  # those modules all recomputed


def test_gdn_names_and_module():
    assert RECOMPUTE_MODULES["gdn"] == GDN and all(n in CHECKPOINT_NAMES for n in GDN)
    with pytest.raises(ValueError, match="recompute_modules \\['gdnn'\\]"):
        ComputeConfig(recompute="selective", recompute_modules=("gdnn",))


def test_full_none_and_offload_residuals():
    full_names, full = _residuals("moe", recompute="full")
    assert not full_names and _unnamed(full) == []  # only the layer's inputs and parameters
    sel_names, sel = _residuals("moe", recompute="selective")
    _, none = _residuals("moe")
    assert sel_names == collections.Counter({n: c for n, c in SAVED["moe"].items() if n != "core_attn"})
    assert len(_unnamed(none)) > 10 and len(none) > len(sel) > len(full)  # none also keeps softmax, MoE routing...
    # offload: the named tensors go to host memory (same shapes), everything else as before
    attn = (B, S, CFG.text_config.num_attention_heads, CFG.text_config.head_dim)
    act = (B * S * CFG.text_config.num_experts_per_tok, CFG.text_config.moe_intermediate_size)
    names, res = _residuals("moe", recompute="selective", recompute_modules=("layernorm",), offload=("core_attn",))
    assert names == collections.Counter({n: c for n, c in SAVED["moe"].items() if n not in ("layernorm", "core_attn")})
    assert _host(res) == [f"float32{list(attn)}".replace(" ", "")]
    names, res = _residuals("moe", offload=("core_attn", "moe_act"))
    assert names["core_attn"] == names["moe_act"] == 0 and names["qkv_proj"] == 3
    assert _host(res) == sorted(f"float32{list(s)}".replace(" ", "") for s in (attn, act))
    device = lambda rr: collections.Counter(a for a, d in rr if "<host>" not in a and "literal" not in d)
    moved = collections.Counter(f"float32{list(s)}".replace(" ", "") for s in (attn, act))
    assert device(none) - device(res) == moved and not device(res) - device(none)  # the rest stays as under none
    names, res = _residuals("moe", recompute="full", offload=("moe",))
    # moe = router logits + the experts' permuted rows, gate/up output, activation, down output (block output unused)
    t = CFG.text_config
    rows = B * S * t.num_experts_per_tok
    want = [[B, S, t.num_experts], [rows, 2 * t.moe_intermediate_size], [rows, t.moe_intermediate_size],
            [rows, t.hidden_size], [rows, t.hidden_size]]
    assert not names and _host(res) == sorted(f"float32{w}".replace(" ", "") for w in want)


def test_vision_tower_follows_its_own_policy():
    for kind in ("moe", "vision"):
        names, res = _residuals(kind, recompute="none", vision_recompute="full")
        assert (not names and _unnamed(res) == []) == (kind == "vision")
        names, _ = _residuals(kind, recompute="full", vision_recompute="selective", vision_recompute_modules=("mlp",))
        if kind == "vision":
            assert names == collections.Counter({n: c for n, c in SAVED["vision"].items() if n != "mlp_hidden"})
        else:
            assert not names


def test_gdn_offload_moves_its_tensors_to_host():
    names, res = _residuals("linear_attention", recompute="selective", recompute_modules=(), offload=("gdn",))
    assert not any(names[n] for n in GDN) and names["qkv_proj"] == 4
    host = sorted(a for a, _ in res if "<host>" in a)
    hk, hv = CFG35.linear_num_key_heads, CFG35.linear_num_value_heads
    group = 2 * CFG35.linear_key_head_dim + hv // hk * CFG35.linear_value_head_dim
    want = sorted([f"float32<host>[{B},{S},{hk},{group}]"]
                  + [f"float32<host>[{B},{S},{hv},{CFG35.linear_value_head_dim}]"] * 2)
    assert host == want


POLICIES = {  # per kind of layer, the policies that act on it (the MoE layer has every checkpoint name but mlp's)
    "moe": [{"recompute": "full"}, {"recompute": "selective"},
            {"recompute": "selective", "recompute_modules": tuple(RECOMPUTE_MODULES)},
            {"offload": ("core_attn", "moe_act")}, {"recompute": "full", "offload": ("qkv_proj", "moe_router")}],
    "dense": [{"recompute": "selective", "recompute_modules": ("mlp",)},
              {"recompute": "selective", "recompute_modules": ("layernorm",), "offload": ("core_attn", "mlp")}],
    "vision": [{"recompute": "none", "vision_recompute": "full"},
               {"recompute": "full", "vision_recompute": "selective", "vision_recompute_modules": ("mlp", "layernorm")},
               {"vision_recompute": "selective", "vision_recompute_modules": (), "offload": ("mlp_hidden",)}],
}


@pytest.mark.parametrize("kind", ["moe", "dense", "vision"])
def test_every_policy_gives_the_same_loss_and_gradients(kind):
    """No recompute and this kind's POLICIES in one program (one compile; each policy's backward
    recomputes inside its own scan, nothing to share)."""
    policies = POLICIES[kind]
    fns = []
    for policy in [{}] + policies:
        loss, state, x = _loss_fn(kind, ComputeConfig(**F32, **policy), layers=2)  # scanned, as in the model
        fns.append(jax.value_and_grad(loss, argnums=(0, 1)))
    program = jax.jit(lambda st, x: [f(st, x) for f in fns]).lower(state, x)
    (ref_loss, ref_grads), *results = program.compile({"xla_backend_optimization_level": 0})(state, x)
    ref = jax.tree.leaves(ref_grads)
    assert len(ref) > 10 and all(np.abs(np.asarray(r)).max() > 0 for r in ref)
    for policy, (loss, grads) in zip(policies, results, strict=True):
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-6, err_msg=str(policy))
        for g, r in zip(jax.tree.leaves(grads), ref, strict=True):
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6 * np.abs(r).max(), err_msg=str(policy))


@pytest.mark.parametrize(("moe", "policy"), [
    ({"capacity_factor": 1.0}, {"recompute": "full"}),
    ({"capacity_factor": 0.5, "hybrid_overflow": 0.05},
     {"recompute": "selective", "recompute_modules": tuple(RECOMPUTE_MODULES)}),
])
def test_hybrid_experts_under_recompute_match_the_default_experts(moe, policy):
    """The 'hybrid' experts (their lax.cond: overflow buffer or grouped fallback) inside remat'd,
    scanned MoE layers: the loss and gradients of the default experts without recompute."""
    graphdef, state, x, side, body = _setup("moe")
    hybrid = ComputeConfig(**F32, moe={"backend": "hybrid", **moe}, **policy)
    t = CFG.text_config
    hybrid_def = nnx.split(nnx.eval_shape(lambda: stack_modules(
        lambda r: DecoderLayer(t, hybrid, "moe", r), 2, nnx.Rngs(0), "layers")))[0]

    def loss(gdef, compute):
        def f(st, x):
            out, _ = run_stack(nnx.merge(gdef, st), body, x, None, compute, side=side)
            return jnp.sum(out * jnp.cos(x))
        return jax.value_and_grad(f, argnums=(0, 1))

    jaxpr = str(jax.make_jaxpr(loss(hybrid_def, hybrid))(state, x))
    assert "cond[" in jaxpr and f"{remat_p.name}[" in jaxpr
    (ref_loss, ref_grads), (got_loss, got_grads) = jax.jit(
        lambda st, x: (loss(graphdef, ComputeConfig(**F32))(st, x), loss(hybrid_def, hybrid)(st, x)))(state, x)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-5)
    ref = jax.tree.leaves(ref_grads)
    for g, r in zip(jax.tree.leaves(got_grads), ref, strict=True):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5 * np.abs(r).max())


def _checkpoint_policies(jaxpr) -> list:
    """The policy of every jax.checkpoint in a jaxpr, nested jaxprs included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is remat_p:
            out.append(eqn.params["policy"])
        for v in eqn.params.values():
            for sub in v if isinstance(v, (list, tuple)) else [v]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out += _checkpoint_policies(inner)
    return out


def _saves(policy, name: str) -> bool:
    from jax.ad_checkpoint import Recompute

    return policy(name_p, jnp.zeros(()), name=name) not in (False, Recompute)


def test_pipeline_stages_trace_the_policies():
    from moevlm_jax.config import load_layout
    from moevlm_jax.parallelism import pipeline
    from moevlm_jax.parallelism.logical import sharding_context
    from moevlm_jax.training.config import OptimizerConfig
    from moevlm_jax.training.trainer import Trainer

    compute = ComputeConfig(**F32, recompute="selective", recompute_modules=("core_attn",), vision_recompute="full")
    trainer = Trainer.create(CFG, compute, load_layout("pp"), OptimizerConfig(), steps=10)
    spec = trainer.spec
    batch = {k: jax.ShapeDtypeStruct(v.shape[1:], v.dtype) for k, v in trainer.abstract_batch(2, 32, 16).items()}
    with sharding_context(spec.mesh, spec.rules, spec.layout_options):
        assert pipeline.active_config("layers") is not None  # the decoder runs as a pipeline
        jaxpr = jax.make_jaxpr(lambda p, b: trainer.model(p).hidden_states(b)[0])(trainer.abstract_params, batch)
    policies = _checkpoint_policies(jaxpr.jaxpr)
    decoder = [p for p in policies if _saves(p, "layernorm")]
    vision = [p for p in policies if not _saves(p, "layernorm")]
    assert len(decoder) == 1 and len(vision) == 3  # one decoder stack (pipelined); vision split at deepstack 1, 2
    assert not _saves(decoder[0], "core_attn") and _saves(decoder[0], "qkv_proj")
    assert all(not _saves(p, n) for p in vision for n in ("qkv_proj", "core_attn", "mlp_hidden"))
    assert remat_policy(compute, "vision") is jax.checkpoint_policies.nothing_saveable


def test_gdn_policies_give_the_same_loss_and_gradients(monkeypatch):
    """A GDN layer (scanned; chunks of 8 tokens, so two a row): every policy's loss and gradients equal no
    recompute's (float32: to 1e-5 of each gradient's scale)."""
    monkeypatch.setattr(qwen3_5_gdn, "GDN_CHUNK_SIZE", 8)
    graphdef, state, x, side = _setup35("linear_attention")

    def run(compute):
        fn = jax.jit(jax.value_and_grad(_loss35(graphdef, side, compute), argnums=(0, 1)))
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
