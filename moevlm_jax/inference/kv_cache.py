"""The decoder's KV cache for generation: preallocated, static shapes, one entry per decoder stack.

Layout: a list with one ``(k, v)`` pair per decoder stack (``TextModel.groups``: a run of consecutive
layers of one kind), each ``[layers of the stack, B, T, kv_heads, head_dim]`` in the compute dtype.
Slot ``t`` of row ``b`` holds the K/V of the row's token at sequence index ``t``: prompts are
left-padded to ``S`` slots (``[0, S)``), decoded token ``k`` goes to slot ``S + k``. The cache's
segment ids ``[B, T]`` are the prompt's attention mask on ``[0, S)`` and 1 after it; causality
over the slots masks slots not yet written, so they never change while decoding.

``T = round_up(S + max_new_tokens, cache_bucket)`` and ``S = round_up(longest prompt, prompt_bucket)``
so the compiled prefill / decode programs are reused across prompts (see ``engine``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Cache = list[tuple[jax.Array, jax.Array]]


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` >= ``n`` (and >= ``multiple``)."""
    multiple = max(int(multiple), 1)
    return max(multiple, -(-int(n) // multiple) * multiple)


def cache_shapes(model, batch: int, length: int) -> list[tuple[int, ...]]:
    """Shape of each stack's K (= V) cache: ``[n, batch, length, kv_heads, head_dim]``."""
    return model.language_model.cache_shapes(batch, length)


def init_cache(model, batch: int, length: int, dtype: jnp.dtype | None = None) -> Cache:
    """A zero cache for ``batch`` rows of ``length`` slots (dtype: the model's compute dtype)."""
    dtype = jnp.dtype(model.compute.dtype) if dtype is None else dtype
    return [(jnp.zeros(s, dtype), jnp.zeros(s, dtype)) for s in cache_shapes(model, batch, length)]


def cache_bytes(model, batch: int, length: int) -> int:
    """Device bytes of a cache of ``batch`` x ``length`` slots."""
    item = jnp.dtype(model.compute.dtype).itemsize
    return int(sum(2 * np.prod(s) * item for s in cache_shapes(model, batch, length)))


def cache_segment_ids(prompt_mask: np.ndarray, length: int) -> np.ndarray:
    """The cache's segment ids ``[B, length]``: the prompt's mask ``[B, S]`` (left padding 0), then 1."""
    prompt_mask = np.asarray(prompt_mask, np.int32)
    b, s = prompt_mask.shape
    if length < s:
        raise ValueError(f"cache of {length} slots cannot hold a prompt of {s}")
    return np.concatenate([prompt_mask, np.ones((b, length - s), np.int32)], axis=1)
