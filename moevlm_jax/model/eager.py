"""The eager (Hugging Face style) entry points every model family shares: ``hf_call`` turns HF model
inputs into the project's batch (``data.batch.hf_inputs_to_batch``) and runs the compiled forward;
``jit_forward`` is ``model.forward(batch)`` compiled once per graph and batch shapes."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from moevlm_jax.data.batch import hf_inputs_to_batch


@functools.partial(jax.jit, static_argnums=0)
def _jit_forward(graphdef: nnx.GraphDef, state: nnx.State, batch: dict) -> tuple[jax.Array, dict]:
    return nnx.merge(graphdef, state).forward(batch)


def jit_forward(model: Any, batch: Mapping[str, Any]) -> tuple[jax.Array, dict]:
    """``model.forward(batch)`` compiled: (logits ``[B, S, vocab]`` float32, aux)."""
    graphdef, state = nnx.split(model)
    return _jit_forward(graphdef, state, dict(batch))


def hf_call(model: Any, input_ids: Any, pixel_values: Any = None, image_grid_thw: Any = None,
            attention_mask: Any = None, pixel_values_videos: Any = None, video_grid_thw: Any = None) -> jax.Array:
    """HF-style call: input_ids ``[B, S]``, pixel_values ``[N, patch_dim]``, image_grid_thw ``[n, 3]``,
    attention_mask ``[B, S]``, pixel_values_videos / video_grid_thw (numpy, torch or jax) -> logits
    ``[B, S, vocab]`` float32."""
    batch = hf_inputs_to_batch(model.config, _np(input_ids), _np(pixel_values), _np(image_grid_thw),
                               _np(attention_mask), pixel_values_videos=_np(pixel_values_videos),
                               video_grid_thw=_np(video_grid_thw))
    return jit_forward(model, batch)[0]


def _np(x: Any) -> np.ndarray | None:
    if x is None:
        return None
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x)
