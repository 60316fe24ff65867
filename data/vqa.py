"""Built-in procedural visual question answering set (no download).

Scenes of coloured shapes and rendered words on textured backgrounds, drawn at varied realistic
resolutions and aspect ratios and saved as JPEG (quality 70-95) inside ArrayRecord shards. Each
question has a short answer read off the drawing and a known chance level:

    colour    "What colour is the shape?"           one of 8 colours        chance 1/8
    shape     "What shape is shown?"                circle/square/triangle/star   1/4
    count     "How many shapes are there?"          1..6                    1/6
    position  "Is the shape on the left or the right?"  left/right          1/2
    text      "What word is written in the image?"  one of 16 words         1/16  (``text_words``: fewer)

With ``video_fraction`` > 0, that fraction of samples is instead a short clip (``video_frames`` square frames of
``video_size`` px at ``video_fps``, a textured background, encoded as an MPEG-4 mp4 with PyAV and stored in the
shard beside the images, decoded by the pipeline as any video) with a question only the frames' order answers:

    motion    "Which way does the shape move?"      left/right/up/down      chance 1/4
    blinks    "How many times does the shape flash?"  1..3                  1/3

A moving shape crosses about half the frame from a random start; a flashing shape is shown in 1-3 single frames
(never two adjacent ones), so that no one frame holds the answer. The image samples are the same with or without
clips (each sample draws from its own stream), and the cache key of a set without clips is unchanged.

Samples may hold several images (questions then name the image) and extra "describe" turns whose
long answers (not scored) describe every object; the GPU proxy preset uses that to reach 4 images
and ~4k tokens per sample (``text_budget`` caps the characters of describe turns so that samples
stay under the sequence). Generation is deterministic per (seed, split, index), runs in worker
processes for large sets, and is cached under ``<cache_dir>/vqa/<hash of the parameters>``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib.util
import io
import itertools
import json
import logging
import math
import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from moevlm_jax.data.config import VqaConfig, source_params
from moevlm_jax.data.records import encode_record
from moevlm_jax.data.sample import QUESTION_TYPES

log = logging.getLogger(__name__)

GENERATOR_VERSION = 2
COLOURS = {
    "red": (215, 35, 35), "green": (30, 150, 55), "blue": (35, 75, 215), "yellow": (235, 200, 25),
    "orange": (245, 125, 15), "purple": (135, 55, 175), "black": (25, 25, 25), "brown": (125, 75, 35),
}
SHAPES = ("circle", "square", "triangle", "star")
WORDS = ("cat", "dog", "sun", "tree", "book", "fish", "bird", "moon",
         "ship", "king", "road", "rain", "fire", "milk", "gold", "door")
MAX_COUNT = 6
ANSWERS = {
    "colour": tuple(COLOURS), "shape": SHAPES, "count": tuple(str(i) for i in range(1, MAX_COUNT + 1)),
    "position": ("left", "right"), "text": WORDS,
    "motion": ("left", "right", "up", "down"), "blinks": ("1", "2", "3"),
}
CHANCE = {q: 1.0 / len(ANSWERS[q]) for q in QUESTION_TYPES}  # of the default parameters (16 words)
QUESTIONS = {
    "colour": ("What colour is the shape?", "Which colour is the shape in the picture?",
               "Name the colour of the shape."),
    "shape": ("What shape is shown?", "Which shape is in the picture?", "Name the shape."),
    "count": ("How many shapes are there?", "Count the shapes in the picture.", "How many shapes can you see?"),
    "position": ("Is the shape on the left or the right?", "Which side is the shape on, left or right?"),
    "text": ("What word is written in the image?", "Read the word in the picture.", "Which word is shown?"),
    "motion": ("Which way does the {shape} move?", "In which direction does the {colour} {shape} move: left, "
               "right, up or down?", "Where is the shape going: left, right, up or down?"),
    "blinks": ("How many times does the {shape} flash?", "How many times does the {colour} {shape} appear?",
               "Count the flashes of the shape."),
}
VIDEO_KEYS = ("video_fraction", "video_questions", "video_frames", "video_fps", "video_size")
SPLITS = {"train": 0, "heldout": 1}


def vqa_params(source: VqaConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Generator parameters: a ``VqaConfig``'s settings as plain values (given a mapping of some of its
    keys, the rest take the config's defaults)."""
    if not isinstance(source, VqaConfig):
        source = VqaConfig(**{k: v for k, v in source.items() if k != "kind"})
    return source_params(source)


def answer_sets(params: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Each question type's answers under a parameter set (the text question: the first ``text_words``)."""
    return {**ANSWERS, "text": WORDS[:int(params["text_words"])]}


def chance(params: Mapping[str, Any]) -> dict[str, float]:
    """Each question type's chance level under a parameter set: one over its number of answers."""
    return {q: 1.0 / len(a) for q, a in answer_sets(params).items()}


# -- drawing ----------------------------------------------------------------------------------------

_FONTS: dict[int, Any] = {}


def _font(size: int) -> Any:
    if size not in _FONTS:
        try:
            spec = importlib.util.find_spec("matplotlib")
            root = Path(next(iter(spec.submodule_search_locations)))  # type: ignore[union-attr]
            _FONTS[size] = ImageFont.truetype(str(root / "mpl-data" / "fonts" / "ttf" / "DejaVuSans-Bold.ttf"), size)
        except Exception:  # noqa: BLE001 - fall back to Pillow's bundled font
            _FONTS[size] = ImageFont.load_default(size=size)
    return _FONTS[size]


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "triangle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in np.radians([-90, 30, 150])]
    pts = []
    for k in range(10):  # star
        rad = r if k % 2 == 0 else 0.45 * r
        a = math.radians(-90 + 36 * k)
        pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
    return pts


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, colour: str, cx: float, cy: float, r: float) -> None:
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    elif shape == "square":
        h = 0.8 * r
        draw.rectangle((cx - h, cy - h, cx + h, cy + h), fill=fill)
    else:
        draw.polygon(_polygon(shape, cx, cy, r), fill=fill)


def _background(rng: np.random.Generator, w: int, h: int) -> Image.Image:
    level = rng.uniform(205, 245)
    tint = rng.uniform(-12, 12, 3)  # pale, low-saturation backgrounds keep the shapes' colours clear
    tilt = rng.uniform(-20, 20) + rng.uniform(-5, 5, 3)
    ramp = np.linspace(0, 1, h)[:, None, None]
    shade = (level + tint[None, None, :] + tilt[None, None, :] * ramp).astype(np.int16)  # [h, 1, 3]
    noise = rng.integers(-6, 7, size=(h, w, 3), dtype=np.int16)  # sensor-like grain, realistic JPEG entropy
    img = Image.fromarray(np.clip(shade + noise, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(0, 4))):  # faint clutter lines, never counted as shapes
        g = int(rng.integers(175, 200))
        xy = [float(v) for v in rng.uniform(0, 1, 4) * [w, h, w, h]]
        draw.line(xy, fill=(g, g, g), width=1)
    return img


def _size(rng: np.random.Generator, params: Mapping[str, Any]) -> tuple[int, int]:
    lo, hi = params["image_size"]
    a_lo, a_hi = params["aspect"]
    long_side = float(rng.uniform(lo, hi))
    aspect = float(math.exp(rng.uniform(math.log(a_lo), math.log(a_hi))))  # width / height
    w, h = (long_side, long_side / aspect) if aspect >= 1 else (long_side * aspect, long_side)
    return max(16, round(w)), max(16, round(h))


def _place(rng: np.random.Generator, w: int, h: int, radii: list[float], xs: tuple[float, float] = (0.0, 1.0)
           ) -> list[tuple[float, float]] | None:
    centres: list[tuple[float, float]] = []
    for r in radii:
        for _ in range(200):
            cx = rng.uniform(max(r, xs[0] * w), min(w - r, xs[1] * w))
            cy = rng.uniform(r, h - r)
            gap = max(3.0, 0.15 * (r + min(radii)))  # clear gaps keep shapes countable after JPEG
            if all(math.hypot(cx - x, cy - y) > r + rr + gap for (x, y), rr in zip(centres, radii)):
                centres.append((cx, cy))
                break
        else:
            return None
    return centres


def _where(cx: float, cy: float, w: int, h: int) -> str:
    col = ("left", "centre", "right")[min(2, int(3 * cx / w))]
    row = ("top", "middle", "bottom")[min(2, int(3 * cy / h))]
    return "in the centre" if (row, col) == ("middle", "centre") else f"at the {row} {col}".replace(" centre", "")


def make_scene(rng: np.random.Generator, qtype: str, params: Mapping[str, Any]) -> tuple[bytes, str, str, tuple]:
    """Draw one scene for a question type -> (JPEG bytes, answer, description, (w, h))."""
    w, h = _size(rng, params)
    img = _background(rng, w, h)
    draw = ImageDraw.Draw(img)
    short = min(w, h)
    objects: list[str] = []
    if qtype == "count":
        n = int(rng.integers(1, MAX_COUNT + 1))
        for attempt in range(60):  # small images may not hold n shapes: give up on the largest counts
            count = max(1, n - attempt // 20)
            radii = [max(4.0, float(rng.uniform(0.07, 0.11) * short)) for _ in range(count)]
            centres = _place(rng, w, h, radii)
            if centres is not None:
                break
        else:
            count, radii, centres = 1, [4.0], [(w / 2, h / 2)]
        for (cx, cy), r in zip(centres, radii):
            shape, colour = SHAPES[rng.integers(len(SHAPES))], list(COLOURS)[rng.integers(len(COLOURS))]
            _draw_shape(draw, shape, colour, cx, cy, r)
            objects.append(f"a {colour} {shape} {_where(cx, cy, w, h)}")
        answer = str(count)
    elif qtype == "text":
        words = WORDS[:int(params["text_words"])]
        word = words[rng.integers(len(words))]
        lo, hi = params["text_size"]
        size = max(8, int(short * rng.uniform(lo, hi)))
        font = _font(size)
        left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
        if right - left > w:  # wider than the image: the largest size that fits
            font = _font(max(8, int(size * w / (right - left))))
            left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
        x = rng.uniform(0, max(1.0, w - (right - left))) - left
        y = rng.uniform(0, max(1.0, h - (bottom - top))) - top
        g = int(rng.integers(0, 60))
        draw.text((x, y), word, fill=(g, g, g), font=font)
        objects.append(f'the word "{word}" {_where(x + (left + right) / 2, y + (top + bottom) / 2, w, h)}')
        answer = word
    else:
        r = max(4.0, float(rng.uniform(0.14, 0.22) * short))
        shape, colour = SHAPES[rng.integers(len(SHAPES))], list(COLOURS)[rng.integers(len(COLOURS))]
        xs = (0.0, 1.0)
        side = ""
        if qtype == "position":
            side = ("left", "right")[rng.integers(2)]
            xs = (0.0, 0.38) if side == "left" else (0.62, 1.0)
            r = min(r, 0.18 * w)
        (cx, cy), = _place(rng, w, h, [r], xs) or [((xs[0] + xs[1]) / 2 * w, h / 2)]
        _draw_shape(draw, shape, colour, cx, cy, r)
        objects.append(f"a {colour} {shape} {_where(cx, cy, w, h)}")
        answer = {"colour": colour, "shape": shape, "position": side}[qtype]
    quality = int(rng.integers(params["jpeg_quality"][0], params["jpeg_quality"][1] + 1))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=quality)
    description = "It shows " + ", ".join(objects[:-1]) + (" and " if len(objects) > 1 else "") + objects[-1] + "."
    return buf.getvalue(), answer, description, (w, h)


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """uint8 frames [n, h, w, 3] (even h, w) -> an MPEG-4 Part 2 mp4 file's bytes, encoded with PyAV."""
    import av  # PyAV; imported here so that image-only sets never load FFmpeg

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=Fraction(fps).limit_denominator(1000))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "3"}  # high quality: shapes keep their colours and edges
        for f in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def make_clip(rng: np.random.Generator, qtype: str, params: Mapping[str, Any]) -> tuple[bytes, str, dict[str, str]]:
    """Draw one clip for a video question type -> (mp4 bytes, answer, {"shape", "colour"})."""
    lo, hi = params["video_size"]
    side = 2 * round(float(rng.uniform(lo, hi)) / 2)  # even: yuv420p
    n = int(params["video_frames"])
    background = _background(rng, side, side)
    r = float(rng.uniform(0.12, 0.18) * side)
    shape, colour = SHAPES[rng.integers(len(SHAPES))], list(COLOURS)[rng.integers(len(COLOURS))]
    if qtype == "motion":
        answer = ANSWERS["motion"][rng.integers(4)]
        span = float(rng.uniform(0.4, 0.55)) * (side - 2 * r)  # the distance travelled, of the free range
        start = float(rng.uniform(r, side - r - span))  # along the motion's axis, in moving-forward coordinates
        across = float(rng.uniform(r, side - r))
        along = start + span * np.linspace(0, 1, n)
        if answer in ("left", "up"):
            along = side - along
        centres = [(a, across) if answer in ("left", "right") else (across, a) for a in along]
        shown = [True] * n
    else:
        count = int(rng.integers(1, 4))
        answer = str(count)
        cx, cy = (float(v) for v in rng.uniform(r, side - r, 2))
        centres = [(cx, cy)] * n
        while True:  # single frames in distinct frame pairs, never two adjacent frames (one flash each)
            pairs = rng.choice(n // 2, size=count, replace=False)
            frames = sorted(int(2 * p + rng.integers(2)) for p in pairs)
            if all(b - a > 1 for a, b in itertools.pairwise(frames)):
                break
        shown = [i in frames for i in range(n)]
    out = np.empty((n, side, side, 3), np.uint8)
    for i, ((cx, cy), on) in enumerate(zip(centres, shown)):
        img = background.copy()
        if on:
            _draw_shape(ImageDraw.Draw(img), shape, colour, cx, cy, r)
        out[i] = np.asarray(img)
    return encode_mp4(out, float(params["video_fps"])), answer, {"shape": shape, "colour": colour}


def make_clip_record(params: Mapping[str, Any], split: str, index: int) -> bytes:
    """One clip sample: a video and its question (its own random stream: the image samples stay as they are)."""
    rng = np.random.default_rng([int(params["seed"]), SPLITS[split], int(index), 1])
    questions = list(params["video_questions"])
    qtype = questions[rng.integers(len(questions))]
    mp4, answer, what = make_clip(rng, qtype, params)
    question = QUESTIONS[qtype][rng.integers(len(QUESTIONS[qtype]))].format(**what)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": question}]},
                {"role": "assistant", "content": answer}]
    meta = {"source": "vqa", "split": split, "qtypes": [qtype], "answers": [answer]}
    return encode_record(messages, [], meta, videos=[mp4])


def is_clip(params: Mapping[str, Any], split: str, index: int) -> bool:
    """Whether sample ``index`` of a split is a clip (``video_fraction`` of them, drawn per sample)."""
    fraction = float(params.get("video_fraction", 0.0))
    if fraction <= 0:
        return False
    return bool(np.random.default_rng([int(params["seed"]), SPLITS[split], int(index), 2]).random() < fraction)


def make_record(params: Mapping[str, Any], split: str, index: int) -> bytes:
    """One encoded record of the VQA set, a pure function of (params, split, index)."""
    if is_clip(params, split, index):
        return make_clip_record(params, split, index)
    rng = np.random.default_rng([int(params["seed"]), SPLITS[split], int(index)])
    lo, hi = params["images_per_sample"]
    n_images = int(rng.integers(lo, hi + 1))
    d_lo, d_hi = params["describe_turns"]
    questions = list(params["questions"])
    images, scenes, qtypes, answers, messages = [], [], [], [], []
    for _ in range(n_images):
        qtype = questions[rng.integers(len(questions))]
        jpeg, answer, description, size = make_scene(rng, qtype, params)
        images.append(jpeg)
        scenes.append((qtype, answer, description, size))
    user: list[dict[str, Any]] = [{"type": "image"} for _ in range(n_images)]
    for k, (qtype, answer, _, _) in enumerate(scenes):
        q = QUESTIONS[qtype][rng.integers(len(QUESTIONS[qtype]))]
        if n_images > 1:
            q = f"In image {k + 1}: {q[0].lower()}{q[1:]}"
        user.append({"type": "text", "text": q})
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
        qtypes.append(qtype)
        answers.append(answer)
        user = []
    budget = int(params["text_budget"]) or None  # characters of describe turns (0: no limit)
    for t in range(int(rng.integers(d_lo, d_hi + 1))):
        k = t % n_images
        _, _, description, (w, h) = scenes[k]
        question = f"Describe image {k + 1} in one sentence." if n_images > 1 else "Describe the image in one sentence."
        answer_text = f"The image is {w} by {h} pixels. {description}"
        if budget is not None:
            budget -= len(question) + len(answer_text)
            if budget < 0:
                break
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer_text}]
        qtypes.append("describe")
        answers.append(None)
    meta = {"source": "vqa", "split": split, "qtypes": qtypes, "answers": answers}
    return encode_record(messages, images, meta)


# -- dataset on disk -------------------------------------------------------------------------------

def _chunk(args: tuple[dict[str, Any], str, int, int]) -> list[bytes]:
    params, split, start, stop = args
    return [make_record(params, split, i) for i in range(start, stop)]


def dataset_dir(params: Mapping[str, Any], cache_dir: Path) -> Path:
    """Cache directory of a parameter set (a set without clips keys as before clips existed)."""
    if not params.get("video_fraction"):
        params = {k: v for k, v in params.items() if k not in VIDEO_KEYS}
    key = json.dumps({"v": GENERATOR_VERSION, **params}, sort_keys=True)
    return Path(cache_dir) / "vqa" / hashlib.sha1(key.encode()).hexdigest()[:12]


# a spawned worker imports this package (grain and jax with it, 5-8 s on 2 busy cores) before its first sample: a
# set of a few hundred samples is made sooner in this process
POOL_WORTH_S = 30.0


# sets being generated in this process (by :func:`generate_in_background`), by their cache directory: a caller of
# ensure_vqa for the same set waits for that generation instead of making a second copy
_GENERATING: dict[Path, concurrent.futures.Future] = {}
_GENERATING_LOCK = threading.Lock()


def generate_in_background(source: Mapping[str, Any], cache_dir: Path) -> concurrent.futures.Future | None:
    """Start generating the set into the cache in a thread (None where it is there already): the train command
    calls it before its fit check and compiles, so that a new machine makes the built-in data while XLA compiles.
    :func:`ensure_vqa` of the same set then waits for it."""
    params = vqa_params(source)
    root = dataset_dir(params, cache_dir)
    if (root / "manifest.json").exists():
        return None
    with _GENERATING_LOCK:
        if root not in _GENERATING:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vqa-generate")
            _GENERATING[root] = pool.submit(_generate, params, root)
            pool.shutdown(wait=False)
        return _GENERATING[root]


def ensure_vqa(source: Mapping[str, Any], cache_dir: Path, split: str, processes: int | None = None) -> list[str]:
    """ArrayRecord shard paths of a split, generating the set into the cache first if needed (``processes``: the
    worker processes that make it; None: as many as cores where the set would take over ``POOL_WORTH_S`` here)."""
    params = vqa_params(source)
    if split not in SPLITS:
        raise ValueError(f"vqa split must be one of {list(SPLITS)}, got {split!r}")
    root = dataset_dir(params, cache_dir)
    manifest = root / "manifest.json"
    with _GENERATING_LOCK:
        pending = _GENERATING.get(root)
    if pending is not None:
        pending.result()  # a generation started in the background: its set (or its error)
    if not manifest.exists():
        _generate(params, root, processes)
    info = json.loads(manifest.read_text())
    return [str(root / name) for name in info["shards"][split]]


def _generate(params: Mapping[str, Any], root: Path, processes: int | None = None) -> None:
    """Write the set's shards and manifest under ``root`` (atomically: a concurrent builder either wins or finds
    it done)."""
    from array_record.python.array_record_module import ArrayRecordWriter

    if (root / "manifest.json").exists():
        return
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=root.name + ".tmp", dir=root.parent))
    start = time.time()
    total = params["num_train"] + params["num_heldout"]
    pool = None
    try:
        shards: dict[str, list[str]] = {}
        for name, count in (("train", params["num_train"]), ("heldout", params["num_heldout"])):
            size = int(params["shard_size"])
            shards[name] = []
            for s0 in range(0, count, size):
                path = tmp / f"{name}-{s0 // size:05d}.array_record"
                writer = ArrayRecordWriter(str(path), "group_size:1")
                step = 32
                jobs = [(params, name, i, min(i + step, s0 + size, count))
                        for i in range(s0, min(s0 + size, count), step)]
                if pool is None and jobs:  # time one chunk: processes where the rest outlasts starting them
                    t0 = time.time()
                    for rec in _chunk(jobs[0]):
                        writer.write(rec)
                    jobs = jobs[1:]
                    left = (time.time() - t0) / step * total
                    procs = processes or (min(os.cpu_count() or 1, 16) if left > POOL_WORTH_S else 1)
                    if procs > 1:
                        pool = mp.get_context("spawn").Pool(procs)
                for records in (pool.imap(_chunk, jobs) if pool else map(_chunk, jobs)):
                    for rec in records:
                        writer.write(rec)
                writer.close()
                shards[name].append(path.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if pool:
            pool.close()
            pool.join()
    info = {"params": params, "version": GENERATOR_VERSION, "shards": shards, "chance": chance(params),
            "answers": {k: list(v) for k, v in answer_sets(params).items()}, "seconds": round(time.time() - start,
                                                                                              2)}
    (tmp / "manifest.json").write_text(json.dumps(info, indent=1))
    try:
        os.replace(tmp, root)  # atomic: a concurrent builder either wins or finds it done
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("generated VQA set %s (%d samples) in %.1fs", root, total, time.time() - start)
