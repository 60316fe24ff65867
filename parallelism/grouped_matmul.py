"""Grouped matmul backends for the experts: rows sorted by group times one weight matrix per group.

``grouped_matmul(lhs [M, K], rhs [G, K, N], group_sizes [G]) -> [M, N]``: rows
``[sum(group_sizes[:g]), sum(group_sizes[:g+1]))`` of ``lhs`` are multiplied by ``rhs[g]``; rows past
``sum(group_sizes)`` (padding) give zero rows, and zero gradients, under every backend.

Backends:
- ``"ragged_dot"``: ``jax.lax.ragged_dot``; the CPU/TPU path and the reference. On GPU (jax 0.11.2)
  it is a masked dense expansion: ~5 TFLOP/s, and it materialises ``[M, G*K]`` / ``[G, M, N]``
  buffers, so it runs out of memory at training sizes (128 experts, 131k rows).
- ``"tokamax"``: ``tokamax.ragged_dot`` (Pallas Mosaic-GPU kernels with their own VJP), imported
  lazily; the GPU path. Its kernels leave rows past ``sum(group_sizes)`` uninitialised in the
  output and in d(lhs), so both are masked here. On Hopper (H100/H200) the three kernels get
  explicit configs (:data:`TOKAMAX_SM90_CONFIGS`) instead of tokamax 0.0.16's heuristics: its
  heuristic config for the expert-weight gradient d(rhs) (the ragged-contracting kernel: block
  64x64x128, 2 stages) is wrong by 2.5-2.7% (norm-wise, every group; d(x) and the forward are at
  bf16 rounding, 0.17%), and configs with a 64-row token block give inf; 64x128x128 with 3 stages is
  at bf16 rounding at the same speed. The forward config 128x128x64, 4 stages, persistent ran 1.27-1.38x
  the heuristic's speed (bench/results/moe_layer.md).
- ``"triton"``: this project's Pallas-Triton kernels (``parallelism.gmm_triton``: forward, d(x) on the
  weights read transposed, d(w) contracting each group's rows), with their own VJP; GPU, and on CPU in
  Pallas' interpret mode (tests). Rows past ``sum(group_sizes)`` are masked here as for tokamax.
- ``"dense"``: a masked per-group einsum over ``[G, M, K]``; a reference for tests, O(G) memory.
And for drop-and-pad: :func:`capacity_matmul` ``[G, C, K] x [G, K, N] -> [G, C, N]``.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from typing import Any

import jax
import jax.numpy as jnp

from moevlm_jax.parallelism import gmm_mgpu, gmm_triton
from moevlm_jax.parallelism.kernels import DEFAULT_KERNELS, KernelsConfig

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("ragged_dot", "tokamax", "triton", "dense")
GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})

_TOKAMAX: dict[str, Any] = {}


def _install_xprof_stub() -> None:
    """tokamax imports ``xprof.cli.tools`` only for its benchmarking helpers; stand in for it."""
    for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
        if name not in sys.modules:
            sys.modules[name] = types.ModuleType(name)
    sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None  # type: ignore[attr-defined]
    sys.modules["xprof"].cli = sys.modules["xprof.cli"]  # type: ignore[attr-defined]
    sys.modules["xprof.cli"].tools = sys.modules["xprof.cli.tools"]  # type: ignore[attr-defined]


def import_tokamax() -> Any | None:
    """The ``tokamax`` module, or None when it cannot be imported (the reason is logged once)."""
    if "module" in _TOKAMAX:
        return _TOKAMAX["module"]
    module = None
    try:
        import tokamax as module  # type: ignore[no-redef]
    except ModuleNotFoundError as err:
        if (err.name or "").startswith("xprof"):
            log.warning("tokamax needs xprof only for benchmarking helpers; using an empty stand-in")
            _install_xprof_stub()
            try:
                import tokamax as module  # type: ignore[no-redef]
            except Exception as err2:  # noqa: BLE001 - any import failure means "not available"
                _TOKAMAX["error"] = repr(err2)
        else:
            _TOKAMAX["error"] = repr(err)
    except Exception as err:  # noqa: BLE001
        _TOKAMAX["error"] = repr(err)
    if module is None:
        log.info("tokamax is not importable: %s", _TOKAMAX.get("error"))
    _TOKAMAX["module"] = module
    return module


def preload(platform: str, backend: str | None = "auto") -> None:
    """Import the GPU kernels' package now, outside any trace (call before the first jit), when the
    experts' backend is tokamax. Imported for the first time inside a trace, tokamax changes jax's
    tracing context (H200, jax 0.11.2: the train step compiled ahead with 50 context values, called
    with 56), so the step compiled ahead of time misses the jit cache and compiles again in its first
    call; imported here first, it does not. The Triton kernels need nothing."""
    if platform in GPU_PLATFORMS and backend == "tokamax":
        import_tokamax()


def tokamax_available() -> bool:
    """Whether ``tokamax.ragged_dot`` can be used here."""
    return import_tokamax() is not None


def default_backend(platform: str | None = None) -> str:
    """The grouped-matmul backend for ``platform`` (default: jax's default backend): on GPUs this
    project's Pallas-Triton kernels (Pallas ships with jax; on an H200 1.8x tokamax for the MoE layer,
    bench/results/moe_layer.md), elsewhere ``jax.lax.ragged_dot``."""
    platform = platform or jax.default_backend()
    return "triton" if platform in GPU_PLATFORMS else "ragged_dot"


def resolve_backend(backend: str | None, platform: str | None = None) -> str:
    """Check a backend name; ``None``/``"auto"`` picks :func:`default_backend`."""
    if backend in (None, "auto"):
        return default_backend(platform)
    if backend not in BACKENDS:
        raise ValueError(f"unknown grouped-matmul backend {backend!r}; choose one of {('auto',) + BACKENDS}")
    if backend == "tokamax" and not tokamax_available():
        raise ImportError(
            f"backend 'tokamax' needs the tokamax package (GPU, jax>=0.11.1, Python>=3.12): {_TOKAMAX.get('error')}"
        )
    return backend


def valid_rows(m: int, group_sizes: jax.Array) -> jax.Array:
    """``[m]`` bool: row < ``sum(group_sizes)``."""
    return jnp.arange(m, dtype=jnp.int32) < jnp.sum(group_sizes)


def zero_tail(y: jax.Array, group_sizes: jax.Array, zero: bool = True) -> jax.Array:
    """``y [m, ...]`` with the rows past ``sum(group_sizes)`` (a kernel leaves them unwritten) set to zero;
    ``zero=False``: ``y`` as it is, for a caller that reads none of those rows (a pass over ``y`` saved)."""
    if not zero:
        return y
    return jnp.where(valid_rows(y.shape[0], group_sizes)[:, None], y, jnp.zeros((), y.dtype))


@jax.custom_vjp
def zero_grad_where(x: jax.Array, valid: jax.Array) -> jax.Array:
    """Identity forward; the gradient is zeroed where ``valid`` (x's leading dims) is False. For
    kernels that leave their gradient at invalid rows unwritten (tokamax here, cuDNN's ragged
    attention in ``moevlm_jax.model.attention``)."""
    return x


def _zero_grad_where_fwd(x: jax.Array, valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x, valid


def _zero_grad_where_bwd(valid: jax.Array, g: jax.Array) -> tuple[jax.Array, None]:
    keep = valid.reshape(valid.shape + (1,) * (g.ndim - valid.ndim))
    return jnp.where(keep, g, jnp.zeros((), g.dtype)), None


zero_grad_where.defvjp(_zero_grad_where_fwd, _zero_grad_where_bwd)


# Mosaic-GPU ragged-dot kernel configs on sm90, measured on an H200 (bench/results/moe_layer.md): "fwd" is the
# forward kernel (also d(lhs), which tokamax runs as the forward kernel on the transposed weights);
# "dw" the ragged-contracting kernel of d(rhs). None of them from tokamax's heuristics (see above).
TOKAMAX_SM90_CONFIGS: dict[str, dict[str, Any]] = {
    "fwd": {"block_m": 128, "block_n": 128, "block_k": 64, "num_stages": 4, "split_k": 1, "persistent": True},
    "dw": {"block_m": 64, "block_n": 128, "block_k": 128, "num_stages": 3, "split_k": 1},
}


def _tokamax_implementation() -> Any | None:
    """The configured Mosaic-GPU op for Hopper GPUs (None elsewhere: tokamax picks)."""
    if "impl" in _TOKAMAX:
        return _TOKAMAX["impl"]
    impl = None
    kind = jax.devices()[0].device_kind if jax.default_backend() in GPU_PLATFORMS else ""
    if "H100" in kind or "H200" in kind or "H800" in kind:
        try:
            from functools import partial

            from tokamax._src.ops.ragged_dot import base
            from tokamax._src.ops.ragged_dot import pallas_mosaic_gpu as pmg

            op = pmg.PallasMosaicGpuRaggedDot
            cfg = {k: pmg.Config(**v) for k, v in TOKAMAX_SM90_CONFIGS.items()}
            vjp = partial(base.vjp, dlhs_ragged_dot=op(config=cfg["fwd"]), drhs_ragged_dot=op(config=cfg["dw"]))
            impl = op(config=cfg["fwd"], vjp=vjp)
        except Exception as err:  # noqa: BLE001 - tokamax internals moved: its own choice, with a warning
            log.warning("tokamax Mosaic-GPU configs not applied (%r); tokamax's heuristics can give wrong "
                        "expert-weight gradients on sm90", err)
    _TOKAMAX["impl"] = impl
    return impl


def _tokamax_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype: Any) -> jax.Array:
    tokamax = import_tokamax()
    if tokamax is None:
        raise ImportError(f"backend 'tokamax' is not available: {_TOKAMAX.get('error')}")
    valid = valid_rows(lhs.shape[0], group_sizes)
    lhs = zero_grad_where(lhs, valid)
    impl = _tokamax_implementation()
    kw = {} if impl is None else {"implementation": [impl]}
    out = tokamax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype, **kw)
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))


def mgpu_takes(kind: str, m: int, k: int, n: int, dtype: Any, kernels: KernelsConfig = DEFAULT_KERNELS) -> bool:
    """Whether the experts' matmul of ``kind`` ("fwd" / "dx": ``[m, k] -> [m, n]``; "dw": ``x [m, k]``, ``dy [m, n]``)
    runs on the Mosaic-GPU kernels (``parallelism.gmm_mgpu``): listed in ``kernels.mosaic_gpu``, bf16, on a Hopper
    GPU, at a shape the kernel takes with ``kernels.mosaic_gpu_tiles``; else on the Triton kernels."""
    if kind not in kernels.mosaic_gpu or dtype != jnp.bfloat16 or gmm_triton._on_cpu() or not gmm_mgpu.on_hopper():
        return False
    cfg = getattr(kernels.mosaic_gpu_tiles, kind)
    if kind == "dw":
        return gmm_mgpu.tsupported(m, k, n, cfg)
    return gmm_mgpu.supported(m, k, n, cfg)


def plain_gmm(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, trans_w: bool = False,
              kernels: KernelsConfig = DEFAULT_KERNELS) -> jax.Array:
    """``gmm_triton.gmm`` without fusions, or the same product on the Mosaic-GPU kernel (``gmm_mgpu.gmm``) where
    :func:`mgpu_takes`; the tiles from ``kernels``. Both leave the rows past ``sum(group_sizes)`` unwritten."""
    kind = "dx" if trans_w else "fwd"
    k, n = x.shape[1], (w.shape[1] if trans_w else w.shape[2])
    if w.dtype == x.dtype and mgpu_takes(kind, x.shape[0], k, n, x.dtype, kernels):
        return gmm_mgpu.gmm(x, w, group_sizes, trans_w=trans_w, config=getattr(kernels.mosaic_gpu_tiles, kind))
    return gmm_triton.gmm(x, w, group_sizes, trans_w=trans_w, config=kernels.triton_config(kind, k, n))


def plain_tgmm(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, out_dtype: Any = None,
               kernels: KernelsConfig = DEFAULT_KERNELS) -> jax.Array:
    """The experts' d(w) ``[G, K, N]``: ``gmm_triton.tgmm``, or ``gmm_mgpu.tgmm`` where :func:`mgpu_takes` (and the
    gradient is wanted in bf16). Neither lets the rows past ``sum(group_sizes)`` into the result (the Mosaic kernel
    selects zeros there, so NaN there stays out)."""
    k, n = x.shape[1], dy.shape[1]
    if (dy.dtype == x.dtype and out_dtype in (None, x.dtype)
            and mgpu_takes("dw", x.shape[0], k, n, x.dtype, kernels)):
        return gmm_mgpu.tgmm(x, dy, group_sizes, config=kernels.mosaic_gpu_tiles.dw)
    return gmm_triton.tgmm(x, dy, group_sizes, out_dtype=out_dtype, config=kernels.triton_config("dw", k, n))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _triton_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tail: bool,
                   kernels: KernelsConfig) -> jax.Array:
    """``tail``: zero the output's (and d(lhs)'s) rows past ``sum(group_sizes)``, which the kernels leave
    unwritten (and never read)."""
    return _triton_fwd(lhs, rhs, group_sizes, tail, kernels)[0]


def _triton_fwd(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, tail: bool,
                kernels: KernelsConfig) -> tuple[jax.Array, tuple]:
    out = zero_tail(plain_gmm(lhs, rhs, group_sizes, kernels=kernels), group_sizes, tail)
    return out, (lhs, rhs, group_sizes)


def _triton_bwd(tail: bool, kernels: KernelsConfig, res: tuple, g: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    lhs, rhs, group_sizes = res
    g = g.astype(lhs.dtype)
    dlhs = zero_tail(plain_gmm(g, rhs, group_sizes, trans_w=True, kernels=kernels), group_sizes, tail)
    drhs = plain_tgmm(lhs, g, group_sizes, out_dtype=rhs.dtype, kernels=kernels)
    return dlhs, drhs, None


_triton_matmul.defvjp(_triton_fwd, _triton_bwd)


def _dense_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype: Any) -> jax.Array:
    g = rhs.shape[0]
    ends = jnp.cumsum(group_sizes)
    group_of_row = jnp.searchsorted(ends, jnp.arange(lhs.shape[0]), side="right")
    member = group_of_row[None, :] == jnp.arange(g)[:, None]  # [G, M]
    masked = jnp.where(member[:, :, None], lhs[None], jnp.zeros((), lhs.dtype))  # [G, M, K]
    return jnp.einsum("gmk,gkn->mn", masked, rhs, preferred_element_type=out_dtype).astype(out_dtype)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, backend: str | None = None,
                   zero_tail_rows: bool = True, kernels: KernelsConfig = DEFAULT_KERNELS) -> jax.Array:
    """lhs ``[M, K]`` (rows sorted by group), rhs ``[G, K, N]``, group_sizes ``[G]`` -> ``[M, N]``.

    Rows past ``sum(group_sizes)`` are zero (in the output and in d(lhs)); ``zero_tail_rows=False`` lets the Triton
    backend leave them unwritten (any values, NaN included) for a caller that reads none of them: the
    masking is a pass over ``[M, N]`` (at M = 360k rows and N = 2048, ~0.9 ms on an H200). ``kernels``: the
    Triton backend's kernel choices and tiles (``compute.moe.kernels``)."""
    if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
        raise ValueError(f"grouped_matmul: lhs [M, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}")
    if group_sizes.shape != (rhs.shape[0],):
        raise ValueError(f"grouped_matmul: group_sizes must be [{rhs.shape[0]}], got {group_sizes.shape}")
    backend = resolve_backend(backend)
    out_dtype = lhs.dtype
    rhs = rhs.astype(lhs.dtype)
    group_sizes = group_sizes.astype(jnp.int32)
    if backend == "ragged_dot":
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    if backend == "tokamax":
        return _tokamax_matmul(lhs, rhs, group_sizes, out_dtype)
    if backend == "triton":
        return _triton_matmul(lhs, rhs, group_sizes, zero_tail_rows, kernels)
    return _dense_matmul(lhs, rhs, group_sizes, out_dtype)


def capacity_matmul(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """Drop-and-pad expert matmul: lhs ``[G, C, K]`` x rhs ``[G, K, N]`` -> ``[G, C, N]``."""
    if lhs.ndim != 3 or rhs.ndim != 3 or lhs.shape[0] != rhs.shape[0] or lhs.shape[2] != rhs.shape[1]:
        raise ValueError(f"capacity_matmul: lhs [G, C, K] and rhs [G, K, N], got {lhs.shape} and {rhs.shape}")
    return jnp.einsum("gck,gkn->gcn", lhs, rhs.astype(lhs.dtype), preferred_element_type=lhs.dtype).astype(lhs.dtype)
