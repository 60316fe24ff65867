"""Expert-parallel dispatchers on 8 CPU devices equal the single-device experts, forward and backward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

from moevlm_jax.config import load_layout
from moevlm_jax.parallelism import hlo, logical
from moevlm_jax.parallelism.dispatch import (
    host_exchanges,
    ragged_all_to_all_dense,
    resolve_topology,
    shard_map_unchecked,
)
from moevlm_jax.parallelism.experts import ExpertsConfig, experts_forward, experts_forward_with_stats
from moevlm_jax.parallelism.permute import expert_capacity
from tests.parallelism.moe_reference import assert_close, dense_reference, make_problem, probe, value_and_grads
from tests.xla_options import FAST

# quick compiles (tests/xla_options.py): the single-device references compiled alike
pytestmark = pytest.mark.usefixtures("legacy_emitters")

TOKENS_ALL = ["act_tokens", ["data", "fsdp", "expert"]]
LAYOUTS = {
    "expert8": dict(mesh={"expert": 8}, rules=[TOKENS_ALL, ["exp", "expert"]]),
    "expert4_fsdp2": dict(mesh={"fsdp": 2, "expert": 4}, rules=[TOKENS_ALL, ["exp", "expert"], ["embed", "fsdp"]]),
    # ETP: tokens replicated over the tensor axis
    "expert2_tensor2_fsdp2": dict(
        mesh={"fsdp": 2, "expert": 2, "tensor": 2},
        rules=[TOKENS_ALL, ["exp", "expert"], ["moe_mlp", "tensor"], ["embed", "fsdp"]],
    ),
    # ETP with token rows also sharded over the tensor axis (gathered, then reduce-scattered)
    "expert2_tensor2_fsdp2_tokens_on_tensor": dict(
        mesh={"fsdp": 2, "expert": 2, "tensor": 2},
        rules=[["act_tokens", ["fsdp", "expert", "tensor"]], ["exp", "expert"], ["moe_mlp", "tensor"]],
    ),
    # EP not folded into data parallelism: tokens replicated over the expert axis
    "expert4_fsdp2_tokens_replicated": dict(
        mesh={"fsdp": 2, "expert": 4}, rules=[["act_tokens", ["data", "fsdp"]], ["exp", "expert"]]
    ),
    # no expert parallelism: experts FSDP-sharded at rest, gathered for the local dispatcher
    "fsdp8": dict(mesh={"fsdp": -1}, rules=[["act_tokens", ["data", "fsdp"]], ["embed", "fsdp"]]),
    # experts over two mesh axes; for the hierarchical dispatcher 'fsdp' is the host axis: 2 "hosts" x 4 devices
    "experts_on_fsdp_and_expert": dict(mesh={"fsdp": 2, "expert": 4}, rules=[TOKENS_ALL, ["exp", ["fsdp", "expert"]]]),
    # 2 "hosts" ('fsdp') x EP 2 x ETP 2, tokens replicated over 'expert' and 'tensor' (split, then gathered)
    "hosts_ep_etp_tokens_replicated": dict(mesh={"fsdp": 2, "expert": 2, "tensor": 2}, rules=[
        ["act_tokens", ["data", "fsdp"]], ["exp", ["fsdp", "expert"]], ["moe_mlp", "tensor"]]),
}
HOSTS = "experts_on_fsdp_and_expert"


def _mesh_and_rules(name):
    layout = load_layout({"name": name, **LAYOUTS[name]})
    return layout.make_mesh(), layout.rules


def _place(mesh, rules, x, idx, w, w_gate_up, w_down, split_gate_up=False):
    """Put inputs on the mesh the way the model would hold them (weights sharded at rest)."""
    with logical.sharding_context(mesh, rules):
        tok = logical.named_sharding(("act_tokens", None))
        if split_gate_up:  # [E, H, 2, I] keeps each tensor shard's gate and up columns aligned
            e, h, two_i = w_gate_up.shape
            w_gate_up = jax.device_put(
                w_gate_up.reshape(e, h, 2, two_i // 2), logical.named_sharding(("exp", "embed", None, "moe_mlp"))
            )
        else:
            w_gate_up = jax.device_put(w_gate_up, logical.named_sharding(("exp", "embed", "moe_mlp")))
        w_down = jax.device_put(w_down, logical.named_sharding(("exp", "moe_mlp", "embed")))
        return (jax.device_put(x, tok), jax.device_put(idx, tok), jax.device_put(w, tok), w_gate_up, w_down)


def _sharded_value_and_grads(name, problem, split_gate_up=False, **opts):
    mesh, rules = _mesh_and_rules(name)
    args = _place(mesh, rules, *problem, split_gate_up=split_gate_up)
    with logical.sharding_context(mesh, rules):
        out, grads = value_and_grads(lambda *a: experts_forward(*a, **opts), *args)
    if split_gate_up:
        grads = grads[:2] + (grads[2].reshape(problem[3].shape),) + grads[3:]
    return out, grads


CASES = [
    ("expert8", "alltoall", "random"),
    ("expert8", "allgather", "skewed"),
    ("expert4_fsdp2", "alltoall", "one"),
    ("expert4_fsdp2", "allgather", "random"),
    ("expert2_tensor2_fsdp2", "alltoall", "skewed"),
    ("expert2_tensor2_fsdp2", "allgather", "random"),
    ("expert2_tensor2_fsdp2_tokens_on_tensor", "alltoall", "random"),
    ("expert2_tensor2_fsdp2_tokens_on_tensor", "allgather", "one"),
    ("expert4_fsdp2_tokens_replicated", "alltoall", "random"),
    ("expert4_fsdp2_tokens_replicated", "allgather", "skewed"),
    # flat alltoall on this layout: test_hierarchical_equals_flat_and_dense; skewed routing leaves a "host" idle
    ("experts_on_fsdp_and_expert", "hierarchical", "skewed"),
    ("hosts_ep_etp_tokens_replicated", "hierarchical", "random"),
    ("experts_on_fsdp_and_expert", "allgather", "random"),
]


@pytest.mark.parametrize(("layout", "dispatcher", "routing"), CASES)
def test_dropless_dispatch_equals_single_device(layout, dispatcher, routing):
    problem = make_problem(seed=11, routing=routing)
    want = value_and_grads(lambda *a: experts_forward(*a, backend="ragged_dot"), *problem)
    split = layout.endswith("tokens_on_tensor")  # [E, H, 2, I] weights; the others pass [E, H, 2I]
    got = _sharded_value_and_grads(layout, problem, split_gate_up=split, dispatcher=dispatcher)
    assert_close(got[0], want[0], what=f"{layout}/{dispatcher} forward")
    assert_close(got[1], want[1], what=f"{layout}/{dispatcher}")


@pytest.mark.parametrize(("layout", "dispatcher"), [("expert4_fsdp2", "alltoall"), ("expert2_tensor2_fsdp2",
                                                                                    "allgather")])
def test_triton_kernels_under_expert_parallelism(layout, dispatcher):
    """The GPU default backend (Pallas-Triton kernels, interpret mode here) inside the EP shard_map."""
    problem = make_problem(seed=5, routing="skewed")
    want = value_and_grads(lambda *a: experts_forward(*a, backend="ragged_dot"), *problem)
    got = _sharded_value_and_grads(layout, problem, dispatcher=dispatcher, backend="triton")
    assert_close(got[0], want[0], what=f"{layout}/{dispatcher} triton forward")
    assert_close(got[1], want[1], what=f"{layout}/{dispatcher} triton")


@pytest.mark.parametrize(("layout", "dispatcher", "routing", "factor", "overflow"), [
    ("expert8", "alltoall", "skewed", 0.5, 4.0),
    ("expert4_fsdp2", "allgather", "one", 1.0, 0.25),
    ("expert2_tensor2_fsdp2", "alltoall", "random", 1.0, 0.25),
    ("expert4_fsdp2_tokens_replicated", "allgather", "skewed", 0.5, 4.0),
    ("fsdp8", "local", "one", 1.0, 0.25),
])
def test_hybrid_under_expert_parallelism_is_dropless(layout, dispatcher, routing, factor, overflow):
    """backend 'hybrid' on the receiving devices (padded einsum up to the capacity, grouped matmul
    past it) equals the single-device dropless experts; small factors force overflow; an overflow
    buffer of 4x the expected rows holds large overflows, 0.25 sends them to the grouped fallback."""
    problem = make_problem(seed=13, routing=routing)
    want = value_and_grads(lambda *a: experts_forward(*a, backend="ragged_dot"), *problem)
    opts = dict(backend="hybrid", capacity_factor=factor, dispatcher=dispatcher, hybrid_overflow=overflow)
    got = _sharded_value_and_grads(layout, problem, **opts)
    assert_close(got[0], want[0], what=f"{layout}/{dispatcher} hybrid forward")
    assert_close(got[1], want[1], what=f"{layout}/{dispatcher} hybrid")
    mesh, rules = _mesh_and_rules(layout)
    with logical.sharding_context(mesh, rules):
        _, stats = jax.jit(lambda *a: experts_forward_with_stats(*a, **opts))(*_place(mesh, rules, *problem))
    assert int(stats["dropped"]) == 0


def test_local_dispatcher_on_fsdp_mesh_equals_single_device():
    problem = make_problem(seed=12)
    want = value_and_grads(experts_forward, *problem)
    got = _sharded_value_and_grads("fsdp8", problem)
    assert_close(got[0], want[0], what="forward")
    assert_close(got[1], want[1], what="fsdp8 local")


def _per_group_reference(problem, groups, **opts):
    """Single-device experts on each device's token group (capacity is per device group)."""
    x, idx, w, w_gate_up, w_down = problem

    def fn(x, idx, w, a, b):
        parts = [
            experts_forward(
                *(c[g] for c in (jnp.split(x, groups), jnp.split(idx, groups), jnp.split(w, groups))), a, b, **opts
            )
            for g in range(groups)
        ]
        return jnp.concatenate(parts)

    stats = jax.jit(lambda *a: experts_forward_with_stats(*a, **opts)[1]["dropped"])
    dropped = sum(
        int(stats(xs, ids, ws, w_gate_up, w_down))
        for xs, ids, ws in zip(jnp.split(x, groups), jnp.split(idx, groups), jnp.split(w, groups))
    )
    return value_and_grads(fn, *problem), dropped


@pytest.mark.parametrize(
    ("layout", "dispatcher", "backend", "policy"),
    [
        ("expert8", "alltoall", "capacity", "probs"),
        ("expert4_fsdp2", "alltoall", "ragged_dot", "position"),
        ("expert4_fsdp2", "allgather", "capacity", "position"),
    ],
)
def test_capacity_dispatch_equals_per_group_single_device(layout, dispatcher, backend, policy):
    problem = make_problem(seed=13, routing="skewed")
    opts = dict(capacity_factor=1.0, drop_policy=policy, backend=backend)
    want, want_dropped = _per_group_reference(problem, 8, **opts)
    assert want_dropped > 0
    got = _sharded_value_and_grads(layout, problem, dispatcher=dispatcher, **opts)
    assert_close(got[0], want[0], what="forward")
    assert_close(got[1], want[1], what=f"{layout}/{dispatcher}/{backend}/{policy}")
    mesh, rules = _mesh_and_rules(layout)
    with logical.sharding_context(mesh, rules):
        stats = jax.jit(lambda *a: experts_forward_with_stats(*a, dispatcher=dispatcher, **opts)[1])(*problem)
    assert int(stats["dropped"]) == want_dropped


def test_topology_reads_the_logical_rules():
    mesh, rules = _mesh_and_rules("expert2_tensor2_fsdp2_tokens_on_tensor")
    topo = resolve_topology(logical.ShardingContext(mesh, logical.normalize_rules(rules)))
    assert (topo.token_axes, topo.expert_axes, topo.etp_axes) == (
        ("fsdp", "expert", "tensor"),
        ("expert",),
        ("tensor",),
    )
    assert (topo.ep, topo.etp, topo.etp_token_axes, topo.ep_replicated_axes) == (2, 2, ("tensor",), ())
    mesh, rules = _mesh_and_rules("expert4_fsdp2_tokens_replicated")
    topo = resolve_topology(logical.ShardingContext(mesh, logical.normalize_rules(rules)))
    assert (topo.token_axes, topo.ep_token_axes, topo.ep_replicated_axes) == (("fsdp",), (), ("expert",))
    assert resolve_topology(None).mesh is None


def test_ragged_all_to_all_dense_matches_documented_example():
    """The example in jax.lax.ragged_all_to_all's docstring, on the fixed-size emulation."""
    mesh = Mesh(np.asarray(jax.devices()[:2]), ("x",))
    operand = jnp.asarray([[1, 2, 2], [3, 4, 0]], jnp.float32)[..., None]
    args = dict(
        input_offsets=[[0, 1], [0, 1]],
        send_sizes=[[1, 2], [1, 1]],
        output_offsets=[[0, 0], [1, 2]],
        recv_sizes=[[1, 1], [2, 1]],
    )
    args = {k: jnp.asarray(v, jnp.int32) for k, v in args.items()}

    def body(op, io, ss, oo, rs):
        out = jnp.zeros((4, 1), jnp.float32)
        return ragged_all_to_all_dense(op[0], out, io[0], ss[0], oo[0], rs[0], axis_name=("x",), axis_size=2)[None]

    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("x"), out_specs=PartitionSpec("x"), check_vma=False)
    )
    result = fn(operand, *args.values())[..., 0]
    np.testing.assert_array_equal(np.asarray(result), [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_layout_errors_name_the_problem():
    mesh, rules = _mesh_and_rules("expert4_fsdp2")
    with logical.sharding_context(mesh, rules):
        with pytest.raises(
            ValueError, match=r"6 experts do not divide over the expert-parallel mesh axes \('expert',\)"
        ):
            experts_forward(*make_problem(e=6))
        with pytest.raises(ValueError, match="ragged_all_to_all, not implemented on XLA:CPU"):
            experts_forward(*make_problem(), a2a_impl="ragged")
        with pytest.raises(ValueError, match="token rows do not divide"):
            experts_forward(*make_problem(t=12))
        with pytest.raises(ValueError, match=r"^compute.moe.dispatcher 'hierarchical' needs the experts split over a "
                                             r"mesh axis that may cross hosts .* maps 'exp' to \('expert',\)"):
            experts_forward(*make_problem(), dispatcher="hierarchical")
    mesh, rules = _mesh_and_rules("expert2_tensor2_fsdp2")
    with logical.sharding_context(mesh, rules):
        with pytest.raises(ValueError, match=r"intermediate size 3 does not divide .* \('tensor',\)"):
            experts_forward(*make_problem(i=3))
    mesh, rules = _mesh_and_rules("expert4_fsdp2_tokens_replicated")
    with logical.sharding_context(mesh, rules):
        with pytest.raises(ValueError, match="splits each device's 6 rows"):
            experts_forward(*make_problem(t=12))


@pytest.mark.parametrize(("layout", "opts"), [
    (None, dict(backend="ragged_dot")),
    (None, dict(backend="triton")),
    (None, dict(backend="hybrid", capacity_factor=0.5)),
    (None, dict(backend="capacity", capacity_factor=2.0)),
    ("expert8", dict(dispatcher="alltoall")),
    ("expert4_fsdp2", dict(dispatcher="allgather", backend="capacity", capacity_factor=8.0)),
    ("expert2_tensor2_fsdp2", dict(dispatcher="alltoall", backend="hybrid", capacity_factor=0.5)),
])
def test_expert_id_e_is_no_expert(layout, opts):
    """The MoE block sends padding positions to id E (no expert): every dispatcher and backend leaves them out,
    forward and backward, as the dense reference that adds no routing weight for them (an out-of-range scatter);
    and are not counted as dropped (the capacities here hold every valid assignment)."""
    x, idx, w, a, b = make_problem(seed=17, routing="random")
    e = a.shape[0]
    pad = np.arange(idx.shape[0]) % 3 == 0
    idx = jnp.where(jnp.asarray(pad)[:, None], e, idx)
    problem = (x, idx, w, a, b)
    want = value_and_grads(dense_reference, *problem)
    assert not np.asarray(want[0])[pad].any() and np.asarray(want[0])[~pad].any()
    if layout is None:
        got = value_and_grads(lambda *p: experts_forward(*p, **opts), *problem)
        stats = jax.jit(lambda *p: experts_forward_with_stats(*p, **opts)[1])(*problem)
    else:
        got = _sharded_value_and_grads(layout, problem, **opts)
        mesh, rules = _mesh_and_rules(layout)
        with logical.sharding_context(mesh, rules):
            stats = jax.jit(lambda *p: experts_forward_with_stats(*p, **opts)[1])(*_place(mesh, rules, *problem))
    assert_close(got[0], want[0], what=f"{layout} {opts} forward")
    assert_close(got[1], want[1], what=f"{layout} {opts}")
    assert int(stats["dropped"]) == 0


# ----------------------------------------------------------------------------- hierarchical (EP across hosts)

# top-4 of 8 experts, 4 a host: most tokens need both hosts, with 2 experts on the remote one on average
HOST_PROBLEM = dict(seed=21, routing="random", k=4, h=64)
HOST_CAPACITY = dict(drop_policy="probs", backend="capacity")


def _kept(idx, w, groups, factor):
    """[T, K] the assignments each device group keeps under the probs policy (highest weight, then earlier)."""
    t, k = idx.shape
    e = HOST_PROBLEM.get("e", 8)
    cap = expert_capacity(t // groups, k, e, factor)
    keep = np.zeros(idx.shape, bool)
    for g in range(groups):
        rows = slice(g * t // groups, (g + 1) * t // groups)
        gi, gw = idx[rows].reshape(-1), w[rows].reshape(-1)
        for ex in range(e):
            mine = np.flatnonzero(gi == ex)
            order = mine[np.lexsort((mine, -gw[mine]))][:cap]
            keep[rows].reshape(-1)[order] = True
    return keep


@pytest.fixture(scope="module")
def host_steps():
    """Compiled value-and-gradient steps on 2 "hosts" x 4 devices (by (dispatcher, capacity factor)): outputs,
    gradients and the compiled HLO text, shared by the tests below (one compile each)."""
    problem = make_problem(**HOST_PROBLEM)
    mesh, rules = _mesh_and_rules(HOSTS)
    x, idx, w, a, b = _place(mesh, rules, *problem)
    c = jnp.asarray(probe(*x.shape))
    done = {}

    def get(dispatcher, factor=None, chunks=1):
        if (dispatcher, factor, chunks) not in done:
            opts = dict(dispatcher=dispatcher, **(dict(HOST_CAPACITY, capacity_factor=factor) if factor else {}))
            if chunks > 1:
                opts["dispatch_chunks"] = chunks

            def loss(x, w, a, b, idx):
                out = experts_forward(x, idx, w, a, b, **opts)
                return jnp.sum(out * c), out

            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
            with logical.sharding_context(mesh, rules):
                compiled = step.lower(x, w, a, b, idx).compile(FAST)
            (_, out), grads = compiled(x, w, a, b, idx)
            found, _ = hlo.collectives(compiled.as_text(), mesh.axis_names, mesh.devices.shape, hlo.mesh_hosts(mesh, 4))
            done[dispatcher, factor, chunks] = (out, grads, found)
        return done[dispatcher, factor, chunks]

    return problem, get


@pytest.mark.parametrize("factor", [None, 1.25], ids=["dropless", "capacity"])
def test_hierarchical_equals_flat_and_dense(host_steps, factor):
    """Experts over 2 hosts x 4 devices: the hierarchical dispatcher (tokens deduplicated by host, fanned out inside
    it, partial sums back) == the flat all-to-all == the dense reference (with the assignments each device group
    keeps, computed here in numpy), outputs and every gradient, dropless and drop-and-pad."""
    problem, get = host_steps
    keep = None
    if factor:
        keep = _kept(np.asarray(problem[1]), np.asarray(problem[2]), 8, factor)
        assert 0 < (~keep).sum() < keep.size // 2  # the capacity drops some, not most
    want = value_and_grads(lambda *p: dense_reference(*p, keep=None if keep is None else jnp.asarray(keep)), *problem)
    flat, hier = get("alltoall", factor), get("hierarchical", factor)
    for name, got in (("alltoall", flat), ("hierarchical", hier)):
        assert_close(got[0], want[0], what=f"{name} {factor} forward")
        assert_close(got[1], want[1], what=f"{name} {factor}")


def _dedup_factor(idx, keep, devices=8, hosts=2):
    """(token, expert) rows the flat dispatcher sends to other hosts / (token, host) rows the hierarchical one sends:
    the device of expert e is e // (E / devices), its host the device // (devices / hosts) (8 experts: e // 4)."""
    t, _ = idx.shape
    src_host = np.arange(t) // (t // devices) // (devices // hosts)
    dst_host = idx // (8 // hosts)
    remote = keep & (dst_host != src_host[:, None])
    flat = remote.sum()
    hier = sum(len(set(dst_host[i][remote[i]].tolist())) for i in range(t))
    return flat / hier


def _across(found):
    return sum(c.across for c in found)


@pytest.mark.parametrize("factor", [None, 1.25], ids=["dropless", "capacity"])
def test_hierarchical_cuts_cross_host_bytes(host_steps, factor):
    """From the compiled HLO: the bytes a device receives from the other host per step (forward and backward) fall
    from the flat all-to-all to the hierarchical dispatcher by at least the dedup factor of this routing (remote
    (token, expert) rows / remote (token, host) rows, numpy), and only the host axis ('fsdp') crosses hosts.

    The compiled exchanges here are fixed-size, so their bytes bound what crosses: the flat one sizes a peer's block
    for every assignment (dropless, CPU's emulated ragged exchange: T x K rows; drop-and-pad: C rows a remote
    expert, T K f / hosts a host), the hierarchical one a host's block for every token once (T rows; with a capacity
    min(T, experts a host x C)) plus the tokens' routing (2 K floats a row). Drop-and-pad therefore saves
    K f / hosts, at least the dedup factor where f >= 1 + 2^-K for 2 hosts (uniform routing), here f = 1.25. On
    GPUs the ragged exchanges move the rows routed, which fall by the dedup factor itself (not measured here)."""
    problem, get = host_steps
    idx = np.asarray(problem[1])
    keep = _kept(idx, np.asarray(problem[2]), 8, factor) if factor else np.ones(idx.shape, bool)
    dedup = _dedup_factor(idx, keep)
    assert dedup > 1.5  # top-4 of 8 over 2 hosts: most tokens' remote experts share the remote host
    flat, hier = get("alltoall", factor)[2], get("hierarchical", factor)[2]
    crossing = {c.axes for c in hier if c.across > 0 and c.operand_bytes > 4}  # (4 bytes: the dropped count's sum)
    assert crossing == {("fsdp",)}, crossing
    assert all(c.across == 0 for c in hier if "fsdp" not in c.axes)
    ratio = _across(flat) / _across(hier)
    print(f"{'capacity' if factor else 'dropless'}: bytes from the other host flat {_across(flat):.0f}, "
          f"hierarchical {_across(hier):.0f} (x{ratio:.2f}); the routing's dedup factor {dedup:.2f}")
    assert ratio >= dedup, (ratio, dedup, hlo.summarize(flat), hlo.summarize(hier))


@pytest.mark.parametrize("dispatcher", ["alltoall", "hierarchical"])
def test_dispatch_chunks_give_the_unchunked_results_in_that_many_exchanges(host_steps, dispatcher):
    """``dispatch_chunks`` 3 (uneven chunks of a device's 8 token rows: 3, 3, 2): outputs and every gradient equal the
    one-exchange dispatcher's (rows are independent), and the compiled step holds three times the exchanges over
    the host axis, moving the same bytes in all (each chunk's blocks a third as large)."""
    _, get = host_steps
    one, three = get(dispatcher), get(dispatcher, chunks=3)
    assert_close(three[0], one[0], what=f"{dispatcher} chunks forward")
    assert_close(three[1], one[1], what=f"{dispatcher} chunks")

    def exchanges(found):
        return [c for c in found if c.kind in ("all-to-all", "ragged-all-to-all") and c.across > 0]

    assert len(exchanges(three[2])) == 3 * len(exchanges(one[2])) > 0, (hlo.summarize(one[2]), hlo.summarize(three[2]))
    moved = [sum(c.across * c.runs for c in exchanges(f[2])) for f in (one, three)]
    assert moved[1] == pytest.approx(moved[0], rel=0.02), moved


def test_dispatch_chunks_refused_where_they_would_change_the_result():
    with pytest.raises(ValueError, match="dispatch_chunks 2 needs dropless experts"):
        ExpertsConfig(dispatch_chunks=2, capacity_factor=1.25, backend="capacity")
    with pytest.raises(ValueError, match="dispatcher 'allgather' has none"):
        ExpertsConfig(dispatch_chunks=2, dispatcher="allgather")
    with pytest.raises(ValueError, match="integer >= 1"):
        ExpertsConfig(dispatch_chunks=0)


def test_host_exchanges_ragged_moves_the_valid_rows_there_and_back():
    """The hierarchical dispatcher's ragged host exchange (GPU: jax.lax.ragged_all_to_all; here its fixed-size
    emulation, as XLA:CPU has none) lands the valid rows of each block where the fixed-size exchange does, fills the
    rest, and its return trip brings them back to where they were sent from."""
    mesh, _ = _mesh_and_rules(HOSTS)
    block, hosts = 3, 2
    rng = np.random.default_rng(3)
    sent = rng.integers(0, block + 1, (8, hosts)).astype(np.int32)  # per device, valid rows per destination host
    rows = (1 + np.arange(8 * hosts * block, dtype=np.float32)).reshape(8 * hosts * block, 1)
    ragged = functools.partial(ragged_all_to_all_dense, axis_size=hosts)

    def body(a, n):
        out = []
        for impl in ("ragged", "dense"):
            there, back = host_exchanges(impl, ("fsdp",), hosts, block, n[0], ragged=ragged)
            got = there(a, -1.0)
            out += [got, back(got)]
        return tuple(out)

    spec = PartitionSpec(("fsdp", "expert"))
    fn = jax.jit(shard_map_unchecked(body, mesh, (spec, spec), (spec,) * 4))
    r_there, r_back, d_there, d_back = (np.asarray(v).reshape(8, hosts, block) for v in fn(rows, sent))
    np.testing.assert_array_equal(d_back.reshape(-1, 1), rows)  # the fixed-size exchange is its own inverse
    sent3 = sent.reshape(2, 4, hosts)  # [host, device in host, destination host]
    for dev in range(8):
        me, inner = divmod(dev, 4)
        for src in range(hosts):
            n = sent3[src, inner, me]  # rows device (src, inner) sent here
            np.testing.assert_array_equal(r_there[dev, src, :n], d_there[dev, src, :n])
            assert (r_there[dev, src, n:] == -1).all()
        for dst in range(hosts):
            n = sent[dev, dst]
            np.testing.assert_array_equal(r_back[dev, dst, :n], rows.reshape(8, hosts, block)[dev, dst, :n])
            assert (r_back[dev, dst, n:] == 0).all()
