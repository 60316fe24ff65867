"""Logical axis names -> mesh axes: the one table that maps model axes onto devices.

Model code names tensor axes logically ("embed", "mlp", "heads", "exp", "act_batch", ...) and
calls :func:`constrain` on activations; parameters carry their logical names as Flax NNX
sharding metadata. Only this module (and the rest of ``parallelism/``) knows about meshes.

Rules follow Flax/MaxText semantics: a list of ``(logical_name, mesh_axes)`` pairs, where
``mesh_axes`` is a mesh axis name, a tuple of them, or ``None``. A logical name may appear in
several rules; for each dimension the first rule whose mesh axes are not already used by an
earlier dimension of the same tensor wins, so a tensor never uses a mesh axis twice.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None
Rules = tuple[tuple[str, MeshAxes], ...]
LogicalAxes = Sequence[str | None]


@dataclasses.dataclass(frozen=True)
class ShardingContext:
    """The active mesh, logical-axis rules and the layout's options (``parallelism.layout.LayoutOptions``)."""

    mesh: Mesh
    rules: Rules
    options: Any = None


_CONTEXT: contextvars.ContextVar[ShardingContext | None] = contextvars.ContextVar(
    "moevlm_sharding_context", default=None
)
_MANUAL: contextvars.ContextVar[bool] = contextvars.ContextVar("moevlm_manual", default=False)


def normalize_rules(rules: Sequence[Sequence[Any]]) -> Rules:
    """Rules from YAML-ish lists (``[name, axes]`` with axes a str, list or null) to tuples."""
    out = []
    for rule in rules:
        if len(rule) != 2:
            raise ValueError(f"a logical-axis rule is [logical_name, mesh_axes], got {rule!r}")
        name, axes = rule
        if isinstance(axes, list):
            axes = tuple(axes)
        if isinstance(axes, tuple) and len(axes) == 1:
            axes = axes[0]
        out.append((str(name), axes))
    return tuple(out)


@contextlib.contextmanager
def sharding_context(mesh: Mesh, rules: Sequence[Sequence[Any]], options: Any = None) -> Iterator[ShardingContext]:
    """Make ``mesh`` and ``rules`` the ones :func:`constrain` and the dispatchers use; ``options``
    (a layout's ``LayoutOptions``) reach e.g. ``parallelism.pipeline``."""
    if options is not None and not hasattr(options, "context_parallel"):  # (layout imports this module)
        raise TypeError(f"sharding_context options must be a parallelism.layout.LayoutOptions, got {options!r}")
    ctx = ShardingContext(mesh, normalize_rules(rules), options)
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


def current() -> ShardingContext | None:
    """The active sharding context, or None when running unsharded."""
    return _CONTEXT.get()


@contextlib.contextmanager
def manual_region() -> Iterator[None]:
    """Mark code running inside ``shard_map`` so :func:`constrain` leaves its values alone."""
    token = _MANUAL.set(True)
    try:
        yield
    finally:
        _MANUAL.reset(token)


def in_manual_region() -> bool:
    """Whether the caller runs inside ``shard_map`` (marked by :func:`manual_region`)."""
    return _MANUAL.get()


def mesh_axes_for(name: str | None, rules: Rules, used: set[str] | None = None) -> MeshAxes:
    """The mesh axes a logical name maps to, skipping rules whose axes are in ``used``."""
    if name is None:
        return None
    used = used or set()
    for logical, axes in rules:
        if logical != name:
            continue
        if axes is None:
            return None
        flat = (axes,) if isinstance(axes, str) else tuple(axes)
        if any(a in used for a in flat):
            continue
        return axes
    return None


def logical_to_spec(axes: LogicalAxes | None, rules: Rules, mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec over mesh axes for a tensor whose dimensions carry logical ``axes``.

    Mesh axes of size 1 are dropped when ``mesh`` is given, so specs stay readable.
    """
    if axes is None:
        return PartitionSpec()
    used: set[str] = set()
    out: list[MeshAxes] = []
    for name in axes:
        mapped = mesh_axes_for(name, rules, used)
        if mapped is not None:
            flat = (mapped,) if isinstance(mapped, str) else tuple(mapped)
            if mesh is not None:
                flat = tuple(a for a in flat if mesh.shape[a] > 1)
            used.update(flat)
            mapped = None if not flat else (flat[0] if len(flat) == 1 else flat)
        out.append(mapped)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def flat_axes(entry: MeshAxes) -> tuple[str, ...]:
    """A rule's mesh axes as a tuple: None -> (), 'a' -> ('a',), ('a', 'b') as is."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def axis_size(mesh: Mesh | Mapping[str, int], axes: MeshAxes) -> int:
    """Number of devices a dimension mapped to ``axes`` is split over (a Mesh or its axis sizes)."""
    shape = mesh.shape if isinstance(mesh, Mesh) else mesh
    return math.prod(int(shape[a]) for a in flat_axes(axes))


def data_parallel_size(rules: Rules, mesh: Mesh | Mapping[str, int]) -> int:
    """Devices the batch rows are split over: the mesh axes the rule for 'act_batch' names (Megatron's
    DP ranks: the trainer's loss groups and the router's per-rank aux loss)."""
    return axis_size(mesh, mesh_axes_for("act_batch", rules))


def named_sharding(axes: LogicalAxes | None, ctx: ShardingContext | None = None) -> NamedSharding:
    """NamedSharding for logical ``axes`` under the active (or given) context."""
    ctx = ctx or current()
    if ctx is None:
        raise RuntimeError("named_sharding() needs an active sharding_context(mesh, rules)")
    return NamedSharding(ctx.mesh, logical_to_spec(axes, ctx.rules, ctx.mesh))


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    """Constrain activation ``x`` to the sharding its logical ``axes`` map to; identity when no
    mesh is active or inside a manual (shard_map) region."""
    ctx = _CONTEXT.get()
    if ctx is None or _MANUAL.get():
        return x
    if len(axes) != x.ndim:
        raise ValueError(f"constrain: {len(axes)} logical axes {tuple(axes)} for a rank-{x.ndim} array")
    spec = logical_to_spec(axes, ctx.rules, ctx.mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, spec))


def split_counts(axes: LogicalAxes) -> tuple[int, ...]:
    """How many devices each dimension of an activation with logical ``axes`` is split over under the active
    context (all 1 without one, or inside a manual region, where :func:`constrain` is the identity)."""
    ctx = _CONTEXT.get()
    if ctx is None or _MANUAL.get():
        return (1,) * len(axes)
    spec = logical_to_spec(axes, ctx.rules, ctx.mesh)
    return tuple(axis_size(ctx.mesh, spec[i] if i < len(spec) else None) for i in range(len(axes)))


def check_divisible(name: str, shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> None:
    """Raise a clear error when a dimension does not divide by the devices it is split over."""
    for dim, (size, axes) in enumerate(zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec)))):
        n = axis_size(mesh, axes)
        if n > 1 and size % n:
            raise ValueError(
                f"{name}: dimension {dim} of size {size} is split over mesh axes {axes} "
                f"({n} devices) and does not divide; change the layout or the model config"
            )
