"""Grouped matmul backends against a per-group einsum, forward and gradients."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.parallelism import grouped_matmul as gm
from tests.parallelism.moe_reference import assert_close

GROUP_SIZES = {
    "random": [3, 0, 5, 2, 6],
    "one_group": [0, 0, 16, 0, 0],
    "padding_rows": [2, 0, 4, 0, 3],  # 9 of 16 rows used, 7 padding rows
    "empty": [0, 0, 0, 0, 0],
}


def per_group_reference(lhs, rhs, sizes):
    """Loop over groups in numpy order: rows [start, start + n) times rhs[g]; others zero."""
    out = jnp.zeros((lhs.shape[0], rhs.shape[2]), lhs.dtype)
    start = 0
    for g, n in enumerate(sizes):
        out = out.at[start : start + n].set(lhs[start : start + n] @ rhs[g])
        start += n
    return out


def _inputs(seed=0, m=16, k=8, n=6, g=5):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((m, k), np.float32)), jnp.asarray(rng.standard_normal((g, k, n), np.float32))


def _value_and_grads(fn, lhs, rhs):
    probe = jnp.sin(jnp.arange(lhs.shape[0] * rhs.shape[2], dtype=jnp.float32)).reshape(lhs.shape[0], -1)
    return jax.value_and_grad(lambda a, b: jnp.sum(fn(a, b) * probe), argnums=(0, 1))(lhs, rhs)


@pytest.mark.parametrize("backend", ["ragged_dot", "dense", "triton"])
@pytest.mark.parametrize("case", sorted(GROUP_SIZES))
def test_backend_matches_per_group_reference(backend, case):
    lhs, rhs = _inputs()
    sizes = GROUP_SIZES[case]
    gs = jnp.asarray(sizes, jnp.int32)
    out = gm.grouped_matmul(lhs, rhs, gs, backend=backend)
    assert_close(out, per_group_reference(lhs, rhs, sizes), what=f"{backend} forward")
    got = _value_and_grads(lambda a, b: gm.grouped_matmul(a, b, gs, backend=backend), lhs, rhs)
    want = _value_and_grads(lambda a, b: per_group_reference(a, b, sizes), lhs, rhs)
    assert_close(got[0], want[0], what="loss")
    assert_close(got[1], want[1], what=f"{backend} grads")


class _FakeTokamax:
    """Behaves like tokamax's GPU kernels where it matters: rows past sum(group_sizes) are left
    uninitialised (here: NaN) in the forward output and in the lhs gradient."""

    @staticmethod
    def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None):
        @jax.custom_vjp
        def f(a, b):
            return _poison(jax.lax.ragged_dot(a, b, group_sizes), group_sizes)

        def fwd(a, b):
            return f(a, b), (a, b)

        def bwd(res, g):
            a, b = res
            _, vjp = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes), a, b)
            da, db = vjp(g)
            return _poison(da, group_sizes), db

        f.defvjp(fwd, bwd)
        return f(lhs, rhs).astype(preferred_element_type or lhs.dtype)


def _poison(x, group_sizes):
    rows = jnp.arange(x.shape[0])[:, None] < jnp.sum(group_sizes)
    return jnp.where(rows, x, jnp.nan)


def test_tokamax_wrapper_masks_uninitialised_padding_rows(monkeypatch):
    monkeypatch.setitem(gm._TOKAMAX, "module", _FakeTokamax())
    lhs, rhs = _inputs()
    sizes = GROUP_SIZES["padding_rows"]
    gs = jnp.asarray(sizes, jnp.int32)
    # the gathered input rows are re-used by a later op, as in the experts; NaN must not leak
    got = _value_and_grads(lambda a, b: gm.grouped_matmul(a, b, gs, backend="tokamax"), lhs, rhs)
    want = _value_and_grads(lambda a, b: per_group_reference(a, b, sizes), lhs, rhs)
    assert_close(got[0], want[0], what="loss")
    assert_close(got[1], want[1], what="tokamax-wrapper grads")


def test_capacity_matmul_matches_per_group_matmul():
    lhs, rhs = _inputs(1, m=3, k=8, n=5, g=4)
    lhs = jnp.stack([lhs] * 4) * jnp.arange(1.0, 5.0)[:, None, None]
    want = jnp.stack([lhs[g] @ rhs[g] for g in range(4)])
    assert_close(gm.capacity_matmul(lhs, rhs), want)
    got = jax.grad(lambda a, b: jnp.sum(gm.capacity_matmul(a, b) ** 2), argnums=(0, 1))(lhs, rhs)
    ref = jax.grad(lambda a, b: jnp.sum(jnp.stack([a[g] @ b[g] for g in range(4)]) ** 2), argnums=(0, 1))(lhs, rhs)
    assert_close(got, ref)


def test_backend_choice(monkeypatch):
    monkeypatch.setitem(gm._TOKAMAX, "module", None)
    monkeypatch.setitem(gm._TOKAMAX, "error", "ModuleNotFoundError('tokamax')")
    assert gm.default_backend("cpu") == "ragged_dot"
    assert gm.default_backend("gpu") == "triton"  # the Pallas-Triton kernels need no extra package
    assert gm.resolve_backend("auto", "cuda") == "triton"
    with pytest.raises(ImportError, match="tokamax"):
        gm.resolve_backend("tokamax")
    with pytest.raises(ValueError, match="unknown grouped-matmul backend"):
        gm.resolve_backend("cutlass")
    monkeypatch.setitem(gm._TOKAMAX, "module", _FakeTokamax())
    assert gm.resolve_backend("tokamax") == "tokamax"


def test_xprof_stub_makes_the_import_path_importable():
    names = ("xprof", "xprof.cli", "xprof.cli.tools")
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    try:
        gm._install_xprof_stub()
        from xprof.cli.tools import get_kernel_stats_tool

        assert get_kernel_stats_tool is None
    finally:
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def test_shape_errors_name_the_problem():
    lhs, rhs = _inputs()
    with pytest.raises(ValueError, match="group_sizes must be"):
        gm.grouped_matmul(lhs, rhs, jnp.zeros((3,), jnp.int32), backend="ragged_dot")
    with pytest.raises(ValueError, match=r"lhs \[M, K\] and rhs \[G, K, N\]"):
        gm.grouped_matmul(lhs[:, :4], rhs, jnp.zeros((5,), jnp.int32), backend="ragged_dot")


def test_bfloat16_output_dtype():
    lhs, rhs = _inputs()
    gs = jnp.asarray(GROUP_SIZES["random"], jnp.int32)
    out = gm.grouped_matmul(lhs.astype(jnp.bfloat16), rhs, gs, backend="ragged_dot")
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out, np.float32),
        np.asarray(per_group_reference(lhs, rhs, GROUP_SIZES["random"])),
        atol=0.15,
        rtol=0.05,
    )


def test_triton_tile_table_hand_computed():
    from moevlm_jax.parallelism.gmm_triton import tile_table

    # groups of 5, 0, 9, 2 rows in tiles of 4 (16 rows): tiles [0,4) [4,5) | [5,9) [9,13) [13,14) | [14,16)
    group, row0, row1 = (np.asarray(a) for a in tile_table(jnp.asarray([5, 0, 9, 2]), 16, 4))
    assert len(group) == 16 // 4 + 4
    np.testing.assert_array_equal(group[:6], [0, 0, 2, 2, 2, 3])
    np.testing.assert_array_equal(row0[:6], [0, 4, 5, 9, 13, 14])
    np.testing.assert_array_equal(row1[:6], [5, 5, 14, 14, 14, 16])
    assert (row1[6:] == row0[6:]).all()  # unused tiles: empty ranges


@pytest.mark.parametrize("sizes", [[37, 0, 90, 3, 70], [0, 0, 5, 0, 0], [60, 1, 17, 0, 2]])
def test_triton_kernels_match_per_group_einsum(sizes):
    """The three Pallas-Triton kernels (interpret mode on CPU) with tiles that cut groups at unaligned
    rows, a partial last tile running past the array's end, empty groups, and NaN in the padding rows
    (which the kernels must not read)."""
    from moevlm_jax.parallelism import gmm_triton as gt

    rng = np.random.default_rng(3)
    m, k, n, g = 200, 32, 48, len(sizes)
    valid = np.arange(m) < sum(sizes)
    x = np.where(valid[:, None], rng.standard_normal((m, k)), np.nan).astype(np.float32)
    dy = np.where(valid[:, None], rng.standard_normal((m, n)), np.nan).astype(np.float32)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    gs = jnp.asarray(sizes, jnp.int32)
    cfg = gt.Config(block_m=16, block_n=16, block_k=16)
    starts = np.cumsum([0] + sizes[:-1])
    want_out, want_dx = np.zeros((m, n), np.float32), np.zeros((m, k), np.float32)
    want_dw = np.zeros((g, k, n), np.float32)
    for e, (s0, c) in enumerate(zip(starts, sizes)):
        want_out[s0:s0 + c] = x[s0:s0 + c] @ w[e]
        want_dx[s0:s0 + c] = dy[s0:s0 + c] @ w[e].T
        want_dw[e] = x[s0:s0 + c].T @ dy[s0:s0 + c]
    out = np.asarray(gt.gmm(jnp.asarray(x), jnp.asarray(w), gs, config=cfg))
    dx = np.asarray(gt.gmm(jnp.asarray(dy), jnp.asarray(w), gs, trans_w=True, config=cfg))
    dw = np.asarray(gt.tgmm(jnp.asarray(x), jnp.asarray(dy), gs, config=cfg))
    assert_close(out[valid], want_out[valid], what="gmm")
    assert_close(dx[valid], want_dx[valid], what="gmm trans_w")
    assert_close(dw, want_dw, what="tgmm")
    with pytest.raises(ValueError, match="do not contract"):
        gt.gmm(jnp.asarray(x), jnp.asarray(w), gs, trans_w=True)
    huge = jax.ShapeDtypeStruct((2**21, 2**10), jnp.bfloat16)  # 2^31 elements: traced only, never built
    with pytest.raises(ValueError, match="exceed 2\\^31"):
        jax.eval_shape(lambda a, b: gt.gmm(a, b, gs), huge, jax.ShapeDtypeStruct((g, 2**10, 16), jnp.bfloat16))


def test_triton_tiles_from_config_and_file(tmp_path):
    """compute.moe.kernels.triton_tiles entries over the built-in table (a shape's entry before its kind's), also
    read from a tile sweep's JSON file; the built-in table itself untouched."""
    from moevlm_jax.parallelism import gmm_triton as gt
    from moevlm_jax.parallelism.kernels import KernelsConfig, TritonTile, load_triton_tiles

    before = dict(gt.CONFIGS)
    path = tmp_path / "cfg.json"
    path.write_text('{"dw": {"block_m": 32, "block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}}')
    kernels = KernelsConfig(triton_tiles=load_triton_tiles(str(path)))
    assert kernels.triton_config("dw", 64, 64) == gt.Config(32, 64, 128, 4, 4)
    assert kernels.triton_config("dw", 2048, 1536) == gt.CONFIGS["dw:2048x1536"]  # the built-in shape entry
    path.write_text('{"fwd:64x32": {"block_m": 16, "block_n": 32, "block_k": 64}}')
    kernels = KernelsConfig(triton_tiles=load_triton_tiles(str(path)))
    assert kernels.triton_config("fwd", 64, 32) == gt.Config(16, 32, 64)
    assert kernels.triton_config("fwd", 64, 64) == gt.CONFIGS["fwd"] == gt.config_for("fwd", 64, 64)
    assert gt.CONFIGS == before
    path.write_text('{"bwd": {}}')
    with pytest.raises(ValueError, match="unknown kernels"):
        load_triton_tiles(str(path))
    with pytest.raises(ValueError, match="power of two"):
        TritonTile(kernel="dw", block_m=48)
    with pytest.raises(ValueError, match="names one kernel twice"):
        KernelsConfig(triton_tiles=[{"kernel": "dw"}, {"kernel": "dw", "block_m": 32}])


def test_triton_tiles_reach_the_kernels(monkeypatch):
    """The grouped matmul's Triton kernels run with the configured tiles (forward, d(x), d(w)), and the result
    stays the per-group reference's."""
    from moevlm_jax.parallelism.kernels import KernelsConfig

    seen = []
    real_gmm, real_tgmm = gm.gmm_triton.gmm, gm.gmm_triton.tgmm
    monkeypatch.setattr(gm.gmm_triton, "gmm", lambda *a, **kw: seen.append(("gmm", kw["config"])) or real_gmm(*a, **kw))
    monkeypatch.setattr(gm.gmm_triton, "tgmm", lambda *a, **kw: seen.append(("tgmm", kw["config"])) or real_tgmm(
        *a, **kw))
    lhs, rhs = _inputs()
    sizes = GROUP_SIZES["padding_rows"]
    kernels = KernelsConfig(triton_tiles=[{"kernel": "fwd", "block_m": 16}, {"kernel": "dx", "block_m": 32},
                                          {"kernel": "dw", "block_m": 64, "num_stages": 2}])
    got = _value_and_grads(lambda a, b: gm.grouped_matmul(a, b, jnp.asarray(sizes), backend="triton",
                                                          kernels=kernels), lhs, rhs)
    assert_close(got[1], _value_and_grads(lambda a, b: per_group_reference(a, b, sizes), lhs, rhs)[1], what="grads")
    assert [(kind, c.block_m) for kind, c in seen] == [("gmm", 16), ("gmm", 32), ("tgmm", 64)]
    assert seen[2][1].num_stages == 2


@pytest.mark.parametrize("sizes", [[37, 0, 90, 3, 70], [0, 0, 5, 0, 0]])
def test_triton_fused_kernels_match_per_group_einsum(sizes):
    """The kernels' fusion (interpret mode on CPU) against numpy in float32: rows of x [T, K] read through an
    index (gmm ``rows``), the gathered rows written for d(w) (``gathered_out``), and d(w) of those rows; uneven and
    empty groups, index entries past sum(group_sizes) out of range and NaN in the padding rows of dy (none of which
    the kernels may read)."""
    from moevlm_jax.parallelism import gmm_triton as gt

    rng = np.random.default_rng(4)
    m, t, k, i, g = 200, 50, 32, 24, len(sizes)
    used = sum(sizes)
    valid = np.arange(m) < used
    x = rng.standard_normal((t, k)).astype(np.float32)
    index = np.where(valid, rng.integers(0, t, m), 10**6).astype(np.int32)
    w = rng.standard_normal((g, k, 2 * i)).astype(np.float32) / np.sqrt(k)
    dy = np.where(valid[:, None], rng.standard_normal((m, 2 * i)), np.nan).astype(np.float32)
    xr = x[np.minimum(index, t - 1)]
    starts = np.cumsum([0] + sizes[:-1])
    want_h, want_dw = np.zeros((m, 2 * i), np.float32), np.zeros((g, k, 2 * i), np.float32)
    for e, (s0, c) in enumerate(zip(starts, sizes)):
        want_h[s0:s0 + c] = xr[s0:s0 + c] @ w[e]
        want_dw[e] = xr[s0:s0 + c].T @ dy[s0:s0 + c]
    gs, cfg = jnp.asarray(sizes, jnp.int32), gt.Config(block_m=16, block_n=16, block_k=16)
    args = (jnp.asarray(x), jnp.asarray(w), gs)
    h = np.asarray(gt.gmm(*args, rows=jnp.asarray(index), config=cfg))
    h3, xg3 = (np.asarray(a) for a in gt.gmm(*args, rows=jnp.asarray(index), gathered_out=True, config=cfg))
    # d(w) of the gathered rows the forward wrote (the fusion's backward), their padding rows NaN-free or not read
    dw = np.asarray(gt.tgmm(jnp.asarray(xg3), jnp.asarray(dy), gs, config=cfg))
    assert_close(h[valid], want_h[valid], atol=1e-4, rtol=1e-4, what="gmm rows")
    assert_close(h3[valid], want_h[valid], atol=1e-4, rtol=1e-4, what="gmm rows + gathered_out: h")
    np.testing.assert_array_equal(xg3[valid], xr[valid], err_msg="gathered_out: x[rows]")
    assert_close(dw, want_dw, atol=1e-4, rtol=1e-4, what="tgmm of the gathered rows")
    with pytest.raises(ValueError, match="gathered_out needs rows"):
        gt.gmm(*args, gathered_out=True)


def test_triton_tail_rows_zero_or_left_unwritten(monkeypatch):
    """The Triton backend's rows past sum(group_sizes) (unwritten by the kernels; NaN here, as uninitialised
    memory may be): zero in the output and d(lhs) by default; with zero_tail_rows=False left as they are and the
    valid rows and d(rhs) unchanged (the sorted experts read none of them, tests/parallelism/test_permute.py)."""
    real = gm.gmm_triton.gmm

    def poisoned(x, w, group_sizes, *args, **kwargs):
        return _poison(real(x, w, group_sizes, *args, **kwargs), group_sizes)

    monkeypatch.setattr(gm.gmm_triton, "gmm", poisoned)
    lhs, rhs = _inputs()
    sizes = GROUP_SIZES["padding_rows"]
    gs = jnp.asarray(sizes, jnp.int32)
    valid = np.arange(lhs.shape[0]) < sum(sizes)
    assert not valid.all()
    want = per_group_reference(lhs, rhs, sizes)
    out = gm.grouped_matmul(lhs, rhs, gs, backend="triton")
    assert_close(out, want, what="masked forward")
    assert (np.asarray(out)[~valid] == 0).all()
    got = _value_and_grads(lambda a, b: gm.grouped_matmul(a, b, gs, backend="triton"), lhs, rhs)
    ref = _value_and_grads(lambda a, b: per_group_reference(a, b, sizes), lhs, rhs)
    assert_close(got[1], ref[1], what="masked grads")
    raw = gm.grouped_matmul(lhs, rhs, gs, backend="triton", zero_tail_rows=False)
    assert np.isnan(np.asarray(raw)[~valid]).all()
    assert_close(np.asarray(raw)[valid], np.asarray(want)[valid], what="unmasked forward, valid rows")
    probe = jnp.asarray(valid[:, None], jnp.float32)  # a caller that reads only the valid rows
    d_lhs, d_rhs = jax.grad(lambda a, b: jnp.sum(jnp.where(valid[:, None], gm.grouped_matmul(
        a, b, gs, backend="triton", zero_tail_rows=False), 0) * probe), argnums=(0, 1))(lhs, rhs)
    r_lhs, r_rhs = jax.grad(lambda a, b: jnp.sum(per_group_reference(a, b, sizes) * probe), argnums=(0, 1))(lhs, rhs)
    assert np.isnan(np.asarray(d_lhs)[~valid]).all()
    assert_close(np.asarray(d_lhs)[valid], np.asarray(r_lhs)[valid], what="unmasked d(lhs), valid rows")
    assert_close(d_rhs, r_rhs, what="unmasked d(rhs)")
