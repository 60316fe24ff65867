"""The Gated DeltaNet core (moevlm_jax.model.gated_deltanet) against HF's Qwen3.5-MoE reference
(torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule, causal_conv1d_fn / _update,
Qwen3_5MoeRMSNormGated, Qwen3_5MoeGatedDeltaNet): values, gradients (chunked vs recurrent), packed
rows (each sample as if run alone) and the state / window carried from one sequence shard to the next.

Tolerances are relative to scale: max |ours - ref| <= tol * max |ref| (float32, tol 1e-5 unless noted).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as hf
from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

from moevlm_jax.model.gated_deltanet import (
    causal_conv1d,
    chunk_gated_delta_rule,
    gated_rms_norm,
    gdn_gates,
    l2norm,
    recurrent_gated_delta_rule,
)

logging.getLogger("transformers").setLevel(logging.ERROR)  # the "falling back to PyTorch" notices

TOL = 1e-5
K_CONV = 4


def _rel(ours, ref) -> float:
    """max |ours - ref| / max |ref|."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(ours - ref).max() / max(np.abs(ref).max(), 1e-30))


def _inputs(rng, b, s, hk, hv, dk, dv, qk_scale=1.0):
    """Random q, k [B, S, Hk, Dk], v [B, S, Hv, Dv], g (log decay in [-1.5, -0.02]), beta (0, 1) [B, S, Hv]."""
    q = qk_scale * rng.standard_normal((b, s, hk, dk))
    k = qk_scale * rng.standard_normal((b, s, hk, dk))
    v = rng.standard_normal((b, s, hv, dv))
    g = -rng.uniform(0.02, 1.5, (b, s, hv))
    beta = rng.uniform(0.05, 0.95, (b, s, hv))
    return tuple(x.astype(np.float32) for x in (q, k, v, g, beta))


def _hf_rule(fn, q, k, v, g, beta, h0=None, l2=True, **kw):
    """HF's torch rule on numpy inputs -> (out, final state) as numpy."""
    t = lambda x: None if x is None else torch.from_numpy(np.ascontiguousarray(x))
    out, state = fn(t(q), t(k), t(v), t(g), t(beta), initial_state=t(h0), output_final_state=True,
                    use_qk_l2norm_in_kernel=l2, **kw)
    return out.numpy(), state.numpy()


@functools.partial(jax.jit, static_argnames=("form", "chunk_size", "l2"))
def _ours(q, k, v, g, beta, h0=None, seg=None, *, form, chunk_size=8, l2=True):
    if form == "chunk":
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk_size, initial_state=h0, segment_ids=seg,
                                      use_qk_l2norm=l2)
    return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0, segment_ids=seg, use_qk_l2norm=l2)


def _conv_hf(x, w, bias=None, activation="silu"):
    """HF's causal_conv1d_fn on x [B, S, C], our weight layout [K, C] -> [B, S, C]."""
    out = hf.causal_conv1d_fn(torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2))),
                              torch.from_numpy(np.ascontiguousarray(w.T)),
                              None if bias is None else torch.from_numpy(bias), activation=activation)
    return np.swapaxes(out.numpy(), 1, 2)


def _packed_row(lengths, pad):
    """segment ids [S] for samples of ``lengths`` (ids 1..) then ``pad`` padding tokens (0)."""
    return np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)] + [np.zeros(pad, int)]).astype(np.int32)


def test_l2norm_matches_hf():
    x = np.random.default_rng(0).standard_normal((3, 5, 16)).astype(np.float32)
    x[0, 0] = 0.0  # eps inside the rsqrt of the sum of squares: zero vectors stay zero, finite
    ref = hf.l2norm(torch.from_numpy(x), dim=-1, eps=1e-6).numpy()
    assert _rel(l2norm(jnp.asarray(x)), ref) < 1e-6


# (B, S, Hk, Hv, Dk, Dv, initial state, l2norm in kernel, chunk size): S not a multiple of the chunk
# (and a chunk not a power of two),
# S < chunk, S a multiple; value heads > key heads (HF's repeat_interleave) in three cases
HF_CASES = [
    (2, 13, 2, 2, 8, 8, False, True, 6),
    (1, 19, 2, 4, 8, 6, True, True, 8),
    (2, 7, 1, 3, 4, 8, True, False, 16),
    (1, 24, 1, 2, 16, 8, True, True, 8),
]


@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: "B{}S{}Hk{}Hv{}Dk{}Dv{}_h0{}_l2{}_C{}".format(*c))
def test_rules_match_hf(case):
    """recurrent == HF torch_recurrent_gated_delta_rule, chunked == HF torch_chunk_gated_delta_rule
    (same chunk size): outputs and final states, 1e-5 relative to scale."""
    b, s, hk, hv, dk, dv, with_h0, l2, chunk = case
    rng = np.random.default_rng(sum(case[:6]))
    q, k, v, g, beta = _inputs(rng, b, s, hk, hv, dk, dv, qk_scale=1.0 if l2 else 0.5)
    h0 = rng.standard_normal((b, hv, dk, dv)).astype(np.float32) if with_h0 else None
    ref_r = _hf_rule(hf.torch_recurrent_gated_delta_rule, q, k, v, g, beta, h0, l2)
    ref_c = _hf_rule(hf.torch_chunk_gated_delta_rule, q, k, v, g, beta, h0, l2, chunk_size=chunk)
    assert _rel(ref_c[0], ref_r[0]) < 1e-4  # the two HF forms agree: the reference is sound
    ours_r = _ours(q, k, v, g, beta, h0, form="recurrent", l2=l2)
    ours_c = _ours(q, k, v, g, beta, h0, form="chunk", chunk_size=chunk, l2=l2)
    for ours, ref in ((ours_r, ref_r), (ours_c, ref_c)):
        assert ours[0].shape == (b, s, hv, dv) and ours[1].shape == (b, hv, dk, dv)
        assert _rel(ours[0], ref[0]) < TOL, _rel(ours[0], ref[0])
        assert _rel(ours[1], ref[1]) < TOL, _rel(ours[1], ref[1])


@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
def test_chunk_equals_recurrent_values_and_grads(packed):
    """chunked == recurrent: outputs, final state and jax.grad of a random linear functional of both
    w.r.t. q, k, v, g, beta and the initial state, 1e-5 relative to scale (each gradient's own scale);
    with packing, padding tokens get exactly zero gradient."""
    rng = np.random.default_rng(7)
    b, s, hk, hv, dk, dv = 2, 21, 1, 2, 8, 4
    q, k, v, g, beta = _inputs(rng, b, s, hk, hv, dk, dv)
    h0 = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)
    seg = np.stack([_packed_row([6, 8, 4], 3), _packed_row([2, 3, 16], 0)]) if packed else None
    w_out = rng.standard_normal((b, s, hv, dv)).astype(np.float32)
    w_state = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)

    def loss(form, q, k, v, g, beta, h0):
        out, state = _ours(q, k, v, g, beta, h0, seg, form=form, chunk_size=8)
        return jnp.sum(out * w_out) + jnp.sum(state * w_state), (out, state)

    args = tuple(map(jnp.asarray, (q, k, v, g, beta, h0)))
    grad = lambda form: jax.grad(functools.partial(loss, form), argnums=tuple(range(6)), has_aux=True)(*args)
    (g_r, (o_r, s_r)), (g_c, (o_c, s_c)) = grad("recurrent"), grad("chunk")
    assert _rel(o_c, o_r) < TOL and _rel(s_c, s_r) < TOL
    for name, a, r in zip(("q", "k", "v", "g", "beta", "h0"), g_c, g_r):
        assert np.all(np.isfinite(np.asarray(a))), name
        assert np.abs(np.asarray(r)).max() > 1e-3, name  # a gradient that is there to compare
        assert _rel(a, r) < TOL, (name, _rel(a, r))
    if packed:
        pad = seg == 0
        for name, a in zip(("q", "k", "v", "g", "beta"), g_c[:5]):
            assert np.all(np.asarray(a)[pad] == 0.0), name


def test_packed_rows_equal_samples_alone():
    """Row 0: 3 samples [8, 5, 7] + 4 padding (chunk 8: a boundary on a chunk edge, two inside chunks);
    row 1: 5 samples [3, 2, 12, 5, 2] (two boundaries inside the first chunk). With a nonzero initial
    state, both forms give each sample HF's output for that sample alone (the first sample from the
    initial state, every other from zero), 1e-5; padding outputs exactly 0 although its inputs are NaN;
    final state: HF's of the row's last sample alone (row 1), exactly 0 after padding (row 0). The conv:
    each sample's output equals HF's causal_conv1d_fn on it alone (1e-6); padding zeros; the final window
    holds the last sample's inputs only."""
    rng = np.random.default_rng(3)
    b, s, hk, hv, dk, dv, c = 2, 24, 1, 2, 8, 4, 16
    rows = [([8, 5, 7], 4), ([3, 2, 12, 5, 2], 0)]
    seg = np.stack([_packed_row(n, p) for n, p in rows])
    q, k, v, g, beta = _inputs(rng, b, s, hk, hv, dk, dv)
    h0 = rng.standard_normal((b, hv, dk, dv)).astype(np.float32)
    x = rng.standard_normal((b, s, c)).astype(np.float32)
    w = rng.standard_normal((K_CONV, c)).astype(np.float32)
    bias = rng.standard_normal(c).astype(np.float32)
    for arr in (q, k, v, g, beta, x):
        arr[seg == 0] = np.nan  # padding may hold anything
    outs = {form: _ours(q, k, v, g, beta, h0, seg, form=form, chunk_size=8) for form in ("chunk", "recurrent")}
    conv, window = causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), segment_ids=jnp.asarray(seg))
    conv, window = np.asarray(conv), np.asarray(window)
    for row, (lengths, pad) in enumerate(rows):
        start = 0
        for i, n in enumerate(lengths):
            sl = slice(start, start + n)
            one = lambda a: a[row:row + 1, sl]
            ref = _hf_rule(hf.torch_recurrent_gated_delta_rule, *map(one, (q, k, v, g, beta)),
                           h0[row:row + 1] if i == 0 else None)
            for form, (out, state) in outs.items():
                assert _rel(np.asarray(out)[row:row + 1, sl], ref[0]) < TOL, (form, row, i)
                if i == len(lengths) - 1 and pad == 0:
                    assert _rel(np.asarray(state)[row:row + 1], ref[1]) < TOL, (form, row)
            conv_ref = _conv_hf(one(x), w, bias)
            assert _rel(conv[row:row + 1, sl], conv_ref) < 1e-6, (row, i)
            start += n
        last = x[row, start - lengths[-1]:start]
        want = np.zeros((K_CONV - 1, c), np.float32)
        want[K_CONV - 1 - min(len(last), K_CONV - 1):] = last[-(K_CONV - 1):] if pad == 0 else 0.0
        assert np.array_equal(window[row], want), row
        for form, (out, state) in outs.items():
            assert np.all(np.asarray(out)[row, start:] == 0.0), form
            if pad:
                assert np.all(np.asarray(state)[row] == 0.0), form
        assert np.all(conv[row, start:] == 0.0)


def test_state_carry_across_shards():
    """A row split into two shards, shard 2 run from shard 1's final state / final window, equals the
    unsplit run (outputs concatenated, final state; 1e-5, conv 1e-6), for both forms: a single sequence
    split inside a chunk, and a packed row [6, 10, 6] split inside sample 2 (carry as is) and exactly on
    the boundary of samples 1 and 2 (the caller zeroes the carry, as the module documents; not zeroing
    it would be wrong, which the test also checks)."""
    rng = np.random.default_rng(11)
    b, s, hk, hv, dk, dv, c = 1, 22, 1, 2, 8, 4, 6
    q, k, v, g, beta = _inputs(rng, b, s, hk, hv, dk, dv)
    x = rng.standard_normal((b, s, c)).astype(np.float32)
    w = rng.standard_normal((K_CONV, c)).astype(np.float32)
    packed = _packed_row([6, 10, 6], 0)[None]
    for seg, split, zero_carry in ((None, 9, False), (packed, 11, False), (packed, 6, True)):
        seg_at = lambda sl: None if seg is None else seg[:, sl]
        first, second = slice(0, split), slice(split, s)
        conv_full, _ = causal_conv1d(jnp.asarray(x), jnp.asarray(w), segment_ids=seg_at(slice(None)))
        conv_1, win = causal_conv1d(jnp.asarray(x[:, first]), jnp.asarray(w), segment_ids=seg_at(first))
        keep = 0.0 if zero_carry else 1.0  # seg[:, split] != seg[:, split - 1]: a new sample starts here
        conv_2, _ = causal_conv1d(jnp.asarray(x[:, second]), jnp.asarray(w), segment_ids=seg_at(second),
                                  initial_window=win * keep)
        assert _rel(np.concatenate([conv_1, conv_2], 1), conv_full) < 1e-6, (split, "conv")
        for form in ("chunk", "recurrent"):
            out_full, state_full = _ours(q, k, v, g, beta, None, seg, form=form, chunk_size=8)
            part = lambda sl: tuple(a[:, sl] for a in (q, k, v, g, beta))
            out_1, state_1 = _ours(*part(first), None, seg_at(first), form=form, chunk_size=8)
            out_2, state_2 = _ours(*part(second), state_1 * keep, seg_at(second), form=form, chunk_size=8)
            assert _rel(np.concatenate([out_1, out_2], 1), out_full) < TOL, (split, form)
            assert _rel(state_2, state_full) < TOL, (split, form)
            if zero_carry:  # the carry not zeroed leaks sample 1 into sample 2
                out_bad, _ = _ours(*part(second), state_1, seg_at(second), form=form, chunk_size=8)
                assert _rel(out_bad, out_full[:, second]) > 1e-2, form


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_rms_norm_matches_hf(dtype):
    """gated_rms_norm == HF's Qwen3_5MoeRMSNormGated on the same weight: float32 1e-6; bfloat16 within
    one bf16 rounding step (2**-7 relative to scale), on the module cast to bfloat16."""
    rng = np.random.default_rng(5)
    d = 16
    x, z = (rng.standard_normal((3, 7, d)).astype(np.float32) * 2 for _ in range(2))
    weight = rng.uniform(0.5, 1.5, d).astype(np.float32)
    mod = hf.Qwen3_5MoeRMSNormGated(d, eps=1e-6)
    with torch.no_grad():
        mod.weight.copy_(torch.from_numpy(weight))
    tdt, jdt = getattr(torch, dtype), jnp.dtype(dtype)
    mod = mod.to(tdt)
    with torch.no_grad():
        ref = mod(torch.from_numpy(x).to(tdt), torch.from_numpy(z).to(tdt)).float().numpy()
    ours = gated_rms_norm(jnp.asarray(x, jdt), jnp.asarray(z, jdt), jnp.asarray(weight, jdt), 1e-6)
    assert ours.dtype == jdt
    assert _rel(ours.astype(jnp.float32), ref) < (1e-6 if dtype == "float32" else 2.0 ** -7)


def test_conv_matches_hf():
    """causal_conv1d (no packing) == HF's causal_conv1d_fn, with/without bias and silu (1e-6); the
    carried window == HF's cached decode step causal_conv1d_update (its conv state = the last K inputs)."""
    rng = np.random.default_rng(9)
    b, s, c = 2, 11, 5
    x = rng.standard_normal((b, s, c)).astype(np.float32)
    w = rng.standard_normal((K_CONV, c)).astype(np.float32)
    bias = rng.standard_normal(c).astype(np.float32)
    for bb in (None, bias):
        for act in ("silu", None):
            ours, _ = causal_conv1d(jnp.asarray(x), jnp.asarray(w), None if bb is None else jnp.asarray(bb),
                                    activation=act)
            assert _rel(ours, _conv_hf(x, w, bb, act)) < 1e-6, (bb is None, act)
    split = 7
    conv_state = torch.from_numpy(np.ascontiguousarray(np.swapaxes(x[:, split - K_CONV:split], 1, 2)))
    ref = hf.causal_conv1d_update(torch.from_numpy(np.ascontiguousarray(np.swapaxes(x[:, split:], 1, 2))),
                                  conv_state, torch.from_numpy(np.ascontiguousarray(w.T)), torch.from_numpy(bias),
                                  "silu")
    _, window = causal_conv1d(jnp.asarray(x[:, :split]), jnp.asarray(w), jnp.asarray(bias))
    ours, _ = causal_conv1d(jnp.asarray(x[:, split:]), jnp.asarray(w), jnp.asarray(bias), initial_window=window)
    assert _rel(ours, np.swapaxes(ref.numpy(), 1, 2)) < 1e-6


def test_gated_deltanet_layer_matches_hf():
    """The layer composed from these functions (projections, conv + silu, split, gdn_gates, chunked rule
    with in-kernel l2norm at chunk 8, gated RMSNorm, out projection) == HF's Qwen3_5MoeGatedDeltaNet
    forward (no cache; HF's chunk 64) on the same random weights, value heads 4 > key heads 2: 1e-5."""
    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(hidden_size=32, num_hidden_layers=4, linear_num_value_heads=4,
                               linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=6,
                               linear_conv_kernel_dim=K_CONV, rms_norm_eps=1e-6)
    mod = hf.Qwen3_5MoeGatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():
        mod.norm.weight.uniform_(0.5, 1.5)
        mod.dt_bias.normal_()
    b, s = 2, 19
    x = torch.randn(b, s, cfg.hidden_size)
    with torch.no_grad():
        ref = mod(x).numpy()
    p = {n: jnp.asarray(t.detach().numpy()) for n, t in mod.named_parameters()}
    hk, hv, dk, dv = 2, 4, 8, 6
    xj = jnp.asarray(x.numpy())
    qkv, _ = causal_conv1d(xj @ p["in_proj_qkv.weight"].T, p["conv1d.weight"][:, 0, :].T)
    q, k, v = jnp.split(qkv, [hk * dk, 2 * hk * dk], axis=-1)
    g, beta = gdn_gates(xj @ p["in_proj_a.weight"].T, xj @ p["in_proj_b.weight"].T, p["A_log"], p["dt_bias"])
    o, _ = chunk_gated_delta_rule(q.reshape(b, s, hk, dk), k.reshape(b, s, hk, dk), v.reshape(b, s, hv, dv), g, beta,
                                  chunk_size=8, use_qk_l2norm=True)
    z = (xj @ p["in_proj_z.weight"].T).reshape(b, s, hv, dv)
    y = gated_rms_norm(o, z, p["norm.weight"], cfg.rms_norm_eps).reshape(b, s, hv * dv) @ p["out_proj.weight"].T
    assert _rel(y, ref) < TOL, _rel(y, ref)
