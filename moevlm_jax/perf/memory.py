"""Memory accounting of the train step: XLA's compiled memory analysis without running it, and what
an out-of-memory failure looks like and what to change.

For a model x layout x compute (recompute, offload, ...) x MBS x sequence length, the train step
(``moevlm_jax.training.trainer``: forward, backward, AdamW, state donated) is lowered on abstract inputs
(``jax.ShapeDtypeStruct`` with their shardings: no parameter is materialised, no step runs) and
compiled; ``compiled.memory_analysis()`` then gives per device: arguments (train state + batch),
outputs, aliased bytes (the donated state reused for the new state), temporaries (activations,
saved residuals, gradients, workspace), generated code, and the ``host_*`` counterparts (host
memory: offloaded residuals where the backend reports them). ``total = argument + output - alias +
temp`` is XLA's estimate of the step's device memory (:func:`memory_report`).

The batch is the full-size worst case: ``mbs`` x data-parallel rows of ``seq_len`` tokens with
``patches`` patch rows each (default ~3/4 of seq_len, the proxy workload's ratio of 3136 patches
per 4096 tokens; 0 = text only), logits over whole rows (no trained-position gather). The report as a
CLI table: ``python -m moevlm_jax.tools.memory``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from moevlm_jax.config.files import load_layout
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.model.registry import CONFIG_TYPES, load_model_config
from moevlm_jax.parallelism.validate import validate_layout
from moevlm_jax.training.config import OptimizerConfig
from moevlm_jax.training.trainer import Trainer

TOTAL = "total_bytes"


OOM_MARKERS = ("resource_exhausted", "out of memory", "oom when allocating", "failed to allocate")


def is_oom(error: BaseException | str) -> bool:
    """An allocation failure on the device (XLA RESOURCE_EXHAUSTED, allocator messages)."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return any(m in text.lower() for m in OOM_MARKERS)


def oom_advice(model: str, layout: str, mbs: int, seq_len: int) -> str:
    """What to change when a train step does not fit (the knobs in the order a user reaches for them)."""
    return ("to fit it: compute.recompute=selective (or full); a smaller train.micro_batch_size with a larger "
            "train.grad_accum (same global batch); compute.param_dtype=bfloat16 optimizer.state_dtype=bfloat16 "
            "(bf16 weights and AdamW state, HF's setting); or more devices, over which FSDP shards parameters, "
            "gradients and optimizer state. The step's memory without running it: python -m moevlm_jax.tools.memory "
            f"--model {model} --layout {layout} --mbs {mbs} --seq-len {seq_len} --recompute none,selective,full")


def peak_device_bytes(devices: list[Any]) -> int | None:
    """Largest ``peak_bytes_in_use`` over the local devices (None where the backend has no stats)."""
    peaks = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:  # noqa: BLE001 - CPU backends raise or return None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def default_patches(seq_len: int) -> int:
    """Patch rows per row when not given: 3/4 of the tokens, a multiple of 4 (2x2 merge)."""
    return (3 * seq_len // 4) // 4 * 4


def lower_step(trainer: Any, state: Any, arrays: Mapping[str, Any], capacity: int | None = None,
               bounded: bool = False) -> Any:
    """``jax.stages.Lowered`` of the trainer's train step for these (concrete or abstract) inputs;
    ``.compile()`` gives an executable to call as ``compiled(state, arrays)``."""
    return trainer.lower_step(state, arrays, capacity, bounded=bounded)


def init_state(trainer: Any, seed: int = 0, compiler_options: Mapping[str, Any] | None = None) -> Any:
    """The trainer's fresh train state (``Trainer.init_state``), compiled ahead of time with
    ``compiler_options`` (its random init compiles slowly on CPU at the default optimisation level)."""
    lowered = trainer.lower_init(seed)
    return (lowered.compile(dict(compiler_options)) if compiler_options else lowered.compile())()


def trace_step(trainer: Any, state: Any, arrays: Mapping[str, Any], capacity: int | None = None) -> Any:
    """Trace (no lowering, no compile) the train step: raises trace-time errors, e.g. a batch the
    layout's pipeline cannot split into microbatches, in seconds."""
    return trainer.lower_step(state, arrays, capacity, trace_only=True)


def memory_fields(compiled: Any) -> dict[str, int]:
    """``compiled.memory_analysis()`` as ``{name}_bytes`` ints (argument, output, alias, temp,
    generated_code, host_* where the backend reports them, peak_memory where present) + total."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError("this backend gives no compiled memory analysis")
    out = {}
    for name in dir(stats):
        value = getattr(stats, name, None)
        if name.endswith("_in_bytes") and isinstance(value, int):
            out[name.removesuffix("_in_bytes").removesuffix("_size") + "_bytes"] = int(value)
    out[TOTAL] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    return out


@dataclasses.dataclass
class CompiledStep:
    """A compiled (never run) train step: :func:`memory_report`'s fields, the executable and its trainer."""

    report: dict[str, Any]
    compiled: Any  # jax.stages.Compiled: memory_analysis(), as_text()
    trainer: Any


def compile_step(model: Any, layout: Any, compute: Any, *, mbs: int, seq_len: int, patches: int | None = None,
                 grad_accum: int = 1, devices: Sequence[Any] | None = None, mesh: Any = None, optimizer: Any = None,
                 capacity: int | None = None, compiler_options: Mapping[str, Any] | None = None,
                 frozen: Sequence[str] = (), param_groups: Mapping[str, Sequence[str]] | None = None,
                 bounded: bool = True, dest: bool = False, steps: int = 1000) -> CompiledStep:
    """Compile (never run) the train step for this setting: the memory fields per device plus ``compile_s``
    and the setting (``.report``), and the executable. ``model``/``layout``: configs or names; ``compute`` a
    ComputeConfig or a mapping of its fields; ``mesh``: the layout's mesh built by the caller (e.g. hybrid over
    hosts; default: ``Trainer.create``'s over ``devices``); ``compiler_options`` go to ``Lowered.compile`` (e.g.
    ``xla_backend_optimization_level=0`` compiles faster on CPU; buffer assignment comes before it);
    ``frozen`` / ``param_groups``: frozen parameter groups as ``Trainer.create`` takes them (no gradients
    or optimizer state for them: ``train.freeze_*``); ``bounded``: the batch within cuDNN's ragged bound
    (``compute.attention_options``: the step the trainer runs for such batches; False: the dense-mask
    fallback's step, much larger on the H200's proxy, bench/results/attention.md); ``dest``: the batch carries
    ``patch_dest`` (``data.balance_vision_rows``), as the run's batches then do; ``steps``: the run's length (the
    learning-rate schedule's, a constant of the program)."""
    model = model if isinstance(model, CONFIG_TYPES) else load_model_config(model)  # any family
    layout = load_layout(layout) if isinstance(layout, str) else layout
    compute = compute if isinstance(compute, ComputeConfig) else ComputeConfig.from_dict(compute)
    patches = default_patches(seq_len) if patches is None else patches
    devices = list(mesh.devices.flat) if mesh is not None else list(devices if devices is not None else jax.devices())
    trainer = Trainer.create(model, compute, layout, optimizer or OptimizerConfig(), steps=steps,
                             grad_accum=grad_accum, devices=devices, mesh=mesh, frozen=frozen,
                             param_groups=param_groups)
    validate_layout(model, layout, trainer.mesh, batch_size=mbs * trainer.data_parallel_size, seq_len=seq_len)
    t0 = time.perf_counter()
    lowered = lower_step(trainer, trainer.abstract_state(), trainer.abstract_batch(mbs, seq_len, patches, dest),
                         capacity, bounded)
    compiled = lowered.compile(dict(compiler_options)) if compiler_options else lowered.compile()
    fields = memory_fields(compiled)
    report = {"model": model.name, "layout": layout.name, "devices": len(devices), "mbs": mbs,
              "grad_accum": grad_accum, "seq_len": seq_len, "patches": patches, "recompute": compute.recompute,
              "recompute_modules": list(compute.recompute_modules), "offload": list(compute.offload),
              "vision_recompute": compute.stack_recompute("vision")[0], "frozen": sorted(frozen), **fields,
              "compile_s": round(time.perf_counter() - t0, 2)}
    return CompiledStep(report, compiled, trainer)


def memory_report(model: Any, layout: Any, compute: Any, **kwargs: Any) -> dict[str, Any]:
    """:func:`compile_step`'s report alone (same arguments)."""
    return compile_step(model, layout, compute, **kwargs).report


def format_bytes(n: float | None) -> str:
    """Bytes as GiB / MiB / KiB text ('-' for None)."""
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
