"""Run settings: layering, CLI overrides, near-miss errors, cross-field rules, config.yaml round trip,
the schema's own help."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import yaml

from moevlm_jax.config import run as recipe
from moevlm_jax.config.run import ConfigError, load_config
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.training.config import OptimizerConfig

FSDP = str(recipe.CONFIG_DIR / "layouts" / "fsdp.yaml")


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """A model, a data config and a recipe in tmp_path (so the test does not depend on presets)."""
    model = tmp_path / "m.yaml"
    tiny = yaml.safe_load((recipe.CONFIG_DIR / "models" / "tiny.yaml").read_text())
    model.write_text(yaml.safe_dump({**tiny, "name": "m", "text_config": {**tiny["text_config"],
                                                                          "num_hidden_layers": 4},
                                     "vision_config": {**tiny["vision_config"], "depth": 2,
                                                       "deepstack_visual_indexes": [1]}}))
    data = tmp_path / "d.yaml"
    data.write_text(yaml.safe_dump({"name": "d", "source": {"kind": "mock"}, "seq_len": 1024, "batch_size": 8,
                                    "patch_buckets": [256]}))
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({
        "name": "r",
        "model": {"base": str(model), "text_config": {"num_hidden_layers": 2}},
        "layout": FSDP, "data": str(data),
        "compute": {"dtype": "float32"},
        "optimizer": {"lr": "1e-3", "warmup_steps": 5},
        "train": {"steps": 50, "micro_batch_size": 2},
    }))
    return {"model": model, "data": data, "recipe": rec}


def _error(recipe_path: Path, *overrides: str, **kw) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(recipe_path, overrides=list(overrides), num_devices=kw.pop("num_devices", 8),
                    num_processes=1, **kw)
    return str(e.value)


def test_layering_defaults_recipe_files_cli(files):
    cfg = load_config(files["recipe"], overrides=["optimizer.lr=1e-4", "train.grad_accum=3",
                                                  "model.text_config.moe_intermediate_size=32",
                                                  "compute.dtype=bfloat16"],
                      steps=7, num_devices=8, num_processes=1)
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.lr, float)  # CLI over recipe ('1e-4' -> float)
    assert cfg.optimizer.warmup_steps == 5  # recipe over default
    assert cfg.optimizer.b2 == OptimizerConfig().b2  # default
    assert cfg.train.steps == 7  # --steps over recipe
    text = cfg.model.text_config  # file < recipe < CLI
    assert (text.moe_intermediate_size, text.num_hidden_layers, text.hidden_size) == (32, 2, 64)
    assert cfg.model.vision_config.depth == 2
    # the default compute, but for the vision band derived from the data's images (test_attention_window.py)
    from moevlm_jax.model.compute import AttentionOptions

    assert cfg.compute.attention_options.vision_max_image_patches > 0
    assert cfg.compute.replace(attention_options=AttentionOptions()) == ComputeConfig(dtype="bfloat16")
    assert cfg.layout.name == "fsdp" and cfg.data_parallel_size == 8
    # global batch = MBS 2 x accum 3 x DP 8; the data section is derived from the train section
    assert cfg.global_batch_size == 48 and cfg.train.global_batch_size == 48
    assert cfg.data.seq_len == cfg.train.seq_len == 4096 and cfg.data.batch_size == 48
    assert cfg.data.balance_group == 2  # the rows of one microbatch of one data-parallel rank


def test_cli_arguments_and_references(files, tmp_path):
    parser = argparse.ArgumentParser()
    recipe.add_arguments(parser)
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({**yaml.safe_load(files["model"].read_text()), "name": "other"}))
    args = parser.parse_args(["--recipe", str(files["recipe"]), "--model", str(other), "--run-dir", "x/y",
                              "--resume", "train.seed=3", "train.freeze_vision_model=true"])
    cfg = recipe.from_args(args, num_devices=1)
    assert cfg.model.name == "other" and cfg.model.text_config.num_hidden_layers == 4  # --model replaces the recipe's
    assert cfg.train.run_dir == "x/y" and cfg.run_dir == Path("x/y") and cfg.train.resume is True
    assert cfg.train.seed == 3 and cfg.train.freeze_vision_model is True
    cfg2 = load_config(files["recipe"], overrides=[f"model={other}"], num_devices=1, num_processes=1)
    assert cfg2.model == cfg.model  # model=PATH is the same as --model PATH


@pytest.mark.parametrize("override, expected", [
    ("optimizer.lrr=1", "unknown key 'optimizer.lrr'; did you mean 'lr'?"),
    ("train.micro_batch=2", "did you mean 'micro_batch_size'?"),
    ("optimiser.lr=1", "unknown setting 'optimiser.lr'; did you mean 'optimizer'?"),
    ("train.steps=abc", "train.steps: expected int, got str 'abc'"),
    ("train.steps=2.5", "train.steps: expected int, got float 2.5"),
    ("train.async_checkpointing=3", "train.async_checkpointing: expected bool, got int 3"),
    ("optimizer.schedule=cosin", "'cosin' is not one of ['cosine', 'linear', 'constant']; did you mean 'cosine'?"),
    ("model.text_config.hiden_size=3", "unknown key 'model.text_config.hiden_size'; did you mean 'hidden_size'?"),
    ("layout.mesh.fsdb=2", "unknown mesh axis 'layout.mesh.fsdb'; did you mean 'fsdp'?"),
    ("layout.mesh.tensr=2", "unknown mesh axis 'layout.mesh.tensr'; did you mean 'tensor'?"),
    ("data.seq_len=128", "'data.seq_len' is derived from the train section; set train.seq_len"),
    ("train.steps", "is not key=value"),
])
def test_bad_settings_name_the_key(files, override, expected):
    assert expected in _error(files["recipe"], override)


def test_hf_spellings_of_model_keys_are_read(files):
    """HF's alternative spellings (v4 rope_theta) are read into the field they stand for."""
    cfg = load_config(files["recipe"], overrides=["model.text_config.rope_theta=10000"], num_devices=1, num_processes=1)
    assert cfg.model.text_config.rope_theta == 10000


def test_a_present_key_with_a_prefix_word_is_not_a_typo(files):
    """compute.attention_options' per-tower keys (vision_max_segments next to max_segments); a real
    typo beside them is still named."""
    keys = ["compute.attention_options.max_segments=2", "compute.attention_options.vision_max_segments=4",
            "compute.attention_options.vision_pad_head_dim=128"]
    cfg = load_config(files["recipe"], overrides=keys, num_devices=1, num_processes=1)
    opts = cfg.compute.attention_options
    assert (opts.max_segments, opts.vision_max_segments, opts.vision_pad_head_dim) == (2, 4, 128)
    assert "did you mean 'max_segments'" in _error(files["recipe"], keys[0], "compute.attention_options.max_segmnets=3")
    # a present key with a word after it: compute.capture_scopes next to a recipe's compute.capture
    cfg = load_config(files["recipe"], overrides=["compute.capture=scopes", "compute.capture_scopes=[full_iteration]"],
                      num_devices=1, num_processes=1)
    assert cfg.compute.capture_scopes == ("full_iteration",)
    assert "did you mean 'capture'" in _error(files["recipe"], "compute.capture=none", "compute.captur=scopes")


def test_all_errors_reported_together(files):
    msg = _error(files["recipe"], "optimizer.lrr=1", "train.stepz=3")
    assert "optimizer.lrr" in msg and "train.stepz" in msg and "'steps'" in msg


def test_missing_named_config_suggests(files):
    with pytest.raises(ConfigError, match=r"no models config 'tinyy'.*did you mean 'tiny'"):
        load_config(files["recipe"], model="tinyy", num_devices=1, num_processes=1)


def test_cross_field_rules(files, caplog):
    # the global batch is fixed, the accumulation derived (Megatron): 8 devices, MBS 2, global batch 32 ->
    # grad_accum 2; given both, they must agree, and the message says what to set
    ok = load_config(files["recipe"], overrides=["train.global_batch_size=32"], num_devices=8, num_processes=1)
    assert (ok.global_batch_size, ok.train.grad_accum, ok.train.micro_batch_size) == (32, 2, 2)
    # a host's rows split into grad_accum x its data-parallel ranks: 2 processes hold 16 rows of 4 ranks each
    two = load_config(files["recipe"], overrides=["train.global_batch_size=32"], num_devices=8, num_processes=2)
    assert (two.data.batch_size, two.data.balance_group) == (16, 2)
    msg = _error(files["recipe"], "train.global_batch_size=32", "train.grad_accum=1")
    assert "train.global_batch_size=32 but micro_batch_size 2 x grad_accum 1 x data-parallel size 8 = 16" in msg
    assert "set train.grad_accum=2" in msg
    assert "not a multiple of micro_batch_size 2 x data-parallel size 8 = 16" in _error(
        files["recipe"], "train.global_batch_size=40")
    # no micro batch given: the global batch split over the data-parallel ranks
    free = load_config(files["recipe"], overrides=["train.global_batch_size=16", "train.micro_batch_size=null"],
                       num_devices=8, num_processes=1)
    assert (free.train.micro_batch_size, free.train.grad_accum) == (2, 1)
    assert "does not divide over data-parallel size 8" in _error(files["recipe"], "train.global_batch_size=12",
                                                                 "train.micro_batch_size=null")
    assert "nothing would be trained" in _error(files["recipe"], "train.freeze_vision_model=true",
                                                "train.freeze_vision_projection=true",
                                                "train.freeze_language_model=true")
    with caplog.at_level(logging.WARNING, logger="moevlm_jax.config.run"):  # a smoke run: allowed, but said
        short = load_config(files["recipe"], overrides=["optimizer.warmup_steps=80"], num_devices=8, num_processes=1)
    assert short.optimizer.warmup_steps == 80
    assert "optimizer.warmup_steps=80 exceeds the decay length 50" in caplog.text
    assert "train.eval_every=10 needs train.eval_batches >= 1" in _error(files["recipe"], "train.eval_every=10")
    assert "train.micro_batch_size must be >= 1, got 0" in _error(files["recipe"], "train.micro_batch_size=0")
    assert "unknown parameter group 'train.param_groups.vision_modle'; did you mean 'vision_model'?" in _error(
        files["recipe"], "train.param_groups={vision_modle: [x]}")
    with pytest.raises(ConfigError, match="cannot spread over 3 hosts") as e:  # 8 devices in 3 host groups
        load_config(files["recipe"], num_devices=8, num_processes=3)
    assert "global batch" not in str(e.value)  # nothing derived from a layout that failed



def test_data_parallel_size_follows_the_layout(files, tmp_path):
    layout = tmp_path / "l.yaml"
    layout.write_text(yaml.safe_dump({"name": "l", "mesh": {"data": 2, "fsdp": -1, "tensor": 2},
                                      "rules": [["act_batch", ["data", "fsdp"]], ["embed", "fsdp"]]}))
    cfg = load_config(files["recipe"], layout=str(layout), num_devices=8, num_processes=1)
    assert cfg.data_parallel_size == 4 and cfg.global_batch_size == 8  # tensor axis is not data parallel
    assert "multiply to" in _error(files["recipe"], "layout.mesh={fsdp: 3}")


def test_resolved_config_round_trips(files, tmp_path):
    cfg = load_config(files["recipe"], overrides=["optimizer.lr=2e-4", "train.grad_accum=2"],
                      run_dir=str(tmp_path / "run"), num_devices=8, num_processes=1)
    path = recipe.save_config(cfg, cfg.run_dir)
    assert path == tmp_path / "run" / "config.yaml"
    again = load_config(path, num_devices=8, num_processes=1)
    assert again.resolved == cfg.resolved
    assert again.optimizer == cfg.optimizer and again.train == cfg.train
    # --resume with --run-dir and no --recipe picks the run's own config.yaml
    resumed = load_config(None, run_dir=str(tmp_path / "run"), resume=True, steps=99, num_devices=8, num_processes=1)
    assert resumed.optimizer.lr == 2e-4 and resumed.train.steps == 99 and resumed.train.resume


def test_resume_step_implies_resume_and_is_not_inherited(files, tmp_path):
    """train.resume_step (--resume-step N) resumes without --resume, from the run's own config.yaml; it goes to
    config.yaml, and a later --resume of that run does not inherit it (the newest checkpoint that restores)."""
    run = str(tmp_path / "run")
    cfg = load_config(files["recipe"], overrides=["optimizer.lr=2e-4"], run_dir=run, num_devices=8, num_processes=1)
    recipe.save_config(cfg, cfg.run_dir)
    picked = load_config(None, run_dir=run, resume_step=4, num_devices=8, num_processes=1)
    assert picked.optimizer.lr == 2e-4 and picked.train.resume_step == 4 and picked.train.resuming
    recipe.save_config(picked, picked.run_dir)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["resume_step"] == 4
    later = load_config(None, run_dir=run, resume=True, num_devices=8, num_processes=1)
    assert later.train.resume_step is None and later.train.resuming and later.optimizer.lr == 2e-4
    by_key = load_config(None, run_dir=run, overrides=["train.resume_step=2"], num_devices=8, num_processes=1)
    assert by_key.train.resume_step == 2 and by_key.optimizer.lr == 2e-4
    assert recipe.resumes(None, None, ["train.resume_step=null"]) is False
    assert "checkpoint steps start at 1" in _error(files["recipe"], "train.resume_step=0")


def test_help_config_lists_every_key_with_its_meaning():
    """--help-config: every key of every section with type, default and a one-line meaning."""
    from moevlm_jax.schema import describe

    rows = list(describe(recipe.RunConfig))
    keys = {r[0] for r in rows}
    for key in ("train.micro_batch_size", "compute.moe.backend", "compute.router.aux_loss", "layout.mesh",
                "layout.options.pipeline", "data.source[kind=vqa].num_train", "data.source[kind=llava].path",
                "data.image.max_pixels", "model.text_config.num_experts", "optimizer.lr"):
        assert key in keys, key
    undocumented = [r[0] for r in rows if not r[3]]
    assert not undocumented, f"keys without a meaning: {undocumented}"
    row = next(r for r in rows if r[0] == "compute.recompute")
    assert row[1] == "'none' | 'full' | 'selective'" and row[2] == "none"
    assert "compute.moe.backend" in recipe.help_config()
    # a section's last field: its own comment above, not a comment inside the __post_init__ below it
    meaning = {r[0]: r[3] for r in rows}
    assert meaning["train.compile_bucket"].startswith("with compile reserve / ahead: the patch bucket")
    assert not any("as the loader checks them" in m for m in meaning.values())


def test_typed_sections_refuse_bad_values(files):
    msg = _error(files["recipe"], "compute.dtyp=x", "compute.loss_chunk_size=big", "compute.moe.backend=fast",
                 "data.source.kind=parquet")
    assert "unknown key 'compute.dtyp'; did you mean 'dtype'?" in msg
    assert "compute.loss_chunk_size: expected int, got str 'big'" in msg
    assert "compute.moe.backend: 'fast' is not one of" in msg
    assert "data.source.kind: 'parquet' is not one of" in msg
    assert "did you mean 'recompute'" in _error(files["recipe"], "compute.recompte=full")


def test_default_recipes_by_platform():
    assert recipe.default_recipe("cpu") == "cpu-default"
    assert recipe.default_recipe("gpu") == "gpu-default"
    for name, model, data in (("cpu-default", "small", "vqa"), ("gpu-default", "proxy", "proxy")):
        raw = yaml.safe_load((recipe.CONFIG_DIR / "recipes" / f"{name}.yaml").read_text())
        base = raw["data"]["base"] if isinstance(raw["data"], dict) else raw["data"]
        assert raw["model"] == model and raw["layout"] == "fsdp" and base == data
        cfg = load_config(name, num_devices=1, num_processes=1)
        assert cfg.name == name and cfg.train.global_batch_size == cfg.train.micro_batch_size
        assert cfg.data.seq_len == cfg.train.seq_len and cfg.model.name == model


def test_h200_recipe_is_the_measured_one_gpu_setting():
    """configs/recipes/h200.yaml: the best measured dropless point (bench/results/step.md runs 9-16; MBS 11 from run 21,
    bf16 logits from run 23) as a recipe."""
    cfg = load_config("h200", num_devices=1, num_processes=1)
    assert cfg.name == "h200" and cfg.model.name == "proxy" and cfg.train.micro_batch_size == 11
    assert cfg.data.balance_vision_rows and cfg.data.balance_group == 11
    compute = cfg.compute
    assert (compute.param_dtype, compute.recompute, compute.recompute_modules, compute.capture) == (
        "bfloat16", "selective", (), "scopes")
    assert compute.capture_scopes == ("full_iteration",)
    assert compute.scan_layers is False
    assert (compute.attention_options.max_segments, compute.attention_options.vision_max_segments) == (2, 4)
    assert compute.logits_fp32 is False  # HF's bf16 logits (run 23: the LM head 5% faster alone)
    # cuBLAS for every dot (run 24: the compile 81.5 -> 46.1 s, the step the same), applied before the backend starts
    assert compute.xla_flags == ("--xla_gpu_enable_triton_gemm=false",)
    from moevlm_jax.training import capture
    flags = capture.compute_flags(capture.recipe_compute("h200"))
    assert flags["--xla_gpu_enable_triton_gemm"] == "false" and flags["--xla_gpu_graph_min_graph_size"] == "1"
    assert cfg.optimizer.state_dtype == "bfloat16" and cfg.data.seq_len == 4096
