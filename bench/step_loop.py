"""The timed steps of ``python -m bench.step``: the compile counter (JAX's compile events),
what selects a compiled step (batch shapes, loss capacity, ragged bound) and the step loop, run as
the trainer runs it (one step in flight while the next batch is read and placed)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

COMPILES = {"seconds": 0.0, "count": 0, "listening": False}
COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def _on_event(event: str, duration: float, **_: Any) -> None:
    if event in COMPILE_EVENTS:
        COMPILES["seconds"] += duration
        COMPILES["count"] += event == COMPILE_EVENTS[-1]


def listen_for_compiles() -> None:
    """Count JAX's compiles into ``COMPILES`` (once per process)."""
    import jax

    if not COMPILES["listening"]:
        jax.monitoring.register_event_duration_secs_listener(_on_event)
        COMPILES["listening"] = True


def precompile(trainer: Any, state: Any, batch: Any) -> Any:
    """Compile the train step for this batch's shapes without running it (the jit cache keeps it)."""
    return trainer.lower_step(state, batch.arrays, batch.capacity, bounded=batch.bounded).compile()


def shape_key(batch: Any) -> tuple:
    """What selects the compiled train step (``trainer.compile_key`` of the batch)."""
    from moevlm_jax.training.trainer import compile_key

    return compile_key(batch.arrays, batch.capacity, batch.bounded)


def shape_label(batch: Any) -> str:
    """'patches 3328, loss capacity 3584': what selects the compiled executable (rows and seq fixed)."""
    pv = batch.arrays.get("pixel_values")
    fallback = "" if batch.bounded else ", attention fallback"
    return f"patches {pv.shape[-2] if pv is not None else 0}, loss capacity {batch.capacity}{fallback}"


def run_steps(trainer: Any, state: Any, loader: Any, total: int, warmup: int, finish: Callable[..., None],
              start_trace: Callable[[], None] | None = None) -> Any:
    """``total`` steps as the trainer runs them (moevlm_jax.train): batch k read and placed, step k
    dispatched, then step k-1 waited for (``finish(k-1, batch, host, metrics, info)``), so the next
    batch is read while a step runs. ``start_trace`` runs before step ``warmup``, the steps before it
    finished first (the trace holds the timed steps only). Returns the last state."""
    pending, ran = None, set()
    for k in range(total):
        if start_trace is not None and k == warmup:
            if pending is not None:
                finish(*pending)
                pending = None
            start_trace()
        t0 = time.perf_counter()
        host = next(loader)
        batch = trainer.prepare(host)
        input_s = time.perf_counter() - t0
        key = shape_key(batch)
        first_run = key not in ran  # this executable's first run
        ran.add(key)
        before = COMPILES["count"]
        state, metrics = trainer.step(state, batch)
        info = {"input": input_s, "compiles": COMPILES["count"] - before, "first_run": first_run,
                "shape": shape_label(batch)}
        if pending is not None:
            finish(*pending)
        pending = (k, batch, host, metrics, info)
    if pending is not None:
        finish(*pending)
    return state
