"""Capture: Megatron's CUDA-graph choices mapped onto XLA GPU command buffers.

Megatron Bridge captures CUDA graphs per *scope* (``attn``, ``moe_router``, ``moe_preprocess``,
``full_iteration``, ...). In JAX the whole train step is already one ``jax.jit`` program with the
train state donated (``moevlm_jax.training.trainer``), and XLA:GPU records runs of consecutive kernels
("thunks") of chosen *types* into CUDA graphs ("command buffers"). XLA picks by thunk type, not by
model region, so a scope here is the set of command types its kernels are made of; enabling
several scopes enables the union of their types. This is an approximation of Megatron's scopes:
e.g. ``attn`` also captures every other fusion and cuBLAS GEMM in the step, since XLA cannot tell
them apart.

``compute.capture``:
- ``none``: command buffers off (``--xla_gpu_enable_command_buffer=``): every kernel launched on
  its own, the baseline a capture choice is measured against.
- ``step``: the whole step as one jit with donated buffers and XLA's own default command types
  (no flag set; XLA 0.10/0.11 defaults FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN (+
  DYNAMIC_SLICE_FUSION in some builds), minimum graph size 5).
- ``scopes``: the union of ``SCOPE_COMMANDS`` for ``compute.capture_scopes`` as an explicit list
  (overriding XLA's default list) and ``--xla_gpu_graph_min_graph_size`` (the smallest run of
  kernels worth a graph): 1 with ``full_iteration`` (capture everything, loops and conditionals
  included, as a whole-iteration graph), else ``SCOPE_MIN_GRAPH_SIZE``.

The flags must be in ``XLA_FLAGS`` before the backend starts (XLA reads them once per process):
CLIs call :func:`apply_capture` before their first device use; afterwards it raises unless the
flags already in effect are the same. Not yet measured on a GPU (see ARCHITECTURE.md).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Mapping

from moevlm_jax.config.run import default_recipe
from moevlm_jax.model.compute import CAPTURE_MODES, CAPTURE_SCOPES, XLA_FLAGS_OF_CAPTURE, ComputeConfig
from moevlm_jax.schema import build, find_config, parse_override, read_yaml, set_dotted

# Command-buffer types accepted by --xla_gpu_enable_command_buffer in jax 0.10.2's XLA (each checked
# by XLA's flag parser on that build; DYNAMIC_SLICE_COPY_FUSION, in the proto, is rejected there).
COMMAND_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUDNN", "CUSTOM_CALL", "COLLECTIVES", "WHILE", "CONDITIONAL",
                 "DYNAMIC_SLICE_FUSION", "CONVOLUTION")
# What each Megatron scope's kernels are in XLA:GPU terms.
SCOPE_COMMANDS: dict[str, tuple[str, ...]] = {
    # q/k/v/o GEMMs (cuBLAS / cuBLASLt), norm + rotary + softmax fusions, cuDNN fused attention
    "attn": ("FUSION", "CUBLAS", "CUBLASLT", "CUDNN"),
    # router GEMM, float32 softmax and top-k (fusions; a sort or XLA's top-k kernel)
    "moe_router": ("FUSION", "CUBLAS", "CUBLASLT"),
    # token permutation before the experts: sort, gathers, dynamic slices, counts
    "moe_preprocess": ("FUSION", "DYNAMIC_SLICE_FUSION"),
    # everything, including the layer / microbatch loops (WHILE), conditionals, collectives and
    # custom calls (tokamax / Mosaic GPU expert GEMMs)
    "full_iteration": COMMAND_TYPES,
}
SCOPE_MIN_GRAPH_SIZE = 2  # scopes without full_iteration: capture short runs too (XLA default: 5)
FLAG_TYPES, FLAG_MIN_SIZE = XLA_FLAGS_OF_CAPTURE  # the command-buffer types, the smallest graph


class CaptureError(RuntimeError):
    """The capture flags cannot take effect (the backend already started with other flags)."""


def command_types(scopes: Iterable[str]) -> tuple[str, ...]:
    """The command types for ``scopes`` (union, in COMMAND_TYPES order)."""
    scopes = tuple(scopes)
    bad = [s for s in scopes if s not in SCOPE_COMMANDS]
    if bad:
        raise ValueError(f"unknown capture scopes {bad}; known: {CAPTURE_SCOPES}")
    wanted = {t for s in scopes for t in SCOPE_COMMANDS[s]}
    return tuple(t for t in COMMAND_TYPES if t in wanted)


def capture_flags(capture: str, scopes: Iterable[str] = ()) -> dict[str, str]:
    """XLA flags (name -> value) for a capture mode and its scopes; empty for ``step`` (defaults)."""
    if capture not in CAPTURE_MODES:
        raise ValueError(f"capture must be one of {CAPTURE_MODES}, got {capture!r}")
    if capture == "none":
        return {FLAG_TYPES: ""}
    if capture == "step":
        return {}
    scopes = tuple(scopes)
    if not scopes:
        raise ValueError("capture 'scopes' needs at least one scope")
    size = 1 if "full_iteration" in scopes else SCOPE_MIN_GRAPH_SIZE
    return {FLAG_TYPES: ",".join(command_types(scopes)), FLAG_MIN_SIZE: str(size)}


def compute_flags(compute: ComputeConfig) -> dict[str, str]:
    """The XLA flags a ComputeConfig sets: :func:`capture_flags` for its ``capture`` / ``capture_scopes``,
    then its ``xla_flags`` (other flags, e.g. recipe h200's ``--xla_gpu_enable_triton_gemm=false``)."""
    extra = {name: value for name, _, value in (f.partition("=") for f in compute.xla_flags)}
    return {**capture_flags(compute.capture, compute.capture_scopes), **extra}


def parse_flags(xla_flags: str) -> dict[str, str | None]:
    """``--name=value`` tokens of an XLA_FLAGS string (value None for a bare ``--name``)."""
    out: dict[str, str | None] = {}
    for token in shlex.split(xla_flags or ""):
        name, eq, value = token.partition("=")
        out[name] = value if eq else None
    return out


def merge_flags(xla_flags: str, flags: Mapping[str, str]) -> str:
    """``xla_flags`` with ``flags`` set (replacing the same flags' earlier values, keeping the rest in
    order)."""
    kept = [t for t in shlex.split(xla_flags or "") if t.partition("=")[0] not in flags]
    kept += [f"{name}={value}" for name, value in flags.items()]
    return " ".join(shlex.quote(t) if not t or any(c.isspace() for c in t) else t for t in kept)


def backend_started() -> bool:
    """Whether a jax backend exists in this process (XLA has then read XLA_FLAGS)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def apply_capture(compute_or_capture: ComputeConfig | str, scopes: Iterable[str] = (),
                  environ: dict[str, str] | None = None) -> str:
    """Merge the capture flags (and a ComputeConfig's ``xla_flags``) into ``XLA_FLAGS`` (``environ``,
    default ``os.environ``; the config's values replace the same flags there) and return it. Call
    before the first jax device use; once the backend has started, raises CaptureError unless
    XLA_FLAGS already holds the same values (then nothing changes)."""
    if isinstance(compute_or_capture, ComputeConfig):
        flags = compute_flags(compute_or_capture)
    else:
        flags = capture_flags(compute_or_capture, scopes)
    env = os.environ if environ is None else environ
    current = env.get("XLA_FLAGS", "")
    if backend_started():
        have = parse_flags(current)
        differ = {k: v for k, v in flags.items() if have.get(k, None) != v}
        if differ:
            raise CaptureError(f"the jax backend has already started with XLA_FLAGS={current!r}; capture needs "
                               f"{merge_flags('', differ)}: set it before the first device use (a new process)")
        return current
    merged = merge_flags(current, flags)
    env["XLA_FLAGS"] = merged
    return merged


def recipe_capture(recipe: str | os.PathLike | None, overrides: Iterable[str] = (), *, run_dir: str | None = None,
                   resume: bool | None = None) -> tuple[str, tuple[str, ...]]:
    """``(compute.capture, compute.capture_scopes)`` of a train recipe and its overrides (:func:`recipe_compute`)."""
    compute = recipe_compute(recipe, overrides, run_dir=run_dir, resume=resume)
    return compute.capture, compute.capture_scopes


def recipe_compute(recipe: str | os.PathLike | None, overrides: Iterable[str] = (), *, run_dir: str | None = None,
                   resume: bool | None = None) -> ComputeConfig:
    """The ``compute`` section of a train recipe and its ``key=value`` overrides, read without starting
    jax (the full config asks jax for devices): what the train CLI passes to :func:`apply_capture`
    before anything else (the capture's flags and ``compute.xla_flags``). Without a recipe the platform
    default (cpu-default, gpu-default) is the one :func:`guess_platform` names; the config checks it
    against the backend once jax has started."""
    from pathlib import Path


    if resume and recipe is None and run_dir and (Path(run_dir) / "config.yaml").exists():
        recipe = Path(run_dir) / "config.yaml"

    name = recipe if recipe is not None else default_recipe(guess_platform())
    tree = {"compute": dict(read_yaml(find_config("recipes", name)).get("compute") or {})}
    for key, value in map(parse_override, overrides):
        if key.startswith("compute."):
            set_dotted(tree, key, value)
    return build(ComputeConfig, tree["compute"], "compute")


def guess_platform() -> str:
    """The backend jax will pick, without starting it: the first of ``JAX_PLATFORMS`` when set, else
    'gpu' where an NVIDIA or AMD device node is visible to this process, else 'cpu'."""
    platforms = [p.strip().lower() for p in os.environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms:
        return "gpu" if platforms[0] in ("cuda", "gpu", "rocm") else platforms[0]
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return "cpu"
    return "gpu" if os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd") else "cpu"


def describe(capture: str, scopes: Iterable[str] = ()) -> str:
    """One line: the mode and the XLA flags it sets (for logs and sweep results)."""
    flags = capture_flags(capture, scopes)
    if not flags:
        return f"{capture}: XLA default command buffers"
    return f"{capture}: " + " ".join(f"{k}={v}" for k, v in flags.items())
