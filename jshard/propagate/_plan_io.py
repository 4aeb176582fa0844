"""`Plan.save` / `Plan.load`: a plan as JSON, MindSpore's strategy checkpoint for jshard.

The file holds the mesh, every operator's record (strategies, origin, predicted collectives) and
the layouts emission needs, and the layout of each flat argument and result. `parallelize(...,
plan=Plan.load(path))` checks the plan against the traced function operator by operator and
rebuilds the same program without propagating again; the first operator that differs is an error.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jshard._errors import ShardingError
from jshard.layouts import FineMesh
from jshard.propagate._cost import Comm
from jshard.propagate._engine import CONSTRAINT, Decision, Result, constraint_spec, operand_vars, spec_from_pspec
from jshard.propagate._factors import shape_of
from jshard.propagate._graph import Node
from jshard.propagate._plan import OpRecord, Plan, _shape

FORMAT = "jshard.plan/1"


def save(plan: Plan, path: str) -> None:
    with open(path, "w") as f:
        json.dump(to_json(plan), f, indent=1)


def to_json(plan: Plan) -> dict:
    return {
        "format": FORMAT,
        "mode": plan.mode,
        "propagation": plan.propagation,
        "mesh": {"sizes": list(plan.fine.sizes), "names": list(plan.fine.names)},
        "inputs": [_pspec_json(s) for s in _flat_specs(plan.in_shardings)],
        "outputs": [_pspec_json(s) for s in _flat_specs(plan.out_shardings)],
        "ops": [_op_json(op) for op in plan.ops],
    }


def load(path: str) -> Plan:
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ShardingError(f"jshard.Plan.load({path!r}): not a jshard plan file (format {data.get('format')!r}, "
                            f"expected {FORMAT!r}).")
    fine = FineMesh(tuple(data["mesh"]["sizes"]), tuple(data["mesh"]["names"]))
    ops = tuple(_op_from_json(d) for d in data["ops"])
    inputs = [_pspec_from_json(s) for s in data["inputs"]]
    outputs = [_pspec_from_json(s) for s in data["outputs"]]
    return Plan(None, fine, data["mode"], ops, inputs, outputs, (), data["propagation"])


def result_from_plan(plan: Plan, nodes: Sequence[Node], invars, fine: FineMesh, call: str) -> Result:
    """The propagation result a loaded `plan` stands for, checked against the traced `nodes`.

    Raises:
      ShardingError: the mesh, the arguments or an operator differ from the plan's.
    """
    if tuple(plan.fine.sizes) != tuple(fine.sizes):
        raise ShardingError(f"{call}: the loaded plan is for a mesh {dict(zip(plan.fine.names, plan.fine.sizes))}, "
                            f"this call runs on {dict(zip(fine.names, fine.sizes))}. Use the same device count "
                            f"and strategies, or re-plan without plan=.")
    ops = [n for n in nodes if n.primitive != CONSTRAINT]
    if len(plan.in_shardings) != len(invars):
        raise ShardingError(f"{call}: the loaded plan has {len(plan.in_shardings)} arguments, this call "
                            f"{len(invars)}. Load the plan saved for this function, or re-plan without plan=.")
    for i, (node, op) in enumerate(zip(ops, plan.ops)):
        here = (node.primitive, tuple(map(_shape, node.inputs)), tuple(map(_shape, node.outputs)))
        if here != (op.primitive, op.in_shapes, op.out_shapes):
            raise ShardingError(_mismatch(call, i, op, here, node))
    if len(ops) != len(plan.ops):
        raise ShardingError(f"{call}: the loaded plan has {len(plan.ops)} operators, this function "
                            f"{len(ops)} (the first {min(len(ops), len(plan.ops))} match). Load the plan "
                            f"saved for this function, or re-plan without plan=.")
    values, decisions = {}, {}
    for v, spec in zip(invars, plan.in_shardings):
        if spec is not None:
            values[v] = spec_from_pspec(spec, len(shape_of(v)))
    records, unruled = iter(plan.ops), set()
    for i, node in enumerate(nodes):
        if node.primitive == CONSTRAINT:
            values[node.outputs[0]] = constraint_spec(node.eqn.params["sharding"], len(shape_of(node.outputs[0])))
            continue
        op = next(records)
        if not op.ruled:
            unruled.add(i)
        if op.layout is None:
            continue
        in_specs, out_specs, implied = op.layout
        comms = tuple(Comm(k, b / node.weight, tuple(a)) for k, b, a in op.comms)
        via = "searched" if op.origin == "searched" else ""
        decisions[i] = Decision(in_specs, out_specs, comms, op.seconds, via, None, implied)
        for v, spec in zip(operand_vars(node)[1], out_specs):
            values.setdefault(v, spec)
    return Result(decisions, values, unruled)


def _mismatch(call, i, op, here, node) -> str:
    prim, ins, outs = here
    return (
        f"{call}: the loaded plan does not match this function at operator #{i}: the plan has "
        f"{op.primitive} {' '.join(op.in_shapes)} -> {' '.join(op.out_shapes)} ({op.source or 'no source'}), "
        f"the function {prim} {' '.join(ins)} -> {' '.join(outs)} ({node.source or 'no source'}). Load the "
        f"plan saved for this function and these input shapes, or re-plan without plan=."
    )


def _flat_specs(shardings) -> list:
    leaves = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: x is None or isinstance(x, PartitionSpec))
    return [x.spec if isinstance(x, NamedSharding) else x for x in leaves]


def _pspec_json(spec):
    if spec is None:
        return None
    return [None if p is None else list(p) if isinstance(p, tuple) else p for p in spec]


def _pspec_from_json(data):
    if data is None:
        return None
    return PartitionSpec(*(tuple(p) if isinstance(p, list) else p for p in data))


def _spec_json(spec):
    return [list(axes) for axes in spec]


def _op_json(op: OpRecord) -> dict:
    d = dataclasses.asdict(op)
    d["in_specs"] = None if op.in_specs is None else [_pspec_json(s) for s in op.in_specs]
    d["out_specs"] = None if op.out_specs is None else [_pspec_json(s) for s in op.out_specs]
    if op.layout is not None:
        ins, outs, implied = op.layout
        d["layout"] = {"in": [_spec_json(s) for s in ins], "out": [_spec_json(s) for s in outs], "implied": implied}
    return d


def _op_from_json(d: dict) -> OpRecord:
    d = dict(d)
    tup = lambda x: None if x is None else tuple(None if s is None else tuple(s) for s in x)
    d["in_strategy"], d["out_strategy"] = tup(d["in_strategy"]), tup(d["out_strategy"])
    d["in_shapes"], d["out_shapes"] = tuple(d["in_shapes"]), tuple(d["out_shapes"])
    d["in_specs"] = None if d["in_specs"] is None else tuple(_pspec_from_json(s) for s in d["in_specs"])
    d["out_specs"] = None if d["out_specs"] is None else tuple(_pspec_from_json(s) for s in d["out_specs"])
    d["comms"] = tuple((k, b, tuple(a)) for k, b, a in d["comms"])
    if d["layout"] is not None:
        lay = d["layout"]
        spec = lambda s: tuple(tuple(axes) for axes in s)
        d["layout"] = (tuple(map(spec, lay["in"])), tuple(map(spec, lay["out"])), lay["implied"])
    return OpRecord(**d)

