"""Run a module (``python -m`` style) with every ``jnp.searchsorted`` call forced to one method: the A side of an
A/B against the library as it is (parallelism/permute.py and gmm_triton.tile_table use ``compare_all``; ``scan`` is
jnp's default, the library before 2026-12-03).

    python bench/scripts/with_searchsorted.py scan -m moevlm_jax.tools.bench --recipe h200 ...
"""

from __future__ import annotations

import contextlib
import runpy
import sys
from collections.abc import Iterator

import jax.numpy as jnp


@contextlib.contextmanager
def forced(method: str) -> Iterator[None]:
    """Every ``jnp.searchsorted`` call traced inside uses ``method``, whatever method the caller names."""
    original = jnp.searchsorted
    jnp.searchsorted = lambda *a, **kw: original(*a, **{**kw, "method": method})
    try:
        yield
    finally:
        jnp.searchsorted = original


def main() -> None:
    method, flag, module, *args = sys.argv[1:]
    if flag != "-m":
        raise SystemExit("usage: with_searchsorted.py METHOD -m MODULE [ARGS...]")
    forced(method).__enter__()  # for the whole run
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
