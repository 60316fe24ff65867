"""The HF reference for the model tests: small random HF Qwen3-VL-MoE configs and models, HF-style
batches (no image / one image / several images of different sizes, left padding), HF forward."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from moevlm_jax.model.registry import load_model_config

IMAGE, VIDEO, V_START, V_END = 500, 501, 502, 503
TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=V_START, vision_end_token_id=V_END)


def _rope(sections):
    return dict(rope_type="default", rope_theta=5e6, mrope_section=list(sections), mrope_interleaved=True)


def hf_config_dicts() -> dict[str, dict]:
    """HF config dicts: tiny.yaml (GQA 2, 8 experts top-2, all MoE, deepstack [1, 2]); "dense_mix"
    (GQA 4, 6 experts top-3, dense layers 0 and 2 via mlp_only_layers, square experts H == 2I,
    tied embeddings, deepstack [0]); "sparse_step" (MHA, attention bias, 4 experts top-1,
    decoder_sparse_step 2, unsorted deepstack [2, 0])."""
    tiny = load_model_config("tiny-v512").to_hf_dict()
    dense_mix = dict(
        text_config=dict(vocab_size=512, hidden_size=48, intermediate_size=40, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=12, rope_parameters=_rope([2, 2, 2]),
                         moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3, mlp_only_layers=[0, 2],
                         router_aux_loss_coef=0.01),
        vision_config=dict(depth=2, hidden_size=24, intermediate_size=40, num_heads=2, out_hidden_size=48,
                           num_position_embeddings=36, deepstack_visual_indexes=[0]),
        tie_word_embeddings=True, **TOKENS)
    sparse_step = dict(
        text_config=dict(vocab_size=520, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=2, head_dim=16, rope_parameters=_rope([4, 2, 2]),
                         attention_bias=True, moe_intermediate_size=20, num_experts=4, num_experts_per_tok=1,
                         decoder_sparse_step=2),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=4, out_hidden_size=32,
                           num_position_embeddings=49, deepstack_visual_indexes=[2, 0]),
        **TOKENS)
    return {"tiny": tiny, "dense_mix": dense_mix, "sparse_step": sparse_step}


def build_hf(config: dict, seed: int) -> Qwen3VLMoeForConditionalGeneration:
    """A random HF model with O(1) activations: weights ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1),
    biases ~ N(0, 0.1), router weights large enough that top-k choices are clear-cut."""
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(Qwen3VLMoeConfig(**config)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn_like(p))
            elif "experts" in name:
                fan_in = p.shape[-1]  # transformers keeps [E, out, in]
                p.copy_(torch.randn_like(p) / fan_in**0.5)
            else:
                fan_in = p[0].numel() if p.ndim > 1 else p.shape[-1]
                p.copy_(torch.randn_like(p) / fan_in**0.5)
    return model


@dataclasses.dataclass
class HFFixture:
    name: str
    config: dict
    model: Qwen3VLMoeForConditionalGeneration
    path: str


def _frame(ids: np.ndarray, row: int, start: int, n: int) -> int:
    ids[row, start] = V_START
    ids[row, start + 1 : start + 1 + n] = IMAGE
    ids[row, start + 1 + n] = V_END
    return start + n + 2


@dataclasses.dataclass
class HFBatch:
    input_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    pixel_values_videos: np.ndarray | None = None
    video_grid_thw: np.ndarray | None = None

    def hf_kwargs(self) -> dict:
        """The vision inputs of HF's forward: pixels and grids, and ``mm_token_type_ids`` (1 image, 2 video)."""
        kw = {"mm_token_type_ids": torch.tensor(np.where(self.input_ids == IMAGE, 1, 0)
                                                + np.where(self.input_ids == VIDEO, 2, 0))}
        if self.pixel_values is not None:
            kw.update(pixel_values=torch.tensor(self.pixel_values), image_grid_thw=torch.tensor(self.image_grid_thw))
        if self.pixel_values_videos is not None:
            kw.update(pixel_values_videos=torch.tensor(self.pixel_values_videos),
                      video_grid_thw=torch.tensor(self.video_grid_thw))
        return kw


def make_batches(patch_dim: int = 1536, seed: int = 0) -> dict[str, HFBatch]:
    """HF-style batches, all [3, 40]: "text" (no image), "one_image" (one 4x6-patch image), "multi"
    (row 0: 4x4 and 6x4 images, row 1: text only, row 2: a 10x4 image; left padding on rows 1-2).
    Labels: -100 at padding, image tokens, each row's first token and a few random positions."""
    rng = np.random.default_rng(seed)
    b, s = 3, 40
    out = {}
    for name, layout in {
        "text": [[], [], []],
        "one_image": [[], [(1, 4, 6)], []],
        "multi": [[(1, 4, 4), (1, 6, 4)], [], [(1, 10, 4)]],
    }.items():
        ids = rng.integers(0, 400, size=(b, s))
        mask = np.ones((b, s), np.int64)
        pads = [0, 3, 2]
        grids = []
        for r, images in enumerate(layout):
            mask[r, : pads[r]] = 0
            ids[r, : pads[r]] = 0
            pos = pads[r] + 2
            for t, h, w in images:
                pos = _frame(ids, r, pos, t * h * w // 4) + 1
                grids.append((t, h, w))
        labels = np.where((mask == 1) & (ids != IMAGE), ids, -100)
        labels[np.arange(b), pads] = -100  # no target "first token given padding" (meaningless in HF too)
        labels[rng.random((b, s)) < 0.1] = -100
        batch = HFBatch(ids, mask, labels)
        if grids:
            batch.image_grid_thw = np.asarray(grids, np.int64)
            n = int(batch.image_grid_thw.prod(-1).sum())
            batch.pixel_values = rng.standard_normal((n, patch_dim)).astype(np.float32)
        out[name] = batch
    return out


def make_video_batch(patch_dim: int = 1536, seed: int = 1) -> HFBatch:
    """A [3, 64] batch with videos as HF's processor lays them out: each temporal patch its own
    ``<t seconds><|vision_start|><|video_pad|>...<|vision_end|>`` span (timestamps as random text tokens).
    Row 0: a 4x4 image, then a video of grid (2, 4, 6); row 1 (left padding 2): a video of grid (3, 2, 4) and
    text; row 2: text only (left padding 5). Labels as :func:`make_batches`."""
    rng = np.random.default_rng(seed)
    b, s = 3, 64
    ids = rng.integers(0, 400, size=(b, s))
    mask = np.ones((b, s), np.int64)
    pads = [0, 2, 5]
    images, videos = [], []
    for r, items in enumerate([[("image", (1, 4, 4)), ("video", (2, 4, 6))], [("video", (3, 2, 4))], []]):
        mask[r, : pads[r]] = 0
        ids[r, : pads[r]] = 0
        pos = pads[r] + 2
        for kind, (t, h, w) in items:
            if kind == "image":
                pos = _frame(ids, r, pos, h * w // 4) + 1
                images.append((t, h, w))
                continue
            for _ in range(t):  # timestamp text (3 tokens), then the temporal patch's span
                pos += 3
                pos = _frame(ids, r, pos, h * w // 4)
                ids[r, pos - 1 - h * w // 4: pos - 1] = VIDEO
            pos += 1
            videos.append((t, h, w))
    labels = np.where((mask == 1) & (ids != IMAGE) & (ids != VIDEO), ids, -100)
    labels[np.arange(b), pads] = -100
    labels[rng.random((b, s)) < 0.1] = -100
    batch = HFBatch(ids, mask, labels)
    batch.image_grid_thw = np.asarray(images, np.int64)
    batch.pixel_values = rng.standard_normal((int(batch.image_grid_thw.prod(-1).sum()), patch_dim)).astype(np.float32)
    batch.video_grid_thw = np.asarray(videos, np.int64)
    batch.pixel_values_videos = rng.standard_normal((int(batch.video_grid_thw.prod(-1).sum()), patch_dim)
                                                    ).astype(np.float32)
    return batch


def hf_forward(model: Qwen3VLMoeForConditionalGeneration, batch: HFBatch, labels: bool = True):
    """HF outputs (logits, loss incl. router aux, aux loss) for an HFBatch, router logits on."""
    kw = dict(input_ids=torch.tensor(batch.input_ids), attention_mask=torch.tensor(batch.attention_mask),
              output_router_logits=True, **batch.hf_kwargs())
    if labels:
        kw["labels"] = torch.tensor(batch.labels)
    with torch.no_grad():
        return model(**kw)
