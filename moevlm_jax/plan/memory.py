"""The planner's analytic memory model: per-device bytes of the train step by part, no compile.

What the trainer's step (``moevlm_jax.training.trainer``) holds on one device, from the model
config, the layout (rules + mesh axis sizes: ``moevlm_jax.plan.geometry``), the compute section and the batch
shape. XLA's compiled memory analysis of the same step (``moevlm_jax.tools.memory.memory_report``)
is the reference it is checked against (tests/tools/test_plan.py, bench/results/plans.md).

Parts (bytes per device):

- ``params``: the parameter shards (``param_dtype``; the router's expert bias float32).
- ``optimizer``: AdamW's two moments of the trainable shards (``optimizer.state_dtype``).
- ``gradients``: the gradient shards of the trainable parameters live at the peak: the layer scan's
  backward writes them in the parameter dtype (float32 after it, ``training.optimizer.
  accumulate_gradients``, once the residuals are freed, except for one microbatch on one device);
  with grad_accum > 1 also the float32 sum.
- ``batch``: this device's rows of the step's batch (every microbatch), as the step's argument.
- ``activations``: the residuals the backward reads, per recompute policy (``model.compute``
  checkpoint names; :func:`decoder_residuals`, :func:`vision_residuals`: equal to jax's own list of
  saved residuals for tiny and small, tests/tools/test_plan.py), for every layer of every stack
  (a pipeline stage: its layers x every iteration, bubbles included), plus those outside the
  scanned stacks (rotary tables, mergers, final norm, the fused LM head's d(hidden), the scattered
  visual / DeepStack tokens). XLA:CPU stores the scanned stacks' compute-dtype residuals as float32
  (``residual_upcast``).
- ``saved_weights``: under recompute ``none`` the scan also saves each layer's weights as the
  layer used them (gathered over the FSDP axes, cast to the compute dtype): a whole extra
  compute-dtype copy of the decoder per device under FSDP; the mergers' always (no remat there).
- ``lm_head``: the fused cross-entropy's working set for one chunk of ``compute.loss_chunk_size``
  positions (of each row, or of the trained positions gathered per data-parallel rank:
  ``loss_capacity``): float32 logits and softmax (d(logits) reuses them), or after them the chunk's
  whole float32 d(kernel) before it is added to the carry, the gathered kernel in the compute dtype,
  the float32 d(kernel) carry: where the layout splits the LM head's rows or positions, each device's
  whole partial sum, reduced once after the chunks (and whole until XLA issues that reduction, with
  the other gradients': in the layers' backward too); else the kernel's shard (on XLA:CPU each
  chunk's contribution then all-reduced in the loop: two whole copies).
- ``embedding``: the float32 scatter-add target of the table's gradient (XLA allocates it before the
  forward): the table's own shard where the lookup spreads the table over the axes that split the
  ids (``parallelism.vocab``: every preset), else a whole gathered table; less the table's own
  gradient shard where that is float32 (for a bf16 table the shard is the target's cast); with
  grad_accum > 1 also the gathered table itself where the lookup or a tied LM head gathers it
  (loop-invariant: XLA hoists it out of the microbatch loop).
- ``gathered_weights``: one layer's weights gathered over the FSDP axes in the compute dtype, with
  their parameter-dtype gradients before the reduce-scatter (inside a layer's backward).
- ``moe_dispatch``: one MoE layer's transient expert buffers (SwiGLU's float32 halves, the
  dropless exchange's worst-case receive buffer of EP x T x K rows; on CPU the grouped matmul's
  dense expansion over every local expert, ``dense_grouped_matmul``).
- ``attention``: one attention call's transient (XLA path: the float32 scores and probabilities
  of every head pair; cuDNN: its workspace, ``CUDNN_WORKSPACE`` assumed).
- ``xla_temporaries``: ``XLA_HEADROOM`` of the live temporaries: what XLA's buffer packing adds
  over the peak of the live buffers. Measured on XLA:CPU from its buffer-assignment dumps: 0-2% for
  most points, 9-17% for a few whose peak holds several vocabulary-sized buffers of different
  lifetimes (bench/results/plans.md); the analytic parts match XLA's peak of live buffers to ~1% there.

Peak: parameters, optimizer state and batch live through the step (the state is donated: the new
state reuses it); then the largest of three phases: the end of the forward (the LM head's chunk and
the embedding's gradient buffer), a layer's backward (gathered weights, expert buffers, attention,
the d(kernel) residual), both with every residual and (under the layer scan, whose backward writes
the stacked gradients) the parameter-dtype gradients live; or the optimizer (the float32 gradients, in
the parameter dtype for one microbatch on one device; the residuals gone). Unrolled layers
(``compute.scan_layers: false``) free a layer's residuals as its gradients appear, so the gradients are
not added to the residuals there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from moevlm_jax.model.compute import CHECKPOINT_NAMES, checkpoint_names_of
from moevlm_jax.plan.geometry import (
    DTYPE_BYTES,
    Geometry,
    ParamInfo,
    ShardInfo,
    lookup_spread,
    shard_table,
)

GIB = 2**30
# of the live temporaries: XLA:CPU's heap packing (0-17% over the live peak; bench/results/plans.md)
XLA_HEADROOM = 0.06
CUDNN_WORKSPACE = 64 * 2**20  # per attention call (assumed)
PARTS = ("params", "optimizer", "gradients", "batch", "activations", "saved_weights", "lm_head", "embedding",
         "gathered_weights", "moe_dispatch", "attention", "xla_temporaries")


@dataclasses.dataclass(frozen=True)
class MemoryKnobs:
    """The settings memory depends on besides the layout (a run's compute / optimizer / train fields)."""

    dtype: str = "bfloat16"  # compute dtype
    param_dtype: str = "float32"
    state_dtype: str = "float32"
    accum_dtype: str = "float32"  # the gradient sum over microbatches (grad_accum > 1)
    recompute: str = "none"
    recompute_modules: tuple[str, ...] = ("core_attn",)
    vision_recompute: str | None = None
    vision_recompute_modules: tuple[str, ...] | None = None
    offload: tuple[str, ...] = ()
    frozen: frozenset[str] = frozenset()  # parameter groups: vision_model, vision_projection, language_model
    grad_accum: int = 1
    capacity_factor: float | None = None  # None: dropless experts
    loss_chunk: int = 2048
    attention: str = "xla"  # the attention path: xla (CPU) | cudnn (GPU)
    expert_bias: bool = False
    scan_layers: bool = True  # the decoder's (compute.stack_scan("text")): it holds nearly all stacked weights
    loss_capacity: int | None = None  # trained positions the LM head sees per data-parallel rank (None: whole rows)
    # XLA:CPU converts the scanned layers' compute-dtype residuals to float32 between the forward and the
    # backward scan (a convert sunk out of the loop): they take 4 bytes an element there (bench/results/plans.md)
    residual_upcast: bool = False
    # XLA:CPU runs a reduce-scatter as an all-reduce and a slice: a whole-size result buffer
    all_reduce_scatter: bool = False
    # the CPU's grouped matmul (jax.lax.ragged_dot) runs as a dense masked product over every local expert: its
    # backward holds [E_local, rows, H] float32 / bf16 buffers (bench/results/plans.md: 250 GiB of 30B-A3B's CPU step)
    dense_grouped_matmul: bool = False

    @classmethod
    def from_compute(cls, compute: Any, *, state_dtype: str = "float32", frozen: Any = (), grad_accum: int = 1,
                     platform: str = "cpu", loss_capacity: int | None = None,
                     accum_dtype: str = "float32") -> MemoryKnobs:
        """From a ComputeConfig (+ the optimizer's state dtype, frozen groups, accumulation, the platform
        whose attention path ``compute.attention: auto`` resolves to)."""
        attention = compute.attention if compute.attention != "auto" else ("cudnn" if platform == "gpu" else "xla")
        moe = compute.moe
        cf = moe.capacity_factor if moe.backend != "hybrid" else None
        return cls(dtype=compute.dtype, param_dtype=compute.param_dtype, state_dtype=state_dtype,
                   accum_dtype=accum_dtype,
                   recompute=compute.recompute, recompute_modules=tuple(compute.recompute_modules),
                   vision_recompute=compute.vision_recompute,
                   vision_recompute_modules=None if compute.vision_recompute_modules is None
                   else tuple(compute.vision_recompute_modules),
                   offload=tuple(compute.offload), frozen=frozenset(frozen), grad_accum=int(grad_accum),
                   capacity_factor=cf, loss_chunk=compute.loss_chunk_size, attention=attention,
                   expert_bias=compute.router.expert_bias, scan_layers=compute.stack_scan("text"),
                   loss_capacity=loss_capacity,
                   residual_upcast=platform == "cpu" and compute.scan_layers and compute.dtype != "float32",
                   all_reduce_scatter=platform == "cpu",
                   dense_grouped_matmul=platform == "cpu" and moe.backend in ("auto", "ragged_dot"))

    @property
    def residual_bytes(self) -> int:
        """Bytes an element of a scanned layer's compute-dtype residual takes."""
        return 4 if self.residual_upcast else DTYPE_BYTES[self.dtype]

    def tower(self, tower: str) -> tuple[str, tuple[str, ...]]:
        """(mode, recompute modules) of the decoder ("text") or the vision tower."""
        if tower == "vision":
            mode = self.recompute if self.vision_recompute is None else self.vision_recompute
            mods = self.recompute_modules if self.vision_recompute_modules is None else self.vision_recompute_modules
            return mode, tuple(mods)
        return self.recompute, self.recompute_modules

    def saved_names(self, tower: str) -> frozenset[str] | None:
        """Checkpoint names a tower's layers keep on the device (None: recompute none, autodiff keeps all)."""

        mode, mods = self.tower(tower)
        offload = set(checkpoint_names_of(self.offload))
        if mode == "none":
            return None
        if mode == "full":
            return frozenset()
        return frozenset(n for n in CHECKPOINT_NAMES if n not in set(checkpoint_names_of(mods)) and n not in offload)


@dataclasses.dataclass
class MemoryEstimate:
    """Per-device bytes by part (``PARTS``), their sum ``total`` and details of the activations."""

    parts: dict[str, float]
    detail: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> float:
        return float(sum(self.parts.values()))

    def gib(self) -> dict[str, float]:
        return {k: v / GIB for k, v in self.parts.items()}


# ----------------------------------------------------------------------------- expert rows


def expert_rows(model: Any, g: Geometry, capacity_factor: float | None) -> float:
    """Rows one device's experts run per MoE layer call: dropless local T x K; dropless all-to-all
    EP x T x K (the exchange's static receive buffer, ``parallelism.dispatch._alltoall``);
    drop-and-pad E x ceil(T x K / E x factor) either way."""
    t = model.text_config
    a = g.moe_tokens * t.num_experts_per_tok
    if capacity_factor is not None:
        return t.num_experts * math.ceil(a / t.num_experts * capacity_factor)
    return a * g.ep if g.ep > 1 else a


# ----------------------------------------------------------------------------- residuals per layer


def decoder_residuals(model: Any, g: Geometry, knobs: MemoryKnobs, kind: str = "moe") -> dict[str, float]:
    """Bytes one decoder layer leaves for the backward on one device, by checkpoint name (selective
    / full) or by what autodiff keeps (none), for one microbatch."""
    t = model.text_config
    c, f = knobs.residual_bytes, 4
    h, d = t.hidden_size, t.head_dim
    nq, nkv = t.num_attention_heads / g.tp_q, t.num_key_value_heads / g.tp_kv
    tr, ta = g.tokens_res, g.tokens_att
    e, k = t.num_experts, t.num_experts_per_tok
    inner = t.moe_intermediate_size / g.etp
    rows = expert_rows(model, g, knobs.capacity_factor) if kind == "moe" else 0.0
    cudnn = knobs.attention == "cudnn"
    saved = knobs.saved_names("text")
    out: dict[str, float] = {"layer_input": tr * h * c}
    if saved is None:  # recompute none: what autodiff keeps (tests/tools/test_plan.py checks it against jax)
        out = {"hidden": tr * h * (2 * c + 3 * f) + ta * h * c,
               "q": ta * nq * d * (3 * c + f), "kv": ta * nkv * d * (3 * c + f),
               "norm_stats": tr * 8 * f + ta * 2 * (nq + nkv) * f}
        if cudnn:
            out["core_attn"] = ta * nq * d * c + ta * nq * f
        else:  # XLA: the probabilities (compute dtype) and the masked float32 scores of every head pair, and the
            # softmax's float32 max / sum
            out["scores"] = g.rows * nq * (g.seq / g.cp) * (g.seq * (c + f) + 2 * f)
        if kind == "moe":
            a = g.moe_tokens * k
            out["router"] = tr * e * f + tr * k * (c + f + 4) + 2 * a * 4
            out["experts"] = rows * h * 2 * c + rows * inner * (c + 5 * f)
        else:
            out["mlp"] = ta * t.intermediate_size / g.tp_mlp * (c + 5 * f)
        return out
    if "layernorm" in saved:
        out["layernorm"] = 2 * tr * h * c + ta * (nq + nkv) * d * c
    if "qkv_proj" in saved:
        out["qkv_proj"] = ta * (nq + 2 * nkv) * d * c
    if "core_attn" in saved:
        out["core_attn"] = ta * nq * d * c
        if cudnn:  # the kernel's own residuals: its (rotated) q, k, v, its output, float32 softmax stats
            out["core_attn"] += ta * (2 * nq + 2 * nkv) * d * c + ta * nq * f
    if "attn_out" in saved:
        out["attn_out"] = ta * h * c
    if kind == "moe":
        if "moe_router" in saved:
            out["moe_router"] = tr * e * f
        for name, width in (("moe_permuted", h), ("moe_gate_up", 2 * inner), ("moe_act", inner),
                            ("moe_expert_out", h)):
            if name in saved:
                out[name] = rows * width * c
    elif "mlp_hidden" in saved:
        out["mlp_hidden"] = 2 * ta * t.intermediate_size / g.tp_mlp * c
    return out


def vision_residuals(model: Any, g: Geometry, knobs: MemoryKnobs) -> dict[str, float]:
    """Bytes one vision block leaves for the backward on one device (over the row's patches)."""
    v = model.vision_config
    c, f = knobs.residual_bytes, 4
    p = g.vis_rows * g.patches
    ch, hd = v.hidden_size, v.head_dim
    nh, width = v.num_heads / g.tp_vis_heads, v.intermediate_size / g.tp_vis_mlp
    cudnn = knobs.attention == "cudnn"
    saved = knobs.saved_names("vision")
    if saved is None:
        # two LayerNorms keep three float32 [P, C] and two [P] each; tanh-GELU six [P, I] of its internals
        out = {"hidden": p * ch * (2 * c + 6 * f) + 4 * p * f, "qkv": 4 * p * nh * hd * c, "mlp": 6 * p * width * c}
        if cudnn:
            out["core_attn"] = p * nh * f
        else:  # the probabilities, the masked float32 scores and the softmax's max / sum
            out["scores"] = g.vis_rows * nh * g.patches**2 * (c + f) + 2 * p * nh * f
        return out
    out = {"layer_input": p * ch * c}
    if "layernorm" in saved:
        out["layernorm"] = 2 * p * ch * c
    if "qkv_proj" in saved:
        out["qkv_proj"] = 3 * p * nh * hd * c
    if "core_attn" in saved:
        out["core_attn"] = p * nh * hd * c + (3 * p * nh * hd * c + p * nh * hd * c + p * nh * f if cudnn else 0)
    if "attn_out" in saved:
        out["attn_out"] = p * ch * c
    if "mlp_hidden" in saved:
        out["mlp_hidden"] = p * width * c
    return out


def _layer_weights(shards: tuple[ShardInfo, ...], prefix: str) -> float:
    """Elements one device uses of one layer of the stacks under ``prefix`` (FSDP axes gathered)."""
    return sum(s.local * s.fsdp_size / s.param.shape[0] for s in shards
               if s.param.path.startswith(prefix) and len(s.param.shape) >= 2)


def outside_residuals(model: Any, g: Geometry, knobs: MemoryKnobs, vision_trained: bool,
                      projection_trained: bool) -> dict[str, float]:
    """Residuals outside the scanned stacks (any policy): rotary tables, final norm, the fused LM head's
    d(hidden) and float32 d(kernel), the visual / DeepStack tokens scattered into the sequence, the
    patch embedding's input and the mergers (never rematerialised)."""
    t, v = model.text_config, model.vision_config
    c, f = DTYPE_BYTES[knobs.dtype], 4
    none = knobs.recompute == "none"
    tr, ta = g.out_tokens_res, g.out_tokens_att  # outside the decoder's pipeline: every batch axis splits rows
    out = {"rotary": (4 if none else 2) * ta * t.head_dim * f,
           "final_norm": tr * t.hidden_size * (f + c),
           "lm_head_grads": ta * t.hidden_size * c}  # d(hidden); the float32 d(kernel) is in the phases
    if g.patches:
        p = g.vis_rows * g.patches
        n_ds = len(v.deepstack_visual_indexes)
        out["visual_tokens"] = tr * t.hidden_size * (c * (1 + n_ds) + 1) + (tr * t.hidden_size * c if none else 0)
        if vision_trained:
            out["patch_input"] = p * v.patch_dim * c + p * 4 * 8 + 2 * p * v.head_dim * f
        if projection_trained or vision_trained:
            out["mergers"] = (1 + n_ds) * (3 * p * v.hidden_size * f + 5 * p * v.hidden_size * c)
    return out


# ----------------------------------------------------------------------------- the estimate


def _trainable(p: ParamInfo, frozen: frozenset[str]) -> bool:
    return p.trainable and p.group not in frozen


def estimate_memory(model: Any, g: Geometry, knobs: MemoryKnobs) -> MemoryEstimate:
    """Per-device memory of the train step at this point (see the module docstring for the parts)."""
    t, v = model.text_config, model.vision_config
    shards = shard_table(model, knobs.param_dtype, knobs.expert_bias, g.rules, g.shape)
    params = tuple(s.param for s in shards)
    c, pb, sb = DTYPE_BYTES[knobs.dtype], DTYPE_BYTES[knobs.param_dtype], DTYPE_BYTES[knobs.state_dtype]
    local = {s.param.path: s.local for s in shards}
    gathered = {s.param.path: s.local * s.fsdp_size for s in shards}
    param_bytes = sum(local[p.path] * DTYPE_BYTES[p.dtype] for p in params)
    trainable = sum(local[p.path] for p in params if _trainable(p, knobs.frozen))
    ga = knobs.grad_accum
    # the layer scan's backward writes its stacked gradients in the parameter dtype (float32 after the scan,
    # when the residuals are gone); with accumulation the sum over the microbatches (optimizer.grad_accum_dtype)
    # is live too, and each microbatch's gradients are cast to its dtype
    # ... float32 where the sharding sums them over devices; one microbatch on one device keeps the parameter
    # dtype (moevlm_jax.training.optimizer.accumulate_gradients' single_dtype)
    one_device = math.prod(g.shape.values()) == 1
    ab = DTYPE_BYTES[knobs.accum_dtype] if ga > 1 else (pb if one_device else 4)
    grads = trainable * pb + (trainable * ab if ga > 1 else 0)
    grads_f32 = trainable * ab
    # unrolled layers: the sum of the earlier microbatches is live through every later one
    accumulator = trainable * ab if ga > 1 else 0
    optimizer = 2 * trainable * sb
    vision_trained = "vision_model" not in knobs.frozen
    projection_trained = "vision_projection" not in knobs.frozen
    language_trained = "language_model" not in knobs.frozen

    # batch: every microbatch's rows of this device (int32 ids / positions / segments / targets, float32 mask,
    # float32 pixels + int32 patch coordinates and segments)
    batch = ga * g.mbs * g.seq * (4 * 4 + 3 * 4)
    if g.patches:
        batch += ga * g.mbs * g.patches * (v.patch_dim * 4 + 5 * 4)

    # residuals: decoder stacks (MoE / dense), vision stacks, outside
    kinds = t.layer_kinds
    n_moe, n_dense = sum(kd == "moe" for kd in kinds), sum(kd == "dense" for kd in kinds)
    per_layer_layers = 1.0 / g.stages  # a stage holds its share of the layers
    factor = g.stage_layers_factor * g.microbatches if g.stages > 1 else 1.0  # all microbatches of a stage
    moe_res = decoder_residuals(model, g, knobs, "moe") if n_moe else {}
    dense_res = decoder_residuals(model, g, knobs, "dense") if n_dense else {}
    dec = sum(moe_res.values()) * n_moe + sum(dense_res.values()) * n_dense
    dec *= per_layer_layers * factor
    vis = 0.0
    if g.patches and vision_trained:
        vis = sum(vision_residuals(model, g, knobs).values()) * v.depth
    outside = outside_residuals(model, g, knobs, vision_trained, projection_trained) if language_trained or g.patches \
        else {}
    activations = dec + vis + sum(outside.values())
    detail = {f"decoder.{k}": val * (n_moe if k in moe_res else n_dense) * per_layer_layers * factor
              for k, val in {**dense_res, **moe_res}.items()}
    detail.update({f"vision.{k}": val * v.depth for k, val in (vision_residuals(model, g, knobs).items()
                                                                if g.patches and vision_trained else ())})
    detail.update({f"outside.{k}": val for k, val in outside.items()})

    # under recompute none the scan saves each layer's weights as used (gathered, compute dtype)
    saved_weights = 0.0
    if knobs.recompute == "none":
        cr = knobs.residual_bytes
        saved_weights += _layer_weights(shards, "language_model/stacks/") * t.num_hidden_layers \
            * per_layer_layers * cr
        if g.patches and vision_trained and knobs.tower("vision")[0] == "none":
            saved_weights += _layer_weights(shards, "visual/blocks/") * v.depth * cr
    if g.patches and (projection_trained or vision_trained):  # mergers + patch embedding: outside any remat
        for p in params:
            if p.path.startswith(("visual/merger/", "visual/deepstack_merger_list/", "visual/patch_embed/")) \
                    and p.path.endswith("kernel"):
                saved_weights += gathered[p.path] * c

    # transients
    vocab_l = t.vocab_size / g.tp_vocab
    # the LM head sees the trained positions of each data-parallel rank's rows (``loss_capacity`` of them,
    # gathered first: training.objective.gather_trained) or whole rows (None)
    if knobs.loss_capacity is not None:
        positions, rows_head = knobs.loss_capacity, 1
    else:
        positions, rows_head = g.seq, g.mbs
    chunk = min(knobs.loss_chunk, positions)
    logits = rows_head * chunk / g.cp * vocab_l
    head = next(p for p in params if p.path in ("lm_head/kernel", "language_model/embed_tokens")
                and (p.path == "lm_head/kernel" or model.tie_word_embeddings))
    head_gathered = gathered[head.path]
    chunks = math.ceil(positions / chunk)
    # the fused CE's float32 d(kernel) (model.loss._chunked_ce_fwd): where the layout splits the LM head's rows or
    # positions, each device's own sum over its chunks, whole ([H, V/tp]), reduced over the devices once after the
    # scan (XLA issues that reduction with the other gradients' at the backward's end: whole until then); else a
    # carry like the kernel (each chunk's contribution reduced into it); a residual until the backward's end
    split = g.dp * g.cp > 1
    dk = (head_gathered if split else local[head.path]) * 4 if language_trained else 0.0
    # float32 logits and softmax of one chunk (d(logits) reuses them), the gathered kernel in the compute
    # dtype (tied: the gathered table and its transpose), the d(kernel) carry; after the softmax a chunk's whole
    # float32 d(kernel) contribution before it is added (unsplit, XLA:CPU reduces it in the loop by an
    # all-reduce: a second whole copy)
    contribution = head_gathered * 4 * (2 if knobs.all_reduce_scatter and not split else 1) if language_trained else 0.0
    # tied, over several chunks: the gathered table and a transposed copy for the chunk loop (XLA:CPU; float32
    # compute reads the gather's own output)
    copies = 2 if model.tie_word_embeddings and knobs.dtype != "float32" and chunks > 1 else 1
    lm_head = max(logits * 2 * 4, contribution) + head_gathered * DTYPE_BYTES[knobs.dtype] * copies \
        + (dk if chunks > 1 else 0)
    embed = next(p for p in params if p.path == "language_model/embed_tokens")
    # the lookup gathers the table where its FSDP axes do not split the ids too (else: the ids gathered, the
    # rows returned by all-to-all, parallelism.vocab.embed_lookup), a tied LM head always
    spread = bool(lookup_spread(g.rules, g.shape))
    table = local[embed.path] if spread else gathered[embed.path]
    # the float32 scatter-add target of the table's gradient (parallelism.vocab.take_rows): the table as the
    # lookup has it (XLA allocates it early), less the table's own gradient shard when that is float32 too
    # (counted in ``gradients``; where it is that shard, the two are one buffer; a bf16 shard is its cast)
    own = local[embed.path] * 4 if DTYPE_BYTES[embed.dtype] == 4 else 0.0
    embedding = table * 4 - own if language_trained else 0.0
    if ga > 1 and gathered[embed.path] > local[embed.path] and (not spread or model.tie_word_embeddings):
        # the gathered table is loop-invariant: XLA hoists it out of the microbatch loop (lives through the step)
        embedding += gathered[embed.path] * DTYPE_BYTES[embed.dtype]
    layer_gathered = _layer_weights(shards, "language_model/stacks/")
    gathered_weights = layer_gathered * (c + pb)
    moe_dispatch = 0.0
    if n_moe:
        rows = expert_rows(model, g, knobs.capacity_factor)
        inner = t.moe_intermediate_size / g.etp
        moe_dispatch = rows * (2 * inner * 4 + t.hidden_size * c) + (rows * t.hidden_size * c if g.ep > 1 else 0)
        if knobs.dense_grouped_matmul and knobs.capacity_factor is None:  # XLA:CPU's ragged_dot backward
            moe_dispatch += t.num_experts / g.ep * rows * (14 * t.hidden_size + 4 * inner)
    nq = t.num_attention_heads / g.tp_q
    if knobs.attention == "cudnn":
        attention = CUDNN_WORKSPACE
    else:
        attention = g.rows * nq * (g.seq / g.cp) * g.seq * (2 * 4 + c)

    # the peak: the end of the forward (the LM head's chunk) or inside a layer's backward; the stacked layers'
    # float32 gradients are live in both under the layer scan (XLA allocates the stacked gradient buffers
    # before the forward); unrolled, each layer's gradient appears as its residuals are freed, so the
    # gradients peak after the backward, with the residuals gone
    held = activations + saved_weights
    phases = {
        "forward_end": {"lm_head": lm_head, "embedding": embedding},
        "layer_backward": {"gathered_weights": gathered_weights, "moe_dispatch": moe_dispatch,
                           "attention": attention, "lm_head": dk, "embedding": embedding},
    }
    totals = {name: held + sum(ph.values()) + (grads if knobs.scan_layers else accumulator)
              for name, ph in phases.items()}
    totals["optimizer"] = grads_f32 + (trainable * 2 * sb if knobs.state_dtype != knobs.param_dtype else 0.0)
    peak = max(totals, key=totals.get)
    transients = dict.fromkeys(("lm_head", "embedding", "gathered_weights", "moe_dispatch", "attention"), 0.0)
    live = {"activations": 0.0, "saved_weights": 0.0, "gradients": grads}
    if peak != "optimizer":
        transients.update(phases[peak])
        live.update(activations=activations, saved_weights=saved_weights,
                    gradients=grads if knobs.scan_layers else accumulator)
    else:  # after the backward: the float32 gradients and the optimizer's casts
        live["gradients"] = grads_f32
        transients["gathered_weights"] = totals["optimizer"] - grads_f32
    live_temps = sum(live.values()) + sum(transients.values())
    parts = {"params": param_bytes, "optimizer": optimizer, "batch": batch, **live, **transients,
             "xla_temporaries": XLA_HEADROOM * live_temps}
    detail["peak_phase"] = peak
    return MemoryEstimate(parts={k: parts[k] for k in PARTS}, detail=detail)
