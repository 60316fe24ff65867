"""Built-in captioning set from the real photographs that installed packages ship (no download).

scikit-image (``skimage/data``), scikit-learn (``sklearn/datasets/images``) and matplotlib
(``mpl-data/sample_data``) include about twenty real photographs; each gets a hand-written caption.
Sample ``i`` of a split is a deterministic crop (70-100% per side) and rescale of one photo to a
realistic resolution, JPEG-encoded (quality 80-95), with a captioning question. Records are made
on the fly in the worker (no cache directory); photos missing from an installation are left out.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from moevlm_jax.data.config import PhotosConfig, source_params

log = logging.getLogger(__name__)

# (package, relative path, caption)
PHOTOS = (
    ("skimage", "data/astronaut.png",
     "An astronaut in an orange flight suit smiles in front of an American flag and a model of the space shuttle."),
    ("skimage", "data/brick.png", "A grey brick wall seen at an angle, in black and white."),
    ("skimage", "data/camera.png", "A black-and-white photo of a man looking through a camera on a tripod in a field."),
    ("skimage", "data/cell.png", "A grey microscope image of a single round cell."),
    ("skimage", "data/chelsea.png", "A close-up of a tabby cat with green eyes."),
    ("skimage", "data/coffee.png", "A cup of coffee on a red saucer with a spoon, on a wooden table."),
    ("skimage", "data/coins.png", "Rows of old coins on a dark background, in black and white."),
    ("skimage", "data/grass.png", "A close-up of grass, in black and white."),
    ("skimage", "data/gravel.png", "A close-up of gravel, in black and white."),
    ("skimage", "data/hubble_deep_field.jpg", "Many small distant galaxies on a black sky, seen by a space telescope."),
    ("skimage", "data/ihc.png", "A microscope image of stained tissue with brown cell membranes and blue nuclei."),
    ("skimage", "data/moon.png", "The grey surface of the moon with craters."),
    ("skimage", "data/motorcycle_left.png", "A red motorcycle parked in a workshop full of shelves."),
    ("skimage", "data/page.png", "A scanned page of printed text about region-based segmentation."),
    ("skimage", "data/retina.jpg", "A photo of the back of a human eye, showing the retina and its blood vessels."),
    ("skimage", "data/rocket.jpg", "A rocket standing on its launch pad at dusk, lit by floodlights."),
    ("skimage", "data/text.png", "Handwritten characters on a sheet of paper, in black and white."),
    ("sklearn", "datasets/images/china.jpg", "A traditional Chinese pagoda among trees, with a lake behind it."),
    ("sklearn", "datasets/images/flower.jpg", "An orange dahlia flower in front of dark green leaves."),
    ("matplotlib", "mpl-data/sample_data/grace_hopper.jpg",
     "A portrait of an older woman in a navy uniform and cap in front of a flag."),
)
PROMPTS = ("Describe this image.", "What is in this picture?", "Write a short caption for the photo.",
           "What does this photo show?")
SPLITS = {"train": 0, "heldout": 1}


def _package_root(name: str) -> Path | None:
    try:
        module = __import__(name)
    except ImportError:
        return None
    if name == "matplotlib":
        return Path(module.get_data_path()).parent
    return Path(module.__file__).parent


def available_photos() -> list[tuple[Path, str]]:
    """(path, caption) of the photographs present in this installation."""
    found = []
    for package, rel, caption in PHOTOS:
        root = _package_root(package)
        if root is not None and (root / rel).exists():
            found.append((root / rel, caption))
    return found


class PhotoSource:
    """Random-access source of captioning records over the shipped photographs."""

    def __init__(self, source: Mapping[str, Any], split: str = "train"):
        if not isinstance(source, PhotosConfig):  # a mapping of some of its keys: the rest default
            source = PhotosConfig(**{k: v for k, v in source.items() if k != "kind"})
        params = source_params(source)
        if split not in SPLITS:
            raise ValueError(f"photos split must be one of {list(SPLITS)}, got {split!r}")
        self.params, self.split = params, split
        self._photos = available_photos()
        if not self._photos:
            raise FileNotFoundError("no photographs found: install scikit-image, scikit-learn or matplotlib")
        self._cache: dict[int, Image.Image] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def __len__(self) -> int:
        return int(self.params["num_train" if self.split == "train" else "num_heldout"])

    def _photo(self, k: int) -> Image.Image:
        if k not in self._cache:
            with Image.open(self._photos[k][0]) as img:
                self._cache[k] = img.convert("RGB")
        return self._cache[k]

    def _jpeg(self, rng: np.random.Generator, k: int) -> bytes:
        img = self._photo(k)
        w, h = img.size
        cw, ch = int(w * rng.uniform(0.7, 1.0)), int(h * rng.uniform(0.7, 1.0))
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        crop = img.crop((x0, y0, x0 + cw, y0 + ch))
        lo, hi = self.params["image_size"]
        long_side = rng.uniform(lo, hi)
        scale = long_side / max(cw, ch)
        size = (max(16, round(cw * scale)), max(16, round(ch * scale)))
        crop = crop.resize(size, Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        crop.save(buf, format="JPEG", quality=int(rng.integers(80, 96)))
        return buf.getvalue()

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Record ``index``: photo(s), a captioning question, the caption(s)."""
        rng = np.random.default_rng([int(self.params["seed"]), SPLITS[self.split], int(index)])
        lo, hi = self.params["images_per_sample"]
        n = int(rng.integers(lo, hi + 1))
        # heldout samples walk the photos in a different order than train, still covering all of them
        ks = [int((index * 7 + j * 3 + SPLITS[self.split]) % len(self._photos)) for j in range(n)]
        images = [self._jpeg(rng, k) for k in ks]
        messages: list[dict[str, Any]] = []
        for j, k in enumerate(ks):
            prompt = PROMPTS[int(rng.integers(len(PROMPTS)))]
            if n > 1:
                prompt = f"Image {j + 1}: {prompt[0].lower()}{prompt[1:]}"
            content: list[dict[str, Any]] = [{"type": "image"}] * n if j == 0 else []
            messages += [{"role": "user", "content": [*content, {"type": "text", "text": prompt}]},
                         {"role": "assistant", "content": self._photos[k][1]}]
        meta = {"source": "photos", "photos": [self._photos[k][0].name for k in ks], "qtypes": ["caption"] * n}
        return {"messages": messages, "images": images, "meta": meta}


def photo_count() -> int:
    """Number of shipped photographs found."""
    return len(available_photos())
