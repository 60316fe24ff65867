"""Expert computation entry point: ``experts_forward`` (dispatch + grouped matmul + combine).

The dispatcher (``parallelism.dispatch``) and grouped-matmul backend (``parallelism.grouped_matmul``)
are chosen from the options and the active sharding context (``parallelism.logical.current()``).

Options (all optional):
- ``backend``: ``"auto"`` (GPU: triton, this project's Pallas-Triton kernels; else ragged_dot), ``"triton"``,
  ``"tokamax"``, ``"ragged_dot"``, ``"dense"`` (masked per-expert einsum reference), or
  ``"capacity"`` (drop-and-pad batched einsum ``[E, C, H] x [E, H, 2I]``; needs a capacity factor),
  or ``"hybrid"`` (dropless: the padded einsum for each expert's first ``C`` assignments, the
  ``"auto"`` grouped matmul for the overflow; needs a capacity factor, which here sets only the
  split: nothing drops; under EP the split is made on the receiving device).
- ``hybrid_overflow``: ``"hybrid"`` only: the overflow buffer's static rows as a fraction of the
  assignments (0.25); a batch with more overflow runs the grouped matmul on all its rows (a
  per-layer ``lax.cond``; still dropless). The grouped kernel's time follows its static rows.
- ``dispatcher``: ``"auto"`` (alltoall when the layout shards ``exp``, else local), ``"local"``,
  ``"alltoall"``, ``"allgather"``, ``"hierarchical"`` (``exp`` over a host axis and within-host axes: each
  token crosses to a host once; ``parallelism.dispatch``).
- ``capacity_factor``: None (dropless) or > 0: each expert keeps at most
  ``ceil(T_group * K / E * factor)`` assignments of one device's token group (Megatron's
  per-device capacity); dropped assignments contribute zero.
- ``drop_policy``: ``"probs"`` (keep the highest routing weights) or ``"position"`` (earliest tokens).
- ``a2a_impl``: ``"auto"`` (GPU: ragged, else dense), ``"ragged"`` (``jax.lax.ragged_all_to_all``;
  not implemented on XLA:CPU) or ``"dense"`` (fixed-size ``all_to_all``, worst-case buffers).
- ``dispatch_chunks``: ``"alltoall"`` / ``"hierarchical"``, dropless: each device's token rows dispatched in this
  many independent chunks (route, exchange, experts, return each), so that XLA's asynchronous collectives can move
  one chunk while the experts compute another (1: one exchange; a capacity factor needs 1, its drops are per token
  group).
- ``kernels``: the ``triton`` backend's fusions, GPU kernels and tiles
  (:class:`~moevlm_jax.parallelism.kernels.KernelsConfig` or a mapping of its fields).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any, Literal

import jax
import jax.numpy as jnp

from moevlm_jax.parallelism import fp8, logical
from moevlm_jax.parallelism.dispatch import (
    A2A_IMPLS,
    DISPATCHERS,
    ExpertTopology,
    MoeOptions,
    hierarchical_problem,
    resolve_topology,
    run_experts,
)
from moevlm_jax.parallelism.fp8 import Fp8Config
from moevlm_jax.parallelism.grouped_matmul import GPU_PLATFORMS, resolve_backend
from moevlm_jax.parallelism.kernels import KernelsConfig
from moevlm_jax.parallelism.permute import DROP_POLICIES

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class ExpertsConfig:
    """The ``compute.moe`` section: how the experts run (each key as in the module docstring)."""

    # auto (GPU: triton, this project's Pallas-Triton kernels; else ragged_dot) | triton | tokamax |
    # ragged_dot | dense (reference) | capacity (drop-and-pad einsum) | hybrid (padded einsum + grouped overflow)
    backend: Literal["auto", "triton", "tokamax", "ragged_dot", "dense", "capacity", "hybrid"] = "auto"
    # auto (alltoall when the layout shards 'exp', else local) | local | alltoall | allgather | hierarchical
    # (EP across hosts: each token crosses to a host once, fanned out to its experts inside the host; needs 'exp'
    # mapped to a host axis (stage, data, fsdp) and the within-host axes, e.g. layout ep_multinode)
    dispatcher: Literal["auto", "local", "alltoall", "allgather", "hierarchical"] = "auto"
    # null: dropless; else each expert keeps <= ceil(T*K/E*factor) per device group
    capacity_factor: float | None = None
    drop_policy: Literal["probs", "position"] = "probs"  # which assignments a full expert keeps
    a2a_impl: Literal["auto", "ragged", "dense"] = "auto"  # auto (GPU: ragged_all_to_all, else fixed-size all_to_all)
    hybrid_overflow: float = 0.25  # hybrid only: the overflow buffer's rows as a fraction of the assignments
    kernels: KernelsConfig = KernelsConfig()  # the triton backend's fusions, GPU kernels and tiles
    # alltoall / hierarchical, dropless: token chunks dispatched one after another, so that one chunk's exchange
    # can overlap another's experts (1: one exchange; the overlap is XLA's scheduler's, unmeasured on GPUs here)
    dispatch_chunks: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.kernels, Mapping):
            object.__setattr__(self, "kernels", KernelsConfig(**self.kernels))
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError("compute.moe.capacity_factor must be null (dropless) or > 0, "
                             f"got {self.capacity_factor!r}")
        if not self.hybrid_overflow > 0:
            raise ValueError(f"compute.moe.hybrid_overflow must be > 0 (a fraction of the assignments), got "
                             f"{self.hybrid_overflow!r}")
        if self.backend in ("capacity", "hybrid") and self.capacity_factor is None:
            raise ValueError(f"compute.moe.capacity_factor: backend '{self.backend}' needs one, e.g. 1.25")
        _check_chunks(self.dispatch_chunks, self.capacity_factor, self.dispatcher, "compute.moe.")

    def options(self) -> dict[str, Any]:
        """Keyword options for :func:`experts_forward` (each field as it is; ``kernels`` stays a KernelsConfig)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def kernels_summary(self, platform: str) -> str:
        """One line naming the kernels the experts run with on ``platform`` (logged once at the start of a run)."""
        backend = self.backend
        if backend not in ("capacity", "hybrid"):
            backend = resolve_backend(backend, platform)
        elif backend == "hybrid":
            backend = resolve_backend("auto", platform)
        return self.kernels.summary(backend, platform)


def _check_chunks(chunks: Any, factor: Any, dispatcher: str, prefix: str = "") -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{prefix}dispatch_chunks must be an integer >= 1, got {chunks!r}")
    if chunks > 1 and factor is not None:
        raise ValueError(f"{prefix}dispatch_chunks {chunks} needs dropless experts ({prefix}capacity_factor null): "
                         "a capacity is per token group, chunks would change which assignments drop")
    if chunks > 1 and dispatcher not in ("auto", "alltoall", "hierarchical"):
        raise ValueError(f"{prefix}dispatch_chunks {chunks} splits the all-to-all exchanges of the 'alltoall' and "
                         f"'hierarchical' dispatchers; dispatcher {dispatcher!r} has none")


DEFAULT_OPTIONS: dict[str, Any] = ExpertsConfig().options()


def _platform(topo: ExpertTopology) -> str:
    if topo.mesh is not None:
        return topo.mesh.devices.flat[0].platform
    return jax.default_backend()


def resolve_options(topo: ExpertTopology, **options: Any) -> MoeOptions:
    """Validate ``options`` against the topology and fill the ``"auto"`` choices."""
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS))
    if unknown:
        raise ValueError(f"experts_forward: unknown options {unknown}; known: {sorted(DEFAULT_OPTIONS)}")
    o = {**DEFAULT_OPTIONS, **options}
    platform = _platform(topo)
    factor = o["capacity_factor"]
    if factor is not None and not float(factor) > 0:
        raise ValueError(f"capacity_factor must be None (dropless) or > 0, got {factor!r}")
    if o["drop_policy"] not in DROP_POLICIES:
        raise ValueError(f"drop_policy must be one of {DROP_POLICIES}, got {o['drop_policy']!r}")
    overflow = None
    if not float(o["hybrid_overflow"]) > 0:
        raise ValueError(f"hybrid_overflow must be > 0 (a fraction of the assignments), got {o['hybrid_overflow']!r}")
    if o["backend"] in ("capacity", "hybrid"):
        if factor is None:
            what = "drop-and-pad einsum" if o["backend"] == "capacity" else "padded einsum up to the capacity"
            raise ValueError(f"backend '{o['backend']}' ({what}) needs capacity_factor, e.g. 1.25")
        backend = o["backend"]
        if backend == "hybrid":
            overflow = resolve_backend("auto", platform)
    else:
        backend = resolve_backend(o["backend"], platform)
    dispatcher = o["dispatcher"]
    if dispatcher == "auto":
        dispatcher = "alltoall" if topo.ep > 1 else "local"
    elif dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown dispatcher {dispatcher!r}; choose one of {('auto',) + DISPATCHERS}")
    if dispatcher != "local" and topo.ep == 1:
        raise ValueError(
            f"dispatcher {dispatcher!r} needs expert parallelism, but the layout maps logical axis 'exp' "
            f"to no mesh axis of size > 1; use dispatcher 'local' or 'auto'"
        )
    if dispatcher == "hierarchical" and topo.mesh is not None:
        problem = hierarchical_problem(topo.expert_axes)
        if problem:
            raise ValueError(problem)
    if dispatcher == "local" and topo.ep > 1:
        log.warning("dispatcher 'local' with 'exp' sharded over %s: every device gathers all experts", topo.expert_axes)
    a2a = o["a2a_impl"]
    if a2a == "auto":
        a2a = "ragged" if platform in GPU_PLATFORMS else "dense"
    elif a2a not in A2A_IMPLS:
        raise ValueError(f"unknown a2a_impl {a2a!r}; choose one of {('auto',) + A2A_IMPLS}")
    if a2a == "ragged" and platform == "cpu" and dispatcher in ("alltoall", "hierarchical") and factor is None:
        raise ValueError("a2a_impl 'ragged' uses jax.lax.ragged_all_to_all, not implemented on XLA:CPU; use 'dense'")
    _check_chunks(o["dispatch_chunks"], factor, dispatcher)
    kernels = o["kernels"]
    if isinstance(kernels, Mapping):
        kernels = KernelsConfig(**kernels)
    if not isinstance(kernels, KernelsConfig):
        raise TypeError(f"kernels must be a KernelsConfig or a mapping of its fields, got {kernels!r}")
    return MoeOptions(backend, dispatcher, None if factor is None else float(factor), o["drop_policy"], a2a, overflow,
                      float(o["hybrid_overflow"]), kernels, o["dispatch_chunks"])


def _validate(x, topk_idx, topk_weights, w_gate_up, w_down, topo: ExpertTopology, opts: MoeOptions) -> jax.Array:
    """Check shapes and divisibility; return w_gate_up as ``[E, H, 2, I]``."""
    if x.ndim != 2:
        raise ValueError(f"experts_forward: x must be [T, H], got {x.shape}")
    t, h = x.shape
    if topk_idx.shape != topk_weights.shape or topk_idx.ndim != 2 or topk_idx.shape[0] != t:
        raise ValueError(
            f"topk_idx and topk_weights must both be [T={t}, K], got {topk_idx.shape} and {topk_weights.shape}"
        )
    if w_down.ndim != 3:
        raise ValueError(f"w_down must be [E, I, H], got {w_down.shape}")
    e, i, hd = w_down.shape
    if w_gate_up.shape == (e, h, 2 * i):
        w_gate_up = w_gate_up.reshape(e, h, 2, i)
    elif w_gate_up.shape != (e, h, 2, i):
        raise ValueError(f"w_gate_up must be [E={e}, H={h}, 2I={2 * i}] (or [E, H, 2, I]), got {w_gate_up.shape}")
    if hd != h:
        raise ValueError(f"w_down [E, I, H] has H={hd} but x has H={h}")
    if topk_idx.shape[1] > e:
        raise ValueError(f"top-k {topk_idx.shape[1]} exceeds the {e} experts")
    if topo.mesh is None:
        return w_gate_up
    if opts.dispatcher != "local" and e % topo.ep:
        raise ValueError(
            f"{e} experts do not divide over the expert-parallel mesh axes {topo.expert_axes} "
            f"({topo.ep} devices); change the layout's 'exp' rule or the expert count"
        )
    if i % topo.etp:
        raise ValueError(
            f"moe intermediate size {i} does not divide over the expert-tensor-parallel mesh axes "
            f"{topo.etp_axes} ({topo.etp} devices) that 'moe_mlp' maps to"
        )
    n_tok = topo.size(topo.token_axes)
    if t % n_tok:
        raise ValueError(f"{t} token rows do not divide over the 'act_tokens' mesh axes {topo.token_axes} ({n_tok})")
    rep = topo.ep_replicated_axes
    group = t // n_tok * topo.size(topo.etp_token_axes)
    if opts.dispatcher in ("alltoall", "hierarchical") and rep and group % topo.size(rep):
        raise ValueError(
            f"tokens are replicated over the expert axes {rep}; the {opts.dispatcher} dispatcher splits each "
            f"device's {group} rows over them and needs them to divide by {topo.size(rep)}"
        )
    return w_gate_up


def experts_forward_with_stats(
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    fp8_config: Fp8Config | None = None,
    **options: Any,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Like :func:`experts_forward`, also returning ``{"dropped": [] int32, "assignments": [] int32}``
    (global counts of dropped and of all (token, expert) assignments)."""
    topo = resolve_topology(None if logical.in_manual_region() else logical.current())
    opts = resolve_options(topo, **options)
    if (fp8_config is not None and fp8_config.at("experts") is not None and fp8_config.experts_kernel == "triton"
            and opts.backend != "triton"):
        raise ValueError(f"compute.fp8.experts_kernel 'triton' (the FP8 grouped-matmul kernels) needs the experts' "
                         f"backend 'triton'; this run's resolves to {opts.backend!r} (set compute.moe.backend: triton "
                         "or compute.fp8.experts_kernel: qdq)")
    w4 = _validate(x, topk_idx, topk_weights, w_gate_up, w_down, topo, opts)
    log.debug("experts: %s on %s", opts, topo)
    axes = tuple(topo.mesh.axis_names) if topo.mesh is not None else ()  # run_experts' shard_map: all manual
    etp = tuple(topo.etp_axes) if topo.mesh is not None else ()
    with fp8.scope(fp8_config, row_axes=axes, weight_axes=etp):  # the expert matmuls read it (parallelism.permute)
        out, dropped = run_experts(
            x, topk_idx.astype(jnp.int32), topk_weights, w4.astype(x.dtype), w_down.astype(x.dtype), topo, opts
        )
    stats = {"dropped": dropped, "assignments": jnp.asarray(topk_idx.size, jnp.int32)}
    return out, stats


def experts_forward(
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    w_gate_up: jax.Array,
    w_down: jax.Array,
    fp8_config: Fp8Config | None = None,
    **options: Any,
) -> jax.Array:
    """SwiGLU experts: x ``[T, H]``, topk_idx/topk_weights ``[T, K]``, w_gate_up ``[E, H, 2I]``
    (gate half first; or ``[E, H, 2, I]``), w_down ``[E, I, H]`` -> ``[T, H]`` =
    sum_k w_k * expert_{idx_k}(x); the expert matmuls in FP8 with ``fp8_config`` (``parallelism.fp8``)."""
    return experts_forward_with_stats(x, topk_idx, topk_weights, w_gate_up, w_down, fp8_config, **options)[0]
