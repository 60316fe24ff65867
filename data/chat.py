"""Qwen3-VL chat template: conversation -> token ids, trained-token mask, answer spans.

Messages are HF style: ``{"role": "system"|"user"|"assistant", "content": str | [items]}`` with
items ``{"type": "text", "text": ...}``, ``{"type": "image"}`` or ``{"type": "video"}``. The rendering is
Qwen3-VL Instruct's template without tools (``QWEN3_VL_CHAT_TEMPLATE`` below is its Jinja form)::

    <|im_start|>system\\n{system}<|im_end|>\\n            (only when a system message is given)
    <|im_start|>user\\n{text}<|vision_start|><|image_pad|><|vision_end|>{text}<|im_end|>\\n
    <|im_start|>assistant\\n{answer}<|im_end|>\\n

Each image's single ``<|image_pad|>`` is expanded to ``t*h*w / merge**2`` pads, as HF's processor
does. A video renders as ``<|vision_start|><|video_pad|><|vision_end|>``, which the processor
(``Qwen3VLProcessor.replace_video_token``, Qwen3-VL and Qwen3.5 alike) replaces by one group per temporal
patch: ``<{t:.1f} seconds><|vision_start|>`` + ``h*w / merge**2`` ``<|video_pad|>`` + ``<|vision_end|>``; the
timestamp text is tokenised with the text around it, as HF tokenises the expanded prompt. Labels: the
assistant content tokens and their ``<|im_end|>`` are trained; everything else (system, user, the
``<|im_start|>assistant\\n`` header, the newline after ``<|im_end|>``, vision tokens, timestamps) is not. Answer
tokens (assistant content without ``<|im_end|>``) are numbered per assistant turn (1..) for held-out accuracy.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moevlm_jax.data.tokenizer import Tokenizer


def timestamp_text(seconds: float) -> str:
    """The text before a video's temporal patch, as HF's ``Qwen3VLProcessor.replace_video_token`` writes it."""
    return f"<{seconds:.1f} seconds>"

# Qwen3-VL Instruct's chat template, the tool-free path (kept in Jinja so tests can render it with
# transformers' apply_chat_template and compare against ``render_text``).
QWEN3_VL_CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}"
    "{%- else %}{%- for content in messages[0].content %}{%- if 'text' in content %}{{- content.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

ROLES = ("system", "user", "assistant")


class ConversationError(ValueError):
    """A conversation the template cannot render; ``reason`` is the skip-count key."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass
class _Part:
    text: str  # text, a special token string, or "" for an image / a video
    special: bool = False
    image: int = -1  # image index for an image part
    video: int = -1  # video index for a video part
    trained: bool = False
    answer: int = 0  # assistant turn number (1..) for answer text, 0 elsewhere


@dataclasses.dataclass
class Encoded:
    """A tokenised conversation."""

    ids: np.ndarray  # int32 [L]
    trained: np.ndarray  # bool [L]: token is a label target (assistant content + its <|im_end|>)
    answer: np.ndarray  # int16 [L]: assistant turn number on answer tokens, 0 elsewhere
    num_images: int
    num_videos: int = 0


@dataclasses.dataclass(frozen=True)
class VideoTokens:
    """What a video becomes in the prompt: ``tokens`` ``<|video_pad|>`` per temporal patch, one group per entry of
    ``timestamps`` (seconds, written before the group)."""

    tokens: int
    timestamps: tuple[float, ...]


def content_items(content: Any) -> list[dict[str, Any]]:
    """Normalise message content to a list of ``{"type": "text"|"image"|"video", ...}`` items."""
    if content is None:
        return []
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    items = []
    for item in content:
        if isinstance(item, str):
            items.append({"type": "text", "text": item})
        elif item.get("type") == "audio" or "audio" in item:
            raise ConversationError("unsupported_media", f"content item {item.get('type')!r}: not supported yet")
        elif item.get("type") == "video" or "video" in item:
            items.append({"type": "video"})
        elif item.get("type") == "image" or "image" in item or "image_url" in item:
            items.append({"type": "image"})
        elif "text" in item:
            items.append({"type": "text", "text": str(item["text"])})
        else:
            raise ConversationError("bad_record", f"unknown content item {item!r}")
    return items


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Check roles and structure; return the kind of each media item in order (``"image"`` / ``"video"``).
    Raises ``ConversationError``."""
    if not messages:
        raise ConversationError("no_assistant", "empty conversation")
    media: list[str] = []
    has_assistant = False
    for k, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise ConversationError("bad_record", f"unknown role {role!r}")
        if role == "system" and k != 0:
            raise ConversationError("bad_record", "a system message must come first")
        kinds = [it["type"] for it in content_items(m.get("content")) if it["type"] != "text"]
        if role == "system" and kinds:
            raise ConversationError("bad_record", "a system message cannot hold images or videos")
        media += kinds
        has_assistant |= role == "assistant"
    if not has_assistant:
        raise ConversationError("no_assistant", "conversation has no assistant turn")
    return media


def _parts(messages: Sequence[Mapping[str, Any]], system_prompt: str | None) -> list[_Part]:
    parts: list[_Part] = []
    msgs = list(messages)
    if system_prompt is not None and msgs[0].get("role") != "system":
        msgs = [{"role": "system", "content": system_prompt}, *msgs]
    image = video = 0
    answer = 0
    for m in msgs:
        role = m["role"]
        items = content_items(m.get("content"))
        assistant = role == "assistant"
        answer += assistant
        parts += [_Part("<|im_start|>", special=True), _Part(role + "\n")]
        for it in items:
            if it["type"] == "image":
                parts.append(_Part("", image=image))
                image += 1
            elif it["type"] == "video":
                parts.append(_Part("", video=video))
                video += 1
            else:
                parts.append(_Part(it["text"], trained=assistant, answer=answer if assistant else 0))
        parts += [_Part("<|im_end|>", special=True, trained=assistant), _Part("\n")]
    return parts


def render_text(messages: Sequence[Mapping[str, Any]], system_prompt: str | None = None) -> str:
    """The template's text (one ``<|image_pad|>`` per image, one ``<|video_pad|>`` per video), as
    ``apply_chat_template(tokenize=False)``."""
    out = []
    for p in _parts(messages, system_prompt):
        if p.image >= 0:
            out.append("<|vision_start|><|image_pad|><|vision_end|>")
        elif p.video >= 0:
            out.append("<|vision_start|><|video_pad|><|vision_end|>")
        else:
            out.append(p.text)
    return "".join(out)


def _special_splitter(tok: Tokenizer) -> re.Pattern:
    pattern = getattr(tok, "_special_split", None)
    if pattern is None:
        names = sorted(tok.special_tokens, key=len, reverse=True)
        pattern = re.compile("(" + "|".join(re.escape(s) for s in names) + ")")
        tok._special_split = pattern
    return pattern


def encode_conversation(
    messages: Sequence[Mapping[str, Any]],
    tokenizer: Tokenizer,
    image_tokens: Sequence[int] = (),
    system_prompt: str | None = None,
    videos: Sequence[VideoTokens] = (),
) -> Encoded:
    """Token ids [L] (image pads expanded to ``image_tokens[k]`` each, video ``k`` to its timestamped groups of
    ``videos[k].tokens`` pads), trained mask [L], answer ids [L]."""
    media = validate_messages(messages)
    num_images, num_videos = media.count("image"), media.count("video")
    if num_images != len(image_tokens):
        raise ConversationError(
            "image_count_mismatch", f"conversation has {num_images} image placeholders but {len(image_tokens)} images"
        )
    if num_videos != len(videos):
        raise ConversationError(
            "video_count_mismatch", f"conversation has {num_videos} video placeholders but {len(videos)} videos")
    splitter = _special_splitter(tokenizer)
    vs, ve, pad, video_pad = (tokenizer.special_id(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                                  "<|video_pad|>"))
    ids: list[int] = []
    trained: list[bool] = []
    answer: list[int] = []
    piece: list[_Part] = []  # consecutive ordinary-text parts, encoded together as HF would

    def flush() -> None:
        if not piece:
            return
        texts = [unicodedata.normalize("NFC", p.text) for p in piece]
        full = "".join(texts)
        toks = tokenizer.encode(full)
        labels = {(p.trained, p.answer) for p in piece if p.text}
        if len(labels) <= 1:
            t, a = labels.pop() if labels else (False, 0)
            trained.extend([t] * len(toks))
            answer.extend([a] * len(toks))
        else:  # a label boundary inside the piece
            runs: list[tuple[str, tuple[bool, int]]] = []  # consecutive texts with the same label
            for t, p in zip(texts, piece):
                if runs and runs[-1][1] == (p.trained, p.answer):
                    runs[-1] = (runs[-1][0] + t, runs[-1][1])
                elif t:
                    runs.append((t, (p.trained, p.answer)))
            run_ids = [tokenizer.encode(t) for t, _ in runs]
            # usually the BPE does not merge across the boundary: then each run keeps its own tokens
            if list(itertools.chain.from_iterable(run_ids)) == toks:
                for (_, (t, a)), r in zip(runs, run_ids):
                    trained.extend([t] * len(r))
                    answer.extend([a] * len(r))
            else:  # label each token by the part its first character is in
                ends = np.cumsum([len(t) for t in texts])
                which = np.searchsorted(ends, tokenizer.token_starts(full, toks), side="right")
                which = np.minimum(which, len(piece) - 1)
                trained.extend(piece[w].trained for w in which)
                answer.extend(piece[w].answer for w in which)
        ids.extend(toks)
        piece.clear()

    def add_special(token_id: int, is_trained: bool = False) -> None:
        ids.append(token_id)
        trained.append(is_trained)
        answer.append(0)

    def add_pads(token_id: int, n: int) -> None:
        add_special(vs)
        ids.extend([token_id] * n)
        trained.extend([False] * n)
        answer.extend([0] * n)
        add_special(ve)

    for p in _parts(messages, system_prompt):
        if p.image >= 0:
            flush()
            add_pads(pad, int(image_tokens[p.image]))
        elif p.video >= 0:
            v = videos[p.video]
            for seconds in v.timestamps:  # the timestamp joins the text before it, as in HF's expanded prompt
                piece.append(_Part(timestamp_text(seconds)))
                flush()
                add_pads(video_pad, int(v.tokens))
        elif p.special:
            flush()
            add_special(tokenizer.special_id(p.text), p.trained)
        elif not splitter.search(p.text):
            piece.append(p)
        else:
            # special-token strings inside text are tokens, as in HF tokenizers
            for k, chunk in enumerate(splitter.split(p.text)):
                if k % 2:
                    flush()
                    add_special(tokenizer.special_id(chunk), p.trained)
                elif chunk:
                    piece.append(dataclasses.replace(p, text=chunk))
    flush()
    return Encoded(
        ids=np.asarray(ids, np.int32),
        trained=np.asarray(trained, bool),
        answer=np.asarray(answer, np.int16),
        num_images=num_images,
        num_videos=num_videos,
    )
