"""Grouped matmul as a warp-specialised Pallas Mosaic-GPU kernel (Hopper: TMA loads, wgmma, persistent).

The forward and d(x) of a grouped matmul (the row-contracting d(w) stays in ``parallelism.gmm_triton``):

  gmm        out [M, N] = x [M, K] @ w[g(m)] [K, N]          (forward)
  gmm trans  dx  [M, K] = dy [M, N] @ w[g(m)]^T               (d x: w read transposed, [G, K, N] as stored)

The kernel is JAX's warp-specialised Hopper matmul (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``: one
memory warpgroup feeding two compute warpgroups that split the CTA's ``2 * tile_n`` columns, a persistent loop over
the output tiles) made ragged. The output tiles are (group, row block) pairs (:func:`block_table`): the rows are cut
into blocks of ``tile_m`` rows at multiples of ``tile_m`` (a TMA box must start at a provably aligned row), and a
block holding rows of two groups is one tile of each. A tile multiplies the whole block by its group's weight block
and stores only its group's rows: each ``epi_tile_m``-row slab goes from shared memory through TMA boxes of 64, 32,
..., 1 rows (the row count's binary digits), since a TMA box has a static size. Rows past ``sum(group_sizes)`` are
left unwritten, as ``gmm_triton.gmm`` does.

Measured on one H200 (bench/moe_layer.md run 13, 2026-12-04): the dense warp-specialised kernel runs at cuBLAS's speed
at the experts' shapes (0.91-1.06x), where the Pallas-Triton kernels reach ~0.8 of it; this ragged form takes 0.93-1.01x
the Triton kernels' time on each forward / d(x) matmul at both shape sets, with the same output bits. What it leaves
on the table: a row block holding two groups' rows is computed once per group (~G extra tiles), and each epilogue
slab waits for the previous slab's stores.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl



@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of one kernel: each of the two compute warpgroups owns a ``tile_m x tile_n`` accumulator (the CTA
    covers ``2 * tile_n`` columns); ``max_concurrent_steps`` K steps in flight; ``grid_tile_width`` output tiles
    along N visited before moving on in M (the persistent loop's snake order); the epilogue stores
    ``epi_tile_m x epi_tile_n`` slabs."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    grid_tile_width: int = 8
    epi_tile_m: int = 64
    epi_tile_n: int = 64


# grid_tile_width 16 (fwd) / 4 (dx) were up to 5% faster than 8 at the 235B gate_up shapes and the same or up to 7%
# slower at others (bench/moe_layer.md run 13): one config for both
CONFIGS: dict[str, Config] = {"fwd": Config(), "dx": Config()}
KINDS_ENV = "MOEVLM_GMM_MGPU"
# the unfused matmuls of the Triton experts that run on this kernel instead (on a GPU, in bf16, where the shape
# fits): "fwd", "dx" by default ($MOEVLM_GMM_MGPU= for none). The fused gate_up forward (the row gather) and every
# d(w) stay Triton: JAX's Mosaic d(w) kernel (transposed_ragged_dot_mgpu) zeroes out-of-group rows by multiplying,
# and the rows past sum(group_sizes) are left unwritten (NaN there would leak in).
KINDS: frozenset[str] = frozenset(k for k in os.environ.get(KINDS_ENV, "fwd,dx").split(",") if k)
if KINDS - {"fwd", "dx"}:
    raise ValueError(f"${KINDS_ENV}: {sorted(KINDS)}; the kinds are fwd, dx")


def supported(m: int, k: int, n: int, cfg: Config | None = None) -> bool:
    """Whether the kernel takes ``x [m, k]`` to ``[m, n]`` columns: whole K steps, whole CTA column blocks, at
    least one row tile."""
    cfg = cfg or Config()
    return k % cfg.tile_k == 0 and n % (2 * cfg.tile_n) == 0 and m % cfg.tile_m == 0 and cfg.tile_n % cfg.epi_tile_n == 0


def block_table(group_sizes: jax.Array, m: int, tile_m: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per output tile: group, row block (rows ``[block * tile_m, (block + 1) * tile_m)``), and the rows of that
    block that belong to the group, ``[lo, hi)`` (``hi == lo`` for unused tiles). A block holding the end of one group
    and the start of the next is one tile of each. ``[T]`` each, ``T = m / tile_m + G - 1``, used tiles first."""
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile_m
    n_blocks = jnp.where(sizes > 0, (ends - 1) // tile_m - first + 1, 0)
    tile_ends = jnp.cumsum(n_blocks)
    t = jnp.arange(m // tile_m + g - 1, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right", method="compare_all"), g - 1).astype(jnp.int32)
    block = first[group] + t - (tile_ends[group] - n_blocks[group])
    used = t < tile_ends[-1]
    lo = jnp.where(used, jnp.maximum(starts[group], block * tile_m), 0).astype(jnp.int32)
    hi = jnp.where(used, jnp.minimum(ends[group], (block + 1) * tile_m), 0).astype(jnp.int32)
    return group, jnp.where(used, block, 0).astype(jnp.int32), lo, hi


def _num_sms() -> int:
    return getattr(jax.devices()[0], "core_count", None) or 132


def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, trans_w: bool = False, config: Config | None = None,
        interpret=None, num_sms: int | None = None) -> jax.Array:
    """``x [M, K]`` rows sorted by group; ``w [G, K, N]`` -> ``[M, N]`` (with ``trans_w``: ``w [G, N, K]`` read
    transposed, i.e. ``x @ w[g]^T``). Rows past ``sum(group_sizes)`` are left unwritten. ``interpret``: a
    ``InterpretGPUParams`` to run the kernel in Pallas' GPU interpreter (tests on CPU)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cfg = config or CONFIGS["dx" if trans_w else "fwd"]
    m, k = x.shape
    n = w.shape[1] if trans_w else w.shape[2]
    if (w.shape[2] if trans_w else w.shape[1]) != k:
        raise ValueError(f"gmm_mgpu: x {x.shape} and w {w.shape} (trans_w={trans_w}) do not contract")
    if not supported(m, k, n, cfg):
        raise ValueError(f"gmm_mgpu: x [{m}, {k}] -> [{m}, {n}] needs K % {cfg.tile_k} == 0, N % {2 * cfg.tile_n} == 0 "
                         f"and M % {cfg.tile_m} == 0")
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    em, en = cfg.epi_tile_m, cfg.epi_tile_n
    cta_n = 2 * tn
    group, blocks, lo_rows, hi_rows = block_table(group_sizes, m, tm)
    n_tiles, n_iters, k_iters = group.shape[0], n // cta_n, k // tk
    dtype = x.dtype
    swizzle = plgpu.find_swizzle(tk * jnp.dtype(dtype).itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))

    def get_pipeline(pipeline_body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            pipeline_body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((cta_n, tk) if trans_w else (tk, cta_n), (lambda kk: (0, kk)) if trans_w else (lambda kk: (kk, 0)),
                                transforms=transforms, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    def kernel(group_gmem, block_gmem, lo_gmem, hi_gmem, a_gmem, b_gmem, out_gmem):
        ignore = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on the bodies
        b_block = b_gmem.at[0, pl.ds(0, cta_n), :] if trans_w else b_gmem.at[0, :, pl.ds(0, cta_n)]

        @functools.partial(pl.run_scoped,
                           pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(a_gmem.at[pl.ds(0, tm), :], b_block),
                           out_smem=plgpu.SMEM((2, em, en), dtype), collective_axes="wg")
        def scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((n_tiles * n_iters,), collective_axes="sm")
            def mn_loop(info):
                (lin,) = info.index
                t, ni = plgpu.planar_snake(lin, (n_tiles, n_iters), 1, cfg.grid_tile_width)
                r0, r1, g = lo_gmem[t], hi_gmem[t], group_gmem[t]

                @pl.when(r1 > r0)
                def _():
                    start = pl.multiple_of(block_gmem[t] * tm, tm)
                    skip, count = r0 - start, r1 - r0
                    col0 = ni * cta_n + wg * tn

                    def compute_context(eval_pipeline):
                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                        def _(acc_ref):
                            eval_pipeline(acc_ref)
                            acc = acc_ref[...].astype(dtype)
                            for mi in range(tm // em):
                                lo = jnp.clip(skip - mi * em, 0, em)
                                hi = jnp.clip(skip + count - mi * em, 0, em)
                                for nj in range(tn // en):
                                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                                    out_smem[wg] = acc[mi * em:(mi + 1) * em, nj * en:(nj + 1) * en]
                                    plgpu.commit_smem()
                                    s, c, size = lo, hi - lo, em
                                    while size >= 1:
                                        @pl.when((c & size) != 0)
                                        def _(s=s, size=size):
                                            plgpu.copy_smem_to_gmem(
                                                out_smem.at[wg, pl.ds(s, size)],
                                                out_gmem.at[pl.ds(start + mi * em + s, size), pl.ds(col0 + nj * en, en)])

                                        s = s + (c & size)
                                        size //= 2

                    def mma_body(_, a_smem, b_smem, acc_ref):
                        if trans_w:
                            b = plgpu.transpose_ref(b_smem.at[pl.ds(wg * tn, tn)], (1, 0))
                        else:
                            b = b_smem.at[:, pl.ds(wg * tn, tn)]
                        plgpu.wgmma(acc_ref, a_smem, b)
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    cols = pl.ds(ni * cta_n, cta_n)
                    get_pipeline(mma_body, compute_context)(
                        a_gmem.at[pl.ds(start, tm), :], b_gmem.at[g, cols, :] if trans_w else b_gmem.at[g, :, cols],
                        allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((m, n), dtype),
        grid=(num_sms or _num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": interpret} if interpret is not None else {}),
    )
    return call(group, blocks, lo_rows, hi_rows, x, w)
