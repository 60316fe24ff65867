"""The ``optimizer`` and ``train`` sections of a run (loaded by the one config loader).

``OptimizerConfig`` is what ``moevlm_jax.training.optimizer.make_optimizer`` builds AdamW from;
``TrainConfig`` drives the loop (``moevlm_jax.training.loop``): steps, the batch shape, logging,
evaluation, checkpoints, freezing, profiling. Rules between their fields and the layout (global
batch = micro batch x accumulation x data-parallel size, ...) are checked in
``moevlm_jax.config.run`` where all sections meet.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from moevlm_jax.schema import coerce_fields
from moevlm_jax.training.optimizer import PARAM_GROUP_PATTERNS


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
    # default); bfloat16 halves it, which the auto-fit takes only when float32 does not fit (bench/plans.md)
    grad_accum_dtype: Literal["float32", "bfloat16"] = "float32"
    skip_nonfinite: bool = True  # skip updates whose gradients hold inf/nan (counted)
    # this many skipped updates in a row stop the run (a checkpoint of the last good state)
    max_consecutive_skips: int = 10

    def __post_init__(self) -> None:
        coerce_fields(self, "optimizer")  # types, as the loader checks them (and hashable: lists to tuples)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Loop settings: steps, batch shape, logging, evaluation, checkpoints, freezing, profiling."""

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
    freeze_vision_model: bool = False  # no gradients / optimizer state for the vision tower
    freeze_vision_projection: bool = False  # ... for the merger and the deepstack mergers
    freeze_language_model: bool = False  # ... for the decoder, embeddings and LM head
    # which parameters each freeze flag covers: regexes searched in '/'-joined paths
    param_groups: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=lambda: dict(PARAM_GROUP_PATTERNS))
    init_from: str | None = None  # a Hugging Face checkpoint directory to start from (null: random init)
    run_dir: str | None = None  # where config, metrics and checkpoints go (null: runs/<recipe name>)
    resume: bool = False  # continue from the run directory's latest checkpoint
    tensorboard: bool = True  # also write TensorBoard events
    profile_steps: int = 0  # trace this many steps with the JAX profiler (0: none)
    profile_start_step: int = 10  # the first profiled step
    profile_dir: str | None = None  # where the trace goes (null: <run_dir>/profile)
    # JAX's persistent compilation cache (compiled steps reused by later runs of the same program;
    # MaxText's jax_cache_dir); null: JAX's own setting (JAX_COMPILATION_CACHE_DIR, default off)
    compilation_cache_dir: str | None = None
    # pad each batch up to the largest patch bucket and loss capacity its kind (train / eval) has had, so
    # that it reuses that compiled step (a compile per new shape: ~60 s on the H200 proxy; an evaluation
    # pads all its batches to their largest); the padding changes no result. false: a compile for every
    # (bucket, capacity) a batch brings
    reuse_shapes: bool = True
    # with reuse_shapes: every training batch padded to the data's largest patch bucket from the first step,
    # so the run compiles one training step instead of one per bucket as they are met (the H200 proxy data's
    # four buckets cost four ~40-95 s compiles in a 100-step run, bench/fp8_h200.md), at the price of
    # padding patches through the vision tower in batches of a smaller bucket
    reserve_largest_bucket: bool = False
    # with reserve_largest_bucket: the patch bucket reserved instead of the data's largest (one of
    # data.patch_buckets), for data whose batches rarely need the largest (balanced vision rows); a batch
    # over it compiles its own step when it comes, and the batches it holds keep the reserved step
    reserve_bucket: int | None = None
    # with reserve_largest_bucket: compile the training step in a background thread from the start, while
    # the state initialises and the data pipeline starts (time to the first step), for the reserved shape
    # and the largest loss capacity short of whole rows (reserved too; a batch with more than half its
    # positions trained compiles its whole-rows step when it comes)
    compile_ahead: bool = False
    # with compile_ahead: the step's Mosaic-GPU expert kernels (parallelism/gmm_mgpu.py, Hopper) compiled alone in
    # other threads while XLA compiles the step, which then finds them compiled (XLA otherwise compiles them one
    # after another, after its own passes)
    kernels_ahead: bool = True
    # with compile_ahead and evaluations: every eval batch padded to the training step's reserved bucket and loss
    # capacity (one microbatch's rows, as the train job evaluates), and that eval step compiled in a background
    # thread after the training step, while the first steps run (without XLA's autotuning: Trainer.compile_eval_
    # ahead), so that the first evaluation runs without a compile (the proxy's took ~70 s, bench/first_step_h200.md)
    eval_ahead: bool = True

    def __post_init__(self) -> None:
        coerce_fields(self, "train")  # types, as the loader checks them
        if self.compile_ahead and not (self.reuse_shapes and self.reserve_largest_bucket):
            raise ValueError("train.compile_ahead needs train.reserve_largest_bucket=true and train.reuse_shapes=true "
                             "(the training step's batch shape known before the first batch)")
