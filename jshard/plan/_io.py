"""`Plan.save` / `Plan.load`: a plan as JSON, MindSpore's strategy checkpoint for jshard.

The file holds the mesh, every operator's record (strategies, origin, predicted collectives) and
the layouts emission needs, and the layout of each flat argument and result. `parallelize(...,
plan=Plan.load(path))` checks the plan against the traced function operator by operator and
rebuilds the same program without propagating again; the first operator that differs is an error.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jax.sharding import PartitionSpec

from jshard._errors import ShardingError
from jshard.cost import Comm
from jshard.layouts import FineMesh
from jshard.plan._records import OpLayout, OpRecord

FORMAT = "jshard.plan/1"


def write_json(data: dict, path: str) -> None:
    """Writes a plan's JSON object (`to_json`) to `path`."""
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def to_json(plan: Any) -> dict:
    """A `Plan` as the JSON object `save` writes."""
    return {
        "format": FORMAT,
        "mode": plan.mode,
        "propagation": plan.propagation,
        "mesh": {"sizes": list(plan.fine.sizes), "names": list(plan.fine.names)},
        "inputs": [_pspec_json(s) for s in plan.in_specs],
        "outputs": [_pspec_json(s) for s in plan.out_specs],
        "ops": [_op_json(op) for op in plan.ops],
    }


def read_fields(path: str) -> dict:
    """The fields of the `Plan` saved at `path` (all but its mesh, which a file cannot hold)."""
    with open(path) as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ShardingError(f"jshard.Plan.load({path!r}): not a jshard plan file (format {data.get('format')!r}, "
                            f"expected {FORMAT!r}).")
    fine = FineMesh(tuple(data["mesh"]["sizes"]), tuple(data["mesh"]["names"]))
    ops = tuple(_op_from_json(d) for d in data["ops"])
    inputs = tuple(_pspec_from_json(s) for s in data["inputs"])
    outputs = tuple(_pspec_from_json(s) for s in data["outputs"])
    return dict(fine=fine, mode=data["mode"], ops=ops, in_specs=inputs, out_specs=outputs,
                propagation=data["propagation"])


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
        d["layout"] = {"in": [_spec_json(s) for s in op.layout.in_specs], "out": [_spec_json(s) for s in op.layout.out_specs],
                       "implied": op.layout.implied}
    return d


def _op_from_json(d: dict) -> OpRecord:
    d = dict(d)
    tup = lambda x: None if x is None else tuple(None if s is None else tuple(s) for s in x)
    d["in_strategy"], d["out_strategy"] = tup(d["in_strategy"]), tup(d["out_strategy"])
    d["in_shapes"], d["out_shapes"] = tuple(d["in_shapes"]), tuple(d["out_shapes"])
    d["in_specs"] = None if d["in_specs"] is None else tuple(_pspec_from_json(s) for s in d["in_specs"])
    d["out_specs"] = None if d["out_specs"] is None else tuple(_pspec_from_json(s) for s in d["out_specs"])
    d["comms"] = tuple(Comm(k, b, tuple(a)) for k, b, a in d["comms"])
    if d["layout"] is not None:
        lay = d["layout"]
        spec = lambda s: tuple(tuple(axes) for axes in s)
        d["layout"] = OpLayout(tuple(map(spec, lay["in"])), tuple(map(spec, lay["out"])), lay["implied"])
    return OpRecord(**d)

