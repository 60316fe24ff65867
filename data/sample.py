"""One record -> one model-ready sample (or a counted skip).

``SampleProcessor(index, raw)`` decodes the record, processes its images (``data.image``) and videos
(``data.video``), applies the chat template (``data.chat``), computes MRoPE positions per sample
(``data.mrope.mrope_position_ids``) and shifts the targets within the sample. Every
failure becomes ``{"skip": reason, "index": i}`` so that the packer can count it; nothing raises.

A sample is a dict of numpy arrays (``L`` tokens, ``N`` patches, ``n`` images and videos)::

    ids int32 [L]; positions int32 [3, L]; targets int32 [L] (ids shifted left, pad at the end);
    loss_mask bool [L]; answer int16 [L] (assistant turn of the target token, 0 = none);
    answer_type int16 [L] (question type id of that turn, -1 = none);
    patches uint8 [N, 3*p*p] (compact, see data.image; [N, 3*T*p*p] in a sample with a video, whose rows hold
    their own frames, see data.video); grids int32 [n, 3] (images and videos in prompt order: their patches,
    and their tokens, follow each other in that order); videos int (how many of the n are videos); index int;
    with a video longer than ``data.video.max_frames / fps`` seconds: sampled_down int (how many such videos were
    sampled down to max_frames) and sampled_down_note str (what the first was)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from moevlm_jax.data.chat import ConversationError, VideoTokens, encode_conversation, validate_messages
from moevlm_jax.data.config import QUESTION_TYPES, DataConfig
from moevlm_jax.data.image import ImageSkip, decode_image, process_image
from moevlm_jax.data.mrope import mrope_position_ids
from moevlm_jax.data.records import RecordError, UnsupportedMedia, decode_record, from_llava
from moevlm_jax.data.tokenizer import Tokenizer, load_tokenizer
from moevlm_jax.data.video import Clip, decode_video, process_video

log = logging.getLogger(__name__)

# Skip reasons (keys of the skip counters), with what each means; see ARCHITECTURE.md "Data".
SKIP_REASONS = {
    "bad_record": "record or conversation cannot be parsed",
    "missing_image": "image file not found",
    "empty_image": "zero-byte or zero-size image",
    "corrupt_image": "image bytes cannot be decoded",
    "truncated_image": "image file is truncated",
    "image_too_large": "image above max_image_pixels (decompression guard)",
    "extreme_aspect": "aspect ratio above max_aspect_ratio",
    "image_count_mismatch": "image placeholders and images differ in number",
    "missing_video": "video file (or frame folder) not found",
    "corrupt_video": "video cannot be decoded (or a frame of a frame folder), or has no frames",
    "video_count_mismatch": "video placeholders and videos differ in number",
    "unsupported_media": "sample holds audio, not supported yet (never trained as text alone)",
    "no_assistant": "conversation has no assistant turn",
    "too_long": "sample has more tokens than seq_len",
    "too_many_patches": "sample has more patches than the largest patch bucket (a video: its frames x patches a "
                        "frame pair; lower data.video.max_frames / max_pixels)",
    "processing_error": "unexpected error while processing (logged)",
}
# Question types of the built-in VQA set; ``answer_type`` ids index this tuple.
_MAX_ERROR_LOGS = 5


def too_many_patches(grids: np.ndarray, order: list[str], cfg: DataConfig) -> str:
    """The reason a sample's media exceed the largest patch bucket; a video's names its frames, patches a frame pair
    and the settings that bound them."""
    counts = grids.prod(axis=1).astype(int)
    total = int(counts.sum())
    videos = [(g, int(n)) for g, n, kind in zip(grids.tolist(), counts, order) if kind == "video"]
    if not videos:
        return f"{total} patches > the largest patch bucket {cfg.max_patches}"
    t = cfg.image.temporal_patch_size
    parts = ", ".join(f"{g[0] * t} frames ({g[0]} frame pairs x {g[1] * g[2]} patches) = {n} patches"
                      for g, n in videos)
    return (f"video: {parts}; the sample's {total} patches > the largest patch bucket {cfg.max_patches}; lower "
            f"data.video.max_frames ({cfg.video.max_frames}) / max_pixels ({cfg.video.max_pixels}) or add a larger "
            f"data.patch_buckets entry")


def sampled_down(clips: list[Clip], cfg: DataConfig) -> dict[str, Any]:
    """The sample's count of videos sampled down to ``data.video.max_frames`` and a note on the first (nothing when
    none was)."""
    down = [c for c in clips if c.sampled_down]
    if not down:
        return {}
    c = down[0]
    note = (f"a video of {c.total} frames ({c.total / c.fps:.1f} s at {c.fps:g} fps) would take {c.at_fps} frames at "
            f"data.video.fps {cfg.video.fps:g}: sampled down to data.video.max_frames {len(c.indices)}, spread over "
            f"its whole length")
    return {"sampled_down": len(down), "sampled_down_note": note}


def is_skip(sample: Mapping[str, Any]) -> bool:
    """True for a skip marker."""
    return "skip" in sample


def read_record(raw: Any) -> dict[str, Any]:
    """What a source yields -> the in-memory record ``{"messages", "images", "videos", "meta"}``: an ArrayRecord
    entry (bytes), a LLaVA / messages JSON entry (``{"llava": entry, "image_root": ...}``; paths made absolute) or a
    record already. Raises ``RecordError`` (``UnsupportedMedia`` for audio)."""
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return decode_record(bytes(raw))
    if isinstance(raw, Mapping) and "llava" in raw:
        if raw["llava"] is None:
            raise RecordError("unparsable JSON line")
        messages, paths, videos, meta = from_llava(raw["llava"])
        root = raw.get("image_root")

        def rooted(p: str) -> str:
            return str(Path(root) / p) if root and not Path(p).is_absolute() else p

        images = [{"path": rooted(p)} for p in paths]
        clips = [{"path": rooted(v) if isinstance(v, str) else [rooted(f) for f in v]} for v in videos]
        return {"messages": messages, "images": images, "videos": clips, "meta": meta}
    if isinstance(raw, Mapping):
        return dict(raw)
    raise RecordError(f"record of type {type(raw).__name__}")


class SampleProcessor:
    """Callable ``(index, raw record) -> sample | skip``; picklable (tokenizer loaded lazily per process)."""

    def __init__(self, cfg: DataConfig, *, eval_mode: bool = False):
        self.cfg = cfg
        self.eval_mode = eval_mode
        self._tokenizer: Tokenizer | None = None
        self._errors_logged = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        return state

    @property
    def tokenizer(self) -> Tokenizer:
        """The configured tokenizer (loaded on first use in each process)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.cfg.tokenizer)
        return self._tokenizer

    def __call__(self, index: int, raw: Any) -> dict[str, Any]:
        """Process one record; returns a sample dict or ``{"skip": reason, "index": index}``."""
        try:
            return self._process(int(index), raw)
        except (ImageSkip, ConversationError) as e:
            return {"skip": e.reason, "index": int(index), "detail": str(e)}
        except UnsupportedMedia as e:
            return {"skip": "unsupported_media", "index": int(index), "detail": str(e)}
        except RecordError as e:
            return {"skip": "bad_record", "index": int(index), "detail": str(e)}
        except Exception as e:  # bad input must never crash a run
            if self._errors_logged < _MAX_ERROR_LOGS:
                self._errors_logged += 1
                log.warning("sample %d: unexpected %s: %s", index, type(e).__name__, e, exc_info=True)
            return {"skip": "processing_error", "index": int(index), "detail": f"{type(e).__name__}: {e}"}

    # -- internals ---------------------------------------------------------------------------------

    def _record(self, raw: Any) -> dict[str, Any]:
        return read_record(raw)

    def _image_bytes(self, ref: Any) -> bytes:
        if isinstance(ref, (bytes, bytearray)):
            return bytes(ref)
        path = Path(ref["path"] if isinstance(ref, Mapping) else ref)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise ImageSkip("missing_image", f"image file {path} not found") from None
        except IsADirectoryError:
            raise ImageSkip("missing_image", f"image path {path} is a directory") from None
        except OSError as e:
            raise ImageSkip("corrupt_image", f"cannot read {path}: {e}") from None

    def _media(self, record: Mapping[str, Any], order: list[str], rng_index: int
               ) -> tuple[np.ndarray, np.ndarray, list[VideoTokens], list[Clip]]:
        """Patches and grids of the record's images and videos in prompt order (``order``: their kinds), each
        video's prompt groups, and its decoded clip."""
        cfg = self.cfg.image
        dim = 3 * cfg.patch_size**2
        if "mock_grids" in record:  # mock: random patch payload of a fixed shape, no decoding
            grids = np.asarray(record["mock_grids"], np.int32).reshape(-1, 3)
            n = int(grids.prod(axis=1).sum())
            rng = np.random.default_rng(rng_index)
            return rng.integers(0, 256, (n, dim), dtype=np.uint8), grids, [], []
        images, videos = iter(record.get("images", [])), iter(record.get("videos", []))
        patches, grids, prompts, clips = [], [], [], []
        for kind in order:
            if kind == "image":
                p, g = process_image(decode_image(self._image_bytes(next(images)), cfg), cfg)
            else:
                ref = next(videos)
                clip = decode_video(ref["path"] if isinstance(ref, Mapping) else ref, self.cfg.video, cfg)
                p, g, seconds = process_video(clip, self.cfg.video, cfg)
                prompts.append(VideoTokens(int(g[1] * g[2]) // cfg.merge_size**2, tuple(seconds)))
                clips.append(clip)
            patches.append(p)
            grids.append(g)
        if not patches:
            return np.zeros((0, dim), np.uint8), np.zeros((0, 3), np.int32), [], []
        if prompts and len({p.shape[1] for p in patches}) > 1:  # images beside a video: their frame duplicated
            t = cfg.temporal_patch_size
            patches = [p if p.shape[1] != dim else np.repeat(p.reshape(len(p), 3, 1, -1), t, axis=2).reshape(len(p), -1)
                       for p in patches]
        return np.concatenate(patches), np.stack(grids).astype(np.int32), prompts, clips

    def _process(self, index: int, raw: Any) -> dict[str, Any]:
        cfg = self.cfg
        record = self._record(raw)
        messages = record.get("messages")
        if not isinstance(messages, list):
            raise RecordError("record has no message list")
        order = validate_messages(messages)  # cheap checks before decoding any image or video
        num_images, num_videos = order.count("image"), order.count("video")
        declared = len(record.get("mock_grids", record.get("images", [])))
        if num_images != declared:
            raise ConversationError("image_count_mismatch",
                                    f"{num_images} image placeholders but {declared} images")
        if num_videos != len(record.get("videos", [])):
            raise ConversationError("video_count_mismatch",
                                    f"{num_videos} video placeholders but {len(record.get('videos', []))} videos")
        patches, grids, prompts, clips = self._media(record, order, index)
        if len(patches) > cfg.max_patches:
            raise ConversationError("too_many_patches", too_many_patches(grids, order, cfg))
        m = cfg.image.merge_size
        is_video = np.array([k == "video" for k in order], bool).reshape(-1)  # one kind per grid, prompt order
        tokens_per_image = (grids[~is_video].prod(axis=1) // m**2).tolist() if len(grids) else []
        enc = encode_conversation(messages, self.tokenizer, tokens_per_image, cfg.system_prompt, prompts)
        length = len(enc.ids)
        if length > cfg.seq_len:
            raise ConversationError("too_long", f"{length} tokens > seq_len {cfg.seq_len}")
        image_id = self.tokenizer.special_id("<|image_pad|>")
        positions, _ = mrope_position_ids(enc.ids, grids[~is_video] if (~is_video).any() else None,
                                          image_token_id=image_id, spatial_merge_size=m,
                                          video_grid_thw=grids[is_video] if is_video.any() else None,
                                          video_token_id=self.tokenizer.special_id("<|video_pad|>"))
        targets = np.empty_like(enc.ids)
        targets[:-1] = enc.ids[1:]
        targets[-1] = self.tokenizer.pad_id
        answer = np.zeros(length, np.int16)
        answer[:-1] = enc.answer[1:]
        trained = np.zeros(length, bool)
        trained[:-1] = enc.trained[1:]
        loss_mask = answer > 0 if self.eval_mode else trained
        qtypes = list(record.get("meta", {}).get("qtypes", []))
        type_ids = np.array([QUESTION_TYPES.index(q) if q in QUESTION_TYPES else -1 for q in qtypes] or [-1],
                            np.int16)
        answer_type = np.where(answer > 0, type_ids[np.clip(answer - 1, 0, len(type_ids) - 1)], -1)
        if qtypes and int(answer.max(initial=0)) > len(qtypes):
            answer_type = np.where(answer > len(qtypes), -1, answer_type)
        return {
            "index": index,
            "ids": enc.ids,
            "positions": positions,
            "targets": targets,
            "loss_mask": loss_mask,
            "answer": answer,
            "answer_type": answer_type.astype(np.int16),
            "patches": patches,
            "grids": grids,
            "videos": int(is_video.sum()),
            **sampled_down(clips, cfg),
        }
