"""Every layout preset on 8 CPU devices trains the tiny model exactly like one device, through the
trainer's own step (its objective: gathered trained positions, CE over the global batch's trained
tokens, router losses per data-parallel rank; its AdamW update): the same per-step losses, gradient
norms and parameters (float32) over several steps on a packed batch with images, samples and images
crossing the sequence-shard boundaries; and the compiled programs do what the layouts say (HLO:
weights split not gathered, vocabulary never gathered, CP score blocks [S/cp, S], all-to-all expert
dispatch). The pipeline presets (pp, pp_circular, pp_ep) are checked the same way in test_pipeline.py.

One compile per preset (plus the single-device reference), with LLVM optimisations off (``FAST``):
the same partitioned HLO, a third of the compile time on this CPU.
"""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.parallelism.validate import validate_layout
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.trainer import Trainer
from tests.parallelism.packed_batch import packed_batch
from tests.xla_options import FAST  # LLVM optimisations off: a third of the compile

# quick compiles (tests/xla_options.py): the one-device reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

PRESETS = ("fsdp", "tp", "ep", "tp_ep", "ep_etp", "cp", "folded")
ROWS, SEQ, STEPS = 8, 32, 3
COMPUTE = ComputeConfig(dtype="float32", param_dtype="float32", loss_chunk_size=16)
# Adam with eps 1 is ~SGD for the small gradients here (update ~ lr * gradient): parameters then
# follow the gradients smoothly, and a layout that computes them differently shows in the parameters
OPTIMIZER = OptimizerConfig(lr=0.5, schedule="constant", warmup_steps=0, eps=1.0, weight_decay=0.0, clip_grad_norm=0.0)
METRICS = ("loss", "ce_loss", "grad_norm", "router_aux_loss", "trained_tokens")
# an HLO collective: its result type (one array, or a tuple of them for a combined collective) and op
COLLECTIVE = re.compile(r"= (\(?[a-z0-9]+\[[^=]*?) (all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\(")
ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def random_params(config):
    """Parameters drawn in numpy (norm scales ~1, the rest ~N(0, 0.02)): no init compile."""
    abstract = Trainer.create(config, COMPUTE, load_layout("fsdp"), OPTIMIZER, steps=STEPS,
                              devices=jax.devices()[:1]).abstract_params
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        return 1.0 + 0.1 * noise if "norm" in jax.tree_util.keystr(path) else 0.02 * noise

    return jax.tree_util.tree_map_with_path(draw, abstract)


@pytest.fixture(scope="module")
def setup():
    config = load_model_config("tiny-v512")
    return config, random_params(config), packed_batch(config, ROWS, SEQ)


def train(setup, layout, devices=None):
    """STEPS trainer steps of ``layout`` (on ``devices``, default all 8): per-step metrics, the final
    parameters (host) and the compiled step's HLO."""
    config, params, batch = setup
    trainer = Trainer.create(config, COMPUTE, layout, OPTIMIZER, steps=STEPS, devices=devices)
    validate_layout(config, layout, trainer.mesh, *batch["input_ids"].shape)
    state = trainer.init_state(seed=0, params=params)
    placed = trainer.prepare(batch)
    compiled = trainer.lower_step(state, placed.arrays, placed.capacity, bounded=placed.bounded).compile(FAST)
    records = []
    for _ in range(STEPS):
        state, metrics = compiled(state, placed.arrays)
        records.append({k: float(v) for k, v in jax.device_get(metrics).items() if k in METRICS})
    return records, jax.device_get(state["params"]), compiled.as_text()


@pytest.fixture(scope="module")
def reference(setup):
    """One device: the same trainer step's metrics and parameters."""
    records, params, _ = train(setup, load_layout("fsdp"), devices=jax.devices()[:1])
    return records, params


def assert_same_training(got, want, initial, steps=STEPS):
    (records, params), (ref_records, ref_params) = got, want
    for step, (r, ref) in enumerate(zip(records[:steps], ref_records[:steps])):
        for k in METRICS:
            assert r[k] == pytest.approx(ref[k], rel=2e-6, abs=1e-7), f"step {step} {k}: {r[k]} vs {ref[k]}"
    flat, start = (dict(jax.tree_util.tree_flatten_with_path(t)[0]) for t in (params, initial))
    for path, ref in jax.tree_util.tree_flatten_with_path(ref_params)[0]:
        moved = np.abs(np.asarray(ref) - np.asarray(start[path])).max()  # ~ lr x |gradient| x steps
        np.testing.assert_allclose(flat[path], ref, rtol=0, atol=1e-4 * moved + 1e-7,
                                   err_msg=jax.tree_util.keystr(path))


def collectives(hlo: str, op: str, with_dims: bool = False, dtype: str | None = None) -> list:
    """Output shapes of the ``op`` collectives in compiled HLO text, each array of a combined one (of element
    type ``dtype``, e.g. 'f32', if given); ``with_dims``: (shape, the dimensions it gathers / scatters) pairs."""
    out = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if not m or m.group(2) != op:
            continue
        dims = re.search(r"dimensions=\{([0-9,]*)\}", line)
        dims = tuple(int(d) for d in dims.group(1).split(",") if d) if dims else ()
        for element, shape in ARRAY.findall(m.group(1)):  # each array of a combined (tuple) collective
            if dtype in (None, element):
                shape = tuple(int(d) for d in shape.split(",") if d)
                out.append((shape, dims) if with_dims else shape)
    return out


def _has(shape: tuple[int, ...], run: tuple[int, ...]) -> bool:
    return any(shape[i:i + len(run)] == run for i in range(len(shape) - len(run) + 1))


def loop_bodies(hlo: str) -> str:
    """The computations of compiled HLO text that run as while-loop bodies (a layer or chunk scan's step)."""
    names = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    return "\n".join(c for c in re.split(r"\n(?=\S)", hlo) if (m := re.match(r"%?([\w.\-]+)", c))
                     and m.group(1) in names)


def check_hlo(name: str, hlo: str, config) -> None:
    """What each preset promises, read off the partitioned program."""
    t = config.text_config
    gathered = collectives(hlo, "all-gather")
    # the LM head's CE runs as a scan over sequence chunks: its kernel [H, V/tp] is gathered once for all of
    # them, and its gradient is summed over devices once after the scan, not all-reduced whole every chunk
    vocab = {t.vocab_size // k for k in (1, 2, 4)}  # whole or split over the tensor axis
    head = [s for s in gathered if len(s) == 2 and s[0] == t.hidden_size and s[1] in vocab]
    assert len(head) <= 1, f"LM head kernel gathered {len(head)} times: {head}"
    looped = [s for op in ("all-gather", "all-reduce", "reduce-scatter") for s in collectives(loop_bodies(hlo), op)
              if len(s) >= 2 and s[-2] == t.hidden_size and s[-1] in vocab]
    assert not looped, f"vocabulary-sized collectives inside a loop: {looped}"
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
    records, params, hlo = train(setup, load_layout(name))
    assert_same_training((records, params), reference, setup[1])
    check_hlo(name, hlo, setup[0])


def test_kv_heads_replicated_when_tensor_exceeds_them(setup, reference):
    """The validator's advice for KV heads < TP works: 2 KV heads, TP 4, kv_heads -> null."""
    tp = load_layout("tp")
    rules = [list(r) for r in tp.rules if r[0] not in ("kv_heads", "act_kv_heads", "vis_heads")]
    rules = [["kv_heads", None], ["act_kv_heads", None], ["vis_heads", None], *rules]
    layout = load_layout({"name": "tp4_kv_replicated", "mesh": {"fsdp": 2, "tensor": 4}, "rules": rules})
    records, _, _ = train(setup, layout)
    for k in METRICS:
        assert records[0][k] == pytest.approx(reference[0][0][k], rel=2e-6, abs=1e-7), k
