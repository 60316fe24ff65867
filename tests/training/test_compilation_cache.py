"""train.compilation_cache_dir: JAX's persistent compilation cache, set by the train job before it
compiles (also in a process that compiled already), so a rerun loads its compiled steps."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache as cc

from moevlm_jax.config.run import load_config
from moevlm_jax.training import loop


@pytest.fixture
def restore_cache():
    before = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    yield
    cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])


def test_a_second_compile_loads_from_the_cache(tmp_path, restore_cache):
    jnp.sin(jnp.ones(3)).block_until_ready()  # this process has compiled before the cache is set
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache even the quick compile below
    where = loop.apply_compilation_cache(str(tmp_path / "cache"))
    assert where == tmp_path / "cache" and jax.config.jax_compilation_cache_dir == str(where)
    hits = []

    def listen(name, **_):
        hits.append(name)

    jax.monitoring.register_event_listener(listen)

    def f(x):
        return jnp.tanh(x) @ x.T + 7.25

    x = jnp.ones((16, 16))
    want = jax.jit(f)(x)
    assert any(where.iterdir()), "the compiled program was not written to the cache"
    jax.clear_caches()  # forget the in-memory executable: the next call must compile or load
    n = hits.count("/jax/compilation_cache/cache_hits")
    try:
        got = jax.jit(f)(x)
    finally:
        jax.monitoring.unregister_event_listener(listen)
    assert hits.count("/jax/compilation_cache/cache_hits") == n + 1
    assert jnp.array_equal(got, want)
    assert loop.apply_compilation_cache(None) is None and jax.config.jax_compilation_cache_dir == str(where)


def test_the_train_job_applies_the_setting_before_compiling(tmp_path, monkeypatch):
    seen = []

    class Applied(Exception):
        pass

    def record(path):
        seen.append(path)
        raise Applied

    monkeypatch.setattr(loop, "apply_compilation_cache", record)
    cfg = load_config("cpu-default", overrides=[f"train.compilation_cache_dir={tmp_path}/cc", "train.steps=1"])
    with pytest.raises(Applied):
        loop.run(cfg)
    assert seen == [f"{tmp_path}/cc"]
