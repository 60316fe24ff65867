"""Auto-fit: before the first step, does the resolved run fit the devices present? If not, the
planner's fastest fitting settings (``moevlm_jax.plan.fit.fit``), said in words, then the run.

What may change (``ALLOW``): the micro batch with the accumulation that keeps the global batch, the
recompute policy, the parameter / AdamW-state dtypes, and the layout preset on the same devices. What
is trained and on which rows never changes: frozen parts, drop-and-pad experts, the global batch,
the sequence length and the data stay as written. ``--no-auto-fit`` keeps the recipe as written.

The check costs a compile only where the answer is in doubt: the analytic estimate (within 10% of
XLA's compiled analysis on CPU, 15% on one H200: bench/results/plans.md) decides when it is below
``SURE_FITS`` or above ``SURE_FAILS`` of the usable memory; between them XLA's compiled memory
analysis of the run's own train step decides. A changed run is confirmed by a compile of its step.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax

from moevlm_jax.parallelism.multihost import host_ids
from moevlm_jax.plan.fit import fit
from moevlm_jax.plan.report import format_table
from moevlm_jax.schema import ConfigError

log = logging.getLogger(__name__)

ALLOW = ("mbs", "recompute", "dtypes", "layout")
SURE_FITS = 0.75  # estimate below this share of the usable memory: fits without a compile
SURE_FAILS = 1.25  # estimate above it: does not fit without a compile


class DoesNotFit(ConfigError):
    """Nothing the planner may change fits the devices: ``table`` holds its ranked alternatives."""

    def __init__(self, message: str, table: str):
        super().__init__(message)
        self.table = table


def host_memory_gib_per_device(devices: int) -> float:
    """On CPU every host device shares the machine's memory: its share, in GiB."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total / 2**30 / max(devices, 1)


def auto_fit(cfg: Any, rebuild: Callable[[Sequence[str]], Any], *, device_memory_gib: float | None = None,
             devices: Sequence[Any] | None = None, report: Callable[[str], None] = print) -> Any:
    """``cfg`` if it fits ``devices`` (default: all), else ``rebuild(overrides)`` with the planner's fastest
    fitting change, after ``report`` has said what changed and why. Raises ConfigError with the
    planner's table when nothing fits. ``device_memory_gib``: the memory a device has (default: the
    allocator's limit on GPU, the machine's share on CPU)."""


    devices = list(devices if devices is not None else jax.devices())
    if device_memory_gib is None and devices[0].platform == "cpu":
        device_memory_gib = host_memory_gib_per_device(len(devices))
    hosts = len(set(host_ids())) if jax.process_count() > 1 else 1
    plan = fit(cfg, devices, device_memory_gib=device_memory_gib, compile=(SURE_FITS, SURE_FAILS), allow=ALLOW,
               hosts=hosts)
    if plan.fits:
        log.info("auto-fit: %s", plan.reason)
        return cfg
    if not plan.change:

        raise DoesNotFit(f"the run does not fit {len(devices)} {devices[0].platform.upper()} device(s): "
                         f"{plan.reason} (--no-auto-fit runs it as written). The planner's alternatives:",
                         format_table(plan.table, 8))
    report(f"auto-fit: {plan.reason}\nauto-fit: running with {' '.join(plan.change)} "
           "(--no-auto-fit keeps the recipe as written)")
    return rebuild(plan.change)
