"""Packed batches vs per-sample processing; MRoPE positions vs mrope_position_ids per sample."""

import numpy as np
import pytest

from moevlm_jax.data.batch import MODEL_KEYS, patch_layout
from moevlm_jax.data.config import DataError
from moevlm_jax.data.image import expand_patches
from moevlm_jax.data.loader import build_loader
from moevlm_jax.data.mrope import mrope_position_ids
from moevlm_jax.data.packing import choose_bucket
from moevlm_jax.data.sample import QUESTION_TYPES, SampleProcessor
from moevlm_jax.data.sources import build_source

SMALL = ["source.num_train=120", "source.num_heldout=40", "seq_len=512", "batch_size=4",
         "patch_buckets=[256, 512, 1024, 1536, 2048]"]


@pytest.fixture(scope="module")
def vqa_cache(tmp_path_factory):
    return f"cache_dir={tmp_path_factory.mktemp('cache')}"


def check_batch_against_samples(batch, cfg, split="train", eval_mode=False):
    source, _ = build_source(cfg, split)
    proc = SampleProcessor(cfg, eval_mode=eval_mode)
    b, s = batch["input_ids"].shape
    p = batch["pixel_values"].shape[1]
    assert p in cfg.patch_buckets and p % 4 == 0
    row_patches = []
    useful = 0
    for r in range(b):
        t = q = 0
        image_segment = 1
        for k, idx in enumerate(batch["sample_index"][r]):
            if idx < 0:
                continue
            x = proc(int(idx), source[int(idx)])
            n, length = len(x["ids"]), len(x["patches"])
            sl = slice(t, t + n)
            np.testing.assert_array_equal(batch["input_ids"][r, sl], x["ids"])
            np.testing.assert_array_equal(batch["segment_ids"][r, sl], k + 1)
            np.testing.assert_array_equal(batch["targets"][r, sl][:-1], x["ids"][1:])  # shifted within the sample
            np.testing.assert_array_equal(batch["loss_mask"][r, sl], x["loss_mask"].astype(np.float32))
            assert batch["loss_mask"][r, t + n - 1] == 0  # never predicts across samples
            pos, _ = mrope_position_ids(x["ids"], x["grids"], image_token_id=151655, spatial_merge_size=2)
            np.testing.assert_array_equal(batch["positions"][:, r, sl], pos)
            assert batch["positions"][:, r, t].tolist() == [0, 0, 0]  # restarts in each sample
            ps = slice(q, q + length)
            np.testing.assert_array_equal(batch["pixel_values"][r, ps], expand_patches(x["patches"], cfg.image))
            rc, hw, frame = patch_layout(x["grids"], 2)
            np.testing.assert_array_equal(batch["patch_rc"][r, ps], rc)
            np.testing.assert_array_equal(batch["patch_hw"][r, ps], hw)
            np.testing.assert_array_equal(batch["patch_segment_ids"][r, ps], frame + image_segment)
            # the k-th image token of the row takes the k-th merged patch group of the row
            assert (batch["input_ids"][r, sl] == 151655).sum() * 4 == length
            image_segment += len(x["grids"])
            t += n
            q += length
        assert (batch["segment_ids"][r, t:] == 0).all() and (batch["loss_mask"][r, t:] == 0).all()
        assert (batch["pixel_values"][r, q:] == 0).all() and (batch["patch_segment_ids"][r, q:] == 0).all()
        row_patches.append(q)
        useful += t
    stats = batch["stats"]
    assert p == choose_bucket(max(row_patches), cfg.patch_buckets)
    assert stats["useful_tokens"] == useful == int((batch["segment_ids"] > 0).sum())
    assert stats["trained_tokens"] == int(batch["loss_mask"].sum())
    assert stats["useful_patches"] == sum(row_patches)
    assert stats["token_fill"] == pytest.approx(useful / (b * s))
    assert stats["patch_fill"] == pytest.approx(sum(row_patches) / (b * p))
    return source, proc


def test_packed_batches_equal_per_sample_processing(vqa_cache):
    loader = build_loader("vqa", overrides=[*SMALL, vqa_cache])
    for _ in range(2):
        batch = next(loader)
        assert set(MODEL_KEYS) - {"patch_dest"} <= set(batch) and "patch_dest" not in batch  # only when balanced
        assert batch["input_ids"].shape == (4, 512) and batch["positions"].shape == (3, 4, 512)
        assert (batch["sample_index"] >= 0).sum(axis=1).min() >= 2  # rows really hold several samples
        check_batch_against_samples(batch, loader.config)


def test_eval_batches_mask_answers_only(vqa_cache):
    loader = build_loader("vqa", split="heldout", overrides=[*SMALL, vqa_cache])
    assert loader.eval_mode
    batches = list(loader)
    seen = sorted(int(i) for b in batches for i in b["sample_index"].ravel() if i >= 0)
    assert seen == list(range(40))  # one ordered epoch, every held-out sample once
    source, proc = check_batch_against_samples(batches[0], loader.config, "heldout", eval_mode=True)
    b = batches[0]
    from moevlm_jax.data.records import decode_record

    for r in range(b["input_ids"].shape[0]):
        for k, idx in enumerate(b["sample_index"][r]):
            if idx < 0:
                continue
            meta = decode_record(source[int(idx)])["meta"]
            in_sample = b["segment_ids"][r] == k + 1
            mask = b["loss_mask"][r] > 0
            answer_ids = b["targets"][r][mask & in_sample]
            assert proc.tokenizer.decode(answer_ids) == meta["answers"][0]  # exactly the answer tokens
            groups = np.unique(b["answer_group"][r][mask & in_sample])
            assert len(groups) == 1 and groups[0] > 0
            types = np.unique(b["answer_type"][r][mask & in_sample])
            assert types.tolist() == [QUESTION_TYPES.index(meta["qtypes"][0])]
        assert (b["answer_group"][r][b["loss_mask"][r] == 0] == 0).all()


def test_choose_bucket():
    assert choose_bucket(0, [8, 16]) == 0
    assert choose_bucket(1, [8, 16]) == 8
    assert choose_bucket(9, [8, 16]) == 16
    with pytest.raises(DataError):
        choose_bucket(17, [8, 16])


def test_text_only_batches_have_no_pixel_keys():
    loader = build_loader("mock_text", overrides=["seq_len=256", "batch_size=2"])
    batch = next(loader)
    assert "pixel_values" not in batch and "patch_rc" not in batch
    assert batch["stats"]["patch_slots"] == 0 and batch["stats"]["useful_tokens"] > 0


def test_balance_images_by_hand():
    from moevlm_jax.data.packing import balance_images

    # largest first onto the least-filled row: 800 -> row 0, 700 -> row 1, 600 -> row 1, 500 -> row 0
    assert balance_images([[800, 700], [600, 500]], 0) == [[(0, 0), (1, 1)], [(0, 1), (1, 0)]]
    # no row may hold more images than the group's fullest decoder row (2): row 1 may not take the last 100
    # (500 / 900 would be better), so 1000 / 400; groups of 2 rows never mix
    lay = balance_images([[900, 300], [100, 100], [50], [60]], 2)
    assert lay[:2] == [[(0, 0), (1, 1)], [(0, 1), (1, 0)]]
    assert lay[2:] == [[(2, 0)], [(3, 0)]]  # balancing would not lower the fullest row (60): kept as is
    assert all(len(h) <= 2 for h in lay)
    # identity where nothing is gained
    assert balance_images([[300], [300]], 0) == [[(0, 0)], [(1, 0)]]
    assert balance_images([[900, 100], [100, 100]], 0) == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]


def test_balanced_vision_rows_hold_each_rows_images_and_point_at_their_tokens(vqa_cache):
    """The same batches with and without balancing: decoder arrays equal; every image token of every row is fed,
    through ``patch_dest``, by the same 4 patches (pixels, rc, hw) as in the row's own vision row; no vision row
    has more images than the most a decoder row of its group had; the bucket never grows."""
    plain = build_loader("vqa", overrides=[*SMALL, vqa_cache])
    bal = build_loader("vqa", overrides=[*SMALL, vqa_cache, "balance_vision_rows=true", "balance_group=2"])
    unit, moved = 4, 0
    try:
        for _ in range(3):
            a, b = next(plain), next(bal)
            for k in ("input_ids", "positions", "segment_ids", "targets", "loss_mask", "sample_index"):
                np.testing.assert_array_equal(a[k], b[k])
            assert "patch_dest" not in a
            assert b["pixel_values"].shape[1] <= a["pixel_values"].shape[1]
            rows, s = a["input_ids"].shape
            seen = {}
            for v in range(rows):
                valid = np.flatnonzero(b["patch_segment_ids"][v] > 0)
                for q in valid[::unit]:
                    target = v * s + int(b["patch_dest"][v, q])
                    t, pos = divmod(target, s)
                    assert t // 2 == v // 2, "a token left its group of 2 rows"
                    assert (b["patch_dest"][v, q:q + unit] == b["patch_dest"][v, q]).all()
                    assert target not in seen
                    seen[target] = (v, q)
                    moved += t != v
                counts = [len(np.unique(b["patch_segment_ids"][r][b["patch_segment_ids"][r] > 0]))
                          for r in (v, v ^ 1)]
                own = [len(np.unique(a["patch_segment_ids"][r][a["patch_segment_ids"][r] > 0])) for r in (v, v ^ 1)]
                assert counts[0] <= max(own)
            for t in range(rows):
                tokens = np.flatnonzero(a["input_ids"][t] == 151655)
                for k, pos in enumerate(tokens):
                    v, q = seen[t * s + pos]
                    sl_a, sl_b = slice(k * unit, (k + 1) * unit), slice(q, q + unit)
                    for key in ("pixel_values", "patch_rc", "patch_hw"):
                        np.testing.assert_array_equal(b[key][v, sl_b], a[key][t, sl_a])
            assert len(seen) == int((a["input_ids"] == 151655).sum())
    finally:
        plain.close()
        bal.close()
    assert moved > 0  # some image did change rows
