"""The attention op: grouped-query attention restricted to one segment id, optionally causal.

``impl``: "xla" (einsum + float32 softmax; the CPU/reference path), "cudnn" (cuDNN flash
attention through ``jax.nn.dot_product_attention``, same mask semantics via a dense segment mask),
"auto" (cudnn on GPU where cuDNN supports the dtype and head dim, else xla).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def resolve_impl(impl: str, dtype: jnp.dtype, head_dim: int) -> str:
    """"auto" -> "cudnn" on GPU for bf16/fp16 with head_dim a multiple of 8 up to 128 (what cuDNN
    flash attention takes), "xla" otherwise; explicit choices unchanged."""
    if impl != "auto":
        return impl
    ok = jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if ok and jax.default_backend() == "gpu" else "xla"


def segment_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, causal: bool) -> jax.Array:
    """Boolean ``[B, Sq, Sk]``: same segment id (0 = padding attends to padding), and k <= q if causal."""
    mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    if causal:
        sq, sk = q_segment_ids.shape[1], kv_segment_ids.shape[1]
        mask = mask & (jnp.arange(sq)[:, None] >= jnp.arange(sk)[None, :])[None]
    return mask


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_segment_ids: jax.Array,
                          kv_segment_ids: jax.Array, causal: bool, impl: str = "xla",
                          scale: float | None = None) -> jax.Array:
    """q ``[B, Sq, N, D]``, k/v ``[B, Sk, K, D]`` (N a multiple of K), segment ids ``[B, S]`` ->
    ``[B, Sq, N, D]``. Each query attends to keys with its segment id (and at or before it if causal)."""
    b, sq, n, d = q.shape
    kh = k.shape[2]
    scale = d**-0.5 if scale is None else scale
    mask = segment_mask(q_segment_ids, kv_segment_ids, causal)
    impl = resolve_impl(impl, q.dtype, d)
    if impl == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, is_causal=causal,
                                            implementation="cudnn")
    if impl != "xla":
        raise ValueError(f"unknown attention implementation {impl!r}")
    qg = q.reshape(b, sq, kh, n // kh, d)
    scores = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(b, sq, n, d)
