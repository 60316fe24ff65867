"""Host-side agreement across processes (the multi-controller runtime's view of a batch).

Each process builds its own rows of a global batch; per-batch statics that select a compiled
program (the loss capacity, the cuDNN bound check) must be the same in every process, so the
trainer agrees on them here. One process: the values as they are, no communication.
"""

from __future__ import annotations

import jax
import numpy as np


def agreed_max(value: int) -> int:
    """The largest ``value`` over all processes (each computes a per-batch static from its own rows;
    every process must compile the same program)."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.asarray(value))))
