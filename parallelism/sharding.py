"""Shardings of whole trees under a layout: parameters from their logical-axis metadata, optimizer
state like the parameters it mirrors, batches along their row axis.

Generic (no model knowledge): everything comes from the Flax NNX ``out_sharding`` metadata of
parameters and the layout's logical-axis rules (``parallelism.logical``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moevlm_jax.parallelism.logical import Rules, check_divisible, logical_to_spec, normalize_rules

log = logging.getLogger(__name__)

PyTree = Any
# Row (batch) axis of each batch key (ARCHITECTURE.md "The batch"); every other key has it at 0.
BATCH_ROW_AXIS: dict[str, int] = {"positions": 1}


def path_str(key_path: Sequence[Any]) -> str:
    """'/'-joined names of a jax key path (dict keys, attributes, indexes), without the trailing
    'value' of nnx Variables: the one parameter-path spelling (shardings, optimizer groups, logs)."""
    names = [next((str(getattr(k, a)) for a in ("key", "name", "idx") if hasattr(k, a)), str(k)) for k in key_path]
    while names and names[-1] in ("value", "raw_value") and type(key_path[len(names) - 1]).__name__ == "GetAttrKey":
        names.pop()
    return "/".join(names)


def replicated(mesh: Mesh) -> NamedSharding:
    """The fully replicated sharding on ``mesh``."""
    return NamedSharding(mesh, PartitionSpec())


def param_shardings(abstract_state: nnx.State, mesh: Mesh, rules: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """Pure-dict tree (``nnx.to_pure_dict`` structure) of NamedShardings for the Variables of
    ``abstract_state``, from their logical ``out_sharding`` names under ``rules``; raises when a
    dimension does not divide over the devices it is split over."""
    rules = normalize_rules(rules)

    def one(key_path: Sequence[Any], var: nnx.Variable) -> NamedSharding:
        names = var.get_metadata().get("out_sharding")
        spec = logical_to_spec(names, rules, mesh)
        check_divisible(path_str(key_path), var.shape, spec, mesh)
        return NamedSharding(mesh, spec)

    return map_variables(one, abstract_state)


def map_variables(fn: Callable[[Sequence[Any], nnx.Variable], Any], abstract_state: nnx.State) -> dict[str, Any]:
    """Pure-dict tree (``nnx.to_pure_dict`` structure) of ``fn(key_path, variable)`` for the Variables of
    ``abstract_state`` (their metadata, e.g. the logical ``out_sharding`` names, read where the pure tree has none)."""
    pure = nnx.to_pure_dict(abstract_state)
    flat = jax.tree_util.tree_flatten_with_path(pure)[0]
    variables = jax.tree.leaves(abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    if len(flat) != len(variables):
        raise ValueError(f"map_variables: {len(variables)} variables but {len(flat)} pure-dict leaves")
    return jax.tree.unflatten(jax.tree.structure(pure), [fn(kp, v) for (kp, _), v in zip(flat, variables)])


def shardings_like(tree: PyTree, reference: PyTree, reference_shardings: PyTree, mesh: Mesh) -> PyTree:
    """Shardings for ``tree`` (e.g. optimizer state of abstract arrays): a leaf whose key path ends
    with the path of a ``reference`` leaf (a parameter) of the same shape takes that leaf's sharding
    (Adam moments follow their parameter); every other leaf (counters, scalars) is replicated."""
    by_path: dict[str, tuple[tuple[int, ...], Any]] = {}
    for (kp, x), (_, s) in zip(jax.tree_util.tree_flatten_with_path(reference)[0],
                               jax.tree_util.tree_flatten_with_path(reference_shardings)[0]):
        by_path[path_str(kp)] = (tuple(x.shape), s)

    def one(key_path: Sequence[Any], x: Any) -> NamedSharding:
        names = path_str(key_path).split("/")
        for i in range(len(names)):
            hit = by_path.get("/".join(names[i:]))
            if hit is not None and hit[0] == tuple(x.shape):
                return hit[1]
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(one, tree)


def batch_spec(key: str, ndim: int, rules: Rules | Sequence[Sequence[Any]], mesh: Mesh,
               leading: int = 0) -> PartitionSpec:
    """PartitionSpec of batch array ``key`` of rank ``ndim``: logical ``act_batch`` on its row axis
    (``BATCH_ROW_AXIS``, shifted by ``leading`` extra axes such as a microbatch axis), nothing else."""
    axes: list[str | None] = [None] * ndim
    axes[leading + BATCH_ROW_AXIS.get(key, 0)] = "act_batch"
    return logical_to_spec(axes, normalize_rules(rules), mesh)


def batch_shardings(shapes: Mapping[str, Sequence[int]], mesh: Mesh, rules: Sequence[Sequence[Any]],
                    leading: int = 0) -> dict[str, NamedSharding]:
    """NamedSharding per batch key (``shapes``: key -> array shape) with rows over the
    ``act_batch`` mesh axes; raises when the rows do not divide over them."""
    out = {}
    for key, shape in shapes.items():
        spec = batch_spec(key, len(shape), rules, mesh, leading)
        check_divisible(f"batch['{key}']", tuple(shape), spec, mesh)
        out[key] = NamedSharding(mesh, spec)
    return out


def host_rows(x: jax.Array, axis: int = 0) -> np.ndarray:
    """This process's rows of a global array sharded along ``axis`` (all rows on one process)."""
    if jax.process_count() == 1:
        return np.asarray(x)
    pieces: dict[int, np.ndarray] = {}
    for shard in x.addressable_shards:
        start = shard.index[axis].start or 0
        pieces.setdefault(start, np.asarray(shard.data))
    return np.concatenate([pieces[k] for k in sorted(pieces)], axis=axis)
