"""cuDNN's ragged (THD) attention never writes d(q), d(k), d(v) at padding positions (in no
segment), so the packed path zeroes those gradients itself (``mask_padding_grad``). cuDNN is GPU
only; here a stand-in op whose backward leaves NaN at padding positions, as unwritten memory can
hold, shows that the mask keeps every gradient finite and exact, and that without it the NaN
reaches the weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
    want = jax.grad(lambda w: jnp.sum(jnp.where(valid[:, :, None, None], jnp.einsum("bsh,hnd->bsnd", x, w),
                                                0.0) ** 2))(w)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.all(np.isnan(jax.grad(_loss)(w, x, valid, False)))  # unmasked: the NaN reaches the weight


def test_mask_is_the_identity_forward_and_inside_jit():
    x = jnp.arange(24.0).reshape(1, 6, 2, 2)
    valid = jnp.asarray([[True, True, False, True, False, False]])
    np.testing.assert_array_equal(jax.jit(mask_padding_grad)(x, valid), x)
    g = jax.jit(jax.grad(lambda x: jnp.sum(mask_padding_grad(x, valid) * 3.0)))(x)
    np.testing.assert_array_equal(g[0, :, 0, 0], [3.0, 3.0, 0.0, 3.0, 0.0, 0.0])


def test_head_dim_padding_and_segment_bound_reach_the_cudnn_path(monkeypatch):
    """``pad_head_dim`` (the vision tower's 72 -> 128 on the GPU): q/k/v reach the cuDNN kernel
    zero-padded to 128 with the softmax scale of the true head dim and ``max_segments`` as given; the
    output and the gradients equal the unpadded attention's. cuDNN is GPU only: a stand-in kernel
    records what it receives and computes XLA attention on it."""
    from moevlm_jax.model import attention

    seen = []

    def fake_cudnn(q, k, v, segment_ids, causal, scale, max_segments=attention.MAX_PACKED_SEGMENTS):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1], scale, max_segments))
        return attention._attention(q, k, v, segment_ids, segment_ids, 0, causal=causal, impl="xla", scale=scale)

    monkeypatch.setattr(attention, "_cudnn_packed", fake_cudnn)
    rng = np.random.default_rng(1)
    b, s, n, d = 2, 10, 4, 72
    q, k, v = (jnp.asarray(rng.normal(size=(b, s, n, d)), jnp.float32) for _ in range(3))
    seg = jnp.asarray([[1] * 4 + [2] * 6, [1] * 7 + [0] * 3])
    ct = jnp.asarray(rng.normal(size=(b, s, n, d)), jnp.float32)

    def loss(q, k, v, impl, **kw):
        out = attention.dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=False,
                                              impl=impl, **kw)
        return jnp.sum(jnp.where((seg > 0)[:, :, None, None], out, 0.0) * ct), out

    (got_l, got), got_g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        q, k, v, "cudnn", max_segments=4, pad_head_dim=128)
    (_, want), want_g = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v, "xla")
    assert seen and all(x == (128, 128, 128, pytest.approx(72**-0.5), 4) for x in seen)
    assert got.shape == (b, s, n, d)
    valid = (seg > 0)[:, :, None, None]
    np.testing.assert_allclose(jnp.where(valid, got, 0), jnp.where(valid, want, 0), rtol=1e-5, atol=1e-5)
    for g, w in zip(got_g, want_g):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_attention_options_per_tower_and_bad_values():
    from moevlm_jax.model.compute import ComputeConfig

    c = ComputeConfig(attention_options={"max_segments": 2, "vision_max_segments": 4, "vision_pad_head_dim": 128})
    assert c.attention_options.for_tower("text") == {"max_segments": 2, "pad_head_dim": None}
    assert c.attention_options.for_tower("vision") == {"max_segments": 4, "pad_head_dim": 128, "max_segment_len": None}
    assert ComputeConfig().attention_options.for_tower("vision") == {"max_segments": 16, "pad_head_dim": None,
                                                                     "max_segment_len": None}
    for bad, words in (({"max_segment": 2}, "unknown key"), ({"max_segments": 0}, "positive int"),
                       ({"max_segments": None}, "max_segments: expected int"), ({"vision_pad_head_dim": 100},
                                                                                "multiple of 8")):
        with pytest.raises(ValueError, match=words):
            ComputeConfig(attention_options=bad)


def test_rows_over_the_segment_bound_are_counted_and_named_once(caplog):
    """Host-side check of a batch against compute.attention_options: text rows with 1 and 3 packed
    samples against a bound of 2, vision rows with 4 and 5 images against a bound of 4."""
    from moevlm_jax.model.compute import AttentionOptions
    from moevlm_jax.training.trainer import segments_over_bound

    arrays = {"segment_ids": np.array([[1, 1, 1, 0], [1, 2, 3, 3]]),
              "patch_segment_ids": np.array([[1, 2, 3, 4, 0], [1, 2, 3, 4, 5]])}
    warned: set[str] = set()
    options = AttentionOptions(max_segments=2, vision_max_segments=4)
    with caplog.at_level("WARNING"):
        assert segments_over_bound(arrays, options, warned) == {"text": 1, "vision": 1}
        assert segments_over_bound(arrays, options, warned) == {"text": 1, "vision": 1}
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and warned == {"text", "vision"}
    assert "attention_options.max_segments=2 (up to 3)" in warnings[0]
    assert "attention_options.vision_max_segments=4 (up to 5)" in warnings[1]
    assert segments_over_bound(arrays, AttentionOptions(max_segments=3, vision_max_segments=5), set()) == {}
    assert segments_over_bound(arrays, AttentionOptions(), set()) == {}  # the default bound 16
