"""The model families that tests are parametrised over (``family``: "qwen3_vl" for Qwen3-VL-MoE,
"qwen3_5" for Qwen3.5-MoE), and a per-family cache for module fixtures: a module's tests of both
families share one fixture, each family's value computed once, on first use."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FAMILIES = ("qwen3_vl", "qwen3_5")


class PerFamily(dict):
    """family -> make(family), each made on first use and kept (a module fixture's value: once a module)."""

    def __init__(self, make: Callable[[str], Any]):
        super().__init__()
        self.make = make

    def __missing__(self, family: str) -> Any:
        if family not in FAMILIES:
            raise KeyError(family)
        self[family] = value = self.make(family)
        return value
