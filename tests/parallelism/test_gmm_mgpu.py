"""The Mosaic-GPU grouped matmul (parallelism.gmm_mgpu): its tile table by hand, its forward kernel and the SwiGLU
epilogue kernels in Pallas' GPU interpreter against per-group einsums and JAX's gradients (and against the XLA
contracts that stand in for them in the layer tests), the layers' custom VJPs around them, and the shape checks.
The d(x) form (w read transposed in shared memory) is not run here: the interpreter has no transposed wgmma operand
(jax 0.10.2); on an H200 it was bitwise equal to the Triton kernel's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.parallelism import gmm_mgpu
from moevlm_jax.parallelism.kernels import KernelsConfig, MosaicGpuTiles


def _by_group(x, w, group_sizes, spec):
    """Each row's product with its group's weights (``einsum(spec)`` in float32, bf16 operands) and which rows the
    groups hold; rows past ``sum(group_sizes)`` take group 0's."""
    m = x.shape[0]
    ends = jnp.cumsum(group_sizes)
    gid = jnp.minimum(jnp.searchsorted(ends, jnp.arange(m), side="right"), len(group_sizes) - 1)
    each = jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32), precision="highest")  # [G, M, N]
    return jnp.take_along_axis(each, gid[None, :, None], axis=0)[0], jnp.arange(m) < ends[-1]


def dswiglu_contract(dy, w, group_sizes, h, row_w=None):
    """``gmm_mgpu.gmm_dswiglu``'s contract in XLA (the layer's call: ``w [G, I, H]`` read transposed), its stand-in
    in the layer tests: d(h) = JAX's gradient of (weighted) SwiGLU at h for d(act) = dy @ w[g]^T rounded to dy's
    dtype, rows past ``sum(group_sizes)`` NaN; with ``row_w`` also the weights' gradient, 0 there."""
    from moevlm_jax.parallelism.permute import swiglu

    d_act, used = _by_group(dy, w, group_sizes, "mh,gih->gmi")
    d_act = d_act.astype(dy.dtype)
    if row_w is None:
        return jnp.where(used[:, None], jax.vjp(swiglu, h)[1](d_act)[0], jnp.nan)
    dh, d_row_w = jax.vjp(swiglu, h, row_w)[1](d_act)
    return jnp.where(used[:, None], dh, jnp.nan), jnp.where(used, d_row_w, 0.0)


def test_block_table_hand_computed():
    # tile_m 4, 16 rows; groups of 5, 0, 6, 2 rows (13 used): rows 0-4 g0 (blocks 0, 1), 5-10 g2 (blocks 1, 2),
    # 11-12 g3 (blocks 2, 3); one spare tile
    group, row0, lo, hi = (np.asarray(a) for a in gmm_mgpu.block_table(jnp.asarray([5, 0, 6, 2]), 16, 4))
    assert len(group) == 16 // 4 + 4 - 1
    used = hi > lo
    assert used.tolist() == [True] * 6 + [False]
    np.testing.assert_array_equal(group[used], [0, 0, 2, 2, 3, 3])
    np.testing.assert_array_equal(row0[used], [0, 4, 4, 8, 8, 12])
    np.testing.assert_array_equal(lo[used], [0, 4, 5, 8, 11, 12])
    np.testing.assert_array_equal(hi[used], [4, 5, 8, 11, 12, 13])


def test_block_table_group_start_windows_hand_computed():
    # tile_m 16, align 8, 64 rows; groups of 20, 0, 5, 30, 3 rows (58 used): g0 rows 0-19 (windows at 0, 16),
    # g2 rows 20-24 (window at 16), g3 rows 25-54 (windows at 24, 40), g4 rows 55-57 (window at 48)
    group, row0, lo, hi = (np.asarray(a) for a in gmm_mgpu.block_table(jnp.asarray([20, 0, 5, 30, 3]), 64, 16, 8))
    assert len(group) == 64 // 16 + 5 + 3  # + ceil(5 * 7 / 16)
    used = hi > lo
    assert used.sum() == 6 and used[:6].all()
    np.testing.assert_array_equal(group[used], [0, 0, 2, 3, 3, 4])
    np.testing.assert_array_equal(row0[used], [0, 16, 16, 24, 40, 48])
    np.testing.assert_array_equal(lo[used], [0, 16, 20, 25, 40, 55])
    np.testing.assert_array_equal(hi[used], [16, 20, 25, 40, 55, 58])
    # a last window past row m moves back to end at m: rows 10-63 in windows from row 8, the fourth (56) at 48
    group, row0, lo, hi = (np.asarray(a) for a in gmm_mgpu.block_table(jnp.asarray([10, 54]), 64, 16, 8))
    used = hi > lo
    np.testing.assert_array_equal(row0[used], [0, 8, 24, 40, 48])
    np.testing.assert_array_equal(lo[used], [0, 10, 24, 40, 56])
    np.testing.assert_array_equal(hi[used], [10, 24, 40, 56, 64])
    with pytest.raises(ValueError, match="multiple of 8"):
        gmm_mgpu.block_table(jnp.asarray([3, 60]), 64, 16, 4)


# 2 simulated SMs where 4 add nothing but time (the interpreter's time grows with each): 4 where a program's tiles
# change with them (align 128's lone tiles)
@pytest.mark.parametrize("align,epi_buffers,sms", [(128, 1, 4), (8, 1, 2), (8, 2, 2)])
def test_forward_kernel_in_the_gpu_interpreter_matches_per_group_einsum(align, epi_buffers, sms):
    """Windows at aligned row blocks and at each group's start, one and two epilogue buffers: g4's last window is
    moved back to end at row 512."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    m, k, n = 512, 128, 256
    # 480 of 512 rows; a group inside one row block; an empty one; with align 8 windows at rows 0, 128 (g0), 128,
    # 256 (g2), 328 (g3), 336 and 384 (g4: the last moved back from 464 to end at row 512)
    sizes = np.array([130, 0, 200, 10, 140], np.int32)
    x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (len(sizes), k, n), jnp.float32) / 8).astype(jnp.bfloat16)
    cfg = gmm_mgpu.Config(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2, grid_tile_width=1,
                          align=align, epi_buffers=epi_buffers)
    out = gmm_mgpu.gmm(x, w, jnp.asarray(sizes), config=cfg, interpret=InterpretGPUParams(), num_sms=sms)
    used = int(sizes.sum())
    gid = np.repeat(np.arange(len(sizes)), sizes)
    ref = np.einsum("mk,mkn->mn", np.asarray(x[:used], np.float32), np.asarray(w, np.float32)[gid])
    got = np.asarray(out.astype(jnp.float32))[:used]
    # bf16 output of a float32 accumulation: within bf16 rounding of each element
    np.testing.assert_allclose(got, ref, rtol=1e-2, atol=1e-2 * np.abs(ref).max())


def test_swiglu_backward_kernel_in_the_gpu_interpreter_matches_jax_gradient_of_swiglu(sms=2):
    """gmm_dswiglu: d(h) = JAX's gradient of permute.swiglu at h for d(act) = dy @ w[g] as gmm gives it (bf16); each
    warpgroup's four 64 x 64 slabs go through two h buffers (refilled twice); h's rows past the groups' are NaN (read
    into the epilogue, never stored). trans_w=False here (the interpreter has no transposed wgmma operand); the
    layer's call (trans_w=True) is cross-lowered for a GPU."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    from moevlm_jax.parallelism.permute import swiglu

    m, k, n = 256, 128, 256
    sizes = np.array([70, 0, 100, 10, 60], np.int32)  # 240 of 256 rows; windows at rows 0, 64, 128 (g3, g4: moved back)
    used = int(sizes.sum())
    ks = jax.random.split(jax.random.key(7), 3)
    dy = jax.random.normal(ks[0], (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[1], (len(sizes), k, n), jnp.float32) / 8).astype(jnp.bfloat16)
    h = jax.random.normal(ks[2], (m, 2 * n), jnp.float32).at[used:].set(jnp.nan).astype(jnp.bfloat16)
    cfg = gmm_mgpu.Config(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2, grid_tile_width=1, epi_buffers=2)
    run = dict(config=cfg, interpret=InterpretGPUParams(), num_sms=sms)
    dh = gmm_mgpu.gmm_dswiglu(dy, w, jnp.asarray(sizes), h, trans_w=False, **run)
    assert dh.shape == (m, 2 * n)
    da = gmm_mgpu.gmm(dy, w, jnp.asarray(sizes), **run)
    want = np.asarray(jax.vjp(swiglu, h[:used])[1](da[:used])[0], np.float32)
    got = np.asarray(dh[:used], np.float32)
    assert np.isfinite(got).all()
    # the same bf16 values, float32 sigmoid and products (JAX's grad orders them its own way) rounded to bf16
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-3 * np.abs(want).max())
    assert np.mean(got == want) > 0.95
    _assert_near([(dh, dswiglu_contract(dy, jnp.swapaxes(w, 1, 2), jnp.asarray(sizes), h))], used)
    with pytest.raises(ValueError, match="SwiGLU's backward"):
        gmm_mgpu.gmm_dswiglu(dy, w, jnp.asarray(sizes), h[:, :384], trans_w=False, config=cfg)


def _assert_near(pairs, used):
    """Each kernel output within bf16 rounding of its stand-in (``*_contract``, whose d(act) is rounded from a float32
    einsum rather than the kernel's accumulation) over the groups' rows, and the stand-in's rows past them NaN / 0."""
    for got, want in pairs:
        a, b = np.asarray(got[:used], np.float32), np.asarray(want[:used], np.float32)
        assert np.isfinite(b).all() and np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2
        tail = np.asarray(want[used:], np.float32)
        assert np.isnan(tail).all() if tail.ndim > 1 else (tail == 0).all()


def test_weighted_swiglu_backward_kernel_in_the_gpu_interpreter_matches_jax_gradient_of_weighted_swiglu(sms=2):
    """gmm_dswiglu with row weights, the backward of Megatron's weighted SwiGLU (act_w = silu(gate) * up * weight from
    h's rounded values, rounded once): d(h) and the weights' gradient (row sums of d(act_w) * act) as JAX
    differentiates that function at h for d(act_w) = dy @ w[g] as gmm gives it. Rows of five groups, h's rows past
    them NaN (the weights' gradient there 0: _row_sums keeps each row from its own tile); the kernel lowered for a
    GPU (the row vectors in wgmma's layout) too."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    def weighted_swiglu(h, row_w):
        gate, up = jnp.split(h.astype(jnp.float32), 2, axis=-1)
        return (jax.nn.silu(gate) * up * row_w[:, None]).astype(h.dtype)

    cfg = gmm_mgpu.Config(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2, grid_tile_width=1, epi_buffers=2)
    run = dict(config=cfg, interpret=InterpretGPUParams(), num_sms=sms)
    m, k, n = 256, 128, 256
    sizes = np.array([70, 0, 100, 10, 60], np.int32)  # 240 of 256 rows
    used = int(sizes.sum())
    ks = jax.random.split(jax.random.key(8), 5)
    row_w = jax.random.uniform(ks[2], (m,), jnp.float32, 0.05, 1.0)  # 0.05-1: their omission changes every row
    dy = jax.random.normal(ks[3], (m, k), jnp.float32).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[4], (len(sizes), k, n), jnp.float32) / 8).astype(jnp.bfloat16)  # [G, H, I] untransposed
    h_nan = jax.random.normal(ks[2], (m, 2 * n), jnp.float32).at[used:].set(jnp.nan).astype(jnp.bfloat16)
    dh, d_row_w = gmm_mgpu.gmm_dswiglu(dy, wd, jnp.asarray(sizes), h_nan, row_w, trans_w=False, **run)
    assert dh.shape == (m, 2 * n) and d_row_w.shape == (m,) and d_row_w.dtype == jnp.float32
    d_act_w = gmm_mgpu.gmm(dy, wd, jnp.asarray(sizes), **run)
    want_dh, want_dw = jax.vjp(weighted_swiglu, h_nan[:used], row_w[:used])[1](d_act_w[:used])
    got_dh = np.asarray(dh[:used], np.float32)
    want_dh = np.asarray(want_dh, np.float32)
    assert np.isfinite(got_dh).all()
    np.testing.assert_allclose(got_dh, want_dh, rtol=1e-2, atol=1e-3 * np.abs(want_dh).max())
    assert np.mean(got_dh == want_dh) > 0.95
    # float32 sums of the same float32 products over 256 columns, in another order
    np.testing.assert_allclose(np.asarray(d_row_w[:used]), np.asarray(want_dw), rtol=1e-4,
                               atol=1e-5 * np.abs(np.asarray(want_dw)).max())
    np.testing.assert_array_equal(np.asarray(d_row_w[used:]), 0.0)
    _assert_near(zip((dh, d_row_w), dswiglu_contract(dy, jnp.swapaxes(wd, 1, 2), jnp.asarray(sizes), h_nan, row_w)),
                 used)  # the layer tests' stand-in
    with pytest.raises(ValueError, match="row weights"):
        gmm_mgpu.gmm_dswiglu(dy, wd, jnp.asarray(sizes), h_nan, row_w.astype(jnp.bfloat16), trans_w=False, config=cfg)
    with pytest.raises(ValueError, match="row weights"):
        gmm_mgpu.gmm(dy, wd, jnp.asarray(sizes), None, row_w, config=cfg)  # a plain matmul takes no row weights

    bf, f32, i32 = jnp.bfloat16, jnp.float32, jnp.int32
    spec = jax.ShapeDtypeStruct
    args = (spec((1024, 256), bf), spec((4, 256, 256), bf), spec((4,), i32), spec((1024, 512), bf), spec((1024,), f32))
    lowered = jax.jit(gmm_mgpu.gmm_dswiglu).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered.count("mosaic_gpu_v2") >= 1


def test_shape_checks_name_the_problem():
    x = jnp.zeros((256, 100), jnp.bfloat16)
    w = jnp.zeros((2, 100, 256), jnp.bfloat16)
    assert not gmm_mgpu.supported(256, 100, 256)
    assert not gmm_mgpu.supported(200, 128, 256)
    assert gmm_mgpu.supported(256, 128, 256)
    with pytest.raises(ValueError, match="K % 64"):
        gmm_mgpu.gmm(x, w, jnp.asarray([100, 100]))
    with pytest.raises(ValueError, match="do not contract"):
        gmm_mgpu.gmm(x, jnp.zeros((2, 64, 256), jnp.bfloat16), jnp.asarray([100, 100]))


def test_plain_gmm_routes_only_supported_bf16_gpu_matmuls_to_the_mosaic_kernel(monkeypatch):
    """``grouped_matmul.plain_gmm``: the listed kinds, bf16, on a GPU, at shapes the kernel takes; else Triton."""
    from moevlm_jax.parallelism import gmm_triton
    from moevlm_jax.parallelism import grouped_matmul as gmmod

    calls = []
    monkeypatch.setattr(gmm_mgpu, "gmm", lambda x, w, s, trans_w=False, config=None: calls.append(
        ("mgpu", trans_w, config)) or "mgpu")
    monkeypatch.setattr(gmm_triton, "gmm", lambda x, w, s, trans_w=False, config=None: calls.append(
        ("triton", trans_w)) or "triton")
    monkeypatch.setattr(gmm_triton, "_on_cpu", lambda: False)
    monkeypatch.setattr(gmm_mgpu, "on_hopper", lambda: True)
    tiles = dataclasses.replace(gmm_mgpu.CONFIGS["dx"], grid_tile_width=2)
    kernels = KernelsConfig(mosaic_gpu=("dx",), mosaic_gpu_tiles=MosaicGpuTiles(dx=tiles))
    run = lambda *a, **kw: gmmod.plain_gmm(*a, kernels=kernels, **kw)  # noqa: E731
    s = jnp.asarray([128, 128])
    bf = jnp.bfloat16
    x, w = jnp.zeros((256, 128), bf), jnp.zeros((2, 128, 256), bf)
    assert run(x, w, s) == "triton"  # fwd not listed
    assert run(jnp.zeros((256, 256), bf), w, s, trans_w=True) == "triton"  # out 128 columns: not 256-wide
    wt = jnp.zeros((2, 256, 128), bf)  # d(x): [G, out 256, contract 128]
    assert run(x, wt, s, trans_w=True) == "mgpu"
    assert run(x.astype(jnp.float32), wt.astype(jnp.float32), s, trans_w=True) == "triton"  # not bf16
    assert run(jnp.zeros((200, 128), bf), wt, jnp.asarray([100, 100]), trans_w=True) == "triton"  # rows
    monkeypatch.setattr(gmm_mgpu, "on_hopper", lambda: False)
    assert run(x, wt, s, trans_w=True) == "triton"  # a GPU without wgmma (not sm_90)
    monkeypatch.setattr(gmm_triton, "_on_cpu", lambda: True)
    assert run(x, wt, s, trans_w=True) == "triton"  # CPU: the Triton kernels' interpret mode
    assert calls == [("triton", False), ("triton", True), ("mgpu", True, tiles), ("triton", True), ("triton", True),
                     ("triton", True), ("triton", True)]  # the Mosaic kernel with the configured tiles


def test_plain_tgmm_routes_listed_bf16_hopper_weight_gradients_to_the_mosaic_kernel(monkeypatch):
    """``grouped_matmul.plain_tgmm``: "dw" listed, bf16 in and out, on Hopper, at shapes ``tgmm`` takes; else Triton."""
    from moevlm_jax.parallelism import gmm_triton
    from moevlm_jax.parallelism import grouped_matmul as gmmod

    calls, real_tgmm = [], gmm_mgpu.tgmm
    monkeypatch.setattr(gmm_mgpu, "tgmm", lambda x, dy, s, config=None: calls.append("mgpu") or "mgpu")
    monkeypatch.setattr(gmm_triton, "tgmm", lambda x, dy, s, out_dtype=None, config=None: calls.append(
        "triton") or "triton")
    monkeypatch.setattr(gmm_triton, "_on_cpu", lambda: False)
    monkeypatch.setattr(gmm_mgpu, "on_hopper", lambda: True)
    bf = jnp.bfloat16
    s = jnp.asarray([100, 156])
    x, dy = jnp.zeros((256, 128), bf), jnp.zeros((256, 256), bf)
    fwd_dx, dw = KernelsConfig(mosaic_gpu=("fwd", "dx")), KernelsConfig(mosaic_gpu=("dw",))
    assert gmmod.plain_tgmm(x, dy, s, kernels=fwd_dx) == "triton"  # dw not listed
    assert gmmod.plain_tgmm(x, dy, s, out_dtype=bf, kernels=dw) == "mgpu"
    assert gmmod.plain_tgmm(x, dy, s, out_dtype=jnp.float32, kernels=dw) == "triton"  # a float32 gradient
    assert gmmod.plain_tgmm(x, dy[:, :128], s, kernels=dw) == "triton"  # 128 columns: not a whole CTA block
    assert gmmod.plain_tgmm(x[:200], dy[:200], s, kernels=dw) == "triton"  # rows not whole 64-row steps
    assert calls == ["triton", "mgpu", "triton", "triton", "triton"]
    assert gmm_mgpu.tsupported(256, 128, 256) and not gmm_mgpu.tsupported(256, 100, 256)
    with pytest.raises(ValueError, match="K % 128"):
        real_tgmm(jnp.zeros((256, 100), bf), dy, s)


def test_tiles_override_one_field_of_one_kind():
    """compute.moe.kernels.mosaic_gpu_tiles: a field given replaces that field of the tuned default (the defaults are
    gmm_mgpu.CONFIGS, the classes' own); a bad tile is refused with the field's name."""
    from moevlm_jax.schema import ConfigError, build

    base = gmm_mgpu.CONFIGS
    assert base["dw"] == gmm_mgpu.TConfig(seg_rows=16384, max_concurrent_steps=3, epi_tile_m=128, epi_tile_n=128,
                                          epi_buffers=1)
    assert base["fwd"] == base["dx"] == gmm_mgpu.Config(max_concurrent_steps=3, epi_buffers=2)
    assert KernelsConfig().mosaic_gpu_tiles == MosaicGpuTiles(base["fwd"], base["dx"], base["dw"])
    got = build(KernelsConfig, {"mosaic_gpu_tiles": {"fwd": {"max_concurrent_steps": 4}, "dw": {"grid_tile_width": 2}}},
                "compute.moe.kernels").mosaic_gpu_tiles
    assert got.fwd == dataclasses.replace(base["fwd"], max_concurrent_steps=4)
    assert got.dw == dataclasses.replace(base["dw"], grid_tile_width=2) and got.dx == base["dx"]
    direct = KernelsConfig(mosaic_gpu_tiles={"dw": {"seg_rows": 8192, "max_concurrent_steps": 4}})
    assert direct.mosaic_gpu_tiles.dw == dataclasses.replace(base["dw"], seg_rows=8192, max_concurrent_steps=4)
    for bad, message in (({"fwd": {"epi_buffers": 3}}, "epi_buffers must be 1 or 2"),
                         ({"up": {"tile_m": 64}}, "unknown key 'compute.moe.kernels.mosaic_gpu_tiles.up'"),
                         ({"dw": {"align": 8}}, "unknown key 'compute.moe.kernels.mosaic_gpu_tiles.dw.align'"),
                         ({"fwd": {"align": 12}}, "align 12 must divide tile_m")):
        with pytest.raises(ConfigError, match=message):
            build(KernelsConfig, {"mosaic_gpu_tiles": bad}, "compute.moe.kernels")


def test_streamed_segments_hand_computed():
    # 4096 rows, ~1024 a segment (4), 64-row blocks; groups of 1000, 0, 24, 3000, 0, 0, 72, 0 rows (ends 1000, 1000,
    # 1024, 4024, 4024, 4024, 4096, 4096): the cuts at rows 1024, 2048, 3072 all fall inside group 3 (rows 1024-4023),
    # so segment 0 holds groups 0-2 (rows 0-1023, blocks 0-15), segments 1 and 2 none, segment 3 groups 3-7 (rows
    # 1024-4095, blocks 16-63)
    g0, g1, b0, steps, lo, hi = (np.asarray(a) for a in gmm_mgpu.segments(
        jnp.asarray([1000, 0, 24, 3000, 0, 0, 72, 0]), 4096, 1024, 64))
    np.testing.assert_array_equal(g0, [0, 3, 3, 3])
    np.testing.assert_array_equal(g1, [3, 3, 3, 8])
    np.testing.assert_array_equal(b0[steps > 0], [0, 16])
    np.testing.assert_array_equal(steps, [16, 0, 0, 48])
    np.testing.assert_array_equal(lo[steps > 0], [0, 1024])
    np.testing.assert_array_equal(hi[steps > 0], [1024, 4096])


@pytest.mark.parametrize("seed", range(6))
def test_streamed_segments_give_every_group_to_one_segment_whose_blocks_hold_its_rows(seed):
    """Random sizes with empty groups and unused rows past them (and, seed 0, every row used with empty groups last:
    the first block clamped to the last one)."""
    rng = np.random.default_rng(seed)
    m, g, tk, seg = 8192, 16, 64, 1024
    sizes = rng.integers(0, 2 * m // g, g) * (rng.random(g) > 0.3)
    if seed == 0:
        sizes = np.array([m // 4] * 4 + [0] * (g - 4))
    sizes = np.minimum(sizes, m - np.concatenate([[0], np.cumsum(sizes)[:-1]]).clip(max=m)).clip(min=0)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    g0, g1, b0, steps, lo, hi = (np.asarray(a) for a in gmm_mgpu.segments(jnp.asarray(sizes, jnp.int32), m, seg, tk))
    assert len(g0) == m // seg and g0[0] == 0 and g1[-1] == g and (g0[1:] == g1[:-1]).all() and (g1 >= g0).all()
    for s in range(len(g0)):
        if g1[s] == g0[s]:
            assert steps[s] == 0
            continue
        assert lo[s] == starts[g0[s]] and hi[s] == ends[g1[s] - 1]
        assert steps[s] >= 1 and 0 <= b0[s] and (b0[s] + steps[s]) * tk <= m  # whole blocks inside the rows
        assert b0[s] * tk <= lo[s] and hi[s] <= (b0[s] + steps[s]) * tk  # they hold the segment's rows
        assert (b0[s] + steps[s] - 1) * tk < max(hi[s], b0[s] * tk + 1)  # and no block past them


def test_tgmm_options_checked():
    bf = jnp.bfloat16
    x, dy, s = jnp.zeros((256, 128), bf), jnp.zeros((256, 256), bf), jnp.asarray([100, 156])
    # one 128 x 128 epilogue slab per warpgroup (the default): one buffer; two would leave half a round
    assert gmm_mgpu.tsupported(256, 256, 256, gmm_mgpu.TConfig(epi_tile_m=128, epi_tile_n=128, epi_buffers=1))
    assert not gmm_mgpu.tsupported(256, 256, 256, gmm_mgpu.TConfig(epi_tile_m=128, epi_tile_n=128, epi_buffers=2))
    assert not gmm_mgpu.tsupported(256, 128, 256, gmm_mgpu.TConfig(tile_m=256))  # K: whole 256-row tiles
    with pytest.raises(ValueError, match="K % 256"):
        gmm_mgpu.tgmm(x, dy, s, config=gmm_mgpu.TConfig(tile_m=256))
    with pytest.raises(ValueError, match="seg_rows must be an int >= 0"):
        gmm_mgpu.TConfig(seg_rows=-1)


def test_call_sites_of_one_kernel_share_one_lowered_mosaic_module():
    """Every layer of an unrolled decoder calls the same kernels: lowered for a GPU (on this CPU), two calls of one
    kernel hold its serialized Mosaic module once (a jitted kernel function), two different kernels twice."""
    bf = jnp.bfloat16
    x, w = jax.ShapeDtypeStruct((1024, 256), bf), jax.ShapeDtypeStruct((4, 256, 512), bf)
    dy, s = jax.ShapeDtypeStruct((1024, 512), bf), jax.ShapeDtypeStruct((4,), jnp.int32)

    def modules(fn, *args):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text().count("mosaic_gpu_v2")

    assert modules(lambda a, b, c: gmm_mgpu.gmm(a, b, c) + gmm_mgpu.gmm(2 * a, b, c), x, w, s) == 1
    assert modules(lambda a, b, c: gmm_mgpu.tgmm(a, b, c) + gmm_mgpu.tgmm(a, 2 * b, c), x, dy, s) == 1
    assert modules(lambda a, b, c, d: gmm_mgpu.gmm(a, b, c).sum() + gmm_mgpu.tgmm(a, d, c).sum(), x, w, s, dy) == 2


def _kernel_hashes(lowered) -> list[str]:
    import re

    return re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', lowered.as_text())


@pytest.mark.parametrize("fuse", ["", "mgpu_dswiglu", "mgpu_dweighted"])
def test_kernels_recorded_in_a_step_compile_alone_to_the_step_s_modules(monkeypatch, fuse):
    """Trainer.compile_ahead compiles the Mosaic kernels a step records (gmm_mgpu.recording) alone, beside the step's
    compile, so that XLA finds them compiled (jaxlib keys a compiled kernel by its module's hash). Lowered for a GPU on
    this CPU: the experts' forward and backward (the real expert_ffn, the Mosaic kernels taken where the shapes fit;
    "mgpu_dweighted": the real sorted_experts, its d(x) kernel with the row weights) record each distinct
    kernel once, and each recorded kernel lowered alone is one of the step's modules, bit for bit (the backward's
    kernels too, which JAX traces under the forward call's source locations: gmm_mgpu._traced_alone)."""
    from moevlm_jax.parallelism import grouped_matmul as gmmod
    from moevlm_jax.parallelism import permute

    def takes(kind, m, k, n, dtype, kernels):  # the hardware checks left out (lowering only)
        cfg = getattr(kernels.mosaic_gpu_tiles, kind)
        return gmm_mgpu.tsupported(m, k, n, cfg) if kind == "dw" else gmm_mgpu.supported(m, k, n, cfg)

    monkeypatch.setattr(gmmod, "mgpu_takes", takes)
    monkeypatch.setattr(permute, "mgpu_takes", takes)
    kernels = KernelsConfig(fusions=tuple({fuse} - {""}))
    bf = jnp.bfloat16
    rows, s = jax.ShapeDtypeStruct((512, 256), bf), jax.ShapeDtypeStruct((4,), jnp.int32)
    wgu, wd = jax.ShapeDtypeStruct((4, 256, 512), bf), jax.ShapeDtypeStruct((4, 256, 256), bf)

    plan = permute.route_plan(jnp.arange(512, dtype=jnp.int32).reshape(256, 2) % 4, jnp.full((256, 2), 0.5), 4)

    def layer(rows, s, wgu, wd):
        if fuse == "mgpu_dweighted":  # 256 tokens' top-2 rows: 512 sorted rows
            return permute.sorted_experts(rows[:256], plan, jnp.full((256, 2), 0.5), wgu, wd, "triton", kernels)
        return permute.expert_ffn(rows, s, wgu, wd, "triton", zero_tail_rows=False, kernels=kernels)

    def step(rows, s, wgu, wd):
        def loss(rows, wgu, wd):  # two layers of the same shapes: every kernel called twice
            y = layer(layer(rows, s, wgu, wd), s, wgu, wd)
            return jnp.sum(y.astype(jnp.float32)[:200] ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))(rows, wgu, wd)

    with gmm_mgpu.recording() as rec:
        in_step = set(_kernel_hashes(jax.jit(step).trace(rows, s, wgu, wd).lower(lowering_platforms=("cuda",))))
    # forward gate_up, down; d(x) of both (the down one with SwiGLU's backward or not); d(w) of both
    assert len(rec) == len(in_step) == 6
    with_row_weights = [args[4].shape for _, args, _ in rec.kernels.values() if len(args) == 5 and args[4] is not None]
    assert with_row_weights == {"mgpu_dweighted": [(512,)]}.get(fuse, [])  # gmm_dswiglu
    alone = [h for fn, args, kw in rec.kernels.values()
             for h in _kernel_hashes(fn.trace(*args, **dict(kw)).lower(lowering_platforms=("cuda",)))]
    assert len(alone) == 6 and set(alone) == in_step
    with gmm_mgpu.recording() as nothing:  # no kernel traced: nothing to compile
        jax.jit(lambda a: a * 2).trace(rows).lower()
    assert len(nothing) == 0 and nothing.compile_ahead() == []


def test_compile_ahead_compiles_each_recorded_function_in_threads():
    """Recording.compile_ahead's pool (a CPU stand-in for the kernels: jitted functions with static arguments): one
    compiled program per entry, each timed; the compiled program computes what the function does."""
    rec = gmm_mgpu.Recording()
    scale = jax.jit(lambda a, *, k: a * k, static_argnames="k")
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    rec.kernels = {1: (scale, (x,), (("k", 2.0),)), 2: (scale, (x,), (("k", 3.0),))}
    compiled = [f.result() for f in rec.compile_ahead()]
    assert len(compiled) == 2 and len(rec.compile_s) == 2
    np.testing.assert_array_equal(np.asarray(compiled[1](jnp.ones(4))), [3.0] * 4)


def test_swiglu_fused_experts_gradients_match_the_unfused_layer(monkeypatch):
    """permute._mgpu_swiglu_experts (fusion "mgpu_dswiglu"): the experts' output and gradients (SwiGLU's backward in
    the down projection's d(x) kernel) against the per-group einsums and SwiGLU differentiated by JAX, in float32 on
    the same bf16 values; the Mosaic kernel in Pallas' GPU interpreter (gmm_dswiglu on the down weights transposed
    beforehand: the interpreter has no transposed wgmma operand), the other matmuls on the Triton kernels
    (interpreted on CPU)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    from moevlm_jax.parallelism import permute

    cfg = gmm_mgpu.Config(tile_m=128, tile_n=128, tile_k=64, max_concurrent_steps=2, grid_tile_width=1, epi_buffers=2)
    run = dict(config=cfg, interpret=InterpretGPUParams(), num_sms=2)
    dswiglu = gmm_mgpu.gmm_dswiglu
    calls = []

    def dswiglu_untransposed(dy, w, s, h, config=None):
        calls.append(dy.shape)
        return dswiglu(dy, jnp.swapaxes(w, 1, 2), s, h, trans_w=False, **run)

    monkeypatch.setattr(gmm_mgpu, "gmm_dswiglu", dswiglu_untransposed)
    m, hdim, inter = 256, 128, 256
    sizes = np.array([70, 0, 100, 10, 76], np.int32)  # every row used: the reference has no tail rows to ignore
    ks = jax.random.split(jax.random.key(4), 4)
    x = jax.random.normal(ks[0], (m, hdim), jnp.float32).astype(jnp.bfloat16)
    wgu = (jax.random.normal(ks[1], (len(sizes), hdim, 2 * inter), jnp.float32) / 8).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[2], (len(sizes), inter, hdim), jnp.float32) / 8).astype(jnp.bfloat16)
    py = jax.random.normal(ks[3], (m, hdim), jnp.float32)
    gid = jnp.asarray(np.repeat(np.arange(len(sizes)), sizes))

    def fused(x, wgu, wd):
        y = permute._mgpu_swiglu_experts(x, wgu, wd, jnp.asarray(sizes), None, KernelsConfig())
        return jnp.sum(y.astype(jnp.float32) * py)

    def reference(x, wgu, wd):
        h = jnp.einsum("mk,mkn->mn", x, wgu[gid], precision="highest")
        gate, up = jnp.split(h, 2, axis=-1)
        return jnp.sum(jnp.einsum("mk,mkn->mn", jax.nn.silu(gate) * up, wd[gid], precision="highest") * py)

    got = jax.jit(jax.value_and_grad(fused, argnums=(0, 1, 2)))(x, wgu, wd)
    want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2)))(*(a.astype(jnp.float32) for a in (x, wgu, wd)))
    assert calls == [(m, hdim)]
    assert abs(float(got[0]) - float(want[0])) < 1e-2 * abs(float(want[0]))
    for a, b in zip(got[1], want[1]):
        a, b = np.asarray(a, np.float32), np.asarray(b)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2  # bf16 h, act, d(h) and gradients against float32


def test_weighted_experts_match_the_dense_reference_and_their_combine_reads_no_expert_output(monkeypatch):
    """permute.sorted_experts with fusion "mgpu_dweighted" (the routing weights applied to act in XLA's SwiGLU pass
    after the gate_up matmul, an unweighted combine; their backward in the down projection's d(x) epilogue): the layer's
    output and its gradients for x, the routing weights and both expert weights against the dense per-expert
    reference in float32 on the same bf16 values; the Mosaic d(x) kernel stood in for by its contract
    (:func:`dswiglu_contract`: held to the weighted kernel in the GPU interpreter above; the recorded-kernel test
    lowers the real one at the layer's arguments), the other matmuls and the dispatch on the Triton kernels
    (interpreted). The combine's backward is the dispatch of g: the experts' output is not among the backward's
    residuals."""
    from moevlm_jax.parallelism import permute
    from tests.parallelism.moe_reference import dense_reference

    calls = []

    def dswiglu_untransposed(dy, w, s, h, row_w=None, config=None):
        calls.append(("bwd", row_w is not None))
        return dswiglu_contract(dy, w, s, h, row_w)

    monkeypatch.setattr(gmm_mgpu, "gmm_dswiglu", dswiglu_untransposed)
    monkeypatch.setattr(permute, "_weighted_takes",
                        lambda m, wd, dtype, kernels: kernels.fused("mgpu_dweighted") and m % 128 == 0)
    kernels = KernelsConfig(fusions=("mgpu_dweighted",))
    t, hdim, inter, e, k = 128, 128, 256, 5, 2
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((t, e)) + np.array([2.0, 1.0, 0.0, -100.0, 0.5])  # expert 3 gets no token
    idx = np.argsort(-logits, axis=-1)[:, :k].astype(np.int32)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    topw = jnp.asarray(np.take_along_axis(probs, idx, -1), jnp.float32)
    ks = jax.random.split(jax.random.key(6), 4)
    x = jax.random.normal(ks[0], (t, hdim), jnp.float32).astype(jnp.bfloat16)
    wgu = (jax.random.normal(ks[1], (e, hdim, 2 * inter), jnp.float32) / 8).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[2], (e, inter, hdim), jnp.float32) / 8).astype(jnp.bfloat16)
    py = jax.random.normal(ks[3], (t, hdim), jnp.float32)
    plan = permute.route_plan(jnp.asarray(idx), topw, e)

    def fused(x, topw, wgu, wd):
        return jnp.sum(permute.sorted_experts(x, plan, topw, wgu, wd, "triton", kernels).astype(jnp.float32) * py)

    def reference(x, topw, wgu, wd):
        return jnp.sum(dense_reference(x, jnp.asarray(idx), topw, wgu, wd) * py)

    got = jax.jit(jax.value_and_grad(fused, argnums=(0, 1, 2, 3)))(x, topw, wgu, wd)
    assert calls == [("bwd", True)]
    want = jax.jit(jax.value_and_grad(reference, argnums=(0, 1, 2, 3)))(
        x.astype(jnp.float32), topw, wgu.astype(jnp.float32), wd.astype(jnp.float32))
    assert abs(float(got[0]) - float(want[0])) < 1e-2 * abs(float(want[0]))
    for name, a, b in zip(("x", "routing weights", "w_gate_up", "w_down"), got[1], want[1]):
        a, b = np.asarray(a, np.float32), np.asarray(b)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2e-2, name  # bf16 h, act_w, d(h) against float32
    # the backward keeps no [A, H] expert output (the weighted combine's backward would read it)
    _, vjp = jax.vjp(lambda x, w: permute.sorted_experts(x, plan, w, wgu, wd, "triton", kernels), x, topw)
    kept = [leaf.shape for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "shape")]
    assert (t * k, 2 * inter) in kept and (t * k, hdim) in kept  # h, and the dispatched rows for d(w_gate_up)
    assert kept.count((t * k, hdim)) == 1


def test_expert_ffn_takes_the_fused_backward_only_with_the_fusion_asked_for_and_a_shape_it_takes(monkeypatch):
    """permute.expert_ffn: fusion "mgpu_dswiglu" + a down projection whose d(x) [m, H] -> [m, I] the Mosaic kernel
    takes + tail rows left unwritten -> the experts with SwiGLU's backward fused (``_mgpu_swiglu_experts``; the same
    output as the unfused experts, stood in for here by the plain matmuls); otherwise the unfused path."""
    from moevlm_jax.parallelism import grouped_matmul as gmmod
    from moevlm_jax.parallelism import permute

    calls = []

    def stand_in(x, wgu, wd, s, row_w, kernels):
        calls.append(x.shape)
        h = gmmod.grouped_matmul(x, wgu, s, backend="triton", zero_tail_rows=False)
        return gmmod.grouped_matmul(permute.swiglu(h), wd, s, backend="triton", zero_tail_rows=False)

    monkeypatch.setattr(permute, "_mgpu_swiglu_experts", stand_in)
    m, hdim, inter = 256, 64, 128
    s = jnp.asarray([100, 0, 156])
    ks = jax.random.split(jax.random.key(5), 3)
    rows = jax.random.normal(ks[0], (m, hdim), jnp.float32).astype(jnp.bfloat16)
    wgu = (jax.random.normal(ks[1], (3, hdim, 2 * inter), jnp.float32) / 8).astype(jnp.bfloat16)
    wd = (jax.random.normal(ks[2], (3, inter, hdim), jnp.float32) / 8).astype(jnp.bfloat16)
    monkeypatch.setattr(permute, "mgpu_takes", lambda kind, m, k, n, dtype, kernels: kind == "dx" and n == inter)
    plain = permute.expert_ffn(rows, s, wgu, wd, "triton", zero_tail_rows=False, kernels=KernelsConfig(fusions=()))
    assert calls == []
    dswiglu = KernelsConfig(fusions=("mgpu_dswiglu",))
    fused = permute.expert_ffn(rows, s, wgu, wd, "triton", zero_tail_rows=False, kernels=dswiglu)
    assert calls == [(m, hdim)]
    np.testing.assert_array_equal(np.asarray(fused[:256]), np.asarray(plain[:256]))
    permute.expert_ffn(rows, s, wgu, wd, "triton", zero_tail_rows=True, kernels=dswiglu)  # tail rows zeroed: unfused
    permute.expert_ffn(rows, s, wgu[:, :, :192], wd[:, :96], "triton", zero_tail_rows=False,
                       kernels=dswiglu)  # I = 96: not taken
    monkeypatch.setattr(permute, "mgpu_takes", lambda kind, m, k, n, dtype, kernels: False)
    permute.expert_ffn(rows, s, wgu, wd, "triton", zero_tail_rows=False, kernels=dswiglu)  # no Mosaic d(x): unfused
    assert calls == [(m, hdim)]
