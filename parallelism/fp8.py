"""FP8 GEMMs (``compute.fp8``): float8_e4m3 operands, float8_e5m2 gradients, current scaling.

The recipe is Transformer Engine's / Megatron's FP8 on Hopper, with DeepSeek-V3's blockwise scaling as
the second choice. Each GEMM's two forward operands are quantised to ``float8_e4m3fn`` (max 448, 3
mantissa bits) with scales computed from their own absolute maximum at this step (*current* scaling:
no amax history to carry in the train state), the GEMM accumulates in float32, and in the backward the
output gradient is quantised to ``float8_e5m2`` (max 57344, 2 mantissa bits: the range gradients need)
before both gradient GEMMs, which reuse the forward's quantised operands. ``Fp8Config.recipe``:

  tensor     one scale per tensor (per expert for the experts' weights); the dense GEMMs hand the
             fp8 arrays to the dot itself (:func:`dot`), which XLA:GPU compiles to cuBLASLt's FP8 GEMM
  blockwise  1 x B blocks along the contraction axis for activations and gradients, B x B blocks for
             weights (B = ``block``: 128 as in DeepSeek-V3 and Megatron's Hopper blockwise recipe):
             one outlier spoils only its block. The dense GEMMs in quantise-dequantise form: the numerics
             of the recipe; the experts can run on kernels that consume the block scales (below).

Everything else keeps the compute dtype or float32: the router, norms, softmax, attention's core, the
LM head and the loss (``Fp8Config`` names which GEMMs: the decoder's dense ones, the experts', the
vision tower's).

The tensor recipe's dense GEMMs (:func:`dot`) take the fp8 arrays themselves: ``dot_general`` of
e4m3 x e4m3 (forward), e5m2 x e4m3 (both gradient GEMMs) with float32 accumulation and the two scales
applied to the output, in one custom VJP (:func:`tensor_gemm`) that keeps the fp8 operands as its
residuals. On the H200 that form compiles to ``__cublas$lt$matmul$f8``, where the quantise-dequantise
form below stays a bf16 GEMM after a dequantise pass (bench/results/fp8.md sections 3-4). Everything else
(the blockwise recipe, the experts by default) is written as quantise-dequantise (:func:`qdq`): a tensor is
rounded onto its scaled fp8 grid and carried on in its own dtype, so that every backend runs it (CPU tests, the
Triton / ragged-dot experts) and the numerics are the recipe's exactly; the operand's gradient passes straight
through the rounding (:func:`quantized`), and :func:`grad_quantized` rounds the incoming gradient of
a GEMM's output. The experts' grouped matmuls are reached through :func:`scope`, which
``parallelism.experts.experts_forward`` opens with the config it was given (the grouped-matmul
kernels below it take no fp8 argument). With ``experts_kernel: triton`` (backend triton) the experts instead
run ``parallelism.gmm_fp8``: Pallas-Triton grouped-matmul kernels that read the fp8 operands and apply both
recipes' scales inside (the blockwise forward and d(x) per K block; the blockwise d(w), whose row scales vary
along its contraction, dequantised in registers), in one custom VJP that quantises the output gradient once and
keeps the forward's fp8 operands; same numerics, not yet timed on a GPU (the default stays ``qdq``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp

FORMATS: dict[str, Any] = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
SITES = ("dense", "experts", "vision")


def fp8_max(fmt: str) -> float:
    """The largest finite value of the fp8 format ``fmt`` (e4m3: 448, e5m2: 57344)."""
    return float(jnp.finfo(FORMATS[fmt]).max)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """The ``compute.fp8`` section: which GEMMs run in FP8 and how they are scaled."""

    # none | tensor (per-tensor current scaling) | blockwise (1xB activations, BxB weights)
    recipe: Literal["none", "tensor", "blockwise"] = "none"
    block: int = 128  # blockwise: the block edge B
    forward_format: Literal["e4m3", "e5m2"] = "e4m3"  # the forward operands' format
    # the output gradients' format in the backward. Blockwise with e4m3 (DeepSeek-V3's choice: small blocks
    # leave little for e5m2's range to cover) kept 200 proxy steps within 1% of bf16's loss on the H200; the
    # tensor recipe with e5m2 fell 2-6% behind (bench/results/fp8.md section 6; blockwise e5m2 not run that long)
    grad_format: Literal["e4m3", "e5m2"] = "e5m2"
    # the decoder's dense GEMMs: attention and Gated DeltaNet projections, dense and shared-expert MLPs
    dense: bool = True
    experts: bool = True  # the routed experts' grouped matmuls
    vision: bool = False  # the vision tower's and the merger's GEMMs
    # the experts' grouped GEMMs: qdq (quantise-dequantise around the compute-dtype grouped matmul, any backend) |
    # triton (parallelism/gmm_fp8.py: Pallas-Triton kernels reading the fp8 operands, the scales applied inside;
    # needs compute.moe.backend triton). qdq until a GPU benchmark shows the kernel faster: it is untimed
    # (bench/results/fp8.md, "Next: the FP8 grouped GEMM kernel")
    experts_kernel: Literal["qdq", "triton"] = "qdq"

    def __post_init__(self) -> None:
        if self.recipe not in ("none", "tensor", "blockwise"):
            raise ValueError(f"compute.fp8.recipe must be none, tensor or blockwise, got {self.recipe!r}")
        if not (isinstance(self.block, int) and self.block > 0):
            raise ValueError(f"compute.fp8.block must be a positive int, got {self.block!r}")
        for key in ("forward_format", "grad_format"):
            if getattr(self, key) not in FORMATS:
                raise ValueError(f"compute.fp8.{key} must be one of {sorted(FORMATS)}, got {getattr(self, key)!r}")
        if self.experts_kernel not in ("qdq", "triton"):
            raise ValueError(f"compute.fp8.experts_kernel must be qdq or triton, got {self.experts_kernel!r}")

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"

    def at(self, site: str) -> Fp8Config | None:
        """This config where ``site`` (one of SITES) runs in FP8, else None."""
        if site not in SITES:
            raise ValueError(f"unknown fp8 site {site!r}; known: {SITES}")
        return self if self.enabled and getattr(self, site) else None

    def blocks(self, ndim: int, kind: str, batch_dims: int = 0) -> tuple[int, ...]:
        """Block shape of a GEMM operand of ``ndim`` dims: ``kind`` "lhs" (activations or gradients: the
        contraction is the last axis) or "rhs" (weights ``[*batch, K, N]``); -1 is a whole axis."""
        if self.recipe == "tensor":
            return (1,) * batch_dims + (-1,) * (ndim - batch_dims)
        b = self.block
        if kind == "lhs":
            return (1,) * (ndim - 1) + (b,)
        return (1,) * batch_dims + (b,) * (ndim - batch_dims)


# ----------------------------------------------------------------------------- quantisation

def _blocked(x: jax.Array, blocks: Sequence[int]) -> jax.Array:
    """x zero-padded to whole blocks and reshaped ``[n0, b0, n1, b1, ...]``."""
    if len(blocks) != x.ndim:
        raise ValueError(f"fp8 blocks {tuple(blocks)} for a tensor of shape {x.shape}")
    sizes = tuple(d if b == -1 else min(b, d) for d, b in zip(x.shape, blocks))
    pad = [(0, -d % s) for d, s in zip(x.shape, sizes)]
    if any(p for _, p in pad):
        x = jnp.pad(x, pad)
    shape = [v for d, s in zip(x.shape, sizes) for v in (d // s, s)]
    return x.reshape(shape)


def quantize(x: jax.Array, fmt: str, blocks: Sequence[int], amax_axes: tuple[str, ...] = ()
             ) -> tuple[jax.Array, jax.Array]:
    """x -> (q, scale): ``q`` in fp8 ``fmt`` ``[n0, b0, n1, b1, ...]`` (zero-padded to whole blocks) and
    ``scale`` float32 ``[n0, 1, n1, 1, ...]`` = the block's absolute maximum / the format's maximum (1
    for an all-zero block), so that ``q * scale`` approximates x and the block's largest magnitude maps
    to the format's largest value; out-of-range values cannot occur (they saturate). ``amax_axes``:
    inside a shard_map whose devices each hold a part of the block, the maximum over those mesh axes."""
    xb = _blocked(x.astype(jnp.float32), blocks)
    amax = jnp.max(jnp.abs(xb), axis=tuple(range(1, xb.ndim, 2)), keepdims=True)
    if amax_axes:
        amax = jax.lax.pmax(amax, amax_axes)
    top = fp8_max(fmt)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    q = jnp.clip(xb / scale, -top, top).astype(FORMATS[fmt])
    return q, scale


def dequantize(q: jax.Array, scale: jax.Array, shape: Sequence[int], dtype: Any) -> jax.Array:
    """The inverse of :func:`quantize` onto ``shape`` (padding dropped) in ``dtype``."""
    if all(s == 1 for s in scale.shape):  # one scale: fp8 -> dtype, times a scalar (XLA's FP8 GEMM pattern)
        x = q.astype(dtype) * scale.reshape(()).astype(dtype)
    else:
        x = (q.astype(jnp.float32) * scale).astype(dtype)
    padded = tuple(q.shape[2 * i] * q.shape[2 * i + 1] for i in range(len(shape)))
    x = x.reshape(padded)
    if padded != tuple(shape):
        x = x[tuple(slice(0, d) for d in shape)]
    return x


def qdq(x: jax.Array, fmt: str, blocks: Sequence[int], amax_axes: tuple[str, ...] = ()) -> jax.Array:
    """x rounded onto its scaled fp8 grid (``quantize`` then ``dequantize``), in x's dtype.

    The fp8 tensor passes an optimisation barrier. Without it, on the H200 both recipes' GEMMs had
    bf16's error size (0.004 against the ~0.04 of e4m3 operands, bench/results/fp8.md): the rounding was
    compiled away, most likely by XLA:GPU's ``SimplifyFPConversions`` (on under
    ``xla_allow_excess_precision``, XLA's default), which folds convert chains such as ``f32 -> f8 ->
    f32`` (inferred from the errors; that call dumped no HLO). Behind the barrier no convert chain is
    left to fold, and the fp8 tensor is what the next op reads (still XLA's FP8 GEMM pattern: a convert
    of an fp8 operand, times a scalar)."""
    q, scale = quantize(x, fmt, blocks, amax_axes)
    q = jax.lax.optimization_barrier(q)
    return dequantize(q, scale, x.shape, x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def quantized(x: jax.Array, fmt: str, blocks: tuple[int, ...], amax_axes: tuple[str, ...] = ()) -> jax.Array:
    """A GEMM operand in fp8 (:func:`qdq`); its gradient passes straight through the rounding."""
    return qdq(x, fmt, blocks, amax_axes)


def _quantized_fwd(x, fmt, blocks, amax_axes):
    return qdq(x, fmt, blocks, amax_axes), None


def _quantized_bwd(fmt, blocks, amax_axes, _, g):
    return (g,)


quantized.defvjp(_quantized_fwd, _quantized_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def grad_quantized(y: jax.Array, fmt: str, blocks: tuple[int, ...], amax_axes: tuple[str, ...] = ()) -> jax.Array:
    """A GEMM's output, unchanged; its incoming gradient is rounded to fp8 (``fmt``, ``blocks``) before
    the GEMM's backward uses it."""
    return y


def _grad_quantized_fwd(y, fmt, blocks, amax_axes):
    return y, None


def _grad_quantized_bwd(fmt, blocks, amax_axes, _, g):
    return (qdq(g, fmt, blocks, amax_axes),)


grad_quantized.defvjp(_grad_quantized_fwd, _grad_quantized_bwd)


# ----------------------------------------------------------------------------- GEMMs

def operands(lhs: jax.Array, rhs: jax.Array, cfg: Fp8Config, rhs_batch_dims: int = 0, *,
             lhs_axes: tuple[str, ...] = (), rhs_axes: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array]:
    """The forward operands of ``lhs [..., K] x rhs [*batch, K, N]`` in fp8 (``cfg.forward_format``);
    ``*_axes``: the mesh axes a per-tensor scale spans inside a shard_map (``tensor`` recipe only)."""
    whole = cfg.recipe == "tensor"
    return (quantized(lhs, cfg.forward_format, cfg.blocks(lhs.ndim, "lhs"), lhs_axes if whole else ()),
            quantized(rhs, cfg.forward_format, cfg.blocks(rhs.ndim, "rhs", rhs_batch_dims), rhs_axes if whole else ()))


def output(y: jax.Array, cfg: Fp8Config, axes: tuple[str, ...] = ()) -> jax.Array:
    """A GEMM output ``[..., N]`` whose gradient is rounded to ``cfg.grad_format`` (1 x B blocks along N,
    the gradient GEMM's contraction, under blockwise; ``axes`` as :func:`operands`' under tensor)."""
    return grad_quantized(y, cfg.grad_format, cfg.blocks(y.ndim, "lhs"), axes if cfg.recipe == "tensor" else ())


def _per_tensor(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
    """x -> (q in fp8 ``fmt``, x's shape; the scalar float32 scale): :func:`quantize` with one block."""
    q, scale = quantize(x, fmt, (-1,) * x.ndim)
    return q.reshape(x.shape), scale.reshape(())


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def tensor_gemm(x: jax.Array, w: jax.Array, forward_format: str, grad_format: str) -> jax.Array:
    """``x [M, K] . w [K, N]`` in the tensor recipe with the fp8 arrays handed to the dot (the module
    docstring): ``y = (qx . qw) sx sw``; backward ``dx = (qg . qw^T) sg sw``, ``dw = (qx^T . qg) sx sg``
    with ``qg`` the output gradient in ``grad_format``. Float32 accumulation; x and w of one dtype, the
    outputs in it."""
    if x.dtype != w.dtype:
        raise ValueError(f"fp8 tensor_gemm operands of one dtype, got {x.dtype} and {w.dtype}")
    return _tensor_gemm_fwd(x, w, forward_format, grad_format)[0]


def _tensor_gemm_fwd(x, w, forward_format, grad_format):
    (qx, sx), (qw, sw) = _per_tensor(x, forward_format), _per_tensor(w, forward_format)
    y = jax.lax.dot_general(qx, qw, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * (sx * sw)).astype(x.dtype), (qx, sx, qw, sw)


def _tensor_gemm_bwd(forward_format, grad_format, res, g):
    qx, sx, qw, sw = res
    qg, sg = _per_tensor(g, grad_format)
    dx = jax.lax.dot_general(qg, qw, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dw = jax.lax.dot_general(qx, qg, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (dx * (sg * sw)).astype(g.dtype), (dw * (sx * sg)).astype(g.dtype)  # g: y's dtype, x's and w's


tensor_gemm.defvjp(_tensor_gemm_fwd, _tensor_gemm_bwd)


def dot(x: jax.Array, kernel: jax.Array, n_in: int, cfg: Fp8Config) -> jax.Array:
    """``x [..., *in] . kernel [*in, *out]`` (the trailing ``n_in`` dims of x contracted) in FP8, in x's
    dtype with float32 accumulation (the tensor recipe through :func:`tensor_gemm`)."""
    lead, ins, outs = x.shape[: x.ndim - n_in], kernel.shape[:n_in], kernel.shape[n_in:]
    k, n = math.prod(ins), math.prod(outs)
    if cfg.recipe == "tensor":
        y = tensor_gemm(x.reshape(-1, k), kernel.astype(x.dtype).reshape(k, n), cfg.forward_format, cfg.grad_format)
        return y.reshape(*lead, *outs)
    x2, w2 = operands(x.reshape(*lead, k), kernel.astype(x.dtype).reshape(k, n), cfg)
    y = jax.lax.dot_general(x2, w2, (((x2.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return output(y.astype(x.dtype), cfg).reshape(*lead, *outs)


# ----------------------------------------------------------------------------- the experts' scope

@dataclasses.dataclass(frozen=True)
class ExpertsScope:
    """The experts' FP8 recipe and, inside their shard_map, the mesh axes a per-tensor scale spans: every
    axis for the token rows (one scale for all rows, as on one device), the expert-tensor-parallel axes
    for an expert's weights (one scale per expert, never across experts)."""

    cfg: Fp8Config
    row_axes: tuple[str, ...] = ()
    weight_axes: tuple[str, ...] = ()


_EXPERTS: contextvars.ContextVar[ExpertsScope | None] = contextvars.ContextVar("fp8_experts", default=None)


@contextlib.contextmanager
def scope(cfg: Fp8Config | None, row_axes: tuple[str, ...] = (), weight_axes: tuple[str, ...] = ()) -> Iterator[None]:
    """Trace the experts within with ``cfg`` (None: not in FP8); ``experts_forward`` opens it."""
    token = _EXPERTS.set(ExpertsScope(cfg, tuple(row_axes), tuple(weight_axes))
                         if cfg is not None and cfg.enabled else None)
    try:
        yield
    finally:
        _EXPERTS.reset(token)


def experts_scope() -> ExpertsScope | None:
    """The FP8 scope of the experts being traced (:func:`scope`), or None."""
    return _EXPERTS.get()
