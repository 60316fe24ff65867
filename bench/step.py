"""Training-step benchmark: ``python -m bench.step [--recipe R] [--model M] [--layout L]
[--data real,mock] [--mbs 1,2,4] [--peer hf] [--breakdown] [--profile DIR] [--out FILE] [key=value ...]``.

Runs the recipe's workload (default: ``gpu-default`` = the proxy workload of bench/README.md on a GPU;
``cpu-default`` with ``--model tiny`` on CPU) in steady state and reports, per data variant and
micro-batch size: median step time, input wait, useful tokens/s (``segment_ids > 0``: padding
excluded; image tokens count) and trained tokens/s (``loss_mask > 0``), model TFLOP/s per device
(``moevlm_jax.perf.flops``) and MFU against the device's dense bf16 peak (n/a where unknown, e.g. CPU),
peak device memory, and compile time; a table on stdout and JSON with ``--out``.

Steady state: a second loader reads the run's batches ahead, every distinct batch shape (patch
bucket, loss capacity) is compiled before anything is timed, then ``--warmup`` steps and ``--steps``
timed steps run from the real loader as the trainer runs them (step k dispatched, then step k-1
waited for: the next batch is read and placed while a step runs). A timed step is the wall time from
one step's outputs being ready to the next's; the input time (reading and placing a batch,
overlapped) is reported on its own. Compiles during timed steps are counted (0 expected).

- ``--data``: comma list of ``real`` (the recipe's data), ``mock`` (``--mock-data``, default the
  recipe's mock counterpart: ``mock`` for gpu-default, ``mock_small`` for cpu-default) or data
  config names/paths; ``data.*`` overrides apply to the non-mock variants, ``mock.*`` ones (as
  ``data.*``) to the mock variant. With ``real`` and ``mock`` the ratio real/mock is printed.
- ``--peer hf``: the same batches, from the same initial weights (``hf.save_pretrained``), through
  HF transformers in torch (``bench.hf_step``); both sides run in their own processes one after
  the other (each gets the whole accelerator). Prints ours/HF on useful tokens/s and checks that
  both sides' losses agree step by step (exit code 1 when the first step's do not).
- ``--breakdown``: per-component times of one training step (``bench.breakdown``).
- ``--profile DIR``: a ``jax.profiler`` trace of the timed steps per run (TensorBoard / Perfetto).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform as pyplatform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import moevlm_jax.data as data_lib
from bench import trace_breakdown
from bench.breakdown import run_breakdown
from bench.step_loop import (
    COMPILES,
    listen_for_compiles,
    precompile,
    run_steps,
    shape_key,
)
from bench.step_report import (
    compare_losses,
    format_report,
    ok,
    steady_rate,
    summary_line,
)
from moevlm_jax.config.run import default_recipe, load_config
from moevlm_jax.hf import save_pretrained
from moevlm_jax.parallelism.cpu_threads import ensure_collective_threads
from moevlm_jax.perf import flops
from moevlm_jax.perf.flops import peak_flops
from moevlm_jax.perf.memory import is_oom, peak_device_bytes
from moevlm_jax.schema import ConfigError
from moevlm_jax.train import setup_logging
from moevlm_jax.training import capture
from moevlm_jax.training import optimizer as optim
from moevlm_jax.training.trainer import Trainer

log = logging.getLogger("bench.step")

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MOCK = {"gpu-default": "mock", "cpu-default": "mock_small"}


class BenchError(RuntimeError):
    """A benchmark request that cannot be run as asked (the message says why)."""


@dataclasses.dataclass
class Variant:
    """One data variant: its label, the data config name (None: the recipe's) and overrides."""

    label: str
    data: str | None
    overrides: list[str]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", help="configs/recipes/NAME.yaml or a path (default: gpu-default / cpu-default)")
    p.add_argument("--model", help="configs/models/NAME.yaml or a path (CPU default: tiny)")
    p.add_argument("--layout", help="configs/layouts/NAME.yaml or a path")
    p.add_argument("--data", default="real", help="comma list: real, mock, or data config names/paths")
    p.add_argument("--mock-data", help="the data config 'mock' stands for (default: by recipe)")
    p.add_argument("--mbs", help="comma list of micro-batch sizes to sweep (default: the recipe's)")
    p.add_argument("--warmup", type=int, help="untimed steps after compilation (default GPU 3, CPU 1)")
    p.add_argument("--steps", type=int, help="timed steps (default GPU 10, with --peer hf 16; CPU 2)")
    p.add_argument("--devices", type=int, help="use the first N devices (default: all)")
    p.add_argument("--peer", choices=("none", "hf"), default="none", help="also run HF transformers")
    p.add_argument("--hf-compile", choices=("auto", "on", "off"), default="auto",
                   help="HF peer: also under torch.compile (auto: on CUDA)")
    p.add_argument("--breakdown", action="store_true", help="per-component step breakdown")
    p.add_argument("--breakdown-iters", type=int, help="timed calls per component (default GPU 5, CPU 2)")
    p.add_argument("--profile", help="save a jax.profiler trace of the timed steps under this directory")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--work-dir", help="batches and HF weights for --peer (default: a temporary directory)")
    p.add_argument("--keep-work-dir", action="store_true", help="do not delete the work directory")
    p.add_argument("--dump", help=argparse.SUPPRESS)  # internal: the JAX side of --peer writes batches here
    p.add_argument("--quiet", action="store_true", help="warnings only")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides, e.g. train.seq_len=2048")
    return p.parse_args(argv)


def command(args: argparse.Namespace) -> str:
    """The command line that asked for this run."""
    return " ".join(["python -m bench.step", *args.argv])


def variants(args: argparse.Namespace, recipe: str) -> list[Variant]:
    """The ``--data`` items with their overrides (see the module docstring)."""
    real = [o for o in args.overrides if not o.startswith("mock.")]
    mock = [o for o in args.overrides if not o.startswith(("data.", "mock."))]
    mock += ["data." + o[len("mock."):] for o in args.overrides if o.startswith("mock.")]
    out = []
    for item in (x.strip() for x in args.data.split(",")):
        if item == "real":
            out.append(Variant("real", None, real))
        elif item == "mock":
            out.append(Variant("mock", args.mock_data or DEFAULT_MOCK.get(Path(recipe).stem, "mock"), mock))
        elif item:
            out.append(Variant(item, item, real))
    if not out or len({v.label for v in out}) != len(out):
        raise BenchError(f"--data {args.data!r}: give distinct items (real, mock or data config names)")
    return out


# ----------------------------------------------------------------------------- our side, one run

def _steady(args: argparse.Namespace, gpu: bool) -> tuple[int, int]:
    warmup = args.warmup if args.warmup is not None else (3 if gpu else 1)
    # with the HF peer, 16 timed steps on a GPU: torch.compile recompiles on its first steps of each batch shape, and
    # its steady rate needs >= 10 steps that did not (bench/results/step.md)
    steps = args.steps if args.steps is not None else ((16 if args.peer == "hf" else 10) if gpu else 2)
    if warmup < 0 or steps < 1:
        raise BenchError(f"--warmup {warmup} must be >= 0 and --steps {steps} >= 1")
    return warmup, steps


def _save_initial(trainer: Any, state: Any, path: Path, gpu: bool) -> None:
    """Our initial parameters as an HF model directory (bf16 on GPU: the peer's dtype there)."""
    import jax
    import jax.numpy as jnp


    params = state["params"]
    if gpu:
        params = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    save_pretrained(trainer.model(params), trainer.spec.model, path)


def run_one(args: argparse.Namespace, cfg: Any, variant: Variant, devices: Any, dump: Path | None,
            breakdown: bool) -> dict[str, Any]:
    """Warm up, time ``--steps`` steps of one (data variant, MBS) configuration; optionally dump the
    batches + initial HF weights (for the peer) and run the breakdown on the last timed batch."""
    import jax


    tr = cfg.train
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    warmup, n_timed = _steady(args, gpu)
    frozen = optim.frozen_groups(tr.freeze_vision_model, tr.freeze_vision_projection, tr.freeze_language_model)
    trainer = Trainer.create(cfg.model, cfg.compute, cfg.layout, cfg.optimizer, steps=tr.steps,
                             grad_accum=tr.grad_accum, frozen=frozen, param_groups=tr.param_groups, devices=devices,
                             reuse_shapes=tr.reuse_shapes)  # as the train job pads its batches
    n_dev = trainer.mesh.devices.size
    if dump is not None and (n_dev != 1 or tr.grad_accum != 1):
        raise BenchError(f"--peer hf compares one device without gradient accumulation (this run: {n_dev} devices, "
                         f"grad_accum {tr.grad_accum}); pass --devices 1 and train.grad_accum=1")
    name = f"{variant.label} mbs{tr.micro_batch_size}"
    shape = flops.ModelShape.from_config(cfg.model)
    total = warmup + n_timed
    shard = {"shard_index": jax.process_index(), "shard_count": jax.process_count()}

    t0 = time.perf_counter()
    state = trainer.init_state(tr.seed)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    model_dir = dump / "hf_model" if dump is not None else None
    if model_dir is not None and not (model_dir / "config.json").exists():
        _save_initial(trainer, state, model_dir, gpu)
    trace = Path(args.profile) / name.replace(" ", "_") if args.profile else None
    # every batch shape the run will meet, compiled before timing (a second loader reads ahead)
    c0, compile_s = dict(COMPILES), 0.0
    ahead = data_lib.build_loader(cfg.data, **shard)
    seen: set = set()
    try:
        for _ in range(total):
            batch = trainer.prepare(next(ahead))
            key = shape_key(batch)
            if key not in seen:
                seen.add(key)
                t0 = time.perf_counter()
                compiled = precompile(trainer, state, batch)
                compile_s += time.perf_counter() - t0
                if trace is not None:  # the step's HLO maps trace events to the model's named scopes
                    trace.mkdir(parents=True, exist_ok=True)
                    (trace / f"train_step_{len(seen)}.hlo.txt").write_text(compiled.as_text())
                del compiled
            del batch
    finally:
        ahead.close()

    loader = data_lib.build_loader(cfg.data, **shard)
    steps: list[dict[str, Any]] = []
    hosts: list[dict[str, np.ndarray]] = []
    tracing = False
    # every shape was compiled above: any compile from here on is logged with JAX's reason for the
    # cache miss (the H200 run saw one in its first warmup step, bench/results/step.md)
    explain = jax.config.jax_explain_cache_misses
    jax.config.update("jax_explain_cache_misses", True)

    def start_trace() -> None:
        nonlocal tracing
        jax.profiler.start_trace(str(trace), create_perfetto_trace=True)
        tracing = True

    def finish(k: int, batch: Any, host: dict, metrics: Any, info: dict[str, Any]) -> None:
        nonlocal t_ready
        jax.block_until_ready(metrics)  # step k done (one executable: its state too)
        now = time.perf_counter()
        m = jax.device_get(metrics)
        steps.append({**info, "timed": k >= warmup, "time": now - t_ready, **batch.counts,
                      "flops": flops.batch_flops(shape, host), "loss": float(m["loss"]), "ce_loss": float(m["ce_loss"]),
                      "lr": float(m["lr"]), "grad_norm": float(m["grad_norm"]), "skipped": int(m.get("skipped", 0))})
        t_ready = now
        if dump is None:  # the peer needs every batch, the breakdown the last one
            hosts.clear()
        hosts.append({k2: np.asarray(host[k2]) for k2 in data_lib.MODEL_KEYS if k2 in host})

    t_ready = time.perf_counter()
    try:
        state = run_steps(trainer, state, loader, total, warmup, finish, start_trace if trace is not None else None)
        source = loader.summary()
    finally:
        jax.config.update("jax_explain_cache_misses", explain)
        if tracing:
            jax.profiler.stop_trace()
        loader.close()
    timed_steps = [s for s in steps if s["timed"]]
    seconds = sum(s["time"] for s in timed_steps)
    useful, trained = (sum(s[k] for s in timed_steps) for k in ("useful_tokens", "trained_tokens"))
    total_flops = sum(s["flops"] for s in timed_steps)
    peak = flops.peak_flops(trainer.mesh.devices.flat[0].device_kind)
    per_device = total_flops / seconds / n_dev
    result = {
        "side": "ours", "name": name, "data": variant.label, "data_source": source["source"], "mock": source["mock"],
        "mbs": tr.micro_batch_size, "grad_accum": tr.grad_accum, "rows": cfg.global_batch_size,
        "seq_len": tr.seq_len, "devices": n_dev, "dtype": cfg.compute.dtype, "warmup": warmup,
        "timed": [i for i, s in enumerate(steps) if s["timed"]],
        **{f"{k}_per_step": [s[k] for s in steps] for k in ("time", "input", "useful_tokens", "trained_tokens",
                                                            "tokens", "flops", "loss", "ce_loss", "lr", "compiles",
                                                            "grad_norm", "skipped", "first_run", "shape")},
        "step_time_s": statistics.median(s["time"] for s in timed_steps),
        "input_wait_s": statistics.median(s["input"] for s in timed_steps),
        "timed_time_s": seconds, "useful_tokens": useful, "trained_tokens": trained,
        "tokens": sum(s["tokens"] for s in timed_steps), "flops": total_flops,
        "tokens_per_s": useful / seconds, "trained_tokens_per_s": trained / seconds,
        "useful_fraction": useful / max(sum(s["tokens"] for s in timed_steps), 1.0),
        "tflops_per_device": per_device / 1e12, "mfu": per_device / peak if peak else None,
        "peak_bytes": peak_device_bytes(trainer.mesh.local_devices),  # the process's peak so far (runs go in MBS order)
        "compile_s": compile_s, "compile_events_s": COMPILES["seconds"] - c0["seconds"], "init_state_s": init_s,
        "compiled_shapes": len(seen), "timed_compiles": sum(s["compiles"] for s in timed_steps),
        "profile": str(trace) if trace is not None else None,
    }
    if trace is not None:  # the real step's kernels per component (bench.trace_breakdown)

        hlos = [f.read_text() for f in sorted(trace.glob("train_step_*.hlo.txt"))]
        result["trace_breakdown"] = trace_breakdown.breakdown(trace, hlos, len(timed_steps), seconds / len(timed_steps))
        log.info("%s: the timed steps' kernels per component (%s)\n%s", name, trace,
                 trace_breakdown.format_table(result["trace_breakdown"]))
    if steps[-1]["skipped"]:  # the optimizer's running count of skipped updates: these steps trained nothing
        log.warning("%s: %d of %d updates skipped for non-finite gradients (grad norms %s)", name,
                    steps[-1]["skipped"], total, [round(s["grad_norm"], 3) for s in steps])
    result["steady"] = steady_rate(timed_steps, n_dev, peak)
    if result["steady"]:  # a compiled shape's first run is ~0.25 s slower on the H200 (bench/results/step.md)
        log.warning("%s: %d timed steps were a compiled shape's first run: %.1f ms mean vs %.1f ms median step; "
                    "without them %s useful tokens/s", name, result["steady"]["first_runs"],
                    1e3 * result["steady"]["first_run_s"], 1e3 * result["step_time_s"],
                    f"{result['steady']['tokens_per_s']:,.0f}")
    if result["timed_compiles"]:
        log.warning("%s: %d compiles during timed steps (times include them)", name, result["timed_compiles"])
    if dump is not None:
        run_dir = dump / name.replace(" ", "_")
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        for i, h in enumerate(hosts):
            np.savez(run_dir / f"step{i:04d}.npz", **h)
        result.update(batch_dir=str(run_dir), hf_model_dir=str(model_dir))
    if breakdown:

        iters = args.breakdown_iters or (5 if gpu else 2)
        result["breakdown"] = run_breakdown(trainer, state, hosts[-1], step_time_s=result["step_time_s"],
                                            input_wait_s=result["input_wait_s"], iters=iters)
    return result


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    """Every (MBS, data variant) run in this process: the result document (see :func:`main`)."""
    import jax


    listen_for_compiles()
    platform = jax.default_backend()
    recipe = args.recipe or default_recipe(platform)
    model = args.model or ("tiny" if args.recipe is None and platform == "cpu" else None)
    devices = jax.devices()[: args.devices] if args.devices else jax.devices()
    mbs_list = sorted(int(m) for m in args.mbs.split(",")) if args.mbs else [None]
    dump = Path(args.dump) if args.dump else None
    if dump is not None:  # weights of an earlier invocation in the same work directory would be stale
        shutil.rmtree(dump / "hf_model", ignore_errors=True)
    runs, cfgs = [], []
    for mbs in mbs_list:
        for i, variant in enumerate(variants(args, recipe)):
            # an MBS point: MBS x accumulation x data-parallel rows, whatever global batch the recipe fixes
            overrides = [*variant.overrides, *([f"train.micro_batch_size={mbs}", "train.global_batch_size=null"]
                                               if mbs else [])]
            cfg = load_config(recipe, model=model, layout=args.layout, data=variant.data, overrides=overrides,
                              num_devices=len(devices))
            log.info("bench run: %s, mbs %d", variant.label, cfg.train.micro_batch_size)
            try:
                run = run_one(args, cfg, variant, devices, dump, breakdown=args.breakdown and i == 0)
            except Exception as e:  # out of memory is a result; anything else is re-raised
                if not is_oom(e):
                    raise
                run = {"side": "ours", "name": f"{variant.label} mbs{cfg.train.micro_batch_size}", "status": "oom",
                       "message": str(e).splitlines()[0][:500], "data": variant.label, "mock": variant.label == "mock",
                       "mbs": cfg.train.micro_batch_size, "rows": cfg.global_batch_size, "seq_len": cfg.train.seq_len}
            if run.get("status") == "oom":
                import gc

                gc.collect()
                jax.clear_caches()
            log.warning("bench: %s", summary_line(run))
            runs.append(run)
            cfgs.append(cfg)
    d, first = devices[0], cfgs[0]
    return {"command": command(args),
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "host": pyplatform.node(),
            "device": {"platform": platform, "kind": d.device_kind, "count": len(devices)},
            "versions": {"jax": jax.__version__, "python": pyplatform.python_version()},
            "recipe": recipe, "model": first.resolved["model"].get("name") or model,
            "layout": args.layout or "recipe's", "optimizer": dataclasses.asdict(first.optimizer),
            "frozen": sorted(k for k, on in (("vision_model", first.train.freeze_vision_model),
                                              ("vision_projection", first.train.freeze_vision_projection),
                                              ("language_model", first.train.freeze_language_model)) if on),
            "param_groups": first.train.param_groups, "xla_flags": os.environ.get("XLA_FLAGS", ""), "runs": runs}


# ----------------------------------------------------------------------------- the HF peer

def _child_argv(args: argparse.Namespace, work: Path) -> list[str]:
    """Our side's command line for a ``--peer`` run: the same request, no peer, dumping to ``work``."""
    out = []
    for flag in ("recipe", "model", "layout", "data", "mock_data", "mbs", "warmup", "steps", "devices",
                 "breakdown_iters", "profile"):
        value = getattr(args, flag)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    out += ["--breakdown"] * args.breakdown + ["--quiet"] * args.quiet
    return [*out, "--dump", str(work), "--out", str(work / "ours.json"), *args.overrides]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def peer_runs(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs the HF peer repeats: those of the first ``--data`` item (the real data; the peer
    needs no mock comparison of its own) that produced figures."""
    first = runs[0]["data"] if runs else None
    return [r for r in runs if r["data"] == first and ok(r)]


def run_with_peer(args: argparse.Namespace) -> dict[str, Any]:
    """Our side in a child process (dumping batches + initial weights), then the HF peer in another."""
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="moevlm_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        cmd = [sys.executable, "-m", "bench.step", *_child_argv(args, work)]
        if subprocess.run(cmd, env=_env(), check=False).returncode:
            raise BenchError(f"our side failed: {' '.join(cmd)}")
        result = json.loads((work / "ours.json").read_text())
        if not peer_runs(result["runs"]):
            raise BenchError("our side produced no run for the HF peer to repeat (all out of memory?)")
        spec = {"model_dir": peer_runs(result["runs"])[0]["hf_model_dir"], "optimizer": result["optimizer"],
                "frozen": result["frozen"], "param_groups": result["param_groups"], "compile": args.hf_compile,
                "runs": [{"name": r["name"], "batch_dir": r["batch_dir"], "lrs": r["lr_per_step"], "timed": r["timed"],
                          "useful_tokens": r["useful_tokens_per_step"], "trained_tokens": r["trained_tokens_per_step"],
                          "flops": r["flops_per_step"]} for r in peer_runs(result["runs"])]}
        (work / "hf_spec.json").write_text(json.dumps(spec, indent=1))
        cmd = [sys.executable, "-m", "bench.hf_step", "--spec", str(work / "hf_spec.json"),
               "--out", str(work / "hf.json")]
        env = _env()
        if result["device"]["platform"] == "cpu":  # torch's OpenMP threads spin-wait: ~10x slower when cores are shared
            env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if subprocess.run(cmd, env=env, check=False).returncode:
            raise BenchError(f"the HF peer failed: {' '.join(cmd)}")
        peer = json.loads((work / "hf.json").read_text())
    finally:
        if not (args.keep_work_dir or args.work_dir):
            shutil.rmtree(work, ignore_errors=True)
    result["command"] = command(args)
    result["peer"] = {"info": peer["info"], "runs": peer["results"]}

    peak = peak_flops(result["device"]["kind"])
    for p in peer["results"]:
        p["mfu"] = p["tflops_per_device"] * 1e12 / peak if peak and ok(p) else None
    strict = "bfloat16" if "bfloat16" in (peer["info"]["dtype"], peer_runs(result["runs"])[0]["dtype"]) else "float32"
    for r in result["runs"]:
        hf = [p for p in peer["results"] if p["name"] == r["name"] and ok(p)]
        if not ok(r) or not hf:
            continue
        best = min(hf, key=lambda p: p["step_time_s"])
        eager = next((p for p in hf if p["mode"] == "eager"), None)  # the loss check: eager from the initial weights
        rate = lambda x: (x.get("steady") or x)["tokens_per_s"]  # noqa: E731 - without compiles / first runs
        r["vs_hf"] = {"hf_best": best["side"], "tokens_per_s_ratio": r["tokens_per_s"] / best["tokens_per_s"],
                      "steady_ratio": rate(r) / rate(best), "loss": None if eager is None else compare_losses(r, eager,
                                                                                                              strict)}
    return result


def main(argv: list[str] | None = None) -> int:
    """CLI entry: run, print the report, write JSON; 2 on a bad request, 1 when ours and HF disagree."""

    args = parse_args(argv)
    ensure_collective_threads()  # XLA:CPU host devices: pool threads for their collectives, before jax starts
    args.argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging(logging.WARNING if args.quiet else logging.INFO)

    try:  # the recipe's XLA flags (compute.capture's command buffers, compute.xla_flags) before the jax backend starts
        capture.apply_capture(capture.recipe_compute(args.recipe, args.overrides))
    except (ValueError, capture.CaptureError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_with_peer(args) if args.peer == "hf" else run_ours(args)
    except (BenchError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.dump is None:
        print(format_report(result))
    agree = all(r["vs_hf"]["loss"]["first_step_agrees"] for r in result["runs"] if (r.get("vs_hf") or {}).get("loss"))
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
