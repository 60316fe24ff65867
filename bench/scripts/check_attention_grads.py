"""GPU check of the attention op's gradients with padding, cuDNN ragged (packed) vs the XLA path.

bench/step_h200.md: our proxy run on real data did not train while the mock run did; real batches
pad the vision patches (buckets 3328 / 3456), the mock's never do. cuDNN's ragged attention leaves
d(q), d(k), d(v) unwritten at padding positions, which ``moevlm_jax.model.attention`` now zeroes
(``mask_padding_grad``). This script measures, on the proxy's attention shapes with padding, for the
op as shipped and with that mask disabled: whether every gradient is finite, the relative error of
the output and gradients at valid positions against the XLA path in float32, and the largest value
at padding positions. Prints one JSON line per case; ``--out`` writes them all.

  python bench/scripts/check_attention_grads.py --out $OUT/attention_grads.json
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import moevlm_jax.model.attention as attention

CASES = {  # name: (heads, kv heads, head dim, causal, per-row segment lengths, row length)
    "decoder": (32, 4, 128, True, [[1500, 1200, 800, 500], [4000]], 4096),
    "vision": (16, 16, 72, False, [[784] * 4, [784] * 3 + [600]], 3328),
}


def segments(lengths: list[list[int]], s: int) -> np.ndarray:
    out = np.zeros((len(lengths), s), np.int32)
    for r, lens in enumerate(lengths):
        pos = 0
        for i, n in enumerate(lens, 1):
            out[r, pos:pos + n] = i
            pos += n
    return out


def run_case(name: str, masked: bool) -> dict:
    n, kh, d, causal, lens, s = CASES[name]
    seg = jnp.asarray(segments(lens, s))
    valid = seg > 0
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    b = seg.shape[0]
    q = jax.random.normal(keys[0], (b, s, n, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, s, kh, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, s, kh, d), jnp.float32)
    probe = jax.random.normal(keys[3], (b, s, n, d), jnp.float32) * valid[:, :, None, None]

    def loss(q, k, v, impl):
        out = attention.dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, causal=causal, impl=impl)
        out = jnp.where(valid[:, :, None, None], out, 0)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    saved = attention.mask_padding_grad
    if not masked:
        attention.mask_padding_grad = lambda x, valid: x  # the op before the fix
    try:
        bf = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
        (_, out), grads = jax.jit(lambda *a: grad(*a, "cudnn"))(*bf)
    finally:
        attention.mask_padding_grad = saved
    (_, ref_out), ref_grads = jax.jit(lambda *a: grad(*a, "xla"))(q, k, v)
    row = {"case": name, "mask_padding_grad": masked, "finite": bool(all(np.isfinite(np.asarray(g, np.float32)).all()
                                                                          for g in (out, *grads)))}
    vm = np.asarray(valid)[:, :, None, None]
    for label, a, r in (("out", out, ref_out), *zip(("dq", "dk", "dv"), grads, ref_grads)):
        a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            row[f"{label}_rel_err"] = float(np.linalg.norm((a - r) * vm) / max(np.linalg.norm(r * vm), 1e-30))
            row[f"{label}_max_abs_at_padding"] = float(np.nanmax(np.abs(a * ~vm))) if np.isfinite(a).all() else float("nan")
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    rows = []
    for name in CASES:
        for masked in (True, False):
            try:
                rows.append(run_case(name, masked))
            except Exception as e:  # noqa: BLE001 - recorded
                rows.append({"case": name, "mask_padding_grad": masked, "error": f"{type(e).__name__}: {e}"[:400]})
            print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)
    ok = all(r.get("finite") and r.get("dq_rel_err", 1) < 2e-2 for r in rows if r.get("mask_padding_grad"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
