"""Packing samples into fixed-shape batches, and the grain iterator that does it with exact resume.

A batch has ``B`` rows of ``S`` tokens and ``P`` patch slots; ``P`` is the smallest configured
bucket that holds the fullest row, so the step compiles once per bucket. Samples go first-fit into
the first row with room for both their tokens and their patches; a sample that fits nowhere waits
(up to ``pack_lookahead`` of them) and starts the next batch. Positions, targets and loss masks
come from per-sample processing, so attention and MRoPE never cross samples (``segment_ids``) and
vision attention never crosses images (``patch_segment_ids``).

Resume: the iterator state is the parent's state before the oldest waiting sample plus the read
offsets of the waiting samples; ``set_state`` re-reads from there and keeps exactly those, so a
restored iterator produces the batches the original would have.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from moevlm_jax.data.batch import patch_layout
from moevlm_jax.data.config import DataConfig, DataError
from moevlm_jax.data.image import expand_patches, normalize_lut
from moevlm_jax.data.sample import is_skip

EVAL_KEYS = ("answer_group", "answer_type")


class _Rows:
    """Occupancy of the rows of the batch being built."""

    def __init__(self, rows: int, seq_len: int, max_patches: int):
        self.seq_len, self.max_patches = seq_len, max_patches
        self.tokens = [0] * rows
        self.patches = [0] * rows
        self.samples: list[list[dict[str, Any]]] = [[] for _ in range(rows)]

    def place(self, sample: dict[str, Any]) -> bool:
        length, n = len(sample["ids"]), len(sample["patches"])
        for r in range(len(self.tokens)):
            if self.tokens[r] + length <= self.seq_len and self.patches[r] + n <= self.max_patches:
                self.tokens[r] += length
                self.patches[r] += n
                self.samples[r].append(sample)
                return True
        return False

    def full(self, min_length: int) -> bool:
        return all(self.seq_len - t < min_length for t in self.tokens)

    @property
    def count(self) -> int:
        return sum(len(s) for s in self.samples)


def choose_bucket(patches: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= patches (0 when there are no patches)."""
    if patches == 0:
        return 0
    for b in buckets:
        if b >= patches:
            return int(b)
    raise DataError(f"{patches} patches exceed the largest bucket {max(buckets)}")


def image_patch_counts(sample: dict[str, Any]) -> list[int]:
    """Patches of each image (frame group) of a processed sample, in order."""
    grids = np.asarray(sample.get("grids", np.zeros((0, 3))), np.int64).reshape(-1, 3)
    return [int(n) for n in grids.prod(axis=1)]


def balance_images(counts: Sequence[Sequence[int]], group: int) -> list[list[tuple[int, int]]]:
    """Images over vision rows: ``counts[r]`` the patch counts of decoder row r's images, in order -> per vision
    row the ``(decoder row, image)`` pairs it holds, in order. Within each group of ``group`` consecutive rows
    (0: all), largest image first onto the least-filled vision row of the group that holds fewer images than the
    group's fullest decoder row (so no vision row has more attention segments than some decoder row had); ties
    to the lower row. Kept only where it lowers the group's fullest row (else each row keeps its own images)."""
    rows = len(counts)
    group = rows if group <= 0 else group
    out: list[list[tuple[int, int]]] = [[(r, j) for j in range(len(c))] for r, c in enumerate(counts)]
    for g0 in range(0, rows, group):
        members = range(g0, min(g0 + group, rows))
        cap = max((len(counts[r]) for r in members), default=0)
        images = sorted(((counts[r][j], r, j) for r in members for j in range(len(counts[r]))),
                        key=lambda t: (-t[0], t[1], t[2]))
        fill = {r: 0 for r in members}
        held: dict[int, list[tuple[int, int]]] = {r: [] for r in members}
        for n, r, j in images:
            row = min((v for v in members if len(held[v]) < cap), key=lambda v: (fill[v], v))
            fill[row] += n
            held[row].append((r, j))
        if max(fill.values(), default=0) < max((sum(counts[r]) for r in members), default=0):
            for r in members:
                out[r] = held[r]
    return out


def assemble_batch(rows: Sequence[Sequence[dict[str, Any]]], cfg: DataConfig, *, pad_id: int,
                   eval_mode: bool = False, lut: np.ndarray | None = None, visual_ids: Sequence[int] = ()
                   ) -> dict[str, Any]:
    """Samples per row -> the batch dict of ARCHITECTURE.md (input_ids [B, S], pixel_values [B, P, 1536], ...).

    With ``cfg.balance_vision_rows`` the images are balanced over the vision rows of each ``cfg.balance_group``
    rows (:func:`balance_images`) and ``patch_dest [B, P]`` says, per patch, where its merged token goes in the
    decoder: ``(decoder row - vision row) * S + position`` (``visual_ids``, the image and video placeholder tokens,
    find the positions). A video moves between vision rows as one item (all its frames), as an image does."""
    img = cfg.image
    lut = normalize_lut(img) if lut is None else lut
    b, s = len(rows), cfg.seq_len
    unit = img.merge_size**2
    counts = [[n for x in row for n in image_patch_counts(x)] for row in rows]
    balance = cfg.balance_vision_rows and any(counts)
    if balance and not visual_ids:
        raise ValueError("assemble_batch: balance_vision_rows needs the image / video placeholders' token ids "
                         "(visual_ids)")
    layout = balance_images(counts, cfg.balance_group) if balance else [[(r, j) for j in range(len(c))]
                                                                        for r, c in enumerate(counts)]
    row_patches = [sum(counts[r][j] for r, j in held) for held in layout]
    p = choose_bucket(max(row_patches, default=0), cfg.patch_buckets)
    out: dict[str, Any] = {
        "input_ids": np.full((b, s), pad_id, np.int32),
        "positions": np.zeros((3, b, s), np.int32),
        "segment_ids": np.zeros((b, s), np.int32),
        "targets": np.full((b, s), pad_id, np.int32),
        "loss_mask": np.zeros((b, s), np.float32),
    }
    if eval_mode:
        out["answer_group"] = np.zeros((b, s), np.int32)
        out["answer_type"] = np.full((b, s), -1, np.int32)
    if p:
        out["pixel_values"] = np.zeros((b, p, img.patch_dim), np.float32)
        out["patch_rc"] = np.zeros((b, p, 2), np.int32)
        out["patch_hw"] = np.zeros((b, p, 2), np.int32)  # padding rows: all zeros, as the model's hf_inputs_to_batch
        out["patch_segment_ids"] = np.zeros((b, p), np.int32)
        if balance:
            out["patch_dest"] = np.zeros((b, p), np.int32)
    sample_index = np.full((b, max((len(r) for r in rows), default=0)), -1, np.int64)
    images = videos = down = 0
    note = None
    # per decoder row, per image (in order): (its patches, its grid, where its tokens sit in the row)
    row_images: list[list[tuple[np.ndarray, np.ndarray, np.ndarray | None]]] = []
    for r, row in enumerate(rows):
        t = 0
        answers = 0
        mine = []
        for k, x in enumerate(row):
            length = len(x["ids"])
            sl = slice(t, t + length)
            out["input_ids"][r, sl] = x["ids"]
            out["positions"][:, r, sl] = x["positions"]
            out["segment_ids"][r, sl] = k + 1
            out["targets"][r, sl] = x["targets"]
            out["loss_mask"][r, sl] = x["loss_mask"]
            if eval_mode:
                a = x["answer"].astype(np.int32)
                out["answer_group"][r, sl] = np.where(a > 0, a + answers, 0)
                out["answer_type"][r, sl] = x["answer_type"]
                answers += int(a.max(initial=0))
            sizes = image_patch_counts(x)
            if sizes:
                grids = np.asarray(x["grids"], np.int64).reshape(-1, 3)
                tokens = t + np.flatnonzero(np.isin(np.asarray(x["ids"]), visual_ids)) if balance else None
                q = tok = 0
                for grid, n in zip(grids, sizes):
                    mine.append((x["patches"][q:q + n], grid, None if tokens is None else tokens[tok:tok + n // unit]))
                    q, tok = q + n, tok + n // unit
                images += len(sizes) - int(x.get("videos", 0))
                videos += int(x.get("videos", 0))
                down += int(x.get("sampled_down", 0))
                note = note or x.get("sampled_down_note")
            sample_index[r, k] = x["index"]
            t += length
        row_images.append(mine)
    for v, held in enumerate(layout):
        q = 0
        segment = 1
        for r, j in held:
            patches, grid, tokens = row_images[r][j]
            n = len(patches)
            ps = slice(q, q + n)
            expand_patches(patches, img, lut, out=out["pixel_values"][v, ps])
            rc, hw, frame = patch_layout(grid[None], img.merge_size)  # the model's helper, HF patch order
            out["patch_rc"][v, ps] = rc
            out["patch_hw"][v, ps] = hw
            out["patch_segment_ids"][v, ps] = frame + segment  # one id per image frame, 1.. in the row
            segment += int(frame[-1]) + 1
            if tokens is not None:
                if len(tokens) * unit != n:
                    raise ValueError(f"row {r}: image {j} has {n} patches but {len(tokens)} image tokens")
                out["patch_dest"][v, ps] = np.repeat((r - v) * s + tokens, unit)
            q += n
    useful = int((out["segment_ids"] > 0).sum())
    useful_patches = int(sum(row_patches))
    out["sample_index"] = sample_index
    out["stats"] = {
        "rows": b,
        "samples": int(sum(len(r) for r in rows)),
        "images": images,
        "videos": videos,
        "videos_sampled_down": down,
        "tokens": b * s,
        "useful_tokens": useful,
        "trained_tokens": int(out["loss_mask"].sum()),
        "patch_slots": b * p,
        "useful_patches": useful_patches,
        "token_fill": useful / (b * s),
        "patch_fill": useful_patches / (b * p) if p else 0.0,
        "patch_bucket": p,
    }
    if note:
        out["stats"]["sampled_down_note"] = note  # the first video sampled down to max_frames
    return out


class PackedBatchDataset(grain.IterDataset):
    """grain ``IterDataset``: processed samples/skips -> packed batches (+ per-batch skip counts)."""

    def __init__(self, parent: grain.IterDataset, cfg: DataConfig, *, pad_id: int, eval_mode: bool = False,
                 visual_ids: Sequence[int] = ()):
        super().__init__(parent)
        self._cfg, self._pad_id, self._eval, self._visual_ids = cfg, pad_id, eval_mode, tuple(visual_ids)

    def __iter__(self) -> grain.DatasetIterator:
        return _PackedBatchIterator(self._parent.__iter__(), self._cfg, self._pad_id, self._eval, self._visual_ids)

    def __str__(self) -> str:
        return f"PackedBatchDataset(rows={self._cfg.batch_size}, seq_len={self._cfg.seq_len})"


class _PackedBatchIterator(grain.DatasetIterator):
    def __init__(self, parent: grain.DatasetIterator, cfg: DataConfig, pad_id: int, eval_mode: bool,
                 visual_ids: Sequence[int] = ()):
        super().__init__(parent)
        self._cfg, self._pad_id, self._eval, self._visual_ids = cfg, pad_id, eval_mode, visual_ids
        self._lut = normalize_lut(cfg.image)
        self._reads = 0  # samples read from the parent since the anchor
        self._anchor = parent.get_state()
        self._pending: list[tuple[int, Any, dict[str, Any]]] = []  # (read offset, state before, sample)
        self._skips: collections.Counter = collections.Counter()
        self._consecutive_skips = 0
        self._min_length = cfg.seq_len
        self._exhausted = False

    def _read(self) -> tuple[int, Any, dict[str, Any]]:
        before = self._parent.get_state()
        sample = next(self._parent)
        offset = self._reads
        self._reads += 1
        return offset, before, sample

    def _count_skip(self, sample: dict[str, Any]) -> None:
        self._skips[sample["skip"]] += 1
        self._consecutive_skips += 1
        if self._consecutive_skips > self._cfg.max_consecutive_skips:
            raise DataError(f"{self._consecutive_skips} samples in a row were unusable; skip counts since the last "
                            f"batch: {dict(self._skips)}")

    def __next__(self) -> dict[str, Any]:
        cfg = self._cfg
        rows = _Rows(cfg.batch_size, cfg.seq_len, cfg.max_patches)
        waiting = []
        for item in self._pending:
            if not rows.place(item[2]):
                waiting.append(item)
        self._pending = waiting
        while not self._exhausted and len(self._pending) < cfg.pack_lookahead:
            if rows.count and rows.full(self._min_length):
                break
            try:
                item = self._read()
            except StopIteration:
                self._exhausted = True
                break
            sample = item[2]
            if is_skip(sample):
                self._count_skip(sample)
                continue
            self._consecutive_skips = 0
            self._min_length = min(self._min_length, len(sample["ids"]))
            if not rows.place(sample):
                self._pending.append(item)
        skipped = dict(self._skips)
        self._skips.clear()
        if self._pending:  # re-anchor at the oldest waiting sample
            base = self._pending[0][0]
            self._anchor = self._pending[0][1]
            self._pending = [(off - base, st, smp) for off, st, smp in self._pending]
            self._reads -= base
        else:
            self._anchor = self._parent.get_state()
            self._reads = 0
        if rows.count == 0:
            if skipped:  # counts must not vanish: an empty marker the loader absorbs
                return {"stats": {"empty": True, "skipped": skipped}}
            raise StopIteration
        batch = assemble_batch(rows.samples, cfg, pad_id=self._pad_id, eval_mode=self._eval, lut=self._lut,
                               visual_ids=self._visual_ids)
        batch["stats"]["skipped"] = skipped
        return batch

    def get_state(self) -> dict[str, Any]:
        return {"anchor": self._anchor, "reads": self._reads,
                "pending": [off for off, _, _ in self._pending], "exhausted": self._exhausted,
                "min_length": self._min_length}

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state["anchor"])
        self._anchor = state["anchor"]
        keep = set(state["pending"])
        self._reads = 0
        self._pending = []
        self._skips.clear()
        self._consecutive_skips = 0
        self._exhausted = False
        for _ in range(state["reads"]):
            try:
                offset, before, sample = self._read()
            except StopIteration:
                raise DataError("iterator state does not match the data: the source ended during restore") from None
            if offset in keep:
                self._pending.append((offset, before, sample))
        self._exhausted = bool(state["exhausted"])
        self._min_length = int(state["min_length"])
