"""Next-token choice: greedy (argmax) or temperature + top-p (nucleus) sampling, jit-able.

``temperature`` and ``top_p`` are traced values (no recompile when they change); ``greedy`` is static.
Top-p keeps the smallest set of most likely tokens whose probability reaches ``top_p`` (at least one
token; ties at the cut are kept), as HF's ``TopPLogitsWarper``: ``top_p`` -> 0 is greedy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def top_p_mask(logits: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """logits ``[..., V]`` -> bool ``[..., V]``: the tokens inside the top-p nucleus."""
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]  # descending
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
    keep = before < top_p
    keep = keep.at[..., 0].set(True)
    cutoff = jnp.min(jnp.where(keep, ordered, jnp.inf), axis=-1, keepdims=True)
    return logits >= cutoff


def sample_token(logits: jax.Array, key: jax.Array | None, temperature: jax.Array | float = 1.0,
                 top_p: jax.Array | float = 1.0, *, greedy: bool = True) -> jax.Array:
    """logits ``[B, V]`` (float32) -> token ids ``[B]`` int32: argmax when ``greedy``, else a sample
    of ``softmax(logits / temperature)`` restricted to the top-p nucleus (one key for the batch)."""
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    scaled = logits.astype(jnp.float32) / jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    scaled = jnp.where(top_p_mask(scaled, top_p), scaled, -jnp.inf)
    return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
