"""``bench.hf_step``, the HF peer of ``python -m bench.step --peer hf``, for Qwen3.5-MoE (qwen3.5-tiny, float32
on CPU): transformers' ``Qwen3_5MoeForConditionalGeneration`` from our initial weights (written by
``hf.save_pretrained``) trained on our batches to our losses, step by step; what it records about
HF's Gated DeltaNet code; HF's GDN on packed rows (its state leaks across samples, attention does
not); the clear error when transformers lacks Qwen3.5. The Qwen3-VL peer, and the compiled mode of
both families: test_bench.py.

Shapes: one device, rows of 48 tokens holding one sample each (square 128 px images, 64 patches, and
a 64-patch bucket: a second sample never fits a row), so HF's GDN computes what ours does and the
losses agree to float32 rounding; two steps (the second on updated weights on both sides).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import yaml

from bench import hf_step as bench_hf
from bench import step as bench
from bench.hf_step import load_steps
from moevlm_jax.config import CONFIG_DIR

SEQ_LEN, WARMUP, STEPS = 48, 0, 2


def _recipe(tmp) -> str:
    data = yaml.safe_load((CONFIG_DIR / "data" / "vqa.yaml").read_text())
    data.pop("description")
    data["source"] = {**data["source"], "num_train": 16, "num_heldout": 4, "image_size": [128, 128], "aspect": [1.0,
                                                                                                                1.0]}
    data.update(image={"min_pixels": 4096, "max_pixels": 16384}, patch_buckets=[64], cache_dir=str(tmp / "cache"),
                tokenizer="qwen3.5")
    recipe = {"name": "bench-qwen35-test", "model": "qwen3.5-tiny", "layout": "fsdp", "data": data,
              "compute": {"dtype": "float32", "param_dtype": "float32"},
              "optimizer": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.01},
              "train": {"steps": 100, "micro_batch_size": 1, "seq_len": SEQ_LEN}}
    (tmp / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return str(tmp / "recipe.yaml")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench35")
    out = tmp / "bench.json"
    with pytest.MonkeyPatch.context() as mp:  # our side's process: unoptimised XLA:CPU code compiles ~2x faster
        mp.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0")
        rc = bench.main(["--recipe", _recipe(tmp), "--devices", "1", "--warmup", str(WARMUP), "--steps", str(STEPS),
                         "--peer", "hf", "--work-dir", str(tmp / "work"), "--out", str(out), "--quiet"])
    return rc, json.loads(out.read_text())


def test_hf_qwen3_5_trains_our_batches_to_our_losses(run):
    rc, result = run
    assert rc == 0
    info = result["peer"]["info"]
    assert info["family"] == "qwen3_5_moe" and info["model_class"] == "Qwen3_5MoeForConditionalGeneration"
    assert info["dtype"] == "float32" and info["modes"] == ["eager"] and info["experts"] == "grouped_mm"
    (ours,) = result["runs"]
    (hf,) = result["peer"]["runs"]
    batches = load_steps(ours["batch_dir"])
    assert len(batches) == WARMUP + STEPS
    # one sample per row (the loss check needs it: module docstring), and the peer says so per step
    assert all(int(b["segment_ids"].max()) == 1 for b in batches)
    assert hf["packed_per_step"] == [False] * len(batches) == [bench_hf.packed(b) for b in batches]
    assert hf["useful_tokens"] == ours["useful_tokens"] and hf["timed"] == ours["timed"]
    loss = ours["vs_hf"]["loss"]
    assert loss["ours"] == ours["ce_loss_per_step"] and len(loss["hf"]) == WARMUP + STEPS
    # same initial weights, same batches, same AdamW steps: the same losses (float32), step by step;
    # CE + router aux loss too. Measured: first step 7.8e-8 relative (a packed row differs by 4e-4)
    assert loss["first_rel_diff"] < 1e-6 and loss["max_rel_diff"] < 1e-5, loss
    assert loss["max_rel_diff_objective"] < 1e-5 and loss["all_steps_agree"]
    assert loss["ours"][-1] < loss["ours"][0]  # it trains: the second step sees updated weights on both sides


def test_the_gdn_code_hf_ran_is_recorded(run):
    """info["gdn"]: fla's kernel when flash-linear-attention is installed, else transformers' PyTorch
    reference; which one, read from the loaded modeling module, by function."""
    _, result = run
    info = result["peer"]["info"]
    from importlib.util import find_spec

    fla = find_spec("fla") is not None
    assert info["gdn"] == ("fla" if fla else "torch")
    rule = info["gdn_functions"]["torch_chunk_gated_delta_rule"]
    assert rule["package_installed"] == fla and rule["kind"] == info["gdn"]
    if not fla:
        assert rule["implementation"] == ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe."
                                          "torch_chunk_gated_delta_rule")
    conv = info["gdn_functions"]["causal_conv1d_fn"]
    assert conv["kind"] == ("causal_conv1d" if find_spec("causal_conv1d") else "torch")
    assert "packed" in info["packed_rows"]


def test_gdn_implementation_reads_the_resolved_function():
    """By hand: a wrapper whose closure holds another package's function is reported as that package's;
    one holding transformers' own is "torch"; Qwen3-VL's module has no GDN."""
    def make(implementation):  # transformers' wrapper keeps the resolved function as `implementation`
        def wrapped(*a):
            return implementation(*a)
        return wrapped

    def fla_rule():
        pass

    fla_rule.__module__, fla_rule.__qualname__ = "fla.ops.gated_delta_rule", "chunk_gated_delta_rule"

    def torch_conv():
        pass

    torch_conv.__module__ = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"
    module = type("M", (), {"torch_chunk_gated_delta_rule": staticmethod(make(fla_rule)),
                            "causal_conv1d_fn": staticmethod(make(torch_conv))})
    got = bench_hf.gdn_implementation(module)
    assert got["gdn"] == "fla"
    assert got["torch_chunk_gated_delta_rule"]["implementation"] == "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    assert got["causal_conv1d_fn"]["kind"] == "torch"

    def as_module(func):  # transformers 5.25 with the `kernels` package: a module whose forward calls the wrapper
        def forward(self, *a):
            return func(*a)
        return type("Func", (), {"forward": forward})()

    module = type("M", (), {"torch_chunk_gated_delta_rule": as_module(make(fla_rule)),
                            "causal_conv1d_fn": as_module(make(torch_conv))})
    got = bench_hf.gdn_implementation(module)
    assert got["gdn"] == "fla" and got["causal_conv1d_fn"]["kind"] == "torch"
    assert got["torch_chunk_gated_delta_rule"]["implementation"] == "fla.ops.gated_delta_rule.chunk_gated_delta_rule"
    from transformers.models.qwen3_vl_moe import modeling_qwen3_vl_moe

    assert bench_hf.gdn_implementation(modeling_qwen3_vl_moe) == {}


def test_hf_gdn_state_leaks_across_packed_samples():
    """What the bench_hf docstring says about packed rows, on HF itself (float32): a row packing samples
    A (7 tokens) and B (9) with the text-position row restarting at B, as hf_batch builds it. With
    full attention only, B's logits equal B run alone (the block-diagonal mask from the positions);
    with GDN layers they do not (B starts from A's recurrent state and conv window); A's are B-free
    (causal) in both."""
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 400, 7), rng.integers(0, 400, 9)
    seg = np.array([[1] * 7 + [2] * 9])
    pos = bench_hf.text_positions(seg)
    packed_ids = torch.tensor(np.concatenate([a, b])[None])
    packed_pos = torch.tensor(np.concatenate([pos[None], np.broadcast_to(pos, (3, 1, 16))]))  # [4, 1, 16]

    def logits(model, ids, positions=None):
        with torch.no_grad():
            return model(input_ids=ids, position_ids=positions, use_cache=False).logits[0].numpy()

    from tests.model.qwen3_5_reference import tiny_hf

    for layers, leaks in ((["full_attention"] * 2, False), (["linear_attention", "full_attention"], True)):
        model = tiny_hf(layers)
        both = logits(model, packed_ids, packed_pos)
        alone_a, alone_b = logits(model, torch.tensor(a[None])), logits(model, torch.tensor(b[None]))
        scale = np.abs(alone_b).max()
        # float32 rounding apart (other shapes: other summation orders), A is B-free and, without GDN, B A-free
        assert np.abs(both[:7] - alone_a).max() < 1e-5 * scale
        diff = np.abs(both[7:] - alone_b).max() / scale
        assert (diff > 1e-2) if leaks else (diff < 1e-5), (layers, diff)


def test_a_transformers_without_qwen3_5_is_refused_by_name(monkeypatch, tmp_path, capsys):
    """No transformers.models.qwen3_5_moe: a PeerError naming the version (the peer exits 2), no fallback."""
    import transformers

    monkeypatch.setitem(bench_hf.HF_MODELS, "qwen3_5_moe",
                        ("transformers.models.qwen3_5_moe_absent.modeling", "Qwen3_5MoeForConditionalGeneration"))
    with pytest.raises(bench_hf.PeerError, match=f"transformers {transformers.__version__} has no "
                                                 "transformers.models.qwen3_5_moe_absent"):
        bench_hf.hf_modeling("qwen3_5_moe")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    (tmp_path / "spec.json").write_text(json.dumps({"model_dir": str(tmp_path / "model")}))
    assert bench_hf.main(["--spec", str(tmp_path / "spec.json"), "--out", str(tmp_path / "out.json")]) == 2
    assert "qwen3_5_moe_absent" in capsys.readouterr().err
    assert bench_hf.family_of_dir(tmp_path / "model") == "qwen3_5_moe"



def test_a_failing_compiled_run_is_a_result_and_a_failing_eager_run_an_error(monkeypatch, tmp_path):
    """bench_hf.main: a torch.compile run that raises (e.g. inductor on HF's PyTorch GDN loop) is recorded
    as status "error" with its message, the model is reset and the next run goes on; the eager run, whose
    losses are the check, is not caught. A stand-in Peer: compile raises, eager returns figures."""
    calls = []

    class FakePeer:
        torch, cuda, dtype, fused, versions = torch, False, torch.float32, False, {}
        family, model_class, experts, gdn = "qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "grouped_mm", {}

        def __init__(self, spec):
            pass

        def reset(self):
            calls.append("reset")

        def recover(self):
            calls.append("recover")

        def run(self, run, mode):
            calls.append((run["name"], mode))
            if mode == "compile" or run.get("eager_fails"):
                raise RuntimeError("inductor failed\nsecond line")
            return {"name": run["name"], "side": f"hf-{mode}", "mode": mode, "step_time_s": 0.5, "tokens_per_s": 2.0}

    monkeypatch.setattr(bench_hf, "Peer", FakePeer)
    spec, out = tmp_path / "spec.json", tmp_path / "out.json"
    spec.write_text(json.dumps({"compile": "on", "runs": [{"name": "a"}, {"name": "b"}]}))
    assert bench_hf.main(["--spec", str(spec), "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["name"], r["mode"], r.get("status", "ok")) for r in results] == [
        ("a", "eager", "ok"), ("a", "compile", "error"), ("b", "eager", "ok"), ("b", "compile", "error")]
    assert results[1]["message"] == "RuntimeError: inductor failed"
    assert calls == ["reset", ("a", "eager"), ("a", "compile"), "recover", "reset", ("b", "eager"), ("b", "compile"),
                     "recover"]
    spec.write_text(json.dumps({"compile": "on", "runs": [{"name": "a", "eager_fails": True}]}))
    with pytest.raises(RuntimeError, match="inductor failed"):
        bench_hf.main(["--spec", str(spec), "--out", str(out)])
