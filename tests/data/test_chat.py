"""Chat template + labels vs HF (apply_chat_template, Qwen3VLProcessor) and a hand-written expectation."""

import io

import numpy as np
import pytest
from PIL import Image

from moevlm_jax.data.chat import (
    QWEN3_VL_CHAT_TEMPLATE,
    ConversationError,
    encode_conversation,
    render_text,
)
from moevlm_jax.data.config import load_data_config
from moevlm_jax.data.records import encode_record
from moevlm_jax.data.sample import SampleProcessor
from moevlm_jax.data.tokenizer import load_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}]},
     {"role": "assistant", "content": "red"}],
    [{"role": "system", "content": "You are a careful assistant."},
     {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image"},
                                  {"type": "text", "text": " and "}, {"type": "image"}, {"type": "text", "text": "."}]},
     {"role": "assistant", "content": [{"type": "text", "text": "The first is larger."}]},
     {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "\n\nBecause it has more pixels.\n"}],
    [{"role": "user", "content": "No image here: 3 + 4 = ?"}, {"role": "assistant", "content": " 7"}],
]


def test_render_matches_hand_written_qwen3_vl_format():
    expect = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is the shape?<|im_end|>\n"
              "<|im_start|>assistant\nred<|im_end|>\n")
    assert render_text(CONVERSATIONS[0]) == expect
    assert render_text(CONVERSATIONS[0], system_prompt="Be brief.").startswith(
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")


def test_render_matches_hf_apply_chat_template(hf_tokenizer):
    for conv in CONVERSATIONS:
        ref = hf_tokenizer.apply_chat_template(conv, chat_template=QWEN3_VL_CHAT_TEMPLATE, tokenize=False)
        assert render_text(conv) == ref


def expanded(text: str, counts: list[int]) -> str:
    pieces = text.split("<|image_pad|>")
    assert len(pieces) == len(counts) + 1
    return pieces[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, pieces[1:]))


def test_ids_and_labels_match_hf_tokenizer(hf_tokenizer):
    tok = load_tokenizer("qwen3")
    for conv in CONVERSATIONS:
        counts = [6, 9][: render_text(conv).count("<|image_pad|>")]
        enc = encode_conversation(conv, tok, counts)
        ref = hf_tokenizer(expanded(render_text(conv), counts), add_special_tokens=False)["input_ids"]
        assert enc.ids.tolist() == ref
        # trained tokens are exactly each assistant turn's content followed by <|im_end|>
        trained_text = tok.decode(enc.ids[enc.trained])
        answers = [m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
                   for m in conv if m["role"] == "assistant"]
        # (content that starts with newlines merges them into the header's "\n" token, which starts
        # in the untrained header, so those newlines are not trained: the label follows a token's start)
        assert trained_text == "".join(a.lstrip("\n") + "<|im_end|>" for a in answers)
        for k, a in enumerate(answers, start=1):  # answer ids: the content of turn k, without <|im_end|>
            assert tok.decode(enc.ids[enc.answer == k]) == a.lstrip("\n")
        assert not enc.trained[enc.ids == tok.special_id("<|image_pad|>")].any()


def test_conversation_errors():
    tok = load_tokenizer("qwen3")
    with pytest.raises(ConversationError) as e:
        encode_conversation([{"role": "user", "content": "hi"}], tok)
    assert e.value.reason == "no_assistant"
    with pytest.raises(ConversationError) as e:
        encode_conversation(CONVERSATIONS[0], tok, [])
    assert e.value.reason == "image_count_mismatch"


def test_sample_matches_hf_qwen3_vl_processor(hf_tokenizer, monkeypatch):
    """Our whole per-sample path (record -> ids, pixel_values, grids) vs HF's Qwen3VLProcessor."""
    from transformers import ProcessorMixin, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
    )

    cfg = load_data_config("vqa", ["seq_len=4096"])
    img_cfg = cfg.image
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": img_cfg.min_pixels, "longest_edge": img_cfg.max_pixels})
    # without torchvision, transformers' processor class check trips over the video-processor registry
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: None)
    processor = Qwen3VLProcessor(image_processor=image_processor, tokenizer=hf_tokenizer,
                                 video_processor=Qwen3VLVideoProcessor(), chat_template=QWEN3_VL_CHAT_TEMPLATE)
    rng = np.random.default_rng(0)
    jpegs = []
    for w, h in ((200, 120), (77, 301)):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
        jpegs.append(buf.getvalue())
    conv = CONVERSATIONS[1]
    text = processor.apply_chat_template(conv, tokenize=False)
    ref = processor(text=[text], images=[Image.open(io.BytesIO(b)) for b in jpegs], return_tensors="np")
    sample = SampleProcessor(cfg)(0, encode_record(conv, jpegs))
    assert "skip" not in sample, sample
    np.testing.assert_array_equal(sample["ids"], ref["input_ids"][0])
    np.testing.assert_array_equal(sample["grids"], ref["image_grid_thw"])
    from moevlm_jax.data.image import expand_patches

    np.testing.assert_array_equal(expand_patches(sample["patches"], img_cfg), ref["pixel_values"])
