"""python -m moevlm_jax.data.convert: LLaVA JSON and image folders -> ArrayRecord shards, with a skip summary; videos
embedded (files as they are, frame folders / lists as their frames), the shards training exactly as the JSON."""

import json

import numpy as np
import pytest
from PIL import Image

from moevlm_jax.data.config import load_data_config
from moevlm_jax.data.convert import main
from moevlm_jax.data.loader import build_loader
from moevlm_jax.data.records import decode_record
from moevlm_jax.data.sample import SampleProcessor
from moevlm_jax.data.sources import ArrayRecordSource
from tests.data.video_files import moving_square, write_frame_folder, write_mp4


def test_convert_llava_then_load(llava_dir, tmp_path, capsys):
    path, expected, good = llava_dir
    out = tmp_path / "shards"
    assert main(["llava", str(path), "--out", str(out), "--shard-size", "4"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    at_convert = {k: v for k, v in expected.items() if k != "too_long"}  # seq_len is the loader's business
    assert summary["skipped"] == at_convert
    assert summary["written"] == len(good) + 1 and summary["entries"] == 14
    assert len(summary["shards"]) == 2  # 6 records, 4 per shard
    printed = capsys.readouterr().out
    assert "written" in printed and "corrupt_image" in printed and "e.g. missing_image" in printed
    src = ArrayRecordSource([str(out / s) for s in summary["shards"]])
    first = decode_record(src[0])
    assert first["messages"][0]["content"][0] == {"type": "image"}
    assert first["images"][0] == (path.parent / "images" / "good0.jpg").read_bytes()  # original bytes
    loader = build_loader({"source": {"kind": "arrayrecord", "paths": [str(out / "*.array_record")]},
                           "seq_len": 256, "batch_size": 2, "patch_buckets": [64, 128, 256],
                           "image": {"min_pixels": 1024, "max_pixels": 16384}, "shuffle": False, "num_epochs": 1,
                           "heldout_fraction": 0})  # every shard's sample in the train split
    seen = sum(int((b["sample_index"] >= 0).sum()) for b in loader)
    assert seen == len(good) and loader.summary()["skipped"] == {"too_long": 1}


def test_convert_image_folder(tmp_path, capsys):
    from tests.data.images import jpeg_bytes

    folder = tmp_path / "pics"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.jpg").write_bytes(jpeg_bytes(120, 90, 1))
    (folder / "sub" / "b.jpg").write_bytes(jpeg_bytes(90, 120, 2))
    (folder / "c.jpg").write_bytes(jpeg_bytes(64, 64, 3))
    (folder / "d.jpg").write_bytes(b"\xff\xd8\xff broken")
    (folder / "captions.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"file_name": "a.jpg", "text": "A noisy picture."}, {"file_name": "sub/b.jpg", "text": "Another one."},
        {"file_name": "d.jpg", "text": "Broken."}]))
    out = tmp_path / "out"
    assert main(["folder", str(folder), "--out", str(out), "--prompt", "Caption this."]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["written"] == 2 and summary["skipped"] == {"no_assistant": 1, "corrupt_image": 1}
    src = ArrayRecordSource([str(out / s) for s in summary["shards"]])
    recs = [decode_record(src[i]) for i in range(2)]
    assert sorted(r["messages"][1]["content"] for r in recs) == ["A noisy picture.", "Another one."]
    assert recs[0]["messages"][0]["content"][1] == {"type": "text", "text": "Caption this."}


def test_convert_nothing_usable_fails(tmp_path, capsys):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "<image>hi"}], "image": "no.jpg"}))
    assert main(["llava", str(path), "--out", str(tmp_path / "o")]) == 1
    assert "nothing usable" in capsys.readouterr().err


def _video_config(source):
    return {"name": "convvid", "source": source, "seq_len": 512, "batch_size": 2, "patch_buckets": [64, 128, 256],
            "image": {"min_pixels": 1024, "max_pixels": 16384}, "video": {"min_pixels": 4096, "max_pixels": 32768},
            "workers": 0, "read_threads": 0, "shuffle": False, "num_epochs": 1, "heldout_fraction": 0}


@pytest.fixture()
def video_entries(tmp_path):
    """A LLaVA / messages file with videos as files (mp4, webm, mkv), a frame folder and a frame list, an image
    beside a video, and every kind of bad video; (path, the indices of the good entries, expected skips)."""
    from tests.data.images import jpeg_bytes

    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(64, 48, seed=1))
    clip = write_mp4(tmp_path / "clip.mp4", moving_square(20, seed=1), fps=10)
    write_mp4(tmp_path / "clip.webm", moving_square(14, seed=3), fps=7, codec="libvpx")
    write_mp4(tmp_path / "clip.mkv", moving_square(9, seed=4), fps=3)
    write_frame_folder(tmp_path / "frames", moving_square(30, seed=2))  # frame_1 .. frame_30 (natural order)
    jpegs = tmp_path / "jpeg_frames"
    jpegs.mkdir()
    for i, f in enumerate(moving_square(11, seed=5)):
        Image.fromarray(f).save(jpegs / f"{i:03d}.jpg", quality=90)
    (tmp_path / "no_frames").mkdir()
    (tmp_path / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 4)  # garbage after a header
    (tmp_path / "short.mp4").write_bytes(clip.read_bytes()[:600])  # truncated
    (tmp_path / "empty.mp4").write_bytes(b"")
    ask, answer = "Which way does the square move?", "Right."

    def llava(video, image=None):
        entry = {"conversations": [{"from": "human", "value": ("<image>\n" if image else "") + "<video>\n" + ask},
                                   {"from": "gpt", "value": answer}], "video": video}
        return {**entry, "image": image} if image else entry

    def messages(video, image=None):
        content = [{"type": "video", "video": video}] + ([{"type": "image", "image": image}] if image else [])
        return {"messages": [{"role": "user", "content": [*content, {"type": "text", "text": ask}]},
                             {"role": "assistant", "content": answer}]}

    frame_list = [f"frames/frame_{i}.png" for i in range(3, 28, 2)]  # 13 frames, in the list's order
    entries = [
        llava("clip.mp4"),
        messages("frames"),                                    # a folder of frames: 24 fps assumed
        llava("gone.mp4"),                                     # missing_video
        messages(frame_list, image="a.jpg"),                   # a list of frame paths, an image after the video
        llava("clip.webm"),
        llava("bad.mp4"),                                      # corrupt_video
        llava("clip.mkv", image="a.jpg"),                      # image + video
        llava("short.mp4"),                                    # corrupt_video (truncated)
        messages(str(jpegs)),                                  # absolute folder of JPEG frames
        llava("empty.mp4"),                                    # corrupt_video (zero bytes)
        llava("no_frames"),                                    # corrupt_video (no frame images)
        llava("gone_folder/"),                                 # missing_video
        messages(["frames/frame_1.png", "frames/frame_99.png"]),  # corrupt_video (a frame missing)
        {"conversations": [{"from": "human", "value": "<audio>\n" + ask}, {"from": "gpt", "value": answer}],
         "audio": "clip.wav"},                                 # unsupported_media
    ]
    path = tmp_path / "videos.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in entries))
    expected = {"missing_video": 2, "corrupt_video": 5, "unsupported_media": 1}
    return path, [0, 1, 3, 4, 6, 8], expected


def test_convert_embeds_videos_and_shards_train_as_the_json(video_entries, tmp_path, capsys):
    """Videos written into the shards (files as they are, frame folders / lists as their frame files) give the loader
    exactly the samples and batches it builds from the JSON file itself: tokens, MRoPE positions, video patches,
    grids; bad videos are counted with their reason and an example, audio stays unsupported."""
    path, good, expected = video_entries
    root = path.parent
    cfg_file = tmp_path / "data.yaml"
    cfg_file.write_text(json.dumps(_video_config({"kind": "llava", "path": str(path)})))
    out = tmp_path / "shards"
    assert main(["llava", str(path), "--out", str(out), "--shard-size", "4", "--data-config", str(cfg_file)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["written"] == len(good) and summary["skipped"] == expected
    assert "gone.mp4" in summary["examples"]["missing_video"]
    assert "corrupt_video" in capsys.readouterr().out

    src = ArrayRecordSource([str(out / s) for s in summary["shards"]])
    assert len(src) == len(good)
    records = [decode_record(src[i]) for i in range(len(src))]
    assert records[0]["videos"] == [(root / "clip.mp4").read_bytes()]  # the file as it is, never re-encoded
    assert records[0]["images"] == [] and src[0][4] == 1  # no video as frames: still a version 1 record
    folder = [(root / "frames" / f"frame_{i}.png").read_bytes() for i in range(1, 31)]
    assert records[1]["videos"] == [folder] and src[1][4] == 2  # every frame, in natural order
    listed = [(root / f).read_bytes() for f in json.loads(path.read_text().splitlines()[3])["messages"][0][
        "content"][0]["video"]]
    assert records[2]["videos"] == [listed] and records[2]["images"] == [(root / "a.jpg").read_bytes()]
    assert records[3]["videos"] == [(root / "clip.webm").read_bytes()]
    assert records[4]["videos"] == [(root / "clip.mkv").read_bytes()] and len(records[4]["images"]) == 1
    assert len(records[5]["videos"][0]) == 11

    json_cfg = load_data_config(_video_config({"kind": "llava", "path": str(path)}))
    shard_cfg = load_data_config(_video_config({"kind": "arrayrecord", "paths": [str(out / "*.array_record")]}))
    from_json, from_shards = SampleProcessor(json_cfg), SampleProcessor(shard_cfg)
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    for k, index in enumerate(good):
        want = from_json(index, {"llava": entries[index], "image_root": str(root)})
        got = from_shards(index, src[k])
        assert "skip" not in want and "skip" not in got, (index, want.get("detail"), got.get("detail"))
        assert got["videos"] == want["videos"] == 1
        for key in ("ids", "positions", "targets", "loss_mask", "patches", "grids"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"entry {index}: {key}")

    with build_loader(json_cfg) as loader:
        json_batches = list(loader)
        json_summary = loader.summary()
    with build_loader(shard_cfg) as loader:
        shard_batches = list(loader)
        shard_summary = loader.summary()
    assert json_summary["skipped"] == expected and shard_summary["skipped"] == {}
    for key in ("samples", "videos", "images", "tokens", "useful_tokens", "trained_tokens", "useful_patches"):
        assert shard_summary[key] == json_summary[key], key
    assert shard_summary["videos"] == len(good) and shard_summary["images"] == 2
    assert len(shard_batches) == len(json_batches)
    to_shard = {index: k for k, index in enumerate(good)} | {-1: -1}
    for a, b in zip(json_batches, shard_batches, strict=True):
        assert sorted(a) == sorted(b)
        for key in a:
            if key == "sample_index":
                np.testing.assert_array_equal(np.vectorize(to_shard.get)(a[key]), b[key])
            elif key != "stats":
                np.testing.assert_array_equal(b[key], a[key], err_msg=key)


def test_convert_video_without_decode_check(video_entries, tmp_path):
    """``--no-decode-check``: files are stored unread by PyAV; missing and empty videos are still counted."""
    path, good, _ = video_entries
    out = tmp_path / "raw"
    assert main(["llava", str(path), "--out", str(out), "--no-decode-check"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["skipped"] == {"missing_video": 2, "corrupt_video": 3, "unsupported_media": 1}
    assert summary["written"] == len(good) + 2  # bad.mp4 and short.mp4 are caught by the loader instead
