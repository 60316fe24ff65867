"""The Hugging Face side of ``bench.moe_layer``: transformers' Qwen3-VL-MoE sparse MoE block in torch.

transformers v5 selects the experts kernel from ``config._experts_implementation`` at every forward
(``@use_experts_implementation`` on ``Qwen3VLMoeTextExperts``); ``"grouped_mm"`` sorts the
assignments by expert and runs ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``. The
block keeps ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (our layouts transposed).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class HFMoeBlock:
    """``Qwen3VLMoeTextSparseMoeBlock`` with given weights, bf16 on CUDA (float32 on CPU)."""

    def __init__(self, top_k: int, router: jax.Array, w_gate_up: jax.Array, w_down: jax.Array):
        import torch
        from transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe import (
            Qwen3VLMoeTextConfig,
        )
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
            Qwen3VLMoeTextSparseMoeBlock,
        )

        self.torch = torch
        self.cuda = torch.cuda.is_available()
        self.device, self.dtype = ("cuda", torch.bfloat16) if self.cuda else ("cpu", torch.float32)
        e, h, two_i = w_gate_up.shape
        cfg = Qwen3VLMoeTextConfig(
            hidden_size=h, moe_intermediate_size=two_i // 2, num_experts=e, num_experts_per_tok=top_k, hidden_act="silu"
        )
        cfg._experts_implementation = "grouped_mm"
        self.implementation = f"{cfg._experts_implementation}, torch {torch.__version__}"
        with torch.device(self.device):
            self.block = Qwen3VLMoeTextSparseMoeBlock(cfg).to(self.dtype)
        with torch.no_grad():
            self.block.gate.weight.copy_(self.to_torch(router))
            self.block.experts.gate_up_proj.copy_(self.to_torch(w_gate_up, (0, 2, 1)))
            self.block.experts.down_proj.copy_(self.to_torch(w_down, (0, 2, 1)))

    def to_torch(self, a: jax.Array, perm: tuple[int, ...] | None = None) -> Any:
        """A JAX array as a torch tensor on the block's device and dtype (dlpack when possible)."""
        try:  # zero-copy on the same device
            t = self.torch.from_dlpack(a)
        except Exception:  # noqa: BLE001 - another device or dtype: through the host
            t = self.torch.from_numpy(np.array(a.astype(jnp.float32)))
        t = t.permute(*perm) if perm else t
        return t.to(device=self.device, dtype=self.dtype).contiguous()

    def time_step(self, x: jax.Array, probe: jax.Array, iters: int, warmup: int) -> float:
        """Median ms of router + experts forward and backward of <block(x), probe> (CUDA events)."""
        torch = self.torch
        xt = self.to_torch(x).requires_grad_(True)
        pt = self.to_torch(probe).float()

        def step():
            self.block.zero_grad(set_to_none=True)
            xt.grad = None
            (self.block(xt[None])[0].float() * pt).sum().backward()

        for _ in range(max(1, warmup)):
            step()
        if self.cuda:
            torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                step()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def experts_rel_errs(
        self, x: jax.Array, idx: jax.Array, w: jax.Array, probe: jax.Array, ours: tuple, grads: tuple
    ) -> list[float]:
        """Experts only, on our routing: relative errors of (out, d_x, d_gate_up, d_down) vs ``ours``/``grads``."""
        torch = self.torch
        self.block.zero_grad(set_to_none=True)
        xt = self.to_torch(x).requires_grad_(True)
        idx_t = torch.from_numpy(np.array(idx)).to(self.device).long()
        out = self.block.experts(xt, idx_t, self.to_torch(w))
        (out.float() * self.to_torch(probe).float()).sum().backward()
        pairs = [
            (out, ours, None),
            (xt.grad, grads[0], None),
            (self.block.experts.gate_up_proj.grad, grads[1], (0, 2, 1)),
            (self.block.experts.down_proj.grad, grads[2], (0, 2, 1)),
        ]
        errs = []
        for t_val, j_val, perm in pairs:  # on the torch device, in float32
            ref = self.to_torch(j_val, perm).float()
            diff = torch.linalg.norm(t_val.detach().float() - ref)
            errs.append(float(diff / torch.linalg.norm(ref).clamp_min(1e-30)))
        return errs

    def close(self) -> None:
        """Free the block and give cached CUDA memory back (JAX runs next)."""
        del self.block
        if self.cuda:
            self.torch.cuda.empty_cache()
