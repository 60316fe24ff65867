"""Training checkpoints with orbax: the train state pytree plus the data iterator state.

Each step directory ``<run_dir>/checkpoints/<step>/`` holds two items:
``state`` (orbax's PyTree format, as ``StandardSave`` writes it: params, optimizer state, step, rng key
... any pytree of arrays, typed PRNG keys and ``None`` leaves included, written sharded by every
process) and ``data`` (``JsonSave``: the data iterator's ``get_state()``, a JSON-able dict or grain's
bytes). Saves are periodic (``save_interval_steps``) and asynchronous (the arrays are copied off the
devices before ``save`` returns, the files are written in the background); ``max_to_keep`` newest steps
are kept. Restoring takes an abstract target (``jax.ShapeDtypeStruct`` leaves with ``.sharding``) so
arrays land directly on a mesh, in that layout, whatever layout they were saved from.

A periodic save holds one host copy of the process's whole state until it is written (so that training
can go on updating, and donating, the device arrays meanwhile). A *streamed* save
(``save(..., streamed=True)``, the end of a run) holds at most ``stream_host_gb`` of it at once: the
arrays are copied off the devices in batches of that size after ``save`` is called, each batch written
before the next is copied (orbax's ``save_device_host_concurrent_gb``, which applies only to arrays whose
transfer is deprioritized); the state must not change meanwhile, so a streamed save returns once it is
on disk. An array larger than the budget is a batch of its own. :attr:`Checkpointer.last_host_peak_bytes`
is what the last save held on the host at most, counted from orbax's transfer / write callbacks.

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
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# orbax has no public name for these two (the one place this module reaches into orbax's internals; written
# against orbax-checkpoint 0.12.8, the version pyproject asks for): the priority the jax.Array handler's callback
# gives each array (only arrays given ASYNCHRONOUS_DEPRIORITIZED are held to save_device_host_concurrent_gb), and the
# array-metadata store the default jax.Array handler writes with (so that the files are StandardSave's). Where they
# are missing (an environment that ignores the pin), checkpoints are orbax's plain PyTree ones and a streamed save is
# an ordinary one, said in one line when it happens.
try:
    from orbax.checkpoint._src.metadata.array_metadata_store import Store as _ArrayMetadataStore
    from orbax.checkpoint._src.serialization.types import TransferPriority as _TransferPriority
except ImportError:  # pragma: no cover - only with an orbax other than the pinned one
    _ArrayMetadataStore = _TransferPriority = None

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


class _ExpectedOrbaxWarning(logging.Filter):
    """Drops the warning orbax logs (through absl) at each streamed save, whose arrays are all deprioritized on
    purpose: "No prioritized params found for saving. D2H for all values will be scheduled asynchronously"."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No prioritized params found for saving")


def local_bytes(x: Any) -> int:
    """The bytes of ``x``'s data this process holds (each distinct shard once, replicas not counted again): what
    a save of ``x`` can copy to this process's host at most; 0 for a leaf that is not a ``jax.Array``."""
    if not isinstance(x, jax.Array):
        return 0
    shards = {tuple((i.start, i.stop, i.step) for i in s.index) for s in x.addressable_shards}
    return len(shards) * int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * x.dtype.itemsize


class HostBytes:
    """The jax.Array handler's serialization callback (orbax's ``SerializationStatusCallback``): the transfer
    priority of each array (SYNCHRONOUS, all copied before ``save`` returns; ASYNCHRONOUS_DEPRIORITIZED while a
    streamed save runs, copied in memory-budgeted batches after it), and the state's bytes on the host, counted
    from the transfer's end to the write's (each array's :func:`local_bytes`), with their ``peak``. orbax calls it
    from its own threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.streamed = False
        self.sizes: dict[str, int] = {}
        self.held = self.peak = 0
        self.unknown: set[str] = set()  # arrays orbax reported that the state given to start() does not have

    def start(self, state: PyTree, streamed: bool) -> None:
        """Before a save of ``state`` (none other under way): the sizes of its arrays, the counts reset."""
        sizes = {jax.tree_util.keystr(path): local_bytes(x)
                 for path, x in jax.tree_util.tree_flatten_with_path(state)[0]}
        with self._lock:
            self.streamed, self.sizes, self.held, self.peak, self.unknown = streamed, sizes, 0, 0, set()

    def _size(self, keypath: Any) -> int:
        key = jax.tree_util.keystr(tuple(keypath))
        if key not in self.sizes:
            self.unknown.add(key)
        return self.sizes.get(key, 0)

    def key_priority(self, keypath: Any) -> _TransferPriority:
        return _TransferPriority.ASYNCHRONOUS_DEPRIORITIZED if self.streamed else _TransferPriority.SYNCHRONOUS

    def on_transfer_start(self, keypath: Any) -> None:
        pass

    def on_transfer_end(self, keypath: Any) -> None:
        with self._lock:
            self.held += self._size(keypath)
            self.peak = max(self.peak, self.held)

    def on_write_start(self, keypath: Any) -> None:
        pass

    def on_write_end(self, keypath: Any) -> None:
        with self._lock:
            self.held -= self._size(keypath)


def state_handler(host_bytes: HostBytes, stream_host_gb: float) -> ocp.PyTreeCheckpointHandler:
    """The ``state`` item's handler: StandardSave's (the same files), with a type registry whose jax.Array
    handler reports to ``host_bytes`` and a device-to-host budget of ``stream_host_gb`` GB (10**9 bytes) for the
    arrays ``host_bytes`` deprioritizes (a streamed save's)."""
    if _TransferPriority is None:
        return ocp.PyTreeCheckpointHandler()
    handlers = [(t, ocp.type_handlers.ArrayHandler(array_metadata_store=_ArrayMetadataStore(), callback=host_bytes)
                 if t is jax.Array else ocp.type_handlers.get_type_handler(t))
                for t in ocp.type_handlers.supported_types()]
    return ocp.PyTreeCheckpointHandler(
        save_device_host_concurrent_gb=stream_host_gb,
        type_handler_registry=ocp.type_handlers.create_type_handler_registry(*handlers))


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
    """Periodic, retained, async orbax checkpoints of (train state, data iterator state); a streamed save
    (the end of a run) holds at most ``stream_host_gb`` GB of the state on the host at once."""

    def __init__(self, directory: str | Path, *, save_every: int = 500, keep: int = 3,
                 async_save: bool = True, stream_host_gb: float = 2.0) -> None:
        if not stream_host_gb > 0:
            raise ValueError(f"stream_host_gb={stream_host_gb}: a streamed save's host budget must be > 0")
        self.directory = Path(directory).absolute()
        self.save_every = save_every
        self.stream_host_gb = stream_host_gb
        self.host_bytes = HostBytes()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=max(save_every, 1),
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            "state": state_handler(self.host_bytes, stream_host_gb), "data": ocp.JsonCheckpointHandler()})

    @property
    def streams(self) -> bool:
        """Whether a ``streamed`` save holds at most ``stream_host_gb`` on the host (the installed orbax can)."""
        return _TransferPriority is not None

    @property
    def last_host_peak_bytes(self) -> int:
        """The most bytes of the state the last save held on this process's host at once (once it is written:
        after :meth:`wait`; a streamed save has waited): the state's :func:`local_bytes` for a periodic save, at
        most ``max(stream_host_gb, the largest array)`` for a streamed one."""
        return self.host_bytes.peak

    @property
    def last_state_bytes(self) -> int:
        """This process's bytes of the state the last save wrote (the sum of its arrays' :func:`local_bytes`)."""
        return sum(self.host_bytes.sizes.values())

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
             force: bool = False, streamed: bool = False) -> bool:
        """Start saving ``state`` (arrays, any sharding) and ``data_state`` at ``step`` if it is a
        save step (or ``force``); returns whether a save started. Non-blocking when async, unless
        ``streamed``: then at most ``stream_host_gb`` of the state is on the host at once, copied off the
        devices while the save runs, and this returns once the checkpoint is on disk (the state must not
        change, or be donated, before)."""
        if step in self.manager.all_steps():
            return False
        if not force and not self.should_save(step):
            return False
        self.manager.wait_until_finished()  # as manager.save does first: the previous save's counts are final
        if streamed and not self.streams:
            log.warning("checkpoint: orbax %s cannot stream a save (pyproject asks for >= 0.12.8): step %d is saved "
                        "with one host copy of the state", getattr(ocp, "__version__", "?"), step)
        self.host_bytes.start(state, streamed)
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave(state),
            data=ocp.args.JsonSave(_jsonable({"iterator": data_state})),
        )
        expected = _ExpectedOrbaxWarning()
        if streamed:  # for this save only: no process-wide logging change
            logging.getLogger("absl").addFilter(expected)
        try:
            started = self.manager.save(step, args=args, force=True)
            if started:
                log.info("checkpoint: saving step %d to %s%s", step, self.directory, " (streamed)" if streamed else "")
                if streamed:
                    self.manager.wait_until_finished()
        finally:
            logging.getLogger("absl").removeFilter(expected)
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
            state=ocp.args.PyTreeRestore(target, restore_args=ocp.checkpoint_utils.construct_restore_args(target)),
            data=ocp.args.JsonRestore()))
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
