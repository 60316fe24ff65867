"""Random-access sources (``len`` + ``[i]``), one per ``source.kind`` of a data config.

- ``arrayrecord``: ArrayRecord shards of encoded records (the native format; ``paths`` globs, or
  ``{train: [...], heldout: [...]}``).
- ``llava``: a LLaVA-style JSON list or JSONL file (``path``, ``image_root``; optional
  ``heldout_path``); images are read from disk in the workers.
- ``image_folder``: a folder of images with captions (``captions.jsonl`` / ``metadata.jsonl`` with
  ``file_name`` + ``text``/``caption``, ``captions.json`` {file: caption}, or ``<stem>.txt``).
- ``vqa`` / ``photos`` / ``mock``: the built-in sets (``data.vqa``, ``data.photos``, ``data.mock``).

Sources never raise for a bad entry: they hand it on and the sample processor counts the skip.
"""

from __future__ import annotations

import glob
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moevlm_jax.data.config import DataConfig, DataError, source_params
from moevlm_jax.data.mock import MockSource, mock_label
from moevlm_jax.data.photos import PhotoSource
from moevlm_jax.data.vqa import ensure_vqa, generate_in_background

log = logging.getLogger(__name__)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
CAPTION_PROMPT = "Describe this image."


class ArrayRecordSource:
    """ArrayRecord shards; items are encoded record bytes (decoded in the sample processor)."""

    def __init__(self, paths: Sequence[str]):
        import grain

        self.paths = expand_paths(paths)
        self._ds = grain.sources.ArrayRecordDataSource(self.paths)

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, index: int) -> bytes:
        return self._ds[index]


def expand_paths(patterns: Sequence[str] | str) -> list[str]:
    """Expand globs (sorted) and check that every path exists."""
    if isinstance(patterns, str):
        patterns = [patterns]
    paths: list[str] = []
    for pattern in patterns:
        pattern = str(Path(pattern).expanduser())
        matched = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not matched or not all(Path(p).exists() for p in matched):
            raise DataError(f"no ArrayRecord file matches {pattern!r}")
        paths += matched
    return paths


def read_llava(path: str | Path) -> list[Any]:
    """Entries of a LLaVA JSON list or JSONL file; unparsable JSONL lines become ``None`` (counted later)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"LLaVA file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl" or not text.lstrip().startswith("["):
        entries: list[Any] = []
        for line in text.splitlines():
            if line.strip():
                try:
                    entries.append(json.loads(line))
                except json.JSONDecodeError:
                    entries.append(None)
        return entries
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, list):
        raise DataError(f"{path} must hold a JSON list of samples")
    return data


class LlavaSource:
    """LLaVA / ShareGPT conversations with image paths (read lazily by the sample processor)."""

    def __init__(self, path: str | Path, image_root: str | Path | None = None):
        self.path = Path(path).expanduser()
        self.image_root = str(Path(image_root).expanduser()) if image_root else str(self.path.parent)
        self._entries = read_llava(self.path)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"llava": self._entries[index], "image_root": self.image_root}


def read_captions(folder: Path, captions: str | Path | None = None) -> dict[str, str]:
    """file name -> caption, from a captions file or ``<stem>.txt`` sidecars."""
    candidates = [Path(captions).expanduser()] if captions else [
        folder / "captions.jsonl", folder / "metadata.jsonl", folder / "captions.json"]
    for path in candidates:
        if not path.exists():
            continue
        if path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, Mapping):
                raise DataError(f"{path} must map file names to captions")
            return {str(k): str(v) for k, v in data.items()}
        out: dict[str, str] = {}
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                name = row.get("file_name", row.get("file", row.get("image")))
                caption = row.get("caption", row.get("text"))
            except (json.JSONDecodeError, AttributeError):
                continue
            if name is not None and caption is not None:
                out[str(name)] = str(caption)
        return out
    sidecars: dict[str, str] = {}
    for txt in sorted(folder.rglob("*.txt")):
        for ext in IMAGE_EXTENSIONS:
            for image in (txt.with_suffix(ext), txt.with_suffix(ext.upper())):
                if image.exists():
                    sidecars[str(image.relative_to(folder))] = txt.read_text(encoding="utf-8").strip()
    return sidecars


class ImageFolderSource:
    """Every image file of a folder (recursively) with its caption; uncaptioned images are counted, not dropped."""

    def __init__(self, folder: str | Path, captions: str | Path | None = None, prompt: str = CAPTION_PROMPT):
        self.folder = Path(folder).expanduser().resolve()
        if not self.folder.is_dir():
            raise DataError(f"image folder {self.folder} does not exist")
        self.prompt = prompt
        caps = read_captions(self.folder, captions)
        files = sorted(p for p in self.folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS)
        self._items = []
        for p in files:
            rel = str(p.relative_to(self.folder))
            self._items.append((str(p), caps.get(rel, caps.get(p.name))))
        missing = sum(c is None for _, c in self._items)
        if missing:
            log.warning("%s: %d of %d images have no caption (counted as no_assistant)", self.folder, missing,
                        len(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, caption = self._items[index]
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": self.prompt}]}]
        if caption:
            messages.append({"role": "assistant", "content": caption})
        return {"messages": messages, "images": [{"path": path}], "meta": {"file": path}}


def _split_value(value: Any, split: str, what: str) -> Any:
    if isinstance(value, Mapping):
        if split not in value:
            raise DataError(f"source {what} has no entry for split {split!r}")
        return value[split]
    if split != "train":
        raise DataError(f"source {what} gives no {split!r} split (use {{train: ..., {split}: ...}})")
    return value


HELDOUT_SLICE_SEED = 20261201  # the permutation that picks a held-out slice: the same samples every run
HELDOUT_SLICE_MAX = 1000  # at most this many samples held out


class Subset:
    """A random-access view of some indices of another source."""

    def __init__(self, base: Any, indices: np.ndarray):
        self.base, self.indices = base, np.asarray(indices, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.base[int(self.indices[index])]


def heldout_slice(n: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, held-out indices) of a source of ``n`` samples without a held-out split: the first
    ``max(1, round(fraction * n))`` (at most HELDOUT_SLICE_MAX, never all) of a fixed-seed permutation
    are held out, both sides in source order. ``fraction`` 0: nothing held out."""
    k = 0 if fraction <= 0 or n < 2 else min(max(1, round(fraction * n)), HELDOUT_SLICE_MAX, n - 1)
    held = np.sort(np.random.default_rng(HELDOUT_SLICE_SEED).permutation(n)[:k])
    mask = np.ones(n, bool)
    mask[held] = False
    return np.flatnonzero(mask), held


def has_split(cfg: DataConfig, split: str) -> bool:
    """Whether the source names ``split`` itself (the built-in sources always have both)."""
    src, kind = source_params(cfg.source), cfg.kind
    if split == "train" or kind in ("vqa", "photos", "mock"):
        return True
    if kind == "llava":
        return src.get("heldout_path") is not None
    value = src.get("paths" if kind == "arrayrecord" else "path")
    return isinstance(value, Mapping) and split in value


def has_heldout(cfg: DataConfig) -> bool:
    """Whether evaluation has samples: a held-out split of the source, or a held-out slice of it."""
    return has_split(cfg, cfg.eval_split) or cfg.heldout_fraction > 0


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif")


def dataset_source(path: str | Path) -> dict[str, Any] | None:
    """The ``data.source`` mapping of a dataset given by its path (``--data PATH``): a LLaVA ``.json`` /
    ``.jsonl`` file, a folder (or glob) of ArrayRecord shards, or a folder of images with captions;
    None when ``path`` names no file or folder. Raises DataError when it exists but is none of those."""
    text = str(path)
    if any(c in text for c in "*?["):
        shards = sorted(glob.glob(str(Path(text).expanduser())))
        if shards and all(s.endswith(".array_record") or ".array_record-" in s for s in shards):
            return {"kind": "arrayrecord", "paths": [text]}
        raise DataError(f"--data {text}: the glob matches {len(shards)} file(s), not ArrayRecord shards")
    p = Path(text).expanduser()
    if not p.exists():
        return None
    if p.is_file():
        if p.suffix in (".json", ".jsonl"):
            return {"kind": "llava", "path": str(p)}
        if p.name.endswith(".array_record") or ".array_record-" in p.name:
            return {"kind": "arrayrecord", "paths": [str(p)]}
        raise DataError(f"--data {p}: a dataset file is a LLaVA .json / .jsonl or an .array_record shard "
                        f"(a data config is a .yaml file)")
    files = [f for f in p.iterdir() if f.is_file()]
    if any(f.name.endswith(".array_record") or ".array_record-" in f.name for f in files):
        return {"kind": "arrayrecord", "paths": [str(p / "*.array_record*")]}
    if any(f.suffix.lower() in IMAGE_SUFFIXES for f in files):
        return {"kind": "image_folder", "path": str(p)}
    raise DataError(f"--data {p}: cannot tell what dataset this folder is: expected ArrayRecord shards "
                    "(*.array_record, from python -m moevlm_jax.data.convert) or images "
                    f"({', '.join(IMAGE_SUFFIXES)}) with captions; for a LLaVA file give the .json / .jsonl itself")


def prepare_in_background(cfg: DataConfig) -> Any:
    """Start making what the source needs on disk before it can be read, in a thread, where that is work (the
    built-in VQA set not yet in the cache): a future, or None where nothing is to be made. The sources built
    later wait for it (``data.vqa.ensure_vqa``)."""
    if cfg.kind != "vqa":
        return None
    return generate_in_background(source_params(cfg.source), cfg.resolved_cache_dir())


def build_source(cfg: DataConfig, split: str = "train") -> tuple[Any, str]:
    """(random-access source, human label) for a config and split (``train`` / ``heldout``). A source
    without its own held-out split gives a disjoint slice of its samples for evaluation
    (``data.heldout_fraction``, :func:`heldout_slice`) and trains on the rest."""
    if (split != "train" and has_split(cfg, split)) or (split == "train" and has_split(cfg, cfg.eval_split)):
        return _build_source(cfg, split)
    if cfg.heldout_fraction <= 0:
        if split == "train":
            return _build_source(cfg, split)
        raise DataError(f"the {cfg.kind} source has no {split!r} split and data.heldout_fraction is 0")
    base, label = _build_source(cfg, "train")
    train, held = heldout_slice(len(base), cfg.heldout_fraction)
    if split == "train":
        return Subset(base, train), f"{label}, less a held-out slice of {len(held)}"
    return Subset(base, held), f"{label}, held-out slice of {len(held)} ({cfg.heldout_fraction:g})"


def _build_source(cfg: DataConfig, split: str) -> tuple[Any, str]:
    src = source_params(cfg.source)
    kind = cfg.kind
    if kind == "vqa":

        clips = f" and {src['video_fraction']:g} mp4 clips, real video decode" if src.get("video_fraction") else ""
        return ArrayRecordSource(ensure_vqa(src, cfg.resolved_cache_dir(), split)), \
            f"vqa (procedural scenes, real JPEG decode{clips})"
    if kind == "photos":

        return PhotoSource(src, split), "photos (shipped photographs, real JPEG decode)"
    if kind == "mock":

        return MockSource(src, split), mock_label(src)
    if kind == "arrayrecord":
        return ArrayRecordSource(_split_value(src.get("paths"), split, "paths")), "arrayrecord"
    if kind == "llava":
        path = src.get("path") if split == "train" else src.get("heldout_path")
        if path is None:
            raise DataError(f"llava source needs 'path' (train) / 'heldout_path' (heldout) for split {split!r}")
        return LlavaSource(path, src.get("image_root")), f"llava ({Path(path).name})"
    if kind == "image_folder":
        folder = _split_value(src.get("path"), split, "path")
        return ImageFolderSource(folder, src.get("captions"), src.get("prompt", CAPTION_PROMPT)), \
            f"image folder ({Path(folder).name})"
    raise DataError(f"unknown source kind {kind!r}")
