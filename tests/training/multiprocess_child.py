"""Child script of tests/training/test_multiprocess.py, run by ``python -m moevlm_jax.launch``: one of
several processes trains the tiny model 3 steps under each of the given layouts through the trainer
(jax.distributed from the launcher's MOEVLM_* variables; this process feeds its half of the rows) and
prints the per-step metrics as one JSON line per layout."""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from moevlm_jax.training import distributed


def main(layouts: list[str]) -> int:
    distributed.initialize()
    from moevlm_jax.config import load_layout
    from moevlm_jax.model.registry import load_model_config
    from moevlm_jax.training.trainer import Trainer
    from tests.parallelism.test_layouts import COMPUTE, FAST, METRICS, OPTIMIZER, STEPS, random_params
    from tests.training.test_multiprocess import ROWS, global_batch

    config = load_model_config("tiny-v512")
    batch = global_batch(config)
    p, n = jax.process_index(), jax.process_count()
    local = {k: (v[:, p * ROWS // n:(p + 1) * ROWS // n] if k == "positions" else v[p * ROWS // n:(p + 1) * ROWS // n])
             for k, v in batch.items()}
    for name in layouts:
        trainer = Trainer.create(config, COMPUTE, load_layout(name), OPTIMIZER, steps=STEPS)
        state = trainer.init_state(seed=0, params=random_params(config))
        placed = trainer.prepare(local)
        compiled = trainer.lower_step(state, placed.arrays, placed.capacity, bounded=placed.bounded).compile(FAST)
        records = []
        for _ in range(STEPS):
            state, metrics = compiled(state, placed.arrays)
            records.append({k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items() if k in METRICS})
        print("RESULT " + json.dumps({"layout": name, "process": p, "records": records}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
