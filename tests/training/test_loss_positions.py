"""The LM loss on gathered trained positions equals the loss over whole rows; eval argmax in chunks
equals the argmax of the full logits; capacities come in quarter steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.model.loss import lm_loss
from moevlm_jax.training.objective import capacity_step, ce_and_argmax, gather_trained, loss_capacity, most_trained


def _inputs(b=4, s=160, h=8, v=50, seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.normal(size=(b, s, h)).astype(np.float32)
    kernel = rng.normal(size=(h, v)).astype(np.float32)
    targets = rng.integers(0, v, size=(b, s)).astype(np.int32)
    mask = (rng.random((b, s)) < 0.15).astype(np.float32)
    return hidden, kernel, targets, mask


@pytest.mark.parametrize("groups", [1, 4])
def test_gathered_loss_and_gradient_equal_whole_rows(groups):
    hidden, kernel, targets, mask = _inputs()
    capacity = loss_capacity(*most_trained(mask, groups))
    assert capacity is not None and capacity >= (mask.reshape(groups, -1) > 0).sum(-1).max()

    def whole(h):
        return lm_loss(h, kernel, targets, mask, chunk_size=16)

    def gathered(h):
        hg, tg, mg, _ = gather_trained(h, targets, mask, groups, capacity)
        return lm_loss(hg, kernel, tg, mg, chunk_size=16)

    (a, na), (b, nb) = whole(hidden), jax.jit(gathered)(hidden)
    assert float(na) == float(nb) == mask.sum()
    np.testing.assert_allclose(float(b), float(a), rtol=1e-6)
    ga = jax.grad(lambda h: whole(h)[0])(hidden)
    gb = jax.grad(lambda h: gathered(h)[0])(hidden)
    np.testing.assert_allclose(gb, ga, rtol=1e-5, atol=1e-6)


def test_chunked_argmax_and_ce_match_dense_logits():
    hidden, kernel, targets, mask = _inputs(s=37)
    ce, count, pred = ce_and_argmax(jnp.asarray(hidden), jnp.asarray(kernel), jnp.asarray(targets),
                                    jnp.asarray(mask), chunk_size=16)
    logits = np.einsum("bsh,hv->bsv", hidden, kernel)
    np.testing.assert_array_equal(np.asarray(pred), logits.argmax(-1))
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    want = ((lse - np.take_along_axis(logits, targets[..., None], -1)[..., 0]) * mask).sum()
    assert float(ce) == pytest.approx(want, rel=1e-5) and float(count) == mask.sum()


def test_gathered_positions_map_back_to_rows():
    _, _, targets, mask = _inputs(b=4, s=10)
    hidden = np.zeros((4, 10, 1), np.float32)
    _, tg, mg, idx = gather_trained(jnp.asarray(hidden), jnp.asarray(targets), jnp.asarray(mask), 2, 16)
    idx, tg = np.asarray(idx), np.asarray(tg)
    for g in range(2):
        flat = idx[g][idx[g] >= 0]
        rows, cols = 2 * g + flat // 10, flat % 10
        assert (mask[rows, cols] > 0).all() and len(flat) == (mask[2 * g:2 * g + 2] > 0).sum()
        np.testing.assert_array_equal(tg[g][: len(flat)], targets[rows, cols])


def test_capacity_steps():
    assert [capacity_step(n) for n in (1, 5, 9, 17, 33, 120, 129, 161, 1000)] == [4, 5, 10, 20, 40, 128, 160, 192, 1024]
    mask = np.zeros((4, 512), np.float32)
    mask[1, :45] = 1
    assert loss_capacity(*most_trained(mask, groups=1)) == 48 and loss_capacity(*most_trained(mask, groups=4)) == 48
    mask[:, :300] = 1
    assert loss_capacity(*most_trained(mask, groups=4)) is None  # more than half of a group trained: whole rows


def test_gather_trained_backward_scatter_has_unique_indices():
    """The trained positions are distinct (top_k), so the backward of the gather is a scatter that
    XLA may run without atomics; and the gradient is the cotangent put back at those positions."""
    rng = np.random.default_rng(2)
    hidden = jnp.asarray(rng.standard_normal((2, 8, 4)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 8)) < 0.5, jnp.float32)
    targets = jnp.zeros((2, 8), jnp.int32)
    probe = jnp.asarray(rng.standard_normal((1, 5, 4)), jnp.float32)

    def fn(h):
        hg, _, mg, _ = gather_trained(h, targets, mask, 1, 5)
        return jnp.sum(hg * probe * mg[..., None])

    jaxpr = str(jax.make_jaxpr(jax.grad(fn))(hidden))
    assert "scatter-add" in jaxpr and "unique_indices=True" in jaxpr
    _, _, mg, idx = gather_trained(hidden, targets, mask, 1, 5)
    want = np.zeros((16, 4), np.float32)
    for c, (i, m) in enumerate(zip(np.asarray(idx)[0], np.asarray(mg)[0])):
        if i >= 0:
            want[i] += np.asarray(probe)[0, c] * m
    np.testing.assert_allclose(np.asarray(jax.grad(fn)(hidden)).reshape(16, 4), want, rtol=1e-6)
