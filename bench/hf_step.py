"""The Hugging Face side of ``python -m bench.step --peer hf``: transformers' model of the
bench model's family (:data:`HF_MODELS`, by the ``model_type`` of the HF directory, through
:mod:`moevlm_jax.model.registry`) trained in torch on the batches our side trained on, from the same
initial weights: ``Qwen3VLMoeForConditionalGeneration`` (Qwen3-VL-MoE) or
``Qwen3_5MoeForConditionalGeneration`` (Qwen3.5-MoE; a transformers without
``transformers.models.qwen3_5_moe`` is refused with a :class:`PeerError` naming the version, exit 2).

Run by the bench in its own process (``python -m bench.hf_step --spec SPEC --out OUT``), after
the JAX side has exited, so each side has the whole accelerator. The spec (JSON, written by
``bench.step``) names the HF model directory (our initial parameters, ``hf.save_pretrained``,
which writes either family's layout), the optimizer settings and, per run, a directory of
``stepNNNN.npz`` host batches (the batch of ARCHITECTURE.md), the learning rate our side applied at
each step and which steps were timed.

Settings (the strongest HF configuration bench/README.md records): CUDA -> bf16 parameters,
``attn_implementation="sdpa"``, experts ``grouped_mm``, ``torch.optim.AdamW(fused=True)``, each
run eager and with ``torch.compile`` per transformer block (``compile_blocks``; the faster counts);
CPU -> float32, eager, unfused, denormals flushed as XLA:CPU does (tests). Both families have the
same block structure (``model.visual.blocks``, ``model.language_model.layers``) and ``grouped_mm``
experts, so every setting applies to both. A compiled run that fails (e.g. inductor on HF's
PyTorch GDN loop) is recorded as ``status: error`` with its message and the next run goes on; the
eager run, which checks the losses, is not caught.
The optimizer mirrors ours: AdamW (decoupled decay, same betas/eps/lr per step, no decay on the
``no_decay_patterns``), global-norm clipping; the loss is cross-entropy + the router aux loss
(``output_router_logits``, over non-padding tokens as ours; see :meth:`Peer.step`).

Qwen3.5's Gated DeltaNet layers in HF: ``chunk_gated_delta_rule`` and ``causal_conv1d_fn`` resolve,
when transformers is imported, to flash-linear-attention's / causal-conv1d's kernels if those
packages are installed, else to transformers' PyTorch reference code (``torch_chunk_gated_delta_rule``:
a Python loop over chunks of 64 tokens; ``F.conv1d``). :func:`gdn_implementation` reads which one
the loaded module holds; the result JSON's ``info["gdn"]`` records it (``"torch"`` on a machine
without fla, such as the H200 test machine, where fla cannot be installed).

Batches -> HF inputs (:func:`hf_batch`): ``input_ids``; ``labels`` = next-token targets where
``loss_mask`` is set (HF shifts labels inside its loss); ``pixel_values`` = each row's valid
patches in order, rows in order, with ``image_grid_thw`` ``(1, h, w)`` per image (HF scatters image
features onto image tokens in that order, as ours does per row); ``position_ids`` = our MRoPE
positions ``[3, B, S]`` and, when a row packs several samples, a leading text-position row
restarting at each sample (``[4, B, S]``): transformers then builds a block-diagonal causal mask
from it (``find_packed_sequence_indices``), so packed samples never see each other *in attention*,
as ours (both families read the ``[4, B, S]`` form).
No ``attention_mask`` and ``use_cache=False`` (either would switch that detection off; a training
step needs no KV cache anyway); trailing padding continues the last sample's positions and carries
no labels. Timing per step: host->device copy, forward, backward,
clipping, optimizer step (synchronised); the batches are already in host memory (no loader).

Packed rows and HF's Gated DeltaNet (Qwen3.5; a known limitation of HF, not of this harness): HF's
GDN layers keep samples apart only through flash-attention's ``cu_seq_lens`` kwargs handed to fla's
varlen kernels; with ``sdpa`` attention there are none, and transformers' PyTorch fallback has no
such input at all (without fla, 5.24 refuses ``cu_seqlens``, 5.17 drops it). So in a row that packs several
samples, HF runs the causal conv and the delta-rule recurrence over the whole row: each sample
after the first starts from the previous sample's recurrent state and conv window (the state leaks
across samples), where ours restarts both at every sample (``segment_ids``). Trailing padding is
harmless on both sides (causal: it comes after every trained token and carries no labels). HF's
losses on packed rows therefore differ from ours by that leak (qwen3.5-tiny, CPU float32: 4e-4
relative on rows of two samples against 8e-8 on rows of one; both under the bench's float32 rtol,
so an "agree" on packed rows says less than it reads), and the bench's step-by-step loss check
(``compare_losses``) is a correctness check only on rows of one sample each (the proxy workload's
rows hold one sample each); each result records ``packed_per_step``. The throughput comparison
still stands on packed rows: the leak changes values, not which operations run on which shapes
(the same conv, chunked rule, attention and experts over the same tokens), so HF's step time is
the same whichever values it computes.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.step_report import steady_rate

IGNORE = -100

# our model family (moevlm_jax.model.registry) -> (transformers modeling module, model class)
HF_MODELS: dict[str, tuple[str, str]] = {
    "qwen3_vl_moe": ("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),
    "qwen3_5_moe": ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"),
}
# the GDN functions transformers' Qwen3.5 resolves to an optional package's kernel at import time
GDN_FUNCTIONS: dict[str, str] = {"torch_chunk_gated_delta_rule": "fla", "causal_conv1d_fn": "causal_conv1d"}


class PeerError(RuntimeError):
    """The HF peer cannot run this model with the installed transformers (the message says why)."""


def family_of_dir(model_dir: str | Path) -> str:
    """Our model family (``registry.FAMILIES`` name) of an HF model directory, by its config.json's
    ``model_type``; PeerError for a family the peer has no transformers class for."""
    from moevlm_jax.model.registry import family_for_type

    model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
    family = family_for_type(model_type).name
    if family not in HF_MODELS:
        raise PeerError(f"the HF peer has no transformers model for family {family!r} (known: {', '.join(HF_MODELS)})")
    return family


def hf_modeling(family: str) -> tuple[Any, type]:
    """(transformers modeling module, model class) of ``family``; PeerError naming the transformers
    version when it lacks them (e.g. a transformers older than Qwen3.5-MoE)."""
    import transformers

    module_name, class_name = HF_MODELS[family]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PeerError(f"transformers {transformers.__version__} has no {module_name.rsplit('.', 1)[0]} ({e}): the HF "
                        f"peer of a {family} model needs a transformers that has it (5.17.0 and 5.24.0 do)") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise PeerError(f"transformers {transformers.__version__}: {module_name} has no {class_name}")
    return module, cls


def _closure_value(fn: Any, name: str) -> Any:
    """The value of free variable ``name`` in ``fn``'s closure (None when it has none of that name)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None or name not in code.co_freevars:
        return None
    return cells[code.co_freevars.index(name)].cell_contents


def gdn_implementation(modeling: Any) -> dict[str, Any]:
    """Which code HF's Qwen3.5 GDN layers run: for each of :data:`GDN_FUNCTIONS`, the function the
    module-level wrapper (``use_kernel_func_from_hub_with_fallback``; with the ``kernels`` package installed,
    transformers 5.25 hands that wrapper to a ``Func`` module's forward) resolved to at import time
    (``module.qualname``) and whether that is the optional package's kernel or transformers' own
    PyTorch code; ``"gdn"``: ``"fla"`` when the chunked rule is fla's, else ``"torch"``. Empty for a
    module without GDN (Qwen3-VL)."""
    out: dict[str, Any] = {}
    for name, package in GDN_FUNCTIONS.items():
        fn = getattr(modeling, name, None)
        if fn is None:
            continue
        if getattr(fn, "__code__", None) is None:  # the `kernels` package installed (transformers 5.25): a module
            fn = _closure_value(getattr(type(fn), "forward", None), "func") or fn  # whose forward calls the wrapper
        impl = _closure_value(fn, "implementation") or fn  # no wrapper (an older transformers): the function itself
        qual = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__qualname__', getattr(impl, '__name__', '?'))}"
        ours = qual.startswith("transformers.")
        out[name] = {"implementation": qual, "kind": "torch" if ours else package,
                     "package_installed": importlib.util.find_spec(package) is not None}
    if "torch_chunk_gated_delta_rule" in out:
        out["gdn"] = out["torch_chunk_gated_delta_rule"]["kind"]
    return out


def packed(batch: dict[str, np.ndarray]) -> bool:
    """Whether any row of a host batch packs more than one sample."""
    return any(len(np.unique(row[row > 0])) > 1 for row in np.asarray(batch["segment_ids"]))


def text_positions(segment_ids: np.ndarray) -> np.ndarray:
    """``[B, S]`` position within each packed sample, restarting at 0 at every sample start; padding
    continues the sample before it (so a padded row stays one sequence for HF's packing detection)."""
    seg = np.asarray(segment_ids)
    b, s = seg.shape
    ar = np.broadcast_to(np.arange(s), (b, s))
    last = np.maximum.accumulate(np.where(seg > 0, ar, 0), axis=1)  # index of the last non-padding token
    owner = np.take_along_axis(seg, last, axis=1)  # padding takes the id of the sample before it
    start = np.ones((b, s), bool)
    start[:, 1:] = owner[:, 1:] != owner[:, :-1]
    first = np.maximum.accumulate(np.where(start, ar, 0), axis=1)
    return (ar - first).astype(np.int64)


def hf_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our host batch -> HF model inputs (numpy): input_ids, labels, position_ids and, with images,
    pixel_values ``[N, patch_dim]`` + image_grid_thw ``[n, 3]`` (see the module docstring)."""
    ids = np.asarray(batch["input_ids"]).astype(np.int64)
    seg = np.asarray(batch["segment_ids"])
    b, s = ids.shape
    labels = np.full((b, s), IGNORE, np.int64)
    mask = np.asarray(batch["loss_mask"]) > 0
    labels[:, 1:] = np.where(mask[:, :-1], np.asarray(batch["targets"])[:, :-1], IGNORE)
    positions = np.asarray(batch["positions"]).astype(np.int64)
    if packed(batch):
        positions = np.concatenate([text_positions(seg)[None], positions], axis=0)
    out = {"input_ids": ids, "labels": labels, "position_ids": positions}
    if "patch_segment_ids" in batch and np.any(np.asarray(batch["patch_segment_ids"]) > 0):
        pseg, hw = np.asarray(batch["patch_segment_ids"]), np.asarray(batch["patch_hw"])
        pixels, grids = [], []
        for r in range(b):
            for image in range(1, int(pseg[r].max(initial=0)) + 1):
                where = np.flatnonzero(pseg[r] == image)
                h, w = (int(v) for v in hw[r, where[0]])
                if h * w != len(where):
                    raise ValueError(f"row {r} image {image}: {len(where)} patches but grid {h}x{w} (videos are not "
                                     "supported)")
                pixels.append(np.asarray(batch["pixel_values"])[r, where])
                grids.append((1, h, w))
        out["pixel_values"] = np.concatenate(pixels).astype(np.float32)
        out["image_grid_thw"] = np.asarray(grids, np.int64)
    return out


def load_steps(directory: str | Path) -> list[dict[str, np.ndarray]]:
    """The ``stepNNNN.npz`` batches of a run directory, in step order."""
    return [dict(np.load(p)) for p in sorted(Path(directory).glob("step*.npz"))]


# ----------------------------------------------------------------------------- the torch side

def graph_count() -> int:
    """Graphs torch.compile (dynamo) has traced so far in this process (0 when torch is absent)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"]["unique_graphs"])


def compile_blocks(model: Any) -> Any:
    """``torch.compile`` per transformer block (every vision block and decoder layer), as torchtitan
    compiles: identical blocks share one compiled graph (parameters are graph inputs), and the
    model's data-dependent parts (the image-token scatter, DeepStack's boolean-mask assignment) stay
    eager. Compiling the whole model instead broke its graph there ("inductor failed with
    aten.nonzero") and did not finish within a 10-minute H200 call (bench/results/step.md).
    Returns the model (its blocks compiled in place; ``uncompile_blocks`` undoes it)."""
    for block in _blocks(model):
        block.compile()
    return model


def uncompile_blocks(model: Any) -> None:
    """Back to eager blocks (``nn.Module.compile`` keeps the compiled call in ``_compiled_call_impl``)."""
    for block in _blocks(model):
        block._compiled_call_impl = None


def _blocks(model: Any) -> list[Any]:
    return [*model.model.visual.blocks, *model.model.language_model.layers]


class Peer:
    """transformers' model of the spec's family (:data:`HF_MODELS`) + AdamW on the local accelerator."""

    def __init__(self, spec: dict[str, Any]):
        import torch
        import transformers

        self.family = family_of_dir(spec["model_dir"])
        modeling, model_class = hf_modeling(self.family)
        self.model_class = model_class.__name__
        self.gdn = gdn_implementation(modeling)
        self.torch, self.balance = torch, modeling.load_balancing_loss_func
        self.cuda = torch.cuda.is_available()
        self.device = torch.device("cuda" if self.cuda else "cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        torch.set_flush_denormal(True)  # CPU ops: flush denormals to zero, as XLA:CPU does
        kw = {"dtype": self.dtype, "attn_implementation": "sdpa"}
        try:
            model = model_class.from_pretrained(spec["model_dir"], experts_implementation="grouped_mm", **kw)
        except (TypeError, ValueError) as e:  # older transformers: no such from_pretrained argument
            print(f"bench_hf: from_pretrained(experts_implementation=...) failed ({e}); setting it on the configs",
                  file=sys.stderr)
            model = model_class.from_pretrained(spec["model_dir"], **kw)
        experts = set()
        for module in model.modules():  # the experts read config._experts_implementation at every forward
            if type(module).__name__.endswith("Experts") and hasattr(module, "config"):
                module.config._experts_implementation = "grouped_mm"
                experts.add(module.config._experts_implementation)
        self.experts = ",".join(sorted(experts)) or "none"
        self.model = model.to(self.device).train()
        self.initial = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        self.aux_coef = float(self.model.config.text_config.router_aux_loss_coef)
        self.spec = spec
        self.clip = float(spec["optimizer"]["clip_grad_norm"])
        self.fused = self.cuda
        self.versions = {"torch": torch.__version__, "transformers": transformers.__version__}
        self.reset()

    def reset(self) -> None:
        """Back to the initial weights with a fresh optimizer (every run starts as ours does)."""
        torch = self.torch
        self.opt = None  # free the previous optimizer state first
        self.model.load_state_dict(self.initial)
        self.model.zero_grad(set_to_none=True)
        opt = self.spec["optimizer"]
        from moevlm_jax.training.optimizer import param_group  # regexes only: no accelerator use

        frozen, groups = set(self.spec.get("frozen", ())), self.spec.get("param_groups")
        no_decay = [re.compile(p) for p in opt["no_decay_patterns"]]
        decay, plain = [], []
        for name, p in self.model.named_parameters():
            path = name.removeprefix("model.").replace(".", "/")  # our '/'-joined parameter paths
            if frozen and param_group(path, groups) in frozen:
                p.requires_grad_(False)
                continue
            (plain if any(r.search(path) for r in no_decay) else decay).append(p)
        self.params = decay + plain
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": float(opt["weight_decay"])},
                                      {"params": plain, "weight_decay": 0.0}],
                                     lr=float(opt["lr"]), betas=(float(opt["b1"]), float(opt["b2"])),
                                     eps=float(opt["eps"]), fused=self.fused)

    def recover(self) -> None:
        """After an out-of-memory error: drop gradients and cached blocks, back to the initial weights."""
        import gc

        self.model.zero_grad(set_to_none=True)
        self.opt = None
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()
        self.reset()

    def tensors(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
        """HF inputs (+ ``token_mask``: non-padding, for the router loss) as host tensors (pinned on
        CUDA), converted once before timing."""
        torch = self.torch
        out = {}
        inputs = {**hf_batch(batch), "token_mask": (np.asarray(batch["segment_ids"]) > 0).astype(np.int64)}
        for k, v in inputs.items():
            t = torch.from_numpy(np.ascontiguousarray(v))
            out[k] = t.pin_memory() if self.cuda else t
        return out

    def step(self, forward: Any, host: dict[str, Any], lr: float) -> dict[str, float]:
        """One optimizer step; returns loss (CE + coef x aux), ce and aux as floats.

        The loss is what the HF model computes from ``labels`` and ``output_router_logits``
        (``loss_function`` + ``router_aux_loss_coef`` x ``load_balancing_loss_func``), with the
        router loss over non-padding tokens, as HF does when given an attention mask (which the
        packed rows cannot have here) and as ours does."""
        torch = self.torch
        inputs = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
        labels, valid = inputs.pop("labels"), inputs.pop("token_mask")
        if "pixel_values" in inputs:
            inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        for group in self.opt.param_groups:
            group["lr"] = lr
        out = forward(**inputs, output_router_logits=True, use_cache=False)  # training: no KV cache
        text = self.model.config.text_config
        ce = self.model.loss_function(logits=out.logits, labels=labels, vocab_size=text.vocab_size)
        aux = self.balance(out.router_logits, text.num_experts, text.num_experts_per_tok, valid)
        loss = ce + self.aux_coef * aux
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.cuda:
            torch.cuda.synchronize()
        return {"loss": float(loss.detach()), "ce": float(ce.detach()), "aux": float(aux.detach())}

    def run(self, run: dict[str, Any], mode: str) -> dict[str, Any]:
        """All steps of one run (eager or compiled): per-step losses and times, timed statistics."""
        hosts = load_steps(run["batch_dir"])
        forward = self.model if mode == "eager" else compile_blocks(self.model)
        try:
            result = self._run(run, mode, forward, hosts)
        finally:
            if mode != "eager":
                uncompile_blocks(self.model)
        # rows packing several samples (Qwen3.5: HF's GDN state leaks across them; module docstring)
        return {**result, "packed_per_step": [packed(h) for h in hosts]}

    def _run(self, run: dict[str, Any], mode: str, forward: Any,
             hosts: list[dict[str, np.ndarray]] | None = None) -> dict[str, Any]:
        torch = self.torch
        batches = [self.tensors(b) for b in (load_steps(run["batch_dir"]) if hosts is None else hosts)]
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        times, losses, compiled = [], [], []
        for host, lr in zip(batches, run["lrs"]):
            graphs, t0 = graph_count(), time.perf_counter()
            losses.append(self.step(forward, host, lr))
            times.append(time.perf_counter() - t0)
            compiled.append(graph_count() > graphs)  # torch.compile traced a new graph (a new shape) in this step
        timed = run["timed"]
        total = sum(times[i] for i in timed)
        useful = sum(run["useful_tokens"][i] for i in timed)
        trained = sum(run["trained_tokens"][i] for i in timed)
        flops = sum(run["flops"][i] for i in timed)
        return {"name": run["name"], "side": f"hf-{mode}", "mode": mode, "steps": len(times),
                "step_times_s": times, "losses": losses, "timed": timed, "compiled_per_step": compiled,
                # without the timed steps that compiled (real data's new shapes): ours' "steady" counterpart
                "steady": steady_rate([{"time": times[i], "useful_tokens": run["useful_tokens"][i],
                                        "flops": run["flops"][i],
                                        "first_run": compiled[i]} for i in timed], 1, None),
                "step_time_s": statistics.median(times[i] for i in timed), "timed_time_s": total,
                "useful_tokens": useful, "trained_tokens": trained, "flops": flops,
                "tokens_per_s": useful / total, "trained_tokens_per_s": trained / total,
                "tflops_per_device": flops / total / 1e12,
                "peak_bytes": int(torch.cuda.max_memory_allocated()) if self.cuda else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hf_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", required=True, help="JSON written by bench.step")
    p.add_argument("--out", required=True, help="results JSON")
    args = p.parse_args(argv)
    spec = json.loads(Path(args.spec).read_text())
    try:
        peer = Peer(spec)
    except PeerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    compile_ = spec.get("compile", "auto")  # auto: torch.compile on CUDA only (CPU: no compiler toolchain needed)
    modes = ["eager", "compile"] if compile_ == "on" or (compile_ == "auto" and peer.cuda) else ["eager"]
    info = {"device": peer.torch.cuda.get_device_name() if peer.cuda else "cpu",
            "dtype": str(peer.dtype).split(".")[-1],
            "family": peer.family, "model_class": peer.model_class,
            "attention": "sdpa", "experts": peer.experts, "fused_adamw": peer.fused, "modes": modes, **peer.versions}
    if peer.gdn:  # Qwen3.5: which GDN code HF runs (fla's kernels or its PyTorch reference), and the packed-row caveat
        info["gdn"] = peer.gdn.pop("gdn")
        info["gdn_functions"] = peer.gdn
        info["packed_rows"] = "HF's GDN state and conv window run across packed samples (attention does not)"
    results: list[dict[str, Any]] = []
    Path(args.out).write_text(json.dumps({"info": info, "results": results}, indent=1))
    for run in spec["runs"]:
        for mode in modes:
            if mode == "eager":  # eager first, from the initial weights: its losses are the check
                peer.reset()
            try:
                results.append(peer.run(run, mode))
                print(f"bench_hf: {run['name']} {mode}: {results[-1]['step_time_s'] * 1e3:.1f} ms/step, "
                      f"{results[-1]['tokens_per_s']:,.0f} useful tokens/s", file=sys.stderr)
            except peer.torch.cuda.OutOfMemoryError as e:  # a result, as on our side; the next run goes on
                results.append({"name": run["name"], "side": f"hf-{mode}", "mode": mode, "status": "oom",
                                "message": str(e).splitlines()[0][:500]})
                print(f"bench_hf: {run['name']} {mode}: out of memory", file=sys.stderr)
                del e
                peer.recover()
            # a compiled run that fails is a result; the eager run (the loss check) is not caught
            except Exception as e:
                if mode == "eager":
                    raise
                results.append({"name": run["name"], "side": f"hf-{mode}", "mode": mode, "status": "error",
                                "message": f"{type(e).__name__}: {str(e).splitlines()[0][:500] if str(e) else ''}"})
                print(f"bench_hf: {run['name']} {mode}: failed ({results[-1]['message']})", file=sys.stderr)
                del e
                peer.recover()
            # written after every run: a caller that stops this process keeps what finished
            Path(args.out).write_text(json.dumps({"info": info, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
