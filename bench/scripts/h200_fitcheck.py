"""Auto-fit's verdict on recipe h200 on one H200 (issue 21): the planner's estimate and XLA's compiled
memory analysis of the bounded attention step, as ``python -m moevlm_jax.train --recipe h200`` would
decide before its first step.  python bench/scripts/h200_fitcheck.py OUT.json"""

import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # as the train command

import jax  # noqa: E402

from moevlm_jax.config.run import load_config  # noqa: E402
from moevlm_jax.tools.plan import estimate  # noqa: E402
from moevlm_jax.tools.plan_fit import candidate_of, compiled_memory, device_memory_bytes, workload_of  # noqa: E402
from moevlm_jax.training import capture  # noqa: E402

capture.apply_capture(capture.recipe_compute("h200"))  # before the backend starts, as the train command
cfg = load_config("h200")
devices = jax.devices()
limit = device_memory_bytes(devices)
w = workload_of(cfg, 1, platform="gpu", device_memory_gib=limit / 2**30 / 0.95)
cand = candidate_of(cfg, 1)
est = estimate(cand, w, cfg.compute)
out = {"limit_gib": limit / 2**30, "estimate_gib": est.memory.total / 2**30}
for bounded in (True, False):  # the step of batches within cuDNN's ragged bound, and the fallback's
    t0 = time.perf_counter()
    rep = compiled_memory(cand, w, devices, compute=cfg.compute, optimizer=cfg.optimizer) if bounded else None
    if rep is None:
        from moevlm_jax.tools.memory import memory_report
        rep = memory_report(cfg.model, cfg.layout, cfg.compute, mbs=10, seq_len=4096, patches=w.patches,
                            devices=devices, optimizer=cfg.optimizer, bounded=False)
    out["bounded" if bounded else "fallback"] = {"total_gib": rep["total_bytes"] / 2**30,
                                                 "compile_s": time.perf_counter() - t0,
                                                 **{k: v for k, v in rep.items() if k.endswith("_bytes")}}
    print(json.dumps(out, indent=1, default=str), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1, default=str)
