"""Qwen-VL video processing: decode (PyAV, or frame images) -> sample frames -> resize -> temporal patches.

A video is a file (or its encoded bytes, as ``data.records`` stores it) or its frame images: a folder of them (in
natural name order), a list of their paths, or a list of their encoded bytes (a record's video stored as frames);
the frames are sampled and decoded alike whichever form holds them.

Equal to HF's ``Qwen3VLVideoProcessor`` (Qwen3-VL and Qwen3.5 share it) except for the resize kernel:

- ``sample_frame_indices``: HF's ``sample_frames``: ``n = int(total / source_fps * fps)`` clamped to
  ``[min_frames, max_frames]`` and to the clip's frame count, indices ``linspace(0, total - 1, n)`` rounded. A clip
  longer than ``max_frames / fps`` seconds is sampled down to ``max_frames`` frames spread over its whole length,
  as HF does (never cut short). A source without a frame rate (a folder of frames) gets ``default_fps`` (HF: 24).
- ``smart_resize``: HF's video rule: one (height, width), multiples of patch*merge, with
  ``frames x height x width`` within ``[min_pixels, max_pixels]`` (the budget is over all sampled frames). A
  one-frame clip is sized as the two frames its patch becomes (HF refuses it).
- Resize: PIL bicubic on uint8 frames, as the image path (``data.image``). HF resizes videos with torchvision's
  bicubic on tensors; the two kernels differ by a few grey levels, the sizes and everything after are the same.
- Temporal patches: an odd frame count is padded by repeating the last frame (HF's ``patchify``); each patch row
  is ``(channel, frame in the pair, y, x)``: 3 * 2 * 16 * 16 values, merge blocks of 2x2 consecutive, frame
  pairs in turn: ``video_grid_thw = (frames / 2, h / 16, w / 16)``. Workers keep uint8 rows ``[N, 3*T*p*p]``;
  ``data.image.expand_patches`` normalises them with the image path's exact arithmetic.
- Timestamps (``frame_timestamps``): HF's ``Qwen3VLProcessor._calculate_timestamps``: each frame pair's mean of
  ``index / fps``, written ``<{t:.1f} seconds>`` (``data.chat.timestamp_text``) before that pair's
  ``<|vision_start|><|video_pad|>...``.

A clip that is missing or cannot be decoded raises :class:`VideoSkip` (``missing_video`` / ``corrupt_video``): the
sample is counted as skipped, never trained on its text alone.
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from moevlm_jax.data.config import ImageConfig, VideoConfig
from moevlm_jax.data.image import ImageSkip, decode_image

# files a folder of frames may hold (anything else in the folder is ignored)
FRAME_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff")


class VideoSkip(ImageSkip):
    """A video that cannot be used; ``reason`` (``missing_video`` / ``corrupt_video``) is the skip-count key."""


@dataclass
class Clip:
    """Decoded frames of one video and where they came from."""

    frames: np.ndarray  # uint8 [n, H, W, 3], the sampled frames in order
    indices: np.ndarray  # int [n], their indices in the source
    fps: float  # the source's frame rate (default_fps where it has none)
    total: int  # frames in the source
    at_fps: int = 0  # frames sampling at data.video.fps would take: above max_frames, the clip was sampled down

    @property
    def sampled_down(self) -> bool:
        """Fewer frames than ``data.video.fps`` asks for: the clip is longer than ``max_frames / fps`` seconds."""
        return self.at_fps > len(self.indices)


def frames_at_fps(total: int, source_fps: float | None, cfg: VideoConfig) -> int:
    """Frames sampling at ``cfg.fps`` takes from a clip of ``total`` frames (before ``max_frames`` bounds it)."""
    fps_in = cfg.default_fps if not source_fps else float(source_fps)
    return min(max(int(total / fps_in * cfg.fps), cfg.min_frames), total)


def sample_frame_indices(total: int, source_fps: float | None, cfg: VideoConfig) -> np.ndarray:
    """Indices of the frames to keep, HF ``Qwen3VLVideoProcessor.sample_frames`` (fps given, num_frames not)."""
    fps_in = cfg.default_fps if not source_fps else float(source_fps)
    n = int(total / fps_in * cfg.fps)
    n = min(max(n, cfg.min_frames), cfg.max_frames, total)
    return np.linspace(0, total - 1, n).round().astype(int)


def smart_resize(num_frames: int, height: int, width: int, temporal_factor: int = 2, factor: int = 32,
                 min_pixels: int = 131072, max_pixels: int = 786432) -> tuple[int, int]:
    """(height, width) of every frame: HF's video ``smart_resize`` (the pixel budget is over all frames)."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got "
                         f"{max(height, width) / min(height, width)}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def frame_timestamps(indices: Sequence[int], fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal patch (HF ``Qwen3VLProcessor._calculate_timestamps``): indices padded with the last
    to a multiple of the temporal patch, each group's first and last frame times averaged."""
    idx = [int(i) for i in indices]
    if len(idx) % temporal_patch_size:
        idx += [idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size)
    times = [i / fps for i in idx]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def _natural_key(name: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def frame_files(folder: Path) -> list[Path]:
    """The frame images of a folder, in natural name order (``frame_2`` before ``frame_10``)."""
    files = [p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in FRAME_SUFFIXES]
    return sorted(files, key=lambda p: _natural_key(p.name))


def _read_frames(files: Sequence[Path | bytes], cfg: VideoConfig, image_cfg: ImageConfig) -> Clip:
    """The sampled frames of a video given as its frame images in order: paths, or their encoded bytes (a record's
    video stored as frames); either way the same frames are sampled and decoded alike."""
    if not files:
        raise VideoSkip("corrupt_video", "no frame images (" + ", ".join(FRAME_SUFFIXES) + ")")
    if len(files) > cfg.max_decode_frames:
        raise VideoSkip("corrupt_video", f"{len(files)} frames > data.video.max_decode_frames {cfg.max_decode_frames}")
    indices = sample_frame_indices(len(files), None, cfg)
    frames = []
    for i in indices:
        frame = files[i]
        name = f"{i + 1} of {len(files)} ({len(frame)} bytes)" if isinstance(frame, bytes) else str(frame)
        try:
            data = frame if isinstance(frame, bytes) else Path(frame).read_bytes()
        except OSError as e:
            raise VideoSkip("corrupt_video", f"cannot read frame {name}: {e}") from None
        try:
            frames.append(np.asarray(decode_image(data, image_cfg), np.uint8))
        except ImageSkip as e:
            raise VideoSkip("corrupt_video", f"frame {name}: {e}") from None
    if len({f.shape for f in frames}) > 1:
        raise VideoSkip("corrupt_video", f"frames differ in size: {sorted({f.shape[:2] for f in frames})}")
    return Clip(np.stack(frames), indices, cfg.default_fps, len(files), frames_at_fps(len(files), None, cfg))


def _decode_file(path: Path | bytes, cfg: VideoConfig) -> Clip:
    """A video file, or its encoded bytes, decoded with PyAV: the sampled frames."""
    import av  # PyAV; imported here so that image-only pipelines never load FFmpeg

    source = io.BytesIO(path) if isinstance(path, bytes) else str(path)
    if isinstance(path, bytes):
        path = f"video of {len(path)} bytes"  # its name in messages
    try:
        with av.open(source) as container:
            if not container.streams.video:
                raise VideoSkip("corrupt_video", f"{path} has no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            fps = float(rate) if rate else None
            total = int(stream.frames or 0)
            if total <= 0:  # the container does not say (e.g. WebM): count the frames' packets
                total = sum(1 for packet in container.demux(stream) if packet.size)
                container.seek(0)
            if total <= 0:
                raise VideoSkip("corrupt_video", f"{path} has no frames")
            if total > cfg.max_decode_frames:
                raise VideoSkip("corrupt_video", f"{path}: {total} frames > data.video.max_decode_frames "
                                                 f"{cfg.max_decode_frames}")
            indices = sample_frame_indices(total, fps, cfg)
            wanted = set(indices.tolist())
            last = int(indices[-1])
            frames = {}
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    frames[i] = frame.to_ndarray(format="rgb24")
                if i >= last:
                    break
    except VideoSkip:
        raise
    except FileNotFoundError:
        raise VideoSkip("missing_video", f"video file {path} not found") from None
    except Exception as e:  # noqa: BLE001 - any FFmpeg failure is a corrupt video
        raise VideoSkip("corrupt_video", f"cannot decode {path}: {type(e).__name__}: {e}") from None
    if len(frames) < len(wanted):
        raise VideoSkip("corrupt_video", f"{path}: decoded {len(frames)} of the {len(wanted)} sampled frames "
                                         f"(the stream claims {total})")
    return Clip(np.stack([frames[int(i)] for i in indices]), indices, fps or cfg.default_fps, total,
                frames_at_fps(total, fps, cfg))


def decode_video(ref: str | Path | bytes | Sequence[str | Path | bytes], cfg: VideoConfig, image_cfg: ImageConfig
                 ) -> Clip:
    """A video file (any container FFmpeg reads: mp4, webm, mkv, avi, ...), its encoded bytes (a record's payload),
    a folder of frame images, a list of frame image paths or a list of encoded frame images (a record's video stored
    as frames) -> the sampled frames (uint8 RGB). Raises :class:`VideoSkip` with the reason."""
    if isinstance(ref, (bytes, bytearray, memoryview)):
        if not len(ref):
            raise VideoSkip("corrupt_video", "video of zero bytes")
        return _decode_file(bytes(ref), cfg)
    if not isinstance(ref, (str, Path)):
        return _read_frames([bytes(p) if isinstance(p, (bytes, bytearray, memoryview)) else Path(p) for p in ref],
                            cfg, image_cfg)
    path = Path(ref)
    if path.is_dir():
        return _read_frames(frame_files(path), cfg, image_cfg)
    if not path.exists():
        raise VideoSkip("missing_video", f"video file {path} not found")
    if path.stat().st_size == 0:
        raise VideoSkip("corrupt_video", f"video file {path} has zero bytes")
    return _decode_file(path, cfg)


def frame_size(num_frames: int, height: int, width: int, cfg: VideoConfig, image_cfg: ImageConfig) -> tuple[int, int]:
    """(height, width) every frame of a clip of ``num_frames`` sampled frames is resized to (HF's video
    ``smart_resize``); an aspect ratio above 200 raises :class:`VideoSkip` (``extreme_aspect``)."""
    try:
        return smart_resize(max(num_frames, image_cfg.temporal_patch_size), height, width,
                            image_cfg.temporal_patch_size, image_cfg.factor, cfg.min_pixels, cfg.max_pixels)
    except ValueError as e:
        raise VideoSkip("extreme_aspect", str(e)) from None


def resize_frames(frames: np.ndarray, cfg: VideoConfig, image_cfg: ImageConfig) -> np.ndarray:
    """uint8 [n, H, W, 3] -> uint8 [n, h, w, 3] at HF's video ``smart_resize`` size (PIL bicubic)."""
    n, height, width, _ = frames.shape
    h, w = frame_size(n, height, width, cfg, image_cfg)
    if (h, w) == (height, width):
        return frames
    return np.stack([np.asarray(Image.fromarray(f).resize((w, h), resample=Image.Resampling.BICUBIC), np.uint8)
                     for f in frames])


def compact_video_patches(frames: np.ndarray, image_cfg: ImageConfig) -> tuple[np.ndarray, np.ndarray]:
    """Resized uint8 frames [n, h, w, 3] -> (uint8 patch rows [N, 3*T*p*p] in HF's ``patchify`` order,
    video_grid_thw int32 [3]); an odd frame count is padded with the last frame."""
    p, m, t = image_cfg.patch_size, image_cfg.merge_size, image_cfg.temporal_patch_size
    if pad := -len(frames) % t:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
    n, height, width, c = frames.shape
    gt, gh, gw = n // t, height // p, width // p
    x = frames.reshape(gt, t, gh // m, m, p, gw // m, m, p, c)
    # -> (pair, block row, block col, row in block, col in block, channel, frame in pair, y, x)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * t * p * p), np.array([gt, gh, gw], np.int32)


def process_video(clip: Clip, cfg: VideoConfig, image_cfg: ImageConfig) -> tuple[np.ndarray, np.ndarray, list[float]]:
    """A decoded clip -> (uint8 patch rows [N, 3*T*p*p], video_grid_thw int32 [3], seconds of each temporal patch)."""
    patches, grid = compact_video_patches(resize_frames(clip.frames, cfg, image_cfg), image_cfg)
    return patches, grid, frame_timestamps(clip.indices, clip.fps, image_cfg.temporal_patch_size)
