"""Grouped matmul as Pallas-Triton kernels (GPU; on CPU they run in Pallas' interpret mode for tests).

The three matmuls of a grouped matmul's forward and backward, rows of ``x`` sorted by group:

  gmm        out [M, N]    = x [M, K] @ w[g(m)] [K, N]         (forward)
  gmm trans  dx  [M, K]    = dy [M, N] @ w[g(m)]^T              (d x: the same kernel, w read transposed)
  tgmm       dw  [G, K, N] = x_g^T [K, M_g] @ dy_g [M_g, N]     (d w: the row dimension is contracted)

Tiles: the rows of each group are cut into tiles of ``block_m`` rows starting at the group's first row
(MegaBlocks / the TPU ``gmm`` layout), so a tile never spans two groups and no row is padded or copied;
the tile -> (group, first row, end row) table is computed from ``group_sizes`` outside the kernel. The
static tile count is ``cdiv(M, block_m) + G`` (each group adds at most one partial tile); tiles past the
real ones exit at once. Rows past ``sum(group_sizes)`` are not written by ``gmm`` (the caller masks them).

Launch order: the first grid dimension varies fastest, so the ``N`` blocks of one row tile run next to
each other (the tile's ``x`` rows are read from HBM once and reused from L2) and the tiles of one group
follow each other (its weight matrix stays in L2). ``tgmm`` runs one program per (N block, K block,
group), groups slowest, each looping over its group's rows in chunks of ``block_m``.

Fusions (used by ``parallelism.permute`` per its ``FUSE``): ``rows`` (gmm, tgmm) reads the rows of ``x`` through an
int32 index inside the kernel, the MoE dispatch gather folded into the loads; ``epilogue`` (gmm) applies SwiGLU
("swiglu": the forward writes h and act) or its backward ("swiglu_bwd": d(act) becomes d(h)) to the output tiles
before they are stored.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes and Triton launch parameters of one kernel."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3


# Per kernel: "fwd" (gmm), "dx" (gmm, w transposed), "dw" (tgmm: block_m = rows per step, block_k x block_n
# = the output tile); "KIND:KxN" for one shape (gmm: contraction x output columns; tgmm: the output's
# K x N), else the kernel's default. Measured on an H200 (2026-11-30, bench/moe_layer.md run 6,
# bench/scripts/probe_gmm.py; 131,072 rows, 128 skewed groups): the fastest of 7-8 configs each, all at
# bf16 rounding (1.7e-3 vs float32).
CONFIGS: dict[str, Config] = {
    "fwd": Config(128, 256, 64, 8, 3), "dx": Config(128, 256, 64, 8, 3), "dw": Config(64, 128, 128, 8, 3),
    "fwd:768x2048": Config(128, 256, 64, 8, 4), "dx:2048x768": Config(128, 256, 64, 8, 4),  # 30B-A3B down_proj
    "dw:2048x1536": Config(32, 128, 128, 4, 4),  # 30B-A3B gate_up_proj
    # 235B-A22B experts, d(w) only (bench/moe_layer.md run 9, 2026-12-03 ~07:05 UTC; the fwd / d(x) kernels'
    # best are the defaults, or within the repeat spread of them): down_proj (tgmm output 1536 x 4096) 5-9% faster
    # than the default in two timings each; gate_up_proj (4096 x 3072) 3.4% in run 8, ~10% in the layer's profile
    "dw:4096x3072": Config(64, 256, 128, 8, 3), "dw:1536x4096": Config(64, 256, 128, 8, 3),
}
CONFIG_ENV = "MOEVLM_GMM_TRITON_CONFIGS"
_KEY = re.compile(r"^(fwd|dx|dw)(:\d+x\d+)?$")


def config_for(kind: str, k: int, n: int) -> Config:
    """The config of kernel ``kind`` for contraction/output sizes ``k`` x ``n`` (see :data:`CONFIGS`)."""
    return CONFIGS.get(f"{kind}:{k}x{n}", CONFIGS[kind])


def load_configs(path: str) -> dict[str, Config]:
    """Update :data:`CONFIGS` from a JSON file ``{"fwd"|"dx"|"dw"[":KxN"]: {field: value}}`` (what
    ``bench/scripts/probe_gmm.py --best-out`` writes); read at import from ``$MOEVLM_GMM_TRITON_CONFIGS``."""
    with open(path) as f:
        raw = json.load(f)
    unknown = sorted(k for k in raw if not _KEY.match(k))
    if unknown:
        raise ValueError(f"{path}: unknown kernels {unknown}; known: fwd, dx, dw, each optionally ':KxN'")
    CONFIGS.update({kind: Config(**fields) for kind, fields in raw.items()})
    return CONFIGS


if os.environ.get(CONFIG_ENV):
    load_configs(os.environ[CONFIG_ENV])


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


_MAX_ELEMENTS = 2**31 - 1  # the kernels' offsets are 32-bit


def _check_size(what: str, *arrays: jax.Array | jax.ShapeDtypeStruct) -> None:
    big = [a.shape for a in arrays if a.size > _MAX_ELEMENTS]
    if big:
        raise ValueError(f"{what}: operands of shape {big} exceed 2^31 elements (32-bit offsets in the Triton "
                         f"kernels); split the rows (smaller micro-batch) or use backend 'tokamax' / 'capacity'")


def fit_block(block: int, dim: int) -> int:
    """``block`` halved until it divides ``dim`` (a power-of-two block: the largest power of two up to it that does)."""
    while block > 1 and dim % block:
        block //= 2
    return block


def _fit(cfg: Config, k: int, n: int, what: str, interpret: bool) -> Config:
    """``cfg`` with block_k / block_n cut to the largest power of two that divides K / N (small test
    shapes); on the GPU a block under 16 (Triton's smallest dot) is an error."""
    out = dataclasses.replace(cfg, block_k=fit_block(cfg.block_k, k), block_n=fit_block(cfg.block_n, n))
    if not interpret and min(out.block_k, out.block_n) < 16:
        raise ValueError(f"{what}: K={k} and N={n} need a power-of-two divisor >= 16 for the Triton kernels")
    return out


def tile_table(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per tile: group, first row, end row (exclusive; == first row for unused tiles). ``[T]`` each,
    ``T = cdiv(m, block_m) + G``."""
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    tiles_per_group = (sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles_per_group)
    n_tiles = pl.cdiv(m, block_m) + g
    t = jnp.arange(n_tiles, dtype=jnp.int32)
    # compare_all: one fused [T, G] comparison instead of a host-driven binary-search loop (permute.route_plan)
    group = jnp.minimum(jnp.searchsorted(tile_ends, t, side="right", method="compare_all"), g - 1).astype(jnp.int32)
    local = t - (tile_ends[group] - tiles_per_group[group])
    used = t < tile_ends[-1]
    row0 = jnp.where(used, starts[group] + local * block_m, 0).astype(jnp.int32)
    row1 = jnp.where(used, ends[group], 0).astype(jnp.int32)
    return group, row0, row1


def _load_rows(x_ref, x_rows: jax.Array | None, row0: jax.Array, k_i: jax.Array, block_m: int, block_k: int,
               mask: jax.Array) -> jax.Array:
    """The ``[block_m, block_k]`` tile of x at column block ``k_i``: rows ``row0 + i``, or ``x_rows[i]`` (a gather:
    both axes indexed by arrays, the form Pallas' interpret mode also runs); masked rows read as zero."""
    k0 = pl.multiple_of(k_i * block_k, block_k)
    if x_rows is None:
        return plgpu.load(x_ref.at[pl.ds(row0, block_m), pl.ds(k0, block_k)], mask=mask, other=0.0)
    cols = k0 + jnp.arange(block_k, dtype=jnp.int32)
    return plgpu.load(x_ref.at[x_rows[:, None], cols[None, :]], mask=mask, other=0.0)


def _gmm_kernel(group_ref, row0_ref, row1_ref, *refs, k: int, cfg: Config, trans_w: bool, gather: bool,
                epilogue: str | None, gathered_out: bool):
    if gather:
        idx_ref, *refs = refs
    x_ref, w_ref, *refs = refs
    if epilogue == "swiglu_bwd":
        h_ref, *refs = refs
    n_i, t = pl.program_id(0), pl.program_id(1)
    row0, row1 = row0_ref[t], row1_ref[t]

    @pl.when(row1 > row0)
    def _():
        g = group_ref[t]
        rows = row0 + jnp.arange(cfg.block_m, dtype=jnp.int32)
        valid = rows < row1
        row_mask = valid[:, None]
        a_mask = jnp.broadcast_to(row_mask, (cfg.block_m, cfg.block_k))
        n0 = pl.multiple_of(n_i * cfg.block_n, cfg.block_n)
        n_slice = pl.ds(n0, cfg.block_n)
        if epilogue is not None:  # the up half's columns: w (swiglu) / h (swiglu_bwd) hold [gate | up]
            up_slice = pl.ds((w_ref.shape[2] if epilogue == "swiglu" else h_ref.shape[1]) // 2 + n0, cfg.block_n)
        x_rows = plgpu.load(idx_ref.at[pl.ds(row0, cfg.block_m)], mask=valid, other=0) if gather else None
        out_rows = pl.ds(row0, cfg.block_m)
        if gathered_out:  # the first column block's program also writes the tile's gathered rows x[rows]
            xg_ref = refs[-1]

            @pl.when(n_i == 0)
            def _():
                def copy(k_i, carry):
                    a = _load_rows(x_ref, x_rows, row0, k_i, cfg.block_m, cfg.block_k, a_mask)
                    k_slice = pl.ds(pl.multiple_of(k_i * cfg.block_k, cfg.block_k), cfg.block_k)
                    plgpu.store(xg_ref.at[out_rows, k_slice], a, mask=a_mask)
                    return carry

                jax.lax.fori_loop(0, k // cfg.block_k, copy, 0)

        def body(k_i, accs):
            k_slice = pl.ds(pl.multiple_of(k_i * cfg.block_k, cfg.block_k), cfg.block_k)
            a = _load_rows(x_ref, x_rows, row0, k_i, cfg.block_m, cfg.block_k, a_mask)
            if trans_w:  # w [G, N, K]: the tile [block_n, block_k], contracted on its second axis
                return (accs[0] + plgpu.dot(a, plgpu.load(w_ref.at[g, n_slice, k_slice]), trans_b=True),)
            out = (accs[0] + plgpu.dot(a, plgpu.load(w_ref.at[g, k_slice, n_slice])),)
            if epilogue == "swiglu":
                out += (accs[1] + plgpu.dot(a, plgpu.load(w_ref.at[g, k_slice, up_slice])),)
            return out

        zeros = jnp.zeros((cfg.block_m, cfg.block_n), jnp.float32)
        accs = jax.lax.fori_loop(0, k // cfg.block_k, body, (zeros, zeros) if epilogue == "swiglu" else (zeros,))
        o_mask = jnp.broadcast_to(row_mask, (cfg.block_m, cfg.block_n))
        if epilogue is None:
            plgpu.store(refs[0].at[out_rows, n_slice], accs[0].astype(refs[0].dtype), mask=o_mask)
        elif epilogue == "swiglu":  # h = [gate | up] and act = silu(gate) * up, from h's rounded values
            h_out, act_out = refs[:2]
            gate, up = (a.astype(h_out.dtype) for a in accs)
            plgpu.store(h_out.at[out_rows, n_slice], gate, mask=o_mask)
            plgpu.store(h_out.at[out_rows, up_slice], up, mask=o_mask)
            plgpu.store(act_out.at[out_rows, n_slice], _swiglu(gate, up).astype(act_out.dtype), mask=o_mask)
        else:  # swiglu_bwd: accs[0] is d(act); d(h) = [d(gate) | d(up)]
            dh_out = refs[0]
            gate = plgpu.load(h_ref.at[out_rows, n_slice], mask=o_mask, other=0.0)
            up = plgpu.load(h_ref.at[out_rows, up_slice], mask=o_mask, other=0.0)
            dgate, dup = _swiglu_bwd(gate, up, accs[0].astype(h_ref.dtype))
            plgpu.store(dh_out.at[out_rows, n_slice], dgate.astype(dh_out.dtype), mask=o_mask)
            plgpu.store(dh_out.at[out_rows, up_slice], dup.astype(dh_out.dtype), mask=o_mask)


def _swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up in float32 (as ``parallelism.permute.swiglu``)."""
    g = gate.astype(jnp.float32)
    return g * jax.nn.sigmoid(g) * up.astype(jnp.float32)


def _swiglu_bwd(gate: jax.Array, up: jax.Array, dact: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(d gate, d up) of :func:`_swiglu` for the cotangent ``dact``, in float32."""
    g, u, d = gate.astype(jnp.float32), up.astype(jnp.float32), dact.astype(jnp.float32)
    s = jax.nn.sigmoid(g)
    return d * u * s * (1.0 + g * (1.0 - s)), d * g * s


def gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, trans_w: bool = False, rows: jax.Array | None = None,
        gathered_out: bool = False, epilogue: str | None = None, h: jax.Array | None = None,
        config: Config | None = None, interpret: bool | None = None) -> jax.Array | tuple[jax.Array, ...]:
    """``x [M, K]`` rows sorted by group; ``w [G, K, N]`` (``[G, N, K]`` with ``trans_w``) -> ``[M, N]``.
    Rows past ``sum(group_sizes)`` are left unwritten.

    ``rows`` (int32 ``[M]``): row ``m`` of the product is ``x[rows[m]] @ w[g(m)]``, the rows of ``x [T, K]`` read
    through the index inside the kernel (a gather fused into the loads; ``x[rows]`` is never built); with
    ``gathered_out`` the kernel also returns ``x[rows] [M, K]`` (last), written by the first column block's programs
    (rows past ``sum(group_sizes)`` unwritten).
    ``epilogue``: ``"swiglu"`` (forward, w ``[G, K, 2I]`` = [gate | up]): returns ``(h [M, 2I], act [M, I])``,
    ``act = silu(gate) * up`` in float32 from h's rounded values; ``"swiglu_bwd"`` (``trans_w``, w ``[G, I, K]``,
    ``h [M, 2I]`` the forward's): the product is d(act), and the kernel returns ``d(h) [M, 2I]`` = [d(gate) | d(up)]
    of ``act = swiglu(h)`` instead. Both tile the I columns with ``block_n`` halved (two tiles of h per program)."""
    m = rows.shape[0] if rows is not None else x.shape[0]
    k = x.shape[1]
    n = w.shape[1] if trans_w else w.shape[2]
    cfg = config or config_for("dx" if trans_w else "fwd", k, n)
    if (w.shape[2] if trans_w else w.shape[1]) != k:
        raise ValueError(f"gmm: x {x.shape} and w {w.shape} (trans_w={trans_w}) do not contract")
    if epilogue not in (None, "swiglu", "swiglu_bwd") or (epilogue == "swiglu_bwd") != (trans_w and h is not None):
        raise ValueError(f"gmm: epilogue {epilogue!r} (trans_w={trans_w}, h given: {h is not None})")
    interpret = _on_cpu() if interpret is None else interpret
    tile_n = n // 2 if epilogue == "swiglu" else n  # the columns one program's tiles cover
    if epilogue is not None:
        cfg = dataclasses.replace(cfg, block_n=max(cfg.block_n // 2, 1))
    cfg = _fit(cfg, k, tile_n, "gmm", interpret)
    out_n = 2 * n if epilogue == "swiglu_bwd" else n
    _check_size("gmm", x, w, jax.ShapeDtypeStruct((m, out_n), x.dtype))
    group, row0, row1 = tile_table(group_sizes, m, cfg.block_m)
    if gathered_out and rows is None:
        raise ValueError("gmm: gathered_out needs rows")
    kernel = functools.partial(_gmm_kernel, k=k, cfg=cfg, trans_w=trans_w, gather=rows is not None, epilogue=epilogue,
                               gathered_out=gathered_out)
    out_shape = (jax.ShapeDtypeStruct((m, out_n), x.dtype),)
    if epilogue == "swiglu":
        out_shape += (jax.ShapeDtypeStruct((m, n // 2), x.dtype),)
    if gathered_out:
        out_shape += (jax.ShapeDtypeStruct((m, k), x.dtype),)
    out_shape = out_shape[0] if len(out_shape) == 1 else out_shape
    operands = (group, row0, row1) + ((rows.astype(jnp.int32),) if rows is not None else ()) + (x, w)
    return pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(tile_n // cfg.block_n, group.shape[0]),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=("gmm_trans" if trans_w else "gmm") + ("_gather" if rows is not None else "")
        + (f"_{epilogue}" if epilogue else ""),
    )(*operands, *((h,) if epilogue == "swiglu_bwd" else ()))


def _tgmm_kernel(start_ref, size_ref, *refs, cfg: Config, gather: bool):
    if gather:
        idx_ref, *refs = refs
    x_ref, dy_ref, o_ref = refs
    n_i, k_i, g = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, size = start_ref[g], size_ref[g]
    k_slice = pl.ds(pl.multiple_of(k_i * cfg.block_k, cfg.block_k), cfg.block_k)
    n_slice = pl.ds(pl.multiple_of(n_i * cfg.block_n, cfg.block_n), cfg.block_n)

    def body(j, acc):
        row0 = start + j * cfg.block_m
        valid = (row0 + jnp.arange(cfg.block_m, dtype=jnp.int32)) < start + size
        mask = valid[:, None]
        x_rows = plgpu.load(idx_ref.at[pl.ds(row0, cfg.block_m)], mask=valid, other=0) if gather else None
        a = _load_rows(x_ref, x_rows, row0, k_i, cfg.block_m, cfg.block_k,
                       jnp.broadcast_to(mask, (cfg.block_m, cfg.block_k)))
        b = plgpu.load(dy_ref.at[pl.ds(row0, cfg.block_m), n_slice], other=0.0,
                       mask=jnp.broadcast_to(mask, (cfg.block_m, cfg.block_n)))
        return acc + plgpu.dot(a, b, trans_a=True)

    acc = jax.lax.fori_loop(0, (size + cfg.block_m - 1) // cfg.block_m, body,
                            jnp.zeros((cfg.block_k, cfg.block_n), jnp.float32))
    o_ref[g, k_slice, n_slice] = acc.astype(o_ref.dtype)


def tgmm(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, *, rows: jax.Array | None = None,
         config: Config | None = None, out_dtype=None, interpret: bool | None = None) -> jax.Array:
    """``x [M, K]``, ``dy [M, N]`` rows sorted by group -> ``[G, K, N]``: per group, the sum over its rows
    of ``x^T dy`` (zero for empty groups; rows past ``sum(group_sizes)`` are not read). ``rows`` (int32
    ``[M]``): row ``m`` is ``x[rows[m]]`` of ``x [T, K]``, read through the index inside the kernel (as :func:`gmm`)."""
    m, n = dy.shape
    k = x.shape[1]
    cfg = config or config_for("dw", k, n)
    if (rows.shape[0] if rows is not None else x.shape[0]) != m:
        raise ValueError(f"tgmm: x {x.shape} (rows {None if rows is None else rows.shape}) and dy {dy.shape} "
                         f"need the same rows")
    interpret = _on_cpu() if interpret is None else interpret
    cfg = _fit(cfg, k, n, "tgmm", interpret)
    _check_size("tgmm", x, dy, jax.ShapeDtypeStruct((group_sizes.shape[0], k, n), x.dtype))
    g = group_sizes.shape[0]
    sizes = group_sizes.astype(jnp.int32)
    starts = (jnp.cumsum(sizes) - sizes).astype(jnp.int32)
    operands = (starts, sizes) + ((rows.astype(jnp.int32),) if rows is not None else ()) + (x, dy)
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, cfg=cfg, gather=rows is not None),
        out_shape=jax.ShapeDtypeStruct((g, k, n), out_dtype or x.dtype),
        grid=(n // cfg.block_n, k // cfg.block_k, g),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name="tgmm_gather" if rows is not None else "tgmm",
    )(*operands)
