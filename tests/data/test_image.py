"""Our Qwen-VL image processing vs HF's Qwen2VLImageProcessor (PIL backend) with Qwen3-VL's settings."""

import io

import numpy as np
import pytest
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

from moevlm_jax.data.batch import patch_layout  # the shared helper (model + data)
from moevlm_jax.data.config import ImageConfig
from moevlm_jax.data.image import (
    ImageSkip,
    decode_image,
    expand_patches,
    image_to_pixel_values,
    process_image,
    smart_resize,
)


def hf_processor(cfg: ImageConfig) -> Qwen2VLImageProcessorPil:
    # Qwen3-VL's preprocessor_config.json: patch 16, merge 2, temporal 2, mean = std = 0.5,
    # size {shortest_edge: 65536, longest_edge: 16777216}
    return Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size, merge_size=cfg.merge_size, temporal_patch_size=cfg.temporal_patch_size,
        image_mean=list(cfg.image_mean), image_std=list(cfg.image_std),
        size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels})


def photo_like(rng: np.random.Generator, h: int, w: int, mode: str = "RGB") -> Image.Image:
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 / max(w - 1, 1), yy * 255 / max(h - 1, 1), (xx + yy) % 256], -1)
    arr = np.clip(base + rng.normal(0, 20, (h, w, 3)), 0, 255).astype(np.uint8)
    img = Image.fromarray(arr)
    if mode == "L":
        return img.convert("L")
    if mode == "RGBA":
        rgba = img.convert("RGBA")
        rgba.putalpha(Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8)))
        return rgba
    if mode == "P":
        return img.convert("P")
    return img


SIZES = [(448, 448), (300, 500), (500, 300), (10, 10), (33, 1000), (1000, 33), (17, 23), (224, 224),
         (480, 640), (1080, 1920), (720, 1280), (1365, 2048), (31, 64), (64, 31), (250, 4000), (3000, 200),
         (513, 511), (96, 97), (2000, 1500), (128, 4096)]


@pytest.mark.parametrize("cfg", [ImageConfig(), ImageConfig(min_pixels=4096, max_pixels=102400)],
                         ids=["qwen3vl_defaults", "small_cpu_preset"])
def test_patches_and_grids_match_hf(cfg):
    proc = hf_processor(cfg)
    rng = np.random.default_rng(0)
    for h, w in SIZES:
        img = photo_like(rng, h, w)
        ours, grid = image_to_pixel_values(img, cfg)
        ref = proc(img, return_tensors="np")
        np.testing.assert_array_equal(grid, ref["image_grid_thw"][0], err_msg=f"{h}x{w}")
        assert ours.shape == ref["pixel_values"].shape == (int(np.prod(grid)), 1536)
        np.testing.assert_array_equal(ours, ref["pixel_values"], err_msg=f"{h}x{w}")  # bit-identical


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_colour_modes_match_hf(mode):
    cfg = ImageConfig(min_pixels=4096, max_pixels=102400)
    img = photo_like(np.random.default_rng(1), 120, 200, mode)
    ours, grid = image_to_pixel_values(img, cfg)
    ref = hf_processor(cfg)(img, return_tensors="np")
    np.testing.assert_array_equal(grid, ref["image_grid_thw"][0])
    np.testing.assert_array_equal(ours, ref["pixel_values"])


def test_smart_resize_matches_hf_on_many_sizes():
    rng = np.random.default_rng(2)
    sizes = np.concatenate([rng.integers(1, 5000, (1500, 2)), rng.integers(1, 100, (500, 2))])
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        for lo, hi in ((65536, 16777216), (4096, 102400), (200704, 200704)):
            assert smart_resize(int(h), int(w), 32, lo, hi) == hf_smart_resize(int(h), int(w), 32, lo, hi)


def test_decode_jpeg_bytes_same_as_hf_on_decoded_image():
    cfg = ImageConfig(min_pixels=4096, max_pixels=102400)
    buf = io.BytesIO()
    photo_like(np.random.default_rng(3), 211, 377).save(buf, format="JPEG", quality=85)
    decoded = decode_image(buf.getvalue(), cfg)
    compact, grid = process_image(decoded, cfg)
    ref = hf_processor(cfg)(Image.open(io.BytesIO(buf.getvalue())), return_tensors="np")
    np.testing.assert_array_equal(expand_patches(compact, cfg), ref["pixel_values"])
    np.testing.assert_array_equal(grid, ref["image_grid_thw"][0])


def test_patch_layout_rebuilds_the_resized_image():
    cfg = ImageConfig(min_pixels=4096, max_pixels=102400)
    img = photo_like(np.random.default_rng(4), 150, 260)
    compact, grid = process_image(img, cfg)
    rc, hw, frame = patch_layout(grid[None], cfg.merge_size)
    _, gh, gw = grid
    assert (hw == [gh, gw]).all() and (frame == 0).all()
    # put each compact patch (3, 16, 16) back at patch_rc; it must give the smart-resized image
    canvas = np.zeros((gh * 16, gw * 16, 3), np.uint8)
    for (r, c), patch in zip(rc, compact.reshape(-1, 3, 16, 16)):
        canvas[r * 16:(r + 1) * 16, c * 16:(c + 1) * 16] = patch.transpose(1, 2, 0)
    h, w = smart_resize(150, 260, 32, cfg.min_pixels, cfg.max_pixels)
    expect = np.asarray(img.resize((w, h), Image.Resampling.BICUBIC))
    np.testing.assert_array_equal(canvas, expect)
    # the first four patches form the top-left 2x2 merge block
    assert rc[:4].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1]]


def test_patch_layout_multi_image_and_frames():
    rc, hw, frame = patch_layout(np.array([[1, 2, 4], [2, 2, 2]]), 2)
    assert len(rc) == 8 + 8
    assert frame.tolist() == [0] * 8 + [1] * 4 + [2] * 4  # one id per frame
    assert rc[:8].tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    assert hw[8:].tolist() == [[2, 2]] * 8


def test_extreme_aspect_and_empty_images_are_skips():
    cfg = ImageConfig()
    buf = io.BytesIO()
    Image.new("RGB", (1000, 4)).save(buf, format="PNG")
    with pytest.raises(ImageSkip) as e:
        decode_image(buf.getvalue(), cfg)
    assert e.value.reason == "extreme_aspect"
    with pytest.raises(ImageSkip) as e:
        decode_image(b"", cfg)
    assert e.value.reason == "empty_image"
