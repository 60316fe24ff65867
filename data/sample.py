"""One record -> one model-ready sample (or a counted skip).

``SampleProcessor(index, raw)`` decodes the record, processes its images (``data.image``), applies
the chat template (``data.chat``), computes MRoPE positions per sample
(``data.mrope.mrope_position_ids``) and shifts the targets within the sample. Every
failure becomes ``{"skip": reason, "index": i}`` so that the packer can count it; nothing raises.

A sample is a dict of numpy arrays (``L`` tokens, ``N`` patches, ``n`` images)::

    ids int32 [L]; positions int32 [3, L]; targets int32 [L] (ids shifted left, pad at the end);
    loss_mask bool [L]; answer int16 [L] (assistant turn of the target token, 0 = none);
    answer_type int16 [L] (question type id of that turn, -1 = none);
    patches uint8 [N, 3*p*p] (compact, see data.image); grids int32 [n, 3]; index int
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from moevlm_jax.data.chat import ConversationError, encode_conversation, validate_messages
from moevlm_jax.data.config import QUESTION_TYPES, DataConfig
from moevlm_jax.data.image import ImageSkip, decode_image, process_image
from moevlm_jax.data.mrope import mrope_position_ids
from moevlm_jax.data.records import RecordError, UnsupportedMedia, decode_record, from_llava
from moevlm_jax.data.tokenizer import Tokenizer, load_tokenizer

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
    "unsupported_media": "sample holds video or audio, not supported yet (never trained as text alone)",
    "no_assistant": "conversation has no assistant turn",
    "too_long": "sample has more tokens than seq_len",
    "too_many_patches": "sample has more patches than the largest patch bucket",
    "processing_error": "unexpected error while processing (logged)",
}
# Question types of the built-in VQA set; ``answer_type`` ids index this tuple.
_MAX_ERROR_LOGS = 5


def is_skip(sample: Mapping[str, Any]) -> bool:
    """True for a skip marker."""
    return "skip" in sample


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
        if isinstance(raw, (bytes, bytearray, memoryview)):
            return decode_record(bytes(raw))
        if isinstance(raw, Mapping) and "llava" in raw:
            if raw["llava"] is None:
                raise RecordError("unparsable JSON line")
            messages, paths, meta = from_llava(raw["llava"])
            root = raw.get("image_root")
            images = [{"path": str(Path(root) / p) if root and not Path(p).is_absolute() else p} for p in paths]
            return {"messages": messages, "images": images, "meta": meta}
        if isinstance(raw, Mapping):
            return dict(raw)
        raise RecordError(f"record of type {type(raw).__name__}")

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

    def _images(self, record: Mapping[str, Any], rng_index: int) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg.image
        dim = 3 * cfg.patch_size**2
        if "mock_grids" in record:  # mock: random patch payload of a fixed shape, no decoding
            grids = np.asarray(record["mock_grids"], np.int32).reshape(-1, 3)
            n = int(grids.prod(axis=1).sum())
            rng = np.random.default_rng(rng_index)
            return rng.integers(0, 256, (n, dim), dtype=np.uint8), grids
        patches, grids = [], []
        for ref in record.get("images", []):
            img = decode_image(self._image_bytes(ref), cfg)
            p, g = process_image(img, cfg)
            patches.append(p)
            grids.append(g)
        if not patches:
            return np.zeros((0, dim), np.uint8), np.zeros((0, 3), np.int32)
        return np.concatenate(patches), np.stack(grids).astype(np.int32)

    def _process(self, index: int, raw: Any) -> dict[str, Any]:
        cfg = self.cfg
        record = self._record(raw)
        messages = record.get("messages")
        if not isinstance(messages, list):
            raise RecordError("record has no message list")
        num_images = validate_messages(messages)  # cheap checks before decoding any image
        declared = len(record.get("mock_grids", record.get("images", [])))
        if num_images != declared:
            raise ConversationError("image_count_mismatch",
                                    f"{num_images} image placeholders but {declared} images")
        patches, grids = self._images(record, index)
        if len(patches) > cfg.max_patches:
            raise ConversationError("too_many_patches", f"{len(patches)} patches > {cfg.max_patches}")
        m = cfg.image.merge_size
        tokens_per_image = (grids.prod(axis=1) // m**2).tolist() if len(grids) else []
        enc = encode_conversation(messages, self.tokenizer, tokens_per_image, cfg.system_prompt)
        length = len(enc.ids)
        if length > cfg.seq_len:
            raise ConversationError("too_long", f"{length} tokens > seq_len {cfg.seq_len}")
        image_id = self.tokenizer.special_id("<|image_pad|>")
        positions, _ = mrope_position_ids(enc.ids, grids if len(grids) else None, image_token_id=image_id,
                                          spatial_merge_size=m)
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
        }
