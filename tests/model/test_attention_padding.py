"""cuDNN's ragged (THD) attention never writes d(q), d(k), d(v) at padding positions (in no
segment), so the packed path zeroes those gradients itself (``mask_padding_grad``). cuDNN is GPU
only; here a stand-in op whose backward leaves NaN at padding positions, as unwritten memory can
hold, shows that the mask keeps every gradient finite and exact, and that without it the NaN
reaches the weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from moevlm_jax.model.attention import mask_padding_grad


@jax.custom_vjp
def unwritten_at_padding(x, valid):
    """Identity whose backward returns NaN at padding positions (cuDNN's unwritten d(q))."""
    return x


unwritten_at_padding.defvjp(
    lambda x, valid: (x, valid),
    lambda valid, g: (jnp.where(valid[:, :, None, None], g, jnp.nan), None),
)


def _loss(w, x, valid, mask):
    q = jnp.einsum("bsh,hnd->bsnd", x, w)  # the q projection whose weight gradient sums over positions
    if mask:
        q = mask_padding_grad(q, valid)
    out = unwritten_at_padding(q, valid)
    out = jnp.where(valid[:, :, None, None], out, 0.0)  # the packed path zeroes padding outputs
    return jnp.sum(out**2)


def test_padding_gradients_are_zeroed_before_they_reach_the_weights():
    rng = np.random.default_rng(0)
    b, s, h, n, d = 2, 12, 8, 2, 4
    x = jnp.asarray(rng.normal(size=(b, s, h)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(h, n, d)), jnp.float32)
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12])
    valid = jnp.asarray(seg > 0)
    got = jax.grad(_loss)(w, x, valid, True)
    # reference: the same loss over the valid positions only, with an ordinary backward
    want = jax.grad(lambda w: jnp.sum(jnp.where(valid[:, :, None, None], jnp.einsum("bsh,hnd->bsnd", x, w), 0.0) ** 2))(w)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.all(np.isnan(jax.grad(_loss)(w, x, valid, False)))  # unmasked: the NaN reaches the weight


def test_mask_is_the_identity_forward_and_inside_jit():
    x = jnp.arange(24.0).reshape(1, 6, 2, 2)
    valid = jnp.asarray([[True, True, False, True, False, False]])
    np.testing.assert_array_equal(jax.jit(mask_padding_grad)(x, valid), x)
    g = jax.jit(jax.grad(lambda x: jnp.sum(mask_padding_grad(x, valid) * 3.0)))(x)
    np.testing.assert_array_equal(g[0, :, 0, 0], [3.0, 3.0, 0.0, 3.0, 0.0, 0.0])
