"""The error every HF checkpoint problem is reported as."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: names the tensor (or file) at fault."""
