"""The sample record: conversation + image payloads + metadata, and its ArrayRecord encoding.

A record (in memory) is ``{"messages": [...], "images": [bytes | {"path": str}], "meta": {...}}``:
HF-style messages whose ``{"type": "image"}`` items refer to ``images`` in order. On disk each
ArrayRecord entry is ``b"MVLR" | u8 version | u32 header length | JSON header | image bytes...``;
the header holds messages, meta and each image's byte length. Images are stored as their original
encoded bytes (JPEG/PNG/...), never re-encoded.

``from_llava`` accepts LLaVA ``conversations`` (``from``: human/gpt, ``<image>`` placeholders,
``image``: str or list) and ShareGPT/LLaMA-Factory ``messages`` + ``images``.
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
_ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "bot": "assistant", "model": "assistant", "system": "system"}


class RecordError(ValueError):
    """A record that cannot be decoded or understood (counted as ``bad_record``)."""


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
    items: list[dict[str, Any]] = []
    for k, chunk in enumerate(text.split(IMAGE_PLACEHOLDER)):
        if k:
            items.append({"type": "image"})
        if chunk:
            items.append({"type": "text", "text": chunk})
    return items


def _message(role: Any, content: Any) -> dict[str, Any]:
    role_name = _ROLE_ALIASES.get(str(role).lower())
    if role_name is None:
        raise RecordError(f"unknown role {role!r}")
    if isinstance(content, str):
        return {"role": role_name, "content": _split_placeholders(content)}
    if isinstance(content, list):
        items: list[dict[str, Any]] = []
        for item in content:
            if isinstance(item, str):
                items += _split_placeholders(item)
            elif isinstance(item, Mapping) and (item.get("type") == "image" or "image" in item):
                items.append({"type": "image"})
            elif isinstance(item, Mapping) and "text" in item:
                items += _split_placeholders(str(item["text"]))
            else:
                raise RecordError(f"unknown content item {item!r}")
        return {"role": role_name, "content": items}
    if content is None:
        return {"role": role_name, "content": []}
    raise RecordError(f"message content of type {type(content).__name__}")


def from_llava(entry: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str], dict[str, Any]]:
    """A LLaVA / ShareGPT JSON entry -> (messages, image paths, meta)."""
    if not isinstance(entry, Mapping):
        raise RecordError(f"entry is a {type(entry).__name__}, not an object")
    if "conversations" in entry:
        turns = entry["conversations"]
        messages = [_message(t.get("from", t.get("role")), t.get("value", t.get("content"))) for t in turns]
    elif "messages" in entry:
        messages = [_message(t.get("role"), t.get("content")) for t in entry["messages"]]
    else:
        raise RecordError("entry has neither 'conversations' nor 'messages'")
    images = entry.get("images", entry.get("image", []))
    if images is None:
        images = []
    if isinstance(images, str):
        images = [images]
    images = [str(p) for p in images]
    meta = {k: entry[k] for k in ("id",) if k in entry}
    return messages, images, meta
