"""Training checkpoints with orbax: the train state pytree plus the data iterator state.

Each step directory ``<run_dir>/checkpoints/<step>/`` holds two items:
``state`` (``StandardSave``: params, optimizer state, step, rng key ... any pytree of arrays, typed
PRNG keys and ``None`` leaves included, written sharded by every process) and ``data`` (``JsonSave``:
the data iterator's ``get_state()``, a JSON-able dict or grain's bytes). Saves are periodic
(``save_interval_steps``) and asynchronous (the arrays are copied off the devices before ``save``
returns, the files are written in the background); ``max_to_keep`` newest steps are kept.
Restoring takes an abstract target (``jax.ShapeDtypeStruct`` leaves with ``.sharding``) so arrays
land directly on a mesh, in that layout, whatever layout they were saved from.

A checkpoint can be damaged after its commit (a truncated data file from a full disk or a partial
copy): only reading it tells. :func:`first_restorable` tries steps newest first and skips one that
does not restore with one log line (its step and the error's innermost cause), leaving it on disk;
:meth:`Checkpointer.restore_newest` does so for the train state, and a run that resumes past newer
checkpoints sets them aside (:func:`set_aside`, renamed, never deleted) so that it can write those
steps again.

Multi-host note: the data item is written by the primary process only, which is right for one
host; several hosts with their own iterators need one data item per process.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import gc
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from moevlm_jax.parallelism.multihost import agreed_max
from moevlm_jax.schema import ConfigError

log = logging.getLogger(__name__)

PyTree = Any
T = TypeVar("T")
_BYTES_KEY = "__bytes_b64__"
_REASON_CHARS = 300  # a skipped checkpoint's reason in its log line: the innermost error's first line, cut here


class RestoreError(Exception):
    """No checkpoint of those tried restores (each named with its reason), or the one asked for does not."""


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A checkpoint newer than the one restored that was not used: ``reason`` says why (the restore's
    error, or the explicit step asked for instead); ``kept_as`` where it is now when set aside."""

    step: int
    reason: str
    kept_as: str | None = None


@dataclasses.dataclass(frozen=True)
class Restored:
    """What :meth:`Checkpointer.restore_newest` restored: the ``step``, the train ``state`` and the data
    iterator's ``data_state``; ``skipped``: the newer checkpoints tried first that did not restore."""

    step: int
    state: PyTree
    data_state: Any
    skipped: tuple[Skipped, ...] = ()


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
        (ShapeDtypeStruct with shardings, see :func:`abstract_like`) shaped like the saved state. A
        checkpoint that does not restore is a :class:`RestoreError` naming it and the reason."""
        self.manager.wait_until_finished()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        if step not in self.manager.all_steps():
            raise FileNotFoundError(f"no checkpoint for step {step} in {self.directory}; have {self.all_steps()}")
        return restore_exactly(lambda s: self._read(target, s), step, str(self.directory))

    def restore_newest(self, target: PyTree, steps: Sequence[int] | None = None) -> Restored:
        """The newest of ``steps`` (default: every kept checkpoint) that restores, as :class:`Restored`;
        each newer one that does not is logged in one line and skipped (left on disk). Raises
        :class:`RestoreError` listing every step tried when none restores."""
        self.manager.wait_until_finished()
        steps = self.all_steps() if steps is None else list(steps)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        step, (state, data_state), skipped = first_restorable(
            steps, lambda s: self._read(target, s), str(self.directory))
        return Restored(step, state, data_state, tuple(skipped))

    def reload(self) -> None:
        """Read the steps on disk again (after :func:`set_aside` moved some)."""
        self.manager.reload()

    def _read(self, target: PyTree, step: int) -> tuple[PyTree, Any]:
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


def checkpoint_steps(directory: str | Path) -> list[int]:
    """The step directories in ``directory`` (orbax renames a step into place once written), ascending."""
    directory = Path(directory)
    return sorted(int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()) \
        if directory.is_dir() else []


def resume_steps(directory: str | Path, resume: bool, step: int | None = None) -> list[int]:
    """The checkpoint steps a run may resume from, newest first: with ``step`` (``train.resume_step``)
    that one alone (a ConfigError when it is not on disk), with ``resume`` every step on disk, else none.
    Raises when ``directory`` has checkpoints but the run does not resume (no silent overwrite, no
    silent resume)."""
    steps = checkpoint_steps(directory)
    if step is not None:
        if step not in steps:
            raise ConfigError(f"train.resume_step={step}: no checkpoint for step {step} in {directory} (have "
                              f"{steps or 'none'})")
        return [step]
    if steps and not resume:
        raise FileExistsError(
            f"{directory} already holds checkpoints (steps {steps}); pass --resume to continue that "
            f"run or --run-dir to start a new one")
    if resume and not steps:
        log.warning("--resume: no checkpoint in %s, starting from step 0", directory)
    return steps[::-1] if resume else []


def first_restorable(steps: Sequence[int], restore: Callable[[int], T], where: str) -> tuple[int, T, list[Skipped]]:
    """``(step, restore(step), skipped)`` for the newest of ``steps`` whose ``restore`` succeeds (on every
    process); each newer one that raises is logged in one line with the error's innermost cause and
    skipped (nothing is deleted). Raises :class:`RestoreError` naming every step tried when none restores."""
    skipped: list[Skipped] = []
    for step in sorted(steps, reverse=True):
        out, reason = attempt(restore, step)
        if reason is None:
            return step, out, skipped
        log.warning("checkpoint %d in %s does not restore, skipped (left on disk): %s", step, where, reason)
        skipped.append(Skipped(step, reason))
    tried = "; ".join(f"{s.step}: {s.reason}" for s in skipped)
    raise RestoreError(f"no checkpoint in {where} restores (tried {', '.join(str(s.step) for s in skipped)}): {tried}")


def restore_exactly(restore: Callable[[int], T], step: int, where: str) -> T:
    """``restore(step)``, or a :class:`RestoreError` naming the checkpoint and the reason (no fallback: the
    step was asked for)."""
    out, reason = attempt(restore, step)
    if reason is not None:
        raise RestoreError(f"checkpoint {step} in {where} does not restore: {reason}")
    return out


def attempt(restore: Callable[[int], T], step: int) -> tuple[T | None, str | None]:
    """``(restore(step), None)``, or ``(None, reason)`` when it raised in this or another process (all
    processes agree, so they go on to the same step); the reason is the innermost cause's first line."""
    out, reason = None, None
    with _unraisable_quiet():
        try:
            out = restore(step)
        except Exception as e:  # noqa: BLE001 - a damaged checkpoint fails in many ways (tensorstore, json, io)
            reason = error_reason(e)
    if agreed_max(int(reason is not None)) and reason is None:
        out, reason = None, "did not restore in another process"
    return out, reason


def error_reason(e: BaseException) -> str:
    """The first line of ``e``'s innermost cause (where a restore's long wrapped error says what failed),
    at most ``_REASON_CHARS`` characters."""
    while (e.__cause__ or e.__context__) is not None:
        e = e.__cause__ or e.__context__
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= _REASON_CHARS else text[:_REASON_CHARS - 3] + "..."


@contextlib.contextmanager
def _unraisable_quiet() -> Iterator[None]:
    """A failed restore leaves orbax's other reads as coroutines that Python reports, each with its long
    error, as 'Exception ignored' when they are collected: collected here, unprinted (the first error
    is the one reported)."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda _: None
    try:
        yield
    finally:
        gc.collect()
        sys.unraisablehook = hook


def set_aside(directory: str | Path, skipped: Sequence[Skipped], tag: str) -> list[Skipped]:
    """Rename the step directories of ``skipped`` in ``directory`` to ``<step>.<tag>`` (``-2``, ``-3`` .. when
    taken), where checkpoint listings no longer see them and nothing deletes them; returns them with
    ``kept_as``. Called by one process."""
    out = []
    for s in skipped:
        src = Path(directory) / str(s.step)
        dst, n = src.with_name(f"{s.step}.{tag}"), 1
        while dst.exists():
            n += 1
            dst = src.with_name(f"{s.step}.{tag}-{n}")
        src.rename(dst)
        out.append(dataclasses.replace(s, kept_as=str(dst)))
    return out
