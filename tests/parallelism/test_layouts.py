"""Every layout preset on 8 CPU devices trains each model family exactly like one device, through the
trainer's own step (its objective: gathered trained positions, CE over the global batch's trained
tokens, router losses per data-parallel rank; its AdamW update): the same per-step losses, gradient
norms and parameters (float32) over several steps on a packed batch with images and a video row (two frame
pairs, each its own vision segment and timestamped span of video tokens), samples, images and frame groups crossing
the sequence-shard boundaries; and the compiled programs do what the layouts say. One test
per (family, preset), the families' setups and one-device references computed once each per module.

- Qwen3-VL-MoE (tiny-v512), presets fsdp, tp, ep, tp_ep, ep_etp, cp, folded; the HLO checks: weights
  split not gathered, vocabulary never gathered, CP score blocks [S/cp, S], all-to-all expert dispatch.
  Its pipeline presets (pp, pp_circular, pp_ep) are checked the same way in test_pipeline.py.
- Qwen3.5-MoE: qwen3.5-tiny (Gated DeltaNet + gated attention, 8 experts top-2 + a shared expert, tied
  embeddings) with two changes for speed and the pipeline: a 512-token vocabulary (special ids 500-503,
  as tiny-v512) and the layer pattern [linear, linear, full, full], whose two stacks divide over 2
  pipeline stages (the 3:1 pattern's stacks of 3 and 1 cannot be stored stage-split: the validator
  says so). What each preset exercises:
  - ``tp``: GDN key / value heads, gated-attention heads and the shared expert over 'tensor' with SP; ETP;
  - ``ep``: expert parallelism (all-to-all dispatch of the routed experts; the shared expert and its gate
    run on every token outside the dispatch, ZeRO-sharded like any dense weight);
  - ``cp``: CP 4: the GDN conv window and recurrent state carried across the shards
    (``parallelism.context.SequenceShards``), attention's K/V all-gathered;
  - ``folded``: TP 2 x CP 2 x EP 4 over context x tensor: GDN heads split over 'tensor' *inside* the CP
    shard_map, the token rows of both;
  - ``pp``: GPipe over 2 stages, each stack (linear / full attention) its own pipeline, uneven per stack.
  ``fsdp`` and ``tp_ep`` add no Qwen3.5-specific code path over these (plain ZeRO-3 is the reference's own
  path on one device; tp_ep = tp's heads + ep's dispatch), nor does ``ep_etp``: they are not trained for
  Qwen3.5; the same presets are checked for Qwen3-VL above and in test_pipeline.py.
  Also (no compile): every preset validates the Qwen3.5 test config, and the validator's Qwen3.5 checks.

One compile per (family, preset), plus each family's single-device reference, with LLVM optimisations
off (``FAST``): the same partitioned HLO, a third of the compile time on this CPU.
"""

from __future__ import annotations

import dataclasses
import logging
import re

import jax
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.parallelism.validate import LayoutError, validate_layout
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.trainer import Trainer
from tests.families import PerFamily
from tests.parallelism.packed_batch import packed_batch
from tests.xla_options import FAST  # LLVM optimisations off: a third of the compile

# quick compiles (tests/xla_options.py): the one-device reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

PRESETS = {  # per family, the presets trained in the default suite
    "qwen3_vl": ("fsdp", "tp", "ep", "tp_ep", "ep_etp", "cp", "folded"),
    "qwen3_5": ("tp", "ep", "cp", "folded", "pp"),
}
# Qwen3.5's fsdp, tp_ep and ep_etp are not trained here: they add no Qwen3.5-specific path over the presets above
# (the GDN and gated attention shard as under tp / ep / cp; the experts as Qwen3-VL's under tp_ep / ep_etp)
CASES = [(family, name) for family, names in PRESETS.items() for name in names]
ROWS = {"qwen3_vl": 8, "qwen3_5": 16}
SEQ, STEPS = 32, 3
COMPUTE = ComputeConfig(dtype="float32", param_dtype="float32", loss_chunk_size=16)
# Adam with eps 1 is ~SGD for the small gradients here (update ~ lr * gradient): parameters then
# follow the gradients smoothly, and a layout that computes them differently shows in the parameters
OPTIMIZER = OptimizerConfig(lr=0.5, schedule="constant", warmup_steps=0, eps=1.0, weight_decay=0.0, clip_grad_norm=0.0)
METRICS = ("loss", "ce_loss", "grad_norm", "router_aux_loss", "trained_tokens")
# an HLO collective: its result type (one array, or a tuple of them for a combined collective) and op
COLLECTIVE = re.compile(r"= (\(?[a-z0-9]+\[[^=]*?) (all-gather|all-reduce|reduce-scatter|all-to-all)(?:-start)?\(")
ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
LIN, FULL = "linear_attention", "full_attention"


def qwen3_5_test_config():
    """qwen3.5-tiny with a 512-token vocabulary and the layer pattern [lin, lin, full, full]."""
    config = load_model_config("qwen3.5-tiny")
    config = dataclasses.replace(config, image_token_id=500, video_token_id=501, vision_start_token_id=502,
                                 vision_end_token_id=503)
    return config.replace_text(vocab_size=512, layer_types=(LIN, LIN, FULL, FULL))


def _draw_qwen3_vl(rng):
    def draw(path, leaf):  # norm scales ~1, the rest ~N(0, 0.02)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        return 1.0 + 0.1 * noise if "norm" in jax.tree_util.keystr(path) else 0.02 * noise
    return draw


def _draw_qwen3_5(rng):
    def draw(path, leaf):  # (zero-centred) norm scales ~0.1, A_log ~U(-1, 1), the rest ~N(0, 0.02)
        name = jax.tree_util.keystr(path)
        noise = rng.standard_normal(leaf.shape).astype(np.float32)
        if "A_log" in name:
            return rng.uniform(-1.0, 1.0, leaf.shape).astype(np.float32)
        if "linear_attn']['norm" in name:  # the GDN gated norm: a plain (not zero-centred) scale
            return 1.0 + 0.1 * noise
        return 0.1 * noise if "norm" in name else 0.02 * noise
    return draw


FAMILIES = {"qwen3_vl": (lambda: load_model_config("tiny-v512"), _draw_qwen3_vl),
            "qwen3_5": (qwen3_5_test_config, _draw_qwen3_5)}


def random_params(config, draw=_draw_qwen3_vl):
    """Parameters of ``config`` drawn in numpy by ``draw`` (seed 0): no init compile. Also the several-process
    tests' (tests/training/test_multiprocess.py, multiprocess_child.py)."""
    abstract = Trainer.create(config, COMPUTE, load_layout("fsdp"), OPTIMIZER, steps=STEPS,
                              devices=jax.devices()[:1]).abstract_params
    return jax.tree_util.tree_map_with_path(draw(np.random.default_rng(0)), abstract)


def make_setup(family: str):
    """(config, parameters drawn in numpy: no init compile, packed batch) of ``family``."""
    make_config, draw = FAMILIES[family]
    config = make_config()
    return config, random_params(config, draw), packed_batch(config, ROWS[family], SEQ)


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
def setups():
    return PerFamily(make_setup)


@pytest.fixture(scope="module")
def references(setups):
    """One device, per family: the same trainer step's metrics and parameters."""
    return PerFamily(lambda family: train(setups[family], load_layout("fsdp"), devices=jax.devices()[:1])[:2])


@pytest.fixture
def setup(setups, family):
    return setups[family]


@pytest.fixture
def reference(references, family):
    return references[family]


def assert_same_training(got, want, initial):
    (records, params), (ref_records, ref_params) = got, want
    assert ref_records[-1]["loss"] < ref_records[0]["loss"]  # it trains
    for step, (r, ref) in enumerate(zip(records, ref_records, strict=True)):
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


def check_qwen3_5(name: str, hlo: str, logged: list[str]) -> None:
    """Qwen3.5's own code paths, read off the partitioned program and the pipeline's log."""
    if name in ("cp", "folded"):  # GDN under CP: the shards' (transition, final) states [cp, B, Hv, Dk, D]
        cp = 4 if name == "cp" else 2  # all-gathered over 'context', the sequence not gathered for the GDN
        assert re.search(rf"f32\[{cp},\d+,\d+,16,16\][^=]*? all-gather", hlo)
    if name == "pp":  # each stack its own pipeline over the 2 stages
        for text in ("'layers' (layers 0..1) gpipe: 2 stages", "'layers' (layers 2..3) gpipe: 2 stages"):
            assert any(text in m for m in logged), logged


@pytest.mark.parametrize(("family", "name"), CASES)
def test_preset_trains_like_one_device(setup, reference, family, name, caplog):
    with caplog.at_level(logging.INFO, logger="moevlm_jax.parallelism.pipeline"):
        records, params, hlo = train(setup, load_layout(name))
    assert_same_training((records, params), reference, setup[1])
    if family == "qwen3_vl":
        check_hlo(name, hlo, setup[0])
    else:
        check_qwen3_5(name, hlo, [r.getMessage() for r in caplog.records])


@pytest.mark.parametrize("family", ["qwen3_vl"])
def test_kv_heads_replicated_when_tensor_exceeds_them(setup, reference, family):
    """The validator's advice for KV heads < TP works: 2 KV heads, TP 4, kv_heads -> null."""
    tp = load_layout("tp")
    rules = [list(r) for r in tp.rules if r[0] not in ("kv_heads", "act_kv_heads", "vis_heads")]
    rules = [["kv_heads", None], ["act_kv_heads", None], ["vis_heads", None], *rules]
    layout = load_layout({"name": "tp4_kv_replicated", "mesh": {"fsdp": 2, "tensor": 4}, "rules": rules})
    records, _, _ = train(setup, layout)
    for k in METRICS:
        assert records[0][k] == pytest.approx(reference[0][0][k], rel=2e-6, abs=1e-7), k


# ----------------------------------------------------------------------------- Qwen3.5 validation (no compile)

ROWS35 = ROWS["qwen3_5"]


@pytest.mark.parametrize("name", ("fsdp", "tp", "ep", "tp_ep", "ep_etp", "cp", "folded", "pp", "pp_circular", "pp_ep"))
def test_presets_validate_qwen3_5(name):
    """Every preset fits the test config; the released 3:1 pattern (stacks of 3 and 1 layers) is refused
    by the pipeline presets before anything compiles, naming the stacks."""
    validate_layout(qwen3_5_test_config(), load_layout(name), batch_size=ROWS35, seq_len=SEQ, num_devices=8)
    tiny = load_model_config("qwen3.5-tiny")
    if not name.startswith("pp"):
        validate_layout(tiny, load_layout(name), batch_size=ROWS35, seq_len=SEQ, num_devices=8)
        return
    with pytest.raises(LayoutError, match=r"decoder stacks layers 0\.\.2 \(3 linear_attention\), layers 3\.\.3 "
                                          r"\(1 full_attention\) do not divide over the 2 devices of mesh axes "
                                          r"stage=2"):
        validate_layout(tiny, load_layout(name), batch_size=ROWS35, seq_len=SEQ, num_devices=8)


def test_gdn_heads_shared_expert_and_cp_window_are_checked():
    model = qwen3_5_test_config().replace_text(linear_num_key_heads=3, linear_num_value_heads=9,
                                               shared_expert_intermediate_size=33)
    with pytest.raises(LayoutError) as err:
        validate_layout(model, load_layout("tp"), batch_size=ROWS35, seq_len=SEQ, num_devices=8)
    text = str(err.value)
    for want in ("text_config.linear_num_key_heads (GDN query / key heads) = 3 does not divide over the 2 devices of "
                 "mesh axes tensor=2 that logical axis 'q_heads' maps to",
                 "text_config.linear_num_value_heads (GDN value heads) = 9 does not divide over the 2 devices",
                 "text_config.shared_expert_intermediate_size = 33 does not divide over the 2 devices of mesh axes "
                 "tensor=2 that logical axis 'mlp' maps to"):
        assert want in text, text
    with pytest.raises(LayoutError, match=r"leaves 2 tokens a shard, fewer than the 3 the GDN conv window"):
        validate_layout(qwen3_5_test_config(), load_layout("cp"), batch_size=ROWS35, seq_len=8, num_devices=8)
