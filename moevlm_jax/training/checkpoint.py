"""Training checkpoints with orbax: the train state pytree plus the data iterator state.

Each step directory ``<run_dir>/checkpoints/<step>/`` holds two items:
``state`` (``StandardSave``: params, optimizer state, step, rng key ... any pytree of arrays, typed
PRNG keys and ``None`` leaves included, written sharded by every process) and ``data`` (``JsonSave``:
the data iterator's ``get_state()``, a JSON-able dict or grain's bytes). Saves are periodic
(``save_interval_steps``) and asynchronous (the arrays are copied off the devices before ``save``
returns, the files are written in the background); ``max_to_keep`` newest steps are kept.
Restoring takes an abstract target (``jax.ShapeDtypeStruct`` leaves with ``.sharding``) so arrays
land directly on a mesh, in that layout, whatever layout they were saved from.

Multi-host note: the data item is written by the primary process only, which is right for one
host; several hosts with their own iterators need one data item per process.
"""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

PyTree = Any
_BYTES_KEY = "__bytes_b64__"


def abstract_like(tree: PyTree, shardings: PyTree | None = None, mesh: Mesh | None = None) -> PyTree:
    """ShapeDtypeStruct tree for ``tree`` (arrays or ShapeDtypeStructs) carrying ``shardings`` (a tree
    of Shardings shaped like ``tree``) or each leaf's own; with ``mesh``, leaves that are not
    NamedSharded (scalars a jitted init left on one device) become replicated on ``mesh``."""
    def leaf(x: Any, s: Any) -> jax.ShapeDtypeStruct:
        if mesh is not None and not isinstance(s, NamedSharding):
            s = NamedSharding(mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    if shardings is None:
        return jax.tree.map(lambda x: leaf(x, getattr(x, "sharding", None)), tree)
    return jax.tree.map(leaf, tree, shardings)


def _jsonable(obj: Any) -> Any:
    """numpy scalars/arrays -> python, bytes -> {__bytes_b64__: ...}, so JsonSave can write it."""
    if isinstance(obj, bytes):
        return {_BYTES_KEY: base64.b64encode(obj).decode("ascii")}
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    return obj


def _from_jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {_BYTES_KEY}:
            return base64.b64decode(obj[_BYTES_KEY])
        return {k: _from_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_from_jsonable(v) for v in obj]
    return obj


class Checkpointer:
    """Periodic, retained, async orbax checkpoints of (train state, data iterator state)."""

    def __init__(self, directory: str | Path, *, save_every: int = 500, keep: int = 3,
                 async_save: bool = True) -> None:
        self.directory = Path(directory).absolute()
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=max(save_every, 1),
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step, or None."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """Steps of all kept checkpoints, ascending."""
        return sorted(self.manager.all_steps())

    def should_save(self, step: int) -> bool:
        """True at periodic save steps (``save_every`` > 0 divides ``step``) and on preemption."""
        if step in self.manager.all_steps():
            return False
        periodic = self.save_every > 0 and step % self.save_every == 0
        return periodic or self.manager.reached_preemption(step)

    def save(self, step: int, state: PyTree, data_state: dict[str, Any] | bytes | None = None, *,
             force: bool = False) -> bool:
        """Start saving ``state`` (arrays, any sharding) and ``data_state`` at ``step`` if it is a
        save step (or ``force``); returns whether a save started. Non-blocking when async."""
        if step in self.manager.all_steps():
            return False
        if not force and not self.should_save(step):
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave(_jsonable({"iterator": data_state})),
        )
        started = self.manager.save(step, args=args, force=True)
        if started:
            log.info("checkpoint: saving step %d to %s", step, self.directory)
        return started

    def restore(self, target: PyTree, step: int | None = None) -> tuple[PyTree, Any]:
        """(state, data_state) at ``step`` (default: latest). ``target`` is an abstract tree
        (ShapeDtypeStruct with shardings, see :func:`abstract_like`) shaped like the saved state."""
        self.manager.wait_until_finished()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        out = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), data=ocp.args.JsonRestore()))
        log.info("checkpoint: restored step %d from %s", step, self.directory)
        return out["state"], _from_jsonable(out["data"] or {}).get("iterator")

    def wait(self) -> None:
        """Block until pending async saves are on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release the manager's threads."""
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def resume_step(directory: str | Path, resume: bool) -> int | None:
    """Latest checkpoint step to resume from, None for a fresh start; raises when ``directory`` has
    checkpoints but ``resume`` is False (no silent overwrite, no silent resume)."""
    directory = Path(directory)
    steps = sorted(int(p.name) for p in directory.glob("*") if p.is_dir() and p.name.isdigit()) \
        if directory.exists() else []
    if steps and not resume:
        raise FileExistsError(
            f"{directory} already holds checkpoints (steps {steps}); pass --resume to continue that "
            f"run or --run-dir to start a new one")
    if resume and not steps:
        log.warning("--resume: no checkpoint in %s, starting from step 0", directory)
    return steps[-1] if (resume and steps) else None
