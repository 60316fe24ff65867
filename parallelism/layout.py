"""Layouts: a mesh shape plus logical-axis rules (``configs/layouts/*.yaml``, loaded by the one config
loader: ``moevlm_jax.config.load_layout``).

A layout is data, not code: switching FSDP <-> 3D is choosing another YAML file. Mesh axes, in
device order from outermost to innermost (innermost = fastest links):
``stage`` (pipeline), ``data`` (replicated data parallel), ``fsdp`` (sharded data parallel),
``context`` (sequence/context parallel), ``expert`` (expert parallel), ``tensor`` (tensor parallel).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import numpy as np
from flax.core import FrozenDict
from jax.experimental import mesh_utils
from jax.sharding import Mesh

from moevlm_jax.parallelism.cpu_threads import check_collective_threads
from moevlm_jax.parallelism.logical import normalize_rules

MESH_AXES: tuple[str, ...] = ("stage", "data", "fsdp", "context", "expert", "tensor")
HOST_AXES: tuple[str, ...] = ("stage", "data", "fsdp")  # may cross hosts; the others stay within one


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """A layout's ``options.pipeline`` (parallelism.pipeline; checked against the stage count there)."""

    schedule: Literal["gpipe", "circular"] = "gpipe"  # gpipe: each stage once; circular: interleaved repeats
    microbatches: int | None = None  # microbatches per batch (null: the stage count)
    repeats: int | None = None  # chunks per stage (null: 1 for gpipe, 2 for circular)
    # decoder layers per chunk (stages x repeats entries, summing to the layer count), or
    # {stack axis: counts}; null: an even split (a short chunk is padded with masked identity slots)
    stage_layers: tuple[int, ...] | dict[str, tuple[int, ...]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stage_layers, Mapping):  # hashable
            object.__setattr__(self, "stage_layers", FrozenDict({str(k): tuple(v)
                                                                 for k, v in self.stage_layers.items()}))

    def stage_layers_by_axis(self) -> dict[str, tuple[int, ...]]:
        """``{stack axis: per-chunk layer counts}`` (a bare list is the decoder's ``layers`` axis)."""
        if self.stage_layers is None:
            return {}
        if isinstance(self.stage_layers, Mapping):
            return dict(self.stage_layers)
        return {"layers": tuple(self.stage_layers)}


@dataclasses.dataclass(frozen=True)
class LayoutOptions:
    """What a layout sets beyond its mesh and rules."""

    pipeline: PipelineOptions | None = None  # the pipeline schedule when the mesh has a stage axis
    context_parallel: Literal["allgather", "ring"] = "allgather"  # K/V over sequence shards: all-gathered or a ring


@dataclasses.dataclass(frozen=True)
class Layout:
    """A named mesh shape (``-1`` = the remaining devices) and its logical-axis rules."""

    name: str = "layout"  # a label for logs
    description: str = ""  # one line on what the layout is for
    # axis sizes in device order, outermost first: stage, data, fsdp, context, expert, tensor
    # (-1: the devices left over; axes not named have size 1)
    mesh: dict[str, int] = dataclasses.field(default_factory=lambda: {"fsdp": -1})
    # [logical axis, mesh axis | [mesh axes] | null] pairs; for each tensor dimension the first rule
    # whose mesh axes the tensor does not use yet wins (parallelism.logical)
    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = ()
    options: LayoutOptions = LayoutOptions()  # pipeline schedule, context-parallel variant
    # hosts each mesh axis spans when the run has several (MaxText's dcn_*), e.g. {fsdp: 2}; null: the
    # outermost of stage, data, fsdp that divide (tensor, expert and context stay within a host)
    hosts: dict[str, int] | None = None

    def __post_init__(self) -> None:

        unknown = [a for a in self.mesh if a not in MESH_AXES]
        if unknown:
            import difflib

            near = difflib.get_close_matches(unknown[0], MESH_AXES, n=1)
            raise ValueError(f"unknown mesh axis 'layout.mesh.{unknown[0]}'"
                             f"{f'; did you mean {near[0]!r}?' if near else ''} (mesh axes: {', '.join(MESH_AXES)})")
        object.__setattr__(self, "rules", normalize_rules(self.rules))

    def resolved_mesh_shape(self, num_devices: int) -> dict[str, int]:
        """Mesh axis sizes with ``-1`` filled so that the product equals ``num_devices``."""
        return resolve_mesh_shape(self.mesh, num_devices, self.name)

    def host_split(self, shape: Mapping[str, int], hosts: int) -> dict[str, int]:
        """How many hosts each mesh axis spans (MaxText's ``dcn_*``): ``hosts`` per axis as the layout
        gives them, else the outermost of stage, data, fsdp that divide (the axes that talk most --
        context, expert, tensor -- stay within a host). Raises ValueError naming what does not fit."""
        if hosts <= 1:
            return dict.fromkeys(MESH_AXES, 1)
        if self.hosts is not None:
            split = {a: int(self.hosts.get(a, 1)) for a in MESH_AXES}
            bad = [a for a, n in split.items() if n < 1 or shape[a] % n]
            if bad or math.prod(split.values()) != hosts:
                raise ValueError(f"layout.hosts {dict(self.hosts)} must divide the mesh axes {dict(shape)} and "
                                 f"multiply to the {hosts} hosts")
            return split
        split, left = dict.fromkeys(MESH_AXES, 1), hosts
        for axis in HOST_AXES:
            split[axis] = math.gcd(shape[axis], left)
            left //= split[axis]
        if left != 1:
            inner = {a: shape[a] for a in MESH_AXES if a not in HOST_AXES and shape[a] > 1}
            raise ValueError(
                f"layout '{self.name}': the mesh {{{', '.join(f'{a}: {n}' for a, n in shape.items() if n > 1)}}} "
                f"cannot spread over {hosts} hosts: the axes that may cross hosts ({', '.join(HOST_AXES)}) do not "
                f"hold {hosts} host groups, and the within-host axes {inner or '(none)'} would exceed a host's "
                f"devices; give stage / data / fsdp a multiple of {hosts}, or set layout.hosts")
        return split

    def make_mesh(self, devices: Sequence[jax.Device] | None = None, hosts: Sequence[int] | None = None) -> Mesh:
        """A ``jax.sharding.Mesh`` over ``devices`` (default: all) with every axis in MESH_AXES. With
        several hosts (``hosts``: each device's host; default each device's process) the mesh is
        hybrid: the axes :meth:`host_split` spreads over hosts are outermost, every host holds a whole
        block of the within-host axes."""
        devices = list(devices if devices is not None else jax.devices())
        shape = self.resolved_mesh_shape(len(devices))
        sizes = tuple(shape[a] for a in MESH_AXES)
        host_of = list(hosts) if hosts is not None else [d.process_index for d in devices]
        groups: dict[int, list] = {}
        for d, h in zip(devices, host_of):
            groups.setdefault(h, []).append(d)
        if len(groups) > 1:
            arr = _hybrid(shape, self.host_split(shape, len(groups)), [groups[h] for h in sorted(groups)])
        else:
            try:

                arr = mesh_utils.create_device_mesh(sizes, devices=devices)
            except Exception:  # noqa: BLE001 - CPU host devices or odd topologies: plain order
                arr = np.asarray(devices, dtype=object).reshape(sizes)
        check_collective_threads(len(devices), devices[0].platform)  # warns if XLA:CPU may deadlock
        return Mesh(arr, MESH_AXES)


def _hybrid(shape: Mapping[str, int], split: Mapping[str, int], groups: list[list]) -> np.ndarray:
    """Device array ``[axis sizes]``: host h holds the block ``split``-index h of every axis (host axes
    outermost), its own devices in order inside the block."""
    inner = [shape[a] // split[a] for a in MESH_AXES]
    outer = [split[a] for a in MESH_AXES]
    per_host = math.prod(inner)
    if any(len(g) != per_host for g in groups):
        raise ValueError(f"every host needs {per_host} devices for this mesh, got {[len(g) for g in groups]}")
    blocks = np.empty(outer + inner, dtype=object)
    for h, idx in enumerate(np.ndindex(*outer)):
        blocks[idx] = np.asarray(groups[h], dtype=object).reshape(inner)
    order = [k for i in range(len(MESH_AXES)) for k in (i, len(MESH_AXES) + i)]  # (outer_0, inner_0, ...)
    return blocks.transpose(order).reshape([shape[a] for a in MESH_AXES])


def resolve_mesh_shape(mesh: dict[str, int], num_devices: int, name: str = "layout") -> dict[str, int]:
    """Fill one ``-1`` axis with the remaining devices; every axis in MESH_AXES gets a size."""
    unknown = sorted(set(mesh) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"layout.mesh of '{name}': unknown mesh axes {unknown}; known axes are {list(MESH_AXES)}")
    shape = {a: int(mesh.get(a, 1)) for a in MESH_AXES}
    fill = [a for a, n in shape.items() if n == -1]
    if len(fill) > 1:
        raise ValueError(f"layout.mesh of '{name}': only one mesh axis may be -1, got {fill}")
    bad = {a: n for a, n in shape.items() if n == 0 or n < -1}
    if bad:
        raise ValueError(f"layout.mesh of '{name}': mesh axis sizes must be positive or -1, got {bad}")
    fixed = math.prod(n for n in shape.values() if n != -1)
    if fill:
        if num_devices % fixed:
            raise ValueError(
                f"layout.mesh of '{name}': the fixed mesh axes multiply to {fixed}, which does not divide the "
                f"{num_devices} devices, so -1 on '{fill[0]}' cannot be filled"
            )
        shape[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"layout.mesh of '{name}': axes {{{', '.join(f'{a}: {n}' for a, n in shape.items() if n > 1)}}} multiply "
            f"to {fixed} devices but {num_devices} are available; use -1 on one axis to fill the rest"
        )
    return shape
