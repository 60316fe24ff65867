"""MRoPE position ids (Qwen3-VL's ``get_rope_index``) computed on the host with numpy.

Text tokens advance all three (temporal, height, width) components together; the merged tokens of
an image of grid (t, h, w) get positions ``start + (t_idx, h_idx, w_idx)`` over the merged grid
``(t, h // merge, w // merge)``, and the text after the image continues at
``start + max(h, w) // merge``. Positions are computed per sample, so packed samples each start
at 0.
"""

from __future__ import annotations

import numpy as np


def mrope_position_ids(
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    *,
    image_token_id: int,
    spatial_merge_size: int = 2,
) -> tuple[np.ndarray, int]:
    """Positions ``[3, S]`` (int32) and the rope delta (max position + 1 - S) of one sample.

    ``input_ids`` is one unpadded sample ``[S]``; ``image_grid_thw`` ``[num_images, 3]`` lists the
    patch grids of its images in order. Each image must appear as a run of exactly
    ``t * h * w // merge**2`` image tokens.
    """
    input_ids = np.asarray(input_ids)
    is_image = input_ids == image_token_id
    grids = np.zeros((0, 3), np.int64) if image_grid_thw is None else np.asarray(image_grid_thw, np.int64)
    pieces: list[np.ndarray] = []
    pos = 0
    i = 0
    n = len(input_ids)
    image_index = 0
    while i < n:
        j = i
        while j < n and is_image[j] == is_image[i]:
            j += 1
        if not is_image[i]:
            pieces.append(np.broadcast_to(np.arange(pos, pos + j - i), (3, j - i)))
            pos += j - i
            i = j
            continue
        # a run of image tokens may hold several adjacent images: consume grids until it is used up
        while i < j:
            if image_index >= len(grids):
                raise ValueError(f"more image-token runs than image grids ({len(grids)})")
            t, h, w = (int(v) for v in grids[image_index])
            gh, gw = h // spatial_merge_size, w // spatial_merge_size
            count = t * gh * gw
            if i + count > j:
                raise ValueError(
                    f"image {image_index} with grid {(t, h, w)} needs {count} image tokens, "
                    f"the run has {j - i}"
                )
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            pieces.append(np.stack([tt.ravel() + pos, hh.ravel() + pos, ww.ravel() + pos]))
            pos += max(gh, gw)
            image_index += 1
            i += count
    if image_index != len(grids):
        raise ValueError(f"{len(grids)} image grids given but {image_index} images found in the tokens")
    positions = np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), np.int64)
    delta = int(positions.max()) + 1 - n if n else 0
    return positions.astype(np.int32), delta
