"""Checkpoints move between layouts: a train state saved under fsdp restores under every other preset
with identical parameters and optimizer state (orbax reshards onto the new mesh), the next step's
losses there equal fsdp's, and ``python -m moevlm_jax.export`` writes the same Hugging Face files,
bit for bit, from a checkpoint of any layout, in float32 and bfloat16, and from the newest checkpoint that
restores (a damaged newer one skipped); a run fine-tuned from an HF directory exports with its side files."""

from __future__ import annotations

import logging
import shutil

import jax
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from moevlm_jax.config import load_layout
from moevlm_jax.export import main as export_main
from moevlm_jax.schema import to_plain
from moevlm_jax.training.checkpoint import Checkpointer
from moevlm_jax.training.trainer import Trainer
from tests.parallelism.packed_batch import packed_batch
from tests.parallelism.test_layouts import COMPUTE, FAST, OPTIMIZER, random_params
from tests.training.train_setup import damage_checkpoint

# quick compiles (tests/xla_options.py): fsdp's step and export compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

PRESETS = ("ep", "tp", "tp_ep", "ep_etp", "cp", "folded", "pp", "pp_circular", "pp_ep")
ROWS, SEQ = 16, 32  # 16 rows: 4 pipeline microbatches over 4 fsdp devices under pp


def _trainer(config, layout):
    return Trainer.create(config, COMPUTE, load_layout(layout), OPTIMIZER, steps=10)


def _run_dir(tmp, config, layout, state, step=1):
    """A run directory as the train CLI writes one: config.yaml (its model and compute sections are what
    the export reads) and a checkpoint of ``state``."""
    run = tmp / layout
    run.mkdir(parents=True)
    sections = {"model": to_plain(config), "compute": to_plain(COMPUTE), "layout": layout}
    (run / "config.yaml").write_text(yaml.safe_dump(sections))
    with Checkpointer(run / "checkpoints", save_every=1, keep=1, async_save=False) as ckpt:
        ckpt.save(step, state, {"batches": step}, force=True)
    return run


def _leaves(tree):
    def host(x):
        return np.asarray(jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x)

    return [host(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from moevlm_jax.model.registry import load_model_config

    tmp = tmp_path_factory.mktemp("portable")
    config = load_model_config("tiny-v512")
    trainer = _trainer(config, "fsdp")
    # parameters drawn in numpy (the layout tests' random_params: no initialiser compiled); any state is saved
    state = trainer.init_state(seed=3, params=random_params(config))
    return tmp, config, trainer, state, _run_dir(tmp, config, "fsdp", state)


@pytest.mark.parametrize("layout", PRESETS)
def test_a_fsdp_checkpoint_restores_under_every_preset(saved, layout):
    _, config, _, state, run = saved
    trainer = _trainer(config, layout)
    with Checkpointer(run / "checkpoints", save_every=1, keep=1) as ckpt:
        restored, data = ckpt.restore(trainer.abstract_state())
    assert data == {"batches": 1}
    for got, want in zip(_leaves(restored), _leaves(state)):
        np.testing.assert_array_equal(got, want)
    shardings = trainer.state_shardings  # laid out for the new layout, not the saved one
    assert jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding == s, restored, shardings)) == \
        [True] * len(jax.tree.leaves(restored))


def test_the_next_step_after_restoring_elsewhere_matches(saved):
    """Resumed under ep and pp, the step from the restored state gives fsdp's losses."""
    _, config, fsdp, state, run = saved
    batch = packed_batch(config, ROWS, SEQ)
    records = {}
    for layout in ("fsdp", "ep", "pp"):
        trainer = _trainer(config, layout)
        with Checkpointer(run / "checkpoints", save_every=1, keep=1) as ckpt:
            restored, _ = ckpt.restore(trainer.abstract_state())
        placed = trainer.prepare(batch)
        compiled = trainer.lower_step(restored, placed.arrays, placed.capacity, bounded=placed.bounded).compile(FAST)
        _, metrics = compiled(restored, placed.arrays)
        records[layout] = {k: float(v) for k, v in jax.device_get(metrics).items() if k in ("loss", "grad_norm")}
    for layout in ("ep", "pp"):
        for k, v in records[layout].items():
            assert v == pytest.approx(records["fsdp"][k], rel=2e-6), (layout, k)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_from_any_layout_is_bitwise_the_same(saved, tmp_path, dtype):
    tmp, config, _, state, fsdp_run = saved
    outs = {}
    for layout in ("fsdp", "ep", "pp"):
        if layout == "fsdp":
            run = fsdp_run
        else:  # the state as that layout holds it (restored onto its mesh), saved from there
            trainer = _trainer(config, layout)
            with Checkpointer(fsdp_run / "checkpoints", save_every=1, keep=1) as ckpt:
                placed, _ = ckpt.restore(trainer.abstract_state())
            run = _run_dir(tmp_path, config, layout, placed)
        out = tmp_path / f"hf_{layout}_{dtype}"
        assert export_main(["--run-dir", str(run), "--out", str(out), "--dtype", dtype]) == 0
        outs[layout] = out
    files = sorted(p.name for p in outs["fsdp"].iterdir())
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
    for layout in ("ep", "pp"):
        assert sorted(p.name for p in outs[layout].iterdir()) == files
        assert (outs[layout] / "config.json").read_text() == (outs["fsdp"] / "config.json").read_text()
        for name in files:
            if name.endswith(".safetensors"):
                a, b = load_file(outs["fsdp"] / name), load_file(outs[layout] / name)
                assert a.keys() == b.keys()
                for k in a:
                    assert a[k].dtype == np.dtype(dtype if dtype == "float32" else "bfloat16")
                    np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)


def test_export_skips_a_damaged_checkpoint_and_honours_the_step_asked_for(saved, tmp_path, capsys, caplog):
    """Without --step, export takes the newest checkpoint that restores (a damaged newer one: one log line, left on
    disk) and writes the files the intact run exports; --step of a damaged one is an error naming it."""
    _, _, _, _, fsdp_run = saved
    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    shutil.copytree(run / "checkpoints" / "1", run / "checkpoints" / "2")  # a newer step, then damaged
    truncated = damage_checkpoint(run / "checkpoints" / "2")
    assert export_main(["--run-dir", str(fsdp_run), "--out", str(tmp_path / "want")]) == 0
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="moevlm_jax"):  # a quiet CLI run earlier in the worker set it higher
        assert export_main(["--run-dir", str(run), "--out", str(tmp_path / "got")]) == 0
    skips = [r.getMessage() for r in caplog.records if "does not restore" in r.getMessage()]
    assert len(skips) == 1 and "checkpoint 2 in" in skips[0] and "OUT_OF_RANGE" in skips[0]
    assert any(r.getMessage().endswith(f"step 1 to {tmp_path / 'got'}") for r in caplog.records)
    assert "Traceback" not in capsys.readouterr().err and truncated.exists()
    names = sorted(p.name for p in (tmp_path / "want").iterdir())
    assert sorted(p.name for p in (tmp_path / "got").iterdir()) == names
    for name in names:
        assert (tmp_path / "got" / name).read_bytes() == (tmp_path / "want" / name).read_bytes(), name
    assert export_main(["--run-dir", str(run), "--step", "2", "--out", str(tmp_path / "asked")]) == 1
    err = capsys.readouterr().err
    assert "error: checkpoint 2 in" in err and "does not restore: ValueError: OUT_OF_RANGE" in err
    assert not (tmp_path / "asked").exists()


def test_export_carries_the_source_checkpoints_side_files(saved, tmp_path, caplog):
    """A run whose ``train.init_from`` is an HF directory exports its generation config, tokenizer and processor
    files byte for byte (nothing else of the source); a source that is gone: one warning, the weights still export."""
    from moevlm_jax.export import HF_SIDE_FILES

    _, _, _, _, fsdp_run = saved
    source = tmp_path / "source"
    source.mkdir()
    side = {"generation_config.json": '{"do_sample": true, "temperature": 0.7, "top_p": 0.8, "eos_token_id": [1, 2]}',
            "tokenizer_config.json": '{"model_max_length": 262144}', "chat_template.jinja": "{{ messages }}",
            "preprocessor_config.json": '{"patch_size": 16}'}
    for name, text in side.items():
        (source / name).write_text(text)
    (source / "README.md").write_text("not a side file")
    assert set(side) <= set(HF_SIDE_FILES) and "README.md" not in HF_SIDE_FILES
    run = tmp_path / "run"
    shutil.copytree(fsdp_run, run)
    raw = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**raw, "train": {"init_from": str(source)}}))
    assert export_main(["--run-dir", str(run), "--out", str(tmp_path / "hf")]) == 0
    for name, text in side.items():
        assert (tmp_path / "hf" / name).read_text() == text, name
    assert not (tmp_path / "hf" / "README.md").exists()
    plain = sorted(p.name for p in (tmp_path / "hf").iterdir() if p.name not in side)
    assert plain == ["config.json", "model.safetensors"]  # the weights and config as without a source
    shutil.rmtree(source)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moevlm_jax"):
        assert export_main(["--run-dir", str(run), "--out", str(tmp_path / "hf_gone")]) == 0
    gone = [r.getMessage() for r in caplog.records if "is gone" in r.getMessage()]
    assert len(gone) == 1 and str(source) in gone[0]
    assert not any((tmp_path / "hf_gone" / name).exists() for name in side)
    assert (tmp_path / "hf_gone" / "config.json").read_text() == (tmp_path / "hf" / "config.json").read_text()
