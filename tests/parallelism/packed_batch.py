"""A small packed training batch with images and a video for layout tests: several samples per row, samples,
images and video frame groups crossing sequence-shard boundaries, padding at the end of some rows."""

from __future__ import annotations

import numpy as np

from moevlm_jax.data.batch import patch_layout
from moevlm_jax.data.mrope import mrope_position_ids

# per row: samples as (tokens, image grid (t, h, w) or None, or ("video", grid)); a grid of 1x4x4 patches = 4
# image tokens; a video of grid (2, 4, 4) is two frame pairs of 4 video tokens each, each pair written as
# <timestamp><|vision_start|> 4 x <|video_pad|> <|vision_end|> (the timestamp one random text token here)
ROW_PLANS = (
    ((10, (1, 4, 4)), (22, (1, 4, 4))),
    ((5, None), (19, (1, 4, 8)), (8, None)),
    ((16, ("video", (2, 4, 4))), (10, None)),  # 6 padding tokens
    ((32, (1, 8, 4)),),
)
# the same without the video (row 2: an image sample): for checks that are not about the batch's media
IMAGE_ROW_PLANS = (*ROW_PLANS[:2], ((12, (1, 4, 4)), (14, None)), *ROW_PLANS[3:])


def _vision_tokens(config, ids: np.ndarray, grid, video: bool) -> None:
    """Write one image's (or video's) placeholder tokens into ``ids`` from position 1."""
    t, h, w = grid
    per = h * w // 4  # merged tokens of one frame (pair)
    if not video:
        ids[1], ids[2:2 + t * per], ids[2 + t * per] = (
            config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
        return
    at = 1
    for _ in range(t):  # ids[at] stays a text token: the frame pair's timestamp
        ids[at + 1], ids[at + 2:at + 2 + per], ids[at + 2 + per] = (
            config.vision_start_token_id, config.video_token_id, config.vision_end_token_id)
        at += per + 3


def packed_batch(config, rows: int = 8, seq: int = 32, patches: int = 32, seed: int = 0, video: bool = True
                 ) -> dict[str, np.ndarray]:
    """The model batch of ARCHITECTURE.md for ``config`` (rows cycle through ROW_PLANS, or IMAGE_ROW_PLANS
    without ``video``), with targets and a loss mask on the text tokens of the latter two thirds of each sample."""
    plans = ROW_PLANS if video else IMAGE_ROW_PLANS
    rng = np.random.default_rng(seed)
    pdim = config.vision_config.patch_dim
    b = {"input_ids": np.zeros((rows, seq), np.int32), "positions": np.zeros((3, rows, seq), np.int32),
         "segment_ids": np.zeros((rows, seq), np.int32), "targets": np.zeros((rows, seq), np.int32),
         "loss_mask": np.zeros((rows, seq), np.float32), "pixel_values": np.zeros((rows, patches, pdim), np.float32),
         "patch_rc": np.zeros((rows, patches, 2), np.int32), "patch_hw": np.zeros((rows, patches, 2), np.int32),
         "patch_segment_ids": np.zeros((rows, patches), np.int32)}
    vision = (config.image_token_id, config.video_token_id)
    for r in range(rows):
        plan = plans[r % len(plans)]
        t = p = frames = 0
        for k, (n, grid) in enumerate(plan):
            ids = rng.integers(10, min(400, config.text_config.vocab_size), size=n).astype(np.int32)
            images = videos = None
            if grid is not None:
                video = grid[0] == "video"
                grid = grid[1] if video else grid
                _vision_tokens(config, ids, grid, video)
                count = grid[0] * grid[1] * grid[2]
                if video:
                    videos = np.array([grid])
                else:
                    images = np.array([grid])
                rc, hw, frame = patch_layout(np.array([grid]), config.vision_config.spatial_merge_size)
                b["pixel_values"][r, p:p + count] = rng.normal(size=(count, pdim))
                b["patch_rc"][r, p:p + count], b["patch_hw"][r, p:p + count] = rc, hw
                b["patch_segment_ids"][r, p:p + count] = frames + frame + 1  # one id per image / frame pair
                frames += int(frame[-1]) + 1
                p += count
            pos, _ = mrope_position_ids(ids, images, image_token_id=config.image_token_id, video_grid_thw=videos,
                                        video_token_id=config.video_token_id)
            b["input_ids"][r, t:t + n], b["positions"][:, r, t:t + n], b["segment_ids"][r, t:t + n] = ids, pos, k + 1
            b["targets"][r, t:t + n - 1] = ids[1:]
            mask = (~np.isin(ids[1:], vision)).astype(np.float32)
            mask[: n // 3] = 0
            b["loss_mask"][r, t:t + n - 1] = mask
            t += n
    return b
