"""Fixtures for the config tests: checkpoints transformers saved (tests/model/conftest.py)."""

from tests.model.conftest import hf_models  # noqa: F401 - a fixture
