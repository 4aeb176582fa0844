"""`Plan`: what jshard decided for every operator of a program, in a form a person can read."""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from jshard._context import Annotation
from jshard.layouts import FineMesh, Strategy, TensorLayout
from jshard.layouts._strategy import dtype_str
from jshard.propagate._emit import to_pspec
from jshard.propagate._graph import Node

ORIGINS = ("user", "propagated", "searched", "default")
"""Where an operator's strategy came from: a `shard` call, the propagation engine, the search, or
nowhere (left to XLA's own propagation from the anchors)."""

_SCOPE = re.compile(r"jshard_shard\d+")


@dataclasses.dataclass(frozen=True, slots=True)
class OpRecord:
    """One operator of the planned program.

    Attributes:
      index: position in program order (nested jaxprs flattened in place).
      primitive: the JAX primitive (`dot_general`, `add`, ...).
      source: `file:line (function)` of the user code that made it.
      in_shapes / out_shapes: shapes as `f32[8,64]`.
      in_strategy / out_strategy: MindSpore tuples per operand (None: not fixed by jshard).
      in_specs / out_specs: the same as `PartitionSpec`s over the plan's mesh.
      origin: `user`, `propagated`, `searched` or `default`.
      annotation: the `shard`ed function it belongs to, or `""`.
      backward: whether it belongs to the backward pass.
      inside: the enclosing loop or branch primitive, or `""`.
      comms: predicted collectives `(kind, bytes per device, mesh axes)` per call of the program
        (weighted by loop trip counts): redistributing its inputs and its partial sums.
      seconds: their predicted α–β time.
      via: the index of the operator (or `"arg"`, `"user"`) whose layout this one took.
      rejected: the best alternative it did not take, described, or `""`.
      ruled: False where jshard has no sharding rule for the primitive (left replicated).
    """

    index: int
    primitive: str
    source: str
    in_shapes: tuple[str, ...]
    out_shapes: tuple[str, ...]
    in_strategy: tuple[Strategy | None, ...] | None
    out_strategy: tuple[Strategy | None, ...] | None
    in_specs: tuple[PartitionSpec | None, ...] | None
    out_specs: tuple[PartitionSpec | None, ...] | None
    origin: str
    annotation: str = ""
    backward: bool = False
    inside: str = ""
    comms: tuple[tuple[str, float, tuple[str, ...]], ...] = ()
    seconds: float = 0.0
    via: str = ""
    rejected: str = ""
    ruled: bool = True


@dataclasses.dataclass(frozen=True)
class Plan:
    """The parallel plan of one function for one input signature.

    Attributes:
      mesh: the one `jax.sharding.Mesh` the program runs on.
      fine: its axis sizes, as a `FineMesh`.
      mode: the `parallelize` mode.
      ops: one `OpRecord` per operator, in program order.
      in_shardings / out_shardings: the compiled program's argument and result shardings (pytrees).
      annotations: the `shard` calls met while tracing.
    """

    mesh: Mesh
    fine: FineMesh
    mode: str
    ops: tuple[OpRecord, ...]
    in_shardings: Any
    out_shardings: Any
    annotations: tuple[Annotation, ...] = ()

    @property
    def device_count(self) -> int:
        return self.fine.device_count

    def summary(self) -> str:
        """A table of the user-annotated operators, then the rest counted by primitive."""
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.mesh.axis_names, self.mesh.devices.shape))
        lines = [f"Plan: {self.device_count} devices, mode={self.mode}, mesh ({axes})"]
        fixed = [op for op in self.ops if op.in_strategy is not None]
        if fixed:
            lines.append(_table(fixed))
        rest = [op for op in self.ops if op.in_strategy is None]
        if rest:
            counts = collections.Counter(op.primitive for op in rest)
            shown = ", ".join(f"{c} {p}" for p, c in counts.most_common(8))
            more = "" if len(counts) <= 8 else f", ... ({len(counts) - 8} more kinds)"
            lines.append(
                f"{len(rest)} other operators ({shown}{more}): origin=default, their layouts follow from "
                f"the anchors above through XLA's propagation."
            )
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _table(ops: Sequence[OpRecord]) -> str:
    rows = [("#", "op", "pass", "inputs", "in_strategy", "out_strategy", "origin", "source")]
    for op in ops:
        rows.append(
            (
                str(op.index),
                f"{op.primitive} [{op.annotation}]" if op.annotation else op.primitive,
                "bwd" if op.backward else "fwd",
                " ".join(op.in_shapes),
                _strategies(op.in_strategy),
                _strategies(op.out_strategy),
                op.origin,
                "/".join(op.source.split(" ")[0].split("/")[-2:]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _strategies(value) -> str:
    if value is None:
        return "-"
    return "(" + ", ".join("-" if s is None else str(s) for s in value) + ("," if len(value) == 1 else "") + ")"


def build_ops(
    nodes: Sequence[Node], annotations: Sequence[Annotation], fine: FineMesh, result=None
) -> tuple[OpRecord, ...]:
    """One `OpRecord` per operator; the main operator of each `shard` call carries its strategy.

    Sharding constraints themselves are not operators and are left out. In a `shard` region the
    main operator is its first `dot_general` (else its first operator). With a propagation
    `result`, every operator it decided carries its strategy (`origin="propagated"`, or `user`
    inside a `shard` region's forward pass).
    """
    by_scope = {a.scope: a for a in annotations}
    main: dict[str, Node] = {}
    for node in nodes:
        scope = _innermost(node.scope)
        if scope and not node.backward and node.primitive != "sharding_constraint":
            if scope not in main or (node.primitive == "dot_general" and main[scope].primitive != "dot_general"):
                main[scope] = node
    number = {}
    for i, node in enumerate(nodes):
        if node.primitive != "sharding_constraint":
            number[i] = len(number)
    records = []
    sizes = dict(zip(fine.names, fine.sizes))
    for i, node in enumerate(nodes):
        if i not in number:
            continue
        scope = _innermost(node.scope)
        ann = by_scope.get(scope)
        user = ann is not None and not node.backward
        fields = dict(origin="user" if user else "default", in_strategy=None, out_strategy=None, in_specs=None, out_specs=None)
        if ann is not None and main.get(scope) is node:
            fields.update(
                in_strategy=_strategy_tuple(ann.in_layouts), out_strategy=_strategy_tuple(ann.out_layouts),
                in_specs=_spec_tuple(ann.in_layouts, fine), out_specs=_spec_tuple(ann.out_layouts, fine),
            )
        decision = None if result is None else result.decisions.get(i)
        if decision is not None:
            n_in, n_out = len(node.inputs), len(node.outputs)
            ins, outs = decision.in_specs[:n_in], decision.out_specs[:n_out]
            if fields["in_strategy"] is None:
                fields.update(
                    in_strategy=tuple(_cuts(sp, sizes) for sp in ins), out_strategy=tuple(_cuts(sp, sizes) for sp in outs),
                    in_specs=tuple(map(to_pspec, ins)), out_specs=tuple(map(to_pspec, outs)),
                )
            fields.update(
                origin="user" if user else "propagated",
                comms=tuple((c.kind, c.bytes * node.weight, c.axes) for c in decision.comms),
                seconds=decision.seconds,
                via=_via(decision.via, number),
                rejected=_rejected(decision.rejected, n_out, sizes),
            )
        records.append(
            OpRecord(
                index=number[i], primitive=node.primitive, source=node.source,
                in_shapes=tuple(_shape(v) for v in node.inputs), out_shapes=tuple(_shape(v) for v in node.outputs),
                annotation=ann.name if ann is not None else "", backward=node.backward, inside=node.inside,
                ruled=result is None or i not in result.unruled, **fields,
            )
        )
    return tuple(records)


def _cuts(spec, sizes) -> Strategy:
    return tuple(math.prod(sizes[a] for a in axes) for axes in spec)


def _via(via: str, number: dict[int, int]) -> str:
    if via.isdigit():
        i = int(via)
        return str(number[i]) if i in number else "user"
    return via


def _rejected(rejected, n_out: int, sizes) -> str:
    if rejected is None:
        return ""
    specs, seconds = rejected
    return f"out_strategy {_strategies(tuple(_cuts(sp, sizes) for sp in specs[:n_out]))} at {seconds * 1e6:.2f} us"


def _innermost(scope: str) -> str:
    found = _SCOPE.findall(scope)
    return found[-1] if found else ""


def _shape(v) -> str:
    aval = v.aval
    dtype = getattr(aval, "dtype", None)
    name = "?" if dtype is None else dtype_str(dtype)
    return f"{name}[{','.join(map(str, getattr(aval, 'shape', ())))}]"


def _strategy_tuple(layouts: Sequence[TensorLayout | None]):
    return tuple(None if lay is None else lay.strategy for lay in layouts)


def _spec_tuple(layouts: Sequence[TensorLayout | None], fine: FineMesh):
    return tuple(None if lay is None else fine.partition_spec(lay) for lay in layouts)
