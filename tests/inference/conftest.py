"""The HF reference models of the model tests (tests/model/hf_reference.py), for the generation tests."""

from tests.model.conftest import hf_models  # noqa: F401 - a fixture
