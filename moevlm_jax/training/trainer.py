"""The sharded train state and the compiled train / eval steps, for any (model, compute, layout).

What the train CLI, the benchmark, the sweep tool and layout tests share::

    trainer = Trainer.create(model_cfg, compute_cfg, layout, optimizer_cfg, steps=1000, grad_accum=2)
    state = trainer.init_state(seed=0)              # initialised directly sharded, never whole on one device
    batch = trainer.prepare(host_batch)             # numpy batch -> global arrays, microbatch axis
    state, metrics = trainer.step(state, batch)     # one jit: forward, backward, AdamW (state donated)
    metrics, predictions = trainer.evaluate(state["params"], host_eval_batch)

The state is ``{"params", "opt_state", "step", "rng"}``: ``params`` is the model's parameter tree
as a pure dict (``nnx.to_pure_dict``), sharded by each parameter's logical axes under the layout's
rules (``parallelism.sharding``); ``opt_state`` exists only for trainable parameters (freezing as
Megatron Bridge, ``moevlm_jax.training.optimizer``) and is sharded like them.

The steps are module-level ``jax.jit`` functions whose static argument is a hashable
:class:`StepSpec` (model/compute/optimizer configs, mesh, rules, accumulation, frozen groups), so
two trainers with equal specs share compiled programs (a resumed run compiles nothing new in the
same process). They compile once per batch shape (patch bucket), loss capacity and ``bounded``;
with ``reuse_shapes`` (the train job's ``train.compile``, all but ``exact``) a batch is padded up to the smallest
(patch bucket, loss capacity) its kind (train / eval) already has a step for that holds it, and a
batch no step holds gets one for the largest of each seen so far, so that the compiled shapes form a
chain, each holding the ones before it: at most one compile per new largest bucket or capacity, not one
per combination, and a rare large batch does not pad every later one (padding patches and unused
capacity slots change no result). When every batch's shape is known before the first one
(``reserve_patches`` with a capacity: the train job's ``train.compile=ahead``,
``moevlm_jax.training.compile_policy``), :meth:`Trainer.compile_ahead` compiles that step in a background thread
while the state initialises and the data starts, and :meth:`Trainer.compile_eval_ahead` the eval step for the same
rows after it, while the first steps run: the first evaluation runs without a compile.

The objective (what each microbatch adds to the loss, the gathered-positions LM head, the eval pass)
is ``moevlm_jax.training.objective``; the trainer gives it the data-parallel size and the per-batch
statics it agrees on across processes (``parallelism.multihost``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from moevlm_jax.data.batch import MODEL_KEYS, PATCH_KEYS, batch_shapes
from moevlm_jax.model import layers, registry
from moevlm_jax.model import router as moe_router
from moevlm_jax.model.attention import resolve_impl, rows_within_bound
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.config import ModelConfig
from moevlm_jax.parallelism import gmm_mgpu, grouped_matmul, sharding
from moevlm_jax.parallelism.kernels import ignored_environment
from moevlm_jax.parallelism.layout import Layout, LayoutOptions
from moevlm_jax.parallelism.logical import Rules, data_parallel_size, logical_to_spec, normalize_rules, sharding_context
from moevlm_jax.parallelism.multihost import agreed_max, host_ids
from moevlm_jax.training import optimizer as optim
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.objective import (
    ce_and_argmax,
    gather_trained,
    largest_capacity,
    loss_capacity,
    microbatch_objective,
    most_trained,
)

log = logging.getLogger(__name__)
_kernels_logged: set[str] = set()


def _log_kernels_once(line: str) -> None:
    """The experts' kernels (``compute.moe.kernels`` on this platform): one info line per run, not per trainer."""
    if line not in _kernels_logged:
        _kernels_logged.add(line)
        log.info("%s", line)
        if ignored := ignored_environment(os.environ):
            log.warning("ignored (the run's kernels are its config's): %s", ", ".join(ignored))


PyTree = Any


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """Everything the compiled steps depend on besides array shapes; hashable (a jit static arg)."""

    model: ModelConfig
    compute: ComputeConfig
    mesh: Mesh
    rules: Rules
    optimizer: OptimizerConfig
    total_steps: int
    grad_accum: int = 1
    frozen: frozenset[str] = frozenset()
    param_groups: tuple[tuple[str, tuple[str, ...]], ...] | None = None
    layout_options: LayoutOptions | None = None  # e.g. ``pipeline``: parallelism.pipeline

    @property
    def dp_size(self) -> int:
        """Devices the batch rows are split over (the mesh axes the rules map ``act_batch`` to)."""
        return data_parallel_size(self.rules, self.mesh)

    def patterns(self) -> dict[str, tuple[str, ...]] | None:
        """Parameter-group regexes (None: ``optim.PARAM_GROUP_PATTERNS``)."""
        return None if self.param_groups is None else dict(self.param_groups)


# ----------------------------------------------------------------------------- per-spec pieces (cached)

@functools.lru_cache(maxsize=32)
def _abstract(spec: StepSpec) -> tuple[nnx.GraphDef, nnx.State]:
    model = nnx.eval_shape(lambda: registry.build_model(spec.model, spec.compute, nnx.Rngs(0)))  # by family
    return nnx.split(model)


@functools.lru_cache(maxsize=32)
def _param_shardings(spec: StepSpec) -> dict[str, Any]:
    return sharding.param_shardings(_abstract(spec)[1], spec.mesh, spec.rules)


@functools.lru_cache(maxsize=32)
def _mask(spec: StepSpec) -> dict[str, Any]:
    params = nnx.to_pure_dict(_abstract(spec)[1])
    return moe_router.exclude_expert_bias(optim.trainable_mask(params, spec.frozen, spec.patterns()))


@functools.lru_cache(maxsize=32)
def _norm_pieces(spec: StepSpec) -> dict[str, Any]:
    """Per parameter (pure-dict tree), the pieces ``optim.global_norm`` sums its gradient in: a layer stack's leaf
    of a tower that runs unrolled, with its layer axis on no mesh axis, its layer count (that gradient is the
    concatenate of the layers' own, ``layers.run_stack``); every other leaf 1."""
    rules = normalize_rules(spec.rules)

    def pieces(_, var: nnx.Variable) -> int:
        axis = (var.get_metadata().get("out_sharding") or (None,))[0]
        if axis not in layers.LAYER_AXES or spec.compute.stack_scan(layers.stack_tower(axis)):
            return 1
        return 1 if logical_to_spec((axis,), rules, spec.mesh) != PartitionSpec() else int(var.shape[0])

    return sharding.map_variables(pieces, _abstract(spec)[1])


@functools.lru_cache(maxsize=32)
def _optimizer(spec: StepSpec) -> tuple[optax.GradientTransformation, Any]:
    return optim.make_optimizer(spec.optimizer, spec.total_steps)


@functools.lru_cache(maxsize=32)
def _state_shardings(spec: StepSpec) -> dict[str, Any]:
    params = nnx.to_pure_dict(_abstract(spec)[1])
    pshard = _param_shardings(spec)
    trainable, _ = optim.partition(params, _mask(spec))
    opt_shape = jax.eval_shape(_optimizer(spec)[0].init, trainable)
    rep = sharding.replicated(spec.mesh)
    return {"params": pshard, "opt_state": sharding.shardings_like(opt_shape, params, pshard, spec.mesh),
            "step": rep, "rng": rep}


def segments_over_bound(arrays: dict[str, np.ndarray], options: object, warned: set[str] | None,
                        lengths: bool = True) -> dict[str, int]:
    """Rows of a host batch over the attention's static bounds (``compute.attention_options``): more
    segments (packed samples; images for the vision tower) than the cuDNN ragged kernel's, or an image
    longer than the vision tower's XLA band (``vision_max_image_patches``). The step then runs that
    attention on the dense-mask kernel / the whole row for the whole batch (exact, but slower;
    bench/results/attention.md). Returns ``{"text" | "vision" | "vision_length": rows over}`` and logs a
    warning the first time per kind (``warned``; None: no warning, e.g. where the attention is not
    cuDNN's). ``lengths``: check image lengths (where the vision attention is XLA's; cuDNN's ragged
    kernel has no such bound)."""
    over = {}
    for tower, key in (("text", "segment_ids"), ("vision", "patch_segment_ids")):
        if key not in arrays or not np.asarray(arrays[key]).size:
            continue
        bounds = options.for_tower(tower)
        bound = bounds["max_segments"]
        ids = np.asarray(arrays[key]).reshape(-1, np.shape(arrays[key])[-1])
        most = ids.max(axis=-1)
        n = int(np.count_nonzero(most > bound))
        if n:
            over[tower] = n
            if warned is not None and tower not in warned:
                warned.add(tower)
                log.warning(
                    "%d row(s) hold more %s segments than compute.attention_options.%smax_segments=%d (up to %d): "
                    "on the GPU these batches run the dense-mask attention kernel (exact, slower); raise the bound",
                    n, tower, "vision_" if tower == "vision" else "", bound, int(most.max()))
        span = bounds.get("max_segment_len")
        if span is not None and lengths:
            longest = _longest_segments(ids)
            n = int(np.count_nonzero(longest > span))
            if n:
                over["vision_length"] = n
                if warned is not None and "vision_length" not in warned:
                    warned.add("vision_length")
                    log.warning("%d row(s) hold an image of more patches (up to %d) than compute.attention_options."
                                "vision_max_image_patches=%d: these batches run the vision attention over whole rows "
                                "(exact, slower); raise the bound", n, int(longest.max()), span)
    return over


def _longest_segments(ids: np.ndarray) -> np.ndarray:
    """``[R, S]`` segment ids (0 = padding) -> the longest run of one non-zero id in each row."""
    out = np.zeros(ids.shape[0], np.int64)
    for r, row in enumerate(ids):
        edges = np.flatnonzero(np.diff(row)) + 1
        starts, stops = np.r_[0, edges], np.r_[edges, row.size]
        lengths = np.where(row[starts] > 0, stops - starts, 0)
        out[r] = lengths.max(initial=0)
    return out


# ----------------------------------------------------------------------------- compiled steps

@functools.partial(jax.jit, static_argnames=("spec", "capacity", "bounded"), donate_argnames=("state",))
def _train_step(state: dict[str, Any], micro: dict[str, jax.Array], *, spec: StepSpec,
                capacity: int | None, bounded: bool = False) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    with sharding_context(spec.mesh, spec.rules, spec.layout_options), rows_within_bound(bounded):
        graphdef = _abstract(spec)[0]
        mask = _mask(spec)
        tx, schedule = _optimizer(spec)
        shardings = _state_shardings(spec)
        trainable, frozen = optim.partition(state["params"], mask)
        grad_shardings, _ = optim.partition(shardings["params"], mask)
        total = jnp.maximum(jnp.sum((micro["loss_mask"] > 0).astype(jnp.float32)), 1.0)

        def loss_fn(tr: PyTree, mb: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
            model = nnx.merge(graphdef, optim.combine(tr, frozen))
            return microbatch_objective(model, mb, total, spec.grad_accum, capacity, spec.dp_size)

        # one microbatch on one device: nothing sums the gradients, they stay in the parameters' dtype (the h200
        # recipe's bf16 gradients copied to float32, 24.6 GB, and the optimizer's reads of it: 8.9 ms a step,
        # bench/results/step.md)
        objective, grads, sums = optim.accumulate_gradients(loss_fn, trainable, micro, grad_shardings=grad_shardings,
                                                            accum_dtype=jnp.dtype(spec.optimizer.grad_accum_dtype),
                                                            single_dtype=None if spec.mesh.size == 1 else jnp.float32)
        # an unrolled stack's per-layer gradients are each materialised once inside the model
        # (layers.materialised_grad; re-derived in each reduction over them they cost 82 ms/step,
        # step_h200.md); the stacked leaves' concatenates fuse into the update, and the norm sums
        # each layer's gradient on its own (_norm_pieces)
        # logged, and the clipping's and the finiteness check's (read once: bench/results/step.md)
        grad_norm = optim.global_norm(grads, optim.partition(_norm_pieces(spec), mask)[0])
        with jax.named_scope("optimizer"):  # profiler trace labels (bench.trace_breakdown)
            updates, opt_state = tx.update(grads, state["opt_state"], trainable, grad_norm=grad_norm)
            params = optim.combine(optax.apply_updates(trainable, updates), frozen)
        load = sums.get("router_load")
        if load is not None and spec.compute.router.expert_bias:  # aux-loss-free balancing, outside the grads
            params = moe_router.update_expert_bias(params, load, spec.compute.router.expert_bias_update_rate)
        rng, _ = jax.random.split(state["rng"])
        new = {"params": params, "opt_state": opt_state, "step": state["step"] + 1, "rng": rng}
        new = jax.lax.with_sharding_constraint(new, shardings)
        metrics = {"loss": objective, "ce_loss": sums["ce_sum"] / jnp.maximum(sums["trained_tokens"], 1.0),
                   "grad_norm": grad_norm, "lr": schedule(state["step"]),
                   "skipped": optim.skipped_updates(opt_state), "trained_tokens": sums["trained_tokens"]}
        for k in ("router_aux_loss", "router_z_loss", "router_loss"):
            if k in sums:
                metrics[k] = sums[k]
        if load is not None:
            metrics.update(moe_router.expert_load_metrics(load))
        return new, metrics


@functools.partial(jax.jit, static_argnames=("spec", "capacity", "bounded"))
def _eval_step(params: PyTree, batch: dict[str, jax.Array], *, spec: StepSpec,
               capacity: int | None, bounded: bool = False) -> tuple[dict[str, jax.Array], jax.Array, jax.Array]:
    with sharding_context(spec.mesh, spec.rules, spec.layout_options), rows_within_bound(bounded):
        model = nnx.merge(_abstract(spec)[0], params)
        hidden, _ = model.hidden_states(batch)
        targets, mask = batch["targets"], batch["loss_mask"]
        idx = None
        if capacity is not None:
            hidden, targets, mask, idx = gather_trained(hidden, targets, mask, spec.dp_size, capacity)
        ce_sum, count, pred = ce_and_argmax(hidden, model.lm_head_kernel(), targets, mask,
                                            spec.compute.loss_chunk_size)
        return {"ce_sum": ce_sum, "tokens": count}, pred, idx


@functools.partial(jax.jit, static_argnames=("spec", "seed"))
def _init_state(*, spec: StepSpec, seed: int) -> dict[str, Any]:
    pkey, rkey = jax.random.split(jax.random.key(seed))
    model = registry.build_model(spec.model, spec.compute, nnx.Rngs(pkey))
    params = nnx.to_pure_dict(nnx.state(model, (nnx.Param, moe_router.ExpertBias)))  # + router state
    return _with_optimizer(spec, params, rkey)


def _with_optimizer(spec: StepSpec, params: PyTree, rkey: jax.Array) -> dict[str, Any]:
    trainable, _ = optim.partition(params, _mask(spec))
    state = {"params": params, "opt_state": _optimizer(spec)[0].init(trainable),
             "step": jnp.zeros((), jnp.int32), "rng": rkey}
    return jax.lax.with_sharding_constraint(state, _state_shardings(spec))


# ----------------------------------------------------------------------------- the trainer

def compile_key(arrays: Mapping[str, Any], capacity: int | None, bounded: bool) -> tuple:
    """What selects a compiled step for a batch: its arrays' shapes, the loss capacity, the bound check."""
    return tuple(sorted((k, v.shape) for k, v in arrays.items())), capacity, bounded


def _ahead_key(arrays: Mapping[str, Any], capacity: int | None, bounded: bool) -> tuple:
    """compile_key with the dtypes: an executable compiled ahead takes exactly these arrays."""
    return compile_key(arrays, capacity, bounded), tuple(sorted((k, str(v.dtype)) for k, v in arrays.items()))


@dataclasses.dataclass
class DeviceBatch:
    """A batch on the mesh: ``arrays`` (global; train batches have a leading microbatch axis), the static
    loss ``capacity``, host-side ``counts`` (tokens, useful_tokens, trained_tokens) and ``bounded``: no
    row over the cuDNN ragged bounds (no device-side fallback then: ``attention.rows_within_bound``)."""

    arrays: dict[str, jax.Array]
    capacity: int | None
    counts: dict[str, float]
    bounded: bool = False


class Trainer:
    """Sharded train state + compiled train / eval steps for one StepSpec (see the module docstring)."""

    def __init__(self, spec: StepSpec, reuse_shapes: bool = False):
        self.spec = spec
        self.compiled: set[tuple] = set()  # (kind, shapes, capacity, bounded) seen: one compile each
        # kind (train / eval) -> the executables compiled ahead (compile_ahead, compile_eval_ahead) by (shapes, dtypes,
        # capacity, bounded), and the thread compiling one
        self._ahead: dict[str, dict[tuple, Any]] = {"train": {}, "eval": {}}
        self._ahead_threads: dict[str, threading.Thread | None] = {"train": None, "eval": None}
        self.ahead_steps = 0  # steps that ran an executable compiled ahead
        self.ahead_evals = 0  # eval batches that ran an executable compiled ahead
        self.reuse_shapes = reuse_shapes
        # kind -> the chain of (patches, capacity; inf: whole rows) its batches are padded to, ascending
        self._shapes: dict[str, list[tuple[int, float]]] = {}
        warns = jax.default_backend() == "gpu" and spec.compute.attention != "xla"
        self.bound_warned: set[str] | None = set() if warns else None
        v = spec.model.vision_config
        self.vision_attention = resolve_impl(spec.compute.attention, jnp.dtype(spec.compute.dtype), v.head_dim)

    @classmethod
    def create(cls, model: ModelConfig, compute: ComputeConfig, layout: Layout | None, optimizer: Any, *,
               steps: int, grad_accum: int = 1, frozen: Sequence[str] = (),
               param_groups: Mapping[str, Sequence[str]] | None = None, mesh: Mesh | None = None,
               devices: Sequence[jax.Device] | None = None, rules: Sequence[Sequence[Any]] | None = None,
               reuse_shapes: bool = False) -> Trainer:
        """A trainer for ``model`` under ``layout`` (its mesh over ``devices``, default all; or an
        explicit ``mesh`` + ``rules``); ``optimizer`` an OptimizerConfig; ``frozen`` group names;
        ``reuse_shapes``: see the module docstring."""
        if mesh is None:
            mesh = build_mesh(layout, devices)
        grouped_matmul.preload(mesh.devices.flat[0].platform, compute.moe_options.get("backend"))  # see docstring
        _log_kernels_once(compute.moe.kernels_summary(mesh.devices.flat[0].platform))
        rules = normalize_rules(rules if rules is not None else layout.rules)
        groups = None if param_groups is None else tuple((k, tuple(v)) for k, v in sorted(param_groups.items()))
        spec = StepSpec(model=model, compute=compute, mesh=mesh, rules=rules, optimizer=optimizer,
                        total_steps=int(steps), grad_accum=int(grad_accum), frozen=frozenset(frozen),
                        param_groups=groups, layout_options=layout.options if layout is not None else None)
        return cls(spec, reuse_shapes=reuse_shapes)

    # -- shapes and shardings
    @property
    def mesh(self) -> Mesh:
        """The device mesh."""
        return self.spec.mesh

    @property
    def graphdef(self) -> nnx.GraphDef:
        """The model's graph (merge with a params tree: ``nnx.merge(trainer.graphdef, params)``)."""
        return _abstract(self.spec)[0]

    @property
    def abstract_params(self) -> dict[str, Any]:
        """Parameter tree of ShapeDtypeStructs (pure dict)."""
        return nnx.to_pure_dict(_abstract(self.spec)[1])

    @property
    def param_shardings(self) -> dict[str, Any]:
        """NamedSharding per parameter (pure dict)."""
        return _param_shardings(self.spec)

    @property
    def state_shardings(self) -> dict[str, Any]:
        """NamedSharding per train-state leaf."""
        return _state_shardings(self.spec)

    @property
    def trainable_mask(self) -> dict[str, Any]:
        """Bool per parameter: False for frozen groups."""
        return _mask(self.spec)

    def abstract_state(self) -> dict[str, Any]:
        """The train state as ShapeDtypeStructs with their shardings (a checkpoint restore target)."""
        shapes = jax.eval_shape(lambda: _init_state(spec=self.spec, seed=0))
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            shapes, self.state_shardings)

    def abstract_batch(self, mbs: int, seq_len: int, patches: int, dest: bool = False) -> dict[str, Any]:
        """A train batch of ``mbs`` rows per data-parallel rank (``data.batch.batch_shapes``, microbatch
        axis leading; ``dest``: with ``patch_dest``) as ShapeDtypeStructs with the batch shardings ``prepare``
        gives its arrays."""
        spec = self.spec
        shapes = batch_shapes(spec.model, mbs * spec.dp_size, seq_len, patches, spec.grad_accum, dest)
        shards = sharding.batch_shardings({k: s for k, (s, _) in shapes.items()}, spec.mesh, spec.rules, 1)
        return {k: jax.ShapeDtypeStruct(s, d, sharding=shards[k]) for k, (s, d) in shapes.items()}

    def abstract_eval_batch(self, mbs: int, seq_len: int, patches: int, dest: bool = False) -> dict[str, Any]:
        """An eval batch of ``mbs`` rows per data-parallel rank (the train job evaluates batches of a microbatch's
        rows) as ShapeDtypeStructs with the shardings ``prepare(train=False)`` gives its arrays: no microbatch axis."""
        spec = self.spec
        shapes = {k: (s[1:], d) for k, (s, d) in
                  batch_shapes(spec.model, mbs * spec.dp_size, seq_len, patches, 1, dest).items()}
        shards = sharding.batch_shardings({k: s for k, (s, _) in shapes.items()}, spec.mesh, spec.rules, 0)
        return {k: jax.ShapeDtypeStruct(s, d, sharding=shards[k]) for k, (s, d) in shapes.items()}

    @property
    def data_parallel_size(self) -> int:
        """Devices the batch rows are split over (the mesh axes of ``act_batch``)."""
        return self.spec.dp_size

    # -- state
    def init_state(self, seed: int = 0, params: PyTree | None = None) -> dict[str, Any]:
        """Fresh train state, created sharded (random init from ``seed``, or the given ``params``
        tree, e.g. loaded from an HF checkpoint, placed with the parameter shardings)."""
        if params is None:
            return _init_state(spec=self.spec, seed=seed)
        params = jax.device_put(params, self.param_shardings)
        init = jax.jit(lambda p, k: _with_optimizer(self.spec, p, k))
        return init(params, jax.random.key(seed))

    def model(self, params: PyTree) -> Any:
        """The nnx model holding ``params`` (for eager use outside the steps)."""
        return nnx.merge(self.graphdef, params)

    # -- batches
    def prepare(self, host_batch: Mapping[str, Any], *, train: bool = True) -> DeviceBatch:
        """Host numpy batch (this process's rows) -> global arrays on the mesh. Train batches get a
        leading microbatch axis ``[G, rows / G, ...]`` (``positions`` ``[G, 3, rows / G, S]``)."""
        arrays = {k: np.asarray(host_batch[k]) for k in MODEL_KEYS if k in host_batch}
        if "patch_dest" in arrays:
            check_dest_groups(arrays, self._local_groups * (self.spec.grad_accum if train else 1))
        counts = _counts(arrays)
        # cuDNN's ragged bound, checked on the host (a warning on the GPU when rows hold more segments);
        # one process's rows over it: every process runs the step with the fallback
        over = segments_over_bound(arrays, self.spec.compute.attention_options, self.bound_warned,
                                   lengths=self.vision_attention == "xla")
        bounded = not agreed_max(int(bool(over)))
        capacity = self._capacity(arrays, train)
        if self.reuse_shapes:
            arrays, capacity = self._reused_shapes("train" if train else "eval", arrays, capacity)
        leading = 0
        if train:
            arrays = optim.split_microbatches(arrays, self.spec.grad_accum)
            leading = 1
        return DeviceBatch(self._place(arrays, leading), capacity, counts, bounded)

    @property
    def _local_groups(self) -> int:
        """This process's data-parallel row groups (the loss capacity is per group)."""
        return max(self.spec.dp_size // jax.process_count(), 1)

    def _capacity(self, arrays: Mapping[str, np.ndarray], train: bool) -> int | None:
        """The batch's loss capacity, agreed over the processes (one ``agreed_max`` each call)."""
        most, positions = most_trained(arrays["loss_mask"], self._local_groups, self.spec.grad_accum if train else 1)
        return loss_capacity(agreed_max(most), positions)

    def reserve(self, host_batches: Sequence[Mapping[str, Any]], *, train: bool = False) -> None:
        """With ``reuse_shapes``: make the largest patch axis and capacity of ``host_batches`` the floor of
        their kind before any is prepared, so that all of them run one compiled step (the evaluation
        reads its batches first). Every process must reserve the same number of batches."""
        if not self.reuse_shapes or not host_batches:
            return
        patches, cap = 0, 0
        for host in host_batches:
            arrays = {k: np.asarray(host[k]) for k in ("loss_mask", "pixel_values") if k in host}
            capacity = self._capacity(arrays, train)
            patches = max(patches, arrays["pixel_values"].shape[1] if "pixel_values" in arrays else 0)
            cap = max(cap, math.inf if capacity is None else capacity)
        self.reserve_patches(patches, capacity=None if cap == math.inf else cap, train=train)

    def largest_capacity(self, rows: int, seq_len: int) -> int | None:
        """The largest loss capacity a training batch of ``rows`` (this process's) x ``seq_len`` tokens
        gets short of whole rows (``objective.largest_capacity`` of its row groups, as :meth:`prepare`
        groups them)."""
        return largest_capacity(rows // (self._local_groups * self.spec.grad_accum) * seq_len)

    def reserve_patches(self, patches: int, *, capacity: int | None = 0, train: bool = True) -> None:
        """With ``reuse_shapes``: ``patches`` (a patch bucket) the floor of the patch axis of ``train`` /
        eval batches from now on (``train.compile`` reserve / ahead: ``train.compile_bucket``, default the
        data's largest; one compiled step for every batch it holds), and ``capacity`` the floor
        of their loss capacity (None: whole rows; 0: none): the kind's chain becomes that one shape (or
        its last, if larger). The same on every process (it comes from the config)."""
        if not self.reuse_shapes:
            return
        kind = "train" if train else "eval"
        chain = self._shapes.get(kind, [])
        most_patches, most_cap = chain[-1] if chain else (0, 0)
        cap = math.inf if capacity is None else capacity
        self._shapes[kind] = [(max(most_patches, int(patches)), max(most_cap, cap))]

    def _reused_shapes(self, kind: str, arrays: dict[str, np.ndarray], capacity: int | None
                       ) -> tuple[dict[str, np.ndarray], int | None]:
        """The batch padded to the patch axis and its capacity raised to the capacity (None, whole rows,
        above any) of the smallest shape in ``kind``'s chain that holds it; a batch none holds adds the
        largest patch axis and capacity seen so far (its own included) to the chain's end. The patch
        axis is padded as the data pipeline pads it (zero pixels, rc / hw 0, segment 0)."""
        patches = arrays["pixel_values"].shape[1] if "pixel_values" in arrays else 0
        cap = math.inf if capacity is None else capacity
        chain = self._shapes.setdefault(kind, [])
        held = [(p, c) for p, c in chain if p >= patches and c >= cap]
        if held:
            most_patches, most_cap = held[0]
        else:
            last = chain[-1] if chain else (0, 0)
            most_patches, most_cap = max(last[0], patches), max(last[1], cap)
            chain.append((most_patches, most_cap))
        if patches < most_patches:
            arrays = dict(arrays)
            for k in PATCH_KEYS:
                if k in arrays:
                    pad = [(0, 0)] * arrays[k].ndim
                    pad[1] = (0, most_patches - patches)
                    arrays[k] = np.pad(arrays[k], pad)
        return arrays, None if most_cap == math.inf else int(most_cap)

    def _place(self, arrays: dict[str, np.ndarray], leading: int) -> dict[str, jax.Array]:
        procs = jax.process_count()
        shapes = {}
        for k, x in arrays.items():
            shape = list(x.shape)
            shape[leading + sharding.BATCH_ROW_AXIS.get(k, 0)] *= procs
            shapes[k] = tuple(shape)
        shards = sharding.batch_shardings(shapes, self.mesh, self.spec.rules, leading)
        return {k: jax.make_array_from_process_local_data(shards[k], x, shapes[k]) for k, x in arrays.items()}

    def _note_compile(self, kind: str, arrays: Mapping[str, jax.Array], capacity: int | None, bounded: bool) -> None:
        key = (kind, *compile_key(arrays, capacity, bounded))
        if key not in self.compiled:
            self.compiled.add(key)
            shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in arrays.items() if k in ("input_ids", "pixel_values"))
            log.info("%s step: new batch shape (%s; loss capacity %s%s) -> compile #%d", kind, shapes,
                     capacity or "full rows", "" if bounded else "; attention fallback", len(self.compiled))

    # -- steps
    def step(self, state: dict[str, Any], batch: DeviceBatch) -> tuple[dict[str, Any], dict[str, jax.Array]]:
        """One optimizer step over the global batch (``state`` is donated); metrics stay on device:
        loss, ce_loss, router_aux_loss, router_z_loss, router_loss, moe/load_* (expert load, see
        ``router.expert_load_metrics``), grad_norm, lr, skipped, trained_tokens."""
        ahead = self._compiled_ahead("train", batch)
        if ahead is None:
            return _train_step(state, batch.arrays, spec=self.spec, capacity=batch.capacity, bounded=batch.bounded)
        self.ahead_steps += 1
        return ahead(state, batch.arrays)

    def wait_ahead(self, kind: str = "train") -> None:
        """Wait for the compile of ``kind`` (train / eval) started ahead, if one runs (it may have failed: logged)."""
        thread = self._ahead_threads[kind]
        if thread is not None:
            thread.join()
            self._ahead_threads[kind] = None

    def compile_step(self, state: dict[str, Any], batch: DeviceBatch) -> bool:
        """Have ``batch``'s train step compiled before :meth:`step` runs it: wait for the compile started ahead, else
        compile the step now unless an earlier batch did (it fills :meth:`step`'s cache: the step then runs without
        compiling). True when the batch's step had not been compiled before this call, so the caller can act between
        the compile and the step (a stop requested while it compiled)."""
        key = ("train", *compile_key(batch.arrays, batch.capacity, batch.bounded))
        if key in self.compiled:
            return False
        if self._compiled_ahead("train", batch) is None:
            self.lower_step(state, batch.arrays, batch.capacity, bounded=batch.bounded).compile()
        return True

    def _compiled_ahead(self, kind: str, batch: DeviceBatch) -> Any:
        """The executable of ``kind`` compiled ahead for ``batch`` (the first call waits for the compile started
        ahead), or None: the jit path compiles the batch's step (logged when new)."""
        self.wait_ahead(kind)
        ahead = self._ahead[kind].get(_ahead_key(batch.arrays, batch.capacity, batch.bounded))
        if ahead is None:
            self._note_compile(kind, batch.arrays, batch.capacity, batch.bounded)
        else:
            self.compiled.add((kind, *compile_key(batch.arrays, batch.capacity, batch.bounded)))
        return ahead

    def compile_ahead(self, state: Any, arrays: Mapping[str, Any], capacity: int | None, *,
                      bounded: bool = True, kernels_ahead: bool = True) -> None:
        """Start compiling the train step for batches like ``arrays`` (ShapeDtypeStructs with their
        shardings, e.g. :meth:`abstract_batch`) with this loss ``capacity`` in a background thread
        (``state``: :meth:`abstract_state`); the next :meth:`step` waits for it, and every batch of
        that shape, dtypes, capacity and ``bounded`` runs its executable. A batch of another shape
        compiles as usual; a compile that fails is logged and the step compiles as usual.
        ``kernels_ahead``: the step's Mosaic-GPU kernels compiled alone in other threads beside it
        (``gmm_mgpu.Recording.compile_ahead``; none off a Hopper GPU)."""
        if self._ahead_threads["train"] is not None:
            self._ahead_threads["train"].join()
        self._ahead_threads["train"] = _compile_in_thread(
            "train", lambda: self.lower_step(state, arrays, capacity, bounded=bounded), self._ahead["train"],
            _ahead_key(arrays, capacity, bounded), arrays, capacity, kernels_ahead, "the first step compiles it")

    def compile_eval_ahead(self, params: Any, arrays: Mapping[str, Any], capacity: int | None, *,
                           bounded: bool = True, kernels_ahead: bool = True) -> None:
        """Start compiling the eval step for batches like ``arrays`` (ShapeDtypeStructs with their shardings, e.g.
        :meth:`abstract_eval_batch`) with this loss ``capacity`` in a background thread, once the train step
        :meth:`compile_ahead` started is compiled (``params``: the abstract state's); the next :meth:`evaluate` waits
        for it, and every eval batch of that shape, dtypes, capacity and ``bounded`` runs its executable. It
        compiles while the first training steps run, so without XLA's autotuning (``xla_gpu_autotune_level`` 0:
        the library's default algorithms for the eval's GEMMs, no candidates run on the device while the training
        step holds its memory); a compile that fails is logged and the evaluation compiles as usual."""
        if self._ahead_threads["eval"] is not None:
            self._ahead_threads["eval"].join()
        self._ahead_threads["eval"] = _compile_in_thread(
            "eval", lambda: _eval_step.lower(params, dict(arrays), spec=self.spec, capacity=capacity, bounded=bounded),
            self._ahead["eval"], _ahead_key(arrays, capacity, bounded), arrays, capacity, kernels_ahead,
            "the evaluation compiles it", options=EVAL_AHEAD_OPTIONS,
            after=self._ahead_threads["train"])  # the training step first: the first step waits for that one

    def lower_step(self, state: Any, arrays: Mapping[str, Any], capacity: int | None = None, *,
                   bounded: bool = False, trace_only: bool = False) -> Any:
        """The train step for these (concrete or ``ShapeDtypeStruct``) inputs, ahead of time: ``Lowered``
        (``.compile()`` fills :meth:`step`'s cache; ``bounded`` as the batch's), or ``Traced``."""
        stage = _train_step.trace if trace_only else _train_step.lower
        return stage(state, dict(arrays), spec=self.spec, capacity=capacity, bounded=bounded)

    def lower_init(self, seed: int = 0) -> Any:
        """``Lowered`` of :meth:`init_state`'s compiled initialiser (e.g. to compile with options)."""
        return _init_state.lower(spec=self.spec, seed=seed)

    def evaluate(self, params: PyTree, host_batch: Mapping[str, Any]) -> tuple[dict[str, float], np.ndarray]:
        """Teacher-forced eval of one batch: ({ce_sum, tokens}, argmax predictions ``[B, S]`` int32
        for this process's rows; -1 where the loss mask is 0 when trained positions were gathered)."""
        batch = self.prepare(host_batch, train=False)
        ahead = self._compiled_ahead("eval", batch)
        if ahead is None:
            metrics, pred, idx = _eval_step(params, batch.arrays, spec=self.spec, capacity=batch.capacity,
                                            bounded=batch.bounded)
        else:
            self.ahead_evals += 1
            metrics, pred, idx = ahead(params, batch.arrays)
        pred = sharding.host_rows(pred)
        if idx is None:
            return {k: float(v) for k, v in jax.device_get(metrics).items()}, pred
        idx = sharding.host_rows(idx)
        b, s = np.shape(host_batch["targets"])
        full = np.full((b, s), -1, np.int32)
        groups, slots = np.nonzero(idx >= 0)
        flat = idx[groups, slots]
        full[groups * (b // idx.shape[0]) + flat // s, flat % s] = pred[groups, slots]
        return {k: float(v) for k, v in jax.device_get(metrics).items()}, full


# The eval step compiled ahead compiles while training runs: no autotuning (no candidate kernels run on the device,
# no buffers allocated for them next to the training step's); XLA:CPU ignores the option.
EVAL_AHEAD_OPTIONS = {"xla_gpu_autotune_level": 0}


def _compile_in_thread(kind: str, lower, into: dict, key: tuple, arrays: Mapping[str, Any], capacity: int | None,
                       kernels_ahead: bool, fallback: str, options: Mapping[str, Any] | None = None,
                       after: threading.Thread | None = None) -> threading.Thread:
    """Lower (``lower()``) and compile a step in a started thread (once ``after`` has ended), its executable put in
    ``into[key]``; the step's Mosaic-GPU kernels compiled alone in other threads while XLA compiles the step (which
    then finds them compiled; ``gmm_mgpu.Recording.compile_ahead``). A failure is logged (``fallback``: what happens
    instead)."""

    def work() -> None:
        if after is not None:
            after.join()
        t0 = time.perf_counter()
        try:
            with gmm_mgpu.recording() as kernels:
                lowered = lower()
            compiling = kernels.compile_ahead() if kernels_ahead else []
            into[key] = lowered.compile(compiler_options=dict(options) if options else None)
        except Exception as e:  # noqa: BLE001 - the step compiles the usual way instead
            log.warning("%s step compiled ahead failed (%s: %s); %s", kind, type(e).__name__,
                        str(e).splitlines()[0][:300] if str(e) else "", fallback)
            return
        shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in arrays.items() if k in ("input_ids", "pixel_values"))
        log.info("%s step compiled ahead (%s; loss capacity %s) in %.1f s%s", kind, shapes, capacity or "full rows",
                 time.perf_counter() - t0,
                 f" ({len(compiling)} Mosaic-GPU kernels compiled beside it)" if compiling else "")

    # not a daemon: a run that fails while XLA compiles here waits for the compile at exit, instead of tearing the
    # interpreter down under it (a segmentation fault on the H200, after a clear error)
    thread = threading.Thread(target=work, name=f"compile-ahead-{kind}", daemon=False)
    thread.start()
    return thread


def build_mesh(layout: Layout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The layout's mesh over ``devices`` (default: all devices), hybrid over the hosts of a multi-process run."""
    devices = list(devices if devices is not None else jax.devices())
    hosts = None
    if jax.process_count() > 1:
        by_process = host_ids()
        hosts = [by_process[d.process_index] for d in devices]
    mesh = layout.make_mesh(devices, hosts)
    log.info("mesh %s over %d %s devices", {a: n for a, n in mesh.shape.items() if n > 1} or "{1 device}",
             mesh.devices.size, mesh.devices.flat[0].platform)
    return mesh


def check_dest_groups(arrays: Mapping[str, np.ndarray], groups: int) -> None:
    """Raise when a merged visual token's ``patch_dest`` leaves its row group: the host rows split into
    ``groups`` consecutive groups (microbatches x this process's data-parallel ranks), and a vision row may only
    feed decoder rows of its own group (``data.balance_group`` as the run config derives it)."""
    seg, dest = arrays["patch_segment_ids"], arrays["patch_dest"]
    rows, s = dest.shape[0], arrays["input_ids"].shape[-1]
    if rows % groups:
        raise ValueError(f"{rows} host rows do not split into {groups} row groups")
    size = rows // groups
    vision_row = np.broadcast_to(np.arange(rows)[:, None], dest.shape)
    target = vision_row + np.floor_divide(dest, s)
    bad = (seg > 0) & ((target // size != vision_row // size) | (target < 0) | (target >= rows))
    if bad.any():
        v = int(np.argwhere(bad)[0][0])
        raise ValueError(f"batch['patch_dest']: vision row {v} feeds decoder row {int(target[bad][0])} outside its "
                         f"group of {size} rows (the microbatch of one data-parallel rank): build the loader with "
                         f"data.balance_group dividing {size} (a run derives it from train.micro_batch_size)")


def _counts(arrays: Mapping[str, np.ndarray]) -> dict[str, float]:
    seg = arrays["segment_ids"]
    return {"tokens": float(seg.size), "useful_tokens": float(np.count_nonzero(seg > 0)),
            "trained_tokens": float(np.count_nonzero(arrays["loss_mask"] > 0))}
