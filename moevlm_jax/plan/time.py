"""The planner's step-time model: a roofline from model FLOPs and bytes moved, scaled by kernel rates
measured on the H200 in bench/, plus the communication the layout adds (``moevlm_jax.plan.comm``).

Rates (``H200``; ``measured`` says where a number comes from, ``assumed`` where none was measured):

- dense GEMMs 780 TFLOP/s (bench/README.md, "Workload and reference figures": a large bf16 matmul
  on the H200 reaches ~780 of the datasheet's 989);
- the experts' grouped matmuls, dropless (Triton) 382 TFLOP/s = 0.60 of the balanced batched
  einsum's 633, drop-and-pad (capacity 1.25, counting every assignment) 393 (bench/results/moe_layer.md;
  the 235B-A22B shapes were measured with tokamax only: assumed the same);
- decoder attention, cuDNN ragged (bound 2), forward + backward 423 TFLOP/s counted as 3.5 x the
  forward's causal FLOPs (bench/results/attention.md, second probe, MBS 8 x 4096); the model FLOPs count the
  training attention as 3 x the forward, so the time is ``3.5 / 3 x FLOPs / 423e12``;
- vision attention (head dim 72, 784-patch images) 156 TFLOP/s on the same count (same probe);
- memory-bound work (norms, rotary, activations, permutation, the optimizer) at the HBM's 4.8 TB/s
  (datasheet) over the bytes the step's tensors take (``MEMORY_PASSES`` passes over the
  activations of each layer, assumed; the optimizer reads and writes its shards once);
- the weights' traffic of every microbatch: each device reads the weights it computes with (its gathered
  FSDP shards) in the forward and again for the input gradients (once more under full recompute), writes
  the weight gradients, and with accumulation reads and writes the gradient sum. A step of many small
  microbatches pays this once per microbatch, which is why MBS 1 x 64 runs slower than MBS 4 x 16 on one
  H100 although their FLOPs are equal (bench/results/plans.md);
- the H100 (``H100``): the H200's compute rates (same SMs, clocks and power) with its own memory, 80 GB of
  HBM3 at 3.35 TB/s (datasheet); the planner and auto-fit take it from the device's kind;
- links: NVLink 900 GB/s per GPU (datasheet; 450 each way) at an assumed 0.8 for all-gather /
  reduce-scatter; the MoE all-to-all at the measured rates (EP = 2 on one host, bench/results/moe_layer.md:
  fixed-size all_to_all ~220 GB/s, ragged ~80 GB/s: the dropless path is ragged); across
  hosts 8 x 400 Gb/s InfiniBand per 8-GPU host (assumed unless ``--inter-host-gbps``), 0.8 of it.
- overlap (assumed): FSDP gathers and gradient reductions hide behind the layers' compute up to
  ``OVERLAP`` of it (XLA's latency-hiding scheduler); TP, EP and the pipeline's hand-offs are on the
  critical path; the pipeline's bubbles cost ``(S - 1) / (M x R)`` of the decoder's time.

The sum is scaled by one factor measured end to end: the model's own estimate of recipe h200
(proxy model, one H200, MBS 11, selective recompute, bf16 parameters and AdamW state) against its
measured step (bench/results/step.md: 61,095 useful tokens/s, MFU 47.6%: ~674 ms a step), so every
estimate here is "what the measured step would take at this size", not a datasheet bound. The H100's
measured points (bench/results/step.md, plans.md) check the model's ranking of micro batches
(tests/plan/test_time.py).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from moevlm_jax.config import load_layout
from moevlm_jax.model.registry import load_model_config
from moevlm_jax.perf.flops import ModelShape, vision_params_per_patch
from moevlm_jax.plan.comm import step_communication
from moevlm_jax.plan.geometry import DTYPE_BYTES, Geometry, geometry, shard_table
from moevlm_jax.plan.memory import MemoryKnobs


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator and its links (rates in FLOP/s and bytes/s)."""

    name: str = "H200"
    memory_gib: float = 141.0  # datasheet HBM3e (the device reports ~140.4 GiB: bench/results/sweep.md)
    usable_fraction: float = 0.95  # of the memory a step may use (XLA_PYTHON_CLIENT_MEM_FRACTION in bench/)
    peak_flops: float = 989e12  # dense bf16 datasheet (flops.PEAK_BF16_FLOPS)
    dense_flops: float = 780e12  # measured: a large bf16 matmul
    experts_dropless_flops: float = 382e12  # measured: Triton grouped matmul, 30B-A3B shapes
    experts_capacity_flops: float = 393e12  # measured: drop-and-pad einsum, capacity 1.25
    attention_flops: float = 423e12  # measured: cuDNN ragged causal, fwd + bwd at 3.5 x forward
    vision_attention_flops: float = 156e12  # measured: cuDNN ragged head dim 72, fwd + bwd at 3.5 x forward
    hbm_bytes: float = 4.8e12  # datasheet
    nvlink_bytes: float = 450e9 * 0.8  # datasheet 900 GB/s per GPU (450 each way) x 0.8 assumed
    a2a_bytes: float = 220e9  # measured (EP 2): fixed-size all_to_all
    ragged_a2a_bytes: float = 80e9  # measured (EP 2): ragged all-to-all (the dropless path)
    inter_host_gbps: float = 8 * 400  # per 8-GPU host (assumed: 8 x 400 Gb/s InfiniBand)
    inter_host_efficiency: float = 0.8  # assumed
    gpus_per_host: int = 8

    @property
    def inter_host_bytes_per_gpu(self) -> float:
        return self.inter_host_gbps / 8 * 1e9 * self.inter_host_efficiency / self.gpus_per_host


H200 = Hardware()
H100 = dataclasses.replace(H200, name="H100", memory_gib=80.0, hbm_bytes=3.35e12)  # SXM: HBM3 80 GB, 3.35 TB/s
HARDWARE = {"h100": H100, "h200": H200}


def hardware_of(device_kind: str | None) -> Hardware:
    """The rates of a GPU from its ``device_kind`` ("NVIDIA H100 80GB HBM3" -> H100); the H200's otherwise."""
    kind = (device_kind or "").lower()
    return next((hw for key, hw in HARDWARE.items() if key in kind), H200)


MEMORY_PASSES = 12  # passes over each layer's activations by memory-bound kernels, forward + backward (assumed)
# launch / idle per layer and microbatch (bench/results/plans.md: ~20 ms idle, 35 layers)
LAUNCH_S_PER_LAYER = 0.55e-3
OVERLAP = 0.8  # share of the compute FSDP / gradient collectives can hide behind (assumed)
FILL = 0.914  # useful / all token slots of the proxy data's packed rows (bench/results/step.md's runs)
# the recipe-h200 point the scale factor is measured at (bench/results/step.md: one H200, MBS 11)
REFERENCE = {"model": "proxy", "mbs": 11, "seq": 4096, "patches": 3136, "image_patches": 784,
             "useful_tokens_per_s": 61095.0}
REFERENCE["step_s"] = REFERENCE["mbs"] * REFERENCE["seq"] * FILL / REFERENCE["useful_tokens_per_s"]


@dataclasses.dataclass
class TimeEstimate:
    """Seconds per step: compute by component, exposed communication by kind, total."""

    compute: dict[str, float]
    comm: dict[str, float]
    step_s: float
    scale: float = 1.0

    @property
    def compute_s(self) -> float:
        return float(sum(self.compute.values()))

    @property
    def comm_s(self) -> float:
        return float(sum(self.comm.values()))


def _flop_parts(model: Any, g: Geometry, knobs: Any, image_patches: int, fill: float) -> dict[str, float]:
    """Training FLOPs of one step over the whole batch, by component, with the recompute's extra forwards."""
    t, v = model.text_config, model.vision_config

    m = ModelShape.from_config(model)
    rows = g.mbs * g.dp * knobs.grad_accum
    tokens = rows * g.seq * fill
    h = t.hidden_size
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    n_moe = m.num_moe_layers or 0
    dense_mlps = t.num_hidden_layers - n_moe  # Qwen3.5-MoE has none (and no dense intermediate size)
    dense_params = t.num_hidden_layers * (2 * h * q + 2 * h * kv) + n_moe * h * t.num_experts \
        + (dense_mlps * 3 * h * t.intermediate_size if dense_mlps else 0) + h * t.vocab_size
    expert_params = n_moe * t.num_experts_per_tok * 3 * h * t.moe_intermediate_size
    doc = g.seq * fill  # one packed document a row (the proxy data)
    att = 6.0 * t.num_hidden_layers * t.num_attention_heads * t.head_dim * doc * doc * rows
    if g.cp > 1:  # context parallel: each rank's [S/cp, S] block is computed whole (masked, not skipped)
        att *= 2
    parts = {"dense": 6.0 * dense_params * tokens, "experts": 6.0 * expert_params * tokens, "attention": att}
    if g.patches:

        patches = rows * g.patches * fill
        images = patches / image_patches
        parts["dense"] += 6.0 * vision_params_per_patch(m) * patches
        parts["vision_attention"] = 12.0 * v.depth * v.hidden_size * image_patches**2 * images
        if "vision_model" in knobs.frozen:  # no weight gradients in the tower (its input needs none either)
            parts["dense"] -= 6.0 * v.depth * (4 * v.hidden_size**2 + 2 * v.hidden_size * v.intermediate_size) * patches
            parts["vision_attention"] /= 3
    # recompute: the recomputed parts' forward once more (1/3 of their training FLOPs)
    extra = {}
    for tower, keys in (("text", ("dense", "experts", "attention")), ("vision", ("vision_attention",))):
        mode, mods = knobs.tower(tower)
        share = {"dense": 0.0, "experts": 0.0, "attention": 0.0, "vision_attention": 0.0}
        if mode == "full":
            share = dict.fromkeys(share, 1 / 3)
        elif mode == "selective":
            mods = set(mods)
            if "core_attn" in mods:
                share["attention" if tower == "text" else "vision_attention"] = 1 / 3.5
            if mods & {"experts", "moe"}:
                share["experts"] = 1 / 3
        for k in keys:
            if k in parts and share.get(k):
                extra[k] = parts[k] * share[k]
    if knobs.tower("vision")[0] == "full" and g.patches:
        extra["dense"] = extra.get("dense", 0.0) + 6.0 * v.depth * (4 * v.hidden_size**2 + 2 * v.hidden_size
                                                                     * v.intermediate_size) * rows * g.patches / 3
    for k, val in extra.items():
        parts[k] = parts.get(k, 0.0) + val
    return parts


def model_flops(model: Any, g: Geometry, knobs: Any, image_patches: int = 784, fill: float = FILL) -> float:
    """Training FLOPs of one step over the whole batch without the recompute's extra forwards (MFU's count)."""
    plain = dataclasses.replace(knobs, recompute="none", recompute_modules=(), vision_recompute="none",
                                vision_recompute_modules=())
    return float(sum(_flop_parts(model, g, plain, image_patches, fill).values()))


def _memory_bound_bytes(model: Any, g: Geometry, knobs: Any, devices: int) -> dict[str, float]:
    """Bytes per device the memory-bound work moves: activations per layer, the optimizer's shards."""
    t, v = model.text_config, model.vision_config
    c = DTYPE_BYTES[knobs.dtype]
    micro = knobs.grad_accum
    layer = g.tokens_res * t.hidden_size * c + g.moe_tokens * t.num_experts_per_tok * t.hidden_size * c * 2
    dec = MEMORY_PASSES * layer * g.layer_runs(t.num_hidden_layers) * micro
    vis = MEMORY_PASSES * g.vis_rows * g.patches * (v.hidden_size + v.intermediate_size / g.tp_vis_mlp) * c \
        * v.depth * micro if g.patches else 0.0
    shards = shard_table(model, knobs.param_dtype, knobs.expert_bias, g.rules, g.shape)
    trainable = sum(s.local for s in shards if s.param.trainable and s.param.group not in knobs.frozen)
    pb, sb = DTYPE_BYTES[knobs.param_dtype], DTYPE_BYTES[knobs.state_dtype]
    opt = trainable * (2 * pb + 4 + 4 * sb)  # read + write params and both moments, read the float32 gradient
    # per microbatch: the weights a device computes with (FSDP shards gathered) read in the forward and for the
    # input gradients (+1 under full recompute), the weight gradients written, the gradient sum read + written
    gathered = sum(s.local * s.fsdp_size for s in shards)
    trained = sum(s.local * s.fsdp_size for s in shards if s.param.trainable and s.param.group not in knobs.frozen)
    reads = 3 if knobs.tower("text")[0] == "full" else 2
    weights = gathered * pb * reads + trained * c
    if micro > 1:
        weights += trainable * DTYPE_BYTES[knobs.accum_dtype] * 2
    return {"activations": dec + vis, "optimizer": opt, "weights": weights * micro}


def _raw_time(model: Any, g: Geometry, knobs: Any, comm: Any, hw: Hardware, image_patches: int,
              fill: float, devices: int) -> tuple[dict[str, float], dict[str, float]]:
    flops = _flop_parts(model, g, knobs, image_patches, fill)
    att_scale = 3.5 / 3.0
    expert_rate = hw.experts_capacity_flops if knobs.capacity_factor is not None else hw.experts_dropless_flops
    bubble = (g.microbatches * g.repeats + g.stages - 1) / (g.microbatches * g.repeats) if g.stages > 1 else 1.0
    compute = {
        "dense": flops["dense"] / devices / hw.dense_flops,
        "experts": flops["experts"] / devices / expert_rate * bubble,
        "attention": flops["attention"] / devices * att_scale / hw.attention_flops * bubble,
    }
    if "vision_attention" in flops:
        compute["vision_attention"] = flops["vision_attention"] / devices * att_scale / hw.vision_attention_flops
    mem = _memory_bound_bytes(model, g, knobs, devices)
    compute["memory_bound"] = mem["activations"] / hw.hbm_bytes
    compute["optimizer"] = mem["optimizer"] / hw.hbm_bytes
    compute["weights"] = mem["weights"] / hw.hbm_bytes
    layers = g.layer_runs(model.text_config.num_hidden_layers) + (model.vision_config.depth if g.patches else 0)
    compute["launch"] = LAUNCH_S_PER_LAYER * layers * knobs.grad_accum
    # communication: intra-host at the link rate, the part crossing hosts at the network's
    times = {}
    for kind, groups in comm.by_kind.items():
        total = 0.0
        for grp, b in groups.items():
            cross = comm.cross.get(kind, {}).get(grp, 0.0)
            rate = hw.nvlink_bytes
            if kind == "ep":
                rate = hw.a2a_bytes if knobs.capacity_factor is not None else hw.ragged_a2a_bytes
            total += (b - cross) / rate + cross / hw.inter_host_bytes_per_gpu
        times[kind] = total
    return compute, times


@functools.lru_cache(maxsize=1)
def reference_scale() -> float:
    """Measured / modelled step time of recipe h200 (one H200; bench/results/step.md)."""


    model = load_model_config(REFERENCE["model"])
    g = geometry(model, load_layout("fsdp").rules, {"fsdp": 1}, mbs=REFERENCE["mbs"], seq=REFERENCE["seq"],
                 patches=REFERENCE["patches"])
    knobs = MemoryKnobs(param_dtype="bfloat16", state_dtype="bfloat16", recompute="selective", recompute_modules=(),
                        attention="cudnn")
    comm = step_communication(model, g, knobs, 8)
    compute, _ = _raw_time(model, g, knobs, comm, H200, REFERENCE["image_patches"], FILL, 1)
    return REFERENCE["step_s"] / sum(compute.values())


def step_time(model: Any, g: Geometry, knobs: Any, comm: Any, *, hw: Hardware = H200, image_patches: int = 784,
              fill: float = FILL, devices: int) -> TimeEstimate:
    """Estimated seconds a step takes on ``devices`` devices (module docstring)."""
    scale = reference_scale()
    compute, comm_t = _raw_time(model, g, knobs, comm, hw, image_patches, fill, devices)
    compute = {k: v * scale for k, v in compute.items()}
    busy = sum(compute.values())
    layer_compute = busy - compute["optimizer"]
    exposed = {}
    for kind, t_c in comm_t.items():
        if kind in ("fsdp_gather", "grad_reduce"):
            hide = OVERLAP * layer_compute
            exposed[kind] = max(t_c - hide, (1 - OVERLAP) * t_c)
            layer_compute = max(layer_compute - t_c, 0.0)
        elif kind == "cp":
            exposed[kind] = 0.5 * t_c
        else:
            exposed[kind] = t_c
    return TimeEstimate(compute=compute, comm=exposed, step_s=busy + sum(exposed.values()), scale=scale)


def sources(hw: Hardware = H200) -> str:
    """Which of the plan's numbers are measured (and where) and which are assumed."""
    return "\n".join([
        "Measured (bench/): dense GEMM {:.0f} TFLOP/s (README); experts dropless {:.0f}, capacity 1.25 {:.0f} "
        "(moe_layer.md); decoder attention {:.0f}, vision attention {:.0f} fwd+bwd at 3.5x forward "
        "(attention.md, second probe); all-to-all {:.0f} GB/s fixed-size, {:.0f} ragged (moe_layer.md, EP 2); "
        "the whole step: recipe h200 at MBS {} {:.1f} ms (step.md; the scale factor {:.3f}); useful / all tokens "
        "{:.3f} and trained / all {:.3f} (the proxy data).".format(
            hw.dense_flops / 1e12, hw.experts_dropless_flops / 1e12, hw.experts_capacity_flops / 1e12,
            hw.attention_flops / 1e12, hw.vision_attention_flops / 1e12, hw.a2a_bytes / 1e9, hw.ragged_a2a_bytes / 1e9,
            REFERENCE["mbs"], REFERENCE["step_s"] * 1e3, reference_scale(), FILL, 0.437),
        "Datasheet ({}): {:.0f} GiB HBM ({:.0%} usable, assumed), {:.2f} TB/s HBM, 989 TFLOP/s bf16, NVLink 900 GB/s "
        "per GPU.".format(hw.name, hw.memory_gib, hw.usable_fraction, hw.hbm_bytes / 1e12),
        "Assumed: NVLink collectives at 0.8 of 450 GB/s each way; across hosts {:.0f} Gb/s per {}-GPU host at {:.0%}; "
        "FSDP / gradient collectives hidden behind up to {:.0%} of the compute, TP / EP / PP exposed, CP half; {} "
        "memory-bound passes over each layer's activations; {:.2f} ms launch / idle a layer; balanced experts; one "
        "packed document a row. Memory: the analytic model of plan.memory (checked against XLA's compiled analysis "
        "on CPU: bench/results/plans.md) + {:.0%} of the temporaries for XLA's buffer packing; the cuDNN path's "
        "residuals are read from the code, not measured.".format(
            hw.inter_host_gbps, hw.gpus_per_host, hw.inter_host_efficiency, OVERLAP, MEMORY_PASSES,
            LAUNCH_S_PER_LAYER * 1e3, __import__("moevlm_jax.plan.memory", fromlist=["x"]).XLA_HEADROOM)])
