"""attention.kernel_with_fallback: a fused kernel's residuals under the checkpoint name "core_attn", so
a remat policy that saves core_attn never runs the forward kernel again in the backward (on the GPU the
cuDNN forward ran twice a step without it), and the gradients are those of the plain function, on the
kernel's branch and on the fallback's."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.ad_checkpoint import saved_residuals  # as tests/model/test_recompute.py

from moevlm_jax.model import attention

# quick compiles (tests/xla_options.py): the plain function's reference compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")


def _kernel(q, k, v, ids):  # stands in for cuDNN's ragged kernel: XLA attention within segments
    return attention._attention(q, k, v, ids, ids, 0, causal=True, impl="xla", scale=0.3)


def _fallback(q, k, v, ids):  # a different computation of the same attention (dense mask, float32 scores)
    mask = attention.segment_mask(ids, ids, True)
    s = jnp.einsum("bsnd,btnd->bnst", q, k) * 0.3
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), axis=-1)
    return jnp.einsum("bnst,btnd->bsnd", p, v)


def _data(bound_exceeded):
    rng = np.random.default_rng(0)
    b, s, n, d = 2, 8, 2, 4
    q, k, v, w = (jnp.asarray(rng.normal(size=(b, s, n, d)), jnp.float32) for _ in range(4))
    ids = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 2, 2, 3, 3, 3, 3] if bound_exceeded else [1] * 8])
    return q, k, v, w, ids


def _layer(attend, bound=2):
    def layer(q, k, v, w, ids):
        q = jnp.sin(q)  # an op before the kernel (the rotary embedding in the model)
        out = attend(jnp.max(ids) > bound, _kernel, _fallback, q, k, v, ids)
        out = jax.ad_checkpoint.checkpoint_name(out, "core_attn")
        return jnp.sum(jnp.tanh(out * w))
    return layer


def _plain(use_fallback, primary, fallback, q, k, v, ids):
    return jax.lax.cond(use_fallback, fallback, primary, q, k, v, ids)


@pytest.mark.parametrize("bound_exceeded", [False, True])
@pytest.mark.parametrize("saved", [("core_attn",), ()])
def test_gradients_match_the_plain_function(bound_exceeded, saved):
    q, k, v, w, ids = _data(bound_exceeded)
    policy = jax.checkpoint_policies.save_only_these_names(*saved)
    got = jax.grad(jax.checkpoint(_layer(attention.kernel_with_fallback), policy=policy), argnums=(0, 1, 2, 3))(
        q, k, v, w, ids)
    want = jax.grad(_layer(_plain), argnums=(0, 1, 2, 3))(q, k, v, w, ids)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def _exp_count(fn, *args):
    return str(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2, 3)))(*args)).count(" exp ")


def test_saved_core_attn_keeps_the_kernels_residuals():
    """Each branch's softmax is one exp in the forward. Saved core_attn: the forward once, plus the
    fallback's forward inside its backward branch (recomputed, the rare path); dropped: the forward
    again too; the plain cond reruns its forward either way (its residuals unnamed)."""
    args = _data(False)
    keep = jax.checkpoint_policies.save_only_these_names("core_attn")
    drop = jax.checkpoint_policies.save_only_these_names()
    forward_exps = str(jax.make_jaxpr(_layer(_plain))(*args)).count(" exp ")
    assert forward_exps == 2  # the kernel's and the fallback's branch
    assert _exp_count(jax.checkpoint(_layer(attention.kernel_with_fallback), policy=keep), *args) == forward_exps + 1
    assert _exp_count(jax.checkpoint(_layer(attention.kernel_with_fallback), policy=drop),
                      *args) == 2 * forward_exps + 1
    assert _exp_count(jax.checkpoint(_layer(_plain), policy=keep), *args) == 2 * forward_exps
    saved = saved_residuals(jax.checkpoint(_layer(attention.kernel_with_fallback), policy=keep),
                                              *args)
    assert sum("named 'core_attn'" in why for _, why in saved) >= 2  # the output and the kernel's residuals


def _bounded(use_fallback, primary, fallback, q, k, v, ids):  # the caller checked the bound: no cond
    return attention.kernel_with_fallback(None, primary, fallback, q, k, v, ids)


@pytest.mark.parametrize("saved", [("core_attn",), ()])
def test_without_the_fallback_no_cond_and_the_same_gradients(saved):
    """``use_fallback`` None (the trainer checked the rows on the host, ``attention.rows_within_bound``):
    the kernel alone, no cond in the forward or the backward, the plain function's gradients; its
    forward runs once with core_attn saved, twice with it recomputed."""
    args = _data(False)
    policy = jax.checkpoint_policies.save_only_these_names(*saved)
    fn = jax.checkpoint(_layer(_bounded), policy=policy)
    got = jax.grad(fn, argnums=(0, 1, 2, 3))(*args)
    want = jax.grad(_layer(_plain), argnums=(0, 1, 2, 3))(*args)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    jaxpr = str(jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2, 3)))(*args))
    assert " cond[" not in jaxpr and "cond(" not in jaxpr
    assert _exp_count(fn, *args) == (1 if saved else 2)


def test_rows_within_bound_is_a_trace_time_context():
    assert not attention._WITHIN_BOUND.get()
    with attention.rows_within_bound():
        assert attention._WITHIN_BOUND.get()
        with attention.rows_within_bound(False):
            assert not attention._WITHIN_BOUND.get()
        assert attention._WITHIN_BOUND.get()
    assert not attention._WITHIN_BOUND.get()


def test_the_cudnn_path_traces_without_conds_within_the_bound(monkeypatch):
    """The real cuDNN path (``attention._cudnn_packed``), traced on CPU (its cuDNN version and GPU checks
    patched; nothing runs): within the bound no cond and, with core_attn saved, one forward kernel and
    one backward kernel in the gradient; recomputed, the forward twice; without the promise the
    fallback's conds are there. Fresh functions per trace: jax.checkpoint caches its traces by
    function (the trainer's layer bodies are new closures in every trace of the step)."""
    import re

    from jax._src.cudnn import fused_attention_stablehlo as fas

    monkeypatch.setattr(fas, "check_cudnn_version", lambda: 91400)
    monkeypatch.setattr(fas, "check_compute_capability", lambda capability: True)
    q = jnp.ones((2, 16, 4, 8), jnp.bfloat16)
    seg = jnp.asarray([[1] * 10 + [2] * 6, [1] * 16])

    def counts(saved, within):
        def loss(q):
            out = attention._attention(q, q, q, seg, seg, 0, causal=True, impl="cudnn", scale=0.3, max_segments=2)
            return out.astype(jnp.float32).sum()

        fn = jax.checkpoint(loss, policy=jax.checkpoint_policies.save_only_these_names(*saved))
        with attention.rows_within_bound(within):
            text = str(jax.make_jaxpr(jax.grad(fn))(q))
        return tuple(len(re.findall(rf"= {p}\[", text)) for p in
                     ("cond", "dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"))

    assert counts(("core_attn",), True) == (0, 1, 1)
    assert counts((), True) == (0, 2, 1)
    conds, fwd, bwd = counts(("core_attn",), False)
    assert conds >= 2 and bwd >= 1
