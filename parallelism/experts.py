"""Expert computation entry point: ``experts_forward`` (dispatch + grouped matmul + combine).

PLACEHOLDER reference version (sort + jax.lax.ragged_dot, single device). The dispatch/grouped
matmul work replaces the body while keeping the signature.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def experts_forward(
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    **options: Any,
) -> jax.Array:
    """SwiGLU experts: x ``[T, H]``, topk_idx/topk_weights ``[T, K]``, w_gate_up ``[E, H, 2I]``
    (gate half first), w_down ``[E, I, H]`` -> ``[T, H]`` = sum_k w_k * expert_{idx_k}(x)."""
    t, k = topk_idx.shape
    e = w_gate_up.shape[0]
    flat = topk_idx.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // k
    xs = x[token]
    group_sizes = jnp.bincount(flat, length=e).astype(jnp.int32)
    h = jax.lax.ragged_dot(xs, w_gate_up.astype(xs.dtype), group_sizes)
    gate, up = jnp.split(h, 2, axis=-1)
    act = jax.nn.silu(gate) * up
    y = jax.lax.ragged_dot(act, w_down.astype(act.dtype), group_sizes)
    y = y * topk_weights.reshape(-1)[order][:, None].astype(y.dtype)
    return jnp.zeros_like(x).at[token].add(y)
