"""One point of ``python -m bench.sweep``, run in its own process.

``python -m bench.sweep_point SPEC.json RESULT.json``: sets the capture's XLA flags (and the
CPU host-device count) before the backend starts, builds the trainer for the point's model x layout x
compute x MBS, takes ``warmup + steps`` batches from the data loader, compiles the train step for
each distinct batch shape (timed: ``compile_s``), runs ``warmup`` steps, then times ``steps``
steady-state steps (dispatch to the last result ready). Writes a result dict (``status`` ok / oom /
error with ``message``) to RESULT.json; any exception becomes an error or oom result.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from moevlm_jax.parallelism.cpu_threads import ensure_collective_threads

log = logging.getLogger("bench.sweep")
BUILTIN_TOKENIZERS = ("qwen3", "qwen", "qwen3-vl", "qwen3.5", "qwen3_5",
                      "qwen3.6")  # data.tokenizer.load_tokenizer's names


def classify(message: str) -> str:
    """'oom' for out-of-memory errors (XLA RESOURCE_EXHAUSTED, allocator failures), else 'error'."""
    from moevlm_jax.perf.memory import is_oom

    return "oom" if is_oom(message) else "error"


def run_point(spec: dict[str, Any]) -> dict[str, Any]:
    """Compile and time one point (see the module docstring); raises on failure."""
    from moevlm_jax.perf import memory
    from moevlm_jax.tools.memory import set_host_devices
    from moevlm_jax.training import capture

    set_host_devices(spec.get("host_devices"))
    flags = capture.apply_capture(spec["capture"], spec.get("capture_scopes", ()))
    import jax
    import numpy as np

    import moevlm_jax.data as data_lib
    from moevlm_jax.config import load_layout
    from moevlm_jax.config.run import model_data_checks
    from moevlm_jax.model.compute import ComputeConfig
    from moevlm_jax.model.registry import data_tokenizer, load_model_config
    from moevlm_jax.parallelism.validate import validate_layout
    from moevlm_jax.perf import flops
    from moevlm_jax.training.config import OptimizerConfig
    from moevlm_jax.training.trainer import Trainer

    mbs, steps, warmup = int(spec["mbs"]), int(spec["steps"]), int(spec["warmup"])
    if mbs < 1 or steps < 1 or warmup < 0:
        raise ValueError(f"mbs ({mbs}) and steps ({steps}) must be >= 1, warmup ({warmup}) >= 0")
    model = load_model_config(spec["model"])
    layout = load_layout(spec["layout"])
    compute = ComputeConfig.from_dict({**spec.get("compute", {}), "recompute": spec["recompute"],
                                       "capture": spec["capture"],
                                       "capture_scopes": list(spec.get("capture_scopes", ()))})
    devices = jax.devices()
    trainer = Trainer.create(model, compute, layout, OptimizerConfig(**spec.get("optimizer", {})),
                             steps=warmup + steps + 1, grad_accum=int(spec.get("grad_accum", 1)), devices=devices)
    rows = mbs * trainer.data_parallel_size * trainer.spec.grad_accum
    data_overrides = list(spec.get("data_overrides", ()))
    data_cfg = data_lib.load_data_config(spec["data"], data_overrides)
    want = data_tokenizer(model)  # the built-in data read with the model family's tokenizer (qwen3 / qwen3.5)
    if data_cfg.tokenizer in BUILTIN_TOKENIZERS and data_cfg.tokenizer != want and not any(
            o.split("=")[0].removeprefix("data.") == "tokenizer" for o in data_overrides):
        log.info("data tokenizer %s -> %s (the %s model's ids)", data_cfg.tokenizer, want, model.name or "")
        data_cfg = data_lib.load_data_config(spec["data"], [*data_overrides, f"tokenizer={want}"])
    seq_len = int(spec.get("seq_len") or data_cfg.seq_len)
    validate_layout(model, layout, trainer.mesh, batch_size=mbs * trainer.data_parallel_size, seq_len=seq_len)
    problems = model_data_checks(model, data_cfg)
    if problems:
        raise ValueError("model and data disagree: " + "; ".join(problems))
    # fail fast (before loading data and compiling) on what tracing finds, at the largest patch bucket
    memory.trace_step(trainer, trainer.abstract_state(),
                      trainer.abstract_batch(mbs, seq_len, max(data_cfg.patch_buckets)))
    # vision rows balance within one data-parallel rank's microbatch (the run config derives the same)
    data_cfg = dataclasses.replace(data_cfg, balance_group=mbs)
    loader = data_lib.build_loader(data_cfg, batch_size=rows // jax.process_count(), seq_len=seq_len,
                                   shard_index=jax.process_index(), shard_count=jax.process_count())
    try:
        hosts = [next(loader) for _ in range(warmup + steps)]
        source = loader.summary().get("source", "")
    finally:
        loader.close()
    log.info("%d batches of %d rows x %d tokens from %s", len(hosts), rows, seq_len, source)
    batches = [trainer.prepare(h) for h in hosts]
    caps = {b.capacity for b in batches}
    if len(caps) > 1:  # one program per point: the largest loss capacity serves every batch (same loss)
        cap = None if None in caps else max(caps)
        batches = [dataclasses.replace(b, capacity=cap) for b in batches]
    if not all(b.bounded for b in batches):  # likewise: one batch over the ragged bound, all with the fallback
        batches = [dataclasses.replace(b, bounded=False) for b in batches]
    options = spec.get("compiler_options") or {}
    state = memory.init_state(trainer, 0, options)
    compiled: dict[tuple, Any] = {}
    compile_s, mem = 0.0, None
    for b in batches:  # one compile per batch shape and loss capacity, all before the timed steps
        key = (tuple(sorted((k, v.shape) for k, v in b.arrays.items())), b.capacity, b.bounded)
        if key not in compiled:
            t0 = time.perf_counter()
            lowered = memory.lower_step(trainer, state, b.arrays, b.capacity, b.bounded)
            compiled[key] = lowered.compile(dict(options)) if options else lowered.compile()
            compile_s += time.perf_counter() - t0
            fields = memory.memory_fields(compiled[key])
            if mem is None or fields[memory.TOTAL] > mem[memory.TOTAL]:
                mem = fields
            log.info("compiled batch shape #%d in %.1fs", len(compiled), time.perf_counter() - t0)

    def run(b: Any, st: Any) -> tuple[Any, Any]:
        return compiled[(tuple(sorted((k, v.shape) for k, v in b.arrays.items())), b.capacity, b.bounded)](st, b.arrays)

    metrics = None
    for b in batches[:warmup]:
        state, metrics = run(b, state)
    jax.block_until_ready((state, metrics))
    timed = batches[warmup:]
    t0 = time.perf_counter()
    for b in timed:
        state, metrics = run(b, state)
    jax.block_until_ready((state, metrics))
    seconds = time.perf_counter() - t0
    loss = float(jax.device_get(metrics["loss"]))
    if not np.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} after the timed steps")
    shape = flops.ModelShape.from_config(model)
    model_flops = sum(flops.batch_flops(shape, h) for h in hosts[warmup:])
    useful = sum(b.counts["useful_tokens"] for b in timed)
    trained = sum(b.counts["trained_tokens"] for b in timed)
    n_dev = len(devices)
    peak = flops.peak_flops(devices[0].device_kind)
    device_peak = memory.peak_device_bytes(jax.local_devices())
    achieved = model_flops / seconds / n_dev
    return {
        "status": "ok", "message": "", "steps": len(timed), "step_time_s": seconds / len(timed),
        "tokens_per_s": useful / seconds, "trained_tokens_per_s": trained / seconds,
        "tokens_per_s_per_device": useful / seconds / n_dev, "useful_tokens": useful, "trained_tokens": trained,
        "tokens": sum(b.counts["tokens"] for b in timed), "model_tflops_per_device": achieved / 1e12,
        "mfu": achieved / peak if peak else None,
        "peak_bytes": device_peak if device_peak is not None else mem[memory.TOTAL],
        "peak_source": "device peak_bytes_in_use" if device_peak is not None else "compiled memory analysis",
        "compile_s": compile_s, "compiles": len(compiled), "loss": loss, "seq_len": seq_len, "rows": rows,
        "patch_buckets": sorted({int(h["pixel_values"].shape[1]) for h in hosts if "pixel_values" in h}),
        "data_source": source, "mock_data": bool(hosts[0]["stats"].get("mock")), "devices": n_dev,
        "device_kind": devices[0].device_kind, "xla_flags": flags, "capture_flags": capture.describe(
            spec["capture"], spec.get("capture_scopes", ())),
        **{f"mem_{k}": v for k, v in mem.items()},
    }


def main(argv: list[str] | None = None) -> int:
    """Child entry: SPEC.json RESULT.json; always writes a result unless the process dies."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m bench.sweep_point SPEC.json RESULT.json", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    ensure_collective_threads()  # XLA:CPU host devices: pool threads for their collectives, before jax starts
    spec = json.loads(Path(argv[0]).read_text())
    t0 = time.perf_counter()
    try:
        result = run_point(spec)
    except Exception as e:  # noqa: BLE001 - the point failed: record why
        message = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        result = {"status": classify(message), "message": message[:2000]}
    result["wall_s"] = time.perf_counter() - t0
    Path(argv[1]).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
