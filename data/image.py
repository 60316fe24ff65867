"""Qwen-VL image processing, equal to HF's ``Qwen2VLImageProcessor`` (PIL backend) as Qwen3-VL uses it.

decode (EXIF transpose, alpha composited on white, RGB) -> ``smart_resize`` to multiples of
patch*merge within [min_pixels, max_pixels] (PIL bicubic on uint8) -> rescale 1/255 and normalise
-> temporal duplication -> flatten into patches of ``3 * 2 * 16 * 16 = 1536`` values in the 2x2
merge-block order -> ``image_grid_thw = (1, h/16, w/16)``.

Workers keep the resized pixels as compact uint8 patches ``[N, 3*16*16]`` (8x smaller than the
float32 form); ``expand_patches`` turns them into HF's float32 ``[N, 1536]`` through a per-channel
lookup table that repeats HF's arithmetic exactly (float64 rescale, float32 cast, (x-mean)/std in
float32), so the values are bit-identical.
"""

from __future__ import annotations

import io
import logging
import math
import warnings

import numpy as np
from PIL import Image, ImageOps

from moevlm_jax.data.config import ImageConfig

log = logging.getLogger(__name__)


class ImageSkip(Exception):
    """An image that cannot be used; ``reason`` is the skip-count key."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def smart_resize(height: int, width: int, factor: int = 32, min_pixels: int = 65536,
                 max_pixels: int = 16777216) -> tuple[int, int]:
    """(height, width) divisible by ``factor``, pixel count within [min, max], aspect kept (HF's rule)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_for_size(height: int, width: int, cfg: ImageConfig) -> tuple[int, int, int]:
    """``image_grid_thw`` (1, h/patch, w/patch) of an image of this size."""
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def decode_image(data: bytes, cfg: ImageConfig) -> Image.Image:
    """Decode encoded image bytes into an RGB PIL image; raises ``ImageSkip`` with the reason."""
    if not data:
        raise ImageSkip("empty_image", "image file has zero bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            width, height = img.size
            if width * height > cfg.max_image_pixels:
                raise ImageSkip("image_too_large", f"{width}x{height} exceeds max_image_pixels")
            img.load()
    except ImageSkip:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageSkip("image_too_large", str(e)) from None
    except OSError as e:
        reason = "truncated_image" if "truncated" in str(e).lower() else "corrupt_image"
        raise ImageSkip(reason, f"cannot decode image: {e}") from None
    except Exception as e:  # noqa: BLE001 - any decoder failure is a corrupt image
        raise ImageSkip("corrupt_image", f"cannot decode image: {type(e).__name__}: {e}") from None
    return to_rgb(img, cfg)


def to_rgb(img: Image.Image, cfg: ImageConfig) -> Image.Image:
    """EXIF transpose (optional), composite transparency on white, convert to RGB (HF's convert_to_rgb)."""
    if cfg.exif_transpose:
        try:
            img = ImageOps.exif_transpose(img)
        except Exception as e:  # noqa: BLE001 - a broken EXIF block leaves the image as stored
            log.debug("ignoring unreadable EXIF orientation: %s", e)
    width, height = img.size
    if width == 0 or height == 0:
        raise ImageSkip("empty_image", f"image has zero size {width}x{height}")
    if max(width, height) / min(width, height) > cfg.max_aspect_ratio:
        raise ImageSkip("extreme_aspect", f"aspect ratio of {width}x{height} exceeds {cfg.max_aspect_ratio}")
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        img = img.convert("RGBA")
        background = Image.new("RGBA", img.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, img).convert("RGB")
    return img.convert("RGB") if img.mode != "RGB" else img


def resize_image(img: Image.Image, cfg: ImageConfig) -> np.ndarray:
    """Smart-resized RGB pixels, uint8 [H, W, 3] with H, W multiples of patch*merge."""
    width, height = img.size
    if max(width, height) / min(width, height) > cfg.max_aspect_ratio:
        raise ImageSkip("extreme_aspect", f"aspect ratio of {width}x{height} exceeds {cfg.max_aspect_ratio}")
    h, w = smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    if (w, h) != img.size:
        img = img.resize((w, h), resample=Image.Resampling.BICUBIC)
    return np.asarray(img, dtype=np.uint8)


def compact_patches(pixels: np.ndarray, cfg: ImageConfig) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [N, 3*p*p] patches in HF order (2x2 merge blocks consecutive, channel-major)."""
    p, m = cfg.patch_size, cfg.merge_size
    height, width, c = pixels.shape
    gh, gw = height // p, width // p
    x = pixels.reshape(gh // m, m, p, gw // m, m, p, c)
    # -> (block row, block col, row in block, col in block, channel, y, x)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)
    return np.ascontiguousarray(x).reshape(gh * gw, c * p * p)


def process_image(img: Image.Image, cfg: ImageConfig) -> tuple[np.ndarray, np.ndarray]:
    """RGB image -> (compact uint8 patches [N, 3*p*p], image_grid_thw int32 [3])."""
    pixels = resize_image(img, cfg)
    grid = np.array([1, pixels.shape[0] // cfg.patch_size, pixels.shape[1] // cfg.patch_size], np.int32)
    return compact_patches(pixels, cfg), grid


def normalize_lut(cfg: ImageConfig) -> np.ndarray:
    """float32 [3, 256]: HF's rescale+normalise of each uint8 value per channel, bit-exact."""
    values = np.arange(256, dtype=np.uint8)
    rescaled = (values.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(cfg.image_mean, np.float32)
    std = np.asarray(cfg.image_std, np.float32)
    return ((rescaled[None, :] - mean[:, None]) / std[:, None]).astype(np.float32)


def expand_patches(compact: np.ndarray, cfg: ImageConfig, lut: np.ndarray | None = None,
                   out: np.ndarray | None = None) -> np.ndarray:
    """uint8 [N, 3*p*p] -> float32 [N, 3*T*p*p] normalised, frames duplicated (HF's pixel_values rows); video rows
    (uint8 [N, 3*T*p*p], ``data.video``) hold their own T frames and are normalised alone."""
    lut = normalize_lut(cfg) if lut is None else lut
    n = compact.shape[0]
    pp = cfg.patch_size**2
    t = cfg.temporal_patch_size
    if out is None:
        out = np.empty((n, 3 * t * pp), np.float32)
    if compact.shape[1] == 3 * t * pp and t > 1:  # video: (channel, frame, y, x) already
        view, src = out.reshape(n, 3, t * pp), compact.reshape(n, 3, t * pp)
        for c in range(3):
            view[:, c, :] = lut[c].take(src[:, c, :])
        return out
    view = out.reshape(n, 3, t, pp)
    src = compact.reshape(n, 3, pp)
    for c in range(3):
        vals = lut[c].take(src[:, c, :])
        for k in range(t):
            view[:, c, k, :] = vals
    return out


def image_to_pixel_values(img: Image.Image, cfg: ImageConfig) -> tuple[np.ndarray, np.ndarray]:
    """One image -> (pixel_values float32 [N, 1536], image_grid_thw int32 [3]) as HF's processor returns."""
    compact, grid = process_image(to_rgb(img, cfg), cfg)
    return expand_patches(compact, cfg), grid
