"""The FSDP embedding lookup's effect by the planner (analytic, no device): per-device memory of the table's
float32 gradient buffer and FSDP traffic a step, the lookup as ``parallelism.vocab`` runs it (the table split,
ids gathered, rows by all-to-all) against the table gathered (the lookup before 2026-12-05: ``lookup_spread``
forced to ()). Run from the repository root: ``python3 bench/scripts/plan_embedding.py``."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.getcwd())
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from moevlm_jax.config import load_layout  # noqa: E402
from moevlm_jax.model.config import load_model_config  # noqa: E402
from moevlm_jax.tools import plan_comm, plan_memory  # noqa: E402
from moevlm_jax.tools.plan_geometry import geometry  # noqa: E402

GIB = 2**30


def estimate(model, g, knobs, gathered: bool):
    real = plan_comm.lookup_spread, plan_memory.lookup_spread
    if gathered:
        plan_comm.lookup_spread = plan_memory.lookup_spread = lambda rules, shape: ()
    try:
        comm = plan_comm.step_communication(model, g, knobs, devices_per_host=8)
        mem = plan_memory.estimate_memory(model, g, knobs)
    finally:
        plan_comm.lookup_spread, plan_memory.lookup_spread = real
    return comm.total("fsdp_gather") + comm.total("grad_reduce"), mem.parts["embedding"], mem.total


print("| model, FSDP devices (MBS 1 x 4096, recompute full) | FSDP GiB a step a device | embedding buffer GiB | "
      "estimated total GiB |")
print("|---|---:|---:|---:|")
for name in ("qwen3-vl-30b-a3b", "qwen3-vl-235b-a22b"):
    model = load_model_config(name)
    for n in (8, 64):
        g = geometry(model, load_layout("fsdp").rules, {"fsdp": n}, mbs=1, seq=4096, patches=0)
        knobs = plan_memory.MemoryKnobs(recompute="full")
        (ca, ea, ta), (cb, eb, tb) = (estimate(model, g, knobs, gathered) for gathered in (True, False))
        print(f"| {name}, {n} | {ca / GIB:.1f} -> {cb / GIB:.1f} | {ea / GIB:.2f} -> {eb / GIB:.2f} | "
              f"{ta / GIB:.1f} -> {tb / GIB:.1f} |")
