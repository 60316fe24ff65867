"""Reference MoE math and random problems shared by the tests in tests/parallelism."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.xla_options import FAST  # tiny programs: LLVM optimisation would only cost compile time


def dense_reference(x, topk_idx, topk_weights, w_gate_up, w_down, keep=None):
    """Every expert on every token (per-expert einsum), weighted by a dense [T, E] routing matrix."""
    h = jnp.einsum("th,ehf->tef", x, w_gate_up)
    gate, up = jnp.split(h, 2, axis=-1)
    y = jnp.einsum("tei,eih->teh", jax.nn.silu(gate) * up, w_down)
    w = topk_weights if keep is None else jnp.where(keep, topk_weights, 0.0)
    t = x.shape[0]
    routing = jnp.zeros((t, w_gate_up.shape[0]), w.dtype).at[jnp.arange(t)[:, None], topk_idx].add(w)
    return jnp.einsum("teh,te->th", y, routing)


def make_problem(seed=0, t=64, h=16, e=8, i=8, k=2, routing="random"):
    """x [T, H], topk_idx/topk_weights [T, K], w_gate_up [E, H, 2I], w_down [E, I, H] (float32).

    routing: "random"; "one" (every token's first choice is expert 0); "skewed" (experts 0..2 take
    almost everything, the upper half of the experts gets nothing). Built in numpy (no compiles).
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, h), np.float32)
    logits = rng.standard_normal((t, e), np.float32)
    if routing == "one":
        logits[:, 0] += 100.0
    elif routing == "skewed":
        logits += np.where(np.arange(e) < 3, 8.0, 0.0) - np.where(np.arange(e) >= e // 2, 100.0, 0.0)
    elif routing != "random":
        raise ValueError(routing)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, idx, axis=-1)
    w /= w.sum(-1, keepdims=True)
    w_gate_up = rng.standard_normal((e, h, 2 * i), np.float32) / np.sqrt(h)
    w_down = rng.standard_normal((e, i, h), np.float32) / np.sqrt(i)
    return tuple(jnp.asarray(a) for a in (x, idx.astype(np.int32), w.astype(np.float32), w_gate_up, w_down))


def probe(t, h):
    """A fixed non-uniform cotangent so gradients are not sums of ones."""
    return np.cos(np.arange(t * h, dtype=np.float32).reshape(t, h) * 0.37)


def value_and_grads(fn, x, topk_idx, topk_weights, w_gate_up, w_down):
    """fn's output and the gradients of <fn(...), probe> wrt x, topk_weights, w_gate_up, w_down (jitted)."""
    c = jnp.asarray(probe(*x.shape))

    def loss(x, w, a, b):
        out = fn(x, topk_idx, w, a, b)
        return jnp.sum(out * c), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True), compiler_options=FAST)
    (_, out), grads = step(x, topk_weights, w_gate_up, w_down)
    return out, grads


def assert_close(actual, expected, atol=2e-5, rtol=2e-5, what=""):
    """Compare arrays or tuples of arrays with one tolerance."""
    if isinstance(expected, (tuple, list)):
        names = ("d_x", "d_topk_weights", "d_w_gate_up", "d_w_down")
        for n, (a, b) in enumerate(zip(actual, expected, strict=True)):
            assert_close(a, b, atol, rtol, f"{what} {names[n] if len(expected) == 4 else n}")
        return
    np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), atol=atol, rtol=rtol, err_msg=what)
