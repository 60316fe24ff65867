"""Shared fixture: every test config as a random HF model saved with transformers' save_pretrained."""

from __future__ import annotations

import pytest

from tests.model.hf_reference import HFFixture, build_hf, hf_config_dicts


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, HFFixture]:
    """Every test config as a random HF model saved with transformers' save_pretrained."""
    out = {}
    for seed, (name, cfg) in enumerate(hf_config_dicts().items()):
        model = build_hf(cfg, seed)
        path = tmp_path_factory.mktemp(f"hf_{name}")
        model.save_pretrained(path)
        out[name] = HFFixture(name, cfg, model, str(path))
    return out
