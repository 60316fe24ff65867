"""moevlm_jax: Mixture-of-Experts vision-language models (Qwen3-VL-MoE, Qwen3.5-MoE) in JAX / Flax NNX.

Subpackages by role (ARCHITECTURE.md, "Where is what"): ``model`` (modules and the model config),
``training`` (trainer, objective, optimizer, checkpoints, metrics, loop), ``config`` (the one typed
configuration and its loader), ``hf`` (Hugging Face checkpoints), ``data`` (the input pipeline) and
``parallelism`` (meshes, layouts, dispatch, kernels); the commands ``python -m moevlm_jax.train`` and
``moevlm_jax.launch``.

``moevlm_jax.data`` and ``moevlm_jax.parallelism`` live in the repository's top-level ``data/`` and
``parallelism/`` folders. An installed wheel holds them inside this package (pyproject's
``package-dir``); from a source tree (an editable install, or the repository on ``PYTHONPATH``) the
finder below maps the two names onto those folders. They are not importable as top-level ``data`` /
``parallelism``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_BESIDE = ("data", "parallelism")  # subpackages kept in the repository's top-level folders


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``moevlm_jax.data`` / ``moevlm_jax.parallelism`` in the source tree's top-level folders."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001, ANN201 - the finder protocol
        prefix, _, leaf = fullname.rpartition(".")
        if prefix != __name__ or leaf not in _BESIDE:
            return None
        init = os.path.join(_ROOT, leaf, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(
            fullname, init, submodule_search_locations=[os.path.dirname(init)])


if not all(os.path.isdir(os.path.join(os.path.dirname(__file__), p)) for p in _BESIDE) and not any(
        isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
    sys.meta_path.insert(0,
                         _SourceTreeFinder())  # before an editable install's finder: the folders beside *this* package
