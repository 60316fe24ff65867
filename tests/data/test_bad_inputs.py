"""Every kind of bad input is skipped and counted by reason; good samples still arrive."""

import json

import numpy as np
import pytest

from moevlm_jax.data.config import DataError, load_data_config
from moevlm_jax.data.loader import build_loader
from moevlm_jax.data.records import encode_record
from moevlm_jax.data.sample import SKIP_REASONS, SampleProcessor


def llava_config(path, workers=0):
    return {
        "name": "llava_test",
        "source": {"kind": "llava", "path": str(path)},
        "seq_len": 256, "batch_size": 2, "patch_buckets": [64, 128, 256],
        "image": {"min_pixels": 1024, "max_pixels": 16384},
        "workers": workers, "read_threads": 0, "shuffle": False, "num_epochs": 1,
        "heldout_fraction": 0,  # every sample in the train split (no held-out slice: data/sources.py)
    }


def run_all(loader):
    seen, per_batch = [], {}
    for batch in loader:
        seen += [int(i) for i in batch["sample_index"].ravel() if i >= 0]
        for reason, n in batch["stats"]["skipped"].items():
            per_batch[reason] = per_batch.get(reason, 0) + n
    return sorted(seen), per_batch


@pytest.mark.parametrize("workers", [0, 2])
def test_each_bad_input_is_counted_and_good_samples_arrive(llava_dir, workers):
    path, expected, good = llava_dir
    with build_loader(llava_config(path, workers)) as loader:
        seen, per_batch = run_all(loader)
        summary = loader.summary()
    assert seen == good
    assert summary["skipped"] == expected  # counts from worker processes reach the main process
    assert set(expected) <= set(SKIP_REASONS)
    # the per-batch deltas (what a progress line shows) add up to the totals
    assert per_batch == expected
    assert summary["samples"] == len(good)


def test_skip_counts_appear_in_batch_stats(llava_dir):
    path, _, _ = llava_dir
    loader = build_loader(llava_config(path))
    first = next(loader)
    assert first["stats"]["skipped_total"] == first["stats"]["skipped"]
    assert sum(first["stats"]["skipped"].values()) >= 1  # the corrupt image precedes the second good sample


def test_nothing_usable_fails_at_start(tmp_path):
    entries = [{"conversations": [{"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "x"}],
                "image": f"missing{k}.jpg"} for k in range(5)]
    entries.append({"conversations": [{"from": "human", "value": "no answer"}]})
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n{not json\n")
    with pytest.raises(DataError) as e:
        build_loader(llava_config(path))
    message = str(e.value)
    assert "no usable sample among the first 7" in message
    assert "missing_image: 5" in message and "no_assistant: 1" in message and "bad_record: 1" in message


def test_broken_array_record_entries_are_bad_records():
    cfg = load_data_config("vqa", ["seq_len=256"])
    proc = SampleProcessor(cfg)
    good = encode_record([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], [])
    assert "skip" not in proc(0, good)
    assert proc(1, good[:-3])["skip"] == "bad_record"  # truncated header JSON
    assert proc(2, b"garbage")["skip"] == "bad_record"
    assert proc(3, b"")["skip"] == "bad_record"
    assert proc(4, None)["skip"] == "bad_record"


def test_too_many_patches_is_counted():
    cfg = load_data_config("vqa", ["seq_len=4096", "patch_buckets=[64]", "image.min_pixels=1024",
                                   "image.max_pixels=1024000"])
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.zeros((320, 320, 3), np.uint8)).save(buf, format="PNG")
    rec = encode_record([{"role": "user", "content": [{"type": "image"}]}, {"role": "assistant", "content": "ok"}],
                        [buf.getvalue()])
    assert SampleProcessor(cfg)(0, rec)["skip"] == "too_many_patches"


def test_skips_after_the_last_batch_are_still_counted(tmp_path):
    from tests.data.images import jpeg_bytes

    (tmp_path / "a.jpg").write_bytes(jpeg_bytes(40, 40))
    good = {"conversations": [{"from": "human", "value": "<image>Hi?"}, {"from": "gpt", "value": "Yes."}],
            "image": "a.jpg"}
    bad = dict(good, image="gone.jpg")
    path = tmp_path / "d.json"
    path.write_text(json.dumps([good, bad, bad, bad]))
    cfg = {**llava_config(path), "seq_len": 32, "batch_size": 1, "patch_buckets": [4, 8],
           "image": {"min_pixels": 1024, "max_pixels": 1024}}
    loader = build_loader(cfg)
    batches = list(loader)
    assert len(batches) == 1 and batches[0]["stats"]["skipped"] == {}  # the row filled before the bad ones
    assert loader.summary()["skipped"] == {"missing_image": 3}  # counted through the trailing empty marker
