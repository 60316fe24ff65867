"""Generation with a KV cache: prompts (token ids + images / videos) -> generated token ids; chat prompts -> text.

Low level, on token ids (what the HF-parity tests drive)::

    out = generate_ids(model, [Prompt(ids, pixel_values, image_grid_thw), ...], max_new_tokens=32,
                       stop_ids=(im_end, endoftext), pad_id=endoftext)
    out.tokens[i]          # prompt i's generated ids (up to and including a stop id)

High level, on chat prompts (the data pipeline's template, tokenizer and image processing)::

    texts = generate(model, tokenizer, ["What colour is the shape?"], [["img.jpg"]])
    texts = generate(model, tokenizer, ["Which way did the square move?"], [[Video("clip.mp4")]],
                     video_config=VideoConfig())       # a video: frames sampled, timestamps, as data.video
    rows = answer_questions(model, tokenizer, [(images, question, answer), ...])

How it runs (static shapes, see ``kv_cache``): the prompts of a batch are left-padded to ``S`` (a
multiple of ``prompt_bucket``); their images' patches to a bucket ``P`` per row. One jitted
**prefill** runs the whole model on the prompt batch -- the vision tower once, its merged tokens
scattered into the image-token rows and the DeepStack features added after the first decoder
layers, the attention the training op (``compute.attention``: cuDNN on GPUs), exactly as in
training -- writes every layer's K/V into a zero cache of ``T`` slots and returns the last
position's logits. One jitted **decode** program (a ``lax.while_loop``) then picks a token (greedy,
or temperature + top-p from ``fold_in(key(seed), step)``), writes it at slot ``S + k``, runs the
decoder on that one token against the cache (XLA attention over the ``T`` slots, causal) and stops
after ``max_new_tokens`` or when every row has emitted a stop id (rows that stopped emit ``pad_id``,
as HF). The loop body always runs the decoder on the token it picked, so the last step computes
logits nobody reads (one decoder step per generation; it keeps the body one program).

Positions (MRoPE): a prompt's positions are ``data.mrope.mrope_position_ids`` over its tokens (left
padding excluded), as in training and HF's ``get_rope_index``; the k-th token fed back (k = 0 for the
first generated token) takes position ``max(prompt positions) + 1 + k`` in all three (t, h, w)
components: HF's ``rope_deltas`` (max + 1 - prompt length) added to the text position.

Compiles: prefill once per (batch rows, S, P or no images, T), decode once per (batch rows, T,
greedy or sampling, keep_logits); ``max_new_tokens``, the start slot, temperature, top-p, seed and
stop ids are traced values. ``TRACES`` counts the traces of each (one per compile).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from PIL import Image

from moevlm_jax.data.batch import hf_inputs_to_batch
from moevlm_jax.data.chat import VideoTokens, content_items, encode_conversation
from moevlm_jax.data.config import ImageConfig, VideoConfig
from moevlm_jax.data.image import decode_image, expand_patches, image_to_pixel_values
from moevlm_jax.data.mrope import mrope_position_ids
from moevlm_jax.data.records import split_placeholders
from moevlm_jax.data.tokenizer import Tokenizer
from moevlm_jax.data.video import decode_video, process_video
from moevlm_jax.inference.kv_cache import cache_segment_ids, init_cache, round_up
from moevlm_jax.inference.sampling import sample_token

log = logging.getLogger(__name__)

TRACES = {"prefill": 0, "decode": 0}  # traces (= compiles) of the two programs in this process
MAX_STOP_IDS = 8  # the stop-id array's fixed length (padded with -1): no recompile per stop set


@dataclasses.dataclass
class Prompt:
    """One prompt in HF conventions: token ids ``[L]`` (each image a run of image tokens, each frame pair of a
    video a run of video tokens), the images' flattened patches ``[N, patch_dim]`` and their grids ``[n, 3]``
    (None: no image), the videos' likewise (``pixel_values_videos``, ``video_grid_thw``, as HF's processor)."""

    input_ids: np.ndarray
    pixel_values: np.ndarray | None = None
    image_grid_thw: np.ndarray | None = None
    pixel_values_videos: np.ndarray | None = None
    video_grid_thw: np.ndarray | None = None

    def grids(self, kind: str) -> np.ndarray | None:
        """The image (``kind`` "image") or video grids ``[n, 3]``, None when there are none."""
        g = self.image_grid_thw if kind == "image" else self.video_grid_thw
        return None if g is None or not len(g) else np.asarray(g, np.int64).reshape(-1, 3)

    def num_patches(self) -> int:
        """Patches of its images and videos together (its row of the patch axis)."""
        return sum(int(g.prod(-1).sum()) for g in (self.grids("image"), self.grids("video")) if g is not None)


@dataclasses.dataclass
class Generation:
    """What ``generate_ids`` returns: per prompt the generated ids (a stop id included when it
    stopped on one), whether it stopped on a stop id, and with ``keep_logits`` the logits each
    generated token was chosen from ``[B, steps, V]``; ``prompt_len`` S and ``cache_len`` T."""

    tokens: list[np.ndarray]
    stopped: np.ndarray
    logits: np.ndarray | None
    prompt_len: int
    cache_len: int


# ----------------------------------------------------------------------------- the batch

def prompt_batch(config: Any, prompts: Sequence[Prompt], *, pad_id: int, prompt_bucket: int = 64,
                 patch_bucket: int = 256, num_patches: int | None = None) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Prompts -> the prefill batch (ARCHITECTURE.md keys; rows left-padded to a multiple of
    ``prompt_bucket``, patches per row to a multiple of ``patch_bucket``, no patch keys when no
    prompt has an image; or exactly ``num_patches`` patches a row, text-only batches too: one
    prefill program for all) and each row's next position ``[B]`` (max prompt position + 1)."""
    lengths = [len(p.input_ids) for p in prompts]
    b, s = len(prompts), round_up(max(lengths), prompt_bucket)
    ids = np.full((b, s), pad_id, np.int32)
    mask = np.zeros((b, s), np.int32)
    for r, p in enumerate(prompts):
        ids[r, s - lengths[r]:] = np.asarray(p.input_ids, np.int32)
        mask[r, s - lengths[r]:] = 1
    merge = config.vision_config.spatial_merge_size

    def media(kind: str, pixels: str) -> tuple[np.ndarray | None, np.ndarray | None]:
        holding = [p for p in prompts if p.grids(kind) is not None]
        if not holding:
            return None, None
        return (np.concatenate([np.asarray(getattr(p, pixels), np.float32) for p in holding]),
                np.concatenate([p.grids(kind) for p in holding]))

    (pixels, grids), (video_pixels, video_grids) = media("image", "pixel_values"), media("video", "pixel_values_videos")
    if grids is not None or video_grids is not None:
        most = max(p.num_patches() for p in prompts)
        n_patches = num_patches or round_up(most, round_up(patch_bucket, merge * merge))
        batch = hf_inputs_to_batch(config, ids, pixels, grids, mask, num_patches=n_patches,
                                   pixel_values_videos=video_pixels, video_grid_thw=video_grids)
    else:
        batch = hf_inputs_to_batch(config, ids, attention_mask=mask, num_patches=num_patches)
    # positions over each row's own tokens (HF's get_rope_index with the attention mask; also for text)
    positions = np.zeros((3, b, s), np.int32)
    next_pos = np.zeros((b,), np.int32)
    for r, p in enumerate(prompts):
        pos, _ = mrope_position_ids(np.asarray(p.input_ids), p.grids("image"), image_token_id=config.image_token_id,
                                    spatial_merge_size=merge, video_grid_thw=p.grids("video"),
                                    video_token_id=getattr(config, "video_token_id", None))
        positions[:, r, s - lengths[r]:] = pos
        next_pos[r] = int(pos.max()) + 1
    batch["positions"] = positions
    return batch, next_pos


# ----------------------------------------------------------------------------- compiled programs

@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef: nnx.GraphDef, state: nnx.State, batch: dict[str, jax.Array],
             kv_segment_ids: jax.Array) -> tuple[jax.Array, list]:
    TRACES["prefill"] += 1
    model = nnx.merge(graphdef, state)
    cache = init_cache(model, *kv_segment_ids.shape)
    hidden, cache = model.cached_hidden_states(batch, cache, kv_segment_ids, jnp.zeros((), jnp.int32), prefill=True)
    return model.logits(hidden[:, -1:])[:, 0], cache


@functools.partial(jax.jit, static_argnums=0, static_argnames=("greedy", "keep_logits"), donate_argnames=("cache",))
def _decode(graphdef: nnx.GraphDef, state: nnx.State, cache: list, logits: jax.Array, tokens: jax.Array,
            kv_segment_ids: jax.Array, next_pos: jax.Array, start: jax.Array, max_new: jax.Array,
            stop_ids: jax.Array, pad_id: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array, *,
            greedy: bool, keep_logits: bool) -> tuple[jax.Array, ...]:
    """tokens ``[B, T]`` (prompt in ``[0, start)``) -> (tokens with the generated ids at ``start ..``,
    generated counts ``[B]``, stopped ``[B]``, steps run, logits ``[B, T, V]`` or ``[B, 0, V]``, the
    cache: returned so the donated input buffers are the loop's, updated in place)."""
    TRACES["decode"] += 1
    model = nnx.merge(graphdef, state)
    b, t = tokens.shape
    kept = jnp.zeros((b, t if keep_logits else 0, logits.shape[-1]), jnp.float32)
    init = (jnp.zeros((), jnp.int32), cache, logits, tokens, jnp.zeros((b,), bool), jnp.zeros((b,), jnp.int32), kept)

    def cond(carry):
        k, *_, done, _, _ = carry
        return (k < max_new) & ~jnp.all(done)

    def body(carry):
        k, cache, logits, tokens, done, count, kept = carry
        tok = sample_token(logits, jax.random.fold_in(key, k), temperature, top_p, greedy=greedy)
        tok = jnp.where(done, pad_id, tok)
        slot = start + k
        tokens = jax.lax.dynamic_update_slice(tokens, tok[:, None], (jnp.zeros((), jnp.int32), slot))
        if keep_logits:
            kept = jax.lax.dynamic_update_slice(kept, logits[:, None].astype(kept.dtype), (0, k, 0))
        count = count + (~done).astype(jnp.int32)
        done = done | jnp.any(tok[:, None] == stop_ids[None, :], axis=-1)
        pos = jnp.broadcast_to((next_pos + k)[None, :, None], (3, b, 1))
        step = {"input_ids": tok[:, None], "positions": pos, "segment_ids": jnp.ones((b, 1), jnp.int32)}
        hidden, cache = model.cached_hidden_states(step, cache, kv_segment_ids, slot)
        return k + 1, cache, model.logits(hidden)[:, 0], tokens, done, count, kept

    k, cache, _, tokens, done, count, kept = jax.lax.while_loop(cond, body, init)
    return tokens, count, done, k, kept, cache


# ----------------------------------------------------------------------------- token-level API

def generate_ids(model: Any, prompts: Sequence[Prompt], *, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, stop_ids: Sequence[int] = (), pad_id: int = 0,
                 prompt_bucket: int = 64, cache_bucket: int = 128, patch_bucket: int = 256,
                 num_patches: int | None = None, keep_logits: bool = False) -> Generation:
    """Generate up to ``max_new_tokens`` for each prompt (one batch; left padding): greedy when
    ``temperature <= 0`` (HF ``do_sample=False``), else temperature + top-p sampling under ``seed``.
    A row stops at its first id in ``stop_ids``; stopped rows are fed ``pad_id``. Buckets: see
    ``prompt_batch`` and ``kv_cache`` (T = S + max_new_tokens rounded up to ``cache_bucket``)."""
    if not prompts:
        return Generation([], np.zeros((0,), bool), None, 0, 0)
    if len(stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(stop_ids)}")
    max_new_tokens = int(max_new_tokens)
    batch, next_pos = prompt_batch(model.config, prompts, pad_id=pad_id, prompt_bucket=prompt_bucket,
                                   patch_bucket=patch_bucket, num_patches=num_patches)
    b, s = batch["input_ids"].shape
    t = round_up(s + max(max_new_tokens, 1), cache_bucket)
    kv_seg = cache_segment_ids(batch["segment_ids"], t)
    graphdef, state = nnx.split(model)
    logits, cache = _prefill(graphdef, state, batch, kv_seg)
    tokens = np.full((b, t), pad_id, np.int32)
    tokens[:, :s] = batch["input_ids"]
    stops = np.full((MAX_STOP_IDS,), -1, np.int32)
    stops[: len(stop_ids)] = np.asarray(stop_ids, np.int32)
    greedy = temperature <= 0
    out, count, done, steps, kept, _ = _decode(
        graphdef, state, cache, logits, jnp.asarray(tokens), jnp.asarray(kv_seg), jnp.asarray(next_pos),
        jnp.int32(s), jnp.int32(max_new_tokens), jnp.asarray(stops), jnp.int32(pad_id), jax.random.key(seed),
        jnp.float32(max(temperature, 0.0)), jnp.float32(top_p), greedy=greedy, keep_logits=keep_logits)
    out, count, done, steps = (np.asarray(x) for x in (out, count, done, steps))
    generated = [out[r, s: s + count[r]].copy() for r in range(b)]
    return Generation(generated, done.astype(bool), np.asarray(kept)[:, :int(steps)] if keep_logits else None, s, t)


# ----------------------------------------------------------------------------- chat prompts

ImageRef = str | Path | bytes | Image.Image


@dataclasses.dataclass(frozen=True)
class Video:
    """A video of a prompt, beside its images in the same media list: a file FFmpeg reads, its encoded bytes, a
    folder of frame images, a list of frame image paths or of encoded frame images (a record's video stored as
    frames); decoded and sampled as the data pipeline does (``data.video``)."""

    source: str | Path | bytes | tuple[str, ...] | tuple[bytes, ...]


MediaRef = ImageRef | Video


def load_video(video: Video, cfg: VideoConfig, image_cfg: ImageConfig
               ) -> tuple[np.ndarray, np.ndarray, VideoTokens]:
    """A video -> (pixel_values_videos ``[N, patch_dim]`` float32, grid ``[3]``, its prompt tokens: pads per frame
    pair and timestamps), processed as the data pipeline does (``data.video``). Raises ``VideoSkip``."""
    source = video.source
    ref = list(source) if isinstance(source, (list, tuple)) else source
    if isinstance(ref, (str, Path)):
        ref = Path(ref).expanduser()
    patches, grid, seconds = process_video(decode_video(ref, cfg, image_cfg), cfg, image_cfg)
    return (expand_patches(patches, image_cfg), grid,
            VideoTokens(int(grid[1] * grid[2]) // image_cfg.merge_size**2, tuple(seconds)))


def load_image(ref: ImageRef, cfg: ImageConfig) -> tuple[np.ndarray, np.ndarray]:
    """A path, encoded bytes or a PIL image -> (pixel_values ``[N, patch_dim]`` float32, grid ``[3]``),
    processed as the data pipeline does (``data.image``: EXIF, RGB, smart resize, normalise)."""
    if isinstance(ref, Image.Image):
        return image_to_pixel_values(ref, cfg)
    data = bytes(ref) if isinstance(ref, (bytes, bytearray, memoryview)) else Path(ref).expanduser().read_bytes()
    return image_to_pixel_values(decode_image(data, cfg), cfg)


def user_content(question: str, num_images: int | Sequence[str]) -> list[dict[str, Any]]:
    """The user turn's content items for media of the kinds ``num_images`` lists in order (``"image"`` /
    ``"video"``; a number: that many images): each at the question's ``<image>`` / ``<video>`` placeholders
    (as LLaVA records, ``data.records``) when they are the same kinds in the same order, else all media first,
    then the text (as the built-in VQA samples)."""
    kinds = ["image"] * num_images if isinstance(num_images, int) else list(num_images)
    items = split_placeholders(question)
    if kinds and _media_kinds(items) == kinds:
        return items
    return [{"type": kind} for kind in kinds] + [{"type": "text", "text": question}]


def _media_kinds(items: Sequence[Mapping[str, Any]]) -> list[str]:
    """The kinds ("image" / "video") of content items that are media, in order."""
    return [it["type"] for it in items if it["type"] != "text"]


def prompt_ids(tokenizer: Tokenizer, messages: Sequence[Mapping[str, Any]], image_tokens: Sequence[int],
               system_prompt: str | None = None, videos: Sequence[VideoTokens] = ()) -> np.ndarray:
    """Token ids of a conversation ending with a user turn plus the generation prompt
    (``<|im_start|>assistant\\n``): ``data.chat.encode_conversation`` as for training samples (image
    pads expanded, videos as timestamped frame-pair groups), cut before the empty assistant turn's ``<|im_end|>``."""
    if not messages or messages[-1].get("role") != "user":
        raise ValueError("a prompt conversation must end with a user turn")
    enc = encode_conversation([*messages, {"role": "assistant", "content": ""}], tokenizer, image_tokens, system_prompt,
                              videos)
    im_end = tokenizer.special_id("<|im_end|>")
    ends = np.flatnonzero(enc.ids == im_end)
    return enc.ids[: ends[-1]].astype(np.int32)


def chat_prompt(tokenizer: Tokenizer, question: str | Sequence[Mapping[str, Any]], images: Sequence[MediaRef],
                image_config: ImageConfig | None = None, system_prompt: str | None = None,
                video_config: VideoConfig | None = None) -> Prompt:
    """A question (text, or HF-style messages ending with a user turn) and its media in prompt order (images, and
    videos as :class:`Video`) -> Prompt."""
    cfg = image_config or ImageConfig()
    vcfg = video_config or VideoConfig()
    kinds = ["video" if isinstance(ref, Video) else "image" for ref in images]
    placed = _media_kinds(split_placeholders(question)) if isinstance(question, str) else []
    if kinds and sorted(placed) == sorted(kinds):  # the media at the placeholders: the k-th image at the k-th <image>
        by_kind = {k: iter([r for r, kk in zip(images, kinds) if kk == k]) for k in ("image", "video")}
        images, kinds = [next(by_kind[k]) for k in placed], placed
    loaded = [load_image(ref, cfg) for ref in images if not isinstance(ref, Video)]
    clips = [load_video(ref, vcfg, cfg) for ref in images if isinstance(ref, Video)]
    grids = np.stack([g for _, g in loaded]).astype(np.int64) if loaded else None
    tokens = [int(g.prod()) // cfg.merge_size**2 for _, g in loaded]
    messages = ([{"role": "user", "content": user_content(question, kinds)}] if isinstance(question, str)
                else list(question))
    ids = prompt_ids(tokenizer, messages, tokens, system_prompt, [v for _, _, v in clips])
    pixels = np.concatenate([p for p, _ in loaded]) if loaded else None
    if not clips:
        return Prompt(ids, pixels, grids)
    return Prompt(ids, pixels, grids, np.concatenate([p for p, _, _ in clips]),
                  np.stack([g for _, g, _ in clips]).astype(np.int64))


def stop_ids_of(tokenizer: Tokenizer) -> tuple[int, ...]:
    """``<|im_end|>`` and ``<|endoftext|>`` (those the tokenizer has)."""
    return tuple(tokenizer.special_tokens[t] for t in ("<|im_end|>", "<|endoftext|>") if t in tokenizer.special_tokens)


def decode_text(tokenizer: Tokenizer, ids: np.ndarray, stop_ids: Sequence[int]) -> str:
    """Generated ids -> text, without the final stop id."""
    ids = [int(i) for i in ids]
    if ids and ids[-1] in stop_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids)


def generate(model: Any, tokenizer: Tokenizer, prompts: Sequence[str | Sequence[Mapping[str, Any]]],
             images: Sequence[Sequence[MediaRef]] | None = None, *, image_config: ImageConfig | None = None,
             system_prompt: str | None = None, max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, batch_size: int = 8, return_ids: bool = False,
             video_config: VideoConfig | None = None, **options: Any) -> list[str] | list[tuple[str, np.ndarray]]:
    """Chat prompts (text or messages) with their media (images; videos as :class:`Video`) -> generated texts (with
    ``return_ids``: (text, ids) pairs), ``batch_size`` prompts per generation batch. ``options``:
    ``generate_ids``'s buckets. The chat template, tokenizer and image / video processing are the training
    data's."""
    images = images if images is not None else [[] for _ in prompts]
    if len(images) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
    stops = stop_ids_of(tokenizer)
    out: list[Any] = []
    for lo in range(0, len(prompts), max(batch_size, 1)):
        chunk = [chat_prompt(tokenizer, q, imgs, image_config, system_prompt, video_config)
                 for q, imgs in zip(prompts[lo: lo + batch_size], images[lo: lo + batch_size])]
        gen = generate_ids(model, chunk, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                           seed=seed + lo, stop_ids=stops, pad_id=tokenizer.pad_id, **options)
        for ids in gen.tokens:
            text = decode_text(tokenizer, ids, stops)
            out.append((text, ids) if return_ids else text)
    return out


def record_questions(record: Mapping[str, Any]) -> list[tuple[list[MediaRef], list[dict[str, Any]], str]]:
    """A data record (``data.records``: ``{"messages", "images": [bytes | {"path"}], "videos": [bytes | [bytes] |
    {"path"}]}``, e.g. a held-out sample) -> one ``(media, messages, answer)`` per assistant turn: the conversation up
    to that turn's user message (earlier answers as recorded), the images and videos (:class:`Video`) it refers to
    in prompt order, the turn's text."""
    def ref(r: Any) -> Any:
        r = r["path"] if isinstance(r, Mapping) else r
        return tuple(r) if isinstance(r, list) else r

    refs = {"image": iter([ref(r) for r in record.get("images", [])]),
            "video": iter([Video(ref(r)) for r in record.get("videos", [])])}
    out: list[tuple[list[MediaRef], list[dict[str, Any]], str]] = []
    media: list[MediaRef] = []
    messages = list(record["messages"])
    for k, m in enumerate(messages):
        content = m.get("content")
        items = content if isinstance(content, list) else []
        for it in content_items(content):
            if it["type"] != "text":
                media.append(next(refs[it["type"]]))
        if m.get("role") == "assistant" and k and messages[k - 1].get("role") == "user":
            answer = content if isinstance(content, str) else "".join(
                str(it.get("text", "")) for it in items if isinstance(it, Mapping))
            out.append((list(media), [dict(x) for x in messages[:k]], answer))
    return out


def question_text(question: str | Sequence[Mapping[str, Any]]) -> str:
    """A question's text: itself, or the text items of the messages' last user turn."""
    if isinstance(question, str):
        return question
    content = question[-1].get("content")
    if isinstance(content, str):
        return content
    return "".join(str(it.get("text", "")) if isinstance(it, Mapping) else str(it) for it in content or [])


def answer_questions(model: Any, tokenizer: Tokenizer, questions: Sequence[tuple[Sequence[MediaRef], Any, Any]], *,
                     image_config: ImageConfig | None = None, system_prompt: str | None = None,
                     max_new_tokens: int = 32, batch_size: int = 8, video_config: VideoConfig | None = None,
                     **options: Any) -> list[dict[str, Any]]:
    """Held-out questions ``(media, question, answer)`` (question: text or messages ending with a user
    turn; media: images as paths, bytes or PIL images, videos as :class:`Video`) -> per question
    ``{"question", "answer", "generated",
    "match"}`` (greedy; ``match``: the generated text equals the answer, stripped and case-folded;
    None when there is no answer). For a run's end-of-run summary, e.g. on held-out records::

        model = inference.model_for_generation(cfg.model, cfg.compute, state["params"])
        qs = [inference.record_questions(decode_record(source[i]))[0] for i in range(4)]
        rows = answer_questions(model, tokenizer, qs, image_config=cfg.data.image,
                                system_prompt=cfg.data.system_prompt)"""
    texts = generate(model, tokenizer, [q for _, q, _ in questions], [list(i) for i, _, _ in questions],
                     image_config=image_config, system_prompt=system_prompt, max_new_tokens=max_new_tokens,
                     batch_size=batch_size, video_config=video_config, **options)
    rows = []
    for (_, q, a), text in zip(questions, texts):
        match = None if a is None else text.strip().casefold() == str(a).strip().casefold()
        rows.append({"question": question_text(q), "answer": a, "generated": text, "match": match})
    return rows
