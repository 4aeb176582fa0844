"""`Plan.save` / `Plan.load`: a plan as JSON, MindSpore's strategy checkpoint for jshard.

The file holds the mesh, every operator's record (strategies, origin, predicted collectives) and
the layouts emission needs, and the layout of each flat argument and result. `parallelize(...,
plan=Plan.load(path))` checks the plan against the traced function operator by operator and
rebuilds the same program without propagating again; the first operator that differs is an error.

Format `jshard.plan/2` (written since jshard 0.1; `jshard.plan/1` is still read) keeps a record
small without losing anything `Plan.load` gives back (`Plan.load(p).ops == plan.ops`):

- one operator per line, compact JSON; its index is its position in `ops`;
- a field at its default (`OpRecord`'s defaults, `via="searched"` for a searched operator) is left
  out, and so are the strategy tuples and `PartitionSpec`s that follow from the operator's `layout`
  (written only where they differ);
- source lines are stored once, in `sources`, and an operator names its line by position there.

Reading is JSON only (nothing in a file is executed) and checks the whole file before building
anything (`_schema.check_plan_json`): a file that is not JSON, cut short, of another format, or
hand-edited into wrong keys, types or axis names is a `ShardingError` naming the file and every
problem found (the first `_SHOWN`); a file that is missing, or nested too deeply to be a plan, says
so. `write_json` replaces the file atomically, so a crash mid-save keeps the previous plan.

`write_json` also records a digest of the content (`"digest": "sha256:..."`, the SHA-256 of the plan
object without it, as canonical JSON: sorted keys, no spaces), so that a file edited within its
schema (a layout changed by hand) is told apart from the one saved: `read_fields` warns
(`PlanEditedWarning`) or, `strict`, refuses it; a file without a digest (format 1) is read as it is,
or refused with `strict`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import warnings
from typing import Any

from jax.sharding import PartitionSpec

from jshard._errors import PlanEditedWarning, ShardingError
from jshard.cost import Comm
from jshard.layouts import FineMesh, to_pspec
from jshard.plan._records import OpLayout, OpRecord
from jshard.plan._schema import CHOICES, FORMAT, check_plan_json

_SHOWN = 12
_DERIVED = ("in_strategy", "out_strategy", "in_specs", "out_specs")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(OpRecord) if f.default is not dataclasses.MISSING}


# Writing.


def write_json(data: dict, path: str | os.PathLike) -> None:
    """Writes a plan's JSON object (`to_json`) and its digest to `path`, one operator per line, atomically."""
    data = {**data, "digest": digest(data)}
    compact = lambda v: json.dumps(v, separators=(",", ":"))
    parts = []
    for key, value in data.items():
        if key in ("sources", "ops"):
            rows = ",\n  ".join(map(compact, value))
            parts.append(f"{json.dumps(key)}: [\n  {rows}\n ]")
        else:
            parts.append(f"{json.dumps(key)}: {compact(value)}")
    path = os.fspath(path)
    temporary = f"{path}.tmp{os.getpid()}"
    try:
        with open(temporary, "w") as f:
            f.write("{" + ",\n ".join(parts) + "}\n")
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def digest(data: dict) -> str:
    """The digest of a plan's JSON object (less any digest in it): SHA-256 of its canonical JSON."""
    content = {k: v for k, v in data.items() if k != "digest"}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def to_json(plan: Any) -> dict:
    """A `Plan` as the JSON object `save` writes (format `FORMAT`)."""
    sources: dict[str, int] = {}
    ops = [_op_json(position, op, plan.fine, sources) for position, op in enumerate(plan.ops)]
    return {
        "format": FORMAT,
        "mode": plan.mode,
        "propagation": plan.propagation,
        "mesh": {"sizes": list(plan.fine.sizes), "names": list(plan.fine.names)},
        "inputs": [_pspec_json(s) for s in plan.in_specs],
        "outputs": [_pspec_json(s) for s in plan.out_specs],
        "sources": list(sources),
        "ops": ops,
        **{name: list(value) if isinstance(value, tuple) else value for name, value in plan.choices},
    }


def _op_json(position: int, op: OpRecord, fine: FineMesh, sources: dict[str, int]) -> dict:
    derived = _derived(op.layout, len(op.in_shapes), len(op.out_shapes), fine)
    d: dict[str, Any] = {}
    for field in dataclasses.fields(OpRecord):
        value = getattr(op, field.name)
        if field.name == "index":
            if value != position:
                d["index"] = value
        elif field.name == "source":
            d["source"] = sources.setdefault(value, len(sources))
        elif field.name in _DERIVED:
            if value != derived[field.name]:
                d[field.name] = _strategies_json(value) if "strategy" in field.name else _pspecs_json(value)
        elif value != _default(field.name, op.origin):
            d[field.name] = _value_json(field.name, value)
    return d


def _value_json(name: str, value: Any) -> Any:
    if name == "layout":
        return {"in": [_spec_json(s) for s in value.in_specs], "out": [_spec_json(s) for s in value.out_specs],
                "implied": value.implied}
    if name == "comms":
        return [[c.kind, c.bytes, list(c.axes)] for c in value]
    return list(value) if isinstance(value, tuple) else value


def _default(name: str, origin: str) -> Any:
    return "searched" if name == "via" and origin == "searched" else _DEFAULTS.get(name)


def _derived(layout: OpLayout | None, n_in: int, n_out: int, fine: FineMesh) -> dict:
    """The strategy tuples and `PartitionSpec`s an operator's layout implies (None without one)."""
    if layout is None:
        return dict.fromkeys(_DERIVED)
    sizes = dict(zip(fine.names, fine.sizes))
    cuts = lambda spec: tuple(math.prod(sizes[a] for a in axes) for axes in spec)
    ins, outs = layout.in_specs[:n_in], layout.out_specs[:n_out]
    return {"in_strategy": tuple(map(cuts, ins)), "out_strategy": tuple(map(cuts, outs)),
            "in_specs": tuple(map(to_pspec, ins)), "out_specs": tuple(map(to_pspec, outs))}


def _strategies_json(value):
    return None if value is None else [None if s is None else list(s) for s in value]


def _pspecs_json(value):
    return None if value is None else [_pspec_json(s) for s in value]


def _pspec_json(spec):
    if spec is None:
        return None
    return [None if p is None else list(p) if isinstance(p, tuple) else p for p in spec]


def _spec_json(spec):
    return [list(axes) for axes in spec]


# Reading.


def read_fields(path: str | os.PathLike, call: str, strict: bool = False) -> dict:
    """The fields of the `Plan` saved at `path` (all but its mesh, which a file cannot hold).

    Raises:
      ShardingError: the file is missing or not a plan `Plan.save` wrote (not JSON, cut short,
        another format, keys, types or axis names edited), naming `call`, the file and what is
        wrong; with `strict`, its content no longer matches its digest (or it has none).

    Warns:
      PlanEditedWarning: its content no longer matches its digest (not `strict`).
    """
    path = os.fspath(path)
    data = _decode(path, call)
    problems = check_plan_json(data)
    if problems:
        raise ShardingError(_bad_file_error(call, path, problems))
    _check_digest(call, path, data, strict)
    fine = FineMesh(tuple(data["mesh"]["sizes"]), tuple(data["mesh"]["names"]))
    if data["format"] == "jshard.plan/1":
        data = _upgrade_v1(data)
    ops = tuple(_op_from_json(position, d, data["sources"], fine) for position, d in enumerate(data["ops"]))
    choices = tuple((name, tuple(data[name]) if isinstance(data[name], list) else data[name])
                    for name in CHOICES if name in data)  # what the program was built with beyond its layouts
    return dict(fine=fine, mode=data["mode"], ops=ops, propagation=data["propagation"],
                in_specs=tuple(map(_pspec_from_json, data["inputs"])),
                out_specs=tuple(map(_pspec_from_json, data["outputs"])), loaded_choices=choices)


def _check_digest(call: str, path: str, data: dict, strict: bool) -> None:
    saved = data.get("digest")
    if saved is not None and saved == digest(data) or saved is None and not strict:
        return
    what = ("holds no digest (it was written before jshard kept them, or by hand), so it cannot be told apart from an "
            "edited file" if saved is None else
            "was edited since Plan.save wrote it: its content no longer matches the digest saved in it, so its "
            "layouts may not be the ones the search chose")
    fix = "Save the plan again (plan.save(path)) to use it as it is now"
    if strict:
        raise ShardingError(f"{call}: {path} {what}. {fix}, or load it with strict=False.")
    warnings.warn(f"{call}: {path} {what}. The program follows the file as it is now (the values stay right). "
                  f"{fix}, or pass strict=True to refuse such files.", PlanEditedWarning, stacklevel=4)


def _decode(path: str, call: str) -> Any:
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ShardingError(f"{call}: {path} cannot be read: {e.strerror or e}. Give the path of a file Plan.save "
                            "wrote (plan.save(path), or `jshard plan ... --save path`).") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        what = "nested deeper than any plan is (not a file Plan.save wrote)"
    except UnicodeDecodeError as e:
        what = f"not a text file (byte {e.start} is not UTF-8)"
    except json.JSONDecodeError as e:
        cut = "" if raw.rstrip().endswith(b"}") else "; it ends before its closing brace (cut short while written or copied?)"
        what = f"not valid JSON: {e.msg} (line {e.lineno}, column {e.colno}){cut}"
    raise ShardingError(f"{call}: {path} is {what}. A plan file is the JSON Plan.save writes; save the plan "
                        "again (plan.save(path), or `jshard plan ... --save path`).")


def _bad_file_error(call: str, path: str, problems: list[str]) -> str:
    if problems[0].startswith("format"):
        return f"{call}: {path} is not a jshard plan file: {problems[0]}."
    shown = problems[:_SHOWN] + ([f"... and {len(problems) - _SHOWN} more"] if len(problems) > _SHOWN else [])
    return (f"{call}: {path} is not a plan Plan.save wrote; {len(problems)} problem(s):\n  " + "\n  ".join(shown)
            + "\nWas it edited by hand? Save the plan again (plan.save(path), or `jshard plan ... --save path`).")


def _upgrade_v1(data: dict) -> dict:
    """A `jshard.plan/1` object (every field written, sources inline) in the current form."""
    sources: dict[str, int] = {}
    ops = [{**op, "source": sources.setdefault(op["source"], len(sources))} for op in data["ops"]]
    return {**data, "sources": list(sources), "ops": ops}


def _op_from_json(position: int, d: dict, sources: list[str], fine: FineMesh) -> OpRecord:
    fields = {name: d.get(name, _default(name, d["origin"])) for name in _DEFAULTS}
    if fields["layout"] is not None:
        lay = fields["layout"]
        spec = lambda s: tuple(tuple(axes) for axes in s)
        fields["layout"] = OpLayout(tuple(map(spec, lay["in"])), tuple(map(spec, lay["out"])), lay["implied"])
    fields["comms"] = tuple(Comm(k, b, tuple(a)) for k, b, a in fields["comms"])
    derived = _derived(fields["layout"], len(d["in_shapes"]), len(d["out_shapes"]), fine)
    for name in _DERIVED:
        if name in d:
            strategy = "strategy" in name
            value = d[name]
            derived[name] = None if value is None else tuple(
                None if s is None else tuple(s) if strategy else _pspec_from_json(s) for s in value)
    return OpRecord(index=d.get("index", position), primitive=d["primitive"], source=sources[d["source"]],
                    in_shapes=tuple(d["in_shapes"]), out_shapes=tuple(d["out_shapes"]), origin=d["origin"],
                    **derived, **fields)


def _pspec_from_json(data):
    if data is None:
        return None
    return PartitionSpec(*(tuple(p) if isinstance(p, list) else p for p in data))
