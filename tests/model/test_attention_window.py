"""The XLA attention's band for segments of bounded length (``windowed_attention``, the vision
tower on CPU) equals the whole-row masked attention: outputs at every position in a segment and the
gradients of q, k, v, for rows of images of different lengths up to the bound, padding included;
the host check sends a batch with a longer image to the whole-row path; the bound is derived from
the data's image processing."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.model.attention import dot_product_attention, rows_within_bound, windowed_attention

# quick compiles (tests/xla_options.py): the whole-row reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")


def _rows(lengths_per_row, s):
    seg = np.zeros((len(lengths_per_row), s), np.int32)
    for r, lengths in enumerate(lengths_per_row):
        at = 0
        for i, n in enumerate(lengths):
            seg[r, at:at + n] = i + 1
            at += n
    return jnp.asarray(seg)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("s, span", [(96, 16), (100, 16)])  # 100: the row is padded to whole blocks
def test_band_equals_the_whole_row(causal, s, span):
    rng = np.random.default_rng(0)
    b, n, kh, d = 3, 4, 2, 8
    seg = _rows([[16, 5, 16, 9, 16], [3, 16, 16, 16, 16, 16], [11, 13]], s)
    q, k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) for h in (n, kh, kh))
    valid = (seg > 0)[:, :, None, None]
    w = jnp.asarray(rng.normal(size=(b, s, n, d)), jnp.float32) * valid  # cotangent: zero at padding

    def whole(q, k, v):
        return dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=causal)

    def band(q, k, v):
        return windowed_attention(q, k, v, seg, span, causal=causal, scale=d**-0.5)

    ref, got = whole(q, k, v), band(q, k, v)
    np.testing.assert_allclose(np.where(valid, got, 0), np.where(valid, ref, 0), rtol=1e-5, atol=1e-6)
    g_ref = jax.grad(lambda *a: jnp.sum(whole(*a) * w), argnums=(0, 1, 2))(q, k, v)
    g_got = jax.grad(lambda *a: jnp.sum(band(*a) * w), argnums=(0, 1, 2))(q, k, v)
    for x, y in zip(g_got, g_ref):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5)

    # dot_product_attention takes the band only under rows_within_bound (the host checked the batch)
    with rows_within_bound(True):
        routed = jax.jit(lambda q, k, v: dot_product_attention(
            q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=causal, max_segment_len=span))
        jaxpr = str(jax.make_jaxpr(routed)(q, k, v))
        np.testing.assert_allclose(np.where(valid, routed(q, k, v), 0), np.where(valid, ref, 0), rtol=1e-5, atol=1e-6)
    assert f"{-(-s // span)},{span}" in jaxpr.replace(" ", "")  # [B, blocks, span, ...] scores


def test_a_longer_image_is_found_on_the_host():
    from moevlm_jax.model.compute import AttentionOptions
    from moevlm_jax.training.trainer import segments_over_bound

    arrays = {"patch_segment_ids": np.array([[1] * 4 + [2] * 6 + [0] * 2, [1] * 3 + [2] * 3 + [3] * 3 + [0] * 3])}
    warned: set[str] = set()
    assert segments_over_bound(arrays, AttentionOptions(vision_max_image_patches=5), warned) == {"vision_length": 1}
    assert warned == {"vision_length"}
    assert segments_over_bound(arrays, AttentionOptions(vision_max_image_patches=6), set()) == {}
    # cuDNN's ragged kernel (the GPU's vision attention) has no length bound: not checked there
    assert segments_over_bound(arrays, AttentionOptions(vision_max_image_patches=5), set(), lengths=False) == {}


def test_the_bound_follows_the_data_images():
    from moevlm_jax.config.run import load_config

    cfg = load_config("cpu-default")
    assert cfg.data.image.max_pixels == 16384 and cfg.model.vision_config.patch_size == 16
    assert cfg.compute.attention_options.vision_max_image_patches == 16384 // 16**2
    # min_pixels = max_pixels = 448 x 448: images scaled up to it round up to the grid (up to 884 patches
    # were seen on the H200, 2026-12-01): the bound is (448 + 32)^2 / 16^2
    assert load_config("h200").compute.attention_options.vision_max_image_patches == 900
    pinned = load_config("cpu-default", overrides=["compute.attention_options.vision_max_image_patches=80"])
    assert pinned.compute.attention_options.vision_max_image_patches == 80
