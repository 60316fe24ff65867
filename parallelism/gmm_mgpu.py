"""Grouped matmul as warp-specialised Pallas Mosaic-GPU kernels (Hopper: TMA loads, wgmma, persistent).

The three products of a grouped matmul, as ``parallelism.gmm_triton`` has them for any GPU:

  gmm        out [M, N] = x [M, K] @ w[g(m)] [K, N]          (forward)
  gmm trans  dx  [M, K] = dy [M, N] @ w[g(m)]^T               (d x: w read transposed, [G, K, N] as stored)
  tgmm       dw  [G, K, N] = sum over group g's rows of x^T dy (d w: the rows contracted; :func:`tgmm`)

The kernel is JAX's warp-specialised Hopper matmul (``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``: one
memory warpgroup feeding two compute warpgroups that split the CTA's ``2 * tile_n`` columns, a persistent loop over
the output tiles) made ragged. The output tiles are (group, row window) pairs (:func:`block_table`): a group's
windows of ``tile_m`` rows start at its first row rounded down to a multiple of 8 (a TMA box of the tiled operand
starts at a multiple of its 8-row tile; Mosaic must be able to prove it) and step by ``tile_m``. A tile multiplies the
whole window by its group's weight block and stores only its group's rows: each ``epi_tile_m``-row slab goes from
shared memory through TMA boxes of 64, 32, ..., 1 rows (the row count's binary digits), since a TMA box has a static
size. Rows past ``sum(group_sizes)`` are left unwritten, as ``gmm_triton.gmm`` does.

On an H200 the dense warp-specialised kernel runs at cuBLAS's speed at the experts' shapes, where the Pallas-Triton
kernels reach about 0.8 of it; windows at each group's start beat windows at aligned row blocks (a block holding two
groups' rows is computed once per group). :func:`tgmm` streams the rows of several groups through one pipeline
(``TConfig.seg_rows``). :func:`gmm_dswiglu` puts SwiGLU's backward in the d(x) epilogue (``permute``'s fusions
"mgpu_dswiglu" / "mgpu_dweighted"). Figures: bench/results/moe_layer.md.

A step's kernels can be compiled ahead, beside the step's own compile (:func:`recording`, :class:`Recording`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes of one kernel: each of the two compute warpgroups owns a ``tile_m x tile_n`` accumulator (the CTA
    covers ``2 * tile_n`` columns); ``max_concurrent_steps`` K steps in flight; ``grid_tile_width`` output tiles
    along N visited before moving on in M (the persistent loop's snake order); the epilogue stores
    ``epi_tile_m x epi_tile_n`` slabs through ``epi_buffers`` shared-memory buffers per warpgroup (2: a slab is
    written while the previous one is stored, where that one was a whole slab, i.e. one store); a group's row
    windows start at a multiple of ``align`` (:func:`block_table`)."""

    tile_m: int = 128  # rows of a tile (a group's row window)
    tile_n: int = 128  # columns of each compute warpgroup's accumulator (the CTA covers 2 * tile_n)
    tile_k: int = 64  # contraction per pipeline step
    max_concurrent_steps: int = 3  # pipeline steps in flight
    grid_tile_width: int = 8  # output tiles along N visited before moving on in M
    epi_tile_m: int = 64  # epilogue slab rows
    epi_tile_n: int = 64  # epilogue slab columns
    align: int = 8  # a group's row windows start at a multiple of this (divides tile_m; a multiple of 8)
    epi_buffers: int = 2  # epilogue shared-memory buffers per warpgroup (1 or 2)

    def __post_init__(self) -> None:
        _check_tiles(self)
        if self.tile_m % self.align or self.align % 8:
            raise ValueError(f"gmm_mgpu.Config: align {self.align} must divide tile_m {self.tile_m} and be a "
                             f"multiple of 8")
        if self.tile_m % self.epi_tile_m or self.tile_n % self.epi_tile_n:
            raise ValueError(f"gmm_mgpu.Config: the epilogue slab {self.epi_tile_m} x {self.epi_tile_n} must divide "
                             f"the tile {self.tile_m} x {self.tile_n}")


def _check_tiles(cfg: Config | TConfig) -> None:
    """Every field a positive int (``seg_rows`` >= 0), ``epi_buffers`` 1 or 2."""
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        low = 0 if f.name == "seg_rows" else 1
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise ValueError(f"{type(cfg).__name__}.{f.name} must be an int >= {low}, got {v!r}")
    if cfg.epi_buffers not in (1, 2):
        raise ValueError(f"{type(cfg).__name__}.epi_buffers must be 1 or 2, got {cfg.epi_buffers}")


def on_hopper() -> bool:
    """Whether jax's default device is a Hopper GPU (sm_90: wgmma, which these kernels are built on)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")) == "9.0"


def supported(m: int, k: int, n: int, cfg: Config | None = None) -> bool:
    """Whether the kernel takes ``x [m, k]`` to ``[m, n]`` columns: whole K steps, whole CTA column blocks, at
    least one row tile."""
    cfg = cfg or Config()
    return (k % cfg.tile_k == 0 and n % (2 * cfg.tile_n) == 0 and m % cfg.tile_m == 0
            and cfg.tile_n % cfg.epi_tile_n == 0)


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


def _smem_transforms(plgpu, tile_k: int, dtype) -> tuple:
    """The TMA operands' shared-memory layout: 8-row tiles of one swizzle width, swizzled (wgmma's operand form)."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(tile_k * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _ws_kernel(plgpu, kernel, out_type, num_sms: int | None, interpret=None):
    """``kernel`` launched persistent (one program per SM, grid axis "sm") with three warpgroups ("wg": two compute,
    one memory), in warpgroup lowering."""
    return plgpu.kernel(
        kernel,
        out_type=out_type,
        grid=(num_sms or _num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **({"interpret": interpret} if interpret is not None else {}),
    )


class Recording:
    """The kernels called while tracing inside :func:`recording`: one entry per distinct kernel (the jitted function,
    its arguments' shapes and dtypes, its static arguments), in call order."""

    def __init__(self) -> None:
        self.kernels: dict[tuple, tuple] = {}
        self.compile_s: list[float] = []  # compile_ahead's time per kernel, as each finishes

    def __len__(self) -> int:
        return len(self.kernels)

    def compile_ahead(self, workers: int | None = None) -> list:
        """Compile each recorded kernel alone, in a pool of threads (futures of the compiled programs). A Mosaic-GPU
        kernel's module is compiled once per process, keyed by the hash of its serialized module (jaxlib's
        ``mosaic/gpu/custom_call.cc``: ``GetOrCreateKernel``), and XLA compiles the kernels of a program one after
        another when it emits their calls, after its own passes: compiled here, alongside a program's compile (whose
        XLA passes run for tens of seconds first), they are ready when it reaches them. The kernel lowered alone is
        the same module as inside the program (its hash: test_gmm_mgpu.py)."""
        if not self.kernels:
            return []
        import concurrent.futures

        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers or min(len(self.kernels), 8),
                                                     thread_name_prefix="mosaic-ahead")

        def compile_one(fn, args, kw):
            t0 = time.perf_counter()
            out = fn.trace(*args, **dict(kw)).lower().compile()
            self.compile_s.append(time.perf_counter() - t0)
            return out

        futures = [pool.submit(compile_one, *kernel) for kernel in self.kernels.values()]
        pool.shutdown(wait=False)
        for f in futures:  # a kernel that fails here is compiled by XLA in the step's compile, as without this
            f.add_done_callback(lambda f: f.exception() and log.warning(
                "a Mosaic-GPU kernel compiled ahead failed (%s); the step's compile compiles it", f.exception()))
        return futures


_recording = threading.local()


@contextlib.contextmanager
def recording():
    """Record the Mosaic-GPU kernels that :func:`gmm` / :func:`tgmm` calls in this thread trace (e.g. while a train step
    is lowered), for :meth:`Recording.compile_ahead`."""
    rec, prev = Recording(), getattr(_recording, "current", None)
    _recording.current = rec
    try:
        yield rec
    finally:
        _recording.current = prev


def _record(fn, args: tuple, kw: dict) -> None:
    rec = getattr(_recording, "current", None)
    if rec is None or kw.get("interpret") is not None:
        return
    avals = tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
    static = tuple(sorted(kw.items()))
    key = tuple(None if a is None else (a.shape, str(a.dtype)) for a in avals)
    rec.kernels.setdefault((fn.__name__, key, static), (fn, avals, static))


def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, h: jax.Array | None = None,
        row_w: jax.Array | None = None, *, trans_w: bool = False, config: Config | None = None, interpret=None,
        num_sms: int | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``x [M, K]`` rows sorted by group; ``w [G, K, N]`` -> ``[M, N]`` (with ``trans_w``: ``w [G, N, K]`` read
    transposed, i.e. ``x @ w[g]^T``). Rows past ``sum(group_sizes)`` are left unwritten. ``interpret``: a
    ``InterpretGPUParams`` to run the kernel in Pallas' GPU interpreter (tests on CPU). ``h``: :func:`gmm_dswiglu`;
    ``row_w``: its routing-weighted form."""
    kw = dict(trans_w=trans_w, config=config, interpret=interpret, num_sms=num_sms)
    args = (x, w, group_sizes) if h is None and row_w is None else (x, w, group_sizes, h, row_w)
    _record(_gmm, args, kw)
    return _gmm(*args, **kw)


def _traced_alone(fn):
    """``fn`` (a kernel's jitted body) traced as if called at the top level: a kernel traced inside a transformation
    rule (e.g. a custom VJP's backward, which JAX traces under the forward call's traceback and name stack) otherwise
    carries the caller's source locations in its Mosaic module, so the same kernel is another module (another hash,
    another compile) there than alone (:meth:`Recording.compile_ahead`; test_gmm_mgpu.py checks the hashes)."""
    from jax._src import source_info_util  # (no public API: user_context(None) keeps the caller's traceback)

    @functools.wraps(fn)
    def wrapped(*args, **kw):
        ctx = source_info_util._source_info_context
        prev, ctx.context = ctx.context, source_info_util.new_source_info()
        try:
            return fn(*args, **kw)
        finally:
            ctx.context = prev

    return wrapped


# Both kernels are jitted functions (_gmm, _tgmm; gmm and tgmm record them for :func:`recording`, then call them):
# the call sites of one kernel (the same shapes and config, e.g. every layer of an unrolled decoder) then share one
# lowered function, where each pallas_call would otherwise lower again and embed its serialized Mosaic module
# (~200 KB each) in the program (bench/results/first_step.md: the Mosaic kernels added ~25 s to the proxy step's first
# compile).
@functools.partial(jax.jit, static_argnames=("trans_w", "config", "interpret", "num_sms"))
@_traced_alone
def _gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, h: jax.Array | None = None,
         row_w: jax.Array | None = None, *, trans_w: bool, config: Config | None, interpret,
         num_sms: int | None) -> jax.Array | tuple[jax.Array, jax.Array]:
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
    em, en, nbuf = cfg.epi_tile_m, cfg.epi_tile_n, cfg.epi_buffers
    dswiglu = h is not None  # the product is d(act): SwiGLU's backward in the epilogue, d(h) out
    if dswiglu and (h.shape != (m, 2 * n) or h.dtype != x.dtype):
        raise ValueError(f"gmm_mgpu: SwiGLU's backward needs h [{m}, {2 * n}] {x.dtype} (got {h.shape} {h.dtype})")
    weighted = row_w is not None  # the backward of act scaled by each row's routing weight (dswiglu)
    if weighted and (not dswiglu or row_w.shape != (m,) or row_w.dtype != jnp.float32):
        raise ValueError(f"gmm_mgpu: row weights are float32 [{m}] (got {row_w.shape} {row_w.dtype}), for SwiGLU's "
                         f"backward in the epilogue (h) only")
    cta_n = 2 * tn
    # a compute warpgroup's block of the tile: all its rows, its half of the CTA's columns
    wm, wn = tm, tn
    if wm % em or wn % en:
        raise ValueError(f"gmm_mgpu: a warpgroup's {wm} x {wn} block is not whole {em} x {en} epilogue slabs: {cfg}")
    group, row0, lo_rows, hi_rows = block_table(group_sizes, m, tm, cfg.align)
    n_tiles, n_iters, k_iters = group.shape[0], n // cta_n, k // tk
    dtype = x.dtype
    transforms = _smem_transforms(plgpu, tk, dtype)

    def get_pipeline(pipeline_body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            pipeline_body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((tm, tk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((cta_n, tk) if trans_w else (tk, cta_n),
                                (lambda kk: (0, kk)) if trans_w else (lambda kk: (kk, 0)),
                                transforms=transforms, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    def kernel(group_gmem, row0_gmem, lo_gmem, hi_gmem, a_gmem, b_gmem, *refs):
        refs = list(refs)  # inputs h, row_w; outputs out, the row sums (dswiglu, weighted)
        h_gmem = refs.pop(0) if dswiglu else None
        w_gmem = refs.pop(0) if weighted else None
        out_gmem = refs.pop(0)
        sums_gmem = refs.pop(0) if dswiglu and weighted else None
        ignore = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on the bodies
        b_blocks = (b_gmem.at[0, pl.ds(0, cta_n), :] if trans_w else b_gmem.at[0, :, pl.ds(0, cta_n)],)
        # dswiglu: h's gate and up slabs [warpgroup, buffer, gate / up] (two slabs in flight a warpgroup), each
        # overwritten with its d(h) slab and stored from there (no other epilogue buffer)
        epi = (dict(out_smem=plgpu.SMEM((2, 2, 2, em, en), dtype),
                    h_bar=plgpu.Barrier(num_arrivals=2, num_barriers=4)) if dswiglu
               else dict(out_smem=plgpu.SMEM((2, nbuf, em, en), dtype)))
        if weighted:  # each warpgroup's rows' weights, loaded by TMA; dswiglu: its rows' sums of d(act_w) * act
            epi.update(w_smem=plgpu.SMEM((2, wm), jnp.float32), w_bar=plgpu.Barrier(num_arrivals=1, num_barriers=2))
            if dswiglu:
                epi.update(sums_smem=plgpu.SMEM((2, wm), jnp.float32))

        @functools.partial(pl.run_scoped,
                           pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(a_gmem.at[pl.ds(0, tm), :],
                                                                                          *b_blocks),
                           collective_axes="wg", **epi)
        def scope(pipeline_allocs, out_smem, h_bar=None, w_smem=None, w_bar=None, sums_smem=None):
            wg = lax.axis_index("wg")
            @plgpu.nd_loop((n_tiles * n_iters,), collective_axes="sm")
            def mn_loop(info):
                (lin,) = info.index
                t, ni = plgpu.planar_snake(lin, (n_tiles, n_iters), 1, cfg.grid_tile_width)
                r0, r1, g = lo_gmem[t], hi_gmem[t], group_gmem[t]

                @pl.when(r1 > r0)
                def _():
                    start = pl.multiple_of(row0_gmem[t], cfg.align)
                    skip, count = r0 - start, r1 - r0  # the group's rows from the window's first
                    col0 = ni * cta_n + wg * tn

                    def load_weights():  # this warpgroup's rows' routing weights, while the product runs
                        if weighted:
                            plgpu.copy_gmem_to_smem(w_gmem.at[pl.ds(start, wm)], w_smem.at[wg], w_bar.at[wg])

                    def compute_context(eval_pipeline):
                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
                        def _(acc_ref):
                            if dswiglu:  # h's first two slabs load while the tile's product runs
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (the last tile's stores read)
                                load_weights()
                                for sl in range(min(2, n_slabs)):
                                    load_h(sl)
                            eval_pipeline(acc_ref)
                            if dswiglu:
                                store_dswiglu(acc_ref)
                                return
                            store(acc_ref[...].astype(dtype), out_gmem, col0)

                    n_slabs = (wm // em) * (wn // en)

                    def slab_at(sl):  # the rows (from the window's first) and columns of slab sl of this warpgroup
                        mi, nj = divmod(sl, wn // en)
                        return mi * em, col0 + nj * en

                    def load_h(sl):
                        r, c = slab_at(sl)
                        bar = h_bar.at[wg * 2 + sl % 2]
                        plgpu.copy_gmem_to_smem(h_gmem.at[pl.ds(start + r, em), pl.ds(c, en)],
                                                out_smem.at[wg, sl % 2, 0], bar)
                        plgpu.copy_gmem_to_smem(h_gmem.at[pl.ds(start + r, em), pl.ds(n + c, en)],  # h's up half
                                                out_smem.at[wg, sl % 2, 1], bar)

                    def store_dswiglu(acc_ref):
                        """d(h) = SwiGLU's backward of d(act) = this warpgroup's product, slab by slab: h's gate and
                        up slabs (loaded ahead, two in flight) read, overwritten with d(gate), d(up) (float32 from
                        the product rounded to the output dtype and h, as JAX's gradient of permute.swiglu), those
                        stored (only the group's rows), the buffer refilled with the slab after next. Weighted: the
                        product is d(act_w), d(act) = it times the row's weight, and each row's sum of d(act_w) *
                        act (its weight's gradient, over this warpgroup's columns) is stored for the whole window."""
                        acc = acc_ref[...].astype(dtype)
                        if weighted:
                            plgpu.barrier_wait(w_bar.at[wg])
                        sums = [None] * (wm // em)
                        for sl in range(n_slabs):
                            b = sl % 2
                            r, c = slab_at(sl)
                            mi, nj = divmod(sl, wn // en)
                            plgpu.barrier_wait(h_bar.at[wg * 2 + b])
                            gate = out_smem[wg, b, 0].astype(jnp.float32)
                            up = out_smem[wg, b, 1].astype(jnp.float32)
                            da = acc[mi * em:(mi + 1) * em, nj * en:(nj + 1) * en].astype(jnp.float32)
                            sig = 1.0 / (1.0 + jnp.exp(-gate))
                            if weighted:
                                part = jnp.sum(da * (gate * sig * up), axis=1)
                                sums[mi] = part if sums[mi] is None else sums[mi] + part
                                da = da * lax.broadcast_in_dim(w_smem[wg, pl.ds(mi * em, em)], (em, en), (0,))
                            out_smem[wg, b, 1] = (da * (gate * sig)).astype(dtype)
                            out_smem[wg, b, 0] = (da * up * (sig + gate * sig * (1.0 - sig))).astype(dtype)
                            plgpu.commit_smem()
                            lo = jnp.clip(skip - mi * em, 0, em)
                            hi = jnp.clip(skip + count - mi * em, 0, em)
                            store_rows(out_smem.at[wg, b, 0], out_gmem, start + r, c, lo, hi - lo)
                            store_rows(out_smem.at[wg, b, 1], out_gmem, start + r, n + c, lo, hi - lo)
                            if sl + 2 < n_slabs:  # the buffer's stores read before it is refilled
                                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                                load_h(sl + 2)
                        if weighted:  # the window's row sums: XLA keeps the group's rows (_row_sums)
                            for mi, part in enumerate(sums):
                                sums_smem[wg, pl.ds(mi * em, em)] = part
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(sums_smem.at[wg], sums_gmem.at[ni * 2 + wg, t])

                    def store_rows(slab, o_gmem, row, c0, s, c):
                        """Rows ``[s, s + c)`` of ``slab`` (shared memory) to ``o_gmem`` from row ``row + s``, column
                        ``c0``: TMA boxes of 64, 32, ..., 1 rows (``c``'s binary digits; a box has a static size)."""
                        size = em
                        while size >= 1:
                            @pl.when((c & size) != 0)
                            def _(s=s, size=size):
                                plgpu.copy_smem_to_gmem(slab.at[pl.ds(s, size)],
                                                        o_gmem.at[pl.ds(row + s, size), pl.ds(c0, en)])

                            s = s + (c & size)
                            size //= 2

                    def store(acc, o_gmem, c0, prev=None):
                        """``acc`` (this warpgroup's block) into ``o_gmem`` from column ``c0``, only the group's rows;
                        ``prev``: the row count of the last slab stored before (this tile's), returned for the next."""
                        for mi in range(wm // em):
                            lo = jnp.clip(skip - mi * em, 0, em)
                            hi = jnp.clip(skip + count - mi * em, 0, em)
                            for nj in range(wn // en):
                                b = (mi * (wn // en) + nj) % nbuf
                                if nbuf == 1 or prev is None:
                                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                                else:  # a whole previous slab was one store: the one before it is done
                                    pl.when(prev == em)(lambda: plgpu.wait_smem_to_gmem(1, wait_read_only=True))
                                    pl.when(prev != em)(lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True))
                                out_smem[wg, b] = acc[mi * em:(mi + 1) * em, nj * en:(nj + 1) * en]
                                plgpu.commit_smem()
                                prev = hi - lo
                                store_rows(out_smem.at[wg, b], o_gmem, start + mi * em, c0 + nj * en, lo, prev)
                        return prev

                    def mma_body(_, a_smem, b_smem, acc_ref):  # all the rows, this warpgroup's columns
                        b = (plgpu.transpose_ref(b_smem.at[pl.ds(wg * tn, tn)], (1, 0)) if trans_w
                             else b_smem.at[:, pl.ds(wg * tn, tn)])
                        plgpu.wgmma(acc_ref, a_smem, b)
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    cols = pl.ds(ni * cta_n, cta_n)
                    operands = (a_gmem.at[pl.ds(start, tm), :],
                                b_gmem.at[g, cols, :] if trans_w else b_gmem.at[g, :, cols])
                    get_pipeline(mma_body, compute_context)(*operands, allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    out_type = jax.ShapeDtypeStruct((m, 2 * n if dswiglu else n), dtype)
    if dswiglu and weighted:  # per (warpgroup's column block, tile): the window's row sums
        out_type = (out_type, jax.ShapeDtypeStruct((n // tn, n_tiles, tm), jnp.float32))
    call = _ws_kernel(plgpu, kernel, out_type, num_sms, interpret)
    out = call(group, row0, lo_rows, hi_rows, x, w, *(a for a in (h, row_w) if a is not None))
    if dswiglu and weighted:
        return out[0], _row_sums(out[1], row0, lo_rows, hi_rows, m)
    return out


def _row_sums(sums: jax.Array, row0: jax.Array, lo: jax.Array, hi: jax.Array, m: int) -> jax.Array:
    """``[M]`` float32: each row's sum over the column blocks of ``sums [blocks, tiles, tile_m]`` (a tile's window
    rows, :func:`block_table`), from the one tile whose ``[lo, hi)`` holds the row; rows past the groups 0. A
    window's rows outside its group (another tile's, or never written: unused tiles) are dropped unread."""
    total = jnp.sum(sums, axis=0)
    rows = row0[:, None] + jnp.arange(sums.shape[2], dtype=jnp.int32)[None]
    mine = (rows >= lo[:, None]) & (rows < hi[:, None])
    return jnp.zeros((m,), jnp.float32).at[jnp.where(mine, rows, m)].add(jnp.where(mine, total, 0.0), mode="drop")


def gmm_dswiglu(dy: jax.Array, w: jax.Array, group_sizes: jax.Array, h: jax.Array, row_w: jax.Array | None = None, *,
                trans_w: bool = True, config: Config | None = None, interpret=None,
                num_sms: int | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The experts' down projection's d(x) with SwiGLU's backward in its epilogue: ``dy [M, H]``, ``w [G, I, H]`` (the
    down weights as stored, read transposed; ``trans_w=False``: ``[G, H, I]``), ``h [M, 2I]`` the gate_up forward's
    output -> ``d(h) [M, 2I]``, JAX's gradient of ``permute.swiglu`` at ``h`` for ``d(act) = dy @ w[g]^T`` rounded to
    the output dtype (d(act) itself is never written), rows past ``sum(group_sizes)`` unwritten. Each compute
    warpgroup loads h's gate and up slabs of its output block by TMA (the first two while the block's product runs,
    two in flight), computes d(gate) and d(up) into those buffers and stores them from there. Saves SwiGLU's backward
    pass, which reads h and d(act) and writes d(h), less the loads the epilogue waits for (figures:
    bench/results/moe_layer.md; tested in the interpreter with ``trans_w=False``). ``row_w [M]``
    float32 (the backward of Megatron's weighted SwiGLU, ``act_w = silu(gate) * up * row_w`` as ``permute.swiglu``
    with ``row_w`` computes it; ``dy`` then the cotangent of ``act_w @ w``): the product is
    d(act_w), SwiGLU's backward takes ``d(act) = d(act_w) * row_w``, and the routing weights' gradient
    ``sum_j d(act_w)[m, j] * act[m, j]`` comes back too: ``(d(h), d(row_w) [M])`` (each warpgroup stores its
    window's row sums over its columns, float32, and XLA adds the blocks' and keeps each row's from its own tile:
    :func:`_row_sums`)."""
    return gmm(dy, w, group_sizes, h, row_w, trans_w=trans_w, config=config, interpret=interpret, num_sms=num_sms)


@dataclasses.dataclass(frozen=True)
class TConfig:
    """Tiles of the d(w) kernel :func:`tgmm`: each compute warpgroup owns a ``tile_m x tile_n`` block of one group's
    ``[K, N]`` gradient (the CTA covers ``2 * tile_n`` columns); the group's rows are contracted ``tile_k`` at a
    time, ``max_concurrent_steps`` in flight; ``grid_tile_width`` output tiles along N visited before moving on in
    K; the epilogue stores ``epi_tile_m x epi_tile_n`` slabs through ``epi_buffers`` shared-memory buffers per
    warpgroup (2: a slab is written while the previous one is still being stored)."""

    tile_m: int = 128  # rows of the [K, N] gradient per compute warpgroup's tile
    tile_n: int = 128  # columns of each compute warpgroup's accumulator (the CTA covers 2 * tile_n)
    tile_k: int = 64  # sorted rows contracted per pipeline step
    max_concurrent_steps: int = 3  # pipeline steps in flight
    grid_tile_width: int = 4  # output tiles along N visited before moving on in K
    epi_tile_m: int = 128  # epilogue slab rows
    epi_tile_n: int = 128  # epilogue slab columns
    epi_buffers: int = 1  # epilogue shared-memory buffers per warpgroup (1 or 2)
    # 0: one pipeline per (group, output tile). > 0: the sorted rows cut at group boundaries into segments of about
    # this many rows, one pipeline per (segment, output tile) streaming the segment's row blocks and storing each
    # group's tile where the group ends (:func:`_tgmm_streamed`)
    seg_rows: int = 16384

    def __post_init__(self) -> None:
        _check_tiles(self)


def tsupported(m: int, k: int, n: int, cfg: TConfig | None = None) -> bool:
    """Whether :func:`tgmm` takes ``x [m, k]``, ``dy [m, n]``: whole output tiles, whole row steps."""
    cfg = cfg or CONFIGS["dw"]
    return (k % cfg.tile_m == 0 and n % (2 * cfg.tile_n) == 0 and m % cfg.tile_k == 0
            and cfg.tile_m % cfg.epi_tile_m == 0 and cfg.tile_n % cfg.epi_tile_n == 0
            and (cfg.tile_m // cfg.epi_tile_m * cfg.tile_n // cfg.epi_tile_n) % cfg.epi_buffers == 0)


def _dw_pipeline(plgpu, cfg: TConfig, transforms, body, compute_context, steps, b0, mi, ni):
    """The d(w) kernels' pipeline over ``steps`` row blocks from block ``b0``: x's ``[tile_k, tile_m]`` block of output
    tile row ``mi`` and dy's ``[tile_k, 2 * tile_n]`` block of tile column ``ni``, one memory and two compute
    warpgroups."""
    tk, tm, cta_n = cfg.tile_k, cfg.tile_m, 2 * cfg.tile_n
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=40,
        in_specs=[
            plgpu.BlockSpec((tk, tm), lambda s: (b0 + s, mi), transforms=transforms, memory_space=plgpu.SMEM),
            plgpu.BlockSpec((tk, cta_n), lambda s: (b0 + s, ni), transforms=transforms, memory_space=plgpu.SMEM),
        ],
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=cfg.max_concurrent_steps,
        compute_context=compute_context,
    )


def _dw_out_smem(plgpu, cfg: TConfig, dtype):
    """The d(w) epilogue's shared-memory slabs, ``epi_buffers`` per compute warpgroup."""
    return plgpu.SMEM((2, cfg.epi_buffers, cfg.epi_tile_m, cfg.epi_tile_n), dtype)


def _store_dw_tile(plgpu, cfg: TConfig, out_smem, o_gmem, wg, acc, gi, mi, ni) -> None:
    """This warpgroup's ``[tile_m, tile_n]`` block ``acc`` of group ``gi``'s gradient (output tile ``mi``, ``ni``), slab
    by slab through the epilogue buffers in turn: one store per slab, so at most ``epi_buffers - 1`` pending leaves the
    next buffer free (a tile has a whole number of rounds, so every tile starts at buffer 0)."""
    tm, tn, em, en, nbuf = cfg.tile_m, cfg.tile_n, cfg.epi_tile_m, cfg.epi_tile_n, cfg.epi_buffers
    col0 = ni * (2 * tn) + wg * tn
    for i in range(tm // em):
        for j in range(tn // en):
            b = (i * (tn // en) + j) % nbuf
            plgpu.wait_smem_to_gmem(nbuf - 1, wait_read_only=True)
            out_smem[wg, b] = acc[i * em:(i + 1) * em, j * en:(j + 1) * en]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, b], o_gmem.at[gi, pl.ds(mi * tm + i * em, em), pl.ds(col0 + j * en, en)])


def tgmm(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *, config: TConfig | None = None,
         num_sms: int | None = None) -> jax.Array:
    """d(w) of a grouped matmul: ``x [M, K]``, ``dy [M, N]`` rows sorted by group -> ``[G, K, N]``, per group the
    sum over its rows of ``x^T dy`` (zero for an empty group), as ``gmm_triton.tgmm``.

    Warp-specialised as :func:`gmm` (a memory warpgroup feeding two compute warpgroups that split the CTA's columns,
    a persistent loop over (group, output tile)); each tile's pipeline contracts its group's rows from the first one
    rounded down to ``tile_k`` (a dynamic number of steps). The first and last step of a group hold rows of other
    groups or past ``sum(group_sizes)`` (rows the experts leave unwritten: any bits, NaN included): there each
    compute warpgroup *selects* zeros into the rows outside the group, in its own half of the ``dy`` block and in
    the whole ``x`` block both warpgroups read. The two write the same values into ``x``'s block (a select is
    idempotent: an element is either kept or zero, whichever warpgroup writes it, and in whichever order), so each
    warpgroup's own pass is complete before its MMA reads the block, and the other's concurrent writes change no bit.
    Selecting, not multiplying by a mask (JAX's ``transposed_ragged_dot_mgpu``): 0 x NaN would reach the gradient."""
    _record(_tgmm, (x, dy, group_sizes), dict(config=config, num_sms=num_sms))
    return _tgmm(x, dy, group_sizes, config=config, num_sms=num_sms)


@functools.partial(jax.jit, static_argnames=("config", "num_sms"))  # one lowering per kernel, as _gmm
@_traced_alone
def _tgmm(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *, config: TConfig | None,
          num_sms: int | None) -> jax.Array:
    from jax.experimental.pallas import mosaic_gpu as plgpu

    cfg = config or CONFIGS["dw"]
    m, k = x.shape
    n = dy.shape[1]
    if dy.shape[0] != m or dy.dtype != x.dtype:
        raise ValueError(f"gmm_mgpu.tgmm: x {x.shape} {x.dtype} and dy {dy.shape} {dy.dtype} need the same rows, dtype")
    if not tsupported(m, k, n, cfg):
        raise ValueError(f"gmm_mgpu.tgmm: x [{m}, {k}], dy [{m}, {n}] need K % {cfg.tile_m} == 0, "
                         f"N % {2 * cfg.tile_n} == 0 and M % {cfg.tile_k} == 0 and whole epilogue slabs ({cfg})")
    if cfg.seg_rows:
        return _tgmm_streamed(x, dy, group_sizes, cfg, num_sms)
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = 2 * tn
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes).astype(jnp.int32)
    starts = ends - sizes
    first = starts // tk
    n_steps = jnp.where(sizes > 0, (ends - first * tk + tk - 1) // tk, 0).astype(jnp.int32)
    dtype = x.dtype
    transforms = _smem_transforms(plgpu, tk, dtype)
    grid_m, grid_n = k // tm, n // cta_n
    out_smem_type = _dw_out_smem(plgpu, cfg, dtype)

    def get_pipeline(pipeline_body, compute_context, steps, b0, mi, ni):
        return _dw_pipeline(plgpu, cfg, transforms, pipeline_body, compute_context, steps, b0, mi, ni)

    def kernel(starts_gmem, ends_gmem, first_gmem, steps_gmem, x_gmem, dy_gmem, o_gmem):
        ignore = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on the bodies
        allocs = get_pipeline(ignore, ignore, cfg.max_concurrent_steps, 0, 0, 0).get_allocations(x_gmem, dy_gmem)

        @functools.partial(pl.run_scoped, pipeline_allocs=allocs, out_smem=out_smem_type, collective_axes="wg")
        def scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")

            def store(acc, gi, mi, ni):
                _store_dw_tile(plgpu, cfg, out_smem, o_gmem, wg, acc, gi, mi, ni)

            @plgpu.nd_loop((g * grid_m * grid_n,), collective_axes="sm")
            def mn_loop(info):
                (lin,) = info.index
                gi = lin // (grid_m * grid_n)
                mi, ni = plgpu.planar_snake(lin % (grid_m * grid_n), (grid_m, grid_n), 1, cfg.grid_tile_width)
                start, end, steps, b0 = starts_gmem[gi], ends_gmem[gi], steps_gmem[gi], first_gmem[gi]

                @pl.when((steps == 0) & (wg < 2))
                def _():  # an empty group: a zero gradient
                    store(jnp.zeros((tm, tn), dtype), gi, mi, ni)

                @pl.when(steps > 0)
                def _():
                    def compute_context(eval_pipeline):
                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                        def _(acc_ref):
                            eval_pipeline(acc_ref)
                            store(acc_ref[...].astype(dtype), gi, mi, ni)

                    def mma_body(idx, x_smem, dy_smem, acc_ref):
                        (si,) = idx
                        dy_half = dy_smem.at[:, pl.ds(wg * tn, tn)]

                        @pl.when((si == 0) | (si == steps - 1))
                        def _():  # rows outside the group: zero (selected) in x and in this warpgroup's dy half
                            row0 = (b0 + si) * tk
                            for ref, cols in ((x_smem, tm), (dy_half, tn)):
                                r = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (tk, cols), 0) + row0,
                                                      plgpu.Layout.WGMMA)
                                ref[...] = jnp.where((r >= start) & (r < end), ref[...], jnp.zeros((), dtype))
                            plgpu.commit_smem()

                        plgpu.wgmma(acc_ref, plgpu.transpose_ref(x_smem, (1, 0)), dy_half)
                        plgpu.wgmma_wait(0)
                        return acc_ref

                    get_pipeline(mma_body, compute_context, steps, b0, mi, ni)(
                        x_gmem, dy_gmem, allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = _ws_kernel(plgpu, kernel, jax.ShapeDtypeStruct((g, k, n), dtype), num_sms)
    return call(starts, ends, first, n_steps, x, dy)


def segments(group_sizes: jax.Array, m: int, seg_rows: int, tile_k: int) -> tuple[jax.Array, ...]:
    """The streamed d(w)'s work split: the sorted rows cut at group boundaries into ``ceil(m / seg_rows)`` segments
    of about equal rows (a cut at the last group boundary at or before each ``i * sum(group_sizes) / S``; a group
    larger than a segment makes its segment larger). Per segment: its first and end group (exclusive), its first
    row block (``tile_k`` rows) and number of blocks (at least 1 where the segment has a group, so that empty groups
    still store their zero gradient; 0 for a segment without groups)."""
    g = group_sizes.shape[0]
    s = max(1, -(-m // seg_rows))
    ends = jnp.cumsum(group_sizes.astype(jnp.int32)).astype(jnp.int32)
    starts = ends - group_sizes.astype(jnp.int32)
    targets = jnp.arange(1, s, dtype=jnp.int32) * (ends[-1] // s)
    cuts = jnp.searchsorted(ends, targets, side="right", method="compare_all").astype(jnp.int32)
    bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), cuts, jnp.full((1,), g, jnp.int32)])
    g0, g1 = bounds[:-1], bounds[1:]
    has = g1 > g0
    row_lo = jnp.where(has, starts[jnp.minimum(g0, g - 1)], 0)
    row_hi = jnp.where(has, ends[jnp.maximum(g1 - 1, 0)], 0)
    b0 = jnp.minimum(row_lo // tile_k, m // tile_k - 1)
    steps = jnp.where(has, jnp.maximum((row_hi - b0 * tile_k + tile_k - 1) // tile_k, 1), 0)
    return g0, g1, b0.astype(jnp.int32), steps.astype(jnp.int32), row_lo.astype(jnp.int32), row_hi.astype(jnp.int32)


def _tgmm_streamed(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, cfg: TConfig,
                   num_sms: int | None) -> jax.Array:
    """:func:`tgmm` with one pipeline per (segment, output tile) (``TConfig.seg_rows``): the per-(group, tile)
    pipelines of :func:`tgmm` fill and drain once per group (~17 row steps a tile at 131,072 rows in 128 groups), this
    one streams a whole segment's row blocks (:func:`segments`) through one pipeline and keeps the accumulator of the
    group whose rows it is in. A step whose block holds no group end is one wgmma; a step where groups end (the
    segment's first and last step always take this path) keeps its ``dy`` half in registers and, per group ending
    there, multiplies a copy with only that group's rows kept, stores the group's tile and zeroes the accumulator; the
    rows of the group that goes on into the next block are multiplied last. An empty group stores zeros. Rows
    outside the segment (before its first row, past its last: rows past ``sum(group_sizes)`` may hold any bits) are
    zeroed (selected) in both operands in the first and last step, as :func:`tgmm` does. Between two groups of one
    segment only ``dy`` is masked: a non-finite ``x`` row of one group can make a neighbour's gradient NaN, in a step
    whose gradients are non-finite anyway."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    m, k = x.shape
    n = dy.shape[1]
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_n = 2 * tn
    g = group_sizes.shape[0]
    ends = jnp.cumsum(group_sizes.astype(jnp.int32)).astype(jnp.int32)
    g0, g1, b0s, steps_s, lo_s, hi_s = segments(group_sizes, m, cfg.seg_rows, tk)
    n_seg = g0.shape[0]
    dtype = x.dtype
    transforms = _smem_transforms(plgpu, tk, dtype)
    grid_m, grid_n = k // tm, n // cta_n

    def get_pipeline(pipeline_body, compute_context, steps, b0, mi, ni):
        return _dw_pipeline(plgpu, cfg, transforms, pipeline_body, compute_context, steps, b0, mi, ni)

    def kernel(ends_gmem, g0_gmem, g1_gmem, b0_gmem, steps_gmem, lo_gmem, hi_gmem, x_gmem, dy_gmem, o_gmem):
        ignore = lambda *_, **__: None  # noqa: E731 - the allocations do not depend on the bodies
        allocs = get_pipeline(ignore, ignore, cfg.max_concurrent_steps, 0, 0, 0).get_allocations(x_gmem, dy_gmem)

        @functools.partial(pl.run_scoped, pipeline_allocs=allocs, out_smem=_dw_out_smem(plgpu, cfg, dtype),
                           collective_axes="wg")
        def scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")

            def store(acc, gi, mi, ni):
                _store_dw_tile(plgpu, cfg, out_smem, o_gmem, wg, acc, gi, mi, ni)

            def group_end(gi):
                return ends_gmem[jnp.minimum(gi, g - 1)]

            @plgpu.nd_loop((n_seg * grid_m * grid_n,), collective_axes="sm")
            def mn_loop(info):
                (lin,) = info.index
                si_seg = lin // (grid_m * grid_n)
                mi, ni = plgpu.planar_snake(lin % (grid_m * grid_n), (grid_m, grid_n), 1, cfg.grid_tile_width)
                steps, b0 = steps_gmem[si_seg], b0_gmem[si_seg]
                first_g, end_g = g0_gmem[si_seg], g1_gmem[si_seg]
                row_lo, row_hi = lo_gmem[si_seg], hi_gmem[si_seg]

                @pl.when(steps > 0)
                def _():
                    def compute_context(eval_pipeline):
                        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                        def _(acc_ref):
                            eval_pipeline((acc_ref, first_g, row_lo, group_end(first_g)))

                    def mma_body(idx, x_smem, dy_smem, carry):
                        acc_ref, gc, g_start, g_stop = carry
                        (si,) = idx
                        row0 = (b0 + si) * tk
                        dy_half = dy_smem.at[:, pl.ds(wg * tn, tn)]

                        @pl.when((si == 0) | (si == steps - 1))
                        def _():  # rows outside the segment: zero (selected) in x, as tgmm does
                            r = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (tk, tm), 0) + row0,
                                                  plgpu.Layout.WGMMA)
                            x_smem[...] = jnp.where((r >= row_lo) & (r < row_hi), x_smem[...], jnp.zeros((), dtype))
                            plgpu.commit_smem()

                        x_t = plgpu.transpose_ref(x_smem, (1, 0))
                        crossing = (si == 0) | (g_stop <= row0 + tk)

                        @pl.when(jnp.logical_not(crossing))
                        def _():  # a block inside group gc
                            plgpu.wgmma(acc_ref, x_t, dy_half)
                            plgpu.wgmma_wait(0)

                        def boundary():
                            r = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (tk, tn), 0) + row0,
                                                  plgpu.Layout.WGMMA)
                            v = dy_half[...]

                            def masked_mma(lo, hi):  # acc += x^T dy with only rows [lo, hi) of dy kept
                                dy_half[...] = jnp.where((r >= lo) & (r < hi), v, jnp.zeros((), dtype))
                                plgpu.commit_smem()
                                plgpu.wgmma(acc_ref, x_t, dy_half)
                                plgpu.wgmma_wait(0)

                            def ends_here(c):
                                gc, _, g_stop = c
                                return (gc < end_g) & (g_stop <= row0 + tk)

                            def close_group(c):  # group gc's rows in this block; its tile stored, the acc zeroed
                                gc, g_start, g_stop = c
                                lo = jnp.maximum(g_start, row0)
                                pl.when(g_stop > lo)(lambda: masked_mma(lo, g_stop))
                                store(acc_ref[...].astype(dtype), gc, mi, ni)
                                acc_ref[...] = jnp.zeros((tm, tn), jnp.float32)
                                return gc + 1, g_stop, group_end(gc + 1)

                            gc2, g_start2, g_stop2 = lax.while_loop(ends_here, close_group, (gc, g_start, g_stop))
                            lo = jnp.maximum(g_start2, row0)
                            pl.when((gc2 < end_g) & (row0 + tk > lo))(lambda: masked_mma(lo, row0 + tk))
                            return gc2, g_start2, g_stop2

                        gc, g_start, g_stop = lax.cond(crossing, boundary, lambda: (gc, g_start, g_stop))
                        return acc_ref, gc, g_start, g_stop

                    get_pipeline(mma_body, compute_context, steps, b0, mi, ni)(
                        x_gmem, dy_gmem, allocations=pipeline_allocs)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    call = _ws_kernel(plgpu, kernel, jax.ShapeDtypeStruct((g, k, n), dtype), num_sms)
    return call(ends, g0, g1, b0s, steps_s, lo_s, hi_s, x, dy)


# The tiles per kind: the class defaults, the fastest measured on an H200 (bench/results/moe_layer.md): fwd / dx with
# 3 steps in flight and two epilogue buffers; d(w) the streamed kernel at 16,384-row segments with one 128 x 128
# epilogue slab per warpgroup. A run sets its own in ``compute.moe.kernels.mosaic_gpu_tiles`` (``parallelism.kernels``).
CONFIGS: dict[str, Config | TConfig] = {"fwd": Config(), "dx": Config(), "dw": TConfig()}
