"""The ``data`` section of a run: ``configs/data/*.yaml`` as frozen dataclasses.

A data config names a source (``source``: a tagged union on ``kind``: vqa | photos | arrayrecord |
llava | image_folder | mock, each with its own keys) and the knobs of the pipeline around it:
sequence length, rows per host, patch buckets, Qwen-VL image processing, tokenizer, workers, seed.
The one config loader (``moevlm_jax.schema``) builds it; ``load_data_config("vqa", ["seq_len=2048"])``
is that loader for the data section alone (the data CLIs).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from moevlm_jax.schema import ConfigError, coerce_fields, load_typed

DEFAULT_CONFIG = "vqa"
# question types of the built-in VQA set, in the order eval batches index them (answer_type): those of its images,
# then those of its clips (``source.video_fraction``), which only the frames' order answers
IMAGE_QUESTION_TYPES = ("colour", "shape", "count", "position", "text")
VIDEO_QUESTION_TYPES = ("motion", "blinks")
QUESTION_TYPES = IMAGE_QUESTION_TYPES + VIDEO_QUESTION_TYPES


class DataError(RuntimeError):
    """The input cannot feed a run (nothing usable, bad config, unreadable source)."""


@dataclasses.dataclass(frozen=True)
class ImageConfig:
    """Qwen-VL image processing (HF ``Qwen2VLImageProcessor`` with Qwen3-VL's preprocessor config)."""

    patch_size: int = 16  # patch side in pixels (= the model's vision_config.patch_size)
    merge_size: int = 2  # merged patches per side (= vision_config.spatial_merge_size)
    temporal_patch_size: int = 2  # frames per patch (= vision_config.temporal_patch_size)
    min_pixels: int = 65536  # smallest resized image area (Qwen3-VL size.shortest_edge)
    max_pixels: int = 16777216  # largest resized image area (Qwen3-VL size.longest_edge)
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)  # per-channel normalisation mean
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)  # per-channel normalisation std
    max_aspect_ratio: float = 200.0  # longer / shorter side above this is skipped and counted (HF raises)
    max_image_pixels: int = 100_000_000  # refuse to decode larger (decompression bombs)
    exif_transpose: bool = True  # apply the EXIF orientation, as transformers.image_utils.load_image

    @property
    def factor(self) -> int:
        """Side multiple of a resized image (patch * merge)."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch (3 * temporal * patch * patch)."""
        return 3 * self.temporal_patch_size * self.patch_size**2


@dataclasses.dataclass(frozen=True)
class VideoConfig:
    """Qwen-VL video processing (HF ``Qwen3VLVideoProcessor``'s defaults): frames sampled at ``fps``, resized
    together within a pixel budget over all frames, paired into temporal patches (``image.temporal_patch_size``)."""

    fps: float = 2.0  # frames sampled per second of video (HF's fps)
    min_frames: int = 4  # fewest frames sampled (fewer when the clip has fewer)
    # most frames sampled: a longer clip is sampled down to this many, evenly over its whole length (HF's
    # max_frames: the clip is never cut short); bounds a clip's patches with max_pixels
    max_frames: int = 768
    # the frames share one size, chosen so that frames x height x width lies within [min_pixels, max_pixels]
    min_pixels: int = 131072  # smallest resized area of all sampled frames together (HF's size.shortest_edge)
    max_pixels: int = 786432  # largest resized area of all sampled frames together (HF's size.longest_edge)
    # frame rate assumed where the source gives none (a folder of frames; HF's fallback)
    default_fps: float = 24.0
    max_decode_frames: int = 100_000  # refuse to read a clip of more frames than this (counted as corrupt_video)


@dataclasses.dataclass(frozen=True)
class VqaConfig:
    """The built-in procedural VQA scenes (``data.vqa``; generated once into the cache directory)."""

    kind: Literal["vqa"] = "vqa"  # source kind
    num_train: int = 4000  # training samples
    num_heldout: int = 500  # held-out samples (other scenes)
    image_size: tuple[int, int] = (64, 320)  # [min, max] of an image's longer side in pixels
    aspect: tuple[float, float] = (0.5, 2.0)  # [min, max] width / height
    images_per_sample: tuple[int, int] = (1, 1)  # [min, max] images a sample holds
    describe_turns: tuple[int, int] = (0, 0)  # [min, max] extra "describe" turns (long untrained-for-accuracy answers)
    questions: tuple[str, ...] = IMAGE_QUESTION_TYPES  # question types asked of images
    jpeg_quality: tuple[int, int] = (70, 95)  # [min, max] JPEG quality of the stored images
    seed: int = 1234  # generator seed (samples are deterministic per seed, split and index)
    shard_size: int = 4096  # samples per ArrayRecord shard
    text_budget: int = 0  # characters of describe turns per sample (0: no limit)
    # [min, max] height of the text question's word as a fraction of the image's shorter side (a word
    # wider than the image is drawn at the largest size that fits)
    text_size: tuple[float, float] = (0.2, 0.3)
    text_words: int = 16  # the text question's answers: the first N of data.vqa.WORDS (chance 1/N)
    # short clips (mp4 encoded with PyAV, stored in the shards, decoded by the pipeline as any video): a shape moving
    # left / right / up / down ("motion") or flashing 1-3 times ("blinks"); 0 keeps the image-only set as it was
    video_fraction: float = 0.0  # fraction of samples that are a clip and its question instead of images
    video_questions: tuple[str, ...] = VIDEO_QUESTION_TYPES  # question types asked of clips
    video_frames: int = 8  # frames of a clip (even: whole frame pairs)
    video_fps: float = 2.0  # a clip's frame rate (data.video.fps 2 samples every frame)
    video_size: tuple[int, int] = (64, 128)  # [min, max] of a clip's side in pixels (square frames, even sizes)

    def __post_init__(self) -> None:
        bad = sorted(set(self.questions) - set(IMAGE_QUESTION_TYPES))
        if bad:
            raise ValueError(f"source.questions: unknown question types {bad}; known: {IMAGE_QUESTION_TYPES}")
        bad = sorted(set(self.video_questions) - set(VIDEO_QUESTION_TYPES))
        if bad or not self.video_questions:
            raise ValueError(f"source.video_questions: {list(self.video_questions)}: give some of "
                             f"{VIDEO_QUESTION_TYPES}")
        if not 0 <= self.video_fraction <= 1:
            raise ValueError(f"source.video_fraction ({self.video_fraction}) must be within [0, 1]")
        if self.video_frames < 6 or self.video_frames % 2 or self.video_fps <= 0:
            raise ValueError(f"source.video_frames ({self.video_frames}) must be even and >= 6 (a blink question "
                             f"needs 3 frame pairs) and source.video_fps ({self.video_fps}) > 0")
        if not 32 <= self.video_size[0] <= self.video_size[1]:
            raise ValueError(f"source.video_size {list(self.video_size)} must be a [min, max] with min >= 32")
        if not 2 <= self.text_words <= 16 or not 0 < self.text_size[0] <= self.text_size[1] <= 1:
            raise ValueError(f"source.text_words ({self.text_words}) must be 2..16 and source.text_size "
                             f"{list(self.text_size)} a [min, max] within (0, 1]")


@dataclasses.dataclass(frozen=True)
class PhotosConfig:
    """Captions of the real photographs installed packages ship (``data.photos``; no download)."""

    kind: Literal["photos"] = "photos"  # source kind
    num_train: int = 512  # training samples (crops / resolutions of ~20 photographs)
    num_heldout: int = 64  # held-out samples
    image_size: tuple[int, int] = (224, 640)  # [min, max] of an image's longer side in pixels
    images_per_sample: tuple[int, int] = (1, 1)  # [min, max] images a sample holds
    seed: int = 4321  # generator seed


@dataclasses.dataclass(frozen=True)
class MockConfig:
    """MOCK data for comparison only (``data.mock``): random patches of a fixed shape, or text only."""

    kind: Literal["mock"] = "mock"  # source kind
    mode: Literal["patches", "text"] = "patches"  # random patch payloads, or text-only conversations
    images_per_sample: int = 1  # images per sample (mode patches)
    grid: tuple[int, int, int] = (1, 8, 8)  # patch grid (t, h, w) of every image
    turns: tuple[int, int] = (1, 1)  # [min, max] question / answer turns per sample
    num_train: int = 100000  # training samples
    num_heldout: int = 1000  # held-out samples
    seed: int = 7  # generator seed


SplitPaths = str | tuple[str, ...] | dict[str, str | tuple[str, ...]]


@dataclasses.dataclass(frozen=True)
class ArrayRecordConfig:
    """ArrayRecord shards written by ``python -m moevlm_jax.data.convert`` (the native format)."""

    kind: Literal["arrayrecord"] = "arrayrecord"  # source kind
    # shard paths or globs: a list (the train split) or {train: [...], heldout: [...]}
    paths: Any = ()

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("source.paths: give the shard paths (a list, or {train: [...], heldout: [...]})")


@dataclasses.dataclass(frozen=True)
class LlavaConfig:
    """LLaVA-style JSON / JSONL conversations with image paths, read straight from disk."""

    kind: Literal["llava"] = "llava"  # source kind
    path: str = ""  # the training JSON / JSONL file
    heldout_path: str | None = None  # a held-out JSON / JSONL file (null: none)
    image_root: str | None = None  # base of relative image paths (null: the JSON's folder)

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("source.path: give the LLaVA JSON / JSONL file")


@dataclasses.dataclass(frozen=True)
class ImageFolderConfig:
    """A folder of images with captions (captions.jsonl / metadata.jsonl, captions.json or <name>.txt)."""

    kind: Literal["image_folder"] = "image_folder"  # source kind
    path: Any = ""  # the folder (or {train: folder, heldout: folder})
    captions: str | None = None  # a captions file (null: found in the folder)
    prompt: str = "Describe this image."  # the user turn every sample asks

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("source.path: give the image folder")


SourceConfig = VqaConfig | PhotosConfig | MockConfig | ArrayRecordConfig | LlavaConfig | ImageFolderConfig
SOURCE_KINDS = ("vqa", "photos", "arrayrecord", "llava", "image_folder", "mock")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """One input pipeline: source + sequence packing + image processing + loading."""

    name: str = "vqa"  # a label for logs
    description: str = ""  # one line on the data
    source: SourceConfig = VqaConfig()  # where samples come from (a tagged union on 'kind')
    seq_len: int = 1024  # tokens per packed row (in a run: derived from train.seq_len)
    batch_size: int = 8  # packed rows per host per step (in a run: derived from the global batch)
    # logical data shards, each its own pipeline; a process reads its share, so the batches do not depend on
    # the process count (null: one per process of the run's first start; a checkpoint keeps the count)
    num_shards: int | None = None
    patch_buckets: tuple[int, ...] = (512, 1024, 2048, 4096)  # allowed patch rows of a batch (one compile each)
    # the vision tower's rows hold the images of a group of rows balanced over them (largest first onto the
    # least-filled row), not each decoder row's own: the patch bucket follows the group's mean, not its fullest
    # row (the proxy data: ~91% -> ~96% of the patch slots useful); the batch's ``patch_dest`` says where each
    # merged token goes. A group never spans two microbatches or data-parallel ranks (a run derives its size)
    balance_vision_rows: bool = False  # balance images over the vision rows of each row group
    balance_group: int = 0  # rows per balancing group (in a run: derived, train.micro_batch_size; 0: all rows)
    image: ImageConfig = ImageConfig()  # Qwen-VL image processing
    video: VideoConfig = VideoConfig()  # Qwen-VL video processing (decoding with PyAV, frame sampling, resize)
    tokenizer: str = "qwen3"  # "qwen3" (offline BPE ranks) or a path to a tokenizer.json
    system_prompt: str | None = None  # a system turn before every conversation (null: none)
    workers: int = 0  # grain worker processes (0: in the calling process)
    read_threads: int = 2  # threads per worker decoding samples
    read_buffer: int = 8  # samples decoded ahead per worker
    worker_buffer: int = 2  # packed batches buffered per worker
    seed: int = 0  # shuffle seed
    shuffle: bool = True  # shuffle the training samples each epoch
    num_epochs: int | None = None  # null: repeat forever (train); eval uses 1
    eval_split: str = "heldout"  # the source split evaluation reads
    # a source with no held-out split (a LLaVA file without heldout_path, one image folder, a list of shards)
    # holds out this share of its samples for evaluation, the same ones every run (data.sources.heldout_slice);
    # 0: none (evaluation is then skipped with a notice)
    heldout_fraction: float = 0.02
    pack_lookahead: int = 16  # samples waiting for a row before a batch is closed
    probe_samples: int = 256  # samples tried at start to prove the source usable
    max_consecutive_skips: int = 10000  # a worker gives up after this many skips in a row
    cache_dir: str | None = None  # built-in datasets (null: $MOEVLM_DATA_CACHE or ~/.cache/moevlm_jax)

    def __post_init__(self) -> None:
        coerce_fields(self, "data")  # types (as the loader checks them)
        validate(self)

    @property
    def kind(self) -> str:
        """The source kind."""
        return self.source.kind

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
                    "probe_samples", "max_consecutive_skips", "batch_size", "num_shards"):  # the loader's own keys
            d.pop(key, None)
        return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain dict of a config (YAML / JSON friendly)."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def source_params(source: Any) -> dict[str, Any]:
    """A source config's settings without ``kind``, as plain JSON values (the generators' parameters)."""
    return {k: v for k, v in to_dict(source).items() if k != "kind"}


def validate(cfg: DataConfig) -> None:
    """Raise ValueError with a clear message for inconsistent settings (the loader names the section)."""
    img = cfg.image
    if cfg.seq_len <= 1 or cfg.batch_size <= 0:
        raise ValueError(f"data.seq_len ({cfg.seq_len}) must be > 1 and data.batch_size ({cfg.batch_size}) > 0")
    if cfg.balance_group < 0:
        raise ValueError(f"data.balance_group ({cfg.balance_group}) must be >= 0 (0: every row of a batch)")
    block = img.merge_size**2
    buckets = list(cfg.patch_buckets)
    if not buckets or buckets != sorted(set(buckets)) or any(b <= 0 or b % block for b in buckets):
        raise ValueError(f"data.patch_buckets {buckets} must be increasing positive multiples of merge_size**2={block}")
    if not 0 < img.min_pixels <= img.max_pixels:
        raise ValueError(f"data.image.min_pixels: need 0 < min_pixels ({img.min_pixels}) <= max_pixels "
                         f"({img.max_pixels})")
    if img.max_pixels < img.factor**2:
        raise ValueError(f"data.image.max_pixels {img.max_pixels} is below one merged patch "
                         f"({img.factor}x{img.factor})")
    smallest = block * max(1, -(-img.min_pixels // img.factor**2))
    if smallest > cfg.max_patches and cfg.kind != "mock":
        raise ValueError(f"data.patch_buckets: an image of min_pixels ({img.min_pixels}) needs >= {smallest} patches "
                         f"but the largest patch bucket is {cfg.max_patches}")
    if len(img.image_mean) != 3 or len(img.image_std) != 3 or min(img.image_std) <= 0:
        raise ValueError("data.image.image_mean / image_std need 3 values, std > 0")
    vid = cfg.video
    if not (vid.fps > 0 and vid.default_fps > 0 and 1 <= vid.min_frames <= vid.max_frames <= vid.max_decode_frames):
        raise ValueError(f"data.video: need fps ({vid.fps}) and default_fps ({vid.default_fps}) > 0 and 1 <= "
                         f"min_frames ({vid.min_frames}) <= max_frames ({vid.max_frames}) <= max_decode_frames "
                         f"({vid.max_decode_frames})")
    if not 0 < vid.min_pixels <= vid.max_pixels:
        raise ValueError(f"data.video.min_pixels: need 0 < min_pixels ({vid.min_pixels}) <= max_pixels "
                         f"({vid.max_pixels})")
    if cfg.workers < 0 or cfg.read_threads < 0 or cfg.read_buffer < 1 or cfg.worker_buffer < 1:
        raise ValueError(f"data.workers ({cfg.workers}) / read_threads ({cfg.read_threads}) must be >= 0 and "
                         "read_buffer / worker_buffer >= 1")
    if cfg.num_shards is not None and cfg.num_shards < 1:
        raise ValueError(f"data.num_shards must be >= 1 or null, got {cfg.num_shards}")
    if cfg.pack_lookahead < 1:
        raise ValueError("data.pack_lookahead must be >= 1")
    if cfg.num_epochs is not None and cfg.num_epochs < 1:
        raise ValueError("data.num_epochs must be null (forever) or >= 1")


def load_data_config(name_or_path: str | Mapping[str, Any] | DataConfig | None = None,
                     overrides: Iterable[str] = ()) -> DataConfig:
    """A data config from a preset name (``configs/data/NAME.yaml``; default ``vqa``), a YAML path or a
    mapping, with ``key=value`` overrides (dotted keys reach ``source.*`` and ``image.*``), by the one
    config loader (``moevlm_jax.schema``); a bad setting raises DataError naming the key."""
    try:
        return load_typed(DataConfig, "data", DEFAULT_CONFIG if name_or_path is None else name_or_path, overrides)
    except ConfigError as e:
        raise DataError(str(e)) from None
