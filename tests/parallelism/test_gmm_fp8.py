"""The FP8 grouped-matmul kernels (parallelism/gmm_fp8.py, Pallas interpret mode on CPU) against the
quantise-dequantise reference: the operands quantised and dequantised by fp8.py's own quantize / dequantize, then a
float64 product per group. The kernels get the same fp8 values, so they differ from the reference only by the
order and precision of their float32 arithmetic: each entry within ``(C + 8) u (|A| |B|)`` (``C`` the contraction
length, ``u = 2^-24``: the bound of a float32 sum of ``C`` exact products of fp8 values, plus a few roundings of
the dequantised operands and of the scale multiplies), with no fp8-sized term. And the experts' layer on the kernels
against the same layer quantise-dequantise (``compute.fp8.experts_kernel``)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.parallelism import fp8
from moevlm_jax.parallelism import gmm_fp8 as gf
from moevlm_jax.parallelism.gmm_triton import Config
from tests.parallelism.moe_reference import dense_reference, make_problem, value_and_grads

U = 2.0**-24
SIZES = [13, 0, 1, 21]  # uneven, an empty group, a group of one row; 35 of 48 rows used, 13 past sum(group_sizes)
M, K, N, B = 48, 48, 40, 32  # K and N not multiples of the 32-wide blocks (blockwise pads them to 64)
TILES = Config(block_m=8, block_n=16, block_k=16, num_warps=4, num_stages=1)  # block_k: half the scale block


def _data(shape, seed, huge):
    """Magnitudes over 1e-7 .. ``huge``: the per-tensor scale flushes the smallest to zero, each block's largest
    maps to the format's maximum."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape))
    x.flat[::37] = 1e-7
    x.flat[5] = huge
    return x.astype(np.float32)


def _blocks(recipe, ndim, kind):
    return fp8.Fp8Config(recipe=recipe, block=B).blocks(ndim, kind, batch_dims=1 if kind == "rhs" else 0)


def _dequantised(x, fmt, blocks):
    """fp8.py's own quantise-dequantise: the reference's operand, float64."""
    q, s = fp8.quantize(jnp.asarray(x), fmt, blocks)
    return np.asarray(fp8.dequantize(q, s, x.shape, jnp.float32), np.float64)


def _check(got, a, b, contraction, what):
    """``got`` (float32) against the float64 product ``a @ b`` within the accumulation-order bound."""
    want = a @ b
    bound = (contraction + 8) * U * (np.abs(a) @ np.abs(b)) + 1e-30
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.isfinite(got).all(), what
    assert (err <= bound).all(), f"{what}: worst error / bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("recipe", ["tensor", "blockwise"])
def test_kernels_equal_the_quantise_dequantise_reference(recipe):
    cfg = fp8.Fp8Config(recipe=recipe, block=B)
    blockwise = recipe == "blockwise"
    valid = np.arange(M) < sum(SIZES)
    x = np.where(valid[:, None], _data((M, K), 0, 3e4), 0).astype(np.float32)
    dy = np.where(valid[:, None], _data((M, N), 1, 1e6), 0).astype(np.float32)
    w = _data((len(SIZES), K, N), 2, 50.0)
    gs = jnp.asarray(SIZES, jnp.int32)

    qx, sx = gf.quantize_rows(jnp.asarray(x), "e4m3", cfg)
    qw, sw = gf.quantize_weights(jnp.asarray(w), "e4m3", cfg)
    qg, sg = gf.quantize_rows(jnp.asarray(dy), "e5m2", cfg)
    # the fp8 range is used to its ends (each block's largest magnitude on the format's maximum) and the smallest
    # values flush to zero under one scale for the whole tensor
    for q, top in ((qx, 448.0), (qw, 448.0), (qg, 57344.0)):
        assert np.abs(np.asarray(q, np.float32)).max() == top
    if not blockwise:
        assert (np.asarray(qx, np.float32)[x == np.float32(1e-7)] == 0).all()
    # rows past sum(group_sizes) hold NaN, fp8 and scales alike: the kernels must not read them
    qx, qg = (jnp.where(jnp.asarray(valid)[:, None], q, jnp.nan).astype(q.dtype) for q in (qx, qg))
    if blockwise:
        sx, sg = (jnp.where(jnp.asarray(valid)[None, :], s, jnp.nan) for s in (sx, sg))

    kw = dict(blockwise=blockwise, config=TILES, out_dtype=jnp.float32)
    y = np.asarray(gf.gmm(qx, sx, qw, sw, gs, **kw))[:, :N]
    dx = np.asarray(gf.gmm(qg, sg, qw, sw, gs, trans_w=True, **kw))[:, :K]
    dw = np.asarray(gf.tgmm(qx, sx, qg, sg, gs, **kw))[:, :K, :N]

    xd, gd = _dequantised(x, "e4m3", _blocks(recipe, 2, "lhs")), _dequantised(dy, "e5m2", _blocks(recipe, 2, "lhs"))
    wd = _dequantised(w, "e4m3", _blocks(recipe, 3, "rhs"))
    start = 0
    for e, size in enumerate(SIZES):
        rows = slice(start, start + size)
        _check(y[rows], xd[rows], wd[e], K, f"gmm group {e}")
        _check(dx[rows], gd[rows], wd[e].T, N, f"gmm trans_w group {e}")
        _check(dw[e], xd[rows].T, gd[rows], size, f"tgmm group {e}")
        start += size
    assert (dw[1] == 0).all()  # the empty group's d(w)


def test_kernel_arguments_are_checked():
    gs = jnp.asarray([2, 2], jnp.int32)
    q = jnp.zeros((4, 64), jnp.float8_e4m3fn)
    w = jnp.zeros((2, 64, 32), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="per-tensor scales"):
        gf.gmm(q, jnp.ones((1,)), w, jnp.ones((1,)), gs, out_dtype=jnp.float32)
    with pytest.raises(ValueError, match="not 1 x B / B x B blocks"):
        gf.gmm(q, jnp.ones((1, 4)), w, jnp.ones((2, 2, 1)), gs, out_dtype=jnp.float32, blockwise=True)
    with pytest.raises(ValueError, match="do not contract"):
        gf.gmm(q, jnp.ones((1,)), w, jnp.ones((2,)), gs, out_dtype=jnp.float32, trans_w=True)


# ----------------------------------------------------------------------------- the experts on the kernels


def _experts(recipe, kernel):
    from moevlm_jax.parallelism.experts import experts_forward

    cfg = fp8.Fp8Config(recipe=recipe, block=16, experts_kernel=kernel)
    return lambda *a: experts_forward(*a, fp8_config=cfg, backend="triton")


@pytest.mark.parametrize("recipe", ["tensor", "blockwise"])
def test_experts_on_the_fp8_kernels_equal_quantise_dequantise(recipe, monkeypatch):
    """The layer forward and its gradients (d x, d routing weights, d w_gate_up, d w_down) with
    ``experts_kernel: triton`` against ``qdq``, float32: the same fp8 values, the same recipe, float32 rounding in
    another order (norm-wise ~2e-7 measured; FP8's own error against float32, 6-10% here, is checked to stay far
    above it). A rounding difference can in principle move a value of h or act (or a gradient) across an fp8
    rounding boundary before its next quantisation, one fp8 step in that entry (~1e-3 norm-wise at these sizes):
    none does with this data, so a failure after the data changes is worth a look, not necessarily a bug."""
    x, idx, w, wgu, wd = make_problem(seed=5, t=16, h=32, e=4, i=16, k=2)
    calls = []
    for name in ("gmm", "tgmm"):
        real = getattr(gf, name)
        monkeypatch.setattr(gf, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    got = value_and_grads(_experts(recipe, "triton"), x, idx, w, wgu, wd)
    assert calls.count("gmm") == 4 and calls.count("tgmm") == 2  # two GEMMs forward, four backward
    want = value_and_grads(_experts(recipe, "qdq"), x, idx, w, wgu, wd)
    exact = value_and_grads(dense_reference, x, idx, w, wgu, wd)
    names = ("y", "d x", "d routing weights", "d w_gate_up", "d w_down")
    for name, a, b, c in zip(names, jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(exact)):
        a, b, c = (np.asarray(v, np.float64) for v in (a, b, c))
        assert np.isfinite(a).all(), name
        rel = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert rel < 1e-5, f"{name}: kernel vs qdq {rel:.3g}"
        assert np.linalg.norm(b - c) / np.linalg.norm(c) > 10 * max(rel, 1e-4), f"{name}: FP8 error not seen"


def test_experts_kernel_needs_the_triton_backend():
    from moevlm_jax.model.compute import ComputeConfig
    from moevlm_jax.parallelism.experts import experts_forward
    from moevlm_jax.schema import to_plain

    section = {"recipe": "tensor", "experts_kernel": "triton"}
    with pytest.raises(ValueError, match="experts_kernel 'triton'.*not 'ragged_dot'"):
        ComputeConfig.from_dict({"moe": {"backend": "ragged_dot"}, "fp8": section})
    on = ComputeConfig.from_dict({"moe": {"backend": "triton"}, "fp8": section})
    assert on.fp8.experts_kernel == "triton"
    plain = to_plain(on)  # what config.yaml holds
    assert plain["fp8"]["experts_kernel"] == "triton" and ComputeConfig.from_dict(plain) == on
    # inert where the experts are not in FP8
    ComputeConfig.from_dict({"moe": {"backend": "ragged_dot"}, "fp8": {**section, "experts": False}})
    with pytest.raises(ValueError, match="experts_kernel must be qdq or triton"):
        fp8.Fp8Config(experts_kernel="cutlass")
    x, idx, w, wgu, wd = make_problem(seed=1, t=8, h=16, e=4, i=8, k=2)
    kernel = fp8.Fp8Config(recipe="tensor", experts_kernel="triton")
    with pytest.raises(ValueError, match="resolves to 'dense'"):
        experts_forward(x, idx, w, wgu, wd, fp8_config=kernel, backend="dense")
