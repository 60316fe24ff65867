"""Built-in VQA set: answers read back from the JPEGs (and the clips' frames, decoded from their mp4 by the pipeline's
decoder) by an independent analysis; determinism; accuracy."""

import collections
import io
import json
import time

import numpy as np
import pytest
from PIL import Image
from scipy import ndimage
from scipy.spatial import ConvexHull

from moevlm_jax.data.config import ImageConfig, VideoConfig, load_data_config
from moevlm_jax.data.loader import build_loader
from moevlm_jax.data.metrics import answer_accuracy, merge_accuracy
from moevlm_jax.data.photos import PhotoSource, photo_count
from moevlm_jax.data.records import decode_record
from moevlm_jax.data.sample import QUESTION_TYPES, SampleProcessor
from moevlm_jax.data.video import decode_video
from moevlm_jax.data.vqa import (
    ANSWERS,
    CHANCE,
    COLOURS,
    WORDS,
    dataset_dir,
    ensure_vqa,
    make_record,
    vqa_params,
)


def read_answer(jpeg: bytes, qtype: str) -> str | None:
    """Answer a question from the pixels alone (no access to the generator's scene)."""
    a = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")).astype(int)
    mask = (a.max(-1) - a.min(-1) > 60) | (a.max(-1) < 110)  # saturated or dark: shapes and words
    mask = ndimage.binary_opening(mask)
    labels, n = ndimage.label(mask)
    sizes = ndimage.sum(mask, labels, range(1, n + 1))
    parts = [i + 1 for i, s in enumerate(sizes) if s >= 6]
    if qtype == "count":
        return str(len(parts))
    if qtype == "colour":
        mean = a[mask].mean(0)
        return min(COLOURS, key=lambda c: np.sum((np.array(COLOURS[c]) - mean) ** 2))
    if qtype == "position":
        return "left" if np.nonzero(mask)[1].mean() < a.shape[1] / 2 else "right"
    if qtype == "shape":
        ys, xs = np.nonzero(labels == max(parts, key=lambda i: (labels == i).sum()))
        fill = len(xs) / ((np.ptp(xs) + 1) * (np.ptp(ys) + 1))
        pts = np.stack([xs, ys], 1).astype(float)
        hull = ConvexHull(np.concatenate([pts + d for d in ([-.5, -.5], [-.5, .5], [.5, -.5], [.5, .5])]))
        solidity = len(xs) / hull.volume
        return "star" if solidity < 0.8 else "square" if fill > 0.9 else "circle" if fill > 0.66 else "triangle"
    return None


def test_answers_match_the_drawing():
    params = vqa_params({"image_size": [128, 320]})
    checked = collections.Counter()
    for i in range(250):
        rec = decode_record(make_record(params, "train", i))
        qtype, answer = rec["meta"]["qtypes"][0], rec["meta"]["answers"][0]
        assert answer in ANSWERS[qtype]
        assert rec["messages"][1] == {"role": "assistant", "content": answer}
        seen = read_answer(rec["images"][0], qtype)
        if seen is not None:
            assert seen == answer, (i, qtype)
            checked[qtype] += 1
    assert min(checked[q] for q in ("colour", "shape", "count", "position")) >= 30


def test_sizes_aspects_and_answer_coverage():
    params = vqa_params({})
    sizes, answers = [], collections.defaultdict(set)
    for i in range(400):
        rec = decode_record(make_record(params, "train", i))
        img = Image.open(io.BytesIO(rec["images"][0]))
        assert img.format == "JPEG"
        sizes.append(img.size)
        answers[rec["meta"]["qtypes"][0]].add(rec["meta"]["answers"][0])
    w, h = np.array(sizes).T
    assert np.maximum(w, h).min() >= 60 and np.maximum(w, h).max() <= 320
    aspect = w / h
    assert aspect.min() < 0.6 and aspect.max() > 1.7 and (np.abs(aspect - 1) < 0.05).mean() < 0.2  # not squares
    for q, values in answers.items():  # every answer occurs, so chance is 1/len(ANSWERS[q])
        assert values == set(ANSWERS[q]), q
        assert CHANCE[q] == pytest.approx(1 / len(ANSWERS[q]))


def test_generation_is_deterministic_fast_and_cached(tmp_path):
    params = vqa_params({"num_train": 300, "num_heldout": 50})
    assert make_record(params, "train", 7) == make_record(params, "train", 7)
    assert make_record(params, "train", 7) != make_record(params, "heldout", 7)
    start = time.time()
    paths = ensure_vqa({"num_train": 300, "num_heldout": 50}, tmp_path, "train")
    assert time.time() - start < 15  # a few ms per sample
    heldout = ensure_vqa({"num_train": 300, "num_heldout": 50}, tmp_path, "heldout")
    root = dataset_dir(params, tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["chance"] == CHANCE and manifest["params"]["num_train"] == 300
    from moevlm_jax.data.sources import ArrayRecordSource

    assert len(ArrayRecordSource(paths)) == 300 and len(ArrayRecordSource(heldout)) == 50
    assert ArrayRecordSource(paths)[5] == make_record(params, "train", 5)


def test_a_set_generated_in_the_background_is_made_once_and_waited_for(tmp_path, monkeypatch):
    """The train command starts the built-in set in a thread (data.sources.prepare_in_background) before its fit
    check: the loader's ensure_vqa of the same set waits for that generation, makes no second copy, and reads the
    records the foreground generation writes."""
    import threading

    from moevlm_jax.data import vqa
    from moevlm_jax.data.config import DataConfig, VqaConfig
    from moevlm_jax.data.sources import ArrayRecordSource, prepare_in_background

    source = {"num_train": 40, "num_heldout": 4}
    started, release, calls = threading.Event(), threading.Event(), []
    real = vqa._generate

    def generate(*a, **k):
        calls.append(threading.current_thread().name)
        started.set()
        assert release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(vqa, "_generate", generate)
    cfg = DataConfig(source=VqaConfig(**source), cache_dir=str(tmp_path / "bg"))
    future = prepare_in_background(cfg)
    assert future is not None and started.wait(30)
    threading.Timer(0.5, release.set).start()  # ensure_vqa below comes while the generation is in flight
    paths = ensure_vqa(source, tmp_path / "bg", "train")
    assert future.done() and len(calls) == 1 and calls[0].startswith("vqa-generate"), calls
    assert prepare_in_background(cfg) is None  # there now: nothing to start
    monkeypatch.setattr(vqa, "_generate", real)
    direct = ArrayRecordSource(ensure_vqa(source, tmp_path / "fg", "train", processes=1))
    background = ArrayRecordSource(paths)
    assert [background[i] for i in range(40)] == [direct[i] for i in range(40)]


def test_worker_processes_write_the_records_this_process_writes(tmp_path):
    """``processes=2`` (the path large sets take: the first chunk here, the rest in spawned workers) writes
    exactly the shards one process writes."""
    from moevlm_jax.data.sources import ArrayRecordSource

    source = {"num_train": 70, "num_heldout": 4}
    alone = ArrayRecordSource(ensure_vqa(source, tmp_path / "one", "train", processes=1))
    pooled = ArrayRecordSource(ensure_vqa(source, tmp_path / "two", "train", processes=2))
    assert len(alone) == len(pooled) == 70
    assert [pooled[i] for i in range(70)] == [alone[i] for i in range(70)]


def test_answer_accuracy_exact_match(tmp_path):
    loader = build_loader("vqa", split="heldout", overrides=[
        "source.num_train=60", "source.num_heldout=30", "seq_len=512", "batch_size=2", f"cache_dir={tmp_path}"])
    batches = list(loader)
    perfect = merge_accuracy([answer_accuracy(b, b["targets"]) for b in batches])
    assert perfect["all"]["answers"] == 30 and perfect["all"]["accuracy"] == 1.0
    wrong = merge_accuracy([answer_accuracy(b, b["targets"] + 1) for b in batches])
    assert wrong["all"]["correct"] == 0
    # one wrong token in one answer: exactly that answer fails
    b = batches[0]
    pred = b["targets"].copy()
    r, s = np.argwhere(b["answer_group"] > 0)[0]
    pred[r, s] += 1
    acc = answer_accuracy(b, pred)
    assert acc["all"]["correct"] == acc["all"]["answers"] - 1
    assert {k: v["chance"] for k, v in acc.items() if k != "all"} == {k: CHANCE[k] for k in acc if k != "all"}


def test_photos_are_real_shipped_photographs():
    assert photo_count() >= 15
    src = PhotoSource({"num_train": 40}, "train")
    names = set()
    for i in range(40):
        rec = src[i]
        img = Image.open(io.BytesIO(rec["images"][0]))
        assert img.format == "JPEG" and 224 * 0.7 <= max(img.size) <= 640
        assert rec["messages"][1]["role"] == "assistant" and len(rec["messages"][1]["content"]) > 20
        names.add(rec["meta"]["photos"][0])
    assert len(names) >= 15
    loader = build_loader("photos", overrides=["seq_len=1024", "batch_size=2", "source.num_train=40"])
    batch = next(loader)
    assert batch["stats"]["images"] >= 2 and batch["stats"]["trained_tokens"] > 20


def _ink_box(jpeg: bytes) -> tuple[int, int, int, int, int, int]:
    """(x0, x1, y0, y1, w, h): the dark pixels' (the word's) bounding box and the image size."""
    a = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")).astype(int)
    ys, xs = np.nonzero(ndimage.binary_opening(a.max(-1) < 110))
    return xs.min(), xs.max(), ys.min(), ys.max(), a.shape[1], a.shape[0]


def test_text_words_and_text_size_set_the_text_question(tmp_path):
    from moevlm_jax.data.config import load_data_config
    from moevlm_jax.data.metrics import question_chance

    def text_scenes(**source):
        params = vqa_params({"questions": ["text"], **source})
        recs = [decode_record(make_record(params, "train", i)) for i in range(120)]
        return params, [(r["meta"]["answers"][0], _ink_box(r["images"][0])) for r in recs]

    _, scenes = text_scenes(text_words=4)
    assert {a for a, _ in scenes} == set(WORDS[:4])  # the first 4 words, each asked
    cfg = load_data_config("vqa", ["source.text_words=4", f"cache_dir={tmp_path}"])
    assert question_chance(cfg)["text"] == 0.25 and question_chance(cfg)["colour"] == CHANCE["colour"]
    ensure_vqa(cfg.source, tmp_path, "train")
    manifest = json.loads((dataset_dir(vqa_params(cfg.source), tmp_path) / "manifest.json").read_text())
    assert manifest["chance"]["text"] == 0.25 and manifest["answers"]["text"] == list(WORDS[:4])

    def height(scenes):  # the ink's height over the image's shorter side, median over the scenes
        return float(np.median([(y1 - y0 + 1) / min(w, h) for _, (x0, x1, y0, y1, w, h) in scenes]))

    small, large = height(text_scenes()[1]), height(text_scenes(text_size=[0.4, 0.5])[1])
    assert 1.5 < large / small < 2.1, (small, large)  # sizes 0.2-0.3 vs 0.4-0.5 of the shorter side
    # glyphs larger than a narrow image allows are drawn at the largest size that fits: never cut off
    for _, (x0, x1, _, _, w, _) in text_scenes(text_size=[0.8, 1.0])[1]:
        assert x0 > 0 or x1 < w - 1


def _shape_mask(frame: np.ndarray) -> np.ndarray:
    """Saturated or dark pixels of a frame: the shape (the background is pale and grey)."""
    a = frame.astype(int)
    return ndimage.binary_opening((a.max(-1) - a.min(-1) > 60) | (a.max(-1) < 110))


def read_clip_answer(frames: np.ndarray, qtype: str) -> str:
    """Answer a clip's question from its decoded frames alone: where the shape's centre goes, or in how many frames
    it shows."""
    masks = [_shape_mask(f) for f in frames]
    if qtype == "blinks":
        return str(sum(int(m.sum() >= 20) for m in masks))
    (y0, x0), (y1, x1) = (np.argwhere(m).mean(0) for m in (masks[0], masks[-1]))
    if abs(x1 - x0) > abs(y1 - y0):
        return "right" if x1 > x0 else "left"
    return "down" if y1 > y0 else "up"


def test_clips_answer_from_their_decoded_frames_and_leave_the_image_set_unchanged(tmp_path):
    """``video_fraction``: that share of samples is an mp4 clip whose answer only the frames' order gives (read back
    from the frames PyAV decodes, every frame sampled at data.video.fps 2); the clip samples go through the sample
    pipeline as videos with their question type; the image samples and the cache key of a set without clips are
    those of before clips existed."""
    params = vqa_params({"video_fraction": 0.5})
    plain = vqa_params({})
    assert dataset_dir(plain, tmp_path).name == "c9f3aae36b23"  # the default set's key before clips existed
    assert dataset_dir(params, tmp_path) != dataset_dir(plain, tmp_path)
    checked = collections.Counter()
    clips = []
    for i in range(60):
        raw = make_record(params, "train", i)
        rec = decode_record(raw)
        qtype, answer = rec["meta"]["qtypes"][0], rec["meta"]["answers"][0]
        if not rec.get("videos"):
            assert raw == make_record(plain, "train", i)  # image samples: as without clips
            continue
        clip = decode_video(rec["videos"][0], VideoConfig(), ImageConfig())
        assert len(clip.frames) == 8 and clip.fps == 2 and clip.indices.tolist() == list(range(8))
        assert 64 <= clip.frames.shape[1] == clip.frames.shape[2] <= 128
        assert read_clip_answer(clip.frames, qtype) == answer, (i, qtype, answer)
        checked[qtype, answer] += 1
        clips.append((i, raw))
    assert {q for q, _ in checked} == {"motion", "blinks"} and 20 <= sum(checked.values()) <= 40
    assert len({a for q, a in checked if q == "motion"}) == 4 and len({a for q, a in checked if q == "blinks"}) == 3

    cfg = load_data_config({"name": "vqa", "source": {"kind": "vqa", "video_fraction": 0.5}, "seq_len": 256,
                            "patch_buckets": [512], "image": {"min_pixels": 4096, "max_pixels": 16384},
                            "video": {"min_pixels": 32768, "max_pixels": 73728}})
    process = SampleProcessor(cfg, eval_mode=True)
    for i, raw in clips[:4]:
        sample = process(i, raw)
        rec = decode_record(raw)
        assert sample["videos"] == 1 and sample["grids"][0, 0] == 4  # 8 frames: 4 frame pairs
        assert sample["grids"][0, 1] in (4, 6) and sample["grids"][0, 1] == sample["grids"][0, 2]  # 64 or 96 px
        assert set(sample["answer_type"][sample["answer"] > 0].tolist()) == {QUESTION_TYPES.index(
            rec["meta"]["qtypes"][0])}


def test_the_long_clip_proxy_preset_fills_its_bucket_within_its_row():
    """configs/data/proxy_video.yaml (the GPU's 64-frame workload, bench/scripts/video_step.sh): a clip of it made at
    full size decodes to its 64 frames of 448 x 448 px at 2 fps and goes through the sample pipeline as 32 frame pairs
    of 28 x 28 patches, the preset's patch bucket exactly (25,088), in fewer tokens than its row: 6,272 video tokens
    plus the timestamps and the question."""
    cfg = load_data_config("proxy_video")
    params = vqa_params(cfg.source)
    raw = make_record(params, "train", 0)
    rec = decode_record(raw)
    clip = decode_video(rec["videos"][0], cfg.video, cfg.image)
    assert len(clip.frames) == 64 and clip.fps == 2 and clip.frames.shape[1:] == (448, 448, 3)
    assert read_clip_answer(clip.frames, rec["meta"]["qtypes"][0]) == rec["meta"]["answers"][0]
    sample = SampleProcessor(cfg, eval_mode=True)(0, raw)
    assert sample["videos"] == 1 and sample["grids"][0].tolist() == [32, 28, 28]
    assert 32 * 28 * 28 == cfg.patch_buckets[-1] == 25088
    assert sample["patches"].shape[0] == 25088
    tokens = int(np.count_nonzero(sample["ids"] == 151656))  # the video placeholder's id (Qwen3-VL)
    assert tokens == 25088 // 4 and tokens < len(sample["ids"]) <= cfg.seq_len
