"""Synthetic test images shared by the data tests."""

import io

import numpy as np
from PIL import Image


def jpeg_bytes(w: int, h: int, seed: int = 0, quality: int = 90) -> bytes:
    """A photo-like JPEG of the given size."""
    rng = np.random.default_rng(seed)
    arr = np.clip(rng.normal(128, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()
