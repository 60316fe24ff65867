"""The compiled-HLO collective reader (``parallelism.hlo``) against hand-counted programs on the 8 CPU devices:

- a shard_map program over a ('data' 2, 'model' 4) mesh whose devices are in reverse id order (replica-group
  ids are mesh positions, not device ids) with 2 hosts of 4 devices: an all-gather over 'data', a psum over
  'model' inside a 5-step scan (counted 5 times), an all-to-all over 'model' and a ppermute over 'data';
  kinds, axes, runs and bytes by hand, and the within / across-host split;
- the same loop without XLA's known trip count: the count taken from the loop condition, flagged;
- a jit (SPMD partitioner) matmul contracting over 'model': an all-reduce over 'model' (the partitioner's
  mesh-axes replica-group format);
- the three replica-group spellings parsed alike (no compile);
- a long operand list's /*index=5*/ marker (no compile).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moevlm_jax.parallelism import hlo

F32 = 4
ROWS, COLS, STEPS = 16, 32, 5  # the global array; a device's block is 8 x 8 (data 2, model 4)
BLOCK = ROWS // 2 * COLS // 4 * F32  # 256 bytes


@pytest.fixture(scope="module")
def program():
    mesh = Mesh(np.asarray(jax.devices()[::-1]).reshape(2, 4), ("data", "model"))

    def f(x, w):
        def body(c, wi):
            return jax.lax.psum(c * wi, "model"), None

        c, _ = jax.lax.scan(body, x, w)
        g = jax.lax.all_gather(c, "data", tiled=True)
        a = jax.lax.all_to_all(c, "model", 0, 0, tiled=True)
        p = jax.lax.ppermute(c, "data", [(0, 1), (1, 0)])
        return g.sum() + a.sum() + p.sum()

    sf = jax.shard_map(f, mesh=mesh, in_specs=(P("data", "model"), P()), out_specs=P(), check_vma=False)
    x = jax.ShapeDtypeStruct((ROWS, COLS), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    w = jax.ShapeDtypeStruct((STEPS,), jnp.float32, sharding=NamedSharding(mesh, P()))
    return mesh, jax.jit(sf).lower(x, w).compile().as_text()


def test_hand_counted_collectives_in_mesh_order_with_loops_and_hosts(program):
    mesh, text = program
    hosts = hlo.mesh_hosts(mesh, 4)
    assert hosts == [1, 1, 1, 1, 0, 0, 0, 0]  # mesh position 0 is device 7
    found, known = hlo.collectives(text, mesh.axis_names, mesh.devices.shape, hosts)
    assert known
    by = {c.kind: c for c in found}
    assert sorted(by) == ["all-gather", "all-reduce", "all-to-all", "collective-permute"] and len(found) == 4
    ag, ar, a2a, cp = by["all-gather"], by["all-reduce"], by["all-to-all"], by["collective-permute"]
    # psum over model (4) inside the scan: 2 X 3/4 a run, 5 runs, all within a host
    assert (ar.axes, ar.group_size, ar.runs) == (("model",), 4, STEPS)
    assert ar.bytes == 2 * BLOCK * 3 / 4 * STEPS and ar.across == 0 and ar.within == ar.bytes
    # all-gather over data (2): the other host's block, once
    assert (ag.axes, ag.group_size, ag.runs, ag.bytes) == (("data",), 2, 1, BLOCK)
    assert ag.across == BLOCK and ag.within == 0
    # all-to-all over model: 3/4 of the block leaves the device, within the host
    assert (a2a.axes, a2a.bytes, a2a.across) == (("model",), BLOCK * 3 / 4, 0)
    # ppermute along data: every device receives one block, from the other host
    assert (cp.axes, cp.bytes, cp.across) == (("data",), BLOCK, BLOCK)
    rows = {(r["kind"], r["axes"]): r for r in hlo.summarize(found)}
    assert rows[("all-reduce", "model")]["runs"] == STEPS and rows[("all-gather", "data")]["instructions"] == 1
    # one host: nothing crosses
    alone, _ = hlo.collectives(text, mesh.axis_names, mesh.devices.shape)
    assert sum(c.across for c in alone) == 0


def test_trip_count_from_the_loop_condition_when_xla_gives_none(program):
    mesh, text = program
    bare = re.sub(r',?"known_trip_count":\{"n":"\d+"\}', "", text)
    assert "known_trip_count" not in bare
    found, known = hlo.collectives(bare, mesh.axis_names, mesh.devices.shape)
    assert not known
    assert next(c for c in found if c.kind == "all-reduce").runs == STEPS


def test_spmd_partitioner_all_reduce_maps_to_its_mesh_axis():
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "model"))
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32, sharding=NamedSharding(mesh, P("data", "model")))
    w = jax.ShapeDtypeStruct((64, 16), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
    f = jax.jit(lambda x, w: x @ w, out_shardings=NamedSharding(mesh, P("data", None)))
    found, _ = hlo.collectives(f.lower(x, w).compile().as_text(), mesh.axis_names, mesh.devices.shape,
                               hlo.mesh_hosts(mesh, 4))
    (ar,) = [c for c in found if c.kind == "all-reduce"]
    out = 4 * 16 * F32  # a device's [4, 16] partial product
    assert (ar.axes, ar.group_size, ar.bytes, ar.across) == (("model",), 4, 2 * out * 3 / 4, 0)


def test_replica_group_spellings():
    explicit = hlo._groups("replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}", 8)
    iota = hlo._groups("replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}", 8)
    mesh = hlo._groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, dimensions={0}", 8)
    assert explicit == iota == mesh == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert hlo._groups("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", 8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert hlo._groups("replica_groups={}", 8) == [list(range(8))]
    assert hlo.shape_bytes("(f32[2,3]{1,0}, bf16[4], s32[])") == 24 + 8 + 4


def test_long_operand_lists_with_index_markers():
    """XLA prints /*index=5*/ before the sixth operand of a long list: that operand's bytes count too (a tuple
    all-to-all of 8 blocks, as XLA:CPU writes the dispatchers' exchanges)."""
    names = [f"p{i}" for i in range(8)]
    ops = ", ".join(("/*index=5*/" if i == 5 else "") + f"%{n}" for i, n in enumerate(names))
    text = "\n".join([
        "HloModule m", "",
        "ENTRY %main (" + ", ".join(f"{n}: f32[4,16]" for n in names) + ") -> f32[4,16] {",
        *(f"  %{n} = f32[4,16]{{1,0}} parameter({i})" for i, n in enumerate(names)),
        f"  %a2a = (f32[4,16]{{1,0}}, f32[4,16]{{1,0}}) all-to-all({ops}), channel_id=1, "
        "replica_groups={{0,1,2,3,4,5,6,7}}",
        "  ROOT %r = f32[4,16]{1,0} get-tuple-element(%a2a), index=0",
        "}",
    ])
    (a2a,), _ = hlo.collectives(text, ("x",), (8,))
    assert a2a.operand_bytes == 8 * 4 * 16 * F32
