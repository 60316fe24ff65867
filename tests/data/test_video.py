"""Video input (data.video) against HF's Qwen3VLVideoProcessor / Qwen3VLProcessor (Qwen3-VL and Qwen3.5 share them)
on an mp4 and a frame folder the tests write: frame sampling, smart_resize, patchify, patch counts, the prompt with
timestamps; decoding checked against PyAV's own frames and the drawn ones; bad videos counted.

Not covered by HF parity: the resize kernel. Ours is PIL's bicubic on uint8 frames (as our image path); HF's video
processor resizes with torchvision, which cannot be installed next to this machine's CPU torch. So patchify parity
runs HF's ``patchify`` on our resized frames, and the sizes come from HF's ``smart_resize``."""

import json

import av
import numpy as np
import pytest
import torch
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_smart_resize
from transformers.video_utils import VideoMetadata

from moevlm_jax.data.chat import QWEN3_VL_CHAT_TEMPLATE, VideoTokens, encode_conversation
from moevlm_jax.data.config import ImageConfig, VideoConfig, load_data_config
from moevlm_jax.data.image import expand_patches, normalize_lut
from moevlm_jax.data.loader import build_loader
from moevlm_jax.data.sample import SampleProcessor
from moevlm_jax.data.tokenizer import load_tokenizer
from moevlm_jax.data.video import (
    VideoSkip,
    compact_video_patches,
    decode_video,
    frame_timestamps,
    process_video,
    resize_frames,
    sample_frame_indices,
    smart_resize,
)
from tests.data.images import jpeg_bytes
from tests.data.video_files import moving_square, write_frame_folder, write_mp4

IMG = ImageConfig(min_pixels=1024, max_pixels=16384)
VID = VideoConfig(min_pixels=4096, max_pixels=32768)


def _hf_video_processor(cfg: VideoConfig) -> Qwen3VLVideoProcessor:
    return Qwen3VLVideoProcessor(fps=cfg.fps, min_frames=cfg.min_frames, max_frames=cfg.max_frames,
                                 size={"shortest_edge": cfg.min_pixels, "longest_edge": cfg.max_pixels})


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """An mp4 of 20 frames at 10 fps and a folder of 30 PNG frames; the drawn frames of each."""
    root = tmp_path_factory.mktemp("clips")
    mp4_frames, folder_frames = moving_square(20, seed=1), moving_square(30, seed=2)
    return {"mp4": (write_mp4(root / "clip.mp4", mp4_frames, fps=10), mp4_frames),
            "folder": (write_frame_folder(root / "frames", folder_frames), folder_frames)}


@pytest.mark.parametrize(("total", "source_fps", "cfg"), [
    (20, 10.0, VideoConfig()),  # 2 s at 2 fps: 4 frames
    (3, 30.0, VideoConfig()),  # fewer frames than min_frames: all of them
    (301, 29.97, VideoConfig()),  # 10 s: 20 frames
    (3000, 25.0, VideoConfig(max_frames=16)),  # 2 min: sampled down to max_frames over the whole clip
    (90, 30.0, VideoConfig(fps=4.0, min_frames=2, max_frames=64)),
    (30, None, VideoConfig()),  # no rate (a frame folder): HF's 24 fps
])
def test_frame_indices_match_hf_sample_frames(total, source_fps, cfg):
    hf = _hf_video_processor(cfg).sample_frames(VideoMetadata(total_num_frames=total, fps=source_fps))
    ours = sample_frame_indices(total, source_fps, cfg)
    np.testing.assert_array_equal(ours, hf)
    if total == 3000:  # long clip: max_frames frames from the first to the last
        assert len(ours) == 16 and ours[0] == 0 and ours[-1] == total - 1


def test_smart_resize_matches_hf():
    rng = np.random.default_rng(0)
    cases = [(4, 48, 64, 4096, 32768), (5, 480, 640, 131072, 786432), (64, 448, 448, 4096, 25165824),
             (2, 20, 300, 4096, 32768), (768, 1080, 1920, 131072, 786432)]
    cases += [(int(rng.integers(2, 100)), int(rng.integers(16, 2000)), int(rng.integers(16, 2000)),
               int(rng.integers(1, 64)) * 1024, int(rng.integers(64, 4096)) * 1024) for _ in range(200)]
    for t, h, w, lo, hi in cases:
        assert smart_resize(t, h, w, 2, 32, lo, hi) == hf_smart_resize(t, h, w, 2, 32, lo, hi), (t, h, w, lo, hi)


def test_timestamps_match_hf():
    for indices, fps in (([0, 6, 13, 19], 10.0), ([0, 10, 19, 29, 40], 24.0), ([3], 2.0)):
        assert frame_timestamps(indices, fps, 2) == Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)


def test_mp4_decodes_hf_sampled_frames(clips):
    path, drawn = clips["mp4"]
    clip = decode_video(path, VID, IMG)
    want = _hf_video_processor(VID).sample_frames(VideoMetadata(total_num_frames=20, fps=10.0))
    np.testing.assert_array_equal(clip.indices, want)
    assert (clip.fps, clip.total) == (10.0, 20)
    with av.open(str(path)) as c:  # PyAV's own frames at those indices
        every = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    np.testing.assert_array_equal(clip.frames, np.stack([every[i] for i in want]))
    err = np.abs(clip.frames.astype(int) - drawn[want].astype(int)).mean(axis=(1, 2, 3))
    assert err.max() < 6, err  # the lossy codec stays close to what was drawn
    square_x = [int(np.argmax(f[16:32].mean(axis=(0, 2)) > 200)) for f in clip.frames]
    assert square_x == [min(2 * i, 48) for i in want]  # the square moved right with the frame index


def test_frame_folder_in_natural_order(clips):
    path, drawn = clips["folder"]
    clip = decode_video(path, VID, IMG)
    np.testing.assert_array_equal(clip.indices, [0, 10, 19, 29])  # 30 frames at HF's fallback 24 fps: 4 frames
    np.testing.assert_array_equal(clip.frames, drawn[clip.indices])  # PNG: exact, frame_10 after frame_9
    frames = [str(path / f"frame_{i + 1}.png") for i in range(30)]
    np.testing.assert_array_equal(decode_video(frames, VID, IMG).frames, clip.frames)  # a list of frame paths


@pytest.mark.parametrize("kind", ["mp4", "folder"])
@pytest.mark.parametrize("frames", [None, 5])  # the sampled clip; an odd count (padded with the last frame)
def test_patches_match_hf_patchify(clips, kind, frames):
    path, _ = clips[kind]
    clip = decode_video(path, VID, IMG)
    if frames:
        clip.frames, clip.indices = clip.frames[:1].repeat(frames, 0), clip.indices[:1].repeat(frames)
    resized = resize_frames(clip.frames, VID, IMG)
    n, h, w, _ = resized.shape
    assert (h, w) == hf_smart_resize(n, *clip.frames.shape[1:3], 2, 32, VID.min_pixels, VID.max_pixels)
    compact, grid = process_video(clip, VID, IMG)[:2]
    ours = expand_patches(compact, IMG)
    # HF: rescale + normalise (x / 255 - mean) / std, then its patchify on [1, T, C, H, W]
    x = torch.from_numpy(resized).permute(0, 3, 1, 2)[None].to(torch.float32)
    x = (x * (1 / 255) - 0.5) / 0.5
    hf = _hf_video_processor(VID)
    ref, gt, gh, gw = hf.patchify(x, patch_size=16, merge_size=2, temporal_patch_size=2)
    assert tuple(grid) == (gt, gh, gw)
    np.testing.assert_allclose(ours, ref[0].numpy(), rtol=0, atol=1e-6)
    num = hf.get_num_of_video_patches(n, *clip.frames.shape[1:3], videos_kwargs={
        "size": {"shortest_edge": VID.min_pixels, "longest_edge": VID.max_pixels}})
    assert num == len(ours) == int(np.prod(grid))
    assert (ours[:, ::512] != ours[:, 256::512]).any() or frames  # real clips: the two frames of a patch differ


def test_image_rows_beside_a_video_duplicate_their_frame():
    """A sample's image rows widened to the video row layout expand to the same values as the image path's."""
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (8, 768), dtype=np.uint8)
    wide = np.repeat(img.reshape(8, 3, 1, 256), 2, axis=2).reshape(8, -1)
    np.testing.assert_array_equal(expand_patches(wide, IMG), expand_patches(img, IMG))
    frames = rng.integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    rows, grid = compact_video_patches(frames, IMG)
    lut = normalize_lut(IMG)
    out = expand_patches(rows, IMG, lut).reshape(-1, 3, 2, 16, 16)
    # patch 0 is the top-left 16x16 of both frames, channel-major
    top_left = frames[1, :16, :16].transpose(2, 0, 1)
    np.testing.assert_array_equal(out[0, :, 1], lut[np.arange(3)[:, None, None], top_left])
    assert tuple(grid) == (1, 4, 4)


def test_prompt_matches_hf_processor(hf_tokenizer, monkeypatch):
    """Our ids for a video + image conversation equal HF's: the chat template's video wrapper replaced by
    ``Qwen3VLProcessor.replace_video_token`` (timestamps, one vision span per temporal patch) through its
    ``get_text_with_replacements``, tokenised by HF's tokenizer. The processor of both families (the auto mapping)."""
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    # the processor's argument type check looks its classes up in the video processor mapping, which without
    # torchvision holds placeholders; only that check is skipped
    monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg))
    assert PROCESSOR_MAPPING_NAMES["qwen3_5_moe"] == PROCESSOR_MAPPING_NAMES["qwen3_vl_moe"] == "Qwen3VLProcessor"
    conv = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Where does it go? Then "},
                                         {"type": "image"}, {"type": "text", "text": " and "}, {"type": "video"}]},
            {"role": "assistant", "content": "Right, then left."}]
    grids = [(2, 4, 6), (3, 2, 2)]
    meta = [VideoMetadata(total_num_frames=20, fps=10.0, frames_indices=[0, 6, 13, 19]),
            VideoMetadata(total_num_frames=300, fps=24.0, frames_indices=[0, 60, 120, 180, 240, 299])]
    proc = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(), tokenizer=hf_tokenizer,
                            video_processor=Qwen3VLVideoProcessor(), chat_template=QWEN3_VL_CHAT_TEMPLATE)
    inputs = {"video_grid_thw": torch.tensor(grids), "video_metadata": meta}
    text = proc.apply_chat_template(conv, tokenize=False)
    text = text.replace("<|image_pad|>", "<|image_pad|>" * 6)
    expanded, _ = proc.get_text_with_replacements([text], videos_replacements=[
        proc.replace_video_token(inputs, k) for k in range(2)])
    assert "<0.3 seconds><|vision_start|><|video_pad|>" in expanded[0]
    ref = hf_tokenizer(expanded[0], add_special_tokens=False)["input_ids"]
    videos = [VideoTokens(h * w // 4, tuple(frame_timestamps(m.frames_indices, m.fps))) for (_, h, w), m in
              zip(grids, meta)]
    enc = encode_conversation(conv, load_tokenizer("qwen3"), [6], videos=videos)
    assert enc.ids.tolist() == ref
    assert enc.num_videos == 2 and (enc.ids == 151656).sum() == 2 * 6 + 3 * 1
    trained_text = load_tokenizer("qwen3").decode(enc.ids[enc.trained].tolist())
    assert trained_text == "Right, then left.<|im_end|>"  # timestamps and vision tokens are never trained


def _sample_config(path, **kw):
    return {"name": "video", "source": {"kind": "llava", "path": str(path)}, "seq_len": 256, "batch_size": 2,
            "patch_buckets": [64, 128, 256], "image": {"min_pixels": 1024, "max_pixels": 16384},
            "video": {"min_pixels": 4096, "max_pixels": 32768}, "workers": 0, "read_threads": 0, "shuffle": False,
            "num_epochs": 1, "heldout_fraction": 0, **kw}


@pytest.fixture()
def video_json(tmp_path, clips):
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(64, 48, seed=1))
    (tmp_path / "clip.mp4").write_bytes(clips["mp4"][0].read_bytes())
    (tmp_path / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)  # garbage after a header
    (tmp_path / "short.mp4").write_bytes(clips["mp4"][0].read_bytes()[:600])  # truncated
    (tmp_path / "empty.mp4").write_bytes(b"")
    ask = "<video>\nWhich way does the square move?"
    entries = [
        {"conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": "Right."}], "video": "clip.mp4"},
        {"conversations": [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Noise."}],
         "image": "a.jpg"},
        {"conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": "Right."}], "video": "bad.mp4"},
        {"conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": "Right."}], "video": "short.mp4"},
        {"conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": "Right."}], "video": "empty.mp4"},
        {"conversations": [{"from": "human", "value": ask}, {"from": "gpt", "value": "Right."}], "video": "gone.mp4"},
        {"messages": [{"role": "user", "content": [{"type": "video", "video": str(clips["folder"][0])},
                                                   {"type": "text", "text": "And here?"}]},
                      {"role": "assistant", "content": "Right too."}]},
    ]
    path = tmp_path / "videos.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in entries))
    return path


def test_bad_videos_are_counted(video_json):
    proc = SampleProcessor(load_data_config(_sample_config(video_json)))
    entries = [json.loads(line) for line in video_json.read_text().splitlines()]
    reasons = [proc(k, {"llava": e, "image_root": str(video_json.parent)}).get("skip") for k, e in enumerate(entries)]
    assert reasons == [None, None, "corrupt_video", "corrupt_video", "corrupt_video", "missing_video", None]
    (video_json.parent / "no_frames").mkdir()
    with pytest.raises(VideoSkip, match="no frame images"):
        decode_video(video_json.parent / "no_frames", VID, IMG)


@pytest.mark.parametrize("balance", [False, True])
def test_video_trains_through_the_grain_pipeline(video_json, balance):
    """A LLaVA file with a video entry: the video row's patches are the sample's frames, its placeholders the
    video token, MRoPE positions the sample's; bad videos counted, never trained as text."""
    cfg = load_data_config(_sample_config(video_json, balance_vision_rows=balance))
    proc = SampleProcessor(cfg)
    entries = [json.loads(line) for line in video_json.read_text().splitlines()]
    samples = {k: proc(k, {"llava": e, "image_root": str(video_json.parent)}) for k, e in enumerate(entries)}
    with build_loader(cfg) as loader:
        batches = list(loader)
        summary = loader.summary()
    assert summary["skipped"] == {"corrupt_video": 3, "missing_video": 1}
    assert summary["videos"] == 2 and summary["images"] == 1 and summary["samples"] == 3
    assert summary["patch_fill"] > 0
    video_rows = 0
    for batch in batches:
        ids = batch["input_ids"]
        for r in range(ids.shape[0]):
            for k, index in enumerate(batch["sample_index"][r]):
                if index < 0:
                    continue
                x = samples[int(index)]
                sl = np.flatnonzero(batch["segment_ids"][r] == k + 1)
                np.testing.assert_array_equal(ids[r, sl], x["ids"])
                np.testing.assert_array_equal(batch["positions"][:, r, sl], x["positions"])
                video_rows += x["videos"]
        visual = np.isin(ids, [151655, 151656])
        valid = batch["patch_segment_ids"] > 0
        assert valid.sum() == 4 * visual.sum()  # every placeholder has its merged patch block
        if balance:  # each merged token's destination is a placeholder of the batch
            dest = batch["patch_dest"][valid][::4] + np.nonzero(valid)[0][::4] * ids.shape[1]
            assert sorted(dest.tolist()) == np.flatnonzero(visual.ravel()).tolist()
    assert video_rows == 2
    # the video sample's pixel rows are its own frames' rows (the first batch holds sample 0 in row 0)
    x = samples[0]
    row = int(np.argwhere(batches[0]["sample_index"] == 0)[0][0])
    got = batches[0]["pixel_values"][row, :len(x["patches"])] if not balance else None
    if got is not None:
        np.testing.assert_array_equal(got, expand_patches(x["patches"], cfg.image))
    assert x["grids"].tolist() == [[2, 4, 4]] and x["videos"] == 1  # 4 frames of 48x64 -> 64x64 (16384 px in all)


def test_long_clip_sampled_down_is_counted_and_too_many_patches_names_the_video(video_json, caplog):
    """``max_frames`` 2: the 2 s mp4 (4 frames at 2 fps) is sampled down to 2 frames, counted in the loader's totals
    with one log line for the run; the 30-frame folder (2 frames at 24 fps assumed) is not. A video beyond the
    largest patch bucket is a counted skip whose reason names its frames and patches and the settings to lower."""
    video = {"min_pixels": 4096, "max_pixels": 32768, "min_frames": 2, "max_frames": 2}
    cfg = load_data_config(_sample_config(video_json, video=video))
    with caplog.at_level("INFO", logger="moevlm_jax.data.loader"), build_loader(cfg) as loader:
        batches = list(loader)
        summary = loader.summary()
    assert summary["videos"] == 2 and summary["videos_sampled_down"] == 1
    assert sum(b["stats"]["videos_sampled_down"] for b in batches) == 1
    noted = [r.getMessage() for r in caplog.records if "sampled down" in r.getMessage()]
    assert noted == ["data (train): a video of 20 frames (2.0 s at 10 fps) would take 4 frames at data.video.fps 2: "
                     "sampled down to data.video.max_frames 2, spread over its whole length; such videos are counted "
                     "as videos_sampled_down"]

    small = load_data_config(_sample_config(video_json, patch_buckets=[16]))  # the 4 frames of 64x64: 32 patches
    entry = json.loads(video_json.read_text().splitlines()[0])
    skip = SampleProcessor(small)(0, {"llava": entry, "image_root": str(video_json.parent)})
    assert skip["skip"] == "too_many_patches"
    assert skip["detail"] == ("video: 4 frames (2 frame pairs x 16 patches) = 32 patches; the sample's 32 patches > "
                              "the largest patch bucket 16; lower data.video.max_frames (768) / max_pixels (32768) "
                              "or add a larger data.patch_buckets entry")
