"""FP8 GEMMs (parallelism/fp8.py) against a quantise-dequantise reference written here in numpy with
ml_dtypes' float8 types: the scales and the rounding, saturation, the GEMM forward, the custom VJPs
(operands straight through, the output gradient rounded to e5m2), and the experts under the scope
(the trainer in FP8: test_fp8_trainer.py)."""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from moevlm_jax.parallelism import fp8
from moevlm_jax.parallelism.experts import experts_forward
from tests.parallelism.moe_reference import dense_reference, make_problem

NP_FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}
TOP = {"e4m3": 448.0, "e5m2": 57344.0}


def ref_qdq(x: np.ndarray, fmt: str, blocks) -> np.ndarray:
    """Block by block: scale = the block's amax / the format's max (1 for a zero block), x / scale
    clipped and rounded to the format, times the scale."""
    x = np.asarray(x, np.float32)
    out = np.empty_like(x)
    sizes = [d if b == -1 else min(b, d) for d, b in zip(x.shape, blocks)]
    ranges = [range(0, d, s) for d, s in zip(x.shape, sizes)]
    for start in itertools.product(*ranges):
        idx = tuple(slice(a, a + s) for a, s in zip(start, sizes))
        blk = x[idx]
        amax = np.float32(np.max(np.abs(blk)))
        scale = np.float32(amax / np.float32(TOP[fmt])) if amax > 0 else np.float32(1.0)
        q = np.clip(blk / scale, -TOP[fmt], TOP[fmt]).astype(NP_FORMATS[fmt])
        out[idx] = q.astype(np.float32) * scale
    return out


def _data(shape, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.uniform(-3, 3, shape)).astype(np.float32)
    x.flat[::97] *= 50.0  # outliers: blockwise scaling must confine them to their blocks
    return x


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("blocks", [(-1, -1), (1, 128), (128, 128), (1, 32), (16, 48)])
def test_qdq_equals_the_numpy_reference(fmt, blocks):
    x = _data((40, 300))  # 300 is not a multiple of the blocks: the last block is partial
    got = np.asarray(fp8.qdq(jnp.asarray(x), fmt, blocks))
    # the same fp8 values; XLA may form amax / max as amax x (1 / max): scales within an ulp of float32
    np.testing.assert_allclose(got, ref_qdq(x, fmt, blocks), rtol=3e-7, atol=0)


def test_scales_saturation_and_zero_blocks():
    x = np.zeros((2, 256), np.float32)
    x[0, :128] = np.linspace(-3.0, 7.0, 128)  # block (0, 0): amax 7
    x[1, 128] = 1e30  # block (1, 1): one huge value
    q, scale = fp8.quantize(jnp.asarray(x), "e4m3", (1, 128))
    scale = np.asarray(scale).reshape(2, 2)
    assert scale[0, 0] == pytest.approx(7.0 / 448.0, rel=1e-7) and scale[1, 1] == pytest.approx(1e30 / 448.0, rel=1e-7)
    assert scale[0, 1] == 1.0 and scale[1, 0] == 1.0  # all-zero blocks: scale 1, no division by zero
    q = np.asarray(q.astype(jnp.float32)).reshape(2, 256)
    assert np.isfinite(q).all()
    assert q[0, 127] == 448.0 and q[1, 128] == 448.0  # each block's largest magnitude maps to the top
    assert (q[0, 128:] == 0).all() and (q[1, :128] == 0).all()
    # values past the top (a given scale) saturate instead of becoming NaN (e4m3fn has no infinity)
    big = fp8.qdq(jnp.asarray([[1.0, -2.0, 1000.0]]), "e4m3", (-1, -1))
    assert np.isfinite(np.asarray(big)).all()


@pytest.mark.parametrize("fmt,mantissa", [("e4m3", 3), ("e5m2", 2)])
def test_rounding_error_is_half_an_ulp(fmt, mantissa):
    x = _data((64, 128), seed=1)
    y = np.asarray(fp8.qdq(jnp.asarray(x), fmt, (-1, -1)))
    amax = np.abs(x).max()
    # normal numbers of the scaled format: relative error <= 2^-(mantissa+1)
    tiny = amax / TOP[fmt] * {"e4m3": 2.0**-6, "e5m2": 2.0**-14}[fmt]
    normal = np.abs(x) >= tiny
    rel = np.abs(y - x)[normal] / np.abs(x)[normal]
    assert rel.max() <= 2.0 ** -(mantissa + 1) * (1 + 1e-6)
    assert rel.max() > 2.0 ** -(mantissa + 3)  # it does round


@pytest.mark.parametrize("blocks", [(1, 128), (-1, -1)])
def test_the_fp8_tensor_is_behind_a_barrier(blocks):
    """XLA:GPU compiled the fp8 rounding away (on the H200 both recipes' GEMMs had bf16's error size,
    bench/results/fp8.md; most likely its convert-chain folding under default excess precision); XLA:CPU
    does not, so the rounding tests above cannot see it. What keeps the rounding on any backend: the fp8 tensor
    itself passes an optimisation barrier before it is converted back (the program's text says so)."""
    text = jax.jit(lambda x: fp8.qdq(x, "e4m3", blocks)).lower(jnp.ones((4, 256), jnp.bfloat16)).as_text()
    barriers = [line for line in text.splitlines() if "optimization_barrier" in line]
    assert len(barriers) == 1 and "xf8E4M3FN>" in barriers[0], barriers


@pytest.mark.parametrize("recipe", ["tensor", "blockwise"])
def test_dot_and_its_gradients_are_the_recipe(recipe):
    cfg = fp8.Fp8Config(recipe=recipe, block=32)
    x, w, g = _data((6, 5, 96), 2), _data((96, 3, 40), 3) * 0.05, _data((6, 5, 3, 40), 4)
    y, vjp = jax.vjp(lambda a, b: fp8.dot(a, b, 1, cfg), jnp.asarray(x), jnp.asarray(w))
    dx, dw = vjp(jnp.asarray(g))
    xb, wb = ((-1, -1), (-1, -1)) if recipe == "tensor" else ((1, 32), (32, 32))
    xq, wq = ref_qdq(x.reshape(30, 96), "e4m3", xb), ref_qdq(w.reshape(96, 120), "e4m3", wb)
    gq = ref_qdq(g.reshape(30, 120), "e5m2", xb)  # the output gradient: 1 x B blocks along N
    f64 = np.float64
    np.testing.assert_allclose(np.asarray(y).reshape(30, 120), xq.astype(f64) @ wq, rtol=2e-5, atol=1e-4)
    np.testing.assert_allclose(np.asarray(dx).reshape(30, 96), gq.astype(f64) @ wq.T, rtol=2e-5, atol=1e-3)
    np.testing.assert_allclose(np.asarray(dw).reshape(96, 120), xq.T.astype(f64) @ gq, rtol=2e-5, atol=1e-3)
    # and it is not the float32 GEMM: FP8's error is there, of the size its 3 mantissa bits give
    exact = x.reshape(30, 96).astype(f64) @ w.reshape(96, 120)
    err = np.linalg.norm(np.asarray(y).reshape(30, 120) - exact) / np.linalg.norm(exact)
    assert 1e-3 < err < 0.08


def test_the_tensor_recipe_hands_the_fp8_arrays_to_the_dot():
    """The tensor recipe's dense GEMMs are dots of fp8 arrays (e4m3 x e4m3 forward, e5m2 x e4m3 for both
    gradients), the form XLA:GPU compiles to cuBLASLt's FP8 GEMM (bench/results/fp8.md section 4), not a
    dot of dequantised bf16 operands; the blockwise recipe stays quantise-dequantise."""
    x, w, g = (jnp.ones(s, jnp.bfloat16) for s in ((32, 64), (64, 48), (32, 48)))

    def dots(recipe):
        cfg = fp8.Fp8Config(recipe=recipe)
        def fwd_bwd(a, b, c):
            y, vjp = jax.vjp(lambda a, b: fp8.dot(a, b, 1, cfg), a, b)
            return y, vjp(c)

        fwd_bwd = jax.jit(fwd_bwd)
        text = fwd_bwd.lower(x, w, g).as_text()
        return [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln]

    tensor = dots("tensor")
    assert len(tensor) == 3 and all("f8E4M3FN" in ln for ln in tensor), tensor
    assert sum("f8E5M2" in ln for ln in tensor) == 2  # the output gradient in both gradient GEMMs
    assert not any("f8E" in ln for ln in dots("blockwise"))


def test_config_sites_and_refusals():
    on = fp8.Fp8Config(recipe="tensor", vision=False)
    assert on.at("dense") is on and on.at("experts") is on and on.at("vision") is None
    assert fp8.Fp8Config().at("dense") is None  # recipe none: nothing in FP8
    with pytest.raises(ValueError, match="compute.fp8.block"):
        fp8.Fp8Config(recipe="blockwise", block=0)
    with pytest.raises(ValueError, match="unknown fp8 site"):
        on.at("lm_head")


@pytest.mark.parametrize("backend", ["dense", "ragged_dot", "capacity"])
def test_experts_in_fp8_equal_the_reference_on_quantised_operands(backend):
    x, idx, w, wgu, wd = make_problem(seed=5, t=32, h=32, e=4, i=16, k=2)
    cfg = fp8.Fp8Config(recipe="blockwise", block=16)
    extra = {"capacity_factor": 4.0} if backend == "capacity" else {}  # capacity 4: nothing dropped

    def ours(x, wgu, wd, q):
        return experts_forward(x, idx, w, wgu, wd, fp8_config=q, backend=backend, **extra)

    got = ours(x, wgu, wd, cfg)
    # the reference on fp8-rounded operands: tokens (1 x 16 blocks, per row), weights 16 x 16 per expert,
    # the SwiGLU output rounded again before the down projection
    xq = ref_qdq(np.asarray(x), "e4m3", (1, 16))
    wguq = ref_qdq(np.asarray(wgu), "e4m3", (1, 16, 16))
    wdq = ref_qdq(np.asarray(wd), "e4m3", (1, 16, 16))
    h = np.einsum("th,ehf->tef", xq, wguq)
    gate, up = np.split(h, 2, axis=-1)
    act = gate / (1 + np.exp(-gate)) * up  # [T, E, I]
    actq = np.stack([ref_qdq(act[:, e], "e4m3", (1, 16)) for e in range(act.shape[1])], 1)
    # rows an expert does not take do not enter its blocks (1 x B: per row), so every expert's act is exact
    y = np.einsum("tei,eih->teh", actq, wdq)
    routing = np.zeros((32, 4), np.float32)
    np.add.at(routing, (np.arange(32)[:, None], np.asarray(idx)), np.asarray(w))
    want = np.einsum("teh,te->th", y, routing)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
    full = np.asarray(dense_reference(x, idx, w, wgu, wd))
    err = np.linalg.norm(np.asarray(got) - full) / np.linalg.norm(full)
    assert 1e-3 < err < 0.1  # FP8 differs from the float32 experts by its rounding, no more
    # the gradient flows (straight through the operands' rounding) and is close to float32's
    gq = jax.grad(lambda a: jnp.sum(ours(a, wgu, wd, cfg) ** 2))(x)
    g32 = jax.grad(lambda a: jnp.sum(ours(a, wgu, wd, None) ** 2))(x)
    assert np.linalg.norm(gq - g32) / np.linalg.norm(g32) < 0.15
