"""The chunked gated delta rule (Qwen3.5-MoE's Gated DeltaNet core) with the chunk preparation (where the rule is
not differentiated) and the sequential part as Pallas-Triton kernels (GPU; on CPU they run in Pallas' interpret
mode for tests), forward and backward under one ``jax.custom_vjp``. The math, HF's conventions and the packed-row
semantics are those of ``moevlm_jax.model.gated_deltanet`` (its module docstring), whose einsum form is the
reference and the CPU path.

Per value head, chunks of C tokens, ``gc`` the log decay summed from the chunk start (inclusive), the state
``S [Dk, Dv]`` float32::

    T = I + strictly_lower(beta_i k_i.k_j exp(gc_i - gc_j))           (the UT transform; T^-1 by block inversion)
    w = T^-1 (beta k exp(gc)),  u = T^-1 (beta v)                        [C, Dk], [C, Dv]
    v_new = u - w S
    o     = (q exp(gc)) S + (q k^T * exp(gc_i - gc_j), i >= j) v_new
    S     = exp(gc_C) S + (k exp(gc_C - gc))^T v_new

The decomposition (flash-linear-attention's): everything within a chunk depends on the chunk's own tokens only
and runs for all chunks at once; only the state recurrence is sequential. So:

- :func:`_prep_kernel` (Pallas, the undifferentiated forward's: evaluation, generation; one program per (chunk,
  value head)): the q/k L2 norm, the gates (``e = exp(gc)``, ``f = exp(gc_C - gc)``), the causal decayed
  ``A = q k^T * exp(gc_i - gc_j)``, the ``[C, C]``
  UT matrix and its unit lower inverse on chip (:func:`ut_inverse`: the 16-row diagonal blocks by forward
  substitution, the rest by a block series of whole-tile matmuls, float32), ``w`` and ``u``. q / k are read by
  key head (``h // (Hv / Hk)``, HF's ``repeat_interleave``), so repeated q / k never exist; the packed-row masks
  are applied here. XLA forms only the per-token inputs (the chunk-local cumulative log decay ``gc``, beta, the
  chunk decay ``cd``: :func:`_gate_inputs`).
- :func:`_prepare` (XLA, batched over all chunks, training's: its forward and the backward's re-run are one
  program, which XLA computes once; the kernel in training's forward measured slower): the same inputs in
  float32 (the UT inverse by :func:`unit_lower_inverse`: log2(C) levels of batched matmuls, a closed-form
  backward), differentiated by ``jax.vjp``. The q.k and k.k products are formed per *key* head and broadcast over
  its value heads.
- :func:`_fwd_kernel` (Pallas): one program per (value head, Dv block) walks the chunks in order with its
  ``[Dk, BV]`` float32 state tile in registers: ``v_new = u - w S``, the chunk's output ``(q e) S + A v_new`` and
  the next state, four tile matmuls a chunk and no HBM round trip of the state between chunks (``lax.scan``
  writes and reads it every chunk). The key head of value head ``h`` is ``h // (Hv / Hk)``, read by index.
- The backward recomputes (residuals are the inputs only, O(S x D) a layer, never the O(S x C) chunk factors):
  :func:`_prepare` under ``jax.vjp``, the chunk-start states and ``v_new`` (the forward kernel in its
  ``states`` mode), then :func:`_bwd_kernel` walks the chunks in reverse carrying ``dS`` (``dv_new = A^T do +
  (k f) dS``, ``dS <- cd dS + (q e)^T do - w^T dv_new``), storing ``dv_new`` and each chunk's end-state gradient.
  The gradients of the kernel inputs need no recurrence given those and are batched matmuls over all chunks
  (:func:`_chunk_grads`, XLA); the pullback of :func:`_prepare` takes them to q, k, v, g, beta.

Packed rows: ``segment_ids`` become a run index per token (+1 at every id change); a token receives the state
carried into its chunk only if it is in the run of the token before the chunk (``e``), its update reaches the
chunk's end only if it is in the chunk's last run (``f``), the carried state survives the chunk only if no run
starts in it (``cd``), and ``A`` and the UT matrix pair tokens of one run: the masks of the reference. Padding
(id 0) tokens have zero inputs and no decay.

Numerics: the state, the gates, the UT matrix and its inverse and every accumulation are float32; the matmul
operands of q, k, w, u, A, the state tile and v_new are in the input dtype (bf16 in training, as
flash-linear-attention's kernels); float32 inputs keep everything float32 (the tests). Triton's constraints hold
by construction: every block (C, Dk, BV) a power of two >= 16, both operands of a dot of one dtype, no slicing of
register values.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles and Triton launch parameters of the two recurrence kernels."""

    block_v: int | None = None  # value columns per program (None: 64, halved while the grid is under 256 programs)
    num_warps: int = 4  # Triton launch: warps per program
    num_stages: int = 2  # Triton launch: software pipeline stages of the chunk loop
    bwd_num_warps: int | None = None  # the reverse kernel's warps (None: num_warps)
    # the forward's outputs in the recurrence kernel (True) or, from the chunk-start states it stores, batched over
    # all chunks in XLA (False: a shorter sequential loop, for few long rows)
    fused_output: bool = True
    prep_num_warps: int = 4  # the preparation kernel's warps


DEFAULT_CONFIG = Config()
_MAX_ELEMENTS = 2**31 - 1  # the kernels' offsets are 32-bit
MIN_PROGRAMS = 256  # the automatic block_v keeps at least this many programs (an H100 has 132 SMs) down to 16 columns


def _on_cpu() -> bool:
    return jax.default_backend() == "cpu"


def _power_of_two(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def supported(dk: int, dv: int, chunk_size: int) -> str | None:
    """None if the kernels take head dims ``dk`` / ``dv`` and ``chunk_size``, else why not."""
    for name, n in (("key head dim", dk), ("value head dim", dv), ("chunk size", chunk_size)):
        if not _power_of_two(n) or n < 16:
            return f"{name} {n} is not a power of two >= 16 (Triton's block and dot sizes)"
    return None


def block_v(config: Config, programs_per_block: int, dv: int) -> int:
    """The value-column block of ``config`` for ``programs_per_block`` (batch x value heads) programs per block."""
    if config.block_v is not None:
        if not _power_of_two(config.block_v) or config.block_v < 16 or dv % config.block_v:
            raise ValueError(f"gdn_triton: block_v {config.block_v} must be a power of two >= 16 dividing Dv={dv}")
        return config.block_v
    bv = min(64, dv)
    while bv > 16 and programs_per_block * (dv // bv) < MIN_PROGRAMS:
        bv //= 2
    return bv


# ----------------------------------------------------------------------------- the UT inverse (XLA)

def unit_lower_inverse(lower: jax.Array, precision: jax.lax.PrecisionLike = None) -> jax.Array:
    """lower [..., C, C] strictly lower triangular -> (I + lower)^-1 [..., C, C] by recursive 2x2 block
    inversion ([[A, 0], [X, D]]^-1 = [[A^-1, 0], [-D^-1 X A^-1, D^-1]]): log2(C) levels of batched
    matmuls, as accurate as a triangular solve (a Neumann/doubling product is not, for correlated keys).
    Only the strictly lower entries are read."""
    c = lower.shape[-1]
    n = 1 << max(0, (c - 1).bit_length())  # next power of two: pad with an identity block
    if n != c:
        lower = jnp.pad(lower, [(0, 0)] * (lower.ndim - 2) + [(0, n - c), (0, n - c)])
    batch = lower.shape[:-2]
    blocks = jnp.ones(batch + (n, 1, 1), lower.dtype)  # the diagonal blocks of the inverse, size s
    s = 1
    while s < n:
        p = n // (2 * s)
        # the lower-left s x s block of each diagonal 2s block: block (2i+1, 2i) of the s-blocked matrix,
        # taken by a strided slice over the flattened (row block, column block) pairs (no gather)
        x = lower.reshape(batch + (p, 2, s, p, 2, s))[..., :, 1, :, :, 0, :]  # [..., p, s, p, s]
        x = jnp.swapaxes(x, -3, -2).reshape(batch + (p * p, s, s))[..., ::p + 1, :, :]  # [..., p, s, s]
        pair = blocks.reshape(batch + (p, 2, s, s))
        a_inv, d_inv = pair[..., 0, :, :], pair[..., 1, :, :]
        x = -jnp.einsum("...ij,...jk,...kl->...il", d_inv, x, a_inv, precision=precision)
        blocks = jnp.concatenate([jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], -1),
                                  jnp.concatenate([x, d_inv], -1)], -2)
        s *= 2
    return blocks[..., 0, :c, :c]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _inverse(lower: jax.Array, precision) -> jax.Array:
    """:func:`unit_lower_inverse` with its closed-form backward: for ``Ti = (I + L)^-1``,
    ``d L = -strictly_lower(Ti^T dTi Ti^T)`` (two batched matmuls, not the recursion's transpose)."""
    return unit_lower_inverse(lower, precision)


def _inverse_fwd(lower, precision):
    inv = unit_lower_inverse(lower, precision)
    return inv, inv


def _inverse_bwd(precision, inv, d_inv):
    c = inv.shape[-1]
    d = -jnp.einsum("...ji,...jk,...lk->...il", inv, d_inv, inv, precision=precision)
    return (jnp.where(jnp.tril(jnp.ones((c, c), bool), -1), d, 0.0),)


_inverse.defvjp(_inverse_fwd, _inverse_bwd)


# ----------------------------------------------------------------------------- intra-chunk preparation (XLA)

class _Static(NamedTuple):
    """The static options of one call."""

    chunk: int
    scale: float
    use_qk_l2norm: bool
    precision: Any
    dtype: Any  # the kernels' matmul operand dtype (the input dtype)
    config: Config
    interpret: bool


def l2norm(x: jax.Array, axis: int = -1, eps: float = 1e-6) -> jax.Array:
    """x [..., D] -> x * rsqrt(sum(x^2, axis) + eps), as HF's (FLA's) l2norm, in x's dtype."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=True) + eps)


def segment_runs(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """segment_ids [B, S] -> (run index [B, S] int32: 0 for the row's first segment, +1 at every id
    change; valid [B, S] bool: id != 0)."""
    seg = segment_ids.astype(jnp.int32)
    change = jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return jnp.cumsum(change, axis=1, dtype=jnp.int32), seg != 0


def _runs(segment_ids: jax.Array | None, b: int, s: int, t: int) -> tuple[jax.Array, jax.Array | None]:
    """segment_ids [B, S] -> (run index [B, T] int32 (:func:`segment_runs`), the tail past S in the last run;
    valid [B, S] bool, None without segment ids)."""
    if segment_ids is None:
        return jnp.zeros((b, t), jnp.int32), None
    runs, valid = segment_runs(segment_ids)
    return jnp.pad(runs, ((0, 0), (0, t - s)), mode="edge"), valid


class Prepared(NamedTuple):
    """The recurrence kernels' inputs (:func:`_prepare_kernel`: the matmul operands in the input dtype, the gates
    float32); T = S padded to whole chunks, N = T / C."""

    q: jax.Array  # [B, Hk, T, Dk] L2-normed (if asked), scaled
    k: jax.Array  # [B, Hk, T, Dk] L2-normed (if asked)
    w: jax.Array  # [B, Hv, T, Dk] T^-1 (beta k exp(gc)), masked to the carried run
    u: jax.Array  # [B, Hv, T, Dv] T^-1 (beta v)
    a: jax.Array  # [B, Hv, T, C] row t: q_t.k_j exp(gc_t - gc_j) for j <= t in t's run and chunk (else 0)
    e: jax.Array  # [B, Hv, T] exp(gc) where the carried state reaches the token, else 0
    f: jax.Array  # [B, Hv, T] exp(gc_C - gc) where the token's update reaches the chunk's end, else 0
    cd: jax.Array  # [B, Hv, N] the carried state's decay over the chunk (0 where a new run starts in it)


def _run_before(rc: jax.Array) -> jax.Array:
    """Runs by chunk [..., N, C] -> the run of the token before each chunk [..., N, 1] (the first chunk: its own
    first token's): the carried state reaches a token of its run."""
    return jnp.concatenate([rc[..., :1, :1], rc[..., :-1, -1:]], axis=-2)


def _gates(gc: jax.Array, runs: jax.Array, hk: int) -> tuple[jax.Array, ...]:
    """gc [B, Hv, N, C] float32, runs [B, T] -> per value head, grouped [B, Hk, r, N, ...]: e = exp(gc) where the
    carried state reaches the token [.., C], f = exp(gc_C - gc) where the token's update reaches the chunk end
    [.., C], cd = the carried state's decay over the chunk (0 across a boundary) [..], decay = exp(gc_i - gc_j)
    for i >= j within a run [.., C, C]: the masks of the reference."""
    b, hv, n, c = gc.shape
    rc = runs.reshape(b, 1, 1, n, c)
    prev = _run_before(rc)
    carry, last = rc == prev, rc == rc[..., -1:]
    g = gc.reshape(b, hk, hv // hk, n, c)
    glast = g[..., -1:]
    e = jnp.exp(jnp.where(carry, g, -jnp.inf))
    f = jnp.exp(jnp.where(last, glast - g, -jnp.inf))
    cd = jnp.exp(jnp.where(carry[..., -1], glast[..., 0], -jnp.inf))
    pair = jnp.tril(jnp.ones((c, c), bool)) & (rc[..., :, None] == rc[..., None, :])
    decay = jnp.exp(jnp.where(pair, g[..., :, None] - g[..., None, :], -jnp.inf))
    return e, f, cd, decay


def _prepare(q, k, v, g, beta, runs, valid, st: _Static) -> Prepared:
    """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g, beta [B, S, Hv], runs [B, T], valid [B, S] -> the kernels'
    float32 inputs, all chunks at once; q.k^T and k.k^T per key head, broadcast over its value heads."""
    b, s, hk, dk = q.shape
    hv, dv = v.shape[2:]
    r, c, t = hv // hk, st.chunk, runs.shape[1]
    n = t // c
    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if valid is not None:  # padding: no input (and no NaN from whatever it holds), no decay, no update
        q, k, v = (jnp.where(valid[:, :, None, None], x, 0.0) for x in (q, k, v))
        g, beta = (jnp.where(valid[:, :, None], x, 0.0) for x in (g, beta))
    if st.use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * st.scale
    heads = lambda x: jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0), (0, 0), (0, t - s)) + ((0, 0),) * (x.ndim - 3))
    q, k, v, g, beta = (heads(x) for x in (q, k, v, g, beta))  # [B, H, T, (D)]
    gc = jnp.cumsum(g.reshape(b, hv, n, c), axis=-1)
    e, f, cd, decay = _gates(gc, runs, hk)
    qc, kc = q.reshape(b, hk, n, c, dk), k.reshape(b, hk, n, c, dk)
    bc = beta.reshape(b, hk, r, n, c)
    ein = functools.partial(jnp.einsum, precision=st.precision)
    kk = ein("bhnid,bhnjd->bhnij", kc, kc)[:, :, None]  # per key head
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    t_inv = _inverse(jnp.where(strict, bc[..., :, None] * kk * decay, 0.0), st.precision)
    w = ein("bhrnij,bhnjd->bhrnid", t_inv * (bc * e)[..., None, :], kc)  # T^-1 diag(beta exp(gc)) k
    u = ein("bhrnij,bhrnjd->bhrnid", t_inv * bc[..., None, :], v.reshape(b, hk, r, n, c, dv))
    a = ein("bhnid,bhnjd->bhnij", qc, kc)[:, :, None] * decay
    per_token = lambda x: x.reshape(b, hv, t, *x.shape[5:])
    return Prepared(q, k, per_token(w), per_token(u), per_token(a), per_token(e), per_token(f), cd.reshape(b, hv, n))


# ----------------------------------------------------------------------------- intra-chunk preparation (Pallas)

_SUB = 16  # the UT inverse's diagonal blocks (Triton's smallest dot)


def _decay(gc, run):
    """gc, run [C] -> [C, C]: exp(gc_i - gc_j) where i >= j and tokens i, j are in one run, else 0."""
    c = gc.shape[0]
    row, col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0), jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    return jnp.exp(jnp.where((run[:, None] == run[None, :]) & (row >= col), gc[:, None] - gc[None, :], -jnp.inf))


def _block_diagonal_inverse(lower, sub: int):
    """lower [C, C] float32 strictly lower triangular -> (the inverse of I + its block-diagonal part (``sub``-row
    diagonal blocks), the rest of ``lower``): all blocks at once by forward substitution, step r forming row r
    of every block's inverse from the rows above it (masked reductions over the whole tile, no register
    slicing, which Triton lacks)."""
    c = lower.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    same = (row // sub) == (col // sub)
    diag = jnp.where(same, lower, 0.0)

    def body(r, x):
        at = (row % sub) == r
        lr = -jnp.sum(jnp.where(at, diag, 0.0), axis=0)  # column j: -(row r of j's block)[j]
        return jnp.where(at & same, (lr + jnp.sum(lr[:, None] * x, axis=0))[None, :], x)

    x = jax.lax.fori_loop(2, sub, body, -diag) if sub > 2 else -diag
    return x + jnp.where(row == col, 1.0, 0.0), jnp.where(same, 0.0, lower)


def ut_inverse(lower, exact=None, sub: int = _SUB):
    """lower [C, C] float32 strictly lower triangular -> (I + lower)^-1, as the preparation kernels form it on
    chip: the ``sub``-row diagonal blocks ``Xd`` by :func:`_block_diagonal_inverse`, the rest by the
    block-nilpotent series ``(I + L)^-1 = (I + N)^-1 Xd``, ``N = Xd L_off`` (``N^(C/sub) = 0``, so
    ``(I + N)^-1 = (I - N)(I + N^2)(I + N^4)...``): the products of block forward substitution, as whole-tile
    matmuls. ``exact``: the matmul (default: float32 ``plgpu.dot`` at HIGHEST)."""
    exact = exact or functools.partial(plgpu.dot, precision=jax.lax.Precision.HIGHEST)
    c = lower.shape[0]
    x, off = _block_diagonal_inverse(lower, min(sub, c))
    if c > sub:
        nil = exact(x, off)
        powers = [nil]
        while 2 ** len(powers) < c // sub:
            powers.append(exact(powers[-1], powers[-1]))
        for p in reversed(powers[1:]):  # right to left
            x = x + exact(p, x)
        x = x - exact(nil, x)
    return x


def _prep_kernel(q_ref, k_ref, v_ref, gc_ref, beta_ref, runs_ref, valid_ref, qo_ref, ko_ref, w_ref, u_ref,
                 a_ref, e_ref, f_ref, *, c: int, ratio: int, scale: float, use_qk_l2norm: bool, masked: bool,
                 exact):
    """One chunk of one value head, whole-chunk tiles: the L2-normed, scaled q / k (stored by the group's first
    value head), the gates e, f, the causal decayed ``A = q k^T``, the UT matrix ``L`` from one k k^T, its
    inverse X (:func:`ut_inverse`, float32), ``w = X (beta e k)``, ``u = X (beta v)``.
    The matmuls of q / k / w / u / A with operands of the output dtype, float32 accumulation."""
    n, bh = pl.program_id(0), pl.program_id(1)
    hv = gc_ref.shape[1]
    b, h = bh // hv, bh % hv
    hk = h // ratio
    dk, dv = q_ref.shape[-1], v_ref.shape[-1]
    dt, f32 = w_ref.dtype, jnp.float32
    keys, vals = pl.ds(0, dk), pl.ds(0, dv)
    start = pl.multiple_of(n * c, c)
    prev = runs_ref[b, jnp.maximum(start - 1, 0)]  # the run of the token before the chunk
    last = runs_ref[b, start + c - 1]
    glast = gc_ref[b, h, start + c - 1]
    tc = pl.ds(start, c)
    ok = plgpu.load(valid_ref.at[b, tc])[:, None] != 0 if masked else None

    def load(ref, head, cols):  # padding tokens: zero input (and no NaN from whatever they hold)
        x = plgpu.load(ref.at[b, tc, head, cols]).astype(f32)
        return jnp.where(ok, x, 0.0) if masked else x

    def normed(ref):
        x = load(ref, hk, keys)
        return x * jax.lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + 1e-6) if use_qk_l2norm else x

    gc, run, beta = plgpu.load(gc_ref.at[b, h, tc]), plgpu.load(runs_ref.at[b, tc]), plgpu.load(beta_ref.at[b, h, tc])
    e = jnp.where(run == prev, jnp.exp(gc), 0.0)
    plgpu.store(e_ref.at[b, h, tc], e)
    plgpu.store(f_ref.at[b, h, tc], jnp.where(run == last, jnp.exp(glast - gc), 0.0))
    k = normed(k_ref)
    kd = k.astype(dt)
    qd = (normed(q_ref) * scale).astype(dt)

    @pl.when(h % ratio == 0)
    def _():
        plgpu.store(qo_ref.at[b, hk, tc, keys], qd)
        plgpu.store(ko_ref.at[b, hk, tc, keys], kd)

    decay = _decay(gc, run)
    plgpu.store(a_ref.at[b, h, tc, pl.ds(0, c)], (plgpu.dot(qd, kd, trans_b=True) * decay).astype(dt))
    row = jax.lax.broadcasted_iota(jnp.int32, (c, c), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)
    lower = jnp.where(row > col, beta[:, None] * plgpu.dot(k, k, trans_b=True) * decay, 0.0)
    x = ut_inverse(lower, exact)
    xd = x.astype(dt)
    plgpu.store(w_ref.at[b, h, tc, keys], plgpu.dot(xd, (k * (beta * e)[:, None]).astype(dt)).astype(dt))
    plgpu.store(u_ref.at[b, h, tc, vals], plgpu.dot(xd, (load(v_ref, h, vals) * beta[:, None]).astype(dt)).astype(dt))


class _Gates(NamedTuple):
    """The per-token inputs of the preparation kernels, [B, Hv, T] float32 (padding: 0), and cd [B, Hv, N]."""

    gc: jax.Array  # the chunk-local cumulative log decay
    beta: jax.Array
    cd: jax.Array
    valid: jax.Array  # [B, T] int32 (zeros when there are no segment ids: unread)


def _pad_rows(x, t: int):
    return jnp.pad(x, ((0, 0), (0, t - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


def _gate_inputs(g, beta, runs, valid, st: _Static) -> _Gates:
    b, _, hv = g.shape
    c, t = st.chunk, runs.shape[1]
    n = t // c
    f32 = jnp.float32
    g, beta = g.astype(f32), beta.astype(f32)
    if valid is not None:
        g, beta = (jnp.where(valid[:, :, None], x, 0.0) for x in (g, beta))
    heads = lambda x: jnp.swapaxes(_pad_rows(x, t), 1, 2)  # [B, Hv, T]
    gc = jnp.cumsum(heads(g).reshape(b, hv, n, c), axis=-1)
    rc = runs.reshape(b, 1, n, c)
    prev = _run_before(rc)[..., 0]  # [B, 1, N]
    cd = jnp.exp(jnp.where(rc[..., -1] == prev, gc[..., -1], -jnp.inf))
    valid_t = jnp.zeros((b, t), jnp.int32) if valid is None else _pad_rows(valid.astype(jnp.int32), t)
    return _Gates(gc.reshape(b, hv, t), heads(beta), cd, valid_t)


def _exact_dot(st: _Static):
    """The UT inverse's float32 matmuls: three TF32 passes on the GPU (float32 accuracy on tensor cores)."""
    prec = jax.lax.Precision.HIGHEST if st.interpret else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return functools.partial(plgpu.dot, precision=prec)


def _prepare_kernel(q, k, v, g, beta, runs, valid, st: _Static) -> Prepared:
    """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g, beta [B, S, Hv], runs [B, T], valid [B, S] -> the recurrence
    kernels' inputs (:class:`Prepared`), the per-chunk work in :func:`_prep_kernel` (a program per (chunk, value
    head)), the per-token gate inputs in XLA (:func:`_gate_inputs`); q / k read by key head in their [B, S, H, D]
    layout: :func:`_prepare` cast by :func:`_kernel_inputs`, up to rounding (the forward's; the backward
    differentiates :func:`_prepare`)."""
    b, _, hk, dk = q.shape
    hv, dv = v.shape[2:]
    c, t = st.chunk, runs.shape[1]
    n = t // c
    f32 = jnp.float32
    gates = _gate_inputs(g, beta, runs, valid, st)
    kw = dict(c=c, ratio=hv // hk, scale=st.scale, use_qk_l2norm=st.use_qk_l2norm, masked=valid is not None)
    kernel = functools.partial(_prep_kernel, exact=_exact_dot(st), **kw)
    dt = st.dtype
    out_shape = (jax.ShapeDtypeStruct((b, hk, t, dk), dt), jax.ShapeDtypeStruct((b, hk, t, dk), dt),
                 jax.ShapeDtypeStruct((b, hv, t, dk), dt), jax.ShapeDtypeStruct((b, hv, t, dv), dt),
                 jax.ShapeDtypeStruct((b, hv, t, c), dt), jax.ShapeDtypeStruct((b, hv, t), f32),
                 jax.ShapeDtypeStruct((b, hv, t), f32))
    qo, ko, w, u, a, e, f = pl.pallas_call(
        kernel, out_shape=out_shape, grid=(n, b * hv), interpret=st.interpret, name="gdn_prepare",
        compiler_params=plgpu.CompilerParams(num_warps=st.config.prep_num_warps, num_stages=1),
    )(_pad_rows(q.astype(dt), t), _pad_rows(k.astype(dt), t), _pad_rows(v.astype(dt), t), gates.gc, gates.beta, runs,
      gates.valid)
    return Prepared(qo, ko, w, u, a, e, f, gates.cd)


# ----------------------------------------------------------------------------- the recurrence kernels

def _program(w_ref, bv: int, ratio: int):
    """This program's (row, value head, key head, value-column slice)."""
    v_i, bh = pl.program_id(0), pl.program_id(1)
    hv = w_ref.shape[1]
    b, h = bh // hv, bh % hv
    return b, h, h // ratio, pl.ds(pl.multiple_of(v_i * bv, bv), bv)


def _fwd_kernel(q_ref, k_ref, w_ref, u_ref, a_ref, e_ref, f_ref, cd_ref, h0_ref, *out_refs, c: int, ratio: int,
                bv: int, states: bool):
    """Chunks in order, the ``[Dk, BV]`` state in registers; then the final state (last output). ``states``: store
    each chunk's start state and v_new (the backward's recompute, the unfused forward) instead of the outputs."""
    b, h, hk, vs = _program(w_ref, bv, ratio)
    dk, dt, f32 = w_ref.shape[-1], w_ref.dtype, jnp.float32
    keys = pl.ds(0, dk)

    def body(n, state):
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        sd = state.astype(dt)
        v_new = plgpu.load(u_ref.at[b, h, ts, vs]).astype(f32) - plgpu.dot(plgpu.load(w_ref.at[b, h, ts, keys]), sd)
        vd = v_new.astype(dt)
        if states:
            hs_ref, vn_ref, _ = out_refs
            plgpu.store(hs_ref.at[b, h, n, keys, vs], sd)
            plgpu.store(vn_ref.at[b, h, ts, vs], vd)
        else:
            o_ref = out_refs[0]
            qe = plgpu.load(q_ref.at[b, hk, ts, keys]) * plgpu.load(e_ref.at[b, h, ts])[:, None]
            o = plgpu.dot(qe.astype(dt), sd) + plgpu.dot(plgpu.load(a_ref.at[b, h, ts, pl.ds(0, c)]), vd)
            plgpu.store(o_ref.at[b, ts, h, vs], o.astype(o_ref.dtype))
        kf = plgpu.load(k_ref.at[b, hk, ts, keys]) * plgpu.load(f_ref.at[b, h, ts])[:, None]
        return state * cd_ref[b, h, n] + plgpu.dot(kf.astype(dt), vd, trans_a=True)

    state = jax.lax.fori_loop(0, w_ref.shape[2] // c, body, plgpu.load(h0_ref.at[b, h, keys, vs]))
    plgpu.store(out_refs[-1].at[b, h, keys, vs], state)


def _bwd_kernel(q_ref, k_ref, w_ref, a_ref, e_ref, f_ref, cd_ref, do_ref, dht_ref, dvn_ref, dhs_ref, dh0_ref, *,
                c: int, ratio: int, bv: int):
    """Chunks in reverse, carrying the state gradient ``dS [Dk, BV]``: stores each chunk's d(v_new) and the
    gradient of its end state, then the initial state's gradient."""
    b, h, hk, vs = _program(w_ref, bv, ratio)
    dk, dt = w_ref.shape[-1], w_ref.dtype
    keys = pl.ds(0, dk)
    n_chunks = w_ref.shape[2] // c

    def body(i, ds):
        n = n_chunks - 1 - i
        ts = pl.ds(pl.multiple_of(n * c, c), c)
        do = plgpu.load(do_ref.at[b, ts, h, vs]).astype(dt)
        dsd = ds.astype(dt)
        plgpu.store(dhs_ref.at[b, h, n, keys, vs], dsd)
        kf = plgpu.load(k_ref.at[b, hk, ts, keys]) * plgpu.load(f_ref.at[b, h, ts])[:, None]
        dvn = (plgpu.dot(plgpu.load(a_ref.at[b, h, ts, pl.ds(0, c)]), do, trans_a=True)
               + plgpu.dot(kf.astype(dt), dsd))
        dvd = dvn.astype(dt)
        plgpu.store(dvn_ref.at[b, h, ts, vs], dvd)
        qe = plgpu.load(q_ref.at[b, hk, ts, keys]) * plgpu.load(e_ref.at[b, h, ts])[:, None]
        return (ds * cd_ref[b, h, n] + plgpu.dot(qe.astype(dt), do, trans_a=True)
                - plgpu.dot(plgpu.load(w_ref.at[b, h, ts, keys]), dvd, trans_a=True))

    ds = jax.lax.fori_loop(0, n_chunks, body, plgpu.load(dht_ref.at[b, h, keys, vs]))
    plgpu.store(dh0_ref.at[b, h, keys, vs], ds)


def _launch(kernel, st: _Static, bv: int, dv: int, bh: int, out_shape, name: str, warps: int):
    return pl.pallas_call(
        kernel, out_shape=out_shape, grid=(dv // bv, bh), interpret=st.interpret, name=name,
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=st.config.num_stages))


def _recurrence(x: Prepared, h0, out_dtype, st: _Static, states: bool):
    """The forward kernel on the kernel inputs ``x``: (out [B, T, Hv, Dv], final state [B, Hv, Dk, Dv] float32),
    or with ``states`` (chunk-start states [B, Hv, N, Dk, Dv], v_new [B, Hv, T, Dv] in the operand dtype, final
    state)."""
    b, hv, t, dk = x.w.shape
    dv = x.u.shape[-1]
    bv = block_v(st.config, b * hv, dv)
    kernel = functools.partial(_fwd_kernel, c=st.chunk, ratio=hv // x.q.shape[1], bv=bv, states=states)
    if states:
        out_shape = (jax.ShapeDtypeStruct((b, hv, t // st.chunk, dk, dv), st.dtype),
                     jax.ShapeDtypeStruct((b, hv, t, dv), st.dtype))
    else:
        out_shape = (jax.ShapeDtypeStruct((b, t, hv, dv), out_dtype),)
    out_shape += (jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32),)
    return _launch(kernel, st, bv, dv, b * hv, out_shape, "gdn_states" if states else "gdn_fwd",
                   st.config.num_warps)(*x, h0)


def _reverse(x: Prepared, do, dht, st: _Static):
    """The backward kernel: (d v_new [B, Hv, T, Dv], end-state gradients [B, Hv, N, Dk, Dv], d initial state)."""
    b, hv, t, dk = x.w.shape
    dv = do.shape[-1]
    bv = block_v(st.config, b * hv, dv)
    kernel = functools.partial(_bwd_kernel, c=st.chunk, ratio=hv // x.q.shape[1], bv=bv)
    out_shape = (jax.ShapeDtypeStruct((b, hv, t, dv), st.dtype),
                 jax.ShapeDtypeStruct((b, hv, t // st.chunk, dk, dv), st.dtype),
                 jax.ShapeDtypeStruct((b, hv, dk, dv), jnp.float32))
    return _launch(kernel, st, bv, dv, b * hv, out_shape, "gdn_bwd", st.config.bwd_num_warps or st.config.num_warps)(
        x.q, x.k, x.w, x.a, x.e, x.f, x.cd, do, dht)


# ----------------------------------------------------------------------------- the chunk-parallel parts (XLA)

def _grouped(x: Prepared, hs, st: _Static):
    """Views over all chunks, value heads grouped by key head: q, k [B, Hk, N, C, Dk], e, f [B, Hk, r, N, C],
    start states [B, Hk, r, N, Dk, Dv] (kernel dtypes)."""
    b, hk, t, dk = x.q.shape
    hv, dv = x.u.shape[1], x.u.shape[-1]
    n = t // st.chunk
    view = lambda y: y.reshape(b, hk, hv // hk, n, st.chunk, *y.shape[3:])
    return (x.q.reshape(b, hk, n, st.chunk, dk), x.k.reshape(b, hk, n, st.chunk, dk), view(x.e), view(x.f),
            hs.reshape(b, hk, hv // hk, n, dk, dv), view)


def _chunk_outputs(x: Prepared, hs, vn, st: _Static) -> jax.Array:
    """The outputs [B, T, Hv, Dv] float32 from each chunk's start state ``hs`` and v_new (the unfused forward):
    ``o = e q S + A v_new``, all chunks at once (q per key head)."""
    ein = functools.partial(jnp.einsum, precision=st.precision, preferred_element_type=jnp.float32)
    q, _, e, _, s_, view = _grouped(x, hs, st)
    out = e[..., None] * ein("bhnck,bhrnkv->bhrncv", q, s_) + ein("bhrnij,bhrnjv->bhrniv", view(x.a), view(vn))
    b, hv, t, dv = vn.shape
    return jnp.swapaxes(out.reshape(b, hv, t, dv), 1, 2)


def _chunk_grads(x: Prepared, hs, vn, dvn, dhs, do, st: _Static) -> Prepared:
    """Given the kernel inputs ``x`` (operand dtype), each chunk's start state ``hs``, v_new, d(v_new) and
    end-state gradient ``dhs`` (the kernels), the float32 gradients of the kernel inputs, all chunks at once
    (per value head; q and k summed over the value heads of their key head):

        du = dv_new      dw = -dv_new S^T      dA = do v_new^T      dcd = <S, dS>
        dq = e do S^T    de = q.(do S^T)       dk = f v_new dS^T    df = k.(v_new dS^T)
    """
    f32 = jnp.float32
    ein = functools.partial(jnp.einsum, precision=st.precision, preferred_element_type=f32)
    q, k, e, f, s_, view = _grouped(x, hs, st)
    ds_ = dhs.reshape(s_.shape)
    b, hv, t = vn.shape[:3]
    do_ = view(jnp.swapaxes(do, 1, 2).astype(st.dtype))
    x_q = ein("bhrncv,bhrnkv->bhrnck", do_, s_)  # do S^T
    y_k = ein("bhrncv,bhrnkv->bhrnck", view(vn), ds_)  # v_new dS^T
    per_token = lambda y: y.reshape(b, hv, t, *y.shape[5:])
    return Prepared(
        q=jnp.sum(e[..., None] * x_q, axis=2).reshape(x.q.shape),
        k=jnp.sum(f[..., None] * y_k, axis=2).reshape(x.k.shape),
        w=-per_token(ein("bhrncv,bhrnkv->bhrnck", view(dvn), s_)),
        u=dvn.astype(f32),
        a=per_token(ein("bhrniv,bhrnjv->bhrnij", do_, view(vn))),
        e=per_token(jnp.sum(q[:, :, None].astype(f32) * x_q, axis=-1)),
        f=per_token(jnp.sum(k[:, :, None].astype(f32) * y_k, axis=-1)),
        cd=jnp.sum(s_.astype(f32) * ds_.astype(f32), axis=(-2, -1)).reshape(x.cd.shape))


# ----------------------------------------------------------------------------- the rule under one custom VJP

def _kernel_inputs(x: Prepared, st: _Static) -> Prepared:
    """The prepared float32 inputs, the matmul operands in the kernels' operand dtype (the gates stay float32)."""
    return x._replace(**{name: getattr(x, name).astype(st.dtype) for name in ("q", "k", "w", "u", "a")})


def _forward(x: Prepared, h0, q, st: _Static):
    if st.config.fused_output:
        out, state = _recurrence(x, h0, q.dtype, st, states=False)
    else:
        hs, vn, state = _recurrence(x, h0, q.dtype, st, states=True)
        out = _chunk_outputs(x, hs, vn, st).astype(q.dtype)
    return out[:, :q.shape[1]], state


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _rule(st: _Static, q, k, v, g, beta, h0, runs, valid):
    """Not differentiated (evaluation, generation): the preparation kernel."""
    return _forward(_prepare_kernel(q, k, v, g, beta, runs, valid, st), h0, q, st)


def _rule_fwd(st: _Static, q, k, v, g, beta, h0, runs, valid):
    """Differentiated: the XLA preparation, the same program as the backward's re-run of it (:func:`_rule_bwd`),
    which XLA then computes once for both; with the kernel here the training step is slower
    (bench/results/qwen35.md)."""
    x = _kernel_inputs(_prepare(q, k, v, g, beta, runs, valid, st), st)
    return _forward(x, h0, q, st), (q, k, v, g, beta, h0, runs, valid)


def _rule_bwd(st: _Static, res, cotangents):
    q, k, v, g, beta, h0, runs, valid = res
    d_out, d_state = cotangents
    x32, pullback = jax.vjp(lambda *a: _prepare(*a, runs, valid, st), q, k, v, g, beta)
    x = _kernel_inputs(x32, st)
    hs, vn, _ = _recurrence(x, h0, q.dtype, st, states=True)
    d_out = jnp.pad(d_out, ((0, 0), (0, runs.shape[1] - d_out.shape[1]), (0, 0), (0, 0)))
    dvn, dhs, dh0 = _reverse(x, d_out, d_state.astype(jnp.float32), st)
    grads = pullback(_chunk_grads(x, hs, vn, dvn, dhs, d_out, st))
    return (*grads, dh0.astype(h0.dtype), None, None)


_rule.defvjp(_rule_fwd, _rule_bwd)


def chunk_gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
                           chunk_size: int = 64, initial_state: jax.Array | None = None,
                           segment_ids: jax.Array | None = None, use_qk_l2norm: bool = False,
                           scale: float | None = None, precision: jax.lax.PrecisionLike = None,
                           config: Config | None = None, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g (log decay, <= 0), beta [B, S, Hv], initial_state
    [B, Hv, Dk, Dv], segment_ids [B, S] -> (out [B, S, Hv, Dv] in q's dtype, final state [B, Hv, Dk, Dv]
    float32): ``moevlm_jax.model.gated_deltanet.chunk_gated_delta_rule`` with the recurrence in Pallas kernels
    (module docstring), differentiable in q, k, v, g, beta and the initial state. ``precision``: the XLA
    matmuls' (preparation, chunk gradients); ``config``: the kernels' tiles; ``interpret``: Pallas' interpret
    mode (default: on CPU)."""
    b, s, hk, dk = q.shape
    hv, dv = v.shape[2:]
    if q.shape != k.shape or hv % hk or v.shape[:2] != k.shape[:2] or g.shape != v.shape[:3] or beta.shape != g.shape:
        raise ValueError(f"gated delta rule shapes: q {q.shape} k {k.shape} v {v.shape} g {g.shape} beta {beta.shape}")
    why = supported(dk, dv, chunk_size)
    if why:
        raise ValueError(f"gdn_triton: {why}; use the XLA path (compute.gdn_kernel: xla)")
    dtype = jnp.dtype(q.dtype)
    if dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"gdn_triton: q dtype {dtype} is not bfloat16, float16 or float32")
    t = -(-s // chunk_size) * chunk_size
    biggest = b * hv * t * max(dk, dv) * max(dk, dv) // chunk_size  # the chunk states of the backward
    if max(biggest, b * hv * t * max(dk, dv, chunk_size)) > _MAX_ELEMENTS:
        raise ValueError(f"gdn_triton: B={b} x S={s} x Hv={hv} needs buffers over 2^31 elements (32-bit offsets in "
                         "the Triton kernels); split the rows (smaller micro-batch)")
    runs, valid = _runs(segment_ids, b, s, t)
    if initial_state is None:
        h0 = jnp.zeros((b, hv, dk, dv), jnp.float32)
    elif initial_state.shape != (b, hv, dk, dv):
        raise ValueError(f"initial_state shape {initial_state.shape}, expected {(b, hv, dk, dv)}")
    else:
        h0 = initial_state.astype(jnp.float32)
    st = _Static(int(chunk_size), float(dk ** -0.5 if scale is None else scale), bool(use_qk_l2norm), precision,
                 dtype, config or DEFAULT_CONFIG, _on_cpu() if interpret is None else bool(interpret))
    return _rule(st, q, k, v.astype(dtype), g, beta, h0, runs, valid)
