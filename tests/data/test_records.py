"""The conversation formats users bring (LLaVA, ShareGPT / LLaMA-Factory, HF processors' ``messages``): every
media key is either trained on its images / video frames or counted as skipped (audio), never trained as text
alone."""

import json

import numpy as np
import pytest

from moevlm_jax.data.config import load_data_config
from moevlm_jax.data.convert import prepare_entry
from moevlm_jax.data.loader import build_loader
from moevlm_jax.data.records import RecordError, UnsupportedMedia, from_llava
from moevlm_jax.data.sample import SKIP_REASONS, SampleProcessor
from tests.data.images import jpeg_bytes
from tests.data.video_files import moving_square, write_mp4

QUESTION, ANSWER = "What is shown?", "A picture."


def _config(path):
    return {"name": "formats", "source": {"kind": "llava", "path": str(path)}, "seq_len": 256, "batch_size": 1,
            "patch_buckets": [64, 128, 256], "image": {"min_pixels": 1024, "max_pixels": 16384},
            "video": {"min_pixels": 4096, "max_pixels": 32768}, "workers": 0,
            "read_threads": 0, "shuffle": False, "num_epochs": 1, "heldout_fraction": 0}


def _llava(images):
    return {"conversations": [{"from": "human", "value": "<image>\n" * len(images) + QUESTION},
                              {"from": "gpt", "value": ANSWER}], "image": images if len(images) > 1 else images[0]}


def _hf_messages(images, key="image"):
    content = [{"type": "image", key: p} for p in images] + [{"type": "text", "text": QUESTION}]
    return {"messages": [{"role": "user", "content": content},
                         {"role": "assistant", "content": [{"type": "text", "text": ANSWER}]}]}


# every media key of the formats: (entry, what must happen to it)
def _entries():
    two = ["a.jpg", "b.jpg"]
    return [
        (_llava(["a.jpg"]), 1),                                                   # LLaVA "image": str
        ({**_llava(two), "image": None, "images": two}, 2),                       # "images" list
        ({"messages": [{"role": "user", "content": "<image><image>" + QUESTION},  # LLaMA-Factory messages + images
                       {"role": "assistant", "content": ANSWER}], "images": two}, 2),
        (_hf_messages(two), 2),                                                   # HF: the path inside the item
        (_hf_messages(["a.jpg"], key="path"), 1),
        (_hf_messages(["a.jpg"], key="url"), 1),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file://a.jpg"}},
                                                    {"type": "text", "text": QUESTION}]},
                       {"role": "assistant", "content": ANSWER}]}, 1),
        ({"conversations": [{"from": "human", "value": "<video>\n" + QUESTION}, {"from": "gpt", "value": ANSWER}],
          "video": "clip.mp4"}, 1),                                              # LLaVA-Video "video"
        ({"messages": [{"role": "user", "content": "<video>" + QUESTION}, {"role": "assistant", "content": ANSWER}],
          "videos": ["clip.mp4"]}, 1),                                           # LLaMA-Factory "videos"
        ({"conversations": [{"from": "human", "value": "<video>\n" + QUESTION}, {"from": "gpt", "value": ANSWER}]},
         "video_count_mismatch"),                                                 # a placeholder alone
        ({"messages": [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"},
                                                    {"type": "text", "text": QUESTION}]},
                       {"role": "assistant", "content": ANSWER}]}, 1),            # HF video item
        ({"messages": [{"role": "user", "content": [{"type": "video", "path": "clip.mp4"}, {"type": "image",
                                                    "image": "a.jpg"}, {"type": "text", "text": QUESTION}]},
                       {"role": "assistant", "content": ANSWER}]}, 2),            # video + image, by "path"
        ({"messages": [{"role": "user", "content": [{"type": "video", "url": "file://clip.mp4"}]},
                       {"role": "assistant", "content": ANSWER}]}, 1),            # by "url"
        ({"conversations": [{"from": "human", "value": "<audio>\n" + QUESTION}, {"from": "gpt", "value": ANSWER}],
          "audio": "clip.wav"}, "unsupported_media"),                            # audio: counted
        ({"messages": [{"role": "user", "content": [{"type": "audio", "audio": "clip.wav"},
                                                    {"type": "text", "text": QUESTION}]},
                       {"role": "assistant", "content": ANSWER}]}, "unsupported_media"),
        ({"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": ANSWER}],
          "audios": ["clip.wav"]}, "unsupported_media"),
    ]


@pytest.fixture()
def formats_file(tmp_path):
    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(64, 48, seed=1))
    (tmp_path / "b.jpg").write_bytes(jpeg_bytes(80, 64, seed=2))
    write_mp4(tmp_path / "clip.mp4", moving_square(8), fps=4)
    (tmp_path / "clip.wav").write_bytes(b"RIFF")
    entries = _entries()
    path = tmp_path / "formats.jsonl"
    path.write_text("\n".join(json.dumps(e) for e, _ in entries))
    return path, [want for _, want in entries]


def test_every_media_key_is_trained_or_counted(formats_file):
    path, wants = formats_file
    proc = SampleProcessor(load_data_config(_config(path)))
    root = str(path.parent)
    samples = [proc(k, {"llava": e, "image_root": root}) for k, (e, _) in enumerate(_entries())]
    for k, (sample, want) in enumerate(zip(samples, wants, strict=True)):
        if isinstance(want, str):
            assert sample.get("skip") == want, (k, sample)
        else:  # trained on each image and video it names
            assert "skip" not in sample, (k, sample)
            assert sample["grids"].shape == (want, 3), k
            assert sample["videos"] == ("video" in json.dumps(_entries()[k][0])), k
    with build_loader(_config(path)) as loader:
        seen = sorted({int(i) for batch in loader for i in batch["sample_index"].ravel() if i >= 0})
        summary = loader.summary()
    assert seen == [k for k, w in enumerate(wants) if isinstance(w, int)]
    assert summary["skipped"] == {"unsupported_media": 3, "video_count_mismatch": 1}
    assert summary["videos"] == 5
    assert summary["useful_patches"] == sum(len(s["patches"]) for s in samples if "skip" not in s)
    assert summary["samples"] + sum(summary["skipped"].values()) == len(wants)  # nothing dropped silently
    assert "unsupported_media" in SKIP_REASONS


def test_messages_forms_equal_the_llava_form(formats_file):
    """The same conversation as LLaVA, LLaMA-Factory and HF ``messages`` -> the same ids, targets and patches."""
    path, _ = formats_file
    cfg = load_data_config(_config(path))
    proc = SampleProcessor(cfg)
    root = str(path.parent)
    two = ["a.jpg", "b.jpg"]
    llava = {"conversations": [{"from": "human", "value": "<image><image>" + QUESTION},
                               {"from": "gpt", "value": ANSWER}], "image": two}
    forms = [llava, _entries()[2][0], _hf_messages(two)]
    samples = [proc(k, {"llava": e, "image_root": root}) for k, e in enumerate(forms)]
    assert not any("skip" in s for s in samples), samples
    ref = samples[0]
    assert ref["grids"].shape == (2, 3)
    for s in samples[1:]:
        for key in ("ids", "targets", "loss_mask", "positions", "patches", "grids"):
            np.testing.assert_array_equal(s[key], ref[key], err_msg=key)


def test_images_named_twice_or_partly_inline_are_bad_records():
    entry = _hf_messages(["a.jpg", "b.jpg"])
    entry["messages"][0]["content"][1] = {"type": "image"}  # one item names its file, one does not
    with pytest.raises(RecordError, match="name each image once"):
        from_llava(entry)
    entry = {**_hf_messages(["a.jpg"]), "images": ["b.jpg"]}  # inline and listed disagree
    with pytest.raises(RecordError, match="name each image once"):
        from_llava(entry)
    assert from_llava({**_hf_messages(["a.jpg"]), "images": ["a.jpg"]})[1] == ["a.jpg"]  # the same file twice: fine


def test_convert_writes_video_entries_and_counts_audio(tmp_path):
    """The ArrayRecord converter writes every form of video entry (the file's bytes in the record, as read back by
    ``decode_record``), counts a placeholder without its video and a video that cannot be decoded, and counts audio
    as ``unsupported_media``."""
    from moevlm_jax.data.config import ImageConfig
    from moevlm_jax.data.records import decode_record

    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(64, 48, seed=1))
    clip = write_mp4(tmp_path / "clip.mp4", moving_square(8), fps=4).read_bytes()
    for entry, want in _entries():
        if want == "unsupported_media" or "video" in json.dumps(entry):
            record, reason, detail = prepare_entry(entry, tmp_path, ImageConfig())
            if isinstance(want, str):
                assert (record, reason) == (None, want), detail
            else:
                assert reason is None, detail
                decoded = decode_record(record)
                assert decoded["videos"] == [clip] and len(decoded["images"]) == want - 1
    (tmp_path / "clip.mp4").write_bytes(b"\x00")
    record, reason, detail = prepare_entry(_entries()[7][0], tmp_path, ImageConfig())
    assert (record, reason) == (None, "corrupt_video") and "clip.mp4" in detail
    with pytest.raises(UnsupportedMedia):
        from_llava({"conversations": [{"from": "human", "value": "<audio> hi"}, {"from": "gpt", "value": "x"}]})


def test_read_record_roots_llava_media(tmp_path):
    """What the answers hook and the sample processor read: a JSON entry's image and video paths made absolute
    (a frame list each), a shard entry decoded; an unparsable line is a RecordError, not a crash."""
    from moevlm_jax.data.records import encode_record
    from moevlm_jax.data.sample import read_record

    entry = {"messages": [{"role": "user", "content": [{"type": "video", "video": ["f1.png", "/abs/f2.png"]},
                                                       {"type": "image", "image": "a.jpg"}]},
                          {"role": "assistant", "content": ANSWER}], "videos": None}
    record = read_record({"llava": entry, "image_root": str(tmp_path)})
    assert record["images"] == [{"path": str(tmp_path / "a.jpg")}]
    assert record["videos"] == [{"path": [str(tmp_path / "f1.png"), "/abs/f2.png"]}]
    assert read_record(encode_record(record["messages"], [b"x"]))["images"] == [b"x"]
    with pytest.raises(RecordError):
        read_record({"llava": None})


def test_record_versions_and_videos_as_frames(tmp_path):
    """Version 1 (video files only) is still written and read as before; a video stored as frames makes a version 2
    record whose frames come back in order and decode as the frame files do; malformed headers are RecordErrors."""
    import struct

    from moevlm_jax.data.config import ImageConfig, VideoConfig
    from moevlm_jax.data.records import decode_record, encode_record
    from moevlm_jax.data.video import decode_video
    from tests.data.video_files import write_frame_folder

    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "image"}, {"type": "video"}]}]
    old = json.dumps({"messages": messages, "image_sizes": [3], "meta": {}, "video_sizes": [2, 4]},
                     separators=(",", ":")).encode()
    v1 = struct.pack("<4sBI", b"MVLR", 1, len(old)) + old + b"img" + b"v1" + b"v2v2"  # as the version 1 writer did
    assert encode_record(messages, [b"img"], {}, videos=[b"v1", b"v2v2"]) == v1
    assert decode_record(v1) == {"messages": messages, "images": [b"img"], "meta": {}, "videos": [b"v1", b"v2v2"]}
    assert "videos" not in decode_record(encode_record(messages, [b"img"]))

    v2 = encode_record(messages, [b"img"], {"id": 7}, videos=[[b"f1", b"frame2", b"f"], b"file"])
    assert v2[4] == 2
    assert decode_record(v2) == {"messages": messages, "images": [b"img"], "meta": {"id": 7},
                                 "videos": [[b"f1", b"frame2", b"f"], b"file"]}
    with pytest.raises(RecordError, match="no frames"):
        encode_record(messages, [], videos=[[]])
    for bad in (v2[:-1], v2[:4] + b"\x03" + v2[5:], v1[:4] + b"\x01" + v2[5:]):  # short, unknown version, lists in v1
        with pytest.raises(RecordError):
            decode_record(bad)

    folder = write_frame_folder(tmp_path / "frames", moving_square(15))
    frames = [(folder / f"frame_{i}.png").read_bytes() for i in range(1, 16)]
    cfg, image_cfg = VideoConfig(min_pixels=4096, max_pixels=32768), ImageConfig()
    want = decode_video(folder, cfg, image_cfg)
    got = decode_video(decode_record(encode_record(messages[:1], [], videos=[frames]))["videos"][0], cfg, image_cfg)
    np.testing.assert_array_equal(got.frames, want.frames)
    np.testing.assert_array_equal(got.indices, want.indices)
    assert (got.fps, got.total) == (want.fps, want.total) == (24.0, 15)
