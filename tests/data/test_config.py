"""Data configs: presets load and validate, overrides reach nested keys, bad settings fail clearly."""

import pytest

from moevlm_jax.config import CONFIG_DIR
from moevlm_jax.data.config import DataError, load_data_config


def test_every_preset_loads():
    names = sorted(p.stem for p in (CONFIG_DIR / "data").glob("*.yaml"))
    assert {"vqa", "proxy", "photos", "mock", "mock_text"} <= set(names)
    for name in names:
        cfg = load_data_config(name)
        assert cfg.name == name and all(b % 4 == 0 for b in cfg.patch_buckets)
    assert load_data_config().name == "vqa"  # the default is real images
    assert not load_data_config().is_mock and load_data_config("mock").is_mock


def test_proxy_preset_is_the_proxy_workload():
    cfg = load_data_config("proxy")
    assert cfg.seq_len == 4096 and cfg.batch_size == 4
    assert cfg.source.images_per_sample == (4, 4)
    assert cfg.image.min_pixels == cfg.image.max_pixels == 448 * 448  # 784 patches -> 196 tokens


def test_overrides():
    cfg = load_data_config("vqa", ["seq_len=2048", "image.max_pixels=200704", "source.num_train=10",
                                   "patch_buckets=[512, 1024]"])
    assert cfg.seq_len == 2048 and cfg.image.max_pixels == 200704 and cfg.source.num_train == 10
    assert cfg.patch_buckets == (512, 1024)
    assert cfg.fingerprint() != load_data_config("vqa").fingerprint()
    assert load_data_config("vqa", ["workers=4"]).fingerprint() == load_data_config("vqa").fingerprint()


@pytest.mark.parametrize("override, message", [
    ("patch_buckets=[6, 8]", "multiples of merge_size"),
    ("patch_buckets=[8, 4]", "increasing"),
    ("image.min_pixels=999999", "min_pixels"),
    ("seq_len=0", "seq_len"),
    ("source.kind=parquet", "data.source.kind: 'parquet' is not one of"),
    ("source.num_trian=5", "unknown key 'data.source.num_trian'; did you mean 'num_train'"),
    ("bogus=1", "unknown key 'data.bogus'"),
    ("image.bogus=1", "unknown key 'data.image.bogus'"),
    ("patch_buckets=[4]", "largest patch bucket"),
])
def test_bad_settings_fail_with_a_clear_message(override, message):
    with pytest.raises(DataError, match=message):
        load_data_config("vqa", [override])


def test_video_defaults_are_hf_video_processor_defaults_and_checked():
    """``data.video``'s defaults are Qwen3VLVideoProcessor's (the processor of both families); a mistyped key is named
    with its near miss; contradicting bounds say what to change."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from moevlm_jax.data.config import VideoConfig

    hf, ours = Qwen3VLVideoProcessor(), VideoConfig()
    assert (ours.fps, ours.min_frames, ours.max_frames) == (hf.fps, hf.min_frames, hf.max_frames)
    assert (ours.min_pixels, ours.max_pixels) == (hf.size.shortest_edge, hf.size.longest_edge)
    assert load_data_config("vqa", ["video.max_frames=64"]).video.max_frames == 64
    with pytest.raises(DataError, match="did you mean 'max_frames'"):
        load_data_config("vqa", ["video.max_frame=64"])
    with pytest.raises(DataError, match="min_frames"):
        load_data_config("vqa", ["video.max_frames=2"])
