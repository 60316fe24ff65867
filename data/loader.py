"""The loader: ``build_loader(config, ...)`` -> an iterator of packed batches with checkpointable state.

Pipeline (grain)::

    MapDataset.range(len(source)) -> shuffle(seed) -> repeat(epochs) -> [shard::num_shards]
    -> map(read + SampleProcessor)        # per sample: decode, resize, patches, chat template, MRoPE
    -> to_iter_dataset(read_threads)      # threads per worker
    -> PackedBatchDataset                 # first-fit packing into [B, S] rows + patch bucket
    -> mp_prefetch(workers)               # worker processes, shared-memory batches

The data is split into a fixed number of logical shards (by default one per process of the run's
first start); each shard is its own pipeline (a stream) and a process reads its contiguous share of
them, so a run's global batches do not depend on how many processes read them (``Loader``). Each
grain worker packs whole batches from its slice of a shard's samples, so everything costly runs in
the workers; the main process only sums statistics. Skip counts travel with the batches:
a worker puts the skips it met while building a batch into that batch's ``stats["skipped"]`` (an
empty marker batch carries them when no sample is left), and the ``Loader`` adds them into run
totals (``stats["skipped_total"]``, ``summary()``) that are part of its saved state, so a resumed run
continues the counts. Order is deterministic for a (seed, number of shards, workers) triple; a
restored state must come from the same triple.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from collections.abc import Mapping
from typing import Any, Self

import grain
import numpy as np

from moevlm_jax.data.batch import MODEL_KEYS
from moevlm_jax.data.config import DataConfig, DataError, load_data_config
from moevlm_jax.data.packing import EVAL_KEYS, PackedBatchDataset
from moevlm_jax.data.sample import SKIP_REASONS, SampleProcessor, is_skip
from moevlm_jax.data.sources import build_source

log = logging.getLogger(__name__)
STATE_VERSION = 2  # 2: logical data shards (streams)
HOST_KEYS = ("stats", "sample_index", *EVAL_KEYS)
_TOTAL_KEYS = ("samples", "images", "videos", "videos_sampled_down", "tokens", "useful_tokens", "trained_tokens",
               "patch_slots", "useful_patches")


class _Read:
    """grain map: source index -> processed sample (or skip marker)."""

    def __init__(self, source: Any, processor: SampleProcessor):
        self.source, self.processor = source, processor

    def __call__(self, index: int) -> dict[str, Any]:
        try:
            raw = self.source[int(index)]
        except Exception as e:  # noqa: BLE001 - an unreadable entry is a counted skip
            return {"skip": "bad_record", "index": int(index), "detail": f"{type(e).__name__}: {e}"}
        return self.processor(int(index), raw)


def model_inputs(batch: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The arrays the model consumes (drops host-only keys such as ``stats``)."""
    return {k: batch[k] for k in MODEL_KEYS if k in batch}


def throughput_line(summary: Mapping[str, Any], seconds: float) -> str:
    """One log line of input throughput (samples/s, useful tokens/s, patches/s); mock runs say so first."""
    s = max(seconds, 1e-9)
    prefix = f"[{summary.get('source', '?')}] " if summary.get("mock") else ""
    return (f"{prefix}{summary.get('samples', 0) / s:.1f} samples/s, {summary.get('useful_tokens', 0) / s:,.0f} "
            f"useful tokens/s, {summary.get('useful_patches', 0) / s:,.0f} patches/s, token fill "
            f"{summary.get('token_fill', 0):.1%}, patch fill {summary.get('patch_fill', 0):.1%}, skipped "
            f"{sum(summary.get('skipped', {}).values())}")


class _Stream:
    """One grain pipeline: logical data shard ``shard`` of ``num_shards``, its iterator and run totals."""

    def __init__(self, shard: int, dataset: grain.IterDataset):
        self.shard, self.dataset = shard, dataset
        self.it: grain.DatasetIterator | None = None
        self.totals: dict[str, int] = dict.fromkeys(_TOTAL_KEYS, 0)
        self.skipped: collections.Counter = collections.Counter()
        self.batches = 0

    def iterator(self) -> grain.DatasetIterator:
        if self.it is None:
            self.it = iter(self.dataset)
        return self.it

    def next(self, label: str, workers: int) -> dict[str, Any]:
        """The stream's next real batch (skip-only marker batches absorbed into its counts)."""
        it = self.iterator()
        while True:
            try:
                batch = next(it)
            except StopIteration:
                raise
            except Exception as e:  # a worker that crashed or raised: stop the run with its error, not a hang
                detail = str(e).strip().splitlines()[0][:500] if str(e).strip() else ""
                raise DataError(f"the data pipeline ({label}, shard {self.shard}, {workers} workers) failed: "
                                f"{type(e).__name__}: {detail}") from e
            stats = batch["stats"]
            self.skipped.update(stats.get("skipped", {}))
            if stats.get("empty"):
                continue
            self.batches += 1
            for k in _TOTAL_KEYS:
                self.totals[k] += int(stats.get(k, 0))
            return batch

    def get_state(self) -> dict[str, Any]:
        return {"grain": self.iterator().get_state(), "batches": self.batches, "totals": dict(self.totals),
                "skipped": dict(self.skipped)}

    def set_state(self, state: Mapping[str, Any]) -> None:
        self.iterator().set_state(state["grain"])
        self.batches = int(state["batches"])
        self.totals = {k: int(state["totals"].get(k, 0)) for k in _TOTAL_KEYS}  # "videos": absent in older states
        self.skipped = collections.Counter(state["skipped"])

    def close(self) -> None:
        if self.it is not None and hasattr(self.it, "close"):
            self.it.close()
        self.it = None


def merge_batches(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Batches of several streams -> one batch of all their rows, in order (patch arrays padded to the
    largest patch bucket, ``sample_index`` to the most samples a row; the statistics summed)."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for key in parts[0]:
        if key == "stats":
            continue
        arrays = [np.asarray(b[key]) for b in parts]
        axis = 1 if key == "positions" else 0
        if arrays[0].ndim >= 2 and len({a.shape[axis + 1] for a in arrays}) > 1:  # patch slots / samples a row
            width = max(a.shape[axis + 1] for a in arrays)
            fill = -1 if key == "sample_index" else 0
            arrays = [np.pad(a, [(0, 0)] * (axis + 1) + [(0, width - a.shape[axis + 1])] + [(0,
                                                                                             0)] * (a.ndim - axis - 2),
                             constant_values=fill) for a in arrays]
        out[key] = np.concatenate(arrays, axis=axis)
    summed = ("rows", "samples", "images", "videos", "videos_sampled_down", "tokens", "useful_tokens",
              "trained_tokens", "useful_patches")
    stats = {k: sum(b["stats"].get(k, 0) for b in parts) for k in summed}
    notes = [b["stats"]["sampled_down_note"] for b in parts if "sampled_down_note" in b["stats"]]
    if notes:
        stats["sampled_down_note"] = notes[0]
    stats["patch_bucket"] = max(b["stats"].get("patch_bucket", 0) for b in parts)
    stats["patch_slots"] = stats["rows"] * stats["patch_bucket"]
    stats["token_fill"] = stats["useful_tokens"] / stats["tokens"] if stats["tokens"] else 0.0
    stats["patch_fill"] = stats["useful_patches"] / stats["patch_slots"] if stats["patch_slots"] else 0.0
    skipped: collections.Counter = collections.Counter()
    for b in parts:
        skipped.update(b["stats"].get("skipped", {}))
    stats["skipped"] = dict(skipped)
    out["stats"] = stats
    return out


class Loader:
    """Iterator of packed batches; ``get_state``/``set_state`` for checkpoints, ``summary`` for the run log.

    The data is split into ``num_shards`` logical shards (streams), fixed for a run: a process reads
    its contiguous share of them and its rows are their batches in shard order, so the global batch
    (processes' rows in process order) is the same however many processes read it -- a run checkpointed
    by N processes resumes in M (M dividing the shards) on the same batches."""

    def __init__(self, cfg: DataConfig, streams: list[_Stream], *, label: str, split: str, eval_mode: bool,
                 num_shards: int, source_len: int):
        self.config, self.label, self.split, self.eval_mode = cfg, label, split, eval_mode
        self.num_shards, self.source_len = num_shards, source_len
        self.is_mock = cfg.is_mock
        self._streams = streams
        self._skipped: collections.Counter = collections.Counter()
        self._noted_sampled_down = False

    @property
    def shards(self) -> list[int]:
        """The logical data shards this loader reads."""
        return [s.shard for s in self._streams]

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, Any]:
        batch = merge_batches([s.next(self.label, self.config.workers) for s in self._streams])
        stats = batch["stats"]
        stats["skipped_total"] = dict(self._total_skipped())
        stats["source"] = self.label
        stats["mock"] = self.is_mock
        stats["batch"] = self._streams[0].batches
        if "sampled_down_note" in stats and not self._noted_sampled_down:  # once a run: the count is in the totals
            self._noted_sampled_down = True
            log.info("data (%s): %s; such videos are counted as videos_sampled_down", self.split,
                     stats["sampled_down_note"])
        return batch

    def _total_skipped(self) -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for s in self._streams:
            out.update(s.skipped)
        return out

    def summary(self) -> dict[str, Any]:
        """Run totals so far of this loader's shards: samples, tokens, useful/trained tokens, patches, fill
        fractions, skips by reason (``merge_summaries`` joins the processes')."""
        t = {k: sum(s.totals[k] for s in self._streams) for k in _TOTAL_KEYS}
        return _summary(self.label, self.is_mock, self._streams[0].batches, t, self._total_skipped())

    def _header(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "fingerprint": self.config.fingerprint(), "split": self.split,
                "num_shards": self.num_shards, "shard_rows": self.config.batch_size // len(self._streams),
                "workers": self.config.workers}

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state of this loader's shards (``merge_states`` joins the processes')."""
        return {**self._header(), "streams": {str(s.shard): s.get_state() for s in self._streams},
                "batches": self._streams[0].batches}

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore a state from ``get_state`` / ``merge_states`` (same config, shards and workers; any
        process count that divides the shards)."""
        diff = {k: (state.get(k), v) for k, v in self._header().items() if state.get(k) != v}
        if diff:
            raise DataError(f"data iterator state does not match this loader (saved, now): {diff}")
        missing = [s.shard for s in self._streams if str(s.shard) not in state["streams"]]
        if missing:
            raise DataError(f"data iterator state has no entry for shards {missing} (it holds "
                            f"{sorted(state['streams'], key=int)})")
        for s in self._streams:
            s.set_state(state["streams"][str(s.shard)])

    def close(self) -> None:
        """Stop worker processes."""
        for s in self._streams:
            s.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _summary(label: str, mock: bool, batches: int, t: Mapping[str, int], skipped: Mapping[str, int]
             ) -> dict[str, Any]:
    return {
        "source": label, "mock": mock, "batches": batches, **t,
        "token_fill": t["useful_tokens"] / t["tokens"] if t["tokens"] else 0.0,
        "token_padding": 1 - t["useful_tokens"] / t["tokens"] if t["tokens"] else 0.0,
        "patch_fill": t["useful_patches"] / t["patch_slots"] if t["patch_slots"] else 0.0,
        "patch_padding": 1 - t["useful_patches"] / t["patch_slots"] if t["patch_slots"] else 0.0,
        "skipped": dict(skipped),
    }


def merge_summaries(summaries: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The processes' ``summary()`` results -> the run's: totals and skips summed, fills of the sums (the
    batches are steps, the same in every process)."""
    t = {k: sum(int(s[k]) for s in summaries) for k in _TOTAL_KEYS}
    skipped: collections.Counter = collections.Counter()
    for s in summaries:
        skipped.update(s["skipped"])
    first = summaries[0]
    return _summary(first["source"], first["mock"], first["batches"], t, skipped)


def merge_states(states: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The processes' ``get_state()`` results -> one state holding every shard (what a checkpoint keeps)."""
    out = {k: v for k, v in states[0].items() if k != "streams"}
    out["streams"] = {sid: st for s in states for sid, st in s["streams"].items()}
    return out


def _probe(source: Any, indices: grain.MapDataset, processor: SampleProcessor, limit: int) -> None:
    counts: collections.Counter = collections.Counter()
    details: dict[str, str] = {}
    for j in range(min(limit, len(indices))):
        idx = int(indices[j])
        sample = _Read(source, processor)(idx)
        if not is_skip(sample):
            if counts:
                log.warning("data probe: %d unusable samples before the first usable one: %s", sum(counts.values()),
                            dict(counts))
            return
        counts[sample["skip"]] += 1
        details.setdefault(sample["skip"], f"sample {idx}: {sample.get('detail', '')}")
    lines = "\n".join(f"  {reason}: {n} ({SKIP_REASONS.get(reason, '')}); e.g. {details[reason]}"
                      for reason, n in counts.most_common())
    raise DataError(f"no usable sample among the first {sum(counts.values())} of this shard; skipped:\n{lines}")


def build_loader(
    config: DataConfig | str | Mapping[str, Any] | None = None,
    *,
    batch_size: int | None = None,
    seq_len: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    num_shards: int | None = None,
    seed: int | None = None,
    split: str = "train",
    eval_mode: bool | None = None,
    num_epochs: int | str | None = "config",
    workers: int | None = None,
    overrides: tuple[str, ...] | list[str] = (),
) -> Loader:
    """Packed-batch loader for one process (``shard_index`` of ``shard_count``): ``batch_size`` rows [B, S]
    per step. The data is split into ``num_shards`` logical shards (default: one per process); the
    process reads shards ``shard_index * k .. + k - 1`` (k = num_shards / shard_count), each giving
    ``batch_size / k`` rows, in that order.

    ``config``: a ``DataConfig``, a preset name (``vqa``, ``photos``, ``mock``, ``proxy``...), a YAML
    path or a mapping. Keyword arguments override the config. ``split="heldout"`` defaults to eval
    mode (loss mask on answer tokens only, ``answer_group``/``answer_type`` keys, one epoch, no
    shuffle). Raises ``DataError`` at once when a shard has no usable sample.
    """
    cfg = load_data_config(config, list(overrides))
    eval_mode = (split != "train") if eval_mode is None else eval_mode
    changes: dict[str, Any] = {}
    for key, value in (("batch_size", batch_size), ("seq_len", seq_len), ("seed", seed), ("workers", workers)):
        if value is not None:
            changes[key] = value
    if num_epochs != "config":
        changes["num_epochs"] = num_epochs
    elif eval_mode:
        changes["num_epochs"] = 1
    if eval_mode:
        changes["shuffle"] = False
    cfg = dataclasses.replace(cfg, **changes)
    if not 0 <= shard_index < shard_count:
        raise DataError(f"shard_index {shard_index} must be in [0, {shard_count})")
    num_shards = num_shards or cfg.num_shards or shard_count
    if num_shards % shard_count or cfg.batch_size % (num_shards // shard_count):
        raise DataError(f"{num_shards} data shards do not divide over {shard_count} processes with {cfg.batch_size} "
                        f"rows each (the shard count is the process count the run started with; resume with a "
                        f"process count that divides it)")
    per = num_shards // shard_count
    source, label = build_source(cfg, cfg.eval_split if split == "heldout" else split)
    n = len(source)
    if n == 0:
        raise DataError(f"data source {label} ({split}) is empty")
    # images balance over the vision rows of groups inside one stream's rows (a group of the run's rows that a
    # stream boundary cuts is cut to the largest size that nests in both; 0, every row: the stream's rows)
    stream_rows = cfg.batch_size // per
    stream_cfg = dataclasses.replace(cfg, batch_size=stream_rows,
                                     balance_group=math.gcd(cfg.balance_group, stream_rows))
    processor = SampleProcessor(stream_cfg, eval_mode=eval_mode)
    streams = []
    for shard in range(shard_index * per, (shard_index + 1) * per):
        indices = grain.MapDataset.range(n)
        if cfg.shuffle:
            indices = indices.shuffle(seed=cfg.seed)
        indices = indices.repeat(cfg.num_epochs)[shard::num_shards]
        _probe(source, indices, processor, cfg.probe_samples)
        samples = indices.map(_Read(source, processor)).to_iter_dataset(
            grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=cfg.read_buffer))
        dataset: grain.IterDataset = PackedBatchDataset(samples, stream_cfg, pad_id=processor.tokenizer.pad_id,
                                                        eval_mode=eval_mode,
                                                        visual_ids=[processor.tokenizer.special_id(t) for t in
                                                                    ("<|image_pad|>", "<|video_pad|>")])
        if cfg.workers > 0:
            _absl_flags_parsed()
            dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.workers,
                                                                       per_worker_buffer_size=cfg.worker_buffer))
        streams.append(_Stream(shard, dataset))
    log.info("data: %s, split %s, %d source samples, shards %s of %d, %d rows x %d tokens, buckets %s, %d workers",
             label, split, n, [s.shard for s in streams], num_shards, cfg.batch_size, cfg.seq_len,
             list(cfg.patch_buckets), cfg.workers)
    if cfg.is_mock:
        log.warning("%s", label)
    return Loader(cfg, streams, label=label, split=split, eval_mode=eval_mode, num_shards=num_shards, source_len=n)


def _absl_flags_parsed() -> None:
    """grain's multiprocessing reads absl flags (its profiler flag, once jax is imported); in a program that
    does not run absl.app, mark them parsed so that they read as their defaults."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
