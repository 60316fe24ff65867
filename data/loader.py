"""The loader: ``build_loader(config, ...)`` -> an iterator of packed batches with checkpointable state.

Pipeline (grain)::

    MapDataset.range(len(source)) -> shuffle(seed) -> repeat(epochs) -> [shard_index::shard_count]
    -> map(read + SampleProcessor)        # per sample: decode, resize, patches, chat template, MRoPE
    -> to_iter_dataset(read_threads)      # threads per worker
    -> PackedBatchDataset                 # first-fit packing into [B, S] rows + patch bucket
    -> mp_prefetch(workers)               # worker processes, shared-memory batches

Each grain worker packs whole batches from its slice of the host's samples, so everything costly
runs in the workers; the main process only sums statistics. Skip counts travel with the batches:
a worker puts the skips it met while building a batch into that batch's ``stats["skipped"]`` (an
empty marker batch carries them when no sample is left), and the ``Loader`` adds them into run
totals (``stats["skipped_total"]``, ``summary()``) that are part of its saved state, so a resumed run
continues the counts. Order is deterministic for a (seed, shard layout, workers) triple; a
restored state must come from the same triple.
"""

from __future__ import annotations

import dataclasses
import collections
import logging
from collections.abc import Mapping
from typing import Any, Self

import grain
import numpy as np

from data.config import DataConfig, DataError, load_data_config
from data.batch import MODEL_KEYS
from data.packing import EVAL_KEYS, PackedBatchDataset
from data.sample import SKIP_REASONS, SampleProcessor, is_skip
from data.sources import build_source

log = logging.getLogger(__name__)
STATE_VERSION = 1
HOST_KEYS = ("stats", "sample_index", *EVAL_KEYS)
_TOTAL_KEYS = ("samples", "images", "tokens", "useful_tokens", "trained_tokens", "patch_slots", "useful_patches")


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


class Loader:
    """Iterator of packed batches; ``get_state``/``set_state`` for checkpoints, ``summary`` for the run log."""

    def __init__(self, cfg: DataConfig, dataset: grain.IterDataset, *, label: str, split: str, eval_mode: bool,
                 shard_index: int, shard_count: int, source_len: int):
        self.config, self.label, self.split, self.eval_mode = cfg, label, split, eval_mode
        self.shard_index, self.shard_count, self.source_len = shard_index, shard_count, source_len
        self.is_mock = cfg.is_mock
        self._dataset = dataset
        self._it: grain.DatasetIterator | None = None
        self._totals: dict[str, int] = dict.fromkeys(_TOTAL_KEYS, 0)
        self._skipped: collections.Counter = collections.Counter()
        self._batches = 0

    def _iterator(self) -> grain.DatasetIterator:
        if self._it is None:
            self._it = iter(self._dataset)
        return self._it

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> dict[str, Any]:
        it = self._iterator()
        while True:
            try:
                batch = next(it)
            except StopIteration:
                raise
            except Exception as e:  # a worker that crashed or raised: stop the run with its error, not a hang
                raise DataError(f"the data pipeline ({self.label}, {self.config.workers} workers) failed: "
                                f"{type(e).__name__}: {str(e).strip().splitlines()[0][:500] if str(e).strip() else ''}"
                                ) from e
            stats = batch["stats"]
            self._skipped.update(stats.get("skipped", {}))
            if stats.get("empty"):
                continue
            self._batches += 1
            for k in _TOTAL_KEYS:
                self._totals[k] += int(stats[k])
            stats["skipped_total"] = dict(self._skipped)
            stats["source"] = self.label
            stats["mock"] = self.is_mock
            stats["batch"] = self._batches
            return batch

    def summary(self) -> dict[str, Any]:
        """Run totals so far: samples, tokens, useful/trained tokens, patches, fill fractions, skips by reason."""
        t = self._totals
        return {
            "source": self.label, "mock": self.is_mock, "batches": self._batches, **t,
            "token_fill": t["useful_tokens"] / t["tokens"] if t["tokens"] else 0.0,
            "token_padding": 1 - t["useful_tokens"] / t["tokens"] if t["tokens"] else 0.0,
            "patch_fill": t["useful_patches"] / t["patch_slots"] if t["patch_slots"] else 0.0,
            "patch_padding": 1 - t["useful_patches"] / t["patch_slots"] if t["patch_slots"] else 0.0,
            "skipped": dict(self._skipped),
        }

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state: the grain iterator's plus the run totals."""
        return {
            "version": STATE_VERSION, "fingerprint": self.config.fingerprint(), "split": self.split,
            "shard": [self.shard_index, self.shard_count], "workers": self.config.workers,
            "grain": self._iterator().get_state(), "batches": self._batches, "totals": dict(self._totals),
            "skipped": dict(self._skipped),
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore a state from ``get_state`` (same config, shard layout and workers)."""
        expect = {"version": STATE_VERSION, "fingerprint": self.config.fingerprint(), "split": self.split,
                  "shard": [self.shard_index, self.shard_count], "workers": self.config.workers}
        diff = {k: (state.get(k), v) for k, v in expect.items() if state.get(k) != v}
        if diff:
            raise DataError(f"data iterator state does not match this loader (saved, now): {diff}")
        self._iterator().set_state(state["grain"])
        self._batches = int(state["batches"])
        self._totals = {k: int(state["totals"][k]) for k in _TOTAL_KEYS}
        self._skipped = collections.Counter(state["skipped"])

    def close(self) -> None:
        """Stop worker processes."""
        if self._it is not None and hasattr(self._it, "close"):
            self._it.close()
        self._it = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    seed: int | None = None,
    split: str = "train",
    eval_mode: bool | None = None,
    num_epochs: int | None | str = "config",
    workers: int | None = None,
    overrides: tuple[str, ...] | list[str] = (),
) -> Loader:
    """Packed-batch loader for one host: ``batch_size`` rows [B, S] per step from shard ``shard_index``.

    ``config``: a ``DataConfig``, a preset name (``vqa``, ``photos``, ``mock``, ``proxy``...), a YAML
    path or a mapping. Keyword arguments override the config. ``split="heldout"`` defaults to eval
    mode (loss mask on answer tokens only, ``answer_group``/``answer_type`` keys, one epoch, no
    shuffle). Raises ``DataError`` at once when the shard has no usable sample.
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
    source, label = build_source(cfg, cfg.eval_split if split == "heldout" else split)
    n = len(source)
    if n == 0:
        raise DataError(f"data source {label} ({split}) is empty")
    indices = grain.MapDataset.range(n)
    if cfg.shuffle:
        indices = indices.shuffle(seed=cfg.seed)
    indices = indices.repeat(cfg.num_epochs)[shard_index::shard_count]
    processor = SampleProcessor(cfg, eval_mode=eval_mode)
    _probe(source, indices, processor, cfg.probe_samples)
    samples = indices.map(_Read(source, processor)).to_iter_dataset(
        grain.ReadOptions(num_threads=cfg.read_threads, prefetch_buffer_size=cfg.read_buffer))
    dataset: grain.IterDataset = PackedBatchDataset(samples, cfg, pad_id=processor.tokenizer.pad_id,
                                                    eval_mode=eval_mode)
    if cfg.workers > 0:
        _absl_flags_parsed()
        dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=cfg.workers,
                                                                   per_worker_buffer_size=cfg.worker_buffer))
    log.info("data: %s, split %s, %d source samples, shard %d/%d, %d rows x %d tokens, buckets %s, %d workers",
             label, split, n, shard_index, shard_count, cfg.batch_size, cfg.seq_len, list(cfg.patch_buckets),
             cfg.workers)
    if cfg.is_mock:
        log.warning("%s", label)
    return Loader(cfg, dataset, label=label, split=split, eval_mode=eval_mode, shard_index=shard_index,
                  shard_count=shard_count, source_len=n)


def _absl_flags_parsed() -> None:
    """grain's multiprocessing reads absl flags (its profiler flag, once jax is imported); in a program that
    does not run absl.app, mark them parsed so that they read as their defaults."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
