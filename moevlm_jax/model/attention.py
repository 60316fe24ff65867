"""The attention op: grouped-query attention restricted to one segment id, optionally causal.

``impl``: "xla" (einsum + float32 softmax; the CPU/reference path), "cudnn" (cuDNN flash
attention), "auto" (cudnn on GPU where cuDNN supports the dtype and head dim, else xla).

The cuDNN path runs packed segments in cuDNN's ragged (THD) form: per row, the start offset and
length of each segment, so masked-out blocks between packed samples (or between the images of a
row) are never computed. A dense boolean mask through cuDNN computes every block (measured on the
H200: 4 packed documents a row ran ~3.5x slower, see bench/results/attention.md). The ragged form needs a
static bound on segments per row (``max_segments``, default ``MAX_PACKED_SEGMENTS``; its cost grows
with the bound, so a workload that knows its rows sets it: ``compute.attention_options``); a row with
more runs the dense-mask kernel, so the result is always right: the trainer checks each batch's rows
on the host and traces the step under :func:`rows_within_bound` when they hold (no fallback
compiled), else compiles a step with the fallback (a ``lax.cond`` per call: ~96 us each on the H200).
``pad_head_dim``: q/k/v zero-padded along the head dim to a size cuDNN has tuned kernels for (the vision
tower's 72 -> 128), the softmax scale kept at the true head dim's and the output sliced back: the same
attention (zero columns add nothing to q.k and yield zero outputs).

The XLA path (CPU) computes scores over whole rows, except for the vision tower where a batch is
known (checked on the host, :func:`rows_within_bound`) to hold no image longer than
``compute.attention_options.vision_max_image_patches``: there :func:`windowed_attention` computes only
a band of blocks around each query block (exact; ~2.2x faster on the CPU default's 512-patch rows).

Context parallelism: given the logical axes of q and k/v, the op asks ``parallelism.context``
whether the layout splits their sequence; if so it runs over the sequence shards there (K/V
gathered or passed around a ring, masks from global positions). No mesh logic lives here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from moevlm_jax.parallelism import context
from moevlm_jax.parallelism.grouped_matmul import zero_grad_where

Axes = tuple[str | None, ...]

# Static bound on packed segments per row for cuDNN's ragged form. Its cost grows with the bound
# (H200, B=2 S=4096: 8 -> 383, 64 -> 253 TFLOP/s forward+backward), so keep it small.
MAX_PACKED_SEGMENTS = 16
# The checkpoint name of a fused attention kernel's residuals (moevlm_jax.model.compute.CHECKPOINT_NAMES)
RESIDUAL_NAME = "core_attn"
_WITHIN_BOUND = contextvars.ContextVar("attention_rows_within_bound", default=False)


@contextlib.contextmanager
def rows_within_bound(within: bool = True) -> Iterator[None]:
    """While tracing inside: the caller promises that no row holds more segments than the cuDNN
    path's ``max_segments`` (the trainer checks every batch on the host:
    ``training.trainer.segments_over_bound``), so the ragged kernel runs without its device-side dense-mask
    fallback, a ``lax.cond`` whose predicate the host reads (~96 us a call on the H200,
    bench/results/step.md; 70 conds a proxy step); and, where the vision attention is XLA's, no image
    longer than its ``max_segment_len`` (:func:`windowed_attention`)."""
    token = _WITHIN_BOUND.set(within)
    try:
        yield
    finally:
        _WITHIN_BOUND.reset(token)


def resolve_impl(impl: str, dtype: jnp.dtype, head_dim: int) -> str:
    """"auto" -> "cudnn" on GPU for bf16/fp16 with head_dim a multiple of 8 up to 128 (what cuDNN
    flash attention takes), "xla" otherwise; explicit choices unchanged."""
    if impl != "auto":
        return impl
    ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if ok and jax.default_backend() == "gpu" else "xla"


def segment_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, causal: bool,
                 q_offset: jax.Array | int = 0) -> jax.Array:
    """Boolean ``[B, Sq, Sk]``: same segment id (0 = padding attends to padding), and k <= q if causal;
    query i sits at sequence index ``q_offset + i`` (a context-parallel shard's start)."""
    mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    if causal:
        sq, sk = q_segment_ids.shape[1], kv_segment_ids.shape[1]
        mask = mask & ((jnp.arange(sq) + q_offset)[:, None] >= jnp.arange(sk)[None, :])[None]
    return mask


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids: jax.Array,
                          kv_segment_ids: jax.Array, causal: bool, impl: str = "xla",
                          scale: float | None = None, logical_axes: tuple[Axes, Axes] | None = None,
                          max_segments: int = MAX_PACKED_SEGMENTS, pad_head_dim: int | None = None,
                          max_segment_len: int | None = None) -> jax.Array:
    """q ``[B, Sq, N, D]``, k/v ``[B, Sk, K, D]`` (N a multiple of K), segment ids ``[B, S]`` ->
    ``[B, Sq, N, D]``. Each query attends to keys with its segment id (and at or before it if causal).
    ``logical_axes`` (q's, k/v's): when the layout splits that sequence axis (context parallelism),
    ``parallelism.context`` runs this attention over the sequence shards. ``max_segments``,
    ``pad_head_dim``: the cuDNN path's ragged bound and head-dim padding (module docstring).
    ``max_segment_len``: the XLA path's bound on a segment's length (:func:`windowed_attention`), used
    while tracing under :func:`rows_within_bound` (the caller checked the batch on the host)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    opts = dict(causal=causal, impl=impl, scale=scale, max_segments=max_segments, pad_head_dim=pad_head_dim,
                max_segment_len=max_segment_len)
    if logical_axes is not None and context.sequence_axes(logical_axes[0]):
        attend = functools.partial(_attention, **opts)
        return context.context_parallel_attention(attend, q, k, v, q_segment_ids, kv_segment_ids,
                                                  q_axes=logical_axes[0], kv_axes=logical_axes[1],
                                                  causal=causal, scale=scale)
    return _attention(q, k, v, q_segment_ids, kv_segment_ids, 0, **opts)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids: jax.Array,
                     kv_segment_ids: jax.Array, q_offset: jax.Array | int, scale: float | None = None) -> jax.Array:
    """Generation against a preallocated KV cache: q ``[B, Sq, N, D]`` the new tokens, which sit at
    cache slots ``q_offset .. q_offset + Sq - 1`` (a traced scalar: one compiled decode step for every
    slot), k/v ``[B, T, K, D]`` the whole cache, segment ids ``[B, Sq]`` / ``[B, T]`` -> ``[B, Sq, N, D]``.
    Causal over the slots and within a segment id, as the training attention; slots past the newest
    token are masked whatever they hold. Always the XLA einsum path (exact masked softmax; a decode
    step's single query is memory bound), on every backend."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset, causal=True, impl="xla", scale=scale)


def _attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset, *, causal, impl, scale,
               max_segments=MAX_PACKED_SEGMENTS, pad_head_dim=None, max_segment_len=None):
    """The local attention; query i sits at sequence index ``q_offset + i`` of k/v."""
    b, sq, n, d = q.shape
    kh = k.shape[2]
    impl = resolve_impl(impl, q.dtype, d)
    if impl == "cudnn" and pad_head_dim is not None and pad_head_dim > d:
        pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, pad_head_dim - d)])
        out = _attention(pad(q), pad(k), pad(v), q_segment_ids, kv_segment_ids, q_offset, causal=causal,
                         impl=impl, scale=scale, max_segments=max_segments)
        return out[..., :d]
    if impl == "cudnn":
        if q_segment_ids is kv_segment_ids and sq == k.shape[1]:
            return _cudnn_packed(q, k, v, q_segment_ids, causal, scale, max_segments)
        mask = segment_mask(q_segment_ids, kv_segment_ids, causal, q_offset)
        return _cudnn_dense(q, k, v, mask, causal and sq == k.shape[1], scale)
    if impl != "xla":
        raise ValueError(f"unknown attention implementation {impl!r}")
    windowed = (max_segment_len is not None and _WITHIN_BOUND.get() and q_segment_ids is kv_segment_ids
                and sq == k.shape[1] and isinstance(q_offset, int) and q_offset == 0
                and 3 * max_segment_len < sq)  # else the whole row is no dearer
    if windowed:
        return windowed_attention(q, k, v, q_segment_ids, max_segment_len, causal=causal, scale=scale)
    mask = segment_mask(q_segment_ids, kv_segment_ids, causal, q_offset)
    qg = q.reshape(b, sq, kh, n // kh, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, sq, n, d)


def windowed_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, span: int, *,
                       causal: bool, scale: float) -> jax.Array:
    """Self-attention within segments no longer than ``span`` (each contiguous), exactly, computing
    only a band: the row is cut into blocks of ``span`` queries, and each block attends to the keys of
    itself and its two neighbours, which hold every key of any segment one of its queries belongs to.
    Scores ``[B, S, 3 span]`` instead of ``[B, S, S]`` (the vision tower on CPU: rows of 512 patches,
    images of <= 64, ~2.7x fewer scores). A longer segment would lose keys: callers pass ``span``
    only for batches checked on the host (``training.trainer.segments_over_bound``). Padding (id 0)
    attends to padding within the band: its outputs differ from the whole-row path's and are unused."""
    b, s, n, d = q.shape
    kh = k.shape[2]
    nb = -(-s // span)
    pad = nb * span - s
    seg = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1) if pad else segment_ids
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    pos = jnp.arange(nb * span)

    def band(x, fill):  # [B, nb * span, ...] -> [B, nb, 3 span, ...]: blocks i-1, i, i+1
        widths = ((0, 0), (span, span)) + ((0, 0),) * (x.ndim - 2)
        xb = jnp.pad(x, widths, constant_values=fill).reshape(x.shape[0], nb + 2, span, *x.shape[2:])
        return jnp.concatenate([xb[:, :nb], xb[:, 1:nb + 1], xb[:, 2:]], axis=2)

    kw, vw = band(k, 0), band(v, 0)
    seg_w, pos_w = band(seg, -2), band(pos[None], -1)[0]  # -2: outside the row, matches no query
    qb = q.reshape(b, nb, span, kh, n // kh, d)
    mask = seg.reshape(b, nb, span)[..., :, None] == seg_w[:, :, None, :]  # [B, nb, span, 3 span]
    if causal:
        mask = mask & (pos.reshape(nb, span)[:, :, None] >= pos_w[:, None, :])[None]
    scores = jnp.einsum("bnskgd,bntkd->bnkgst", qb, kw, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, :, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bnkgst,bntkd->bnskgd", probs, vw).reshape(b, nb * span, n, d)
    return out[:, :s]


def segment_offsets(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array]:
    """segment_ids ``[B, S]`` (each id 1..M one contiguous run, 0 = padding) -> cuDNN ragged
    lengths ``[B, M]`` and start offsets ``[B, M+1]``, both -1 where a row has fewer segments."""
    ids = jnp.arange(1, max_segments + 1, dtype=segment_ids.dtype)
    onehot = segment_ids[:, :, None] == ids[None, None, :]
    lengths = onehot.sum(axis=1, dtype=jnp.int32)
    starts = jnp.argmax(onehot, axis=1).astype(jnp.int32)
    present = lengths > 0
    starts = jnp.where(present, starts, -1)
    lengths = jnp.where(present, lengths, -1)
    return lengths, jnp.concatenate([starts, jnp.full_like(starts[:, :1], -1)], axis=1)


def _cudnn_dense(q, k, v, mask, causal, scale):
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, is_causal=causal,
                                        implementation="cudnn")


def mask_padding_grad(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Identity on x ``[B, S, ...]``; its gradient is zeroed where ``valid`` ``[B, S]`` is False.

    cuDNN's ragged (THD) attention computes only the positions inside some segment: its d(q), d(k),
    d(v) at padding positions (segment 0, in no segment) are never written, i.e. whatever the buffer
    held, NaN included, and would flow into the q/k/v projection weights' gradients. The forward
    output there is masked to zero, so the true gradient there is zero."""
    return zero_grad_where(x, valid)


def _cudnn_packed(q, k, v, segment_ids, causal, scale, max_segments=MAX_PACKED_SEGMENTS):
    """cuDNN flash attention over the packed segments of each row (THD ragged offsets), at most
    ``max_segments`` a row (rows with more: the dense-mask kernel); the kernel's residuals are kept
    under the checkpoint name "core_attn" (``kernel_with_fallback``)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import (
        dot_product_attention as cudnn_attention,
    )

    def packed(q, k, v, ids):
        lengths, starts = segment_offsets(ids, max_segments)
        valid = ids > 0  # d(q/k/v) at padding: unwritten by cuDNN, zero by definition
        q, k, v = (mask_padding_grad(x, valid) for x in (q, k, v))
        out = cudnn_attention(q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=starts,
                              kv_offsets=starts, scale=scale,
                              mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK, qkv_layout="BTNH")
        return jnp.where(valid[:, :, None, None], out, jnp.zeros((), out.dtype))

    def dense(q, k, v, ids):
        return _cudnn_dense(q, k, v, segment_mask(ids, ids, causal), causal, scale)

    too_many = None if _WITHIN_BOUND.get() else jnp.max(segment_ids) > max_segments
    return kernel_with_fallback(too_many, packed, dense, q, k, v, segment_ids)


def kernel_with_fallback(use_fallback: jax.Array | None, primary: Callable, fallback: Callable, q: jax.Array,
                         k: jax.Array, v: jax.Array, ids: jax.Array, name: str = RESIDUAL_NAME) -> jax.Array:
    """``lax.cond(use_fallback, fallback, primary, q, k, v, ids)`` (``use_fallback`` None: ``primary``
    alone, no cond) whose backward reuses ``primary``'s own residuals (a flash kernel's output and
    softmax statistics, its inputs), placed under the checkpoint name ``name``.

    A fused kernel's residuals are not the tensors the model names: under a remat policy they would be
    recomputed, i.e. the whole forward kernel would run again in every backward even with "core_attn"
    saved (measured on the H200: the cuDNN forward ran twice a step). Named, the policy decides:
    "core_attn" among the recompute modules recomputes the attention, else its residuals are kept.
    The fallback (rows over the ragged bound) recomputes its forward in the backward."""
    treedef: list[Any] = []

    def primary_vjp(q, k, v, ids):
        out, pullback = jax.vjp(lambda q, k, v: primary(q, k, v, ids), q, k, v)
        leaves, tree = jax.tree.flatten(pullback)
        treedef[:] = [tree]
        return out, leaves

    def fallback_bwd(q, k, v, ids, g):
        return jax.vjp(lambda q, k, v: fallback(q, k, v, ids), q, k, v)[1](g)

    bounded = use_fallback is None
    use_fallback = jnp.zeros((), bool) if bounded else use_fallback

    @jax.custom_vjp
    def run(use_fallback, q, k, v, ids):
        return primary(q, k, v, ids) if bounded else jax.lax.cond(use_fallback, fallback, primary, q, k, v, ids)

    def run_fwd(use_fallback, q, k, v, ids):
        if bounded:
            out, leaves = primary_vjp(q, k, v, ids)
            return out, ([checkpoint_name(x, name) for x in leaves],)
        shapes = jax.eval_shape(primary_vjp, q, k, v, ids)[1]

        def fallback_vjp(q, k, v, ids):
            return fallback(q, k, v, ids), [jnp.zeros(s.shape, s.dtype) for s in shapes]

        out, leaves = jax.lax.cond(use_fallback, fallback_vjp, primary_vjp, q, k, v, ids)
        return out, ([checkpoint_name(x, name) for x in leaves], use_fallback, q, k, v, ids)

    def run_bwd(res, g):
        saved = lambda *_: jax.tree.unflatten(treedef[0], res[0])(g)
        grads = saved() if bounded else jax.lax.cond(res[1], fallback_bwd, saved, *res[2:], g)
        return (None, *grads, None)

    run.defvjp(run_fwd, run_bwd)
    return run(use_fallback, q, k, v, ids)
