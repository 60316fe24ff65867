"""Fixtures for the data tests: the HF reference tokenizer, small on-disk datasets."""

import io
import json

import pytest
from PIL import Image

from moevlm_jax.data.tokenizer import QWEN3_SPECIAL_TOKENS, qwen_ranks_path
from tests.data.images import jpeg_bytes  # noqa: F401  (fixtures below use it)


@pytest.fixture(scope="session")
def hf_tokenizer():
    """HF's Qwen2Tokenizer (the class Qwen3 uses) built independently from the same BPE ranks.

    Vocab and merges come from transformers' TikTokenConverter (how HF derived Qwen's tokenizer.json
    from qwen.tiktoken); the special tokens are added in Qwen3's order, so they get the real ids.
    """
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    path = str(qwen_ranks_path())
    vocab, merges = TikTokenConverter(path).extract_vocab_merges_from_model(path)
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN3_SPECIAL_TOKENS])
    return tok


@pytest.fixture()
def llava_dir(tmp_path):
    """A LLaVA JSON dataset with good samples and one of every kind of bad input.

    Returns (path of the JSON, expected skip counts by reason, indices of the good samples).
    """
    img = tmp_path / "images"
    img.mkdir()
    for k in range(6):
        (img / f"good{k}.jpg").write_bytes(jpeg_bytes(64 + 16 * k, 48 + 8 * k, seed=k))
    good = jpeg_bytes(100, 80, seed=9)
    (img / "corrupt.jpg").write_bytes(b"this is not an image at all" * 10)
    (img / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (img / "empty.jpg").write_bytes(b"")
    buf = io.BytesIO()
    Image.new("RGB", (2000, 5), "red").save(buf, format="PNG")
    (img / "thin.png").write_bytes(buf.getvalue())

    def conv(image, question="What is shown?", answer="A picture.", n_placeholders=1):
        turns = [{"from": "human", "value": "<image>\n" * n_placeholders + question}]
        if answer is not None:
            turns.append({"from": "gpt", "value": answer})
        entry = {"conversations": turns}
        if image is not None:
            entry["image"] = [f"images/{x}" for x in image] if isinstance(image, list) else f"images/{image}"
        return entry

    entries = [
        conv("good0.jpg"),
        conv("corrupt.jpg"),                           # corrupt_image
        conv("good1.jpg", answer="Two words."),
        conv("missing.jpg"),                           # missing_image
        conv("truncated.jpg"),                         # truncated_image
        conv("good2.jpg"),
        conv("empty.jpg"),                             # empty_image
        conv("thin.png"),                              # extreme_aspect
        conv("good3.jpg", answer=None),                # no_assistant
        conv("good4.jpg", question="word " * 400),     # too_long (seq_len 256)
        conv(["good5.jpg", "good0.jpg"], n_placeholders=1),  # image_count_mismatch
        conv("good5.jpg", question="Describe it.", answer="It is noise."),
        {"nonsense": True},                            # bad_record
        conv(None, question="Text only, no image.", answer="Fine.", n_placeholders=0),
    ]
    expected = {"corrupt_image": 1, "missing_image": 1, "truncated_image": 1, "empty_image": 1,
                "extreme_aspect": 1, "no_assistant": 1, "too_long": 1, "image_count_mismatch": 1,
                "bad_record": 1}
    good_indices = [0, 2, 5, 11, 13]
    path = tmp_path / "train.json"
    path.write_text(json.dumps(entries))
    return path, expected, good_indices
