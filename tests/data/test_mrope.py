"""MRoPE position ids (data.mrope) against HF's ``get_rope_index`` of Qwen3-VL-MoE and Qwen3.5-MoE, for prompts
with images and videos (each temporal patch of a video its own span after a timestamp), as the pipeline builds
them, with padding on the left."""

import types

import numpy as np
import pytest
import torch
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeModel
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel

from moevlm_jax.data.chat import VideoTokens, encode_conversation
from moevlm_jax.data.mrope import mrope_position_ids, video_frame_grids
from moevlm_jax.data.tokenizer import load_tokenizer

IMAGE, VIDEO = 151655, 151656


def _hf_rope_index(cls, ids: np.ndarray, mask: np.ndarray, images, videos) -> np.ndarray:
    """HF's ``get_rope_index`` (a method that reads only the merge size and ``get_vision_position_ids``)."""
    vision = types.SimpleNamespace(spatial_merge_size=2)
    stub = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision))
    stub.get_vision_position_ids = lambda *a, **k: cls.get_vision_position_ids(stub, *a, **k)
    types_ = np.where(ids == IMAGE, 1, 0) + np.where(ids == VIDEO, 2, 0)
    pos, _ = cls.get_rope_index(stub, torch.tensor(ids), torch.tensor(types_),
                                image_grid_thw=torch.tensor(images) if len(images) else None,
                                video_grid_thw=torch.tensor(videos) if len(videos) else None,
                                attention_mask=torch.tensor(mask))
    return pos.numpy()


@pytest.mark.parametrize("cls", [Qwen3VLMoeModel, Qwen3_5MoeModel], ids=["qwen3_vl_moe", "qwen3_5_moe"])
def test_positions_match_hf_get_rope_index(cls):
    tok = load_tokenizer("qwen3")
    convs = [
        ([{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Which way?"}, {"type": "image"}]},
          {"role": "assistant", "content": "Left."}], [(1, 4, 6)], [(3, 4, 8)]),
        ([{"role": "user", "content": [{"type": "text", "text": "Two clips: "}, {"type": "video"},
                                       {"type": "video"}]},
          {"role": "assistant", "content": "Same."}], [], [(2, 6, 2), (1, 2, 2)]),
    ]
    rows, grids_i, grids_v = [], [], []
    for conv, images, videos in convs:
        prompts = [VideoTokens(h * w // 4, tuple(0.5 + k for k in range(t))) for t, h, w in videos]
        enc = encode_conversation(conv, tok, [t * h * w // 4 for t, h, w in images], videos=prompts)
        ours, _ = mrope_position_ids(enc.ids, np.asarray(images) if images else None, image_token_id=IMAGE,
                                     video_grid_thw=np.asarray(videos), video_token_id=VIDEO)
        rows.append((enc.ids, ours))
        grids_i += images
        grids_v += videos
    s = max(len(ids) for ids, _ in rows) + 3
    ids = np.zeros((len(rows), s), np.int64)
    mask = np.zeros((len(rows), s), np.int64)
    for r, (x, _) in enumerate(rows):  # left padding
        ids[r, s - len(x):], mask[r, s - len(x):] = x, 1
    ref = _hf_rope_index(cls, ids, mask, grids_i, grids_v)
    for r, (x, ours) in enumerate(rows):
        np.testing.assert_array_equal(ours, ref[:, r, s - len(x):])
    # a video's temporal patches are separate spans: the second starts after the first's widest side + timestamp
    assert video_frame_grids(np.asarray([[3, 4, 8]])).tolist() == [[1, 4, 8]] * 3


def test_video_tokens_must_match_their_grids():
    ids = np.array([1, 2, VIDEO, VIDEO, 3, VIDEO])
    with pytest.raises(ValueError, match="video frame 1 with grid"):
        mrope_position_ids(ids, None, image_token_id=IMAGE, video_grid_thw=np.array([[2, 2, 4]]), video_token_id=VIDEO)
    pos, _ = mrope_position_ids(ids[:4], None, image_token_id=IMAGE, video_grid_thw=np.array([[1, 2, 4]]),
                                video_token_id=VIDEO)
    np.testing.assert_array_equal(pos, [[0, 1, 2, 2], [0, 1, 2, 2], [0, 1, 2, 3]])  # hand-computed: 1x2 merged grid
