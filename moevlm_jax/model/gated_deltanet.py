"""The Gated DeltaNet (GDN) core of Qwen3.5-MoE's linear-attention layers as pure JAX functions,
following ``transformers.models.qwen3_5_moe.modeling_qwen3_5_moe`` (torch_chunk_gated_delta_rule,
torch_recurrent_gated_delta_rule, causal_conv1d_fn, Qwen3_5MoeRMSNormGated, Qwen3_5MoeGatedDeltaNet).

The layer, as HF runs it (no cache), in terms of the functions here::

    qkv = causal_conv1d(x @ W_qkv, conv_w)            # depthwise causal conv, then silu; channels [q | k | v]
    q, k, v = split(qkv, [Hk*Dk, Hk*Dk, Hv*Dv])        # -> [B, S, Hk, Dk], [B, S, Hk, Dk], [B, S, Hv, Dv]
    g, beta = gdn_gates(x @ W_a, x @ W_b, A_log, dt_bias)
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)
    y = gated_rms_norm(o, (x @ W_z).reshape(B, S, Hv, Dv), norm_w, eps).reshape(B, S, Hv*Dv) @ W_out

The gated delta rule (per value head; state ``S [Dk, Dv]``, float32)::

    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T (q_t * Dk**-0.5)

HF details this follows: q/k are L2-normalised inside the kernel (``use_qk_l2norm``, eps 1e-6 inside
the rsqrt of the *sum* of squares, in float32, after the head expansion), then q is always scaled by
Dk**-0.5; when value heads > key heads each q/k head serves ``Hv // Hk`` *consecutive* value heads
(``repeat_interleave``, not tiling); all math is float32, the output is cast back to q's dtype and
the state is float32.

Packed rows (``segment_ids [B, S]``: 1.. per packed sample, 0 = padding; a sample boundary is
wherever the id changes, so adjacent samples need different ids): the recurrent state and the conv
window restart at every boundary, so each sample's output equals running it alone from a zero
state; padding tokens get no update (beta = 0, no decay), output zeros and never mix with samples.

Context parallelism (a row's sequence split into shards): pass shard i's final state / final window
as shard i+1's ``initial_state`` / ``initial_window``. The carried value is applied to the tokens of
shard i+1's *first* segment only (those before its first id change) and is itself "the state of
shard i's last segment" (zeros if shard i ends in padding). The functions cannot see whether shard
i+1's first token continues that sample or starts a new one: the caller zeroes the carry for rows
where ``segment_ids_{i+1}[:, 0] != segment_ids_i[:, -1]`` (a sample starting exactly on the shard
boundary). Model code here names no mesh and no collectives.

Kernels (:func:`gated_delta_rule`, ``compute.gdn_kernel``): on GPUs the chunked rule runs in Pallas-Triton
kernels (``parallelism.gdn_triton``: the forward's intra-chunk work in one kernel over all chunks, the
sequential state walk in one kernel per direction, its own backward that recomputes the chunk factors in XLA);
the einsum form here is the CPU path and the reference the kernels are tested against. The context-parallel form
(:func:`chunk_gated_delta_rule_carry`, below) runs on the einsum path whatever the setting.

Shards in parallel (:func:`chunk_gated_delta_rule_carry`): the rule is affine in its initial state,
``S_final = P S_in + F`` and ``o_t = o_t^0 + S_in^T q~_t``, where F and o^0 are the zero-state run's
final state and outputs, ``P = prod_t exp(g_t) (I - beta_t k_t k_t^T)`` over the shard's first
segment (zero if the shard holds a boundary) and ``q~_t = P_{<=t}^T q_t`` (zero after the first
boundary). The state's value columns evolve independently, so one chunked run with the values
widened by Dk zero columns and the initial state ``[0 | I]`` gives all four: outputs ``[o^0 | q~]``,
final state ``[F | P]``. Every shard runs that at once; the incoming states then follow from the
(P, F) of the shards before (``parallelism.context.SequenceShards.incoming_state``) and each shard
adds ``S_in^T q~`` to its outputs (:func:`apply_incoming_state`). The cost: the state products with
Dv + Dk columns instead of Dv; the intra-chunk work (UT transform, q.k) is unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from moevlm_jax.parallelism import gdn_triton
from moevlm_jax.parallelism.gdn_triton import l2norm, segment_runs, unit_lower_inverse

Precision = jax.lax.PrecisionLike


def gdn_gates(a: jax.Array, b: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
    """a, b [B, S, Hv] (the in_proj_a / in_proj_b outputs), A_log, dt_bias [Hv] -> (g float32, beta in
    b's dtype) [B, S, Hv]: g = -exp(A_log) * softplus(a + dt_bias) (float32, as HF), beta = sigmoid(b)."""
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b)


def gated_rms_norm(x: jax.Array, z: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x, z [..., D], weight [D] -> [..., D] in x's dtype, as HF's Qwen3_5MoeRMSNormGated: norm x in
    float32, cast back to x's dtype, times weight (plain, not 1 + weight), times silu(z) in float32."""
    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    h = weight * h.astype(x.dtype)
    h = h * jax.nn.silu(z.astype(jnp.float32))
    return h.astype(x.dtype)


def _prepare(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, valid: jax.Array | None,
             use_qk_l2norm: bool, scale: float | None) -> tuple[jax.Array, ...]:
    """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g, beta [B, S, Hv] -> float32 q, k [B, Hv, S, Dk] (heads
    expanded, optionally L2-normalised, q scaled), v [B, Hv, S, Dv], g, beta [B, Hv, S]; padding zeroed."""
    hk, hv = k.shape[2], v.shape[2]
    if q.shape != k.shape or hv % hk or v.shape[:2] != k.shape[:2] or g.shape != v.shape[:3] or beta.shape != g.shape:
        raise ValueError(f"gated delta rule shapes: q {q.shape} k {k.shape} v {v.shape} g {g.shape} beta {beta.shape}")
    if hv != hk:  # each q/k head serves hv // hk consecutive value heads (HF's repeat_interleave)
        q, k = jnp.repeat(q, hv // hk, axis=2), jnp.repeat(k, hv // hk, axis=2)
    q, k, v, g, beta = (x.astype(jnp.float32) for x in (q, k, v, g, beta))
    if valid is not None:  # padding: no input (and no NaN from whatever it holds), no decay, no update
        q, k, v = (jnp.where(valid[:, :, None, None], x, 0.0) for x in (q, k, v))
        g, beta = (jnp.where(valid[:, :, None], x, 0.0) for x in (g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    return tuple(jnp.swapaxes(x, 1, 2) for x in (q, k, v, g, beta))


def _initial_state(initial_state: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
    """The float32 [B, Hv, Dk, Dv] starting state (zeros if None)."""
    if initial_state is None:
        return jnp.zeros(shape, jnp.float32)
    if initial_state.shape != shape:
        raise ValueError(f"initial_state shape {initial_state.shape}, expected {shape}")
    return initial_state.astype(jnp.float32)


def recurrent_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                               initial_state: jax.Array | None = None, segment_ids: jax.Array | None = None,
                               use_qk_l2norm: bool = False, scale: float | None = None,
                               precision: Precision = None) -> tuple[jax.Array, jax.Array]:
    """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g (log decay, <= 0), beta [B, S, Hv], initial_state
    [B, Hv, Dk, Dv], segment_ids [B, S] -> (out [B, S, Hv, Dv] in q's dtype, final state [B, Hv, Dk, Dv]
    float32): the token-by-token reference (lax.scan over time), as HF's torch_recurrent_gated_delta_rule."""
    b, s, _, dk = q.shape
    hv, dv = v.shape[2:]
    runs, valid = segment_runs(segment_ids) if segment_ids is not None else (None, None)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, valid, use_qk_l2norm, scale)
    if runs is None:
        reset = jnp.zeros((b, s), bool)
    else:  # the state restarts wherever a new segment starts (not at t = 0: the initial state)
        reset = jnp.concatenate([jnp.zeros_like(runs[:, :1], bool), runs[:, 1:] != runs[:, :-1]], axis=1)
    ein = lambda spec, x, y: jnp.einsum(spec, x, y, precision=precision)

    def step(state, xs):
        q_t, k_t, v_t, g_t, b_t, r_t = xs  # [B, H, D] / [B, H] / [B]
        state = jnp.where(r_t[:, None, None, None], 0.0, state) * jnp.exp(g_t)[..., None, None]
        delta = (v_t - ein("bhkv,bhk->bhv", state, k_t)) * b_t[..., None]
        state = state + k_t[..., :, None] * delta[..., None, :]
        return state, ein("bhkv,bhk->bhv", state, q_t)

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (qf, kf, vf, gf, bf)) + (jnp.moveaxis(reset, 1, 0),)
    state, out = jax.lax.scan(step, _initial_state(initial_state, (b, hv, dk, dv)), xs)
    out = jnp.moveaxis(out, 0, 1)  # [B, S, Hv, Dv]
    if valid is not None:
        out = jnp.where(valid[:, :, None, None], out, 0.0)
    return out.astype(q.dtype), state


def chunk_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                           chunk_size: int = 64, initial_state: jax.Array | None = None,
                           segment_ids: jax.Array | None = None, use_qk_l2norm: bool = False,
                           scale: float | None = None, precision: Precision = None) -> tuple[jax.Array, jax.Array]:
    """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g (log decay, <= 0), beta [B, S, Hv], initial_state
    [B, Hv, Dk, Dv], segment_ids [B, S] -> (out [B, S, Hv, Dv] in q's dtype, final state [B, Hv, Dk, Dv]
    float32): the chunked form (WY/UT transform within a chunk, lax.scan over chunks), as HF's
    torch_chunk_gated_delta_rule; packed segments by masks within a chunk and at the carried state."""
    b, s, _, dk = q.shape
    hv, dv = v.shape[2:]
    runs, valid = segment_runs(segment_ids) if segment_ids is not None else (None, None)
    qf, kf, vf, gf, bf = _prepare(q, k, v, g, beta, valid, use_qk_l2norm, scale)
    c = int(chunk_size)
    pad = (-s) % c
    n = (s + pad) // c
    # the tail padding to a whole chunk: zero inputs, no decay, no update, in the row's last segment
    qf, kf, vf = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))).reshape(b, hv, n, c, -1) for x in (qf, kf, vf))
    gf, bf = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))).reshape(b, hv, n, c) for x in (gf, bf))
    ein = lambda spec, *xs: jnp.einsum(spec, *xs, precision=precision)

    causal = jnp.tril(jnp.ones((c, c), bool))
    if runs is None:
        pair_mask, carry_mask, last_mask = causal, None, None
    else:
        r = jnp.pad(runs, ((0, 0), (0, pad)), mode="edge").reshape(b, n, c)
        prev = jnp.concatenate([r[:, :1, 0], r[:, :-1, -1]], axis=1)  # run of the token before each chunk
        pair_mask = (causal & (r[..., :, None] == r[..., None, :]))[:, None]  # [B, 1, N, C, C]
        carry_mask = (r == prev[..., None])[:, None]  # [B, 1, N, C]: the carried state reaches this token
        last_mask = (r == r[..., -1:])[:, None]  # [B, 1, N, C]: this token's update reaches the chunk's end

    gc = jnp.cumsum(gf, axis=-1)  # log decay from the chunk start to each position (inclusive)
    decay = jnp.exp(jnp.where(pair_mask, gc[..., :, None] - gc[..., None, :], -jnp.inf))  # [B, H, N, C, C]
    k_beta, v_beta = kf * bf[..., None], vf * bf[..., None]
    # UT transform: (I + strictly_lower(beta_i k_i.k_j decay_ij)) u = v_beta - (k_beta decay) S
    ut = ein("...id,...jd->...ij", k_beta, kf) * decay * (1.0 - jnp.eye(c, dtype=jnp.float32))
    t_inv = unit_lower_inverse(ut, precision)
    qd, kbd = qf * jnp.exp(gc)[..., None], k_beta * jnp.exp(gc)[..., None]
    kd = kf * jnp.exp(gc[..., -1:] - gc)[..., None]
    chunk_decay = jnp.exp(gc[..., -1])  # [B, H, N]
    if runs is not None:
        qd, kbd = (jnp.where(carry_mask[..., None], x, 0.0) for x in (qd, kbd))
        kd = jnp.where(last_mask[..., None], kd, 0.0)
        chunk_decay = jnp.where(carry_mask[..., -1], chunk_decay, 0.0)
    new_values = ein("...ij,...jd->...id", t_inv, v_beta)  # u when the carried state is zero
    k_cumdecay = ein("...ij,...jd->...id", t_inv, kbd)  # how the carried state enters u
    attn = ein("...id,...jd->...ij", qf, kf) * decay  # intra-chunk q.k, causal incl. the diagonal

    def step(state, xs):
        u, w, a, q_c, k_c, cd = xs  # [B, H, C, Dv], [B, H, C, Dk], [B, H, C, C], ..., [B, H]
        v_new = u - ein("bhck,bhkv->bhcv", w, state)
        out = ein("bhck,bhkv->bhcv", q_c, state) + ein("bhcj,bhjv->bhcv", a, v_new)
        state = state * cd[..., None, None] + ein("bhck,bhcv->bhkv", k_c, v_new)
        return state, out

    xs = tuple(jnp.moveaxis(x, 2, 0) for x in (new_values, k_cumdecay, attn, qd, kd, chunk_decay))
    state, out = jax.lax.scan(step, _initial_state(initial_state, (b, hv, dk, dv)), xs)
    out = jnp.moveaxis(out, 0, 2).reshape(b, hv, n * c, dv)[:, :, :s]
    out = jnp.swapaxes(out, 1, 2)  # [B, S, Hv, Dv]
    if valid is not None:
        out = jnp.where(valid[:, :, None, None], out, 0.0)
    return out.astype(q.dtype), state


GDN_KERNELS = ("auto", "xla", "triton")


def resolve_gdn_kernel(kernel: str, dtype, dk: int, dv: int, chunk_size: int) -> str:
    """``compute.gdn_kernel`` -> the path that runs: "auto" is "triton" on GPU for bf16 / fp16 inputs whose head
    dims and chunk the kernels take (``gdn_triton.supported``), "xla" otherwise; explicit choices unchanged
    ("triton" off GPU runs the kernels in Pallas' interpret mode: tests only)."""
    if kernel not in GDN_KERNELS:
        raise ValueError(f"gdn kernel {kernel!r} is not one of {GDN_KERNELS}")
    if kernel != "auto":
        return kernel
    ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and gdn_triton.supported(dk, dv, chunk_size) is None
    return "triton" if ok and jax.default_backend() == "gpu" else "xla"


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                     kernel: str = "xla", chunk_size: int = 64, initial_state: jax.Array | None = None,
                     segment_ids: jax.Array | None = None, use_qk_l2norm: bool = False, scale: float | None = None,
                     precision: Precision = None) -> tuple[jax.Array, jax.Array]:
    """:func:`chunk_gated_delta_rule` on the path ``kernel`` names (:func:`resolve_gdn_kernel`): "xla" (this
    module's einsums under ``lax.scan``; the reference) or "triton" (``parallelism.gdn_triton``: the recurrence
    in Pallas-Triton kernels, its own backward). Same arguments, same results up to rounding."""
    impl = resolve_gdn_kernel(kernel, q.dtype, q.shape[-1], v.shape[-1], chunk_size)
    fn = gdn_triton.chunk_gated_delta_rule if impl == "triton" else chunk_gated_delta_rule
    return fn(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state, segment_ids=segment_ids,
              use_qk_l2norm=use_qk_l2norm, scale=scale, precision=precision)


def causal_conv1d(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None, *,
                  segment_ids: jax.Array | None = None, initial_window: jax.Array | None = None,
                  activation: str | None = "silu") -> tuple[jax.Array, jax.Array]:
    """x [B, S, C], weight [K, C] (HF's conv1d.weight[:, 0, :].T), bias [C], segment_ids [B, S],
    initial_window [B, K-1, C] -> (out [B, S, C] in x's dtype, final window [B, K-1, C]): the causal
    depthwise conv out_t = sum_j weight[j] x_{t-K+1+j} (+ bias), then silu, as HF's causal_conv1d_fn.

    Packed rows: a tap reads only inputs of the token's own segment (the window restarts at every
    boundary); padding outputs zeros. The initial window stands before the row and reaches only its
    first segment; the final window holds the last K-1 inputs, zeroed where not of the last segment."""
    kw = weight.shape[0]
    b, s, ch = x.shape
    if weight.shape != (kw, ch):
        raise ValueError(f"conv weight shape {weight.shape}, expected [K, {ch}]")
    window = jnp.zeros((b, kw - 1, ch), x.dtype) if initial_window is None else initial_window.astype(x.dtype)
    runs, valid = segment_runs(segment_ids) if segment_ids is not None else (None, None)
    if valid is not None:
        x = jnp.where(valid[..., None], x, 0)
    xp = jnp.concatenate([window, x], axis=1)  # [B, K-1+S, C]
    rp = None if runs is None else jnp.concatenate([jnp.zeros((b, kw - 1), jnp.int32), runs], axis=1)
    acc = jnp.zeros((b, s, ch), jnp.float32)
    for j in range(kw):  # K (4) shifted multiply-adds: elementwise work, fused by XLA
        tap = xp[:, j:j + s].astype(jnp.float32) * weight[j].astype(jnp.float32)
        if rp is not None and j < kw - 1:
            tap = jnp.where((rp[:, j:j + s] == runs)[..., None], tap, 0.0)
        acc = acc + tap
    if bias is not None:
        acc = acc + bias.astype(jnp.float32)
    if activation == "silu":
        acc = jax.nn.silu(acc)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    if valid is not None:
        acc = jnp.where(valid[..., None], acc, 0.0)
    final = xp[:, xp.shape[1] - (kw - 1):]
    if rp is not None:
        final = jnp.where((rp[:, rp.shape[1] - (kw - 1):] == rp[:, -1:])[..., None], final, 0)
    return acc.astype(x.dtype), final


def chunk_gated_delta_rule_carry(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                                 chunk_size: int = 64, segment_ids: jax.Array | None = None,
                                 use_qk_l2norm: bool = False, scale: float | None = None,
                                 precision: Precision = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One sequence shard's rule from a zero state, with what a later initial state changes (module
    docstring, "Shards in parallel"): shapes as :func:`chunk_gated_delta_rule` -> (out0 [B, S, Hv, Dv],
    q_eff [B, S, Hv, Dk], final [B, Hv, Dk, Dv], transition [B, Hv, Dk, Dk]), all float32. With an
    incoming state ``S_in``: outputs ``out0 + S_in^T q_eff`` (:func:`apply_incoming_state`), final
    state ``transition @ S_in + final``."""
    b, _, _, dk = q.shape
    hv, dv = v.shape[2:]
    v_aug = jnp.concatenate([v.astype(jnp.float32), jnp.zeros(v.shape[:3] + (dk,), jnp.float32)], axis=-1)
    eye = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, hv, dk, dk))
    init = jnp.concatenate([jnp.zeros((b, hv, dk, dv), jnp.float32), eye], axis=-1)  # [0 | I]
    out, state = chunk_gated_delta_rule(q.astype(jnp.float32), k, v_aug, g, beta, chunk_size=chunk_size,
                                        initial_state=init, segment_ids=segment_ids, use_qk_l2norm=use_qk_l2norm,
                                        scale=scale, precision=precision)
    return out[..., :dv], out[..., dv:], state[..., :dv], state[..., dv:]


def apply_incoming_state(out0: jax.Array, q_eff: jax.Array, incoming: jax.Array,
                         precision: Precision = None) -> jax.Array:
    """out0 [B, S, Hv, Dv] + the incoming state's share: ``S_in^T q_eff`` (q_eff [B, S, Hv, Dk],
    incoming [B, Hv, Dk, Dv]) -> [B, S, Hv, Dv] float32."""
    return out0 + jnp.einsum("bshk,bhkv->bshv", q_eff, incoming.astype(jnp.float32), precision=precision)


def conv_tail(x: jax.Array, segment_ids: jax.Array | None, width: int) -> jax.Array:
    """The window a sequence shard hands the next one: x [B, S, C]'s last ``width`` inputs (padding
    zeroed), zeroed where not of the row's last segment -> [B, width, C]; what :func:`causal_conv1d`
    returns as its final window from a zero initial window when S >= width."""
    if x.shape[1] < width:
        raise ValueError(f"a sequence shard of {x.shape[1]} tokens cannot hold the conv window of {width}")
    tail = x[:, x.shape[1] - width:]
    if segment_ids is None:
        return tail
    seg = segment_ids[:, segment_ids.shape[1] - width:]
    keep = (seg == segment_ids[:, -1:]) & (seg != 0)
    return jnp.where(keep[..., None], tail, jnp.zeros((), x.dtype))
