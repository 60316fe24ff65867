"""The experts' row-movement kernels (parallelism/permute_triton.py, Pallas' interpret mode on CPU) against XLA's
gathers (parallelism/permute.py), and the sorted experts on them against the dense reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.parallelism import fp8, permute, permute_triton
from moevlm_jax.parallelism.experts import experts_forward
from moevlm_jax.parallelism.kernels import KernelsConfig
from tests.parallelism.moe_reference import assert_close, dense_reference, make_problem, value_and_grads

pytestmark = pytest.mark.usefixtures("legacy_emitters")

SMALL = permute_triton.Config(block_a=8, block_h=16, num_warps=4, num_stages=2)


def _routing(t=21, k=3, e=5, h=32, capacity=None, seed=0, dtype=jnp.bfloat16):
    """A sorted-layout routing with padding assignments (expert id E) and, with a capacity, drops: slot [T*K] has
    -1s and the buffer rows past the kept ones are mapped by nothing. T*K = 63: the last program is partial."""
    rng = np.random.default_rng(seed)
    idx = np.stack([rng.permutation(e + 1)[:k] for _ in range(t)]).astype(np.int32)  # e: no expert
    w = jnp.asarray(rng.random((t, k)), dtype)
    plan = permute.route_plan(jnp.asarray(idx), w, e, capacity=capacity)
    slot = permute.sorted_slots(plan)
    src = permute.inverse_slots(slot, slot.shape[0])
    x = jnp.asarray(rng.standard_normal((t, h)), dtype)
    y = jnp.asarray(rng.standard_normal((t * k, h)), dtype)
    g = jnp.asarray(rng.standard_normal((t, h)), dtype)
    return x, y, w, slot, src, g


@pytest.mark.parametrize("capacity", [None, 6])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dispatch_kernel_moves_the_rows_xla_gathers(capacity, dtype):
    x, _, _, slot, src, _ = _routing(capacity=capacity, dtype=dtype)
    mapped = np.asarray(src) >= 0
    assert 0 < mapped.sum() < mapped.size  # padding (and drops): some rows are mapped by nothing
    want = np.asarray(permute.dispatch_rows(x, src, slot, 3))
    for cfg in (SMALL, None):
        got = np.asarray(permute_triton.dispatch(x, slot, 3, src.shape[0], config=cfg))
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got[mapped], want[mapped])


@pytest.mark.parametrize("capacity", [None, 6])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_combine_bwd_kernel_equals_xlas_backward(capacity, dtype):
    """d(y) on the mapped rows bitwise (the same float32 product rounded once), d(weights) a float32 sum in another
    order than XLA's: within float32 rounding of the products' magnitude."""
    _, y, w, slot, src, g = _routing(capacity=capacity, dtype=dtype, seed=1)
    mapped = np.asarray(src) >= 0
    dy_want, dw_want, _, _ = permute._combine_bwd((y, w, slot, src), g)
    for cfg in (SMALL, None):
        dy, dw = permute_triton.combine_bwd(y, w, slot, g, config=cfg)
        assert dy.dtype == y.dtype and dw.dtype == w.dtype and dw.shape == w.shape
        np.testing.assert_array_equal(np.asarray(dy)[mapped], np.asarray(dy_want)[mapped])
        # exact float32 reference: the sum of products over the 32 columns, then rounded to the weights' dtype
        rows = np.where(np.asarray(slot)[:, None] >= 0, np.asarray(y, np.float32)[np.maximum(np.asarray(slot), 0)], 0)
        exact = (rows.reshape(21, 3, 32) * np.asarray(g, np.float32)[:, None, :]).sum(-1)
        tol = 1e-6 if dtype == jnp.float32 else 8e-3  # float32 sum order; bf16: one rounding of the result
        np.testing.assert_allclose(np.asarray(dw, np.float32), exact, rtol=tol, atol=tol * np.abs(exact).max())
        np.testing.assert_allclose(np.asarray(dw, np.float32), np.asarray(dw_want, np.float32), rtol=tol,
                                   atol=tol * np.abs(exact).max())


def test_kernels_check_their_shapes():
    x, y, w, slot, src, g = _routing()
    with pytest.raises(ValueError, match="combine_bwd"):
        permute_triton.combine_bwd(y, w, slot[:-1], g)
    with pytest.raises(ValueError, match="combine_bwd"):
        permute_triton.combine_bwd(y, w, slot, g[:, :16])
    with pytest.raises(ValueError, match="dispatch"):
        permute_triton.dispatch(x, slot, 2, src.shape[0])
    with pytest.raises(ValueError, match="power-of-two divisor"):
        permute_triton.dispatch(x[:, :12], slot, 3, src.shape[0], interpret=False)


def _row_kernels(fn, *args):
    text = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=(0, 2, 3, 4)))(*args))
    return set(re.findall(r"name=(dispatch|combine_bwd)\b", text))


@pytest.mark.parametrize("kernels", [(), ("dispatch",), ("combine_bwd",), ("dispatch", "combine_bwd")])
def test_sorted_experts_on_the_row_kernels_match_dense_reference(kernels):
    """The Triton experts without the gather fusion (the Mosaic forward's path on an H200) on each set of row kernels
    (compute.moe.kernels.permute_kernels): the kernels are in the gradient's jaxpr as set, and with a capacity that
    drops (rows of the sorted buffer mapped by nothing, left unwritten by the kernels) output and every gradient equal
    the dense reference with the same drops."""
    chosen = KernelsConfig(fusions=(), permute_kernels=kernels)
    x, idx, w, w_gate_up, w_down = make_problem(seed=4, t=24, routing="skewed")
    fn = lambda *a: experts_forward(*a, backend="triton", kernels=chosen)  # noqa: E731
    assert _row_kernels(fn, x, idx, w, w_gate_up, w_down) == set(kernels)
    assert_close(value_and_grads(fn, x, idx, w, w_gate_up, w_down),
                 value_and_grads(dense_reference, x, idx, w, w_gate_up, w_down), what=f"{kernels} dropless")
    capped = lambda *a: experts_forward(*a, backend="triton", capacity_factor=0.5, drop_policy="position",  # noqa: E731
                                        kernels=chosen)
    plan = permute.route_plan(idx, w, 8, capacity=permute.expert_capacity(24, 2, 8, 0.5), drop_policy="position")
    keep = (np.asarray(plan.expert) < 8).reshape(24, 2)
    assert 0 < keep.sum() < keep.size
    got = value_and_grads(capped, x, idx, w, w_gate_up, w_down)
    for a in jax.tree.leaves(got):
        assert np.isfinite(np.asarray(a)).all()
    assert_close(got, value_and_grads(lambda *a: dense_reference(*a, keep=jnp.asarray(keep)), x, idx, w, w_gate_up,
                                      w_down), what=f"{kernels} with drops")


def test_row_kernels_stay_out_of_fp8_and_other_backends():
    """FP8 scales are maxima over every row (unwritten rows would set them) and the other backends may read every
    row: neither takes the row kernels."""
    unfused = KernelsConfig(fusions=())
    x, idx, w, w_gate_up, w_down = make_problem(seed=4, t=24)
    cfg = fp8.Fp8Config(recipe="tensor")
    assert _row_kernels(lambda *a: experts_forward(*a, backend="triton", fp8_config=cfg, kernels=unfused), x, idx, w,
                        w_gate_up, w_down) == set()
    assert _row_kernels(lambda *a: experts_forward(*a, backend="ragged_dot", kernels=unfused), x, idx, w, w_gate_up,
                        w_down) == set()
    assert _row_kernels(lambda *a: experts_forward(*a, backend="triton", kernels=unfused), x, idx, w, w_gate_up,
                        w_down) == {"dispatch", "combine_bwd"}
