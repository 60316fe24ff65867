"""The experts' kernel choices as typed config (parallelism.kernels, the ``compute.moe.kernels`` section): loaded
and checked with the run's config, written to config.yaml, listed by --help-config, summarised in one log line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moevlm_jax.config import run as recipe
from moevlm_jax.config.run import ConfigError, load_config
from moevlm_jax.parallelism import gmm_mgpu, gmm_triton
from moevlm_jax.parallelism.experts import ExpertsConfig
from moevlm_jax.parallelism.kernels import KernelsConfig, MosaicGpuTiles, TritonTile


@pytest.fixture
def recipe_path(tmp_path: Path) -> Path:
    """A tiny model and mock data (no presets beyond the fsdp layout)."""
    tiny = yaml.safe_load((recipe.CONFIG_DIR / "models" / "tiny.yaml").read_text())
    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump({**tiny, "name": "m"}))
    data = tmp_path / "d.yaml"
    data.write_text(yaml.safe_dump({"name": "d", "source": {"kind": "mock"}, "seq_len": 256, "batch_size": 8,
                                    "patch_buckets": [64]}))
    rec = tmp_path / "r.yaml"
    rec.write_text(yaml.safe_dump({"name": "r", "model": str(model), "data": str(data),
                                   "layout": str(recipe.CONFIG_DIR / "layouts" / "fsdp.yaml"),
                                   "train": {"steps": 2, "micro_batch_size": 1},
                                   "optimizer": {"warmup_steps": 1}}))
    return rec


def _load(path: Path, *overrides: str, run_dir: Path | None = None):
    return load_config(path, overrides=list(overrides), run_dir=None if run_dir is None else str(run_dir),
                       num_devices=8, num_processes=1)


def test_a_runs_config_yaml_names_its_kernels(recipe_path, tmp_path):
    """The defaults and the overrides of compute.moe.kernels in the resolved config.yaml, which loads back to the
    same kernels."""
    cfg = _load(recipe_path, "compute.moe.kernels.fusions=[gather]", "compute.moe.kernels.mosaic_gpu=[fwd,dx]",
                "compute.moe.kernels.mosaic_gpu_tiles.dw.seg_rows=8192",
                "compute.moe.kernels.triton_tiles=[{kernel: 'dw:2048x1536', block_m: 16}]", run_dir=tmp_path / "run")
    kernels = cfg.compute.moe.kernels
    assert kernels.fusions == ("gather",) and kernels.mosaic_gpu == ("fwd", "dx")
    assert kernels.mosaic_gpu_tiles.dw.seg_rows == 8192
    assert kernels.mosaic_gpu_tiles.dw.epi_tile_m == gmm_mgpu.CONFIGS["dw"].epi_tile_m  # the others as tuned
    assert kernels.triton_config("dw", 2048, 1536) == gmm_triton.Config(16, 128, 64, 8, 3)
    saved = yaml.safe_load(recipe.save_config(cfg, cfg.run_dir).read_text())["compute"]["moe"]["kernels"]
    assert saved["fusions"] == ["gather"] and saved["permute_kernels"] == ["dispatch", "combine_bwd"]
    assert saved["mosaic_gpu"] == ["fwd", "dx"]
    assert saved["mosaic_gpu_tiles"]["dw"]["seg_rows"] == 8192
    assert saved["mosaic_gpu_tiles"]["fwd"] == {"tile_m": 128, "tile_n": 128, "tile_k": 64, "max_concurrent_steps": 3,
                                                "grid_tile_width": 8, "epi_tile_m": 64, "epi_tile_n": 64, "align": 8,
                                                "epi_buffers": 2}
    assert saved["triton_tiles"] == [{"kernel": "dw:2048x1536", "block_m": 16, "block_n": 128, "block_k": 64,
                                      "num_warps": 8, "num_stages": 3}]
    assert _load(tmp_path / "run" / "config.yaml").compute.moe.kernels == kernels
    default = yaml.safe_load(recipe.save_config(_load(recipe_path), tmp_path / "d.yaml").read_text())
    assert default["compute"]["moe"]["kernels"]["fusions"] == ["gather", "mgpu_dweighted"]  # today's defaults


@pytest.mark.parametrize(("override", "expected"), [
    ("compute.moe.kernels.fusion=[gather]", "unknown key 'compute.moe.kernels.fusion'; did you mean 'fusions'?"),
    ("compute.moe.kernel.fusions=[gather]", "unknown key 'compute.moe.kernel'; did you mean 'kernels'?"),
    ("compute.moe.kernels.fusions=[gathr]", "compute.moe.kernels.fusions[0]: 'gathr' is not one of"),
    ("compute.moe.kernels.fusions=[swiglu_bwd]", "'swiglu_bwd' was removed"),
    ("compute.moe.kernels.mosaic_gpu=[fwd,dww]", "'dww' is not one of ['fwd', 'dx', 'dw']; did you mean 'dw'?"),
    ("compute.moe.kernels.mosaic_gpu_tiles.dw.seg_row=8192",
     "unknown key 'compute.moe.kernels.mosaic_gpu_tiles.dw.seg_row'; did you mean 'seg_rows'?"),
    ("compute.moe.kernels.mosaic_gpu_tiles.fwd.epi_buffers=3", "epi_buffers must be 1 or 2"),
    ("compute.moe.kernels.triton_tiles=[{kernel: up}]", "triton tile kernel 'up' is not fwd, dx or dw"),
])
def test_a_bad_kernel_setting_fails_at_load_naming_the_key(recipe_path, override, expected):
    with pytest.raises(ConfigError) as e:
        _load(recipe_path, override)
    assert expected in str(e.value), str(e.value)


def test_help_config_lists_the_kernel_section():
    text = recipe.help_config()
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("compute.moe.kernels")}
    for key in ("compute.moe.kernels", "compute.moe.kernels.fusions", "compute.moe.kernels.permute_kernels",
                "compute.moe.kernels.mosaic_gpu", "compute.moe.kernels.mosaic_gpu_tiles.fwd.tile_m",
                "compute.moe.kernels.mosaic_gpu_tiles.dw.seg_rows", "compute.moe.kernels.triton_tiles"):
        assert key in rows, key
    assert "16384" in rows["compute.moe.kernels.mosaic_gpu_tiles.dw.seg_rows"]  # the tuned default shown
    assert "[gather, mgpu_dweighted]" in rows["compute.moe.kernels.fusions"]


def test_one_log_line_names_the_kernels_on_this_platform(monkeypatch):
    moe = ExpertsConfig(backend="triton", kernels={"fusions": ["gather"], "permute_kernels": []})
    assert moe.kernels == KernelsConfig(fusions=("gather",), permute_kernels=())
    line = moe.kernels_summary("cpu")
    assert line.startswith("experts: Triton grouped matmuls on cpu") and "Mosaic-GPU matmuls: none" in line
    assert "fusions: gather;" in line and "row kernels: none" in line
    monkeypatch.setattr(gmm_mgpu, "on_hopper", lambda: True)
    line = ExpertsConfig(backend="triton").kernels_summary("gpu")
    assert "on Hopper" in line and "Mosaic-GPU matmuls: fwd,dx,dw" in line
    assert "fusions: gather,mgpu_dweighted;" in line and "row kernels: dispatch,combine_bwd" in line
    assert "does not apply" in ExpertsConfig().kernels_summary("cpu")  # CPU's ragged_dot: no custom kernels


def test_direct_construction_is_checked_as_the_loader_checks():
    assert KernelsConfig(fusions=["gather"]).fusions == ("gather",)  # lists become tuples: hashable
    hash(KernelsConfig(triton_tiles=[{"kernel": "fwd"}]))
    assert KernelsConfig(mosaic_gpu_tiles={"dx": {"grid_tile_width": 4}}).mosaic_gpu_tiles == MosaicGpuTiles(
        dx=gmm_mgpu.Config(grid_tile_width=4))
    for kwargs, message in ((dict(fusions=["gather_dw"]), "was removed"), (dict(fusions="gather"), "a list"),
                            (dict(permute_kernels=["dispatch", "dispatch"]), "names one twice"),
                            (dict(triton_tiles=[TritonTile("dw"), TritonTile("dw")]), "names one kernel twice")):
        with pytest.raises((ValueError, TypeError), match=message):
            KernelsConfig(**kwargs)
