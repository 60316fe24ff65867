"""Mock source, for comparison only: no images, or random patches of a fixed shape (no decoding).

Megatron Bridge found image-free / mock multimodal data makes a run look about twice as fast as
real input, so this source is never a default: a config must ask for ``kind: mock``, and the
loader labels every batch (``stats["source"]``, ``stats["mock"]``) and every throughput line
(``data.throughput_line``) with ``MOCK DATA``.

``mode: patches`` gives each sample ``images_per_sample`` images of grid ``grid`` (t, h, w) filled
with random pixels (the image tokens, positions and patch layout are real; the decode and resize
work is skipped). ``mode: text`` gives text-only conversations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from moevlm_jax.data.config import MockConfig, source_params

_WORDS = ("the", "image", "shows", "a", "red", "blue", "green", "shape", "on", "left", "right", "of",
          "and", "small", "large", "circle", "square", "word", "near", "top", "bottom", "centre")


def _params(source: MockConfig | Mapping[str, Any]) -> dict[str, Any]:
    """A ``MockConfig``'s settings as plain values (a mapping of some of its keys: the rest default)."""
    if not isinstance(source, MockConfig):
        source = MockConfig(**{k: v for k, v in source.items() if k != "kind"})
    return source_params(source)


def mock_label(source: Mapping[str, Any]) -> str:
    """The label printed with every throughput figure of a mock run."""
    params = _params(source)
    if params["mode"] == "text":
        return "MOCK DATA (text only, no images): throughput is NOT comparable to real multimodal input"
    t, h, w = params["grid"]
    return (f"MOCK DATA (random patches, {params['images_per_sample']} x grid {t}x{h}x{w}, no image decoding): "
            "throughput is NOT comparable to real multimodal input")


class MockSource:
    """Random-access source of mock records (``mock_grids`` instead of image payloads)."""

    def __init__(self, source: Mapping[str, Any], split: str = "train"):
        self.params, self.split = _params(source), split

    def __len__(self) -> int:
        return int(self.params["num_train" if self.split == "train" else "num_heldout"])

    def __getitem__(self, index: int) -> dict[str, Any]:
        """Record ``index``: a short conversation (+ the mock image grids)."""
        rng = np.random.default_rng([int(self.params["seed"]), int(self.split != "train"), int(index)])
        n_images = int(self.params["images_per_sample"]) if self.params["mode"] == "patches" else 0
        lo, hi = self.params["turns"]
        messages: list[dict[str, Any]] = []
        for turn in range(int(rng.integers(lo, hi + 1))):
            question = " ".join(_WORDS[i] for i in rng.integers(len(_WORDS), size=8)) + "?"
            answer = " ".join(_WORDS[i] for i in rng.integers(len(_WORDS), size=int(rng.integers(1, 24)))) + "."
            content: list[dict[str, Any]] = [{"type": "image"}] * n_images if turn == 0 else []
            messages += [{"role": "user", "content": [*content, {"type": "text", "text": question}]},
                         {"role": "assistant", "content": answer}]
        record: dict[str, Any] = {"messages": messages, "meta": {"source": "mock"}}
        record["mock_grids"] = [list(self.params["grid"])] * n_images
        return record
