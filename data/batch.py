"""The batch contract between the data pipeline and the model (ARCHITECTURE.md "The batch").

``MODEL_KEYS`` are the arrays the model and the train step take (numpy on the host, one row per
packed sequence). ``patch_layout`` gives each flattened patch its (row, col) in its image's patch
grid, the grid size, and its frame; the pipeline uses it to build ``patch_rc`` / ``patch_hw`` /
``patch_segment_ids``, and the MRoPE position ids come from ``data.mrope``. ``hf_inputs_to_batch``
turns Hugging Face model inputs (flat ``pixel_values`` + ``image_grid_thw`` + ``attention_mask``)
into the same per-row batch (the model's HF-compatible eager call), ``hf_labels_to_targets`` HF
labels into ``targets`` / ``loss_mask``; ``batch_shapes`` gives a train batch's shapes and dtypes
(to compile a step before any batch exists). Plain numpy: no model, no jax.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moevlm_jax.data.mrope import mrope_position_ids

# the arrays of a batch the model and the train step take (ARCHITECTURE.md "The batch")
MODEL_KEYS = ("input_ids", "positions", "segment_ids", "targets", "loss_mask",
              "pixel_values", "patch_rc", "patch_hw", "patch_segment_ids", "patch_dest")
# those with the patch axis (axis 1: [rows, P, ...]); padding patches are zeros in each
PATCH_KEYS = ("pixel_values", "patch_rc", "patch_hw", "patch_segment_ids", "patch_dest")


def batch_shapes(model: Any, rows: int, seq_len: int, patches: int, microbatches: int = 1, dest: bool = False
                 ) -> dict[str, tuple[tuple[int, ...], str]]:
    """key -> (shape with the leading microbatch axis, dtype) of a train batch of ``microbatches`` x
    ``rows`` rows of ``seq_len`` tokens and ``patches`` patch rows each, as the pipeline builds it
    (``model``: a model config, for the patch width); no patch keys when ``patches`` is 0; ``dest``:
    with ``patch_dest`` (data whose vision rows are balanced, ``data.balance_vision_rows``)."""
    g, b, s = microbatches, rows, seq_len
    out = {"input_ids": ((g, b, s), "int32"), "positions": ((g, 3, b, s), "int32"),
           "segment_ids": ((g, b, s), "int32"), "targets": ((g, b, s), "int32"),
           "loss_mask": ((g, b, s), "float32")}
    if patches:
        if patches % 4:
            raise ValueError(f"patches ({patches}) must be a multiple of 4 (2x2 merge blocks)")
        v = model.vision_config
        dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
        out.update({"pixel_values": ((g, b, patches, dim), "float32"), "patch_rc": ((g, b, patches, 2), "int32"),
                    "patch_hw": ((g, b, patches, 2), "int32"), "patch_segment_ids": ((g, b, patches), "int32")})
        if dest:
            out["patch_dest"] = ((g, b, patches), "int32")
    return out


def patch_layout(image_grid_thw: np.ndarray, spatial_merge_size: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For images ``[n, 3]`` (t, h, w), per patch in HF order (frames in turn, each in 2x2
    merge-block order): patch_rc ``[N, 2]``, patch_hw ``[N, 2]``, frame index ``[N]`` (0.., one per
    image frame, in order); N = sum t*h*w. All int32."""
    m = spatial_merge_size
    rcs, hws, frames = [], [], []
    frame = 0
    for t, h, w in np.asarray(image_grid_thw, np.int64).reshape(-1, 3):
        if h % m or w % m:
            raise ValueError(f"image grid {(t, h, w)} does not divide by spatial_merge_size {m}")
        within = np.arange(h * w)
        in_col, in_row = within % m, (within // m) % m
        block_col = (within // (m * m)) % (w // m)
        block_row = within // (m * m * (w // m))
        rc = np.stack([block_row * m + in_row, block_col * m + in_col], axis=-1)
        rcs.append(np.tile(rc, (t, 1)))
        hws.append(np.broadcast_to(np.array([h, w]), (t * h * w, 2)))
        frames.append(np.repeat(np.arange(frame, frame + t), h * w))
        frame += t
    if not rcs:
        z = np.zeros((0, 2), np.int32)
        return z, z.copy(), np.zeros((0,), np.int32)
    return (np.concatenate(rcs).astype(np.int32), np.concatenate(hws).astype(np.int32),
            np.concatenate(frames).astype(np.int32))


def _assign(counts: np.ndarray, tokens: np.ndarray, what: str) -> list[tuple[int, int]]:
    """Items (images or videos) in order -> per row the range of items whose tokens it holds (``tokens[r]``
    placeholder tokens; ``counts[k]`` tokens of item k), as HF's masked_scatter fills rows in order."""
    rows, item = [], 0
    for r, want in enumerate(tokens.tolist()):
        first = item
        while want > 0:
            if item >= len(counts):
                raise ValueError(f"row {r} has more {what} tokens than the {what}s of the grid provide")
            want -= int(counts[item])
            item += 1
        if want < 0:
            raise ValueError(f"row {r}: its {what} tokens do not add up to whole {what}s")
        rows.append((first, item))
    if item != len(counts):
        raise ValueError(f"{len(counts)} {what}s given, the tokens use {item}")
    return rows


def hf_inputs_to_batch(config: Any, input_ids: np.ndarray, pixel_values: np.ndarray | None = None,
                       image_grid_thw: np.ndarray | None = None, attention_mask: np.ndarray | None = None,
                       patch_multiple: int = 4, num_patches: int | None = None, *,
                       pixel_values_videos: np.ndarray | None = None,
                       video_grid_thw: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """HF inputs -> model batch: input_ids ``[B, S]``, pixel_values ``[N, patch_dim]`` (all images of
    the batch, in order), image_grid_thw ``[n, 3]``, attention_mask ``[B, S]`` (1 = token, 0 = pad),
    pixel_values_videos / video_grid_thw likewise for videos.

    Images and videos go to rows in order by counting each row's image / video tokens (as HF's masked_scatter
    does); within a row the patches of its images and videos follow each other in the order of their first
    tokens, so the k-th merged visual token lands on the row's k-th image or video token. Positions follow HF:
    plain ``arange(S)`` for a batch without images or videos, else ``get_rope_index`` over each row's unmasked
    tokens (0 at padding). The patch axis P is the longest row's patches padded to a multiple of
    ``patch_multiple``, or ``num_patches`` (a fixed bucket) when given.
    """
    input_ids = np.asarray(input_ids).astype(np.int32)
    b, s = input_ids.shape
    mask = np.ones((b, s), np.int32) if attention_mask is None else np.asarray(attention_mask).astype(np.int32)
    batch = {"input_ids": input_ids, "segment_ids": mask}
    merge = config.vision_config.spatial_merge_size
    has_images = pixel_values is not None and image_grid_thw is not None and len(image_grid_thw) > 0
    has_videos = pixel_values_videos is not None and video_grid_thw is not None and len(video_grid_thw) > 0
    if not has_images and not has_videos:
        batch["positions"] = np.broadcast_to(np.arange(s, dtype=np.int32), (3, b, s)).copy()
        if num_patches:  # a fixed patch bucket: all-padding patches (same compiled step as image batches)
            patch_dim = config.vision_config.patch_dim
            batch.update(pixel_values=np.zeros((b, num_patches, patch_dim), np.float32),
                         patch_rc=np.zeros((b, num_patches, 2), np.int32), patch_hw=np.zeros((b, num_patches, 2),
                                                                                             np.int32),
                         patch_segment_ids=np.zeros((b, num_patches), np.int32))
        return batch

    def media(pixels, grid_thw, token_id, what):
        grids = np.zeros((0, 3), np.int64) if grid_thw is None else np.asarray(grid_thw, np.int64).reshape(-1, 3)
        pixels = np.zeros((0, config.vision_config.patch_dim), np.float32) if pixels is None else np.asarray(
            pixels, np.float32)
        n_patches = grids.prod(-1)
        if pixels.shape[0] != n_patches.sum():
            raise ValueError(f"{what} pixel values have {pixels.shape[0]} patches, the grids need {n_patches.sum()}")
        start = np.concatenate([[0], np.cumsum(n_patches)]).astype(np.int64)
        rows = _assign(n_patches // (merge * merge), ((input_ids == token_id) & (mask > 0)).sum(1)
                       if token_id is not None else np.zeros(b, np.int64), what)
        return grids, pixels, start, rows

    video_id = getattr(config, "video_token_id", None)
    img = media(pixel_values if has_images else None, image_grid_thw if has_images else None, config.image_token_id,
                "image")
    vid = media(pixel_values_videos if has_videos else None, video_grid_thw if has_videos else None, video_id, "video")

    positions = np.zeros((3, b, s), np.int32)
    per_row: list[list[tuple[np.ndarray, np.ndarray]]] = []  # per row: (pixels, grid) of each item in token order
    for r in range(b):
        valid = mask[r] > 0
        (fi, ei), (fv, ev) = img[3][r], vid[3][r]
        pos, _ = mrope_position_ids(input_ids[r][valid], img[0][fi:ei], image_token_id=config.image_token_id,
                                    spatial_merge_size=merge, video_grid_thw=vid[0][fv:ev], video_token_id=video_id)
        positions[:, r, valid] = pos
        # each item's first token: the k-th image's run starts after the earlier images' tokens (videos likewise)
        items = []
        for (grids, pixels, start, _), (f, e), token_id in ((img, (fi, ei), config.image_token_id),
                                                            (vid, (fv, ev), video_id)):
            where = np.flatnonzero((input_ids[r] == token_id) & valid)
            before = 0
            for k in range(f, e):
                items.append((int(where[before]), pixels[start[k]:start[k + 1]], grids[k]))
                before += int(grids[k].prod()) // (merge * merge)
        items.sort(key=lambda it: it[0])
        per_row.append([(p, g) for _, p, g in items])
    batch["positions"] = positions

    counts = [sum(len(p) for p, _ in row) for row in per_row]
    p = max(patch_multiple, -(-max(counts) // patch_multiple) * patch_multiple)
    if num_patches is not None:
        if num_patches < max(counts) or num_patches % (merge * merge):
            raise ValueError(f"num_patches {num_patches} must be >= {max(counts)} and a multiple of {merge * merge}")
        p = num_patches
    dim = (img[1] if len(img[1]) else vid[1]).shape[1]
    pv = np.zeros((b, p, dim), np.float32)
    rc = np.zeros((b, p, 2), np.int32)
    hw = np.zeros((b, p, 2), np.int32)
    seg = np.zeros((b, p), np.int32)
    for r, row in enumerate(per_row):
        if not row:
            continue
        pixels = np.concatenate([x for x, _ in row])
        rc_r, hw_r, frame_r = patch_layout(np.stack([g for _, g in row]), merge)
        n = len(pixels)
        pv[r, :n], rc[r, :n], hw[r, :n], seg[r, :n] = pixels, rc_r, hw_r, frame_r + 1
    batch.update(pixel_values=pv, patch_rc=rc, patch_hw=hw, patch_segment_ids=seg)
    return batch


def hf_labels_to_targets(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF ``labels`` ``[B, S]`` (-100 = ignore; HF shifts inside its loss) -> targets ``[B, S]`` int32
    (the next token's label) and loss_mask ``[B, S]`` float32, the batch's convention."""
    labels = np.asarray(labels)
    nxt = np.concatenate([labels[:, 1:], np.full((labels.shape[0], 1), -100, labels.dtype)], axis=1)
    mask = nxt != -100
    return np.where(mask, nxt, 0).astype(np.int32), mask.astype(np.float32)
