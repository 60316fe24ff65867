"""The ``optimizer`` and ``train`` sections of a run (loaded by the one config loader).

``OptimizerConfig`` is what ``moevlm_jax.training.optimizer.make_optimizer`` builds AdamW from;
``TrainConfig`` drives the loop (``moevlm_jax.training.loop``): steps, the batch shape, logging,
evaluation, checkpoints, freezing, profiling. Rules between their fields and the layout (global
batch = micro batch x accumulation x data-parallel size, ...) are checked in
``moevlm_jax.config.run`` where all sections meet.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar, Literal

from moevlm_jax.schema import coerce_fields
from moevlm_jax.training.optimizer import PARAM_GROUP_PATTERNS

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW + warmup/decay schedule + global-norm clipping (moevlm_jax.training.optimizer)."""

    name: Literal["adamw"] = "adamw"  # the optimizer (AdamW with decoupled weight decay)
    lr: float = 3e-4  # peak learning rate
    schedule: Literal["cosine", "linear", "constant"] = "cosine"  # decay after the warmup
    warmup_steps: int = 100  # linear warmup from 0 to lr
    decay_steps: int | None = None  # steps of warmup + decay (null: train.steps)
    min_lr_ratio: float = 0.1  # final lr = lr * min_lr_ratio
    b1: float = 0.9  # Adam's first-moment decay
    b2: float = 0.95  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's epsilon
    weight_decay: float = 0.1  # decoupled weight decay (not on no_decay_patterns)
    # regexes searched in '/'-joined parameter paths; matches get no weight decay (Megatron:
    # biases and norm weights are not decayed, embeddings are)
    no_decay_patterns: tuple[str, ...] = ("norm", "bias$")
    clip_grad_norm: float = 1.0  # clip the global gradient norm to this (0: no clipping)
    state_dtype: Literal["float32", "bfloat16"] = "float32"  # dtype of AdamW's moments
    # the sum of the microbatches' gradients (train.grad_accum > 1; Megatron's fp32 main grads are the
    # default); bfloat16 halves it, which the auto-fit takes only when float32 does not fit (bench/results/plans.md)
    grad_accum_dtype: Literal["float32", "bfloat16"] = "float32"
    skip_nonfinite: bool = True  # skip updates whose gradients hold inf/nan (counted)
    # this many skipped updates in a row stop the run (a checkpoint of the last good state)
    max_consecutive_skips: int = 10

    def __post_init__(self) -> None:
        coerce_fields(self, "optimizer")  # types, as the loader checks them (and hashable: lists to tuples)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop settings: steps, batch shape, logging, evaluation, checkpoints, freezing, profiling, compiling."""

    __aliases__: ClassVar[dict[str, str]] = {"reserve_bucket": "compile_bucket"}  # old names -> new (the loader warns)

    steps: int = 1000  # optimizer steps of the run
    # rows per step over all devices, fixed whatever the layout (Megatron's GBS); null: MBS x grad_accum x
    # the layout's data-parallel size
    global_batch_size: int | None = None
    # rows per data-parallel rank per microbatch (Megatron's MBS); null: global_batch_size / (data-parallel
    # size x grad_accum)
    micro_batch_size: int | None = None
    grad_accum: int | None = None  # microbatches per step; null: global_batch_size / (MBS x data-parallel size)
    seq_len: int = 4096  # tokens per packed row (data.seq_len is derived from it)
    seed: int = 0  # parameter initialisation and step RNG
    log_every: int = 10  # steps between metrics.jsonl / TensorBoard records
    eval_every: int = 0  # steps between held-out evaluations (0: only at the end, if eval_batches)
    eval_batches: int = 0  # held-out batches per evaluation (MBS x DP rows each)
    # held-out questions answered by generation (greedy) at the end of a run that evaluates, shown in the
    # summary next to the truth (0: none; Qwen3-VL-MoE models)
    show_answers: int = 4
    checkpoint_every: int = 500  # steps between checkpoints (0: only the final one)
    checkpointing: bool = True  # false: no checkpoints at all (benchmarks, smoke runs; MaxText's enable_checkpointing)
    keep_checkpoints: int = 3  # checkpoints kept on disk (older ones deleted)
    async_checkpointing: bool = True  # write checkpoints in the background
    # GB (10**9 bytes) of this process's state on the host at once while the final checkpoint is written (copied
    # off the devices and written in batches of this size, a larger array alone); periodic checkpoints hold one
    # whole host copy, so that training goes on while they are written
    checkpoint_host_gb: float = 2.0
    freeze_vision_model: bool = False  # no gradients / optimizer state for the vision tower
    freeze_vision_projection: bool = False  # ... for the merger and the deepstack mergers
    freeze_language_model: bool = False  # ... for the decoder, embeddings and LM head
    # which parameters each freeze flag covers: regexes searched in '/'-joined paths
    param_groups: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=lambda: dict(PARAM_GROUP_PATTERNS))
    init_from: str | None = None  # a Hugging Face checkpoint directory to start from (null: random init)
    run_dir: str | None = None  # where config, metrics and checkpoints go (null: runs/<recipe name>)
    # continue from the run directory's newest checkpoint that restores (a damaged one is skipped, named in the
    # log and the summary, and kept on disk)
    resume: bool = False
    # continue from exactly this checkpoint step (implies resume; an error when it is not there or does not
    # restore); newer checkpoints are set aside as <step>.superseded. null: as train.resume says
    resume_step: int | None = None
    tensorboard: bool = True  # also write TensorBoard events
    profile_steps: int = 0  # trace this many steps with the JAX profiler (0: none)
    profile_start_step: int = 10  # the first profiled step
    profile_dir: str | None = None  # where the trace goes (null: <run_dir>/profile)
    # JAX's persistent compilation cache (compiled steps reused by later runs of the same program;
    # MaxText's jax_cache_dir); null: JAX's own setting (JAX_COMPILATION_CACHE_DIR, default off)
    compilation_cache_dir: str | None = None
    # how steps compile (moevlm_jax.training.compile_policy): 'exact' one compile per (patch bucket, loss capacity)
    # a batch brings, nothing padded; 'lazy' a batch padded up to a shape its kind (train / eval) has compiled, else
    # to the largest seen so far (padding changes no result); 'reserve' lazy, with every training batch padded from
    # the first step to train.compile_bucket: one training compile; 'ahead' reserve, with that step, its Mosaic-GPU
    # kernels and the eval step for one microbatch's rows compiled in background threads from the start, so the
    # first step and evaluation wait for no compile. Old keys: reuse_shapes=false is exact,
    # reserve_largest_bucket=true reserve, compile_ahead=true ahead
    compile: Literal["exact", "lazy", "reserve", "ahead"] = "lazy"
    # with compile reserve / ahead: the patch bucket every training batch is padded to (one of
    # data.patch_buckets; null: the data's largest), for data whose batches rarely need the largest (balanced
    # vision rows); a batch over it compiles its own step when it comes (old key: train.reserve_bucket)
    compile_bucket: int | None = None

    @classmethod
    def __normalize__(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """The six compile flags of old configs (``reuse_shapes``, ``reserve_largest_bucket``, ``compile_ahead``,
        ``kernels_ahead``, ``eval_ahead``; ``reserve_bucket`` is a plain alias) as ``compile``: each one given is
        mapped with a deprecation warning; flags that no one mode has, or that contradict ``compile``, are an error
        that says what to set."""
        return legacy_compile(raw)

    @property
    def resuming(self) -> bool:
        """Whether the run continues from a checkpoint (``resume``, or a ``resume_step`` given)."""
        return self.resume or self.resume_step is not None

    @property
    def reuse_shapes(self) -> bool:
        """Whether batches are padded to a compiled step's shapes (every mode but ``exact``)."""
        return self.compile != "exact"

    def __post_init__(self) -> None:
        coerce_fields(self, "train")  # types, as the loader checks them
        if not self.checkpoint_host_gb > 0:
            raise ValueError(f"train.checkpoint_host_gb={self.checkpoint_host_gb}: the final checkpoint's host "
                             "budget must be > 0 (GB)")
        if self.resume_step is not None and self.resume_step < 1:
            raise ValueError(f"train.resume_step={self.resume_step}: checkpoint steps start at 1 (null: the newest "
                             "checkpoint that restores)")
        if self.compile_bucket is not None and self.compile not in ("reserve", "ahead"):
            raise ValueError(f"train.compile_bucket={self.compile_bucket} reserves a patch bucket, which "
                             f"train.compile={self.compile!r} does not: set train.compile=reserve (or ahead), or "
                             f"train.compile_bucket=null")


# What each train.compile mode is in the old flags' terms (reuse_shapes, reserve_largest_bucket, compile_ahead);
# kernels_ahead and eval_ahead were on by default and are part of 'ahead'.
LEGACY_COMPILE_FLAGS: dict[str, dict[str, bool]] = {
    "exact": {"reuse_shapes": False, "reserve_largest_bucket": False, "compile_ahead": False},
    "lazy": {"reuse_shapes": True, "reserve_largest_bucket": False, "compile_ahead": False},
    "reserve": {"reuse_shapes": True, "reserve_largest_bucket": True, "compile_ahead": False},
    "ahead": {"reuse_shapes": True, "reserve_largest_bucket": True, "compile_ahead": True},
}
_PREFERRED = ("lazy", "reserve", "ahead", "exact")  # the old defaults first: the keys not given keep them
_ALWAYS_ON = ("kernels_ahead", "eval_ahead")  # parts of 'ahead' now, no longer settings of their own


def legacy_compile(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a train mapping) with the old compile flags replaced by ``compile``: the mode whose flags
    (:data:`LEGACY_COMPILE_FLAGS`) agree with every old flag given, the old defaults kept for the others
    (``compile_ahead=true`` alone is ``ahead``); a deprecation warning names the mapping. Raises ValueError
    for flags no mode has (``reuse_shapes=false`` with ``reserve_largest_bucket=true``), flags that contradict
    a ``compile`` given with them, and ``kernels_ahead`` / ``eval_ahead`` false (they are always on with
    ``ahead`` now)."""
    old = {k: raw[k] for k in (*LEGACY_COMPILE_FLAGS["exact"], *_ALWAYS_ON) if k in raw}
    if not old:
        return raw
    given = ", ".join(f"train.{k}={str(v).lower()}" for k, v in old.items())
    for key in _ALWAYS_ON:
        if key in old and old[key] is not True:
            what = "the Mosaic-GPU kernels beside the step" if key == "kernels_ahead" else "the eval step"
            raise ValueError(f"train.{key}={str(old[key]).lower()} is no longer a setting: train.compile=ahead "
                             f"always compiles {what} ahead; drop train.{key} (train.compile=reserve compiles nothing "
                             "ahead)")
    flags = {k: v for k, v in old.items() if k not in _ALWAYS_ON}
    bad = [k for k, v in flags.items() if not isinstance(v, bool)]
    if bad:
        raise ValueError(f"train.{bad[0]}: expected bool, got {flags[bad[0]]!r} (deprecated: set train.compile)")
    fits = [m for m in _PREFERRED if all(LEGACY_COMPILE_FLAGS[m][k] == v for k, v in flags.items())]
    want = raw.get("compile")
    if want is not None and want not in fits:
        raise ValueError(f"{given} (deprecated) disagree with train.compile={want!r} (those flags are "
                         f"train.compile={fits[0] if fits else 'nothing'}); keep train.compile and drop the old keys")
    if not fits:
        meant = "ahead" if flags.get("compile_ahead") else "reserve"
        raise ValueError(f"{given} do not go together: compiling ahead needs a reserved bucket "
                         f"(reserve_largest_bucket) and reserving one needs padded batches (reuse_shapes); set "
                         f"train.compile={meant} (or exact / lazy / reserve / ahead) and drop the old keys")
    mode = want or fits[0]
    log.warning("deprecated config keys %s: they are now train.compile=%s", given, mode)
    out = {k: v for k, v in raw.items() if k not in old}
    out["compile"] = mode
    return out
