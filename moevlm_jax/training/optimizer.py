"""Optimizer, freezing and gradient accumulation.

- :func:`lr_schedule`: linear warmup then cosine (or linear) decay to ``lr * min_lr_ratio``.
- :func:`make_optimizer`: optax AdamW with global-norm clipping, a weight-decay mask by parameter
  path, float32 optimizer state whatever the parameter dtype, and (optionally) skipping of updates
  whose gradients are not finite.
- Freezing as Megatron Bridge's ``freeze_vision_model / freeze_vision_projection /
  freeze_language_model``: :func:`partition` splits the parameter tree into a trainable and a
  frozen tree of the same structure (``None`` where a leaf belongs to the other part, the
  Equinox ``partition``/``combine`` pattern), so the step differentiates only the trainable tree
  and the optimizer state exists only for it.
- :func:`accumulate_gradients`: ``lax.scan`` over microbatches summing objectives, metrics and
  gradients, so the loss can be normalised by the trained tokens of the whole global batch.

Parameter paths are the pytree key path joined with '/' (``visual/blocks/0/attn/qkv/kernel``); the
``.value`` attribute of an ``nnx.Variable`` is dropped.
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from moevlm_jax.parallelism.sharding import path_str

if TYPE_CHECKING:
    from moevlm_jax.training.config import OptimizerConfig

log = logging.getLogger(__name__)

PyTree = Any

# Which parameters each freeze flag covers (regexes searched in '/'-joined paths; the first group
# that matches wins, in this order). The language model is everything else (decoder, embeddings,
# LM head). Correct these once the model's parameter names are final.
PARAM_GROUP_PATTERNS: dict[str, tuple[str, ...]] = {
    "vision_projection": (r"(^|/)visual/(merger|deepstack_merger(_list|s)?)(/|$)",),
    "vision_model": (r"(^|/)visual/",),
}
GROUPS = ("vision_projection", "vision_model", "language_model")


# ----------------------------------------------------------------------------- paths and groups

def tree_paths(tree: PyTree) -> list[str]:
    """The '/'-joined path of every leaf of ``tree``, in leaf order."""
    return [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def map_with_path(fn: Callable[[str, Any], Any], tree: PyTree, *rest: PyTree) -> PyTree:
    """``jax.tree.map`` whose function also gets the leaf's '/'-joined path first."""
    return jax.tree_util.tree_map_with_path(lambda p, x, *r: fn(path_str(p), x, *r), tree, *rest)


def param_group(path: str, patterns: Mapping[str, Iterable[str]] | None = None) -> str:
    """'vision_projection', 'vision_model' or 'language_model' for a parameter path."""
    patterns = PARAM_GROUP_PATTERNS if patterns is None else patterns
    for group in GROUPS[:2]:
        if any(re.search(p, path) for p in patterns.get(group, ())):
            return group
    return "language_model"


def frozen_groups(freeze_vision_model: bool = False, freeze_vision_projection: bool = False,
                  freeze_language_model: bool = False) -> set[str]:
    """The set of group names the three Megatron Bridge freeze flags select."""
    flags = {"vision_model": freeze_vision_model, "vision_projection": freeze_vision_projection,
             "language_model": freeze_language_model}
    return {g for g, on in flags.items() if on}


def trainable_mask(params: PyTree, frozen: Iterable[str],
                   patterns: Mapping[str, Iterable[str]] | None = None) -> PyTree:
    """Tree of bools like ``params``: True where the leaf's group is not in ``frozen``."""
    frozen = set(frozen)
    bad = frozen - set(GROUPS)
    if bad:
        raise ValueError(f"unknown parameter groups {sorted(bad)}; groups are {list(GROUPS)}")
    return map_with_path(lambda p, _: param_group(p, patterns) not in frozen, params)


def partition(params: PyTree, mask: PyTree) -> tuple[PyTree, PyTree]:
    """(trainable, frozen): two trees shaped like ``params``, each ``None`` where the other holds the leaf."""
    trainable = jax.tree.map(lambda m, x: x if m else None, mask, params)
    frozen = jax.tree.map(lambda m, x: None if m else x, mask, params)
    return trainable, frozen


def combine(*trees: PyTree) -> PyTree:
    """Inverse of :func:`partition`: the first non-None leaf at each position."""
    def pick(*xs: Any) -> Any:
        return next((x for x in xs if x is not None), None)

    return jax.tree.map(pick, *trees, is_leaf=lambda x: x is None)


def count_params(tree: PyTree) -> int:
    """Number of scalars in the (non-None) leaves of ``tree``."""
    return int(sum(math.prod(np.shape(x)) for x in jax.tree.leaves(tree)))


def group_sizes(params: PyTree, patterns: Mapping[str, Iterable[str]] | None = None) -> dict[str, int]:
    """Parameter count per group (for the start-up log: what a freeze flag covers)."""
    sizes = dict.fromkeys(GROUPS, 0)
    for (kp, x) in jax.tree_util.tree_flatten_with_path(params)[0]:
        sizes[param_group(path_str(kp), patterns)] += math.prod(np.shape(x))
    return sizes


# ----------------------------------------------------------------------------- schedule + optimizer

def lr_schedule(lr: float, warmup_steps: int, decay_steps: int, min_lr_ratio: float = 0.0,
                kind: str = "cosine") -> Callable[[jax.Array | int], jax.Array]:
    """step -> learning rate: ``lr * (step+1) / warmup`` for step < warmup, then cosine/linear/constant
    decay from ``lr`` at step ``warmup`` to ``lr * min_lr_ratio`` at step ``decay_steps``, flat after."""
    if kind not in ("cosine", "linear", "constant"):
        raise ValueError(f"unknown schedule {kind!r}: cosine | linear | constant")
    floor = lr * min_lr_ratio
    span = max(decay_steps - warmup_steps, 1)

    def schedule(step: jax.Array | int) -> jax.Array:
        step = jnp.asarray(step, jnp.float32)
        warm = lr * jnp.minimum((step + 1.0) / max(warmup_steps, 1), 1.0)
        t = jnp.clip((step - warmup_steps) / span, 0.0, 1.0)
        if kind == "cosine":
            decayed = floor + (lr - floor) * 0.5 * (1.0 + jnp.cos(jnp.pi * t))
        elif kind == "linear":
            decayed = lr + (floor - lr) * t
        else:
            decayed = jnp.full_like(t, lr)
        return jnp.where(step < warmup_steps, warm, decayed)

    return schedule


def decay_mask(params: PyTree, no_decay_patterns: Sequence[str]) -> PyTree:
    """Tree of bools like ``params``: False where the path matches one of ``no_decay_patterns``."""
    compiled = [re.compile(p) for p in no_decay_patterns]
    return map_with_path(lambda p, _: not any(c.search(p) for c in compiled), params)


def with_state_dtype(inner: optax.GradientTransformation, dtype: Any = jnp.float32) -> optax.GradientTransformation:
    """Run ``inner`` on gradients/params cast to ``dtype`` (so its state is ``dtype``); updates
    come back in the wider of each gradient's dtype and ``dtype`` (``optax.apply_updates`` adds them
    to the parameter and casts the sum to its dtype): float32 state gives float32 updates for bf16
    gradients (one rounding, of the sum), bf16 state and bf16 gradients bf16 updates, exactly what the
    state computed. Wrapped around :func:`apply_if_finite`, both branches of its ``cond`` are in ``dtype``."""
    def cast(tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)

    def init(params: PyTree) -> Any:
        return inner.init(cast(params))

    inner = optax.with_extra_args_support(inner)

    def update(grads: PyTree, state: Any, params: PyTree | None = None, **extra_args: Any) -> tuple[PyTree, Any]:
        updates, state = inner.update(cast(grads), state, None if params is None else cast(params), **extra_args)
        return jax.tree.map(lambda u, g: u.astype(jnp.promote_types(g.dtype, dtype)), updates, grads), state

    return optax.GradientTransformationExtraArgs(init, update)


def global_norm(tree: PyTree, pieces: PyTree | None = None) -> jax.Array:
    """The L2 norm of every leaf together, squares summed in float32 (a float32 scalar; 0 for no leaves).

    ``pieces``: a tree like ``tree`` of ints (None: 1 for every leaf); a leaf of ``n > 1`` is summed as its ``n``
    slices along axis 0, each on its own (the same norm up to the order of the float32 additions). For an unrolled
    layer stack's gradient, the concatenate of its layers' gradients (``moevlm_jax.model.layers.run_stack``), XLA
    then reads each layer's gradient where it lies (a slice of a concatenate cancels), where one sum over the
    concatenate read them at ~1 TB/s (9.0 ms a step in the h200 recipe, bench/results/step.md)."""
    leaves = jax.tree.leaves(tree)
    counts = [1] * len(leaves) if pieces is None else jax.tree.leaves(pieces)
    if len(counts) != len(leaves):
        raise ValueError(f"global_norm: {len(counts)} piece counts for {len(leaves)} leaves")

    def sum_sq(x: jax.Array) -> jax.Array:
        return jnp.sum(jnp.square(x.astype(jnp.float32)))

    sums = [sum(sum_sq(x[i]) for i in range(n)) if n > 1 else sum_sq(x) for x, n in zip(leaves, counts)]
    return jnp.sqrt(sum(sums)) if sums else jnp.zeros((), jnp.float32)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm`` with the norm of :func:`global_norm` (float32 squares; optax squares in the
    gradients' dtype) and the scaling in float32, rounded once. A caller that has the norm already passes it
    (``tx.update(..., grad_norm=)``: the trainer's logged gradient norm): the gradients are read once for it.
    Computed twice, XLA:GPU fused the second sum of squares into the AdamW update's elementwise kernels, which
    then ran as reductions (bench/results/step.md)."""
    def init(params: PyTree) -> optax.EmptyState:
        del params
        return optax.EmptyState()

    def update(updates: PyTree, state: optax.EmptyState, params: PyTree | None = None, *,
               grad_norm: jax.Array | None = None, **extra_args: Any) -> tuple[PyTree, optax.EmptyState]:
        del params, extra_args
        norm = global_norm(updates) if grad_norm is None else grad_norm.astype(jnp.float32)
        keep = norm < max_norm
        scale = max_norm / jnp.where(keep, 1.0, norm)
        return jax.tree.map(lambda t: jnp.where(keep, t, (t.astype(jnp.float32) * scale).astype(t.dtype)),
                            updates), state

    return optax.GradientTransformationExtraArgs(init, update)


def apply_if_finite(inner: optax.GradientTransformation, max_consecutive_errors: int
                    ) -> optax.GradientTransformationExtraArgs:
    """``optax.apply_if_finite`` (its state, decision and counts: a non-finite step leaves the parameters and the
    inner state as they were, unless ``max_consecutive_errors`` came before it in a row) with the finiteness read
    from the gradients' global norm, which the trainer computes anyway and passes (``grad_norm=``; computed here
    otherwise): the norm is finite exactly when every gradient is finite and the sum of their squares fits in
    float32 (a norm past ~1.8e19, which no clipping could scale, counts as non-finite too). optax's own check is
    an ``isfinite`` reduction over every gradient. XLA fused it into the norm's reduction over each whole leaf, so
    alone this change saves nothing; but with the norm summed per layer (:func:`global_norm`'s ``pieces``) that
    check would be left reading the unrolled stacks' concatenated gradients on its own, at ~1 TB/s (9.0 ms a step in
    the h200 recipe, bench/results/step.md)."""
    inner = optax.with_extra_args_support(inner)

    def init(params: PyTree) -> optax.ApplyIfFiniteState:
        return optax.ApplyIfFiniteState(notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True,
                                                                                                        jnp.bool_),
                                        total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

    def update(updates: PyTree, state: optax.ApplyIfFiniteState, params: PyTree | None = None, *,
               grad_norm: jax.Array | None = None, **extra_args: Any) -> tuple[PyTree, optax.ApplyIfFiniteState]:
        norm = global_norm(updates) if grad_norm is None else grad_norm
        isfinite = jnp.isfinite(norm)
        notfinite_count = jnp.where(isfinite, jnp.zeros([], jnp.int32), optax.safe_increment(state.notfinite_count))
        accept = jnp.logical_or(isfinite, notfinite_count > max_consecutive_errors)
        if grad_norm is not None:
            extra_args = dict(extra_args, grad_norm=grad_norm)
        new_updates, inner_state = jax.lax.cond(
            accept, lambda: inner.update(updates, state.inner_state, params, **extra_args),
            lambda: (jax.tree.map(jnp.zeros_like, updates), state.inner_state))
        total = jnp.where(isfinite, state.total_notfinite, optax.safe_increment(state.total_notfinite))
        return new_updates, optax.ApplyIfFiniteState(notfinite_count=notfinite_count, last_finite=isfinite,
                                                     total_notfinite=total, inner_state=inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> tuple[optax.GradientTransformation, Callable]:
    """(optax transformation for the trainable tree, lr schedule) from an OptimizerConfig."""
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    schedule = lr_schedule(cfg.lr, cfg.warmup_steps, decay_steps, cfg.min_lr_ratio, cfg.schedule)
    parts = []
    if cfg.clip_grad_norm > 0:
        parts.append(clip_by_global_norm(cfg.clip_grad_norm))
    parts.append(optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps))
    if cfg.weight_decay > 0:
        patterns = list(cfg.no_decay_patterns)
        parts.append(optax.add_decayed_weights(cfg.weight_decay, mask=lambda p: decay_mask(p, patterns)))
    parts.append(optax.scale_by_learning_rate(schedule))
    tx = optax.chain(*parts)
    if cfg.skip_nonfinite:
        # never apply a non-finite update: the training loop stops the run after
        # cfg.max_consecutive_skips of them in a row (moevlm_jax.training.faults.NonFiniteGuard)
        tx = apply_if_finite(tx, max_consecutive_errors=2**31 - 1)
    # outermost: apply_if_finite's two branches are both in the state dtype, whatever the gradients' dtype
    return with_state_dtype(tx, jnp.dtype(cfg.state_dtype)), schedule


def skipped_updates(opt_state: Any) -> jax.Array:
    """Total updates skipped for non-finite gradients so far (0 when skipping is off)."""
    total = getattr(opt_state, "total_notfinite", None)
    return jnp.asarray(0, jnp.int32) if total is None else total


# ----------------------------------------------------------------------------- accumulation

def split_microbatches(batch: Mapping[str, np.ndarray], grad_accum: int,
                       batch_axes: Mapping[str, int] | None = None) -> dict[str, np.ndarray]:
    """Host batch with B*G rows -> leading accumulation axis [G, ...B...]; ``positions`` [3, B*G, S]
    (batch axis 1) becomes [G, 3, B, S]. Row r goes to microbatch r // B."""
    axes = {"positions": 1, **(batch_axes or {})}
    out = {}
    for key, x in batch.items():
        ax = axes.get(key, 0)
        n = x.shape[ax]
        if n % grad_accum:
            raise ValueError(f"batch['{key}'] has {n} rows on axis {ax}, not divisible by grad_accum={grad_accum}")
        x = x.reshape(*x.shape[:ax], grad_accum, n // grad_accum, *x.shape[ax + 1:])
        out[key] = np.moveaxis(x, ax, 0) if ax else x
    return out


def accumulate_gradients(loss_fn: Callable[..., tuple[jax.Array, dict[str, jax.Array]]], params: PyTree,
                         microbatches: Mapping[str, jax.Array], *args: Any,
                         grad_shardings: PyTree | None = None, accum_dtype: Any = jnp.float32,
                         single_dtype: Any | None = jnp.float32
                         ) -> tuple[jax.Array, PyTree, dict[str, jax.Array]]:
    """Sum over the leading axis G of ``microbatches`` of ``loss_fn(params, mb, *args) -> (objective,
    metrics)``: returns (sum objective, sum of d objective / d params, summed metrics).

    Make ``objective`` a sum (e.g. masked token-loss sum divided by the trained tokens of the WHOLE
    global batch, known up front) so the result equals one pass over the G*B rows; gradients are
    accumulated in ``accum_dtype`` (float32 by default) and constrained to ``grad_shardings`` when given.
    One microbatch's gradients are cast to ``single_dtype`` (float32 by default: where the sharding sums
    them over devices, the sum is then float32; None: left in each parameter's dtype, e.g. on one device,
    where the cast only makes a float32 copy of bf16 gradients for the optimizer to read and cast back)."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    leaves = jax.tree.leaves(microbatches)
    num = leaves[0].shape[0]

    def constrain(g: PyTree) -> PyTree:
        if grad_shardings is None:
            return g
        return jax.lax.with_sharding_constraint(g, grad_shardings)

    def f32(tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: x.astype(jnp.float32), tree)

    def one(mb: Any, dtype: Any = single_dtype) -> tuple[jax.Array, PyTree, dict[str, jax.Array]]:
        (obj, metrics), grads = grad_fn(params, mb, *args)
        if dtype is not None:
            grads = jax.tree.map(lambda x: x.astype(dtype), grads)
        return obj.astype(jnp.float32), constrain(grads), f32(metrics)

    if num == 1:
        return one(jax.tree.map(lambda x: x[0], microbatches))
    one = functools.partial(one, dtype=accum_dtype)

    def body(carry: Any, mb: Any) -> tuple[Any, None]:
        return jax.tree.map(jnp.add, carry, one(mb)), None

    item = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), microbatches)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(one, item))
    zeros = (zeros[0], constrain(zeros[1]), zeros[2])
    carry, _ = jax.lax.scan(body, zeros, microbatches)
    return carry
