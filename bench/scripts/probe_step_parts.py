"""Issue 24: three parts of the proxy step that are memory-bound, each timed alone with its variants in one
process, alternating rounds (bench/step_h200.md run 20):

- ``vision``: a stack of the proxy's vision blocks (recipe h200's compute: selective recompute, cuDNN
  ragged attention) forward + backward at MBS 10 (4 images of 784 patches a row), with the bias gradients
  as autodiff makes them (fused into the producer's column-reduction fusion), split from it by a barrier,
  or as a matmul with a ones vector; and with the GELU output kept (named) instead of recomputed.
- ``embed``: the token embedding's gradient, [151936, 2048] bf16, 40,960 ids: autodiff's bf16
  scatter-add vs ``parallelism.vocab.take_rows`` (float32 scatter-add, one cast).
- ``optimizer``: AdamW (recipe h200's: clipping, bf16 state, decay mask) + apply on the proxy's parameter
  shapes: ``optax.apply_if_finite`` (the library's) vs :func:`skip_nonfinite_select` (finiteness from the
  clipping's global norm, selects instead of a ``lax.cond``; not kept: 0.3 ms faster here, and on XLA:CPU
  it holds a second copy of the largest state leaf).

Each variant is checked against the first of its part (values) before timing.

    python3 bench/scripts/probe_step_parts.py --parts vision,embed,optimizer --out $OUT/parts.json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from moevlm_jax.config import load_config
from moevlm_jax.model import layers, vision
from moevlm_jax.training import optimizer as optim
from op_bandwidth import hlo_table, op_rows, print_rows
from moevlm_jax.parallelism.vocab import take_rows


def timeit(fn, args, rounds, iters):
    out = fn(*args)
    jax.block_until_ready(out)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / iters * 1e3)
    return times


def race(variants, args, rounds=3, iters=5, check=None):
    """variants: {name: jitted fn}; alternating rounds; returns {name: best ms} and prints."""
    res = {k: [] for k in variants}
    outs = {k: jax.block_until_ready(f(*args)) for k, f in variants.items()}
    base = next(iter(outs))
    errs = {k: (check(outs[base], o) if check else None) for k, o in outs.items()}
    del outs
    for _ in range(rounds):
        for k, f in variants.items():
            res[k] += timeit(f, args, 1, iters)
    table = {k: {"ms_best": min(v), "ms_all": v, "err_vs_first": errs[k]} for k, v in res.items()}
    for k, v in table.items():
        print(f"  {k:28s} {v['ms_best']:9.3f} ms   (rounds {', '.join(f'{x:.3f}' for x in v['ms_all'])})"
              f"   err vs {base}: {v['err_vs_first']}", flush=True)
    return table


def rel_err(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    num = sum(float(jnp.sum(jnp.square(x.astype(jnp.float32) - y.astype(jnp.float32)))) for x, y in zip(la, lb))
    den = sum(float(jnp.sum(jnp.square(y.astype(jnp.float32)))) for y in lb)
    return (num / max(den, 1e-30)) ** 0.5


# ------------------------------------------------------------------------------------------------ vision

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bias_dot(nd, y, b):
    """y + b whose bias gradient is a ones-vector matmul (the split form is the library's layers.bias_add)."""
    return y + b


def _bias_dot_fwd(nd, y, b):
    return y + b, None


def _bias_dot_bwd(nd, _, g):
    g2 = g.reshape(-1, int(np.prod(g.shape[g.ndim - nd:])))
    ones = jnp.ones((g2.shape[0],), g.dtype)
    db = jnp.einsum("t,tf->f", ones, g2, preferred_element_type=jnp.float32)
    return g, db.reshape(g.shape[g.ndim - nd:]).astype(g.dtype)


_bias_dot.defvjp(_bias_dot_fwd, _bias_dot_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _layer_norm(eps, x, w, b):
    return _ln_fwd(eps, x, w, b)[0]


def _ln_fwd(eps, x, w, b):
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True) + eps)
    y = ((xf - mean) * rstd * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)
    return y, (x, mean, rstd, w)


def _ln_bwd(eps, res, g):
    """dx from row reductions; d(w), d(b) as column sums of a materialised g (their own fusion)."""
    x, mean, rstd, w = res
    gf = g.astype(jnp.float32)
    xhat = (x.astype(jnp.float32) - mean) * rstd
    gw = gf * w.astype(jnp.float32)
    dx = rstd * (gw - jnp.mean(gw, -1, keepdims=True) - xhat * jnp.mean(gw * xhat, -1, keepdims=True))
    gs, xs = jax.lax.optimization_barrier((g, x))
    xh = (xs.astype(jnp.float32) - mean) * rstd
    axes = tuple(range(g.ndim - 1))
    dw = jnp.sum(gs.astype(jnp.float32) * xh, axes)
    db = jnp.sum(gs.astype(jnp.float32), axes)
    return dx.astype(x.dtype), dw.astype(w.dtype), db.astype(w.dtype)


_layer_norm.defvjp(_ln_fwd, _ln_bwd)


def linear_call(add):
    def call(self, x):
        k = self.kernel[...].astype(x.dtype)
        n = self.n_in
        y = jax.lax.dot_general(x, k, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())))
        if self.bias is None:
            return y
        b = self.bias[...].astype(y.dtype)
        return add(y, b) if add is not None else y + b
    return call


def mlp_keep_act(self, x):
    h = layers.activation(self.act)(checkpoint_name(self.linear_fc1(x), "mlp_hidden"))
    return checkpoint_name(self.linear_fc2(checkpoint_name(h, "mlp_hidden")), "mlp")


def probe_vision(args):
    cfg = load_config("h200", model=args.model)
    vcfg = dataclasses.replace(cfg.model.vision_config, depth=args.vision_layers, deepstack_visual_indexes=())
    compute = cfg.compute
    b, p, imgs = args.mbs, 3136, 4
    blocks = layers.stack_modules(lambda r: vision.VisionBlock(vcfg, compute, r), vcfg.depth, nnx.Rngs(0), "vis_layers")
    graphdef, state = nnx.split(blocks)
    state = jax.tree.map(lambda a: a.astype(jnp.bfloat16), state)
    k1, k2 = jax.random.split(jax.random.key(1))
    x = jax.random.normal(k1, (b, p, vcfg.hidden_size), jnp.bfloat16)
    probe = jax.random.normal(k2, (b, p, vcfg.hidden_size), jnp.bfloat16)
    side = p // imgs
    rc = np.stack(np.meshgrid(np.arange(28), np.arange(28), indexing="ij"), -1).reshape(-1, 2)
    patch_rc = jnp.asarray(np.tile(rc, (b, imgs, 1)), jnp.int32)
    cos, sin = vision.vision_rope_cos_sin(patch_rc, vcfg.head_dim, vcfg.rope_theta)
    seg = jnp.asarray(np.tile(np.repeat(np.arange(1, imgs + 1), side), (b, 1)), jnp.int32)

    def make(add, keep_act, ln=False):
        def loss(st, x):
            Linear, MLP, LN = layers.Linear, vision.VisionMLP, layers.LayerNorm
            old = Linear.__call__, MLP.__call__, LN.__call__
            Linear.__call__ = linear_call(add)
            if keep_act:
                MLP.__call__ = mlp_keep_act
            if ln:
                LN.__call__ = lambda self, x: _layer_norm(self.eps, x, self.scale[...], self.bias[...])
            try:
                stack = nnx.merge(graphdef, st)
                out, _ = layers.run_stack(stack, lambda blk, h, _, s: (blk(h, *s), None), x, None, compute,
                                          side=(cos, sin, seg))
            finally:
                Linear.__call__, MLP.__call__, LN.__call__ = old
            return jnp.sum(out.astype(jnp.float32) * probe)
        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    bias_dot = lambda y, b: _bias_dot(b.ndim, y, b)  # noqa: E731
    variants = {"autodiff": make(None, False), "bias_split": make(layers.bias_add, False),
                "bias_dot": make(bias_dot, False), "keep_gelu": make(None, True),
                "bias_split+keep_gelu": make(layers.bias_add, True)}
    if args.ln:
        variants["bias_split+ln_split"] = make(layers.bias_add, False, ln=True)
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    print(f"vision: {vcfg.depth} blocks, x [{b}, {p}, {vcfg.hidden_size}], fwd+bwd", flush=True)
    out = race(variants, (state, x), rounds=args.rounds, iters=args.iters, check=rel_err)
    for name in args.profile.split(",") if args.profile else []:
        out[name]["top_kernels"] = top_kernels(variants[name], (state, x), f"/tmp/prof_{name}")
    return out


def top_kernels(fn, args, path, n=24, n_ops=60):
    """One profiled call: the kernels by total time (ms) with their HLO op's op_name, printed; then the
    ``n_ops`` longest HLO ops (per ``hlo_op``) with the bytes their instruction reads and writes and the
    bandwidth that gives (GB/s; the H200's HBM is ~4,800): memory-bound kernels far below it are the targets."""
    from moevlm_jax.tools.trace_breakdown import device_events, load_trace
    jax.block_until_ready(fn(*args))
    jax.profiler.start_trace(path, create_perfetto_trace=True)
    jax.block_until_ready(fn(*args))
    jax.profiler.stop_trace()
    ops, nbytes = {}, {}
    try:  # op_name and bytes of each instruction from the compiled HLO
        ops, nbytes = hlo_table(fn.lower(*args).compile().as_text())
    except Exception as e:  # noqa: BLE001 - names are a convenience
        print("  (no HLO names:", e, ")")
    events = device_events(load_trace(path))
    tot = {}
    for e in events:
        tot[str(e.get("name"))] = tot.get(str(e.get("name")), 0.0) + float(e.get("dur", 0.0)) * 1e-3
    rows = sorted(tot.items(), key=lambda kv: -kv[1])[:n]
    print(f"  profile {path}: {sum(tot.values()):.2f} ms of kernels", flush=True)
    for k, ms in rows:
        print(f"    {ms:8.3f} ms  {k[:48]:48s} {ops.get(k, '')[-80:]}", flush=True)
    ops_table = op_rows(events, ops, nbytes, n=n_ops)
    print_rows(ops_table)
    return {"kernels": [{"kernel": k, "ms": ms, "op_name": ops.get(k, "")} for k, ms in rows], "ops": ops_table}


# ------------------------------------------------------------------------------------------------ embed

def probe_embed(args):
    cfg = load_config("h200", model=args.model)
    v, h = cfg.model.text_config.vocab_size, cfg.model.text_config.hidden_size
    n = args.mbs * 4096
    table = jax.random.normal(jax.random.key(0), (v, h), jnp.bfloat16)
    out = {}
    for name, ids in {"uniform ids": jax.random.randint(jax.random.key(1), (args.mbs, 4096), 0, v),
                      "25% one id": jnp.where(jax.random.uniform(jax.random.key(2), (args.mbs, 4096)) < 0.25, 151655,
                                              jax.random.randint(jax.random.key(1), (args.mbs, 4096), 0, v))}.items():
        g = jax.random.normal(jax.random.key(3), (args.mbs, 4096, h), jnp.bfloat16)
        variants = {"autodiff bf16 scatter": jax.jit(lambda t, g, ids=ids: jax.vjp(lambda t: jnp.take(t, ids, axis=0), t)[1](g)[0]),
                    "take_rows f32": jax.jit(lambda t, g, ids=ids: jax.vjp(lambda t: take_rows(t, ids), t)[1](g)[0])}
        print(f"embed: [{v}, {h}] bf16, {n} ids ({name})", flush=True)
        out[name] = race(variants, (table, g), rounds=args.rounds, iters=args.iters, check=rel_err)
    return out


# ------------------------------------------------------------------------------------------------ optimizer

def skip_nonfinite_select(inner, max_consecutive_errors):
    """optax.apply_if_finite's state and decision; finiteness from the gradients' global norm (merged by XLA
    with the clipping's), the rejected update as selects fused into the update instead of a lax.cond."""
    def init(params):
        return optax.ApplyIfFiniteState(notfinite_count=jnp.zeros([], jnp.int32), last_finite=jnp.array(True),
                                        total_notfinite=jnp.zeros([], jnp.int32), inner_state=inner.init(params))

    def update(grads, state, params=None):
        isfinite = jnp.isfinite(optax.tree.norm(grads))
        count = jnp.where(isfinite, 0, optax.safe_increment(state.notfinite_count))
        ok = isfinite | (count > max_consecutive_errors)
        updates, inner_state = inner.update(grads, state.inner_state, params)
        updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros((), u.dtype)), updates)
        inner_state = jax.tree.map(lambda new, old: jnp.where(ok, new, old), inner_state, state.inner_state)
        total = jnp.where(isfinite, state.total_notfinite, optax.safe_increment(state.total_notfinite))
        return updates, optax.ApplyIfFiniteState(notfinite_count=count, last_finite=isfinite,
                                                 total_notfinite=total, inner_state=inner_state)

    return optax.GradientTransformation(init, update)


def probe_optimizer(args):
    cfg = load_config("h200", model=args.model)
    from moevlm_jax.model.registry import build_model
    abstract = nnx.state(nnx.eval_shape(lambda: build_model(cfg.model, cfg.compute, nnx.Rngs(0))), nnx.Param)
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), abstract)
    params = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), shapes)
    grads = jax.tree.map(lambda s: jnp.full(s.shape, 1e-4, s.dtype), shapes)
    n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes))
    ocfg = dataclasses.replace(cfg.optimizer, skip_nonfinite=False)
    inner, _ = optim.make_optimizer(ocfg, total_steps=1000)

    def step_fn(tx):
        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s
        return jax.jit(step, donate_argnums=(0, 1))

    res = {}
    for name, tx in {"optax.apply_if_finite": optax.apply_if_finite(inner, 2**31 - 1),
                     "skip_nonfinite": skip_nonfinite_select(inner, 2**31 - 1)}.items():
        step = step_fn(tx)
        p = jax.tree.map(jnp.copy, params)
        s = tx.init(p)
        p, s = step(p, s, grads)
        jax.block_until_ready(p)
        times = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            for _ in range(args.iters):
                p, s = step(p, s, grads)
            jax.block_until_ready(p)
            times.append((time.perf_counter() - t) / args.iters * 1e3)
        leaf = np.asarray(jax.tree.leaves(p)[0][..., :8], np.float32).ravel()[:4].tolist()
        res[name] = {"ms_best": min(times), "ms_all": times, "first_leaf_after": leaf}
        print(f"  {name:28s} {min(times):9.3f} ms   (rounds {', '.join(f'{x:.3f}' for x in times)})  p[:4] {leaf}",
              flush=True)
        del p, s, step
    bytes_ = n * 2 * 7  # read p, g, m, v; write p, m, v (bf16)
    print(f"optimizer: {n / 1e9:.3f}B bf16 params; one-pass floor {bytes_ / 4.8e12 * 1e3:.1f} ms at 4.8 TB/s", flush=True)
    res["params"] = n
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="vision,embed,optimizer")
    ap.add_argument("--mbs", type=int, default=10)
    ap.add_argument("--model", default=None, help="the recipe's (proxy) unless given: tiny for a CPU check")
    ap.add_argument("--vision-layers", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ln", action="store_true", help="vision: also a LayerNorm with its own backward")
    ap.add_argument("--variants", default="", help="vision: only these variants (comma list; the first is the reference)")
    ap.add_argument("--profile", default="", help="vision: variants to profile (comma list)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default="parts.json")
    args = ap.parse_args()
    if args.profile:  # every kernel in the trace, not one command buffer (run 22's first profile was one)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": str(jax.devices()[0]), "jax": jax.__version__,
           "args": vars(args)}
    for part in args.parts.split(","):
        t = time.perf_counter()
        out[part] = {"probe_vision": probe_vision, "probe_embed": probe_embed,
                     "probe_optimizer": probe_optimizer}[f"probe_{part}"](args)
        print(f"{part}: {time.perf_counter() - t:.0f} s", flush=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
