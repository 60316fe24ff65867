"""The sample record: conversation + image payloads + metadata, and its ArrayRecord encoding.

A record (in memory) is ``{"messages": [...], "images": [bytes | {"path": str}], "meta": {...}}``:
HF-style messages whose ``{"type": "image"}`` items refer to ``images`` in order. On disk each
ArrayRecord entry is ``b"MVLR" | u8 version | u32 header length | JSON header | image bytes...``;
the header holds messages, meta and each image's byte length. Images are stored as their original
encoded bytes (JPEG/PNG/...), never re-encoded.

``from_llava`` accepts LLaVA ``conversations`` (``from``: human/gpt, ``<image>`` placeholders,
``image``: str or list), ShareGPT/LLaMA-Factory ``messages`` + ``images``, and the ``messages`` form of HF
processors' chat templates and TRL, whose content items name their image (``{"type": "image", "image": "a.jpg"}``;
``path``, ``url`` or ``image_url`` too). Media the pipeline cannot use yet (video, audio: a ``<video>`` placeholder, a
``video`` item or a ``video`` / ``videos`` / ``audio`` / ``audios`` key) raise :class:`UnsupportedMedia`, so that such a
sample is counted as skipped rather than trained on its text alone.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from typing import Any

MAGIC = b"MVLR"
VERSION = 1
_HEAD = struct.Struct("<4sBI")
IMAGE_PLACEHOLDER = "<image>"
# placeholders and keys of media the pipeline cannot use yet: a sample holding one is skipped, never trained as text
UNSUPPORTED_PLACEHOLDERS = ("<video>", "<audio>")
UNSUPPORTED_KEYS = ("video", "videos", "audio", "audios")
UNSUPPORTED_ITEMS = ("video", "video_url", "audio", "audio_url", "input_audio")
# where a content item of type image names its file, in the order looked up
_IMAGE_REFS = ("image", "path", "url", "image_url")
_ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "bot": "assistant", "model": "assistant", "system": "system"}


class RecordError(ValueError):
    """A record that cannot be decoded or understood (counted as ``bad_record``)."""


class UnsupportedMedia(RecordError):
    """A record holding media the pipeline cannot use yet (video, audio): counted as ``unsupported_media``."""


def encode_record(messages: list[dict[str, Any]], images: list[bytes], meta: Mapping[str, Any] | None = None) -> bytes:
    """Serialise a record (messages, encoded image bytes, meta) to one ArrayRecord entry."""
    header = {"messages": messages, "image_sizes": [len(b) for b in images], "meta": dict(meta or {})}
    head = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    return b"".join([_HEAD.pack(MAGIC, VERSION, len(head)), head, *images])


def decode_record(data: bytes) -> dict[str, Any]:
    """Parse an ArrayRecord entry back into ``{"messages", "images": [bytes], "meta"}``."""
    if len(data) < _HEAD.size:
        raise RecordError(f"record of {len(data)} bytes is shorter than its header")
    magic, version, head_len = _HEAD.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise RecordError(f"not a moevlm record (magic {magic!r}, version {version})")
    start = _HEAD.size
    try:
        header = json.loads(data[start:start + head_len])
        sizes = [int(s) for s in header["image_sizes"]]
        messages = header["messages"]
    except (ValueError, KeyError, TypeError) as e:
        raise RecordError(f"bad record header: {e}") from None
    offset = start + head_len
    if offset + sum(sizes) != len(data):
        raise RecordError(f"record payload is {len(data) - offset} bytes, header says {sum(sizes)}")
    images = []
    for s in sizes:
        images.append(bytes(data[offset:offset + s]))
        offset += s
    return {"messages": messages, "images": images, "meta": header.get("meta", {})}


def _split_placeholders(text: str) -> list[dict[str, Any]]:
    for mark in UNSUPPORTED_PLACEHOLDERS:
        if mark in text:
            raise UnsupportedMedia(f"{mark} placeholder: {mark[1:-1]} input is not supported yet")
    items: list[dict[str, Any]] = []
    for k, chunk in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if k:
            items.append({"type": "image"})
        if chunk:
            items.append({"type": "text", "text": chunk})
    return items


def _image_ref(item: Mapping[str, Any]) -> str | None:
    """The file a content item of type image names (``image`` / ``path`` / ``url`` / ``image_url.url``), else None."""
    for key in _IMAGE_REFS:
        ref = item.get(key)
        if isinstance(ref, Mapping):  # OpenAI-style {"image_url": {"url": ...}}
            ref = ref.get("url")
        if isinstance(ref, str) and ref:
            return ref.removeprefix("file://")
    return None


def _message(role: Any, content: Any) -> tuple[dict[str, Any], list[str | None]]:
    """One turn -> (HF-style message, the file each of its image items names or None, in order)."""
    role_name = _ROLE_ALIASES.get(str(role).lower())
    if role_name is None:
        raise RecordError(f"unknown role {role!r}")
    if isinstance(content, str):
        items = _split_placeholders(content)
        return {"role": role_name, "content": items}, [None] * sum(it["type"] == "image" for it in items)
    if isinstance(content, list):
        items: list[dict[str, Any]] = []
        refs: list[str | None] = []
        for item in content:
            if isinstance(item, Mapping) and (item.get("type") in UNSUPPORTED_ITEMS
                                              or any(k in item for k in UNSUPPORTED_ITEMS)):
                raise UnsupportedMedia(f"content item of type {item.get('type')!r}: video and audio are not "
                                       "supported yet")
            if isinstance(item, Mapping) and (item.get("type") in ("image", "image_url") or "image" in item):
                items.append({"type": "image"})
                refs.append(_image_ref(item))
            elif isinstance(item, str) or (isinstance(item, Mapping) and "text" in item):
                new = _split_placeholders(item if isinstance(item, str) else str(item["text"]))
                items += new
                refs += [None] * sum(it["type"] == "image" for it in new)
            else:
                raise RecordError(f"unknown content item {item!r}")
        return {"role": role_name, "content": items}, refs
    if content is None:
        return {"role": role_name, "content": []}, []
    raise RecordError(f"message content of type {type(content).__name__}")


def from_llava(entry: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """A LLaVA / ShareGPT / HF ``messages`` JSON entry -> (messages, image paths in placeholder order, meta)."""
    if not isinstance(entry, Mapping):
        raise RecordError(f"entry is a {type(entry).__name__}, not an object")
    media = [k for k in UNSUPPORTED_KEYS if entry.get(k)]
    if media:
        raise UnsupportedMedia(f"entry has {media[0]!r}: video and audio are not supported yet")
    if "conversations" in entry:
        turns = [_message(t.get("from", t.get("role")), t.get("value", t.get("content")))
                 for t in entry["conversations"]]
    elif "messages" in entry:
        turns = [_message(t.get("role"), t.get("content")) for t in entry["messages"]]
    else:
        raise RecordError("entry has neither 'conversations' nor 'messages'")
    messages = [m for m, _ in turns]
    inline = [r for _, refs in turns for r in refs]
    images = entry.get("images", entry.get("image", []))
    if images is None:
        images = []
    if isinstance(images, str):
        images = [images]
    listed = [str(p) for p in images]
    named = [r for r in inline if r is not None]
    if named and (len(named) != len(inline) or (listed and listed != named)):
        raise RecordError(f"images named both in content items ({len(named)} of {len(inline)}) and in the 'images' "
                          f"list ({len(listed)}): name each image once")
    meta = {k: entry[k] for k in ("id",) if k in entry}
    return messages, listed or named, meta
