"""Small videos the data tests write at run time: an mp4 (PyAV, MPEG-4 Part 2) and a folder of PNG frames, both a
white square moving left to right over a dark background."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
from PIL import Image


def moving_square(n: int, height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    """uint8 [n, height, width, 3]: frame i has a 16x16 white square at column 2*i (clipped), on a dark smooth
    pattern that changes with ``seed`` (smooth, so that a lossy codec keeps it close)."""
    y, x, c = np.meshgrid(np.arange(height), np.arange(width), np.arange(3), indexing="ij")
    background = (20 + 15 * np.sin(x / 9 + y / 13 + seed + 2 * c)).astype(np.uint8)
    frames = np.repeat(background[None], n, axis=0)
    for i in range(n):
        x = min(2 * i, width - 16)
        frames[i, 16:32, x:x + 16] = 255
    return frames


def write_mp4(path: Path, frames: np.ndarray, fps: int = 10, codec: str = "mpeg4") -> Path:
    """Encode frames with PyAV, MPEG-4 Part 2 by default (high quality, so decoded frames stay close to the drawn
    ones); the container follows the file name (``.mp4``, ``.mkv``, ``.avi``; ``.webm`` with ``codec="libvpx"``)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"} if codec == "mpeg4" else {"crf": "10", "b": "1M"}
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def write_frame_folder(folder: Path, frames: np.ndarray) -> Path:
    """PNG frames ``frame_1.png`` .. ``frame_N.png`` (lossless; names that sort wrongly as plain strings)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(frames):
        Image.fromarray(f).save(folder / f"frame_{i + 1}.png")
    return folder
