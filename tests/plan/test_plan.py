"""The planner (``moevlm_jax.plan.search``, ``python -m moevlm_jax.plan``) on 8 CPU host devices.

- Each recompute policy's per-layer residual formulas (``plan_memory.decoder_residuals`` /
  ``vision_residuals``) equal what jax saves for the backward (``saved_residuals`` of the model's
  loss: tracing only, no compile) for the tiny and small models.
- The analytic per-device total is within 10% of XLA's compiled memory analysis (``memory_report``:
  the train step compiled, never run) for tiny and small over several layouts x recompute x MBS
  (``ACCURACY``; the whole calibration set and its errors are in bench/results/plans.md).
- Communication bytes of a hand-checkable case (the FSDP all-gather of a known parameter count, the
  gradient reduce-scatter, the EP all-to-all rows) and the cross-host fractions of mesh groups.
- The ranking puts a fitting candidate first under a small memory limit, and says nothing fits under
  an impossible one; ``fit`` keeps the global batch when it changes MBS (its compiled check of the run it
  is given: tests/plan/test_compiled.py, sharing the compiled plan's step).
- The CLI writes the table, the JSON / CSV and the plot.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.ad_checkpoint import saved_residuals  # as tests/model/test_recompute.py

from moevlm_jax.config import load_config, load_layout
from moevlm_jax.data.batch import batch_shapes
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.loss import lm_loss
from moevlm_jax.model.qwen3_vl_moe import Qwen3VLMoe
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.perf import memory
from moevlm_jax.plan import comm as plan_comm
from moevlm_jax.plan import fit as plan_fit
from moevlm_jax.plan import memory as plan_memory
from moevlm_jax.plan import search as plan
from moevlm_jax.plan.geometry import geometry, shard_table

COMPILE = {"xla_backend_optimization_level": 0}
# quick compiles (tests/xla_options.py) for every compile here: XLA's memory figures with the legacy emitters
# equal the default emitters' within 0.04% (tiny fsdp / pp / fsdp with patches, 2026-12-02), far inside 10%
pytestmark = pytest.mark.usefixtures("legacy_emitters")
SEQ, CHUNK = 512, 64  # a short loss chunk: the activations, not the vocabulary, dominate the step


# ----------------------------------------------------------------------------- residual formulas vs jax


def _stack_residual_bytes(model, compute, rows, seq, patches):
    """Bytes of the residuals the scanned stacks save (jax's own list; no sharding, no compile)."""
    abstract = nnx.eval_shape(lambda: Qwen3VLMoe(model, compute, nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    shapes = batch_shapes(model, rows, seq, patches, 1)
    batch = {k: jax.ShapeDtypeStruct(s[1:], d) for k, (s, d) in shapes.items()}
    batch["positions"] = jax.ShapeDtypeStruct((3, rows, seq), jnp.int32)

    def loss(state, batch):
        m = nnx.merge(graphdef, state)
        hidden, _ = m.hidden_states(batch)
        return lm_loss(hidden, m.lm_head_kernel(), batch["targets"], batch["loss_mask"], compute.loss_chunk_size)[0]

    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a, src in saved_residuals(loss, state, batch)
               if "output of scan" in src and "run_stack" in src)


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_residual_formulas_equal_what_jax_saves(name):
    model = load_model_config(name)
    rows, seq, patches = 2, 128, 64
    policies = [("none", ()), ("selective", ()), ("selective", ("core_attn", "experts")), ("full", ())]
    if name == "tiny":
        policies += [("selective", ("core_attn",)), ("selective", ("moe", "layernorm", "mlp"))]
    g = geometry(model, load_layout("fsdp").rules, {"fsdp": 1}, mbs=rows, seq=seq, patches=patches)
    t, v = model.text_config, model.vision_config
    for mode, modules in policies:
        compute = ComputeConfig(recompute=mode, recompute_modules=modules, loss_chunk_size=CHUNK)
        knobs = dataclasses.replace(plan_memory.MemoryKnobs.from_compute(compute), residual_upcast=False)
        shards = shard_table(model, "float32", False, g.rules, g.shape)
        text = _stack_residual_bytes(model, compute, rows, seq, 0)
        vision = _stack_residual_bytes(model, compute, rows, seq, patches) - text
        want_text = sum(plan_memory.decoder_residuals(model, g, knobs).values()) * t.num_hidden_layers
        want_vision = sum(plan_memory.vision_residuals(model, g, knobs).values()) * v.depth
        if mode == "none":  # the scan also saves each layer's weights as used (compute dtype)
            want_text += plan_memory._layer_weights(shards, "language_model/stacks/") * t.num_hidden_layers * 2
            want_vision += plan_memory._layer_weights(shards, "visual/blocks/") * v.depth * 2
        assert want_text == pytest.approx(text, rel=0.005), (name, mode, modules)
        assert want_vision == pytest.approx(vision, rel=0.005), (name, mode, modules)


# ----------------------------------------------------------------------------- analytic vs compiled


ACCURACY = [  # (model, layout, recompute, modules, mbs, patches); every one <= 10% of XLA's total
    ("tiny", "fsdp", "none", (), 2, 0),
    ("tiny", "tp_ep", "selective", ("core_attn",), 2, 0),
    ("tiny", "pp", "selective", ("core_attn",), 2, 0),
    ("small", "fsdp", "selective", ("core_attn", "experts"), 2, 0),
    ("small", "tp_ep", "none", (), 1, 0),
    ("tiny", "fsdp", "selective", (), 2, 256),
]


@pytest.mark.parametrize("name,layout,mode,modules,mbs,patches", ACCURACY)
def test_analytic_memory_within_10_percent_of_xla(name, layout, mode, modules, mbs, patches):
    model, lay = load_model_config(name), load_layout(layout)
    compute = ComputeConfig(recompute=mode, recompute_modules=modules, loss_chunk_size=CHUNK)
    report = memory.memory_report(model, lay, compute, mbs=mbs, seq_len=SEQ, patches=patches, compiler_options=COMPILE)
    g = geometry(model, lay.rules, lay.resolved_mesh_shape(8), mbs=mbs, seq=SEQ, patches=patches, options=lay.options)
    est = plan_memory.estimate_memory(model, g, plan_memory.MemoryKnobs.from_compute(compute, platform="cpu"))
    err = est.total / report["total_bytes"] - 1
    assert abs(err) <= 0.10, (f"{name} {layout} {mode} {modules} MBS {mbs}: analytic {est.total / 2**20:.1f} MiB vs "
                              f"XLA {report['total_bytes'] / 2**20:.1f} MiB ({err:+.1%}); parts "
                              + str({k: round(v / 2**20, 1) for k, v in est.parts.items() if v}))
    # the state is exactly the compiled step's donated argument
    state = est.parts["params"] + est.parts["optimizer"]
    assert state == pytest.approx(report["alias_bytes"], rel=0.01)


def test_a_bfloat16_gradient_sum_saves_what_the_estimate_says():
    """Unrolled layers, bf16 parameters, two microbatches: XLA's saving from a bf16 gradient sum
    (optimizer.grad_accum_dtype) against the float32 one within a third of the analytic saving (2 bytes a
    trainable parameter for the sum). Measured 2026-12-01: tiny, 2.4 MiB compiled vs 2.6 estimated. (The
    totals of bf16 parameters on XLA:CPU are not among the 10% cases above: its LM head there.)"""
    from moevlm_jax.training.config import OptimizerConfig

    model, lay = load_model_config("tiny"), load_layout("fsdp")
    compute = ComputeConfig(recompute="selective", recompute_modules=(), loss_chunk_size=CHUNK, scan_layers=False,
                            dtype="bfloat16", param_dtype="bfloat16")
    g = geometry(model, lay.rules, lay.resolved_mesh_shape(8), mbs=2, seq=SEQ, patches=0, options=lay.options)
    totals = {}
    for accum in ("float32", "bfloat16"):
        opt = OptimizerConfig(state_dtype="bfloat16", grad_accum_dtype=accum)
        report = memory.memory_report(model, lay, compute, mbs=2, seq_len=SEQ, patches=0, grad_accum=2, optimizer=opt,
                                      compiler_options=COMPILE)
        knobs = plan_memory.MemoryKnobs.from_compute(compute, state_dtype="bfloat16", grad_accum=2, accum_dtype=accum,
                                                     platform="cpu")
        est = plan_memory.estimate_memory(model, g, knobs)
        totals[accum] = (est.total, report["total_bytes"], est.parts["gradients"])
    saved_est = totals["float32"][0] - totals["bfloat16"][0]
    saved_xla = totals["float32"][1] - totals["bfloat16"][1]
    assert totals["bfloat16"][2] * 2 == totals["float32"][2]  # the sum's bytes halve
    assert saved_est > 0 and saved_xla == pytest.approx(saved_est, rel=0.34), (saved_est / 2**20, saved_xla / 2**20)


# ----------------------------------------------------------------------------- communication


def test_fsdp_gather_and_reduce_scatter_bytes_by_hand():
    """tiny (text only) under FSDP over 8: every weight with an ``embed`` dimension is gathered twice a
    microbatch (forward, recomputed backward) in bf16, the embedding table once, for the tied LM head, in
    float32 (the lookup gathers the int32 ids of the 8 devices and exchanges float32 rows by all-to-all,
    forward and backward); the gradients reduce-scattered in float32; a device receives 7/8 of each."""
    model = load_model_config("tiny")
    t = model.text_config
    h, l, nq, nkv, d, e, i = 64, 4, 4, 2, 16, 8, 24
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
            t.num_experts, t.moe_intermediate_size) == (h, l, nq, nkv, d, e, i)
    per_layer = h * nq * d + 2 * h * nkv * d + nq * d * h + h * e + e * h * 2 * i + e * i * h  # q k v o gate experts
    stacks, table = l * per_layer, t.vocab_size * h
    assert stacks == 198_656
    lay = load_layout("fsdp")
    g = geometry(model, lay.rules, {"fsdp": 8}, mbs=2, seq=SEQ, patches=0)
    knobs = plan_memory.MemoryKnobs(recompute="selective")
    comm = plan_comm.step_communication(model, g, knobs, devices_per_host=8)
    tokens = 2 * SEQ  # a device's rows
    lookup = 8 * tokens * 4 + 2 * tokens * h * 4  # ids gathered, rows all-to-all
    assert comm.by_kind["fsdp_gather"]["fsdp"] == pytest.approx(7 / 8 * (2 * 2 * stacks + 4 * table + lookup))
    norms = l * (2 * h + 2 * d) + h  # replicated: their gradients are all-reduced (2 x 7/8)
    assert comm.by_kind["grad_reduce"]["fsdp"] == pytest.approx(7 / 8 * 4 * (stacks + table) + 2 * 7 / 8 * 4 * norms)
    assert comm.total_cross() == 0  # one host
    # recompute none keeps the forward's gathered copies: one gather a microbatch
    none = plan_comm.step_communication(model, g, dataclasses.replace(knobs, recompute="none"), 8)
    assert none.by_kind["fsdp_gather"]["fsdp"] == pytest.approx(7 / 8 * (2 * stacks + 4 * table + lookup))


def test_expert_all_to_all_rows_and_cross_host_groups():
    model = load_model_config("tiny")
    lay = load_layout("ep")  # fsdp 2 x expert 4: each device routes MBS x S tokens x top-2
    g = geometry(model, lay.rules, lay.resolved_mesh_shape(8), mbs=2, seq=SEQ, patches=0)
    comm = plan_comm.step_communication(model, g, plan_memory.MemoryKnobs(), devices_per_host=8)
    rows = 2 * SEQ * 2
    assert comm.by_kind["ep"]["expert"] == pytest.approx(4 * rows * 64 * 2 * 3 / 4 * 4)  # 4 a2a x 4 layers x 3/4
    # device order follows the mesh axes (tensor innermost): within a host, across, partly across
    assert plan_comm.cross_host_fraction({"data": 2, "fsdp": 8}, ("fsdp",), 8) == 0.0
    assert plan_comm.cross_host_fraction({"data": 2, "fsdp": 8}, ("data",), 8) == 1.0
    assert plan_comm.cross_host_fraction({"fsdp": 16}, ("fsdp",), 8) == pytest.approx(8 / 15)
    assert plan_comm.cross_host_fraction({"fsdp": 4, "expert": 4}, ("expert",), 8) == 0.0
    two = plan_comm.step_communication(model, geometry(model, lay.rules, {"fsdp": 2, "expert": 4}, mbs=2, seq=SEQ,
                                                       patches=0), plan_memory.MemoryKnobs(), devices_per_host=4)
    assert two.cross["ep"] == {}
    assert two.cross["fsdp_gather"]["fsdp"] == pytest.approx(two.by_kind["fsdp_gather"]["fsdp"])


def test_hierarchical_dispatch_cross_host_bytes_by_formula():
    """EP over 2 hosts (ep_multinode: fsdp 2 x expert 4, 4 devices a host): the flat exchange's cross-host bytes
    and the hierarchical dispatcher's (each token once per remote host it needs, plus its routing), by hand."""
    assert plan_comm.remote_hosts_per_token(8, 4, 2) == pytest.approx(1 - 1 / 70)  # all 4 on the own host: 1 in 70
    assert plan_comm.remote_hosts_per_token(8, 2, 1) == 0.0
    flat, hier = plan_comm.hierarchical_ep_cross(1000, 4096, 128, 8, 2)  # top-8 of 128 over 2 hosts, 4 KiB rows
    assert flat / hier == pytest.approx(4.0, rel=0.05)  # ~4 remote experts on ~1 remote host a token
    model = load_model_config("tiny")
    t = model.text_config
    lay = load_layout("ep_multinode")
    g = geometry(model, lay.rules, lay.resolved_mesh_shape(8), mbs=2, seq=SEQ, patches=0)
    comm = plan_comm.step_communication(model, g, plan_memory.MemoryKnobs(), devices_per_host=4)
    layers = sum(k == "moe" for k in t.layer_kinds)
    tokens, k, e, row = 2 * SEQ, t.num_experts_per_tok, t.num_experts, t.hidden_size * 2
    assert comm.total_cross("ep") == pytest.approx(4 * tokens * k * row / 2 * layers)  # half the peers remote
    d = 1 - math.comb(e - e // 2, k) / math.comb(e, k)
    assert comm.ep_cross_hierarchical == pytest.approx(tokens * d * (4 * row + 16 * k) * layers)
    one_host = plan_comm.step_communication(model, g, plan_memory.MemoryKnobs(), devices_per_host=8)
    assert one_host.ep_cross_hierarchical == 0 and one_host.total_cross("ep") == 0


# ----------------------------------------------------------------------------- ranking and the fit API


def _workload(limit_gib):
    return plan.Workload(model=load_model_config("tiny"), devices=8, seq=SEQ, global_batch=32, patches=256,
                         device_memory_gib=limit_gib, platform="cpu", loss_chunk=CHUNK)


def test_ranking_puts_a_fitting_candidate_first_and_says_when_nothing_fits():
    kw = dict(presets=("fsdp", "tp_ep", "ep", "pp"), dtypes=(("float32", "float32"),))
    every = plan.plan(_workload(1000.0), **kw)
    sizes = sorted(e.memory.total for e in every)
    limit = sizes[len(sizes) // 3] / 2**30 / plan.H200.usable_fraction  # a third of the candidates fit
    ranked = plan.plan(_workload(limit), **kw)
    assert ranked[0].fits and not all(e.fits for e in ranked)
    fitting = [e for e in ranked if e.fits]
    assert [e.tokens_per_s for e in fitting] == sorted((e.tokens_per_s for e in fitting), reverse=True)
    assert all(e.memory.total <= ranked[0].limit_bytes for e in fitting)
    for e in ranked:  # the global batch is kept: MBS x grad_accum x data-parallel size
        g = plan.candidate_geometry(e.candidate, _workload(limit))
        assert e.candidate.mbs * e.candidate.grad_accum * g.dp == 32
    from moevlm_jax.plan import report as plan_report

    text = plan_report.recommendation(ranked, _workload(limit))
    assert text.startswith("Fastest fitting:") and "FSDP first" in text
    none = plan.plan(_workload(1e-4), **kw)
    assert none and not any(e.fits for e in none)
    assert plan_report.recommendation(none, _workload(1e-4)).startswith("Nothing fits")


def _config(*extra):
    return load_config("cpu-default", model="tiny", overrides=[
        f"train.seq_len={SEQ}", "train.global_batch_size=32", "train.micro_batch_size=4", "compute.dtype=bfloat16",
        f"compute.loss_chunk_size={CHUNK}", "data.patch_buckets=[256]", *extra])


def test_fit_says_what_to_change_and_keeps_the_global_batch():
    cfg = _config()
    fits = plan_fit.fit(cfg, jax.devices(), device_memory_gib=100.0, compile=False)
    assert fits.fits and fits.change == [] and fits.reason.startswith("fits")
    tight = plan_fit.fit(cfg, jax.devices(), device_memory_gib=fits.current.memory.total / 2**30 * 0.75, compile=False)
    assert not tight.fits and tight.change, tight.reason
    changed = _config(*tight.change)  # later overrides win: the change's MBS / grad_accum replace the base's
    assert changed.global_batch_size == 32  # the overrides load, and the global batch is the same
    again = plan_fit.fit(changed, jax.devices(), device_memory_gib=fits.current.memory.total / 2**30 * 0.75,
                         compile=False)
    assert again.fits, again.reason
    nothing = plan_fit.fit(cfg, jax.devices(), device_memory_gib=1e-4, compile=False)
    assert not nothing.fits and nothing.change == [] and nothing.table and "Nothing" in nothing.reason


# ----------------------------------------------------------------------------- the CLI


def test_cli_writes_table_json_and_plot(tmp_path, capsys):
    from moevlm_jax.plan import cli

    out = tmp_path / "plan"
    rc = cli.main(["--model", "tiny", "--devices", "8", "--hosts", "2", "--seq-len", str(SEQ), "--global-batch", "32",
                   "--patches", "0", "--device-memory", "0.5", "--layouts", "fsdp,tp_ep,ep", "--dtypes",
                   "float32/float32", "--experts", "dropless", "--top", "5", "--out", str(out),
                   f"compute.loss_chunk_size={CHUNK}"])
    assert rc == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].startswith("plan: tiny on 8 x H200 (2 hosts")
    assert lines[1].split()[:4] == ["#", "fits", "layout", "mesh"]
    assert "Fastest fitting:" in text or "Nothing fits" in text
    assert "Per host" in text and "across hosts" in text
    rows = json.loads((out / "results.json").read_text())
    assert rows and {"fits", "step_s", "tokens_per_s", "memory_gib", "comm_by_axis", "cross_host_gb"} <= set(rows[0])
    assert (out / "plan.png").stat().st_size > 10_000 and (out / "results.csv").exists()
    assert (out / "plan.txt").read_text().startswith("plan: tiny")
    assert any(r["cross_host_gb"] > 0 for r in rows)  # 2 hosts of 4: FSDP over 8 crosses them
    assert math.isclose(sum(r["fits"] for r in rows), sum(1 for r in rows if r["memory_gib"] <= 0.5 * 0.95), abs_tol=0)


def test_cli_compiles_for_more_devices_than_the_process_has(tmp_path):
    """``--devices 16 --hosts 2 --compile`` in a process with no device count set: the CLI makes the 16 devices
    before jax starts (CPU host devices here; on a GPU machine JAX's mock GPU topology, plan.compiled) and
    attaches XLA's memory analysis of the leading candidate's step, compiled on a mesh over the two hosts."""
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count"))
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    out = tmp_path / "plan"
    proc = subprocess.run([sys.executable, "-m", "moevlm_jax.plan", "--model", "tiny-v512", "--devices", "16",
                           "--hosts", "2", "--compile", "--compile-top", "1", "--top", "2", "--layouts", "fsdp",
                           "--seq-len", "64", "--patches", "0", "--global-batch", "16", "--max-mbs", "1",
                           "--dtypes", "bfloat16/bfloat16", "--experts", "dropless", "--platform", "cpu",
                           "--out", str(out)], env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("plan: tiny-v512 on 16 x H200 (2 hosts"), proc.stdout[:500]
    compiled = [line for line in proc.stdout.splitlines() if line.startswith("compiled: ")]
    assert len(compiled) == 1 and "data2 fsdp8" in compiled[0] and "XLA (cpu)" in compiled[0], compiled
    rows = json.loads((out / "results.json").read_text())
    first = rows[0]
    assert first["compiled_platform"] == "cpu" and first["compiled_gib"] > 0 and not first["compiled_error"], first
    # XLA:CPU's step beside the analytic estimate for the same backend (the 10% check: the accuracy test above)
    assert 0.5 < first["analytic_same_backend_gib"] / first["compiled_gib"] < 2, first
