"""The shape of a plan file, checked before anything is built from it.

`check_plan_json` lists everything wrong with a plan file's JSON object: its keys and value types
against a schema written once below (`_PLAN`: nested dicts, lists and tuples of JSON types, with
`_Null` and `_Either`; a key starting with `?` may be left out), then what a schema cannot say (a
mesh of as many sizes as names, origins, source positions, layout ranks, axis names the mesh has).
"""

from __future__ import annotations

import json
import re
from typing import Any

from jshard.plan._records import ORIGINS

FORMAT = "jshard.plan/2"
READS = ("jshard.plan/1", FORMAT)
"""The formats `Plan.load` reads: the current one and every earlier one."""


class _Null:
    """`schema` or null."""

    def __init__(self, schema):
        self.schema = schema


class _Either:
    """Any one of `schemas`."""

    def __init__(self, *schemas):
        self.schemas = schemas


_AXES = [str]
_SPEC = [_AXES]  # per dim, the mesh axes that cut it
_PSPEC = _Null([_Null(_Either(str, _AXES))])
_STRATEGIES = _Null([_Null([int])])
_OP = {
    "primitive": str, "in_shapes": [str], "out_shapes": [str], "origin": str,
    "?index": int, "?in_strategy": _STRATEGIES, "?out_strategy": _STRATEGIES,
    "?in_specs": _Null([_PSPEC]), "?out_specs": _Null([_PSPEC]), "?annotation": str, "?backward": bool,
    "?inside": str, "?comms": [(str, float, _AXES)], "?seconds": float, "?via": str, "?rejected": str,
    "?ruled": bool, "?layout": _Null({"in": [_SPEC], "out": [_SPEC], "implied": bool}),
}
_OP_V2 = {**_OP, "source": int, "?recompute": str, "?recomputed": bool, "?weighed": str, "?note": str,
          "?gathered": str}
"""Version 2 adds, as optional keys: the recompute region an operator belongs to, whether it is the
backward pass's run of it again, the argument layouts global propagation weighed for it, its
difference from MindSpore's operator (`OpRecord.note`), and the `shard` cuts it gathers
(`OpRecord.gathered`)."""
_PLAN = {
    "format": str, "mode": str, "propagation": str, "mesh": {"sizes": [int], "names": [str]},
    "inputs": [_PSPEC], "outputs": [_PSPEC], "sources": [str], "ops": [_OP_V2], "?copies": int, "?offload": [str], "?context": int, "?digest": str,
}
CHOICES = ("copies", "offload", "context")
"""`Plan.choices`' names, each a key of the file where the plan made that choice."""
_PLAN_V1 = dict(_PLAN, ops=[{**{k.lstrip("?"): v for k, v in _OP.items()}, "source": str}])
del _PLAN_V1["sources"]
_NAMES = {str: ("a string", "strings"), int: ("an integer", "integers"), float: ("a number", "numbers"),
          bool: ("true or false", "booleans")}


def check_plan_json(data: Any) -> list[str]:
    """What is wrong with a plan file's JSON object `data` (empty: nothing), each as `where: what`."""
    if not isinstance(data, dict) or "format" not in data:
        return [f"format: the file holds {_kind(data)} with no \"format\" key, not a jshard plan object"]
    if data["format"] not in READS:
        newer = isinstance(data["format"], str) and data["format"].startswith("jshard.plan/")
        return [f"format {data['format']!r}, expected one of {READS}"
                + (" (written by a newer jshard: upgrade jshard to read it)" if newer else "")]
    schema = _PLAN if data["format"] == FORMAT else _PLAN_V1
    return _schema_problems(data, schema, "") + _meaning_problems(data, schema)


def _schema_problems(value: Any, schema: Any, where: str) -> list[str]:
    if isinstance(schema, _Null):
        return [] if value is None else _schema_problems(value, schema.schema, where)
    if isinstance(schema, _Either):
        if any(not _schema_problems(value, s, where) for s in schema.schemas):
            return []
        return [f"{where or 'the file'}: {_kind(value)} is neither {' nor '.join(map(_expected, schema.schemas))}"]
    expected = dict if isinstance(schema, dict) else list if isinstance(schema, (list, tuple)) else schema
    if not _is(value, expected):
        return [f"{where or 'the file'}: expected {_expected(schema)}, got {_kind(value)}"]
    if isinstance(schema, dict):
        missing = [k for k in schema if not k.startswith("?") and k not in value]
        known = {k.lstrip("?") for k in schema}
        problems = [f"{where or 'the file'}: missing key {k!r}" for k in missing]
        problems += [f"{where or 'the file'}: unknown key {k!r}" for k in value if k not in known]
        for k, s in schema.items():
            if k.lstrip("?") in value:
                problems += _schema_problems(value[k.lstrip("?")], s, f"{where}.{k.lstrip('?')}".lstrip("."))
        return problems
    if isinstance(schema, tuple):
        if len(value) != len(schema):
            return [f"{where}: expected {len(schema)} entries ({_expected(schema)}), got {len(value)}"]
        return [p for i, (v, s) in enumerate(zip(value, schema)) for p in _schema_problems(v, s, f"{where}[{i}]")]
    if isinstance(schema, list):
        return [p for i, v in enumerate(value) for p in _schema_problems(v, schema[0], f"{where}[{i}]")]
    return []


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _expected(schema: Any, plural: bool = False) -> str:
    """What `schema` accepts, in words: `a list of integers` (plural: `lists of integers`)."""
    if isinstance(schema, _Null):
        return f"{_expected(schema.schema, plural)} or {'nulls' if plural else 'null'}"
    if isinstance(schema, _Either):
        return " or ".join(_expected(s, plural) for s in schema.schemas)
    if isinstance(schema, dict):
        return "objects" if plural else "an object"
    if isinstance(schema, tuple):
        return "[" + ", ".join(map(_expected, schema)) + "]" + (" entries" if plural else "")
    if isinstance(schema, list):
        return f"{'lists' if plural else 'a list'} of {_expected(schema[0], plural=True)}"
    return _NAMES[schema][plural]


def _kind(value: Any) -> str:
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a number"}
    text = json.dumps(value)
    return kinds.get(type(value), "null") + (f" {text}" if len(text) <= 40 and not isinstance(value, dict) else "")


def _meaning_problems(data: dict, schema: dict) -> list[str]:
    """What the schema cannot say (the mesh, origins, axis names, source lines, spec ranks), checked
    on the parts of `data` the schema accepts."""
    valid = lambda key, value=None: not _schema_problems(data.get(key) if value is None else value, schema[key], "")
    problems, used = [], set()
    if valid("mesh"):
        sizes, names = data["mesh"]["sizes"], data["mesh"]["names"]
        if len(sizes) != len(names) or len(set(names)) != len(names) or any(s < 1 for s in sizes):
            problems.append(f"mesh: sizes {sizes} and names {names} must be as many positive sizes as distinct names")
    if valid("propagation") and data["propagation"] not in ("jshard", "xla"):
        problems.append(f"propagation: {data['propagation']!r} is neither 'jshard' nor 'xla'")
    for key in ("inputs", "outputs"):
        if valid(key):
            used |= _pspec_axes(data[key])
    ops = data.get("ops") if isinstance(data.get("ops"), list) else []
    for i, op in enumerate(ops):
        if not valid("ops", [op]):
            continue
        where = f"ops[{i}] ({op['primitive']})"
        if op["origin"] not in ORIGINS:
            problems.append(f"{where}.origin: {op['origin']!r} is not one of {ORIGINS}")
        sources = data.get("sources")
        if isinstance(op["source"], int) and isinstance(sources, list) and not 0 <= op["source"] < len(sources):
            problems.append(f"{where}.source: {op['source']} is not a position in sources (0..{len(sources) - 1})")
        if op.get("layout") is not None:
            problems += _layout_problems(where, op["layout"], op)
            used |= {a for spec in op["layout"]["in"] + op["layout"]["out"] for dim in spec for a in dim}
        used |= _pspec_axes((op.get("in_specs") or []) + (op.get("out_specs") or []))
        used |= {a for c in op.get("comms", ()) for a in c[2]}
    if valid("mesh") and used - set(data["mesh"]["names"]):
        problems.append(f"axis name(s) {sorted(used - set(data['mesh']['names']))} used, but the mesh has only "
                        f"{data['mesh']['names']}")
    return problems


def _pspec_axes(pspecs: list) -> set[str]:
    """The mesh axes a list of JSON `PartitionSpec`s names."""
    return {a for spec in pspecs if spec for entry in spec if entry for a in ([entry] if isinstance(entry, str) else entry)}


def _layout_problems(where: str, layout: dict, op: dict) -> list[str]:
    problems = []
    for side, shapes in (("in", op["in_shapes"]), ("out", op["out_shapes"])):
        for k, (spec, shape) in enumerate(zip(layout[side], shapes)):
            rank = _rank(shape)
            if rank is not None and len(spec) != rank:
                problems.append(f"{where}.layout.{side}[{k}]: {len(spec)} dim(s) for {shape}")
            used = [a for dim in spec for a in dim]
            if len(set(used)) != len(used):
                problems.append(f"{where}.layout.{side}[{k}]: an axis cuts two dims, or one dim twice: {spec}")
    return problems


def _rank(shape: str) -> int | None:
    """The rank of a shape as plans write it (`f32[8,64]`: 2), or None if it is not one."""
    match = re.fullmatch(r".*\[([\d,]*)\]", shape)
    return None if match is None else len([d for d in match.group(1).split(",") if d])
