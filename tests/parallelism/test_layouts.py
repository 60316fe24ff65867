"""Every layout preset on 8 CPU devices trains the tiny model exactly like one device: the same
losses and gradients (float32) over several SGD steps on a packed batch with images, samples and
images crossing the sequence-shard boundaries; and the compiled programs do what the layouts say
(HLO: weights split not gathered, vocabulary never gathered, CP score blocks [S/cp, S], all-to-all
expert dispatch).

One compile per preset (plus the single-device reference): the step is forward + backward + SGD.
Compiled with LLVM optimisations off (``FAST``): the same partitioned HLO, a third of the compile
time on this CPU.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from flax import nnx

from moevlm_jax.model.compute import ComputeConfig

from moevlm_jax.model.config import load_model_config
from moevlm_jax.model.loss import model_loss
from moevlm_jax.model.qwen3_vl_moe import Qwen3VLMoe
from parallelism import sharding
from moevlm_jax.config import load_layout
from parallelism.logical import sharding_context
from parallelism.validate import validate_layout
from tests.parallelism.packed_batch import packed_batch

PRESETS = ("fsdp", "tp", "ep", "tp_ep", "ep_etp", "cp", "folded")
ROWS, SEQ, STEPS, LR = 8, 32, 3, 0.5
FAST = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
COLLECTIVE = re.compile(r"= \(?([a-z0-9]+)\[([0-9,]*)\][^=]*? (all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\(")


@pytest.fixture(scope="module")
def setup():
    config = load_model_config("tiny-v512")
    model = Qwen3VLMoe(config, ComputeConfig(dtype="float32", param_dtype="float32"), nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(state))
    return config, graphdef, state, params, packed_batch(config, ROWS, SEQ)


def _step(graphdef, mesh=None, layout=None):
    def step(params, batch):
        def loss(p):
            if mesh is None:
                return model_loss(nnx.merge(graphdef, p), batch)[0]
            with sharding_context(mesh, layout.rules, layout.options):
                return model_loss(nnx.merge(graphdef, p), batch)[0]

        value, grads = jax.value_and_grad(loss)(params)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), value, grads

    return step


def _train(compiled, params, batch):
    out = []
    for _ in range(STEPS):
        params, loss, grads = compiled(params, batch)
        out.append((float(loss), jax.tree.map(np.asarray, grads)))
    return out


@pytest.fixture(scope="module")
def reference(setup):
    """Single-device losses and gradients of STEPS SGD steps."""
    _, graphdef, _, params, batch = setup
    compiled = jax.jit(_step(graphdef)).lower(params, batch).compile(FAST)
    return _train(compiled, params, batch)


def compile_layout(setup, layout):
    """The SGD step compiled for ``layout`` on all 8 devices, with its placed params and batch."""
    config, graphdef, state, params, batch = setup
    mesh = layout.make_mesh()
    validate_layout(config, layout, mesh, ROWS, SEQ)
    pshard = sharding.param_shardings(state, mesh, layout.rules)
    bshard = sharding.batch_shardings({k: v.shape for k, v in batch.items()}, mesh, layout.rules)
    params, batch = jax.device_put(params, pshard), jax.device_put(batch, bshard)
    jitted = jax.jit(_step(graphdef, mesh, layout), out_shardings=(pshard, sharding.replicated(mesh), pshard))
    return jitted.lower(params, batch).compile(FAST), params, batch


def assert_same_training(got, want):
    for step, ((loss, grads), (ref_loss, ref_grads)) in enumerate(zip(got, want)):
        np.testing.assert_allclose(loss, ref_loss, rtol=2e-6, err_msg=f"loss at step {step}")
        flat = jax.tree_util.tree_flatten_with_path(grads)[0]
        for (path, g), r in zip(flat, jax.tree.leaves(ref_grads)):
            scale = float(np.abs(r).max()) or 1.0
            np.testing.assert_allclose(g, r, rtol=1e-4, atol=2e-5 * scale,
                                       err_msg=f"gradient {jax.tree_util.keystr(path)} at step {step}")


def collectives(hlo: str, op: str, with_dims: bool = False) -> list:
    """Output shapes of the ``op`` collectives in compiled HLO text; ``with_dims``: (shape, the
    dimensions it gathers / scatters) pairs."""
    out = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m and m.group(3) == op:
            shape = tuple(int(d) for d in m.group(2).split(",") if d)
            dims = re.search(r"dimensions=\{([0-9,]*)\}", line)
            out.append((shape, tuple(int(d) for d in dims.group(1).split(",") if d) if dims else ())
                       if with_dims else shape)
    return out


def _has(shape: tuple[int, ...], run: tuple[int, ...]) -> bool:
    return any(shape[i:i + len(run)] == run for i in range(len(shape) - len(run) + 1))


def check_hlo(name: str, hlo: str, config) -> None:
    """What each preset promises, read off the partitioned program."""
    t = config.text_config
    gathered = collectives(hlo, "all-gather")
    tensor_parallel = name in ("tp", "tp_ep", "folded")
    if tensor_parallel:
        # vocabulary-parallel embedding, LM head and cross-entropy: nothing vocabulary-sized is gathered
        assert not [s for s in gathered if t.vocab_size in s], [s for s in gathered if t.vocab_size in s]
        # column-parallel q/k/v weights [H, heads, D] are gathered along H (FSDP), never along heads
        heads = [(s, d) for s, d in collectives(hlo, "all-gather", with_dims=True)
                 if len(s) == 3 and s[0] == t.hidden_size and s[2] == t.head_dim and 1 in d]
        assert not heads, heads
    if name in ("ep", "tp_ep", "ep_etp", "folded"):
        assert collectives(hlo, "all-to-all"), "expert dispatch should exchange tokens with all-to-all"
        e, h, i = t.num_experts, t.hidden_size, t.moe_intermediate_size
        experts = [s for s in gathered if _has(s, (e, h, 2))  # gate_up [E, H, 2, I]
                   or any(s[j:j + 3] == (e, i // k, h) for j in range(len(s)) for k in (1, 2))]  # down [E, I, H]
        assert not experts, f"expert weights gathered over the expert axis: {experts}"
    if name in ("cp", "folded"):
        cp = 4 if name == "cp" else 2
        heads = t.num_attention_heads // (2 if name == "folded" else 1)
        kv = t.num_key_value_heads // (2 if name == "folded" else 1)
        # attention scores [B_local, K, G, S/cp, S] per device, never the whole [.., S, S]
        blocks = {(int(q), int(k)) for _, q, k in re.findall(rf"f32\[(\d+),{kv},{heads // kv},(\d+),(\d+)\]", hlo)}
        assert (SEQ // cp, SEQ) in blocks and (SEQ, SEQ) not in blocks, blocks
        # K/V all-gathered over the context axis: [B_local, S, K_local, D]
        assert [s for s in gathered if len(s) == 4 and s[1:] == (SEQ, kv, t.head_dim)]


@pytest.mark.parametrize("name", PRESETS)
def test_preset_trains_like_one_device(setup, reference, name):
    compiled, params, batch = compile_layout(setup, load_layout(name))
    assert_same_training(_train(compiled, params, batch), reference)
    check_hlo(name, compiled.as_text(), setup[0])


def test_kv_heads_replicated_when_tensor_exceeds_them(setup, reference):
    """The validator's advice for KV heads < TP works: 2 KV heads, TP 4, kv_heads -> null."""
    tp = load_layout("tp")
    rules = [list(r) for r in tp.rules if r[0] not in ("kv_heads", "act_kv_heads", "vis_heads")]
    rules = [["kv_heads", None], ["act_kv_heads", None], ["vis_heads", None], *rules]
    layout = load_layout({"name": "tp4_kv_replicated", "mesh": {"fsdp": 2, "tensor": 4}, "rules": rules})
    compiled, params, batch = compile_layout(setup, layout)
    assert_same_training(_train(compiled, params, batch)[:1], reference[:1])
