"""What the train job compiles, and when: ``train.compile`` (exact | lazy | reserve | ahead) as one object.

The steps are jitted per batch shape (patch bucket), loss capacity and ``bounded``
(``moevlm_jax.training.trainer``); on a GPU each new shape of the proxy's unrolled step is a ~60 s compile.
:class:`CompilePolicy` turns the setting into the trainer's calls:

- ``exact``: the trainer pads nothing (``reuse_shapes`` off): one compile for every shape a batch brings;
- ``lazy`` (default): ``reuse_shapes`` on: a batch is padded up to a shape its kind already has a step for;
- ``reserve``: and, before the first batch, the training steps' patch axis reserved at ``train.compile_bucket``
  (default the data's largest, ``data.max_patches``): one compiled training step from the start;
- ``ahead``: and the reserved shape with the largest loss capacity short of whole rows compiled in a background
  thread while the state initialises and the data starts (:meth:`Trainer.compile_ahead`, its Mosaic-GPU kernels
  beside it), then, where the run evaluates, the eval step for one microbatch's rows with the same bucket and
  capacity (:meth:`Trainer.compile_eval_ahead`).

Data without patch buckets (``data.patch_buckets`` empty) reserves nothing, so ``reserve`` and ``ahead`` act as
``lazy`` there. :func:`apply_compilation_cache` points JAX's persistent cache at ``train.compilation_cache_dir``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from moevlm_jax.schema import ConfigError

if TYPE_CHECKING:
    from moevlm_jax.config.run import RunConfig
    from moevlm_jax.training.trainer import Trainer

log = logging.getLogger("moevlm_jax.train")


def apply_compilation_cache(path: str | None) -> Path | None:
    """Point JAX's persistent compilation cache at ``path`` (``train.compilation_cache_dir``, ``~``
    expanded, created): a later run of the same program on the same devices loads its compiled steps
    instead of compiling them (unrolled layers take about a minute a batch shape on one H200). The cache is
    re-checked, so this works in a process that compiled already. None: unchanged."""
    if not path:
        return None
    from jax.experimental.compilation_cache import compilation_cache as cc

    where = Path(path).expanduser()
    where.mkdir(parents=True, exist_ok=True)
    if jax.config.jax_compilation_cache_dir != str(where):
        cc.reset_cache()  # JAX decides once per process whether a cache is used
        cc.set_cache_dir(str(where))
        log.info("compilation cache: %s", where)
    return where


class CompilePolicy:
    """``train.compile`` for one run: which shapes the trainer reserves and which programs it compiles ahead.

    Built by :meth:`from_config` (which checks ``train.compile_bucket`` against ``data.patch_buckets``); then
    :meth:`reserve` right after the trainer exists (before any batch), :meth:`start` once the run directory
    has been checked (the compile threads start there). ``bucket``: the reserved patch bucket (None: none
    reserved); ``rows``: this process's rows of a global batch; ``micro_batch_size`` / ``seq_len`` /
    ``balance_vision_rows``: the abstract batches' shape; ``evaluates``: the run evaluates on a held-out split."""

    def __init__(self, mode: str, *, bucket: int | None, rows: int, micro_batch_size: int, seq_len: int,
                 balance_vision_rows: bool = False, evaluates: bool = False) -> None:
        self.mode = mode
        self.bucket = bucket if mode in ("reserve", "ahead") else None
        self.rows, self.micro_batch_size, self.seq_len = rows, micro_batch_size, seq_len
        self.balance_vision_rows = balance_vision_rows
        self.evaluates = evaluates
        self.capacity: int | None = 0  # the reserved loss capacity (reserve: none; ahead: set by reserve())

    @classmethod
    def from_config(cls, cfg: RunConfig, *, evaluates: bool) -> CompilePolicy:
        """The policy of ``cfg.train.compile`` for ``cfg``'s data and batch; ConfigError when
        ``train.compile_bucket`` is not one of ``data.patch_buckets``."""
        tr, data = cfg.train, cfg.data
        bucket = None
        if tr.compile in ("reserve", "ahead"):
            if data.patch_buckets:
                bucket = tr.compile_bucket or data.max_patches
                if bucket not in data.patch_buckets:
                    raise ConfigError(f"train.compile_bucket {bucket} is not one of data.patch_buckets "
                                      f"{list(data.patch_buckets)}")
            elif tr.compile == "ahead":
                log.warning("train.compile=ahead compiles nothing ahead: the data has no patch buckets "
                            "(data.patch_buckets)")
        return cls(tr.compile, bucket=bucket, rows=cfg.global_batch_size // jax.process_count(),
                   micro_batch_size=tr.micro_batch_size, seq_len=tr.seq_len,
                   balance_vision_rows=data.balance_vision_rows, evaluates=evaluates)

    @property
    def reuse_shapes(self) -> bool:
        """The trainer's ``reuse_shapes``: batches padded to a compiled step's shapes (all but ``exact``)."""
        return self.mode != "exact"

    @property
    def ahead(self) -> tuple[str, ...]:
        """The programs compiled ahead, in order: ``("train", "eval")``, ``("train",)`` or ``()``."""
        if self.mode != "ahead" or self.bucket is None:
            return ()
        return ("train", "eval") if self.evaluates else ("train",)

    def reserve(self, trainer: Trainer) -> None:
        """Reserve the training steps' bucket (and, compiling ahead, the largest loss capacity short of whole
        rows) on ``trainer`` before its first batch; nothing for ``exact`` / ``lazy`` or data without buckets."""
        if self.bucket is None:
            return
        self.capacity = trainer.largest_capacity(self.rows, self.seq_len) if self.ahead else 0
        trainer.reserve_patches(self.bucket, capacity=self.capacity)
        log.info("train steps padded to the patch bucket %d (train.compile=%s)", self.bucket, self.mode)

    def start(self, trainer: Trainer, abstract: dict[str, Any]) -> None:
        """Start the compiles ahead (:attr:`ahead`) from the abstract state ``abstract``: the training step,
        then the eval step for the same bucket and capacity (its eval floor reserved to match)."""
        if "train" in self.ahead:
            trainer.compile_ahead(abstract, trainer.abstract_batch(
                self.micro_batch_size, self.seq_len, self.bucket, self.balance_vision_rows), self.capacity)
        if "eval" in self.ahead:
            trainer.reserve_patches(self.bucket, capacity=self.capacity, train=False)
            trainer.compile_eval_ahead(abstract["params"], trainer.abstract_eval_batch(
                self.micro_batch_size, self.seq_len, self.bucket, self.balance_vision_rows), self.capacity)
