"""A small packed training batch with images for layout tests: several samples per row, samples and
images crossing sequence-shard boundaries, padding at the end of some rows."""

from __future__ import annotations

import numpy as np

from moevlm_jax.data.batch import patch_layout
from moevlm_jax.data.mrope import mrope_position_ids

# per row: samples as (tokens, image grid (t, h, w) or None); a grid of 1x4x4 patches = 4 image tokens
ROW_PLANS = (
    ((10, (1, 4, 4)), (22, (1, 4, 4))),
    ((5, None), (19, (1, 4, 8)), (8, None)),
    ((12, (1, 4, 4)), (14, None)),            # 6 padding tokens
    ((32, (1, 8, 4)),),
)


def packed_batch(config, rows: int = 8, seq: int = 32, patches: int = 32, seed: int = 0) -> dict[str, np.ndarray]:
    """The model batch of ARCHITECTURE.md for ``config`` (rows cycle through ROW_PLANS), with
    targets and a loss mask on the text tokens of the latter two thirds of each sample."""
    rng = np.random.default_rng(seed)
    pdim = config.vision_config.patch_dim
    b = {"input_ids": np.zeros((rows, seq), np.int32), "positions": np.zeros((3, rows, seq), np.int32),
         "segment_ids": np.zeros((rows, seq), np.int32), "targets": np.zeros((rows, seq), np.int32),
         "loss_mask": np.zeros((rows, seq), np.float32), "pixel_values": np.zeros((rows, patches, pdim), np.float32),
         "patch_rc": np.zeros((rows, patches, 2), np.int32), "patch_hw": np.zeros((rows, patches, 2), np.int32),
         "patch_segment_ids": np.zeros((rows, patches), np.int32)}
    for r in range(rows):
        plan = ROW_PLANS[r % len(ROW_PLANS)]
        t = p = images = 0
        for k, (n, grid) in enumerate(plan):
            ids = rng.integers(10, min(400, config.text_config.vocab_size), size=n).astype(np.int32)
            grids = None
            if grid is not None:
                count = grid[0] * grid[1] * grid[2]
                ids[1], ids[2:2 + count // 4], ids[2 + count // 4] = (
                    config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
                grids = np.array([grid])
                rc, hw, _ = patch_layout(grids, config.vision_config.spatial_merge_size)
                images += 1
                b["pixel_values"][r, p:p + count] = rng.normal(size=(count, pdim))
                b["patch_rc"][r, p:p + count], b["patch_hw"][r, p:p + count] = rc, hw
                b["patch_segment_ids"][r, p:p + count] = images
                p += count
            pos, _ = mrope_position_ids(ids, grids, image_token_id=config.image_token_id)
            b["input_ids"][r, t:t + n], b["positions"][:, r, t:t + n], b["segment_ids"][r, t:t + n] = ids, pos, k + 1
            b["targets"][r, t:t + n - 1] = ids[1:]
            mask = (ids[1:] != config.image_token_id).astype(np.float32)
            mask[: n // 3] = 0
            b["loss_mask"][r, t:t + n - 1] = mask
            t += n
    return b
