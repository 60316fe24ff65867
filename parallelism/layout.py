"""Layouts: a mesh shape plus logical-axis rules, read from ``configs/layouts/*.yaml``.

A layout is data, not code: switching FSDP <-> 3D is choosing another YAML file. Mesh axes, in
device order from outermost to innermost (innermost = fastest links):
``stage`` (pipeline), ``data`` (replicated data parallel), ``fsdp`` (sharded data parallel),
``context`` (sequence/context parallel), ``expert`` (expert parallel), ``tensor`` (tensor parallel).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml
from jax.sharding import Mesh

from parallelism.logical import Rules, normalize_rules

MESH_AXES: tuple[str, ...] = ("stage", "data", "fsdp", "context", "expert", "tensor")
CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


@dataclasses.dataclass(frozen=True)
class Layout:
    """A named mesh shape (``-1`` = the remaining devices) and its logical-axis rules."""

    name: str
    mesh: dict[str, int]
    rules: Rules
    options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def resolved_mesh_shape(self, num_devices: int) -> dict[str, int]:
        """Mesh axis sizes with ``-1`` filled so that the product equals ``num_devices``."""
        return resolve_mesh_shape(self.mesh, num_devices, self.name)

    def make_mesh(self, devices: Sequence[jax.Device] | None = None) -> Mesh:
        """A ``jax.sharding.Mesh`` over ``devices`` (default: all) with every axis in MESH_AXES."""
        devices = list(devices if devices is not None else jax.devices())
        shape = self.resolved_mesh_shape(len(devices))
        sizes = tuple(shape[a] for a in MESH_AXES)
        try:
            from jax.experimental import mesh_utils

            arr = mesh_utils.create_device_mesh(sizes, devices=devices)
        except Exception:  # noqa: BLE001 - CPU host devices or odd topologies: plain order
            arr = np.asarray(devices, dtype=object).reshape(sizes)
        return Mesh(arr, MESH_AXES)


def resolve_mesh_shape(mesh: dict[str, int], num_devices: int, name: str = "layout") -> dict[str, int]:
    """Fill one ``-1`` axis with the remaining devices; every axis in MESH_AXES gets a size."""
    unknown = sorted(set(mesh) - set(MESH_AXES))
    if unknown:
        raise ValueError(f"{name}: unknown mesh axes {unknown}; known axes are {list(MESH_AXES)}")
    shape = {a: int(mesh.get(a, 1)) for a in MESH_AXES}
    fill = [a for a, n in shape.items() if n == -1]
    if len(fill) > 1:
        raise ValueError(f"{name}: only one mesh axis may be -1, got {fill}")
    bad = {a: n for a, n in shape.items() if n == 0 or n < -1}
    if bad:
        raise ValueError(f"{name}: mesh axis sizes must be positive or -1, got {bad}")
    fixed = math.prod(n for n in shape.values() if n != -1)
    if fill:
        if num_devices % fixed:
            raise ValueError(
                f"{name}: the fixed mesh axes multiply to {fixed}, which does not divide the "
                f"{num_devices} devices, so -1 on '{fill[0]}' cannot be filled"
            )
        shape[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"{name}: mesh axes {{{', '.join(f'{a}: {n}' for a, n in shape.items() if n > 1)}}} "
            f"multiply to {fixed} devices but {num_devices} are available; use -1 on one axis "
            f"to fill the rest"
        )
    return shape


def preset_name(name: str) -> str:
    """A preset name as its file is named: '+' reads as '_' (``tp+ep`` is ``tp_ep``)."""
    return name.replace("+", "_")


def load_layout(name_or_path: str | Path) -> Layout:
    """Load a layout preset by name (``configs/layouts/NAME.yaml``; ``tp+ep`` = ``tp_ep``) or from a
    YAML path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = CONFIG_DIR / "layouts" / f"{preset_name(str(name_or_path))}.yaml"
    if not path.exists():
        presets = sorted(p.stem for p in (CONFIG_DIR / "layouts").glob("*.yaml"))
        raise FileNotFoundError(f"no layout '{name_or_path}'; presets: {presets}, or give a .yaml path")
    raw = yaml.safe_load(path.read_text()) or {}
    return layout_from_dict(raw, default_name=path.stem)


def layout_from_dict(raw: dict[str, Any], default_name: str = "layout") -> Layout:
    """Build a Layout from its YAML mapping: ``mesh``, ``rules`` and free-form ``options``."""
    unknown = sorted(set(raw) - {"name", "mesh", "rules", "options", "description"})
    if unknown:
        raise ValueError(f"layout {default_name}: unknown keys {unknown}")
    return Layout(
        name=str(raw.get("name", default_name)),
        mesh={str(k): int(v) for k, v in (raw.get("mesh") or {}).items()},
        rules=normalize_rules(raw.get("rules") or []),
        options=dict(raw.get("options") or {}),
    )
