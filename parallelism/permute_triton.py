"""The experts' row movement as Pallas-Triton kernels (GPU; on CPU they run in Pallas' interpret mode for tests):
the dispatch into the expert-sorted layout and the combine's backward, both walking the assignments in token order.

Vocabulary as in ``parallelism.permute``: ``A = T * K`` assignments, assignment ``a`` is token ``a // K``'s choice,
``slot [A]`` the row of the expert-side buffer ``[S, H]`` it occupies (-1: dropped or padding).

- :func:`dispatch`: ``rows[slot[a]] = x[a // K]``. XLA gathers the rows through the inverse map (``src``), reading
  the token rows in the experts' order, ~2.8 TB/s on an H200 (0.77 ms at the 235B-A22B layer's 131,072 rows of
  4,096: bench/results/moe_layer.md). The kernel reads each token row once, contiguously, and scatters it to its K
  slots (unique: no atomics).
- :func:`combine_bwd`: for ``out[t] = sum_k w[t, k] * y[slot[t*K + k]]`` (``permute.combine_rows``) and the
  cotangent ``g [T, H]``, ``dy[slot[a]] = w[a] * g[a // K]`` and ``dw[a] = <y[slot[a]], g[a // K]>``. XLA runs a
  gather of g's rows and a reduction over gathered rows of y; the kernel reads g and y once and writes dy once.

A program takes ``block_a`` consecutive assignments (a token's K assignments read the same row of x or g, from cache)
and moves ``block_h`` columns a step. Rows of the buffer that no assignment maps to (in the expert-sorted layout the
rows past ``sum(group_sizes)``) are left unwritten: for callers that read none of them (the Triton / Mosaic expert
kernels read no row past ``sum(group_sizes)``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from moevlm_jax.parallelism import gmm_triton


@dataclasses.dataclass(frozen=True)
class Config:
    """Assignments per program, columns per step, Triton launch parameters."""

    block_a: int = 32
    block_h: int = 256
    num_warps: int = 4
    num_stages: int = 2


# Per kernel, the fastest of 8 configs timed on an H200 at 131,072 assignments of 4,096 and of 2,048 columns
# (combine_bwd; dispatch within 3% of the fastest, the config the layer and the step are measured with:
# bench/results/moe_layer.md)
CONFIGS: dict[str, Config] = {"dispatch": Config(32, 256, 4, 2), "combine_bwd": Config(8, 1024, 4, 2)}


def _assignments(slot_ref, k: int, n_assign: int, cfg: Config, buffer_rows: int):
    """This program's assignments: (in range [block_a], buffer rows [block_a, 1], token rows [block_a, 1], the
    [block_a, block_h] mask of the mapped ones). Unmapped lanes point past the buffer (``buffer_rows``), not at a row
    another lane writes: Pallas' interpret mode stores a masked lane by writing back the old value, and two lanes on
    one row would race."""
    a0 = pl.program_id(0) * cfg.block_a
    a = a0 + jnp.arange(cfg.block_a, dtype=jnp.int32)
    in_range = a < n_assign
    slot = plgpu.load(slot_ref.at[pl.ds(a0, cfg.block_a)], mask=in_range, other=-1)
    valid = slot >= 0
    rows = jnp.where(valid, slot, buffer_rows)[:, None]
    token = jnp.where(in_range, a // k, 0)[:, None]
    return in_range, rows, token, jnp.broadcast_to(valid[:, None], (cfg.block_a, cfg.block_h))


def _columns(j, cfg: Config) -> jax.Array:
    return (j * cfg.block_h + jnp.arange(cfg.block_h, dtype=jnp.int32))[None, :]


def _dispatch_kernel(slot_ref, x_ref, out_ref, *, k: int, n_assign: int, cfg: Config):
    _, rows, token, mask = _assignments(slot_ref, k, n_assign, cfg, out_ref.shape[0])

    def body(j, carry):
        cols = _columns(j, cfg)
        plgpu.store(out_ref.at[rows, cols], plgpu.load(x_ref.at[token, cols], mask=mask, other=0.0), mask=mask)
        return carry

    jax.lax.fori_loop(0, x_ref.shape[1] // cfg.block_h, body, 0)


def _combine_bwd_kernel(slot_ref, w_ref, g_ref, y_ref, dy_ref, dw_ref, *, k: int, n_assign: int, cfg: Config):
    in_range, rows, token, g_mask = _assignments(slot_ref, k, n_assign, cfg, dy_ref.shape[0])
    a0 = pl.program_id(0) * cfg.block_a
    w = plgpu.load(w_ref.at[pl.ds(a0, cfg.block_a)], mask=in_range, other=0.0).astype(jnp.float32)[:, None]

    def body(j, acc):
        cols = _columns(j, cfg)
        g = plgpu.load(g_ref.at[token, cols], mask=g_mask, other=0.0).astype(jnp.float32)
        y = plgpu.load(y_ref.at[rows, cols], mask=g_mask, other=0.0).astype(jnp.float32)
        plgpu.store(dy_ref.at[rows, cols], (g * w).astype(dy_ref.dtype), mask=g_mask)
        return acc + jnp.sum(y * g, axis=1)

    acc = jax.lax.fori_loop(0, g_ref.shape[1] // cfg.block_h, body, jnp.zeros((cfg.block_a,), jnp.float32))
    plgpu.store(dw_ref.at[pl.ds(a0, cfg.block_a)], acc.astype(dw_ref.dtype), mask=in_range)


def _fit(cfg: Config | None, h: int, what: str, interpret: bool) -> Config:
    cfg = cfg or CONFIGS[what]
    block_h = gmm_triton.fit_block(cfg.block_h, h)
    if not interpret and block_h < 16:
        raise ValueError(f"{what}: hidden size {h} needs a power-of-two divisor >= 16 for the Triton kernel")
    return dataclasses.replace(cfg, block_h=block_h)


def _call(kernel, what: str, out_shape, n_assign: int, cfg: Config, interpret: bool, **kw):
    return pl.pallas_call(
        functools.partial(kernel, n_assign=n_assign, cfg=cfg, **kw),
        out_shape=out_shape,
        grid=(pl.cdiv(n_assign, cfg.block_a),),
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=what,
    )


def dispatch(x: jax.Array, slot: jax.Array, top_k: int, rows: int, *, config: Config | None = None,
             interpret: bool | None = None) -> jax.Array:
    """``x [T, H]`` -> ``[rows, H]`` with row ``slot[a]`` = ``x[a // top_k]`` (``slot [T*top_k]``, -1: none; rows
    no assignment maps to unwritten)."""
    t, h = x.shape
    if slot.shape != (t * top_k,):
        raise ValueError(f"dispatch: x {x.shape}, slot {slot.shape}, top_k {top_k}")
    interpret = gmm_triton._on_cpu() if interpret is None else interpret
    cfg = _fit(config, h, "dispatch", interpret)
    out = jax.ShapeDtypeStruct((rows, h), x.dtype)
    gmm_triton._check_size("dispatch", x, out)
    return _call(_dispatch_kernel, "dispatch", out, t * top_k, cfg, interpret, k=top_k)(slot.astype(jnp.int32), x)


def combine_bwd(y: jax.Array, weights: jax.Array, slot: jax.Array, g: jax.Array, *, config: Config | None = None,
                interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """``(dy [S, H], dweights [T, K])`` of ``combine_rows(y [S, H], weights [T, K], slot [T*K])`` for the cotangent
    ``g [T, H]``: ``dy`` in y's dtype from ``w * g`` in float32 (rows no assignment maps to unwritten), ``dweights``
    in the weights' dtype from a float32 sum."""
    t, k = weights.shape
    s, h = y.shape
    if g.shape != (t, h) or slot.shape != (t * k,):
        raise ValueError(f"combine_bwd: y {y.shape}, weights {weights.shape}, slot {slot.shape}, g {g.shape}")
    interpret = gmm_triton._on_cpu() if interpret is None else interpret
    cfg = _fit(config, h, "combine_bwd", interpret)
    gmm_triton._check_size("combine_bwd", y, g)
    n_assign = t * k
    out_shape = (jax.ShapeDtypeStruct((s, h), y.dtype), jax.ShapeDtypeStruct((n_assign,), weights.dtype))
    dy, dw = _call(_combine_bwd_kernel, "combine_bwd", out_shape, n_assign, cfg, interpret, k=k)(
        slot.astype(jnp.int32), weights.reshape(-1), g.astype(y.dtype), y)
    return dy, dw.reshape(t, k)
