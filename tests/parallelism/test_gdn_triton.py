"""The chunked gated delta rule's Pallas-Triton path (parallelism/gdn_triton.py, Pallas' interpret mode on CPU)
against the float32 einsum reference (model.gated_deltanet.chunk_gated_delta_rule): outputs, final state and the
gradients of q, k, v, g, beta and the initial state (the forward's preparation kernel and the recurrence kernels,
the backward's XLA preparation and chunk gradients), on packed rows with uneven samples, one ending exactly on a
chunk edge, a padding tail and a tail past the last whole chunk, for Hv = Hk (chunks of 16: one diagonal block
of the UT inverse) and Hv = 2 Hk (chunks of 32: two blocks, the block series); the UT inverse as the kernel
forms it and the XLA one's backward; the path through the model's dispatcher and per-device map; the config
key. Tiny shapes (head dims 16 / 32).

Tolerances are relative to scale: max |ours - ref| <= tol * max |ref|.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moevlm_jax.config import load_layout
from moevlm_jax.model import gated_deltanet
from moevlm_jax.model.compute import ComputeConfig
from moevlm_jax.parallelism import gdn_triton
from moevlm_jax.parallelism.context import per_device_map
from moevlm_jax.parallelism.logical import sharding_context

# quick compiles (tests/xla_options.py): kernels and reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

C = 16  # chunk
B, HK, DK, DV = 2, 2, 16, 32


def _rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def _row(lengths, pad):
    return np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad, int)]).astype(np.int32)


def _problem(hv: int, seed: int = 0, c: int = C):
    """q, k, v, g, beta, initial state (float32), segment ids over S = 2c + 8 tokens (two whole chunks and a
    partial one): row 0 = samples of 7 and c - 7 (ending on the first chunk edge), c - 2, then 10 padding
    tokens; row 1 = c + 7 and c + 1 (crossing both chunk edges)."""
    S = 2 * c + 8
    rng = np.random.default_rng(seed)
    q, k = (rng.standard_normal((B, S, HK, DK)) for _ in range(2))
    v = rng.standard_normal((B, S, hv, DV))
    g = -rng.uniform(0.02, 1.5, (B, S, hv))
    beta = rng.uniform(0.05, 0.95, (B, S, hv))
    h0 = 0.5 * rng.standard_normal((B, hv, DK, DV))
    seg = np.stack([_row([7, c - 7, c - 2], 10), _row([c + 7, c + 1], 0)])
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta, h0)) + (jnp.asarray(seg),)


def _value_and_grads(kernel: str, config=None, c: int = C):
    """jit: (q, k, v, g, beta, h0, seg, probe_out, probe_state) -> ((out, final state), grads of q, k, v, g, beta,
    h0) of sum(out * probe_out) + sum(state * probe_state)."""

    def loss(q, k, v, g, beta, h0, seg, po, ps):
        kw = dict(chunk_size=c, initial_state=h0, segment_ids=seg, use_qk_l2norm=True)
        if kernel == "reference":
            out, state = gated_deltanet.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
        elif config is not None:
            out, state = gdn_triton.chunk_gated_delta_rule(q, k, v, g, beta, config=config, **kw)
        else:
            out, state = gated_deltanet.gated_delta_rule(q, k, v, g, beta, kernel=kernel, **kw)
        return jnp.sum(out * po) + jnp.sum(state * ps), (out, state)

    return jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))


UNFUSED = gdn_triton.Config(block_v=32, num_warps=8, fused_output=False)


@pytest.mark.parametrize("ratio,config,c", [(1, None, 16), (2, UNFUSED, 32)],
                         ids=["hv=hk,dispatcher,c16", "hv=2hk,one-v-block,unfused-output,c32"])
def test_kernel_path_matches_the_einsum_reference(ratio, config, c):
    """Forward, final state and every gradient, float32: through the model's dispatcher with the automatic tiles
    (two Dv blocks of 16 a head: a small grid), and with one Dv block a program and the outputs formed in XLA from
    the stored chunk states."""
    *args, seg = _problem(HK * ratio, c=c)
    S = seg.shape[1]
    rng = np.random.default_rng(1)
    probes = (jnp.asarray(rng.standard_normal((B, S, HK * ratio, DV)), jnp.float32),
              jnp.asarray(rng.standard_normal((B, HK * ratio, DK, DV)), jnp.float32))
    (_, (out, state)), grads = _value_and_grads("triton", config, c)(*args, seg, *probes)
    (_, (ref_out, ref_state)), ref_grads = _value_and_grads("reference", c=c)(*args, seg, *probes)
    assert out.dtype == jnp.float32 and state.shape == (B, HK * ratio, DK, DV)
    assert _rel(out, ref_out) < 1e-5 and _rel(state, ref_state) < 1e-5
    assert not np.asarray(out)[0, S - 10:].any()  # padding outputs zeros
    for name, got, want in zip(("q", "k", "v", "g", "beta", "h0"), grads, ref_grads):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        assert _rel(got, want) < 1e-5, (name, _rel(got, want))


def test_bf16_forward_without_segments_is_within_bf16_rounding():
    """bf16 inputs (the kernels' matmul operands bf16, the state float32) and no segment ids, no initial state:
    the output within bf16 rounding of the float32 reference on the same (bf16-rounded) inputs."""
    q, k, v, g, beta, _, _ = _problem(2 * HK, seed=2)
    q, k, v, beta = (x.astype(jnp.bfloat16) for x in (q, k, v, beta))
    kw = dict(chunk_size=C, use_qk_l2norm=True)
    out, state = jax.jit(functools.partial(gdn_triton.chunk_gated_delta_rule, **kw))(q, k, v, g, beta)
    ref = jax.jit(functools.partial(gated_deltanet.chunk_gated_delta_rule, **kw))
    ref_out, ref_state = ref(*(x.astype(jnp.float32) for x in (q, k, v)), g, beta.astype(jnp.float32))
    assert out.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    assert _rel(out, ref_out) < 2e-2 and _rel(state, ref_state) < 2e-2


def test_per_device_map_runs_the_kernels_on_each_devices_rows_and_heads():
    """Under a layout splitting rows over 'fsdp' and heads over 'tensor' the kernels run inside shard_map on
    each device's block (the model's path), with the result of one device."""
    q, k, v, g, beta, _, seg = _problem(2 * HK, seed=3)
    heads, gates, rows = ("act_batch", "act_seq", "act_heads", None), ("act_batch", "act_seq", "act_heads"), (
        "act_batch", "act_seq")
    rule = lambda *a: gdn_triton.chunk_gated_delta_rule(*a[:5], chunk_size=C, segment_ids=a[5], use_qk_l2norm=True)[0]
    layout = load_layout({"mesh": {"data": -1, "fsdp": 2, "tensor": 2},
                          "rules": [["act_batch", "fsdp"], ["act_heads", "tensor"]]})
    mesh, rules = layout.make_mesh(), layout.rules

    def sharded(*a):
        with sharding_context(mesh, rules):
            return per_device_map(rule, a, (heads,) * 3 + (gates, gates, rows), heads)

    got = jax.jit(sharded)(q, k, v, g, beta, seg)
    want = jax.jit(gated_deltanet.chunk_gated_delta_rule, static_argnames=("chunk_size", "use_qk_l2norm"))(
        q, k, v, g, beta, chunk_size=C, segment_ids=seg, use_qk_l2norm=True)[0]
    assert _rel(got, want) < 1e-5


def test_ut_inverse_is_the_triangular_inverse():
    """The UT inverse as the kernels form it (16-row diagonal blocks by forward substitution, the block series for
    the rest; C = 64: four blocks, the series to N^3) equals the block recursion of the einsum path, on a UT
    matrix of correlated unit keys (the hard case: entries near 1)."""
    rng = np.random.default_rng(4)
    c = 64
    k = rng.standard_normal((c, 8)) + 2.0  # correlated
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    beta = rng.uniform(0.5, 1.0, (c, 1))
    decay = np.exp(np.minimum(0.0, -0.01 * (np.arange(c)[:, None] - np.arange(c)[None, :])))
    lower = jnp.asarray(np.tril(beta * (k @ k.T) * decay, -1), jnp.float32)
    got = jax.jit(gdn_triton.ut_inverse)(lower)
    want = jax.jit(gdn_triton.unit_lower_inverse, static_argnums=1)(lower, jax.lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4 * float(jnp.abs(want).max()))
    np.testing.assert_allclose(np.asarray(got @ (jnp.eye(c) + lower), np.float64), np.eye(c), atol=1e-3)


def test_unit_lower_inverse_backward_is_the_recursions():
    """The closed-form backward of the UT inverse equals autodiff through the block recursion."""
    rng = np.random.default_rng(4)
    lower = jnp.asarray(np.tril(rng.standard_normal((3, C, C)), -1) * 0.3, jnp.float32)
    probe = jnp.asarray(rng.standard_normal((3, C, C)), jnp.float32)
    want = jax.jit(jax.grad(lambda x: jnp.sum(gdn_triton.unit_lower_inverse(x) * probe)))(lower)
    got = jax.jit(jax.grad(lambda x: jnp.sum(gdn_triton._inverse(x, None) * probe)))(lower)
    np.testing.assert_allclose(np.asarray(got), np.tril(np.asarray(want), -1), rtol=1e-5, atol=1e-5)
    inv = jax.jit(gdn_triton.unit_lower_inverse)(lower)
    np.testing.assert_allclose(np.asarray(inv @ (jnp.eye(C) + lower)), np.broadcast_to(np.eye(C), (3, C, C)),
                               atol=1e-5)


def test_gdn_kernel_key_and_its_resolution():
    assert ComputeConfig().gdn_kernel == "auto" and ComputeConfig(gdn_kernel="triton").gdn_kernel == "triton"
    with pytest.raises(ValueError, match="gdn_kernel"):
        ComputeConfig(gdn_kernel="pallas")
    resolve = gated_deltanet.resolve_gdn_kernel
    assert resolve("auto", jnp.bfloat16, 128, 128, 64) == ("triton" if jax.default_backend() == "gpu" else "xla")
    assert resolve("auto", jnp.float32, 128, 128, 64) == "xla"
    assert resolve("triton", jnp.float32, 16, 16, 16) == "triton"
    assert resolve("xla", jnp.bfloat16, 128, 128, 64) == "xla"
    assert gdn_triton.supported(128, 96, 64) is not None and gdn_triton.supported(16, 32, 16) is None
    with pytest.raises(ValueError, match="power of two"):
        gdn_triton.chunk_gated_delta_rule(*(jnp.zeros(s) for s in ((1, 16, 1, 8), (1, 16, 1, 8), (1, 16, 1, 16),
                                                                     (1, 16, 1), (1, 16, 1))), chunk_size=16)
    assert gdn_triton.block_v(gdn_triton.Config(), 128, 128) == 64  # 256 programs
    assert gdn_triton.block_v(gdn_triton.Config(), 32, 128) == 16  # one 32K row: 256 programs of 16 columns
