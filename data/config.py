"""Data configs: ``configs/data/*.yaml`` -> validated, frozen dataclasses.

A data config names a source (``source.kind``: vqa | photos | arrayrecord | llava | image_folder |
mock) and the knobs of the pipeline around it: sequence length, rows per host, patch buckets,
Qwen-VL image processing, tokenizer, workers, seed. ``load_data_config("vqa", ["seq_len=2048"])``
loads a preset and applies ``key=value`` overrides (dotted keys reach into ``image`` / ``source``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "data"
DEFAULT_CONFIG = "vqa"
SOURCE_KINDS = ("vqa", "photos", "arrayrecord", "llava", "image_folder", "mock")


class DataError(RuntimeError):
    """The input cannot feed a run (nothing usable, bad config, unreadable source)."""


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """Qwen-VL image processing (HF ``Qwen2VLImageProcessor`` with Qwen3-VL's preprocessor config)."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 65536  # Qwen3-VL size.shortest_edge
    max_pixels: int = 16777216  # Qwen3-VL size.longest_edge
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_aspect_ratio: float = 200.0  # HF raises above 200; we skip and count
    max_image_pixels: int = 100_000_000  # refuse to decode larger (decompression bombs)
    exif_transpose: bool = True  # as transformers.image_utils.load_image

    @property
    def factor(self) -> int:
        """Side multiple of a resized image (patch * merge)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch (3 * temporal * patch * patch)."""
        return 3 * self.temporal_patch_size * self.patch_size**2


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """One input pipeline: source + sequence packing + image processing + loading."""

    name: str = "vqa"
    description: str = ""
    source: Mapping[str, Any] = dataclasses.field(default_factory=lambda: {"kind": "vqa"})
    seq_len: int = 1024
    batch_size: int = 8  # packed rows per host per step
    patch_buckets: tuple[int, ...] = (512, 1024, 2048, 4096)
    image: ImageConfig = dataclasses.field(default_factory=ImageConfig)
    tokenizer: str = "qwen3"  # "qwen3" (offline BPE ranks) or a path to a tokenizer.json
    system_prompt: str | None = None
    workers: int = 0  # grain worker processes (0: in the calling process)
    read_threads: int = 2  # threads per worker decoding samples
    read_buffer: int = 8  # samples decoded ahead per worker
    worker_buffer: int = 2  # packed batches buffered per worker
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None  # None: repeat forever (train); eval uses 1
    eval_split: str = "heldout"
    pack_lookahead: int = 16  # samples waiting for a row before a batch is closed
    probe_samples: int = 256  # samples tried at start to prove the source usable
    max_consecutive_skips: int = 10000  # a worker gives up after this many skips in a row
    cache_dir: str | None = None  # built-in datasets; default ~/.cache/moevlm_jax

    @property
    def kind(self) -> str:
        """The source kind."""
        return str(self.source["kind"])

    @property
    def is_mock(self) -> bool:
        """True when batches carry no real image payload."""
        return self.kind == "mock"

    @property
    def max_patches(self) -> int:
        """Patch rows a packed row may hold (the largest bucket)."""
        return max(self.patch_buckets)

    def resolved_cache_dir(self) -> Path:
        """Where built-in datasets are generated."""
        root = self.cache_dir or os.environ.get("MOEVLM_DATA_CACHE") or "~/.cache/moevlm_jax"
        return Path(root).expanduser()

    def fingerprint(self) -> str:
        """Hash of everything that changes batch contents (checked when an iterator state is restored)."""
        d = to_dict(self)
        for key in ("description", "workers", "read_threads", "read_buffer", "worker_buffer", "cache_dir",
                    "probe_samples", "max_consecutive_skips"):
            d.pop(key, None)
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def to_dict(cfg: DataConfig) -> dict[str, Any]:
    """Plain dict of a config (YAML/JSON friendly)."""
    d = dataclasses.asdict(cfg)
    d["source"] = dict(cfg.source)
    return json.loads(json.dumps(d))


def _parse_value(text: str) -> Any:
    return yaml.safe_load(text)


def apply_overrides(raw: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``key=value`` (dotted keys, YAML values) to a raw config dict."""
    raw = json.loads(json.dumps(raw))
    for item in overrides:
        if "=" not in item:
            raise DataError(f"override {item!r} is not key=value")
        key, value = item.split("=", 1)
        node = raw
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise DataError(f"override {item!r}: {part!r} is not a mapping")
        node[parts[-1]] = _parse_value(value)
    return raw


def config_from_dict(raw: Mapping[str, Any]) -> DataConfig:
    """Build and validate a ``DataConfig`` from a raw mapping."""
    raw = dict(raw)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    unknown = set(raw) - fields
    if unknown:
        raise DataError(f"unknown data config keys {sorted(unknown)}; known: {sorted(fields)}")
    image_raw = dict(raw.pop("image", None) or {})
    image_fields = {f.name for f in dataclasses.fields(ImageConfig)}
    bad = set(image_raw) - image_fields
    if bad:
        raise DataError(f"unknown image config keys {sorted(bad)}; known: {sorted(image_fields)}")
    for key in ("image_mean", "image_std"):
        if key in image_raw:
            image_raw[key] = tuple(float(v) for v in image_raw[key])
    image = ImageConfig(**image_raw)
    if "patch_buckets" in raw:
        raw["patch_buckets"] = tuple(int(v) for v in raw["patch_buckets"])
    cfg = DataConfig(image=image, **raw)
    validate(cfg)
    return cfg


def validate(cfg: DataConfig) -> None:
    """Raise ``DataError`` with a clear message for inconsistent settings."""
    img = cfg.image
    if "kind" not in cfg.source or cfg.kind not in SOURCE_KINDS:
        raise DataError(f"source.kind must be one of {SOURCE_KINDS}, got {cfg.source.get('kind')!r}")
    if cfg.seq_len <= 1 or cfg.batch_size <= 0:
        raise DataError(f"seq_len ({cfg.seq_len}) must be > 1 and batch_size ({cfg.batch_size}) > 0")
    block = img.merge_size**2
    buckets = list(cfg.patch_buckets)
    if not buckets or buckets != sorted(set(buckets)) or any(b <= 0 or b % block for b in buckets):
        raise DataError(f"patch_buckets {buckets} must be increasing positive multiples of merge_size**2={block}")
    if not 0 < img.min_pixels <= img.max_pixels:
        raise DataError(f"need 0 < min_pixels ({img.min_pixels}) <= max_pixels ({img.max_pixels})")
    if img.max_pixels < img.factor**2:
        raise DataError(f"max_pixels {img.max_pixels} is below one merged patch ({img.factor}x{img.factor})")
    smallest = block * max(1, -(-img.min_pixels // img.factor**2))
    if smallest > cfg.max_patches and cfg.kind != "mock":
        raise DataError(f"an image of min_pixels ({img.min_pixels}) needs >= {smallest} patches but the largest "
                        f"patch bucket is {cfg.max_patches}")
    if len(img.image_mean) != 3 or len(img.image_std) != 3 or min(img.image_std) <= 0:
        raise DataError("image_mean and image_std need 3 values, std > 0")
    if cfg.workers < 0 or cfg.read_threads < 0 or cfg.read_buffer < 1 or cfg.worker_buffer < 1:
        raise DataError("workers/read_threads must be >= 0 and read_buffer/worker_buffer >= 1")
    if cfg.pack_lookahead < 1:
        raise DataError("pack_lookahead must be >= 1")
    if cfg.num_epochs is not None and cfg.num_epochs < 1:
        raise DataError("num_epochs must be None (forever) or >= 1")


def config_path(name_or_path: str) -> Path:
    """Resolve a preset name (``vqa``) or a YAML path."""
    p = Path(name_or_path).expanduser()
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.exists():
            raise DataError(f"data config {p} does not exist")
        return p
    p = CONFIG_DIR / f"{name_or_path}.yaml"
    if not p.exists():
        names = sorted(x.stem for x in CONFIG_DIR.glob("*.yaml"))
        raise DataError(f"no data config named {name_or_path!r}; presets: {names}")
    return p


def load_data_config(
    name_or_path: str | Mapping[str, Any] | DataConfig | None = None, overrides: Iterable[str] = ()
) -> DataConfig:
    """Load a preset name / YAML path / mapping (default ``vqa``) and apply ``key=value`` overrides."""
    overrides = list(overrides)
    if isinstance(name_or_path, DataConfig):
        if not overrides:
            return name_or_path
        raw: dict[str, Any] = to_dict(name_or_path)
    elif isinstance(name_or_path, Mapping):
        raw = dict(name_or_path)
    else:
        path = config_path(name_or_path or DEFAULT_CONFIG)
        raw = yaml.safe_load(path.read_text()) or {}
        raw.setdefault("name", path.stem)
    return config_from_dict(apply_overrides(raw, overrides))
