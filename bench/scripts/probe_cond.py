"""Does a lax.cond cost a host round trip on the GPU? (issue 8: the cuDNN ragged attention's dense-mask
fallback is a lax.cond in every attention call, 70 a proxy step; XLA's conditional thunk copies the
predicate to the host and waits for the stream.) Times a chain of L layers (matmul + a few elementwise
ops, the proxy's token count) with and without a data-dependent cond around each layer's matmul, in one
process, and prints ms per step and per cond.
    python bench/scripts/probe_cond.py --layers 35 --out cond.json"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp


def chain(layers: int, with_cond: bool):
    def layer(x, w, ids):
        def main(x):
            return jnp.tanh(x @ w)

        def other(x):
            return jax.nn.gelu(x @ w)

        h = jax.lax.cond(jnp.max(ids) > 2, other, main, x) if with_cond else main(x)
        for _ in range(4):  # short elementwise kernels after the branch: what waits on the host
            h = h * 1.0001 + 0.001
        return h

    def f(x, ws, ids):
        for i in range(layers):
            x = layer(x, ws[i], ids)
        return x

    return jax.jit(f)


def timed(fn, *args, reps: int) -> float:
    fn(*args).block_until_ready()
    fn(*args).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    out.block_until_ready()
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=35)
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out")
    a = p.parse_args()
    k = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(k[0], (a.tokens, a.hidden), jnp.bfloat16)
    ws = jax.random.normal(k[1], (a.layers, a.hidden, a.hidden), jnp.bfloat16) * a.hidden**-0.5
    ids = jnp.ones((8, 4096), jnp.int32)
    res = {"device": str(jax.devices()[0]), "layers": a.layers, "tokens": a.tokens, "hidden": a.hidden}
    for _ in range(2):  # alternate, twice: drift shows
        for name, c in (("plain", False), ("cond", True)):
            res.setdefault(name, []).append(timed(chain(a.layers, c), x, ws, ids, reps=a.reps))
    plain, cond = min(res["plain"]), min(res["cond"])
    res["per_cond_us"] = (cond - plain) / a.layers * 1e3
    print(f"plain {plain:.3f} ms, cond {cond:.3f} ms: {res['per_cond_us']:.1f} us per cond ({a.layers} layers)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
