"""python -m moevlm_jax.data.convert: LLaVA JSON and image folders -> ArrayRecord shards, with a skip summary."""

import json

from moevlm_jax.data.convert import main
from moevlm_jax.data.loader import build_loader
from moevlm_jax.data.records import decode_record
from moevlm_jax.data.sources import ArrayRecordSource


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
