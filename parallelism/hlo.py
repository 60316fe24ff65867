"""The collectives of a compiled SPMD program, read from its HLO text (``compiled.as_text()``): kind, the
mesh axes its replica groups span, how often a step runs it, and the bytes one device receives, within its
host and across hosts (``moevlm_jax.plan.compiled`` builds its report on this).

Bytes a device receives per run of one collective over a group of ``n`` devices (ring / pairwise
algorithms, as ``moevlm_jax.plan.comm`` counts them), ``X`` the operand bytes one device holds:

- ``all-gather``: ``X (n - 1)`` (the gathered result is ``n X``; the own shard is not received);
- ``reduce-scatter``: ``X (n - 1) / n``; ``all-reduce``: ``2 X (n - 1) / n`` (reduce-scatter + all-gather);
- ``all-to-all``: ``X (n - 1) / n`` (``X`` = everything one device sends, every operand of a tuple form);
  ``ragged-all-to-all``: the same of its input buffer, an upper bound (the sizes sent are data-dependent);
- ``collective-permute``: ``X`` for each (source, target) pair whose target the device is (self pairs
  move nothing); per device = the pairs' bytes over all devices / devices.

Per device is the mean over the program's devices (exact for the symmetric groups SPMD partitioning
makes). The share from peers on other hosts is ``across``: for a group collective the fraction of a
device's peers on another host, for a permute the pairs whose source and target hosts differ.

Which device a replica-group id is: XLA numbers a partitioned program's devices by their position in the
computation's device assignment, which for a ``jax.sharding.Mesh`` is ``mesh.devices.flat`` (mesh order;
a hybrid multi-host mesh is not device-id order), so an id is a mesh coordinate (``numpy.unravel_index``)
and the axes whose coordinate varies within a group are the group's axes. ``hosts[i]`` is the host of
position ``i`` (:func:`mesh_hosts`: device id // devices per host).

How often: a collective inside a ``while`` body (a scan over layers or microbatches) runs trip-count
times: XLA's ``known_trip_count`` backend config where present, else the largest integer constant of the
loop's condition (``trip_known=False``); nested loops multiply. Computations reached through
``calls=`` / ``to_apply=`` / ``branch_computations`` count once per call site (every branch of a
conditional once: an upper bound). Async pairs are counted at their start (``*-start``, ``async-start``);
``*-done`` / ``async-update`` are not.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute")
_OPCODES = {k: k for k in KINDS} | {f"{k}-start": k for k in KINDS}
DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8e\w+?|token)\[([^\]]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*.*\{\s*$")
_PARAM = re.compile(r"%?([\w.\-]+):\s*((?:\([^()]*\))|[^,()]+)")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"')
_COMMENT = re.compile(r"/\*.*?\*/")
_CONST = re.compile(r"\b[su](?:8|16|32|64)\[\]\s+constant\((-?\d+)\)")


def shape_bytes(text: str) -> float:
    """Bytes of every array shape in ``text`` (a shape, a tuple of shapes, or an operand list)."""
    total = 0.0
    for dtype, dims in _SHAPE.findall(text):
        if dtype == "token":
            continue
        size = DTYPE_BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
        n = math.prod(int(d.replace("<=", "")) for d in dims.split(",") if d.strip()) if dims.strip() else 1
        total += size * n
    return total


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # the result shape's text
    opcode: str
    operands: list[str]  # operand names (or their text when the HLO prints shapes with them)
    operand_text: str
    attrs: str  # everything after the operand list


@dataclasses.dataclass
class Computation:
    name: str
    entry: bool
    instructions: list[Instruction]
    shapes: dict[str, str]  # name -> result shape (parameters included)


def _split_top(text: str) -> tuple[str, str]:
    """``text`` after an opening '(': (the operand list, the rest after its matching ')')."""
    depth = 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return text[:i], text[i + 1:]
    return text, ""


def _operand_names(text: str) -> list[str]:
    text = _COMMENT.sub("", text)  # long operand lists carry /*index=5*/ markers
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def parse_module(text: str) -> dict[str, Computation]:
    """HLO module text -> its computations by name."""
    comps: dict[str, Computation] = {}
    cur: Computation | None = None
    for line in text.splitlines():
        if cur is None:
            m = _HEADER.match(line)
            if m:
                cur = Computation(m.group(2), bool(m.group(1)), [], {})
                for pname, pshape in _PARAM.findall(m.group(3)):
                    cur.shapes[pname] = pshape
            continue
        if line.startswith("}"):
            comps[cur.name] = cur
            cur = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, opcode, rest = m.groups()
        operand_text, attrs = _split_top(rest)
        ins = Instruction(name, shape, opcode, _operand_names(operand_text), operand_text, attrs)
        cur.instructions.append(ins)
        cur.shapes[name] = shape
    return comps


def _operand_bytes(ins: Instruction, comp: Computation) -> list[float]:
    out = []
    for op in ins.operands:
        if _SHAPE.search(op):  # printed with its shape
            out.append(shape_bytes(op))
        else:
            out.append(shape_bytes(comp.shapes.get(op.lstrip("%"), "")))
    return out


def _called(attrs: str) -> list[tuple[str, str]]:
    """(attribute, computation) pairs an instruction calls."""
    out = []
    for key in ("calls", "to_apply", "body", "condition"):
        for m in re.finditer(rf"\b{key}=%?([\w.\-]+)", attrs):
            out.append((key, m.group(1)))
    for key in ("branch_computations", "called_computations"):
        m = re.search(rf"\b{key}=\{{([^}}]*)\}}", attrs)
        if m:
            out += [(key, c.strip().lstrip("%")) for c in m.group(1).split(",") if c.strip()]
    return out


def trip_count(ins: Instruction, comps: Mapping[str, Computation]) -> tuple[int, bool]:
    """A ``while``'s trip count and whether XLA knew it (else: the largest integer constant of its condition)."""
    m = _TRIP.search(ins.attrs)
    if m:
        return int(m.group(1)), True
    cond = dict(_called(ins.attrs)).get("condition")
    consts: list[int] = []
    if cond in comps:
        for c in comps[cond].instructions:
            consts += [int(x) for x in _CONST.findall(f"{c.shape} {c.opcode}({c.operand_text})")]
    return (max(consts) if consts and max(consts) > 0 else 1), False


def multiplicities(comps: Mapping[str, Computation]) -> tuple[dict[str, int], bool]:
    """How many times a step runs each computation (from the entry, loops by trip count), and whether
    every loop's trip count was XLA's own."""
    entry = next(c for c in comps.values() if c.entry)
    counts: dict[str, int] = {}
    known = True

    def visit(name: str, times: int, depth: int) -> None:
        nonlocal known
        if name not in comps or depth > 64:
            return
        counts[name] = counts.get(name, 0) + times
        for ins in comps[name].instructions:
            if ins.opcode.endswith(("-done", "-update")):
                continue  # the async pair's start called it
            trips = None
            if ins.opcode == "while":
                trips, ok = trip_count(ins, comps)
                known = known and ok
            for key, callee in _called(ins.attrs):
                if key == "condition" or (key == "to_apply" and ins.opcode in _OPCODES):
                    continue  # a loop test or a reduction's combiner: no collectives
                visit(callee, times * (trips if key == "body" and trips else 1), depth + 1)

    visit(entry.name, 1, 0)
    return counts, known


def _iota(dims: Sequence[int], perm: str | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose([int(x) for x in perm.split(",")]) if perm else ids


def _groups(attrs: str, n_devices: int) -> list[list[int]]:
    """``replica_groups``: explicit ``{{0,1},{2,3}}``, iota ``[G,S]<=[dims]T(perm)`` or over a mesh of the
    device assignment ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (the devices along the named axes); empty:
    one group of all."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*(?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?)?\s*\{([^}]*)\}", attrs)
    if m:
        axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        ids = (_iota([int(x) for x in m.group(2).split(",")], m.group(3)) if m.group(2)
               else np.arange(math.prod(sizes))).reshape(sizes)
        over = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(4)) if a in names]
        rest = [i for i in range(len(names)) if i not in over]
        size = math.prod(sizes[i] for i in over)
        return ids.transpose(rest + over).reshape(-1, size).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attrs)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        return _iota([int(x) for x in m.group(2).split(",")], m.group(3)).reshape(shape).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", attrs)
    if m and m.group(1).strip():
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))]
    return [list(range(n_devices))]


def _pairs(attrs: str) -> list[tuple[int, int]]:
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", attrs)
    if not m:
        return []
    return [(int(a), int(b)) for a, b in re.findall(r"\{?(\d+),(\d+)\}?", m.group(1) + "}")]


@dataclasses.dataclass
class Collective:
    """One collective instruction of the compiled step."""

    kind: str  # all-gather | all-reduce | reduce-scatter | all-to-all | ragged-all-to-all | collective-permute
    name: str  # the HLO instruction
    computation: str
    runs: int  # per step (trip counts of the loops around it multiplied)
    operand_bytes: float  # X: what one device holds (all operands)
    group_size: int  # devices in a replica group (2 for a permute)
    axes: tuple[str, ...]  # mesh axes the groups span
    partial: bool  # a group is not the whole product of its axes (a subset of them)
    bytes: float  # per device per step (module docstring)
    within: float  # of which from peers on the same host
    across: float  # of which from peers on other hosts
    op_name: str = ""  # jax's op_name metadata (where in the model)
    sliced: bool = False  # an all-reduce each device then slices by its partition id: a reduce-scatter in effect

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _axes_of(group: Sequence[int], shape: Sequence[int], names: Sequence[str]) -> tuple[tuple[str, ...], bool]:
    coords = np.array(np.unravel_index(np.asarray(group), shape)).T  # [members, axes]
    varying = [i for i in range(len(shape)) if len(set(coords[:, i].tolist())) > 1]
    partial = len(group) != math.prod(shape[i] for i in varying)
    return tuple(names[i] for i in varying), partial


def collectives(text: str, axis_names: Sequence[str], axis_sizes: Sequence[int],
                hosts: Sequence[int] | None = None) -> tuple[list[Collective], bool]:
    """Every collective of the compiled HLO ``text`` of a program over a mesh (``axis_names`` /
    ``axis_sizes`` in mesh order; ``hosts[i]``: host of mesh position ``i``, default all one host), and
    whether every loop's trip count was XLA's own."""
    comps = parse_module(text)
    runs, known = multiplicities(comps)
    users: dict[str, dict[str, list[Instruction]]] = {}
    n_dev = math.prod(axis_sizes)
    hosts = list(hosts) if hosts is not None else [0] * n_dev
    out = []
    for cname, times in runs.items():
        comp = comps[cname]
        for ins in comp.instructions:
            kind = _OPCODES.get(ins.opcode)
            if kind is None:
                continue
            ops = _operand_bytes(ins, comp)
            x = ops[0] if kind == "ragged-all-to-all" else sum(ops)
            meta = re.search(r'op_name="([^"]*)"', ins.attrs)
            if kind == "collective-permute":
                pairs = [(s, t) for s, t in _pairs(ins.attrs) if s != t]
                cross = sum(hosts[s] != hosts[t] for s, t in pairs)
                per = x * len(pairs) / n_dev
                # the axes the pairs move along
                axes = tuple(dict.fromkeys(a for s, t in pairs for a in _axes_of([s, t], axis_sizes, axis_names)[0]))
                partial = False
                across = per * cross / max(len(pairs), 1)
                out.append(Collective(kind, ins.name, cname, times, x, 2, axes, partial, per * times,
                                      (per - across) * times, across * times, meta.group(1) if meta else ""))
                continue
            groups = _groups(ins.attrs, n_dev)
            n = len(groups[0])
            if n <= 1:
                continue
            sliced = kind == "all-reduce" and _sliced(ins, users.setdefault(cname, _users(comp)))
            per = {"all-gather": x * (n - 1), "all-reduce": 2 * x * (n - 1) / n}.get(kind, x * (n - 1) / n)
            frac = []
            for g in groups:
                for d in g:
                    frac.append(sum(hosts[p] != hosts[d] for p in g) / (len(g) - 1))
            share = float(np.mean(frac)) if frac else 0.0
            axes, partial = _axes_of(groups[0], axis_sizes, axis_names)
            out.append(Collective(kind, ins.name, cname, times, x, n, axes, partial, per * times,
                                  per * (1 - share) * times, per * share * times, meta.group(1) if meta else "",
                                  sliced))
    return out, known


def _users(comp: Computation) -> dict[str, list[Instruction]]:
    out: dict[str, list[Instruction]] = {}
    for ins in comp.instructions:
        for op in ins.operands:
            out.setdefault(op.split()[-1].lstrip("%") if op else op, []).append(ins)
    return out


def _sliced(ins: Instruction, users: Mapping[str, list[Instruction]]) -> bool:
    """Whether a user of the all-reduce's result (or of a tuple element of it) also reads the partition id:
    the SPMD partitioner's all-reduce + per-device slice, which XLA's GPU pipeline turns into a reduce-scatter
    (ReduceScatterCreator; XLA:CPU keeps the pair)."""
    names = [ins.name] + [u.name for u in users.get(ins.name, []) if u.opcode == "get-tuple-element"]
    return any(op.split()[-1].lstrip("%").startswith("partition-id") for name in names for u in users.get(name, [])
               for op in u.operands if op)


def mesh_hosts(mesh: Any, devices_per_host: int) -> list[int]:
    """The host of every position of ``mesh.devices.flat``: device id // ``devices_per_host`` (devices
    numbered host by host, as JAX numbers a multi-process GPU or CPU job's devices)."""
    return [int(d.id) // max(int(devices_per_host), 1) for d in np.asarray(mesh.devices).flat]


def summarize(items: Sequence[Collective]) -> list[dict[str, Any]]:
    """Collectives grouped by (kind, axes, sliced): instructions, runs a step, bytes, within, across."""
    rows: dict[tuple[str, tuple[str, ...], bool], dict[str, Any]] = {}
    for c in items:
        r = rows.setdefault((c.kind, c.axes, c.sliced), {"kind": c.kind, "sliced": c.sliced,
                                                          "axes": "x".join(c.axes) or "-", "instructions": 0,
                                                          "runs": 0, "bytes": 0.0, "within": 0.0, "across": 0.0})
        r["instructions"] += 1
        r["runs"] += c.runs
        r["bytes"] += c.bytes
        r["within"] += c.within
        r["across"] += c.across
    return sorted(rows.values(), key=lambda r: -r["bytes"])
