"""Building blocks shared by the vision tower and the decoder: parameters with logical axes,
linear layers, norms, activations, layer stacks and the scan-over-depth runner with remat.

Parameters are stored in ``param_dtype`` and cast to the compute dtype where they are used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import Offloadable, Saveable

from moevlm_jax.model.compute import CHECKPOINT_NAMES, ComputeConfig, checkpoint_names_of
from moevlm_jax.parallelism import fp8 as fp8_ops
from moevlm_jax.parallelism import pipeline
from moevlm_jax.parallelism.fp8 import Fp8Config

Axes = tuple[str | None, ...]


def dtype_of(name: str) -> jnp.dtype:
    """jnp dtype for a config dtype name ("float32", "bfloat16", ...)."""
    return jnp.dtype(name)


def param(rngs: nnx.Rngs | None, init: str, shape: Sequence[int], axes: Axes, dtype: Any,
          std: float = 0.02) -> nnx.Param:
    """An ``nnx.Param`` of ``shape`` with logical ``axes``; init "normal" (std), "ones" or "zeros"."""
    shape = tuple(int(s) for s in shape)
    if len(axes) != len(shape):
        raise ValueError(f"param of shape {shape} needs {len(shape)} logical axes, got {axes}")
    if init == "normal":
        value = std * jax.random.normal(rngs.params(), shape, jnp.float32)
    elif init == "ones":
        value = jnp.ones(shape, jnp.float32)
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(value.astype(dtype), out_sharding=tuple(axes))


class Linear(nnx.Module):
    """y = x . kernel (+ bias), contracting the trailing ``len(in_shape)`` dims of x.

    kernel ``[*in_shape, *out_shape]`` with logical axes ``in_axes + out_axes``; bias ``out_shape``.
    ``fp8``: the GEMM in FP8 with this recipe (``parallelism.fp8``; None: in x's dtype).
    """

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], in_axes: Axes, out_axes: Axes, *,
                 use_bias: bool, param_dtype: Any, rngs: nnx.Rngs, std: float = 0.02, fp8: Fp8Config | None = None):
        self.n_in = len(in_shape)
        self.fp8 = fp8
        self.kernel = param(rngs, "normal", (*in_shape, *out_shape), (*in_axes, *out_axes), param_dtype, std)
        self.bias = param(rngs, "zeros", out_shape, out_axes, param_dtype) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[..., *in_shape]`` -> ``[..., *out_shape]`` in x's dtype."""
        k = self.kernel[...].astype(x.dtype)
        n = self.n_in
        if self.fp8 is not None:
            y = fp8_ops.dot(x, k, n, self.fp8)
        else:
            y = jax.lax.dot_general(x, k, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())))
        if self.bias is not None:
            y = bias_add(y, self.bias[...].astype(y.dtype))
        return y


def bias_add(y: jax.Array, b: jax.Array) -> jax.Array:
    """``y + b`` (b broadcast over y's leading dims) whose backward sums b's gradient in float32 from
    the materialised output gradient, in a reduction of its own. Autodiff fuses that column sum into
    the fusion that produces the gradient (the vision MLP's GELU backward, ~1 GB a layer), where
    XLA:GPU's column-reduction emitter runs the whole fusion at ~2x its bandwidth bound (bench/
    step_h200.md); split, the proxy's vision stack is ~4% faster."""
    return _bias_add(b.ndim, y, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _bias_add(nd: int, y: jax.Array, b: jax.Array) -> jax.Array:
    return y + b


def _bias_add_fwd(nd, y, b):
    return y + b, None


def _bias_add_bwd(nd, _, g):
    split = jax.lax.optimization_barrier(g)  # the sum reads g once it exists: not fused into g's producer
    return g, jnp.sum(split.astype(jnp.float32), axis=tuple(range(g.ndim - nd))).astype(g.dtype)


_bias_add.defvjp(_bias_add_fwd, _bias_add_bwd)


class RMSNorm(nnx.Module):
    """HF Qwen3 RMSNorm: normalise in float32, cast back, multiply by the weight."""

    def __init__(self, dim: int, eps: float, *, param_dtype: Any):
        self.eps = eps
        self.scale = param(None, "ones", (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[..., dim]`` -> same shape and dtype."""
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * xf.astype(x.dtype)


class LayerNorm(nnx.Module):
    """LayerNorm with weight and bias, computed in float32."""

    def __init__(self, dim: int, eps: float, *, param_dtype: Any):
        self.eps = eps
        self.scale = param(None, "ones", (dim,), ("norm",), param_dtype)
        self.bias = param(None, "zeros", (dim,), ("norm",), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x ``[..., dim]`` -> same shape and dtype."""
        xf = x.astype(jnp.float32)
        mean = jnp.mean(xf, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps)
        y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
    """The activation HF names ``name`` (ACT2FN)."""
    table = {
        "silu": jax.nn.silu,
        "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
        "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
        "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    }
    if name not in table:
        raise ValueError(f"unsupported activation {name!r}; known: {sorted(table)}")
    return table[name]


# ----------------------------------------------------------------------------------------------
# Layer stacks: one module whose parameters carry a leading stacked axis
# ----------------------------------------------------------------------------------------------


def stack_modules(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs, axis_name: str | None) -> nnx.Module:
    """``n`` independently initialised copies of ``make(rngs)`` as one module whose Params have a
    leading axis of size ``n`` named ``axis_name`` (a plain leading axis: a pipeline can reshape it)."""
    keys = jax.random.split(rngs.params(), n)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
    state = jax.vmap(lambda key: nnx.state(make(nnx.Rngs(params=key))))(keys)

    def add_axis(v: nnx.Variable) -> nnx.Variable:
        names = v.get_metadata().get("out_sharding")
        if names is not None:
            v.set_metadata(out_sharding=(axis_name, *names))
        return v

    state = jax.tree.map(add_axis, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.merge(graphdef, state)


# Checkpoint names a recompute policy chooses among and Megatron's module names for them: see
# moevlm_jax.model.config (CHECKPOINT_NAMES, RECOMPUTE_MODULES); placed with jax.ad_checkpoint.checkpoint_name
# in decoder.py, moe.py, vision.py and parallelism/permute.py (moe_act).
OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"  # memory kinds of compute.offload


def remat_policy(compute: ComputeConfig, tower: str = "text") -> Callable[..., Any] | None:
    """The ``jax.checkpoint`` policy for one scanned layer of the decoder (``tower`` "text") or the
    vision tower ("vision": ``compute.vision_recompute*``, defaulting to the decoder's); None = no
    checkpoint at all.

    full: save nothing (each layer's input is kept by the scan; everything else is recomputed).
    selective: save the CHECKPOINT_NAMES tensors except those of the recompute modules, recompute
    everything else. ``compute.offload`` names are saved to pinned host memory instead, in any mode
    (under none: everything else stays saved on the device).
    """
    mode, modules = compute.stack_recompute(tower)
    offload = checkpoint_names_of(compute.offload)
    if mode == "none":
        return _save_all_offloading(offload) if offload else None
    dropped = set(checkpoint_names_of(modules)) if mode == "selective" else set(CHECKPOINT_NAMES)
    saved = tuple(n for n in CHECKPOINT_NAMES if n not in dropped and n not in offload)
    if offload:
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=saved, names_which_can_be_offloaded=offload,
            offload_src=OFFLOAD_SRC, offload_dst=OFFLOAD_DST)
    if mode == "full":
        return jax.checkpoint_policies.nothing_saveable
    return jax.checkpoint_policies.save_only_these_names(*saved)


def _save_all_offloading(names: tuple[str, ...]) -> Callable[..., Any]:
    """Save every residual on the device, except the named ones, which go to pinned host memory."""
    names = frozenset(names)

    def policy(prim: Any, *_: Any, **params: Any) -> Any:
        if prim.name == "name" and params.get("name") in names:  # a checkpoint_name marker
            return Offloadable(src=OFFLOAD_SRC, dst=OFFLOAD_DST)
        return Saveable

    return policy


@jax.custom_vjp
def materialised_grad(x: jax.Array) -> jax.Array:
    """The identity, whose cotangent passes an optimization barrier: computed once, where it is
    produced, and read from there by every consumer (XLA would otherwise fuse its producer into each)."""
    return x


def _materialised_grad_fwd(x: jax.Array) -> tuple[jax.Array, None]:
    return x, None


def _materialised_grad_bwd(_: None, g: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.optimization_barrier(g),)


materialised_grad.defvjp(_materialised_grad_fwd, _materialised_grad_bwd)


def stack_axis(stack: nnx.Module) -> str | None:
    """The logical name of a stacked module's leading (layer) axis, e.g. ``layers``."""
    for v in jax.tree.leaves(nnx.state(stack), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = v.get_metadata().get("out_sharding")
        if names:
            return names[0]
    return None


# the leading-axis names the model's layer stacks take (stack_modules): the decoder's, the vision tower's
LAYER_AXES: tuple[str, ...] = ("layers", "vis_layers")


def stack_tower(axis: str | None) -> str:
    """The tower whose compute options (``compute.stack_scan``, the remat policy) a stack with leading axis ``axis``
    follows: "vision" for ``vis_layers``, else "text"."""
    return "vision" if axis == "vis_layers" else "text"


def run_stack(stack: nnx.Module, body: Callable[[nnx.Module, Any, Any, Any], tuple[Any, Any]], carry: Any, xs: Any,
              compute: ComputeConfig, start: int = 0, stop: int | None = None, *, side: Any = None,
              side_axes: Any = 0, layer_offset: int = 0) -> tuple[Any, Any]:
    """Run layers ``start:stop`` of ``stack``: ``carry, y = body(layer, carry, x, side)`` per layer, with
    ``xs`` (a pytree with a leading layer axis, or None) sliced alongside. Returns the final carry and
    the per-layer ``y`` stacked on a leading axis. Scans (one compiled body) when
    the stack's tower scans (``compute.stack_scan``: ``scan_layers``, or ``vision_scan_layers`` for
    the vision tower), else unrolls; the remat policy wraps the body either way (the
    vision tower's for a ``vis_layers`` stack, else the decoder's; also inside a pipeline stage).

    ``side`` holds the batch-dependent inputs every layer reads (rotary tables, segment ids, ...),
    with the batch on axis ``side_axes`` (an int or a prefix pytree of ints); the carry and each
    ``y`` have the batch leading. When the layout maps the stack's layer axis onto the ``stage`` mesh
    axis, ``parallelism.pipeline`` runs the layers (carry and side split into microbatches);
    ``layer_offset`` is the stack's first layer in the model (for uneven stage boundaries)."""
    graphdef, state = nnx.split(stack)
    n = jax.tree.leaves(state)[0].shape[0]
    stop = n if stop is None else stop
    if stop <= start:
        return carry, None
    if start != 0 or stop != n:
        state = jax.tree.map(lambda a: a[start:stop], state)

    def step(c, layer_state, x, s):
        return body(nnx.merge(graphdef, layer_state), c, x, s)

    axis = stack_axis(stack)
    tower = stack_tower(axis)
    scan = compute.stack_scan(tower)
    policy = remat_policy(compute, tower)
    if policy is not None:
        step = jax.checkpoint(step, policy=policy, prevent_cse=not scan)
    plan = pipeline.active_config(axis) if axis is not None else None
    if plan is not None:
        return pipeline.run_pipeline(step, state, carry, xs, side, side_axes, plan, axis=axis,
                                     offset=layer_offset + start, scan=scan)
    if scan:
        return jax.lax.scan(lambda c, inputs: step(c, *inputs, side), carry, (state, xs))
    # unrolled: each layer's slice from one split per stacked leaf, whose transpose (the stacked
    # gradient) is one concatenate, not a sum of per-layer pads; each layer's weight gradient is
    # materialised once (not re-derived in every consumer of the stacked gradient), and the
    # concatenate is left to fuse into those consumers (the norm, the optimizer) instead of being
    # written out
    n_layers = stop - start

    def per_layer(a):
        return [x[0] for x in jax.lax.split(a, (1,) * n_layers)]

    layers = (jax.tree.map(lambda a: [materialised_grad(x) for x in per_layer(a)], state), jax.tree.map(per_layer, xs))
    ys = []
    for i in range(n_layers):
        carry, y = step(carry, *jax.tree.map(lambda parts, i=i: parts[i], layers, is_leaf=lambda x: isinstance(x,
                                                                                                               list)),
                        side)
        ys.append(y)
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys) if ys and ys[0] is not None else None
