"""Per-component breakdown of one training step (``python -m bench.step --breakdown``).

Each component's forward + backward is compiled on its own and timed (median of ``iters`` calls,
``block_until_ready``) on the real shapes and the real intermediate values of one batch: one
forward pass first records every component's inputs (each decoder layer's input, its post-attention
residual, the routing, the expert-sorted token rows), so routing-dependent work (dispatch, grouped
matmuls) sees the routing the step saw. Gradients are taken with respect to the component's
parameters and inputs, with the step's remat policy (scanned layers go through ``run_stack``).

Components: vision encoder (patch embedding, position embedding, ViT blocks); projector (patch
merger, DeepStack mergers, scattering visual tokens into the token stream); token embedding + final
norm; decoder attention (input norm, q/k/v, MRoPE, attention, out-projection, residual; all layers);
router (post-attention norm, gate, softmax/top-k, routing statistics); permutation / dispatch (sort,
gather to expert order, weighted combine; the local dispatcher); experts (grouped matmuls + SwiGLU);
LM head + loss (trained-position gather, chunked cross-entropy); optimizer update (clip + AdamW on
the real, sharded train state); input wait (loader + host-to-device time per step, measured in the
timed loop). Forward/backward components run one data-parallel rank's rows of one micro-batch on the
first device (collectives are not in them) and are multiplied by ``grad_accum``. Their sum is
compared with the timed loop's median step, and without the input wait with the whole step timed on
the same batch by the same harness (what is not in any component: residual and DeepStack adds, router
losses, gradient-norm metrics, fusion across component boundaries, collectives).

Qwen3.5-MoE (:data:`QWEN35_COMPONENTS`): decoder attention is the gated full attention of the
full-attention layers; ``gdn`` is each linear-attention layer's Gated DeltaNet (input norm,
projections, causal conv, gates, chunked delta rule, gated norm, out-projection, residual); every
layer is MoE (router, dispatch, experts as above) and adds ``shared_expert`` (the dense SwiGLU shared
expert and its sigmoid gate, on every token); no DeepStack.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from moevlm_jax.model.layers import dtype_of, run_stack
from moevlm_jax.model.loss import lm_loss
from moevlm_jax.model.qwen3_vl_moe import scatter_visual_tokens, spread_placeholders
from moevlm_jax.model.registry import family_of
from moevlm_jax.model.rotary import mrope_cos_sin
from moevlm_jax.parallelism.dispatch import ExpertTopology
from moevlm_jax.parallelism.experts import resolve_options
from moevlm_jax.parallelism.hybrid import hybrid_buffer_ffn, hybrid_slots
from moevlm_jax.parallelism.permute import (
    capacity_ffn,
    combine_rows,
    dispatch_rows,
    expert_capacity,
    expert_ffn,
    inverse_slots,
    padded_slots,
    route_plan,
    sorted_slots,
)
from moevlm_jax.training import optimizer as optim
from moevlm_jax.training.objective import gather_trained, loss_capacity, most_trained

COMPONENTS: tuple[tuple[str, str], ...] = (
    ("vision_encoder", "vision encoder: patch + position embedding, ViT blocks"),
    ("projector", "projector: merger + DeepStack mergers + visual token scatter"),
    ("embedding_norm", "token embedding + final norm"),
    ("decoder_attention", "decoder attention: norm, qkv, MRoPE, attention, o_proj"),
    ("router", "router: norm, gate, softmax / top-k, routing stats"),
    ("dispatch", "permutation / dispatch: sort, gather, combine"),
    ("experts", "experts: grouped matmuls + SwiGLU"),
    ("lm_head_loss", "LM head + loss: gather trained, chunked CE"),
    ("optimizer", "optimizer update: clip + AdamW"),
    ("input_wait", "input wait: loader + host-to-device"),
)
_QWEN35_MIXERS = (
    ("decoder_attention", "gated attention: norm, q (+ gate) / k / v, q/k norms, partial MRoPE, attention, o_proj"),
    ("gdn", "Gated DeltaNet: norm, projections, conv, gates, chunked delta rule, gated norm, out_proj"),
)
QWEN35_COMPONENTS: tuple[tuple[str, str], ...] = (
    *COMPONENTS[:3], *_QWEN35_MIXERS, *COMPONENTS[4:7],
    ("shared_expert", "shared expert: SwiGLU + sigmoid gate, every token"), *COMPONENTS[7:],
)


def _qwen35(model: Any) -> bool:
    """Whether ``model`` is a Qwen3.5-MoE (hybrid GDN / gated attention, shared experts, no DeepStack)."""

    return family_of(model.config).name == "qwen3_5_moe"


def components_of(model: Any) -> tuple[tuple[str, str], ...]:
    """The breakdown's (name, description) rows for ``model``'s family."""
    return QWEN35_COMPONENTS if _qwen35(model) else COMPONENTS


def _params(*paths: str, exclude: bool = False) -> Any:
    match = nnx.Any(*[nnx.PathContains(p) for p in paths])
    return nnx.All(nnx.Param, nnx.Not(match) if exclude else match)


# ----------------------------------------------------------------------------- model pieces

def vision_encode(visual: Any, pixel_values: jax.Array, patch_rc: jax.Array, patch_hw: jax.Array,
                  patch_segment_ids: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """``VisionModel.encode``: final ViT output ``[B, P, C]`` and the DeepStack blocks' outputs
    ``[n_ds, B, P, C]`` in block order (None without DeepStack)."""
    x, feats = visual.encode(pixel_values, patch_rc, patch_hw, patch_segment_ids)
    return x, (jnp.stack(feats) if feats else None)


def project(model: Any, x: jax.Array, feats: jax.Array | None, input_ids: jax.Array,
            patch_segment_ids: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """``VisionModel.project`` + scatter onto the image tokens: ``[B, S, H]`` visual embeddings (zero
    elsewhere) and DeepStack features ``[n_ds, B, S, H]`` (None without DeepStack), as
    ``Qwen3VLMoe.hidden_states``."""
    cfg, dt = model.visual.cfg, dtype_of(model.compute.dtype)
    merged, ds = model.visual.project(x, [] if feats is None else list(feats))
    token_valid = patch_segment_ids[:, :: cfg.spatial_merge_size**2] > 0
    is_image = input_ids == model.config.image_token_id
    emb = scatter_visual_tokens(merged.astype(dt), is_image, token_valid)
    return emb, (None if ds is None else scatter_visual_tokens(ds.astype(dt), is_image, token_valid))


def router(mlp: Any, h: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """``SparseMoeBlock.routing``: top-k weights, ids ``[B, S, K]`` and stats."""
    _, _, top_w, top_i, stats = mlp.routing(h, valid)
    return top_w, top_i, stats


def slots(idx: jax.Array, w: jax.Array, experts: int, opts: Any) -> tuple[Any, jax.Array, jax.Array, int | None]:
    """The local dispatcher's routing plan (``parallelism.dispatch.local_experts``): plan, slot, src, capacity
    ('hybrid': the overflow counts stand in for the plan's counts, see ``hybrid.hybrid_slots``)."""
    if opts.backend == "hybrid":  # the hybrid branch of hybrid.hybrid_or_grouped (the forward check
        lay = hybrid_slots(idx, w, experts, opts.capacity_factor, opts.hybrid_overflow)  # flags the other)
        return SimpleNamespace(counts=lay.over_counts), lay.slot, inverse_slots(lay.slot, lay.size), lay.cap
    cap = None if opts.capacity_factor is None else expert_capacity(idx.shape[0], idx.shape[1], experts,
                                                                     opts.capacity_factor)
    plan = route_plan(idx, w, experts, cap, opts.drop_policy)
    if opts.backend == "capacity":
        slot = padded_slots(plan, cap)
        return plan, slot, inverse_slots(slot, experts * cap), cap
    slot = sorted_slots(plan)
    return plan, slot, inverse_slots(slot, slot.shape[0]), cap


def _intermediates(model: Any, batch: Mapping[str, jax.Array], opts: Any) -> dict[str, Any]:
    """One forward pass recording every component's inputs (mirrors ``Qwen3VLMoe.hidden_states`` /
    ``Qwen35Moe.hidden_states``)."""
    lm, tc, dt = model.language_model, model.config.text_config, dtype_of(model.compute.dtype)
    qwen35 = _qwen35(model)
    ids, seg = batch["input_ids"], batch["segment_ids"]
    images = batch.get("pixel_values") is not None and batch["pixel_values"].shape[1] > 0
    if qwen35 and images:  # as Qwen35Moe.hidden_states: placeholders read spread embedding rows

        x = lm.embed(spread_placeholders(ids, ids == model.config.image_token_id, tc.vocab_size))
    else:
        x = lm.embed(ids)
    out: dict[str, Any] = {"vis_x": None, "vis_feats": None}
    deepstack = None
    if images:
        out["vis_x"], out["vis_feats"] = vision_encode(model.visual, batch["pixel_values"], batch["patch_rc"],
                                                       batch["patch_hw"], batch["patch_segment_ids"])
        emb, deepstack = project(model, out["vis_x"], out["vis_feats"], ids, batch["patch_segment_ids"])
        x = jnp.where((ids == model.config.image_token_id)[..., None], emb, x)
    cos, sin = mrope_cos_sin(batch["positions"], _rotary_dim(model), tc.rope_theta, tc.mrope_section)
    n_ds = 0 if deepstack is None else deepstack.shape[0]
    groups = []
    for (kind, first, n), stack in zip(lm.groups, lm.stacks):
        def body(layer, h, i, side, kind=kind, with_ds=first < n_ds):
            cos, sin, seg, ds = side
            if kind == "linear_attention":  # Qwen3.5's Gated DeltaNet layers
                mid = h + layer.linear_attn(layer.input_layernorm(h), seg)
            else:
                mid = h + layer.self_attn(layer.input_layernorm(h), cos, sin, seg)
            hn = layer.post_attention_layernorm(mid)
            rec = {"x": h, "mid": mid}
            if kind == "moe" or qwen35:  # Qwen3.5: every layer is MoE
                y, _ = layer.mlp(hn, seg > 0)
                top_w, top_i, _ = router(layer.mlp, hn, seg > 0)
                b, s, hd = hn.shape
                tokens, idx = hn.reshape(b * s, hd), top_i.reshape(b * s, -1)
                w = top_w.reshape(b * s, -1).astype(dt)
                plan, slot, src, _ = slots(idx, w, layer.mlp.num_experts, opts)
                rec.update(hn=tokens, top_i=idx, top_w=w, rows=dispatch_rows(tokens, src, slot, idx.shape[1]),
                           counts=plan.counts)
            else:
                y = layer.mlp(hn)
            h = mid + y
            if with_ds:
                add = jax.lax.dynamic_index_in_dim(ds, jnp.minimum(i, n_ds - 1), keepdims=False)
                h = h + jnp.where(i < n_ds, add.astype(h.dtype), jnp.zeros_like(h))
            return h, rec

        x, rec = run_stack(stack, body, x, jnp.arange(first, first + n, dtype=jnp.int32), model.compute,
                           side=(cos, sin, seg, deepstack), side_axes=(0, 0, 0, 1), layer_offset=first)
        groups.append(rec)
    out.update(groups=groups, pre_norm=x, hidden=lm.norm(x))
    return out


def _rotary_dim(model: Any) -> int:
    """The MRoPE width: the whole head (Qwen3-VL) or its rotary share (Qwen3.5's partial rotary)."""
    tc = model.config.text_config
    return tc.rotary_dim if _qwen35(model) else tc.head_dim


# ----------------------------------------------------------------------------- components

def _components(model: Any, batch: Mapping[str, jax.Array], inter: Mapping[str, Any], opts: Any
                ) -> list[tuple[str, Callable, tuple, tuple]]:
    """(name, fn(*diff, *const), diff args, const args) per forward/backward component; the batch is
    the last const argument of each (an argument, not a compile-time constant)."""
    lm, compute, tc = model.language_model, model.compute, model.config.text_config
    dt = dtype_of(compute.dtype)
    qwen35, rot = _qwen35(model), _rotary_dim(model)
    attn_kinds = ("full_attention",) if qwen35 else ("moe", "dense")
    moe_kinds = ("full_attention", "linear_attention") if qwen35 else ("moe",)  # Qwen3.5: every layer is MoE
    comps = []
    if inter["vis_x"] is not None:
        v_gd, v_diff, v_rest = nnx.split(model.visual, _params("merger", "deepstack_merger_list", exclude=True), ...)

        def encoder(d, r, b):
            pix = (b["pixel_values"], b["patch_rc"], b["patch_hw"], b["patch_segment_ids"])
            return vision_encode(nnx.merge(v_gd, d, r), *pix)

        comps.append(("vision_encoder", encoder, (v_diff,), (v_rest, batch)))
        m_gd, m_diff, m_rest = nnx.split(model, _params("merger", "deepstack_merger_list"), ...)
        comps.append(("projector", lambda d, x, f, r, b: project(nnx.merge(m_gd, d, r), x, f, b["input_ids"],
                                                                   b["patch_segment_ids"]),
                      (m_diff, inter["vis_x"], inter["vis_feats"]), (m_rest, batch)))
    e_gd, e_diff, e_rest = nnx.split(lm, _params("embed_tokens", "norm"), ...)

    def embed_norm(d, pre, r, b):
        m = nnx.merge(e_gd, d, r)
        return m.embed(b["input_ids"]), m.norm(pre)

    comps.append(("embedding_norm", embed_norm, (e_diff, inter["pre_norm"]), (e_rest, batch)))

    def per_stack(name: str, kinds: tuple[str, ...], paths: tuple[str, ...], body: Callable, carry: Callable,
                  xs_keys: tuple[str, ...], diff_xs: int) -> None:
        """One component scanned over the stacks of ``kinds`` (``run_stack``: the step's remat policy):
        ``body(layer, *per-layer inputs, segment_ids, cos, sin)`` summed over layers; diff = the
        ``paths`` parameters and the first ``diff_xs`` of the per-layer inputs ``xs_keys``."""
        sel = [(stack, rec) for (kind, _, _), stack, rec in zip(lm.groups, lm.stacks, inter["groups"]) if kind in kinds]
        if not sel:
            return
        splits = [nnx.split(stack, _params(*paths), ...) if paths else (*nnx.split(stack), None) for stack, _ in sel]
        gds = [sp[0] for sp in splits]
        diff = tuple((sp[1] if paths else None, tuple(rec[k] for k in xs_keys[:diff_xs]))
                     for sp, (_, rec) in zip(splits, sel))
        const = tuple((sp[2] if paths else sp[1], tuple(rec[k] for k in xs_keys[diff_xs:]))
                      for sp, (_, rec) in zip(splits, sel))

        def fn(diff, const, b):
            side = (b["segment_ids"], *mrope_cos_sin(b["positions"], rot, tc.rope_theta, tc.mrope_section))
            total = None
            for gd, (p, dxs), (rest, cxs) in zip(gds, diff, const):
                stack = nnx.merge(gd, p, rest) if paths else nnx.merge(gd, rest)
                acc, _ = run_stack(stack, lambda layer, c, x, sd: (jax.tree.map(jnp.add, c, body(layer, *x, *sd)),
                                                                   None),
                                   carry(dxs[0] if dxs else cxs[0]), (*dxs, *cxs), compute, side=side)
                total = acc if total is None else jax.tree.map(jnp.add, total, acc)
            return total

        comps.append((name, fn, (diff,), (const, batch)))

    def zeros(x):  # the accumulator of one layer's output
        return jnp.zeros(x.shape[1:], x.dtype)

    per_stack("decoder_attention", attn_kinds, ("self_attn", "input_layernorm"),
              lambda layer, x, seg, cos, sin: x + layer.self_attn(layer.input_layernorm(x), cos, sin, seg),
              zeros, ("x",), 1)
    if qwen35:
        per_stack("gdn", ("linear_attention",), ("linear_attn", "input_layernorm"),
                  lambda layer, x, seg, cos, sin: x + layer.linear_attn(layer.input_layernorm(x), seg),
                  zeros, ("x",), 1)

    def route_body(layer, mid, seg, cos, sin):
        top_w, _, stats = router(layer.mlp, layer.post_attention_layernorm(mid), seg > 0)
        return top_w, stats["prob_sums"], stats["z_sums"]

    rows, seq = batch["input_ids"].shape
    k, e = tc.num_experts_per_tok, tc.num_experts
    per_stack("router", moe_kinds, ("post_attention_layernorm", "gate"), route_body,
              lambda x: (jnp.zeros((rows, seq, k), jnp.float32), jnp.zeros((rows, e), jnp.float32),
                         jnp.zeros((rows,), jnp.float32)),
              ("mid",), 1)

    def dispatch_body(layer, tokens, w, idx, seg, cos, sin):
        _, slot, src, _ = slots(idx, w, e, opts)
        return combine_rows(dispatch_rows(tokens, src, slot, k), w, slot, src)

    per_stack("dispatch", moe_kinds, (), dispatch_body, zeros, ("hn", "top_w", "top_i"), 2)

    def experts_body(layer, rows, counts, seg, cos, sin):
        w_gu = layer.mlp.gate_up_proj[...].astype(dt)
        w_gu = w_gu.reshape(*w_gu.shape[:2], -1)
        w_down = layer.mlp.down_proj[...].astype(dt)
        if opts.backend == "capacity":
            return capacity_ffn(rows.reshape(e, -1, rows.shape[-1]), w_gu, w_down).reshape(rows.shape)
        if opts.backend == "hybrid":  # counts: the overflow counts; the capacity as hybrid_slots sets it
            cap = expert_capacity(batch["input_ids"].size, k, e, opts.capacity_factor)
            return hybrid_buffer_ffn(rows, counts, cap, w_gu, w_down, opts.overflow_backend)
        return expert_ffn(rows, counts, w_gu, w_down, opts.backend)

    per_stack("experts", moe_kinds, ("gate_up_proj", "down_proj"), experts_body, zeros, ("rows", "counts"), 1)

    if qwen35:
        def shared_body(layer, tokens, seg, cos, sin):  # SharedExpertMoeBlock's dense part on [B, S, H]
            hn = tokens.reshape(rows, seq, -1)
            y = jax.nn.sigmoid(layer.mlp.shared_expert_gate(hn)) * layer.mlp.shared_expert(hn)
            return y.reshape(tokens.shape)

        per_stack("shared_expert", moe_kinds, ("shared_expert", "shared_expert_gate"), shared_body, zeros, ("hn",), 1)

    capacity = loss_capacity(*most_trained(np.asarray(batch["loss_mask"]), 1, 1))  # as Trainer.prepare: static
    tied = model.lm_head is None
    kernel = lm.embed_tokens[...] if tied else model.lm_head.kernel[...]

    def head_loss(w, hidden, b):
        targets, mask = b["targets"], b["loss_mask"]
        total = jnp.maximum(jnp.sum(mask > 0).astype(jnp.float32), 1.0)
        if capacity is not None:
            hidden, targets, mask, _ = gather_trained(hidden, targets, mask, 1, capacity)
        return lm_loss(hidden, w.T if tied else w, targets, mask, compute.loss_chunk_size,
                       compute.logits_fp32)[0] / total

    comps.append(("lm_head_loss", head_loss, (kernel, inter["hidden"]), (batch,)))
    return comps


def _cotangent(tree: Any, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape), s.dtype), tree)


def _time(fn: Callable, args: tuple, iters: int) -> tuple[float, float]:
    """(median seconds per call, compile seconds) of a jitted ``fn(*args)``."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_s


def time_fwd_bwd(fn: Callable, diff: tuple, const: tuple, iters: int, seed: int = 0) -> tuple[float, float]:
    """Forward + backward of ``fn(*diff, *const)`` w.r.t. ``diff`` with a random output cotangent."""
    ct = _cotangent(jax.eval_shape(fn, *diff, *const), seed)

    def fwd_bwd(diff, const, ct):
        _, vjp = jax.vjp(lambda *d: fn(*d, *const), *diff)
        return vjp(ct)

    return _time(fwd_bwd, (diff, const, ct), iters)


def time_optimizer(trainer: Any, state: dict[str, Any], iters: int) -> tuple[float, float]:
    """Clip + AdamW + apply on the real (sharded) train state, as inside the step; consumes ``state``."""
    spec = trainer.spec
    tx, _ = optim.make_optimizer(spec.optimizer, spec.total_steps)
    mask, shard = trainer.trainable_mask, trainer.state_shardings

    def update(params, opt_state, grads):
        trainable, frozen = optim.partition(params, mask)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optim.combine(optax.apply_updates(trainable, updates), frozen), opt_state

    grads = jax.jit(lambda p: jax.tree.map(lambda x: (1e-3 * x).astype(jnp.float32), optim.partition(p, mask)[0]))(
        state["params"])
    step = jax.jit(update, donate_argnums=(0, 1), out_shardings=(shard["params"], shard["opt_state"]))
    t0 = time.perf_counter()
    compiled = step.lower(state["params"], state["opt_state"], grads).compile()
    compile_s = time.perf_counter() - t0
    params, opt_state = jax.block_until_ready(compiled(state["params"], state["opt_state"], grads))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        params, opt_state = jax.block_until_ready(compiled(params, opt_state, grads))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), compile_s


def run_breakdown(trainer: Any, state: dict[str, Any], host: Mapping[str, np.ndarray], *, step_time_s: float,
                  input_wait_s: float, iters: int) -> dict[str, Any]:
    """Time every component of one step on ``host`` (a batch the timed loop used) and compare their
    sum with ``step_time_s`` (the timed loop's median), and the sum without the input wait with the
    whole step run on ``host`` under the same harness. ``state`` is consumed (steps and the optimizer
    component donate it)."""
    spec = trainer.spec
    g, dp = spec.grad_accum, spec.dp_size
    rows = np.shape(host["input_ids"])[0] // (g * dp)
    dev = trainer.mesh.devices.flat[0]
    batch = {k: jax.device_put(np.asarray(v)[:, :rows] if k == "positions" else np.asarray(v)[:rows], dev)
             for k, v in host.items()}
    params = state["params"] if trainer.mesh.devices.size == 1 else jax.device_put(state["params"], dev)
    model = trainer.model(params)
    opts = resolve_options(ExpertTopology(), **model.compute.moe_options)
    components = components_of(model)
    graphdef, mstate = nnx.split(model)

    def record(st, b):  # the intermediates, and the model's own forward to check them against
        m = nnx.merge(graphdef, st)
        return _intermediates(m, b, opts), m.hidden_states(b)[0]

    inter, hidden = jax.jit(record)(mstate, batch)
    check = float(jnp.max(jnp.abs(hidden.astype(jnp.float32) - inter["hidden"].astype(jnp.float32))))
    del hidden
    results = {}
    for i, (name, fn, diff, const) in enumerate(_components(model, batch, inter, opts)):
        seconds, compile_s = time_fwd_bwd(fn, diff, const, iters, seed=i)
        results[name] = {"seconds": g * seconds, "compile_s": compile_s}
    del inter, model, mstate, params
    # the whole step on the same batch under the same harness (no loader): the like-for-like reference
    device_batch = trainer.prepare(host)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, device_batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t0)
    step_compute_s = statistics.median(times[1:])
    seconds, compile_s = time_optimizer(trainer, state, iters)
    results["optimizer"] = {"seconds": seconds, "compile_s": compile_s}
    results["input_wait"] = {"seconds": input_wait_s, "compile_s": 0.0}
    total = sum(r["seconds"] for r in results.values())
    comps = [{"name": n, "description": d, **results.get(n, {"seconds": 0.0, "compile_s": 0.0}),
              "present": n in results} for n, d in components]
    for c in comps:
        c["share"] = c["seconds"] / total if total else 0.0
    compute = total - input_wait_s
    return {"components": comps, "sum_s": total, "step_time_s": step_time_s,
            "diff_pct": 100.0 * (total - step_time_s) / step_time_s, "compute_sum_s": compute,
            "step_compute_s": step_compute_s, "compute_diff_pct": 100.0 * (compute - step_compute_s) / step_compute_s,
            "rows": rows, "grad_accum": g,
            "experts_backend": opts.backend, "forward_check_max_abs": check, "iters": iters}


def format_breakdown(bd: Mapping[str, Any]) -> str:
    """The breakdown as a table: component, ms, share; then the sum against the measured step."""
    lines = [f"  {'component':<18} {'ms':>9} {'share':>6}  what"]
    for c in bd["components"]:
        what = c["description"] if c["present"] else c["description"] + " (none in this model/batch)"
        lines.append(f"  {c['name']:<18} {c['seconds'] * 1e3:>9.2f} {100 * c['share']:>5.1f}%  {what}")
    lines.append(f"  {'sum':<18} {bd['sum_s'] * 1e3:>9.2f}         vs the timed loop's median step "
                 f"{bd['step_time_s'] * 1e3:.2f} "
                 f"ms: {bd['diff_pct']:+.1f}%")
    lines.append(f"  {'sum - input':<18} {bd['compute_sum_s'] * 1e3:>9.2f}         vs the step alone on this batch "
                 f"{bd['step_compute_s'] * 1e3:.2f} ms (same harness): {bd['compute_diff_pct']:+.1f}%")
    lines.append(f"  ({bd['rows']} rows x grad_accum {bd['grad_accum']}; experts {bd['experts_backend']}; median of "
                 f"{bd['iters']} calls; forward replica check max |diff| {bd['forward_check_max_abs']:.1e})")
    return "\n".join(lines)
