"""`Plan`: what jshard decided for every operator of a program, in a form a person can read."""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import Mesh, PartitionSpec

from jshard._context import Annotation
from jshard.layouts import FineMesh, Strategy, TensorLayout
from jshard.layouts._strategy import dtype_str
from jshard.propagate._audit import _human
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
    layout: tuple | None = None
    """For a propagated operator, `(operand specs, result specs, implied)` over the fine mesh, loop
    bodies included: what emission and `Plan.load` need to rebuild the same program."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """The parallel plan of one function for one input signature.

    Attributes:
      mesh: the one `jax.sharding.Mesh` the program runs on.
      fine: its axis sizes, as a `FineMesh`.
      mode: the `parallelize` mode.
      ops: one `OpRecord` per operator, in program order.
      in_shardings / out_shardings: the compiled program's argument and result shardings (pytrees;
        a loaded plan holds flat lists of `PartitionSpec`s).
      annotations: the `shard` calls met while tracing.
      propagation: `"jshard"` (the engine laid out every operator) or `"xla"` (Shardy did).
      lower: lowers the planned program (what `audit` compiles); None for a loaded plan or one made
        on an abstract mesh.
      search: how `mode="auto"` found the plan (a `SearchReport`), or None.
    """

    mesh: Mesh | None
    fine: FineMesh
    mode: str
    ops: tuple[OpRecord, ...]
    in_shardings: Any
    out_shardings: Any
    annotations: tuple[Annotation, ...] = ()
    propagation: str = "jshard"
    lower: Callable[[], Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    search: Any = dataclasses.field(default=None, compare=False)

    @property
    def device_count(self) -> int:
        return self.fine.device_count

    @property
    def coverage(self) -> float:
        """The share of operators a real sharding rule laid out (the rest stay replicated)."""
        return sum(op.ruled for op in self.ops) / len(self.ops) if self.ops else 1.0

    def predicted_bytes(self, kind: str | None = None) -> float:
        """Predicted collective payload bytes per device per call (the audit's convention)."""
        return sum(b for op in self.ops for k, b, _ in op.comms if kind is None or k == kind)

    def predicted(self) -> dict[str, float]:
        """`kind -> predicted bytes` for each kind of collective the plan expects."""
        out: dict[str, float] = collections.defaultdict(float)
        for op in self.ops:
            for k, b, _ in op.comms:
                out[k] += b
        return dict(out)

    def audit(self):
        """Compiles the planned program and reads what XLA emitted; `.compare` sets it against the
        prediction."""
        from jshard.propagate._audit import audit

        if self.lower is None:
            raise ValueError("Plan.audit: this plan has no program (it was loaded from a file); audit the "
                             "Parallelized function planned with it.")
        return audit(self.lower().compile())

    def compare(self, report) -> str:
        """Predicted against compiled collective bytes, per kind, from an `Audit` of this plan."""
        predicted, compiled = self.predicted(), {k: b for k, (_, b) in report.by_kind().items()}
        rows = [f"{'kind':<20}{'predicted':>12}{'compiled':>12}{'ratio':>8}"]
        for kind in sorted(set(predicted) | set(compiled)):
            p, c = predicted.get(kind, 0.0), compiled.get(kind, 0.0)
            rows.append(f"{kind:<20}{_human(p):>12}{_human(c):>12}{(p / c if c else float('nan')):>8.2f}")
        p, c = self.predicted_bytes(), report.bytes()
        rows.append(f"{'total':<20}{_human(p):>12}{_human(c):>12}{(p / c if c else float('nan')):>8.2f}")
        return "\n".join(rows)

    def summary(self) -> str:
        """The plan grouped by source line: per line, its operators, strategies and origins."""
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.fine.names, self.fine.sizes))
        origins = collections.Counter(op.origin for op in self.ops)
        lines = [
            f"Plan: {self.device_count} devices, mode={self.mode}, propagation={self.propagation}, mesh ({axes})",
            f"{len(self.ops)} operators: " + ", ".join(f"{origins[o]} {o}" for o in ORIGINS if origins[o])
            + f"; coverage {self.coverage:.1%}; predicted collectives {_human(self.predicted_bytes())} per device",
        ]
        if self.search is not None:
            lines.append(self.search.line())
        lines.append(_table(_by_line(self.ops)))
        return "\n".join(lines)

    def explain(self, op: OpRecord | int) -> str:
        """Why operator `op` (a record or its index) got its strategy: the anchor it came from, the
        chain of operators in between, the cost it paid and the best alternative it rejected."""
        from jshard.propagate._explain import explain

        return explain(self, op if isinstance(op, OpRecord) else self.ops[op])

    def save(self, path: str) -> None:
        """Writes the plan as JSON (MindSpore's strategy checkpoint); `parallelize(plan=Plan.load(path))`
        rebuilds the same program."""
        from jshard.propagate._plan_io import save

        save(self, path)

    @classmethod
    def load(cls, path: str) -> "Plan":
        """Reads a plan written by `save`."""
        from jshard.propagate._plan_io import load

        return load(path)

    def __str__(self) -> str:
        return self.summary()


def _by_line(ops: Sequence[OpRecord]) -> list[tuple]:
    """One row per (source line, pass): its operators, the strategy of its main one, its origins."""
    groups: dict[tuple[str, bool], list[OpRecord]] = {}
    for op in ops:
        groups.setdefault((op.source.split(" ")[0], op.backward), []).append(op)
    rows = []
    for (source, backward), members in groups.items():
        main = next((m for m in members if m.primitive == "dot_general" and m.in_strategy), None)
        main = main or next((m for m in members if m.in_strategy), members[0])
        kinds = collections.Counter(m.primitive for m in members)
        origins = collections.Counter(m.origin for m in members)
        comm = sum(b for m in members for _, b, _ in m.comms)
        rows.append((
            "/".join(source.split("/")[-2:]),
            "bwd" if backward else "fwd",
            ", ".join(f"{p}" + (f"×{c}" if c > 1 else "") for p, c in kinds.most_common(3)) + (" ..." if len(kinds) > 3 else ""),
            f"{main.primitive} {_strategies(main.in_strategy)} -> {_strategies(main.out_strategy)}",
            ", ".join(f"{c} {o}" for o, c in origins.items()),
            _human(comm) if comm else "-",
        ))
    return rows


def _table(rows: Sequence[tuple]) -> str:
    rows = [("source", "pass", "operators", "strategy", "origin", "comm")] + list(rows)
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
    `result`, every operator it decided carries its strategy (`origin="propagated"`, `searched`
    where the strategy search chose it, or `user` inside a `shard` region's forward pass).
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
    node_index = {id(n): i for i, n in enumerate(nodes)}
    stands_for = dict(number)  # a shard call's constraints stand for its main operator
    for i, node in enumerate(nodes):
        main_node = main.get(_innermost(node.scope))
        if i not in number and main_node is not None:
            stands_for[i] = number[node_index[id(main_node)]]
    records = []
    cuts = _cutter(dict(zip(fine.names, fine.sizes)))
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
                    in_strategy=tuple(map(cuts, ins)), out_strategy=tuple(map(cuts, outs)),
                    in_specs=tuple(map(to_pspec, ins)), out_specs=tuple(map(to_pspec, outs)),
                )
            fields.update(
                origin="user" if user else "searched" if decision.via == "searched" else "propagated",
                comms=tuple((c.kind, c.bytes * node.weight, c.axes) for c in decision.comms),
                seconds=decision.seconds,
                via=_via(decision.via, stands_for),
                rejected=_rejected(decision.rejected, n_in, n_out, cuts),
                layout=(decision.in_specs, decision.out_specs, decision.implied),
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


def _cutter(sizes):
    """`spec -> strategy tuple` over a mesh with axis `sizes`, memoized for one plan."""

    @functools.lru_cache(maxsize=None)
    def cuts(spec) -> Strategy:
        return tuple(math.prod(sizes[a] for a in axes) for axes in spec)

    return cuts


def _via(via: str, number: dict[int, int]) -> str:
    if via.isdigit():
        i = int(via)
        return str(number[i]) if i in number else "user"
    return via


def _rejected(rejected, n_in: int, n_out: int, cuts) -> str:
    if rejected is None:
        return ""
    ins, outs, seconds = rejected
    strategy = f"{_strategies(tuple(map(cuts, ins[:n_in])))} -> {_strategies(tuple(map(cuts, outs[:n_out])))}"
    return f"{strategy} at {seconds * 1e6:.8g} us"


def _innermost(scope: str) -> str:
    found = _SCOPE.findall(scope)
    return found[-1] if found else ""


_SHAPES: dict = {}


def _shape(v) -> str:
    aval = v.aval
    key = (getattr(aval, "shape", ()), getattr(aval, "dtype", None))
    found = _SHAPES.get(key)
    if found is None:
        found = _SHAPES[key] = _shape_str(aval)
    return found


def _shape_str(aval) -> str:
    dtype = getattr(aval, "dtype", None)
    name = "?" if dtype is None else dtype_str(dtype)
    return f"{name}[{','.join(map(str, getattr(aval, 'shape', ())))}]"


def _strategy_tuple(layouts: Sequence[TensorLayout | None]):
    return tuple(None if lay is None else lay.strategy for lay in layouts)


def _spec_tuple(layouts: Sequence[TensorLayout | None], fine: FineMesh):
    return tuple(None if lay is None else fine.partition_spec(lay) for lay in layouts)
