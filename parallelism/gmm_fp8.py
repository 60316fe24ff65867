"""The experts' FP8 grouped matmul on Pallas-Triton kernels that read fp8 operands and apply the scales inside.

``compute.fp8.experts_kernel: triton`` (the ``triton`` backend): instead of quantise-dequantise around a bf16
grouped matmul (``parallelism.permute._fp8_gemm`` through ``fp8.operands`` / ``fp8.output``), the operands are
quantised once (:func:`parallelism.fp8.quantize`, the recipe's scales) and the kernels below read the fp8 arrays and
their float32 scales; the accumulator is float32, the output is written in the compute dtype. The three kernels and
their tiles / tile table are those of :mod:`parallelism.gmm_triton` (rows sorted by group, a tile never spans two
groups):

  gmm        y  [M, N]    = qx [M, K] . qw[g] [K, N]           e4m3 x e4m3
  gmm trans  dx [M, K]    = qg [M, N] . qw[g]^T                the gradient (grad_format) x e4m3, qw read transposed
  tgmm       dw [G, K, N] = qx_g^T . qg_g                      e4m3 x the gradient, the rows contracted

Scales (the layouts :func:`parallelism.fp8.quantize` gives, reshaped):

  tensor     x / the gradient: one scale (float32 ``[1]``); w: one per expert (``[G]``). The kernel accumulates the
             fp8 products and multiplies the accumulator by the two scales in its epilogue.
  blockwise  x / the gradient: 1 x B blocks along their columns, passed transposed ``[cols / B, M]`` (a tile's row
             scales are one contiguous load); w: B x B blocks ``[G, K / B, N / B]``. gmm (and d(x)): inside the K
             loop, each K block's partial product times its rows' scales times its weight block's scale before it
             joins the accumulator (DeepSeek-V3's promotion), so ``block_k`` and ``block_n`` divide B (cut to it; in
             tgmm too, whose output tile then lies in one scale block of each operand).
             tgmm: its contraction is the rows, and both operands' scales are per row (x's 1 x B blocks along K, the
             gradient's along N: what the recipe's d(w) GEMM multiplies, ``fp8.operands`` / ``fp8.output``); a scale
             that varies along the contraction cannot be applied to an fp8 product after the MMA, so each
             ``[block_m, block_k]`` / ``[block_m, block_n]`` tile is dequantised in registers (fp8 x its row's
             scale, rounded to the compute dtype as ``fp8.dequantize`` rounds it) and the MMA runs in the compute
             dtype: the recipe's numerics, fp8 reads (half bf16's bytes), no dequantised copy in HBM, bf16 MMA rate.
             (DeepSeek-V3 instead re-quantises the activations in B x 1 blocks for its d(w): other numerics.)

Mixed fp8 operands: Pallas-Triton's dot lowering refuses operands of two element types (jax/_src/pallas/triton/
lowering.py: "a and b must have the same element type"), though Hopper's wgmma takes e5m2 x e4m3. With
``grad_format: e5m2`` (the default) both backward kernels therefore convert their two fp8 tiles to bf16 in registers
(exact: every e4m3 / e5m2 value is a bf16 value) and run a bf16 MMA; with ``grad_format: e4m3`` they are fp8 MMAs
(but the blockwise d(w), dequantised as above). The forward is e4m3 x e4m3 in both recipes.

K and N not multiples of B: ``fp8.quantize`` zero-pads the operands to whole blocks; the kernels run on the padded
sizes and the outputs are cut back. Rows past ``sum(group_sizes)`` are zeroed before quantising (the per-tensor scale
is a maximum over the rows) and in the outputs. The tiles: :data:`CONFIGS` (untimed guesses: block_k 128, the scale
block and four of the fp8 MMA's K steps).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moevlm_jax.parallelism import fp8
from moevlm_jax.parallelism.gmm_triton import Config, _check_size, _on_cpu, fit_block, tile_table

# "fwd" (gmm), "dx" (gmm, w transposed), "dw" (tgmm), as gmm_triton.CONFIGS; not yet timed on a GPU
CONFIGS: dict[str, Config] = {
    "fwd": Config(128, 128, 128, 8, 3), "dx": Config(128, 128, 128, 8, 3), "dw": Config(64, 128, 128, 8, 3),
}


def _dot(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """``a . b`` accumulated in float32: an fp8 MMA where both are one fp8 type, else both as bf16 (exact for fp8)."""
    if a.dtype != b.dtype:
        a, b = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b)


def _fit(cfg: Config, k: int, n: int, scale_block: tuple[int, int] | None, what: str, interpret: bool) -> Config:
    """``cfg``'s block_k / block_n cut to a power of two dividing K / N, and under blockwise the scale blocks."""
    if scale_block is not None:
        sk, sn = scale_block
        if k % sk or n % sn:
            raise ValueError(f"{what}: K={k}, N={n} are not whole scale blocks {scale_block} (fp8.quantize pads them)")
        k, n = sk, sn
    out = dataclasses.replace(cfg, block_k=fit_block(cfg.block_k, k), block_n=fit_block(cfg.block_n, n))
    if not interpret and min(out.block_k, out.block_n) < 16:
        raise ValueError(f"{what}: K={k} and N={n} (or the scale blocks) need a power-of-two divisor >= 16")
    return out


def _gmm_kernel(group_ref, row0_ref, row1_ref, x_ref, xs_ref, w_ref, ws_ref, o_ref, *, k: int, cfg: Config,
                trans_w: bool, scale_block: tuple[int, int] | None):
    n_i, t = pl.program_id(0), pl.program_id(1)
    row0, row1 = row0_ref[t], row1_ref[t]

    @pl.when(row1 > row0)
    def _():
        g = group_ref[t]
        valid = row0 + jnp.arange(cfg.block_m, dtype=jnp.int32) < row1
        a_mask = jnp.broadcast_to(valid[:, None], (cfg.block_m, cfg.block_k))
        n0 = pl.multiple_of(n_i * cfg.block_n, cfg.block_n)
        n_slice, rows = pl.ds(n0, cfg.block_n), pl.ds(row0, cfg.block_m)

        def body(k_i, acc):
            k0 = pl.multiple_of(k_i * cfg.block_k, cfg.block_k)
            k_slice = pl.ds(k0, cfg.block_k)
            a = plgpu.load(x_ref.at[rows, k_slice], mask=a_mask, other=0.0)
            if trans_w:  # w [G, N, K]: the tile [block_n, block_k], contracted on its second axis
                part = _dot(a, plgpu.load(w_ref.at[g, n_slice, k_slice]), trans_b=True)
            else:
                part = _dot(a, plgpu.load(w_ref.at[g, k_slice, n_slice]))
            if scale_block is None:
                return acc + part
            kb, nb = k0 // scale_block[0], n0 // scale_block[1]
            row_s = plgpu.load(xs_ref.at[kb, rows], mask=valid, other=0.0)
            w_s = ws_ref[g, nb, kb] if trans_w else ws_ref[g, kb, nb]  # ws: [G, K/B, N/B] of the forward's w
            return acc + part * (row_s * w_s)[:, None]

        acc = jax.lax.fori_loop(0, k // cfg.block_k, body, jnp.zeros((cfg.block_m, cfg.block_n), jnp.float32))
        if scale_block is None:
            acc = acc * (xs_ref[0] * ws_ref[g])
        o_mask = jnp.broadcast_to(valid[:, None], (cfg.block_m, cfg.block_n))
        plgpu.store(o_ref.at[rows, n_slice], acc.astype(o_ref.dtype), mask=o_mask)


def gmm(qx: jax.Array, x_scale: jax.Array, qw: jax.Array, w_scale: jax.Array, group_sizes: jax.Array, *,
        out_dtype: Any, trans_w: bool = False, blockwise: bool = False, config: Config | None = None,
        interpret: bool | None = None) -> jax.Array:
    """``qx [M, K]`` (fp8, rows sorted by group) times ``qw [G, K, N]`` (``trans_w``: ``qw [G, N, K]`` read
    transposed, i.e. the forward's ``[G, K_fwd, N_fwd]`` for d(x)) with the scales applied -> ``[M, N]`` in
    ``out_dtype``; rows past ``sum(group_sizes)`` left unwritten. Scales: per tensor ``x_scale [1]``, ``w_scale
    [G]``; ``blockwise``: ``x_scale [K / Bk, M]``, ``w_scale [G, K_fwd / B, N_fwd / B]`` (B x B blocks of the
    forward's weight, whichever way it is read), the block edges from the scale arrays' shapes."""
    m, k = qx.shape
    n = qw.shape[1] if trans_w else qw.shape[2]
    if (qw.shape[2] if trans_w else qw.shape[1]) != k:
        raise ValueError(f"fp8 gmm: x {qx.shape} and w {qw.shape} (trans_w={trans_w}) do not contract")
    scale_block = None
    if blockwise:
        kw, nw = (n, k) if trans_w else (k, n)  # the forward weight's K and N
        blocks_w = (kw // w_scale.shape[1], nw // w_scale.shape[2])
        scale_block = (blocks_w[1], blocks_w[0]) if trans_w else blocks_w
        if x_scale.shape != (k // scale_block[0], m) or kw % w_scale.shape[1] or nw % w_scale.shape[2]:
            raise ValueError(f"fp8 gmm: scales x {x_scale.shape}, w {w_scale.shape} are not 1 x B / B x B blocks of "
                             f"x {qx.shape}, w {qw.shape}")
    elif x_scale.shape != (1,) or w_scale.shape != (qw.shape[0],):
        raise ValueError(f"fp8 gmm: per-tensor scales are x [1], w [G], got {x_scale.shape} and {w_scale.shape}")
    interpret = _on_cpu() if interpret is None else interpret
    cfg = _fit(config or CONFIGS["dx" if trans_w else "fwd"], k, n, scale_block, "fp8 gmm", interpret)
    _check_size("fp8 gmm", qx, qw, jax.ShapeDtypeStruct((m, n), out_dtype))
    group, row0, row1 = tile_table(group_sizes, m, cfg.block_m)
    return pl.pallas_call(
        functools.partial(_gmm_kernel, k=k, cfg=cfg, trans_w=trans_w, scale_block=scale_block),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(n // cfg.block_n, group.shape[0]),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="gmm_fp8_trans" if trans_w else "gmm_fp8",
    )(group, row0, row1, qx, x_scale.astype(jnp.float32), qw, w_scale.astype(jnp.float32))


def _tgmm_kernel(start_ref, size_ref, x_ref, xs_ref, dy_ref, ds_ref, o_ref, *, cfg: Config,
                 scale_block: tuple[int, int] | None):
    n_i, k_i, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, size = start_ref[g], size_ref[g]
    k0 = pl.multiple_of(k_i * cfg.block_k, cfg.block_k)
    n0 = pl.multiple_of(n_i * cfg.block_n, cfg.block_n)
    k_slice, n_slice = pl.ds(k0, cfg.block_k), pl.ds(n0, cfg.block_n)
    cdt = o_ref.dtype

    def body(j, acc):
        row0 = start + j * cfg.block_m
        valid = (row0 + jnp.arange(cfg.block_m, dtype=jnp.int32)) < start + size
        rows = pl.ds(row0, cfg.block_m)
        a = plgpu.load(x_ref.at[rows, k_slice], mask=jnp.broadcast_to(valid[:, None], (cfg.block_m, cfg.block_k)),
                       other=0.0)
        b = plgpu.load(dy_ref.at[rows, n_slice], mask=jnp.broadcast_to(valid[:, None], (cfg.block_m, cfg.block_n)),
                       other=0.0)
        if scale_block is None:
            return acc + _dot(a, b, trans_a=True)
        # the row scales vary along the contraction: dequantise in registers, as fp8.dequantize (float32, rounded
        # to the compute dtype), and contract in the compute dtype
        sa = plgpu.load(xs_ref.at[k0 // scale_block[0], rows], mask=valid, other=0.0)
        sb = plgpu.load(ds_ref.at[n0 // scale_block[1], rows], mask=valid, other=0.0)
        a = (a.astype(jnp.float32) * sa[:, None]).astype(cdt)
        b = (b.astype(jnp.float32) * sb[:, None]).astype(cdt)
        return acc + plgpu.dot(a, b, trans_a=True)

    acc = jax.lax.fori_loop(0, (size + cfg.block_m - 1) // cfg.block_m, body,
                            jnp.zeros((cfg.block_k, cfg.block_n), jnp.float32))
    if scale_block is None:
        acc = acc * (xs_ref[0] * ds_ref[0])
    o_ref[g, k_slice, n_slice] = acc.astype(o_ref.dtype)


def tgmm(qx: jax.Array, x_scale: jax.Array, qdy: jax.Array, dy_scale: jax.Array, group_sizes: jax.Array, *,
         out_dtype: Any, blockwise: bool = False, config: Config | None = None,
         interpret: bool | None = None) -> jax.Array:
    """``qx [M, K]``, ``qdy [M, N]`` (fp8, rows sorted by group) -> ``[G, K, N]`` in ``out_dtype``: per group the
    sum over its rows of ``x^T dy`` with the scales applied (zero for empty groups; rows past ``sum(group_sizes)``
    not read). Scales: per tensor ``[1]`` each; ``blockwise``: ``x_scale [K / Bk, M]``, ``dy_scale [N / Bn, M]``
    (1 x B blocks along the columns, per row: dequantised in registers, the MMA in ``out_dtype``)."""
    m, n = qdy.shape
    k = qx.shape[1]
    if qx.shape[0] != m:
        raise ValueError(f"fp8 tgmm: x {qx.shape} and dy {qdy.shape} need the same rows")
    scale_block = None
    if blockwise:
        if x_scale.shape[1:] != (m,) or dy_scale.shape[1:] != (m,) or k % x_scale.shape[0] or n % dy_scale.shape[0]:
            raise ValueError(f"fp8 tgmm: scales x {x_scale.shape}, dy {dy_scale.shape} are not [cols / B, M] of "
                             f"x {qx.shape}, dy {qdy.shape}")
        scale_block = (k // x_scale.shape[0], n // dy_scale.shape[0])
    elif x_scale.shape != (1,) or dy_scale.shape != (1,):
        raise ValueError(f"fp8 tgmm: per-tensor scales are [1], got {x_scale.shape} and {dy_scale.shape}")
    interpret = _on_cpu() if interpret is None else interpret
    cfg = _fit(config or CONFIGS["dw"], k, n, scale_block, "fp8 tgmm", interpret)
    g = group_sizes.shape[0]
    _check_size("fp8 tgmm", qx, qdy, jax.ShapeDtypeStruct((g, k, n), out_dtype))
    sizes = group_sizes.astype(jnp.int32)
    starts = (jnp.cumsum(sizes) - sizes).astype(jnp.int32)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, cfg=cfg, scale_block=scale_block),
        out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype),
        grid=(n // cfg.block_n, k // cfg.block_k, g),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="tgmm_fp8",
    )(starts, sizes, qx, x_scale.astype(jnp.float32), qdy, dy_scale.astype(jnp.float32))


# ----------------------------------------------------------------------------- quantised operands

def quantize_rows(x: jax.Array, fmt: str, cfg: fp8.Fp8Config, axes: tuple[str, ...] = ()
                  ) -> tuple[jax.Array, jax.Array]:
    """Activations or gradients ``[M, C]`` -> (fp8 ``[M, C_padded]``, scales): tensor ``[1]`` (the maximum over
    ``axes`` too, as ``fp8.operands``); blockwise ``[C_padded / B, M]`` (1 x B blocks along C, transposed)."""
    m = x.shape[0]
    if cfg.recipe == "tensor":
        q, s = fp8.quantize(x, fmt, (-1, -1), axes)
        return q.reshape(x.shape), s.reshape(1)
    q, s = fp8.quantize(x, fmt, cfg.blocks(2, "lhs"))  # [M, 1, C/B, B], [M, 1, C/B, 1]
    return q.reshape(m, -1), s.reshape(m, -1).T


def quantize_weights(w: jax.Array, fmt: str, cfg: fp8.Fp8Config, axes: tuple[str, ...] = ()
                     ) -> tuple[jax.Array, jax.Array]:
    """Expert weights ``[G, K, N]`` -> (fp8 ``[G, K_padded, N_padded]``, scales): tensor ``[G]`` (one per expert, the
    maximum over ``axes`` too); blockwise ``[G, K_padded / B, N_padded / B]``."""
    g = w.shape[0]
    if cfg.recipe == "tensor":
        q, s = fp8.quantize(w, fmt, (1, -1, -1), axes)
        return q.reshape(w.shape), s.reshape(g)
    q, s = fp8.quantize(w, fmt, cfg.blocks(3, "rhs", batch_dims=1))  # [G, 1, K/B, B, N/B, B]
    return q.reshape(g, q.shape[2] * q.shape[3], q.shape[4] * q.shape[5]), s.reshape(g, s.shape[2], s.shape[4])


# ----------------------------------------------------------------------------- the experts' GEMM

def _valid(m: int, group_sizes: jax.Array) -> jax.Array:
    return (jnp.arange(m, dtype=jnp.int32) < jnp.sum(group_sizes))[:, None]


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, cfg: fp8.Fp8Config,
                   row_axes: tuple[str, ...] = (), weight_axes: tuple[str, ...] = (),
                   configs: tuple[Config | None, Config | None, Config | None] = (None, None, None)) -> jax.Array:
    """``lhs [M, K]`` (rows sorted by group) x ``rhs [G, K, N]`` in ``cfg``'s FP8 recipe on the fp8 kernels -> ``[M,
    N]`` in lhs's dtype, rows past ``sum(group_sizes)`` zero (in d(lhs) too). The numerics of ``fp8.operands`` +
    ``fp8.output`` around a grouped matmul (the forward operands in ``forward_format``, the output gradient
    quantised once to ``grad_format`` and both gradient GEMMs on it and on the forward's fp8 operands, which are the
    residuals); ``*_axes`` as :class:`parallelism.fp8.ExpertsScope`'s. ``configs``: fwd, dx, dw tiles (None:
    :data:`CONFIGS`)."""
    if not cfg.enabled:
        raise ValueError("gmm_fp8.grouped_matmul needs an FP8 recipe (compute.fp8.recipe tensor or blockwise)")
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1] or group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"gmm_fp8.grouped_matmul: lhs [M, K], rhs [G, K, N], group_sizes [G], got {lhs.shape}, "
                         f"{rhs.shape}, {group_sizes.shape}")
    return _fp8_matmul(lhs, rhs.astype(lhs.dtype), group_sizes.astype(jnp.int32), cfg, tuple(row_axes),
                       tuple(weight_axes), tuple(configs), lhs.shape[1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _fp8_matmul(lhs, rhs, group_sizes, cfg, row_axes, weight_axes, configs, k):
    """``k``: lhs's columns (the fp8 residuals are padded to whole blocks)."""
    return _fp8_fwd(lhs, rhs, group_sizes, cfg, row_axes, weight_axes, configs, k)[0]


def _fp8_fwd(lhs, rhs, group_sizes, cfg, row_axes, weight_axes, configs, k):
    whole = cfg.recipe == "tensor"
    valid = _valid(lhs.shape[0], group_sizes)
    qx, sx = quantize_rows(jnp.where(valid, lhs, 0), cfg.forward_format, cfg, row_axes if whole else ())
    qw, sw = quantize_weights(rhs, cfg.forward_format, cfg, weight_axes if whole else ())
    y = gmm(qx, sx, qw, sw, group_sizes, out_dtype=lhs.dtype, blockwise=not whole, config=configs[0])
    y = y[:, :rhs.shape[2]]
    return jnp.where(valid, y, jnp.zeros((), y.dtype)), (qx, sx, qw, sw, group_sizes)


def _fp8_bwd(cfg, row_axes, weight_axes, configs, k, res, g):
    qx, sx, qw, sw, group_sizes = res
    whole = cfg.recipe == "tensor"
    m, n = g.shape
    valid = _valid(m, group_sizes)
    # the output gradient quantised once; both gradient GEMMs read it (and the forward's fp8 operands)
    qg, sg = quantize_rows(jnp.where(valid, g, 0), cfg.grad_format, cfg, row_axes if whole else ())
    dx = gmm(qg, sg, qw, sw, group_sizes, out_dtype=g.dtype, trans_w=True, blockwise=not whole, config=configs[1])
    dw = tgmm(qx, sx, qg, sg, group_sizes, out_dtype=g.dtype, blockwise=not whole, config=configs[2])
    return jnp.where(valid, dx[:, :k], jnp.zeros((), dx.dtype)), dw[:, :k, :n], None


_fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)
