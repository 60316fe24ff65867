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
    ``epi_tile_m x epi_tile_n`` slabs; a group's row windows start at a multiple of ``align`` (:func:`block_table`)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    max_concurrent_steps: int = 4
    grid_tile_width: int = 8
    epi_tile_m: int = 64
    epi_tile_n: int = 64
    align: int = 8


# grid_tile_width 16 (fwd) / 4 (dx) were up to 5% faster than 8 at the 235B gate_up shapes and the same or up to 7%
# slower at others (bench/moe_layer.md run 13): one config for both
CONFIGS: dict[str, Config] = {"fwd": Config(), "dx": Config()}
KINDS_ENV = "MOEVLM_GMM_MGPU"
# the unfused matmuls of the Triton experts that run on these kernels instead (on a GPU, in bf16, where the shape
# fits): "fwd" and "dx" (gmm), "dw" (tgmm); "fwd,dx" by default ($MOEVLM_GMM_MGPU= for none). The fused gate_up
# forward (the row gather) stays Triton.
KINDS: frozenset[str] = frozenset(k for k in os.environ.get(KINDS_ENV, "fwd,dx").split(",") if k)
if KINDS - {"fwd", "dx", "dw"}:
    raise ValueError(f"${KINDS_ENV}: {sorted(KINDS)}; the kinds are fwd, dx, dw")


def supported(m: int, k: int, n: int, cfg: Config | None = None) -> bool:
    """Whether the kernel takes ``x [m, k]`` to ``[m, n]`` columns: whole K steps, whole CTA column blocks, at
    least one row tile."""
    cfg = cfg or Config()
    return k % cfg.tile_k == 0 and n % (2 * cfg.tile_n) == 0 and m % cfg.tile_m == 0 and cfg.tile_n % cfg.epi_tile_n == 0


def block_table(group_sizes: jax.Array, m: int, tile_m: int, align: int | None = None
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per output tile: group, first row of the ``tile_m``-row window it loads (``start``), and the rows of that
    window that belong to the group, ``[lo, hi)`` (``hi == lo`` for unused tiles), used tiles first.

    A group's windows start at its first row rounded down to a multiple of ``align`` (default ``tile_m``) and step
    by ``tile_m``; the last window of the last rows is moved back to end at row ``m``. ``align == tile_m``: aligned
    row blocks, a block holding the end of one group and the start of the next is one tile of each (``T = m /
    tile_m + G - 1`` tiles). A smaller ``align`` (a multiple of 8: a TMA box of the tiled operand starts at a
    multiple of its 8-row tile) starts each group's windows at its own rows, so a group of ``s`` rows takes
    ``ceil(s / tile_m)`` windows or one more, about half the extra tiles of aligned blocks."""
    align = align or tile_m
    if tile_m % align or (align != tile_m and align % 8):
        raise ValueError(f"block_table: align {align} must divide tile_m {tile_m} and be a multiple of 8")
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // align * align
    n_blocks = jnp.where(sizes > 0, (ends - first + tile_m - 1) // tile_m, 0)
    tile_ends = jnp.cumsum(n_blocks)
    n_tiles = m // tile_m + g - 1 if align == tile_m else m // tile_m + g + -(-g * (align - 1) // tile_m)
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right", method="compare_all"), g - 1).astype(jnp.int32)
    window = first[group] + (t - (tile_ends[group] - n_blocks[group])) * tile_m
    used = t < tile_ends[-1]
    lo = jnp.where(used, jnp.maximum(starts[group], window), 0).astype(jnp.int32)
    hi = jnp.where(used, jnp.minimum(ends[group], window + tile_m), 0).astype(jnp.int32)
    return group, jnp.where(used, jnp.minimum(window, m - tile_m), 0).astype(jnp.int32), lo, hi


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
    group, row0, lo_rows, hi_rows = block_table(group_sizes, m, tm, cfg.align)
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

    def kernel(group_gmem, row0_gmem, lo_gmem, hi_gmem, a_gmem, b_gmem, out_gmem):
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
                    start = pl.multiple_of(row0_gmem[t], cfg.align)
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
    return call(group, row0, lo_rows, hi_rows, x, w)


@dataclasses.dataclass(frozen=True)
class TConfig:
    """Tiles of the d(w) kernel :func:`tgmm`: each output tile is ``block_m x block_n`` of ``[K, N]`` (one group's),
    contracted over the group's rows ``block_k`` at a time, ``max_concurrent_steps`` in flight; ``grid_block_n``
    output tiles along N visited before moving on in K (snake order)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 4


def tsupported(m: int, k: int, n: int, cfg: TConfig | None = None) -> bool:
    """Whether :func:`tgmm` takes ``x [m, k]``, ``dy [m, n]``: whole output tiles, whole row steps."""
    cfg = cfg or TConfig()
    return k % cfg.block_m == 0 and n % cfg.block_n == 0 and m % cfg.block_k == 0


def tgmm(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *, config: TConfig | None = None,
         interpret=None, num_sms: int | None = None) -> jax.Array:
    """d(w) of a grouped matmul: ``x [M, K]``, ``dy [M, N]`` rows sorted by group -> ``[G, K, N]``, per group the
    sum over its rows of ``x^T dy`` (zero for an empty group).

    JAX's ``transposed_ragged_dot_mgpu`` kernel (one warpgroup, a persistent loop over (group, output tile), each
    contracting the group's ``block_k``-row steps from its first row rounded down), with one change: a step holding
    rows outside the group (its first and last) *selects* zeros into both operands in shared memory, where JAX's
    multiplies one operand by a 0/1 mask. A row past ``sum(group_sizes)`` is one the experts leave unwritten (any
    bits, NaN included); multiplied by zero, or met by a zero in the other operand inside the MMA, a NaN there would
    reach the last group's gradient. A group's steps stay inside ``M`` rows (``M % block_k`` is checked)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cfg = config or TConfig()
    m, k = x.shape
    n = dy.shape[1]
    if dy.shape[0] != m or dy.dtype != x.dtype:
        raise ValueError(f"gmm_mgpu.tgmm: x {x.shape} {x.dtype} and dy {dy.shape} {dy.dtype} need the same rows, dtype")
    if not tsupported(m, k, n, cfg):
        raise ValueError(f"gmm_mgpu.tgmm: x [{m}, {k}], dy [{m}, {n}] need K % {cfg.block_m} == 0, "
                         f"N % {cfg.block_n} == 0 and M % {cfg.block_k} == 0")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes).astype(jnp.int32)
    starts = ends - sizes
    first = starts // bk * bk
    n_steps = jnp.where(sizes > 0, (ends - first + bk - 1) // bk, 0).astype(jnp.int32)
    dtype = x.dtype
    swizzle = plgpu.find_swizzle(bk * jnp.dtype(dtype).itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
    grid_m, grid_n = k // bm, n // bn
    delay = 1 if cfg.max_concurrent_steps > 1 else 0

    def kernel(starts_gmem, ends_gmem, first_gmem, steps_gmem, x_gmem, dy_gmem, o_gmem):
        @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
        def mn_loop(info):
            gi, lin = info.index
            mi, ni = plgpu.planar_snake(lin, (grid_m, grid_n), 1, cfg.grid_block_n)
            row0 = pl.multiple_of(first_gmem[gi], bk)
            start, end, steps = starts_gmem[gi], ends_gmem[gi], steps_gmem[gi]

            def acc_scope(acc_ref):
                def step(idx, x_smem, dy_smem):
                    (si,) = idx

                    @pl.when((si == 0) | (si == steps - 1))
                    def _():  # rows outside the group: zero in both operands (a select, not a product)
                        rows = row0 + si * bk
                        for ref, cols in ((x_smem, bm), (dy_smem, bn)):
                            r = lax.broadcasted_iota(jnp.int32, (bk, cols), 0)
                            if interpret is None:  # a layout hint the interpreter has no rule for
                                r = plgpu.layout_cast(r, plgpu.Layout.WGMMA)
                            keep = (r + rows >= start) & (r + rows < end)
                            ref[...] = jnp.where(keep, ref[...], jnp.zeros((), dtype))
                        plgpu.commit_smem()

                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(x_smem, (1, 0)), dy_smem)
                    if delay == 0:
                        plgpu.wgmma_wait(0)

                @pl.when(steps > 0)
                def _():
                    b0 = row0 // bk  # the group's first row step
                    plgpu.emit_pipeline(
                        step,
                        grid=(steps,),
                        in_specs=[
                            plgpu.BlockSpec((bk, bm), lambda s: (b0 + s, mi), delay_release=delay, transforms=transforms),
                            plgpu.BlockSpec((bk, bn), lambda s: (b0 + s, ni), delay_release=delay, transforms=transforms),
                        ],
                        max_concurrent_steps=cfg.max_concurrent_steps,
                    )(x_gmem, dy_gmem)

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype, transforms=transforms))
            def _(o_smem):
                o_smem[...] = acc.astype(dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[gi, pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((g, k, n), dtype),
        grid=(num_sms or _num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": interpret} if interpret is not None else {}),
    )
    return call(starts, ends, first, n_steps, x, dy)
