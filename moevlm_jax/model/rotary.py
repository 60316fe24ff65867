"""Rotary position embeddings: the decoder's interleaved MRoPE and the vision tower's 2D rotary.

Both follow HF Qwen3-VL-MoE: frequencies in float32, ``rotate_half`` convention (the two halves
of the head dim pair up), cos/sin of width ``head_dim``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def inv_freq(dim: int, theta: float) -> np.ndarray:
    """``1 / theta ** (arange(0, dim, 2) / dim)`` in float32, shape ``[dim // 2]``."""
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (1.0 / (np.float32(theta) ** exponent)).astype(np.float32)


def mrope_section_index(head_dim: int, mrope_section: tuple[int, int, int]) -> np.ndarray:
    """For each of the ``head_dim // 2`` frequencies, which position component (0=t, 1=h, 2=w)
    drives it under HF's interleaved layout (t h w t h w ... then t for the rest), ``[head_dim // 2]``."""
    sel = np.zeros(head_dim // 2, np.int32)
    for dim, offset in ((1, 1), (2, 2)):
        sel[offset : mrope_section[dim] * 3 : 3] = dim
    return sel


def mrope_cos_sin(positions: jax.Array, head_dim: int, theta: float,
                  mrope_section: tuple[int, int, int]) -> tuple[jax.Array, jax.Array]:
    """Interleaved MRoPE: positions ``[3, B, S]`` (t, h, w) -> cos, sin ``[B, S, head_dim]`` float32."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq(head_dim, theta))  # [3, B, S, D/2]
    sel = jnp.asarray(mrope_section_index(head_dim, mrope_section))
    f = jnp.where(sel == 0, freqs[0], jnp.where(sel == 1, freqs[1], freqs[2]))  # [B, S, D/2]
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def vision_rope_cos_sin(patch_rc: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """2D rotary of the vision tower: (row, col) ``[..., 2]`` -> cos, sin ``[..., head_dim]`` float32.

    A quarter of the head dim's frequencies rotate with the row, a quarter with the column; the
    (row, col) halves are repeated to the full width, as HF's ``Qwen3VLMoeVisionRotaryEmbedding``.
    """
    inv = jnp.asarray(inv_freq(head_dim // 2, theta))  # [D/4]
    rc = patch_rc.astype(jnp.float32)
    f = jnp.concatenate([rc[..., 0:1] * inv, rc[..., 1:2] * inv], axis=-1)  # [..., D/2]
    emb = jnp.concatenate([f, f], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rotate_half(x: jax.Array) -> jax.Array:
    """(x1, x2) -> (-x2, x1) over the last dim."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x ``[B, S, N, D]`` with cos/sin ``[B, S, D]`` -> rotated x (float32 math, x's dtype out)."""
    xf = x.astype(jnp.float32)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return (xf * c + rotate_half(xf) * s).astype(x.dtype)
