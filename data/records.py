"""The sample record: conversation + image payloads + metadata, and its ArrayRecord encoding.

A record (in memory) is ``{"messages": [...], "images": [bytes | {"path": str}], "videos": [bytes | [bytes, ...] |
{"path": ...}], "meta": {...}}``: HF-style messages whose ``{"type": "image"}`` / ``{"type": "video"}`` items refer to
``images`` / ``videos`` in order. A video is an encoded file (bytes), the encoded frame images of one video in
order (a list of bytes), or a path (a file, a folder of frame images or a list of frame image paths).

On disk each ArrayRecord entry is ``b"MVLR" | u8 version | u32 header length | JSON header | image bytes... |
video bytes...``. The JSON header holds ``messages``, ``meta``, ``image_sizes`` (each image's byte length) and, in a
record with videos, ``video_sizes``: one entry a video, the byte length of an encoded file (an int) or the byte
lengths of its frame images in order (a list of ints), their bytes following each other in that order. Images,
video files and frames are stored as their original encoded files (JPEG/PNG/..., mp4/webm/...), never re-encoded.
Versions:

- 1: ``video_sizes`` entries are ints (video files) only; a record without videos has no ``video_sizes`` and
  decodes without a ``videos`` key. :func:`encode_record` still writes version 1 for every record that holds no
  video stored as frames, so that such records stay byte-identical and readable by older code.
- 2: a ``video_sizes`` entry may be a list (a video stored as its frame images, e.g. a folder of frames: the
  frames of the folder in natural name order, all of them, sampled at decode time as the folder would be).

:func:`decode_record` reads both versions.

``from_llava`` accepts LLaVA ``conversations`` (``from``: human/gpt, ``<image>`` / ``<video>`` placeholders,
``image`` / ``video``: str or list), ShareGPT/LLaMA-Factory ``messages`` + ``images`` / ``videos``, and the ``messages``
form of HF processors' chat templates and TRL, whose content items name their image or video
(``{"type": "image", "image": "a.jpg"}``, ``{"type": "video", "video": "clip.mp4"}``; ``path``, ``url``,
``image_url`` / ``video_url`` too). A video is a file, a folder of frame images or a list of frame image paths
(``data.video``). Audio (an ``<audio>`` placeholder, an ``audio`` item or an ``audio`` / ``audios`` key) raises
:class:`UnsupportedMedia`, so that such a sample is counted as skipped rather than trained on its text alone.
``data.convert`` embeds a LLaVA entry's images and videos (files as they are, frame folders / lists as their
frames); :func:`encode_record` also writes the built-in clips of ``data.vqa``.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Mapping
from typing import Any

MAGIC = b"MVLR"
VERSION = 2  # the newest version written (see the module docstring); 1 is written where it suffices
VERSIONS = (1, 2)  # versions decode_record reads
_HEAD = struct.Struct("<4sBI")
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
_PLACEHOLDERS = re.compile("(<image>|<video>)")
# placeholders and keys of media the pipeline cannot use yet: a sample holding one is skipped, never trained as text
UNSUPPORTED_PLACEHOLDERS = ("<audio>",)
UNSUPPORTED_KEYS = ("audio", "audios")
UNSUPPORTED_ITEMS = ("audio", "audio_url", "input_audio")
# where a content item of type image / video names its file, in the order looked up
_IMAGE_REFS = ("image", "path", "url", "image_url")
_VIDEO_REFS = ("video", "path", "url", "video_url")
_ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                 "bot": "assistant", "model": "assistant", "system": "system"}


class RecordError(ValueError):
    """A record that cannot be decoded or understood (counted as ``bad_record``)."""


class UnsupportedMedia(RecordError):
    """A record holding media the pipeline cannot use (audio): counted as ``unsupported_media``."""


VideoBytes = bytes | list[bytes]  # an encoded video file, or the encoded frame images of one video in order


def encode_record(messages: list[dict[str, Any]], images: list[bytes], meta: Mapping[str, Any] | None = None,
                  videos: list[VideoBytes] = ()) -> bytes:
    """Serialise a record (messages, encoded image bytes, meta, videos: encoded files or lists of encoded frame
    images) to one ArrayRecord entry; version 1 unless a video is stored as frames."""
    header: dict[str, Any] = {"messages": messages, "image_sizes": [len(b) for b in images], "meta": dict(meta or {})}
    payload = list(images)
    version = 1
    if videos:
        sizes: list[int | list[int]] = []
        for video in videos:
            if isinstance(video, (bytes, bytearray, memoryview)):
                sizes.append(len(video))
                payload.append(bytes(video))
            else:  # a list of frames
                frames = [bytes(f) for f in video]
                if not frames:
                    raise RecordError("a video stored as frames has no frames")
                sizes.append([len(f) for f in frames])
                payload += frames
                version = 2
        header["video_sizes"] = sizes
    head = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
    return b"".join([_HEAD.pack(MAGIC, version, len(head)), head, *payload])


def _video_sizes(header: Mapping[str, Any], version: int) -> list[int | list[int]]:
    sizes: list[int | list[int]] = []
    for s in header.get("video_sizes", []):
        if isinstance(s, list):
            if version < 2 or not s:
                raise TypeError(f"video_sizes entry {s!r} in a version {version} record")
            sizes.append([int(f) for f in s])
        else:
            sizes.append(int(s))
    return sizes


def decode_record(data: bytes) -> dict[str, Any]:
    """Parse an ArrayRecord entry back into ``{"messages", "images": [bytes], "meta"}`` (and ``"videos"``: each an
    encoded file (bytes) or its frame images (a list of bytes), when it holds videos)."""
    if len(data) < _HEAD.size:
        raise RecordError(f"record of {len(data)} bytes is shorter than its header")
    magic, version, head_len = _HEAD.unpack_from(data)
    if magic != MAGIC or version not in VERSIONS:
        raise RecordError(f"not a moevlm record (magic {magic!r}, version {version})")
    start = _HEAD.size
    try:
        header = json.loads(data[start:start + head_len])
        sizes = [int(s) for s in header["image_sizes"]]
        video_sizes = _video_sizes(header, version)
        messages = header["messages"]
    except (ValueError, KeyError, TypeError) as e:
        raise RecordError(f"bad record header: {e}") from None
    offset = start + head_len
    flat = sizes + [f for s in video_sizes for f in (s if isinstance(s, list) else [s])]
    if any(s < 0 for s in flat) or offset + sum(flat) != len(data):
        raise RecordError(f"record payload is {len(data) - offset} bytes, header says {sum(flat)}")

    def take(s: int) -> bytes:
        nonlocal offset
        offset += s
        return bytes(data[offset - s:offset])

    record = {"messages": messages, "images": [take(s) for s in sizes], "meta": header.get("meta", {})}
    if video_sizes:
        record["videos"] = [[take(f) for f in s] if isinstance(s, list) else take(s) for s in video_sizes]
    return record


def _split_placeholders(text: str) -> list[dict[str, Any]]:
    for mark in UNSUPPORTED_PLACEHOLDERS:
        if mark in text:
            raise UnsupportedMedia(f"{mark} placeholder: {mark[1:-1]} input is not supported yet")
    return split_placeholders(text)


def split_placeholders(text: str) -> list[dict[str, Any]]:
    """Text with ``<image>`` / ``<video>`` placeholders -> HF-style content items (text, image, video) in order."""
    items: list[dict[str, Any]] = []
    for k, chunk in enumerate(_PLACEHOLDERS.split(text)):
        if k % 2:
            items.append({"type": "image" if chunk == IMAGE_PLACEHOLDER else "video"})
        elif chunk:
            items.append({"type": "text", "text": chunk})
    return items


VideoRef = str | list[str]  # a video file or folder of frames, or the frame images of one video


def _media_ref(item: Mapping[str, Any], keys: tuple[str, ...]) -> VideoRef | None:
    """The file a content item names (the first of ``keys``; ``{"url": ...}`` objects too; a video may be a list of
    frame paths), else None."""
    for key in keys:
        ref = item.get(key)
        if isinstance(ref, Mapping):  # OpenAI-style {"image_url": {"url": ...}}
            ref = ref.get("url")
        if isinstance(ref, str) and ref:
            return ref.removeprefix("file://")
        if isinstance(ref, list) and ref and all(isinstance(r, str) for r in ref) and "video" in keys:
            return [r.removeprefix("file://") for r in ref]
    return None


def _is_video_item(item: Mapping[str, Any]) -> bool:
    return item.get("type") in ("video", "video_url") or "video" in item or "video_url" in item


def _message(role: Any, content: Any) -> tuple[dict[str, Any], list[str | None], list[VideoRef | None]]:
    """One turn -> (HF-style message, the file each of its image items names or None, the same of its video items)."""
    role_name = _ROLE_ALIASES.get(str(role).lower())
    if role_name is None:
        raise RecordError(f"unknown role {role!r}")

    def counts(items: list[dict[str, Any]]) -> tuple[list[None], list[None]]:
        return [None] * sum(it["type"] == "image" for it in items), [None] * sum(it["type"] == "video" for it in items)

    if isinstance(content, str):
        items = _split_placeholders(content)
        return {"role": role_name, "content": items}, *counts(items)
    if isinstance(content, list):
        items: list[dict[str, Any]] = []
        images: list[str | None] = []
        videos: list[VideoRef | None] = []
        for item in content:
            if isinstance(item, Mapping) and (item.get("type") in UNSUPPORTED_ITEMS
                                              or any(k in item for k in UNSUPPORTED_ITEMS)):
                raise UnsupportedMedia(f"content item of type {item.get('type')!r}: audio is not supported yet")
            if isinstance(item, Mapping) and _is_video_item(item):
                items.append({"type": "video"})
                videos.append(_media_ref(item, _VIDEO_REFS))
            elif isinstance(item, Mapping) and (item.get("type") in ("image", "image_url") or "image" in item):
                items.append({"type": "image"})
                images.append(_media_ref(item, _IMAGE_REFS))
            elif isinstance(item, str) or (isinstance(item, Mapping) and "text" in item):
                new = _split_placeholders(item if isinstance(item, str) else str(item["text"]))
                items += new
                more_images, more_videos = counts(new)
                images += more_images
                videos += more_videos
            else:
                raise RecordError(f"unknown content item {item!r}")
        return {"role": role_name, "content": items}, images, videos
    if content is None:
        return {"role": role_name, "content": []}, [], []
    raise RecordError(f"message content of type {type(content).__name__}")


def _listed(entry: Mapping[str, Any], keys: tuple[str, str], video: bool) -> list:
    """The top-level media list (``images`` / ``image``, ``videos`` / ``video``): a str is one item; a video may be a
    list of frame paths."""
    value = entry.get(keys[0], entry.get(keys[1], []))
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [[str(f) for f in v] if video and isinstance(v, list) else str(v) for v in value]


def _match(kind: str, inline: list, listed: list) -> list:
    named = [r for r in inline if r is not None]
    if named and (len(named) != len(inline) or (listed and listed != named)):
        raise RecordError(f"{kind}s named both in content items ({len(named)} of {len(inline)}) and in the "
                          f"'{kind}s' list ({len(listed)}): name each {kind} once")
    return listed or named


def from_llava(entry: Mapping[str, Any]) -> tuple[list[dict[str, Any]], list[str], list[VideoRef], dict[str, Any]]:
    """A LLaVA / ShareGPT / HF ``messages`` JSON entry -> (messages, image paths in placeholder order, video paths
    (or frame path lists) in placeholder order, meta)."""
    if not isinstance(entry, Mapping):
        raise RecordError(f"entry is a {type(entry).__name__}, not an object")
    media = [k for k in UNSUPPORTED_KEYS if entry.get(k)]
    if media:
        raise UnsupportedMedia(f"entry has {media[0]!r}: audio is not supported yet")
    if "conversations" in entry:
        turns = [_message(t.get("from", t.get("role")), t.get("value", t.get("content")))
                 for t in entry["conversations"]]
    elif "messages" in entry:
        turns = [_message(t.get("role"), t.get("content")) for t in entry["messages"]]
    else:
        raise RecordError("entry has neither 'conversations' nor 'messages'")
    messages = [m for m, _, _ in turns]
    images = _match("image", [r for _, refs, _ in turns for r in refs], _listed(entry, ("images", "image"), False))
    videos = _match("video", [r for _, _, refs in turns for r in refs], _listed(entry, ("videos", "video"), True))
    meta = {k: entry[k] for k in ("id",) if k in entry}
    return messages, images, videos, meta
