"""MRoPE position ids (Qwen3-VL's and Qwen3.5's ``get_rope_index``) computed on the host with numpy.

Text tokens advance all three (temporal, height, width) components together; the merged tokens of
an image of grid (t, h, w) get positions ``start + (t_idx, h_idx, w_idx)`` over the merged grid
``(t, h // merge, w // merge)``, and the text after the image continues at
``start + max(h, w) // merge``. A video of grid (t, h, w) is t such images of grid (1, h, w), one per
temporal patch: in the prompt each is its own run of ``<|video_pad|>`` between a timestamp text and
the next (HF splits ``video_grid_thw`` so: ``repeat_interleave`` over t, then t = 1). Positions are
computed per sample, so packed samples each start at 0.
"""

from __future__ import annotations

import numpy as np


def video_frame_grids(video_grid_thw: np.ndarray | None) -> np.ndarray:
    """Videos ``[n, 3]`` -> one grid ``(1, h, w)`` per temporal patch, in order (as HF's ``get_rope_index``)."""
    if video_grid_thw is None:
        return np.zeros((0, 3), np.int64)
    grids = np.asarray(video_grid_thw, np.int64).reshape(-1, 3)
    out = np.repeat(grids, grids[:, 0], axis=0)
    out[:, 0] = 1
    return out


def mrope_position_ids(
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    *,
    image_token_id: int,
    spatial_merge_size: int = 2,
    video_grid_thw: np.ndarray | None = None,
    video_token_id: int | None = None,
) -> tuple[np.ndarray, int]:
    """Positions ``[3, S]`` (int32) and the rope delta (max position + 1 - S) of one sample.

    ``input_ids`` is one unpadded sample ``[S]``; ``image_grid_thw`` ``[num_images, 3]`` lists the
    patch grids of its images in order, ``video_grid_thw`` those of its videos (their tokens are
    ``video_token_id``). Each image must appear as a run of exactly ``t * h * w // merge**2`` image
    tokens, each temporal patch of a video as a run of ``h * w // merge**2`` video tokens.
    """
    input_ids = np.asarray(input_ids)
    kinds = np.where(input_ids == image_token_id, 1, 0)
    if video_token_id is not None:
        kinds = np.where(input_ids == video_token_id, 2, kinds)
    queues = {1: np.zeros((0, 3), np.int64) if image_grid_thw is None else np.asarray(image_grid_thw, np.int64),
              2: video_frame_grids(video_grid_thw)}
    used = {1: 0, 2: 0}
    names = {1: "image", 2: "video frame"}
    pieces: list[np.ndarray] = []
    pos = 0
    i = 0
    n = len(input_ids)
    while i < n:
        kind = int(kinds[i])
        j = i
        while j < n and kinds[j] == kind:
            j += 1
        if not kind:
            pieces.append(np.broadcast_to(np.arange(pos, pos + j - i), (3, j - i)))
            pos += j - i
            i = j
            continue
        # a run of vision tokens may hold several adjacent images: consume grids until it is used up
        grids = queues[kind]
        while i < j:
            k = used[kind]
            if k >= len(grids):
                raise ValueError(f"more {names[kind]} token runs than {names[kind]} grids ({len(grids)})")
            t, h, w = (int(v) for v in grids[k])
            gh, gw = h // spatial_merge_size, w // spatial_merge_size
            count = t * gh * gw
            if i + count > j:
                raise ValueError(
                    f"{names[kind]} {k} with grid {(t, h, w)} needs {count} {names[kind]} tokens, the run has {j - i}"
                )
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            pieces.append(np.stack([tt.ravel() + pos, hh.ravel() + pos, ww.ravel() + pos]))
            pos += max(gh, gw)
            used[kind] += 1
            i += count
    for kind, grids in queues.items():
        if used[kind] != len(grids):
            raise ValueError(f"{len(grids)} {names[kind]} grids given but {used[kind]} found in the tokens")
    positions = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int64)
    delta = int(positions.max()) + 1 - n if n else 0
    return positions.astype(np.int32), delta
