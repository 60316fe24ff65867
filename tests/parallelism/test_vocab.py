"""Vocabulary-parallel embedding lookup on 8 CPU devices equals ``jnp.take`` (rows and the table's
gradient) under the preset layouts, and its program is Megatron's: a local masked lookup and a
reduce-scatter along the sequence (SP), with no gather of token ids or of the table's vocabulary; the
table's FSDP-split embed dimension is not gathered either (the ids are, and the rows come back by
all-to-all), nor its gradient all-reduced."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.parallelism.logical import named_sharding, sharding_context
from moevlm_jax.parallelism.vocab import embed_lookup
from tests.parallelism.test_layouts import FAST, collectives

V, H, B, S = 512, 64, 8, 32
OUT = ("act_batch", "act_norm_seq", "act_embed")


@pytest.fixture(scope="module")
def problem():
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    return (jax.random.normal(k1, (V, H)), jax.random.randint(k2, (B, S), 0, V, jnp.int32),
            jax.random.normal(k3, (B, S, H)))


def _loss(table, ids, probe):
    rows = embed_lookup(table, ids, ("vocab", "embed"), OUT)
    return jnp.sum(rows * probe), rows


# a layout whose batch uses the axis the vocabulary is split over: the table is gathered there
BATCH_ON_VOCAB = {"mesh": {"fsdp": 4, "tensor": 2}, "rules": [["act_batch", ["fsdp", "tensor"]], ["vocab", "tensor"]]}
# DP x FSDP (HSDP): the table split over 'fsdp' only, its gradient summed over 'data'
DATA_FSDP = {"mesh": {"data": 2, "fsdp": 4}, "rules": [["act_batch", ["data", "fsdp"]], ["embed", "fsdp"]]}
CUSTOM = {"batch_on_vocab_axis": BATCH_ON_VOCAB, "data_fsdp": DATA_FSDP}


def table_collectives(hlo: str) -> list[tuple[str, int, int]]:
    """2-D float32 all-gathers and all-reduces: the table or its gradient (the ids are integers, the rows
    3-D or more)."""
    return [(op, *s) for op in ("all-gather", "all-reduce") for s in collectives(hlo, op, dtype="f32") if len(s) == 2]


@pytest.mark.parametrize("name", ["fsdp", "tp", "folded", "cp", "data_fsdp", "batch_on_vocab_axis"])
def test_embed_lookup_matches_take(problem, name):
    table, ids, probe = problem
    layout = load_layout({"name": name, **CUSTOM[name]}) if name in CUSTOM else load_layout(name)
    mesh = layout.make_mesh()
    fn = jax.value_and_grad(_loss, has_aux=True)
    (ref_loss, ref_rows), ref_grad = jax.jit(fn)(table, ids, probe)

    def sharded(table, ids, probe):
        with sharding_context(mesh, layout.rules):
            return fn(table, ids, probe)

    with sharding_context(mesh, layout.rules):
        shardings = (named_sharding(("vocab", "embed")), named_sharding(OUT[:2]), named_sharding(OUT))
    args = [jax.device_put(a, s) for a, s in zip((table, ids, probe), shardings)]
    compiled = jax.jit(sharded).lower(*args).compile(FAST)
    (loss, rows), grad = compiled(*args)
    np.testing.assert_allclose(rows, ref_rows, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-6)
    assert rows.sharding.is_equivalent_to(shardings[2], 3)
    hlo = compiled.as_text()
    gathered = collectives(hlo, "all-gather")
    assert not [s for s in gathered if s[:2] == (B, S) or s == (B, S)], f"token ids gathered: {gathered}"
    if name in ("tp", "folded"):  # vocabulary stays split: the embed dim alone is gathered (FSDP)
        assert not [s for s in gathered if V in s], gathered
        assert collectives(hlo, "reduce-scatter"), "SP: partial rows reduce-scattered along the sequence"
        assert not [s for s in collectives(hlo, "all-reduce") if len(s) == 3], "rows reduce-scattered, not all-reduced"
    if name != "batch_on_vocab_axis":  # the table's embed dim split over axes that split the ids too
        assert " all-to-all(" in hlo or " all-to-all-start(" in hlo, "rows returned by all-to-all"
        if name == "data_fsdp":  # the gradient's one all-reduce: over 'data', of the [V, H / 4] shard
            assert table_collectives(hlo) == [("all-reduce", V, H // 4)], table_collectives(hlo)
        else:
            assert not table_collectives(hlo), table_collectives(hlo)


def test_take_rows_gradient_accumulates_in_float32():
    """take_rows: rows equal jnp.take's; the bf16 table's gradient equals the float32 scatter-add of the
    same cotangents rounded once (repeated ids, a wrapped negative id, an out-of-range id dropped), where
    autodiff's bf16 scatter-add of jnp.take rounds at every repeat."""
    from moevlm_jax.parallelism.vocab import take_rows
    v, h = 16, 8
    ids = jnp.array([[3, 3, 3, 3, 3, 3, 3, 3, 5, -1, 99, 0]], jnp.int32)
    table = jax.random.normal(jax.random.key(0), (v, h), jnp.bfloat16)
    g = (1.0 + jax.random.uniform(jax.random.key(1), (*ids.shape, h)) / 64).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(take_rows(table, ids), np.float32),
                                  np.asarray(jnp.take(table, ids, axis=0), np.float32))
    grad = jax.vjp(lambda t: take_rows(t, ids), table)[1](g)[0]
    assert grad.dtype == jnp.bfloat16
    ref = np.zeros((v, h), np.float64)
    for i, r in zip(np.asarray(ids[0]), np.asarray(g[0], np.float64)):
        if -v <= i < v:
            ref[i % v] += r
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(jnp.asarray(ref, jnp.bfloat16), np.float32))
    naive = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)[1](g)[0]
    assert np.abs(np.asarray(naive, np.float64) - ref).max() > np.abs(np.asarray(grad, np.float64) - ref).max()
