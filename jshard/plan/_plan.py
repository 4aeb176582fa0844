"""`Plan`: what jshard decided for every operator of a program, in a form a person can read."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard._context import Annotation
from jshard._errors import ShardingError, api_boundary
from jshard._format import human_bytes
from jshard.audit import Audit, audit
from jshard.layouts import FineMesh
from jshard.plan._explain import explain
from jshard.plan._io import read_fields, to_json, write_json
from jshard.plan._offload import HOST_MEMORY, OffloadReport
from jshard.plan._optimizer import OptimizerReport
from jshard.plan._records import ORIGINS, OpRecord, strategies_str
from jshard.search import SearchReport


@dataclasses.dataclass(frozen=True)
class Plan:
    """The parallel plan of one function for one input signature.

    Attributes:
      mesh: the one `jax.sharding.Mesh` the program runs on.
      fine: its axis sizes, as a `FineMesh`.
      mode: the `parallelize` mode.
      ops: one `OpRecord` per operator, in program order.
      in_specs / out_specs: the `PartitionSpec` of every argument and result leaf, flat in leaf
        order (a result XLA lays out: None); the pytree forms are `in_shardings` / `out_shardings`.
      in_tree / out_tree: the arguments' and results' tree structures; None for a loaded plan.
      annotations: the `shard` calls met while tracing.
      propagation: `"jshard"` (the engine laid out every operator) or `"xla"` (Shardy did).
      lower: lowers the planned program (what `audit` compiles); None for a loaded plan or one made
        on an abstract mesh.
      search: how `mode="auto"` found the plan (a `SearchReport`), or None.
      optimizer: what optimizer parallel cut (an `OptimizerReport`), or None.
      offload: the state kept in host memory and the bytes streamed per step (an `OffloadReport`),
        or None.
    """

    mesh: Mesh | None
    fine: FineMesh
    mode: str
    ops: tuple[OpRecord, ...]
    in_specs: tuple[PartitionSpec, ...]
    out_specs: tuple[PartitionSpec | None, ...]
    in_tree: jax.tree_util.PyTreeDef | None = None
    out_tree: jax.tree_util.PyTreeDef | None = None
    annotations: tuple[Annotation, ...] = ()
    propagation: str = "jshard"
    lower: Callable[[], Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    search: SearchReport | None = dataclasses.field(default=None, compare=False)
    optimizer: OptimizerReport | None = dataclasses.field(default=None, compare=False)
    offload: OffloadReport | None = dataclasses.field(default=None, compare=False)

    @property
    def device_count(self) -> int:
        return self.fine.device_count

    @property
    def in_shardings(self) -> Any:
        """The compiled program's argument shardings, a pytree of `NamedSharding`s like the arguments
        (memory kind `pinned_host` where `offload` keeps a leaf in host memory)."""
        return self._shardings("in_shardings", self.in_tree, self.in_specs)

    @property
    def out_shardings(self) -> Any:
        """The result shardings, a pytree like the results (None where XLA chooses)."""
        return self._shardings("out_shardings", self.out_tree, self.out_specs)

    def _shardings(self, what: str, tree, specs) -> Any:
        if tree is None or self.mesh is None:
            raise ShardingError(
                f"jshard.Plan.{what}: a Plan read back by Plan.load keeps its shardings flat (in_specs / "
                f"out_specs), not the arguments' tree or a mesh; plan the function (parallelize(fn, "
                f"plan=Plan.load(path)).plan(*args)) for its shardings."
            )
        host = () if self.offload is None else self.offload.args if what == "in_shardings" else self.offload.results
        return jax.tree_util.tree_unflatten(tree, [None if s is None else NamedSharding(
            self.mesh, s, memory_kind=HOST_MEMORY if i in host else None) for i, s in enumerate(specs)])

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

    @api_boundary
    def audit(self) -> Audit:
        """Compiles the planned program and reads what XLA emitted; `.compare` sets it against the
        prediction."""
        if self.lower is None:
            raise ValueError("Plan.audit: this plan has no program (it was loaded from a file); audit the "
                             "Parallelized function planned with it.")
        return audit(self.lower().compile())

    def compare(self, report: Audit) -> str:
        """Predicted against compiled collective bytes, per kind, from an `Audit` of this plan."""
        predicted, compiled = self.predicted(), {k: b for k, (_, b) in report.by_kind().items()}
        rows = [f"{'kind':<20}{'predicted':>12}{'compiled':>12}{'ratio':>8}"]
        for kind in sorted(set(predicted) | set(compiled)):
            p, c = predicted.get(kind, 0.0), compiled.get(kind, 0.0)
            rows.append(f"{kind:<20}{human_bytes(p):>12}{human_bytes(c):>12}{(p / c if c else float('nan')):>8.2f}")
        p, c = self.predicted_bytes(), report.bytes()
        rows.append(f"{'total':<20}{human_bytes(p):>12}{human_bytes(c):>12}{(p / c if c else float('nan')):>8.2f}")
        return "\n".join(rows)

    def summary(self) -> str:
        """The plan grouped by source line: per line, its operators, strategies and origins."""
        axes = ", ".join(f"{n}={s}" for n, s in zip(self.fine.names, self.fine.sizes))
        origins = collections.Counter(op.origin for op in self.ops)
        lines = [
            f"Plan: {self.device_count} devices, mode={self.mode}, propagation={self.propagation}, mesh ({axes})",
            f"{len(self.ops)} operators: " + ", ".join(f"{origins[o]} {o}" for o in ORIGINS if origins[o])
            + f"; coverage {self.coverage:.1%}; predicted collectives {human_bytes(self.predicted_bytes())} per device",
        ]
        if self.search is not None:
            lines.append(self.search.line())
        if self.optimizer is not None:
            lines.append(self.optimizer.line())
        if self.offload is not None:
            lines.append(self.offload.line())
        lines.append(_table(_by_line(self.ops)))
        return "\n".join(lines)

    @api_boundary
    def explain(self, op: OpRecord | int) -> str:
        """Why operator `op` (a record or its index) got its strategy: the anchor it came from, the
        chain of operators in between, the cost it paid and the best alternative it rejected."""
        return explain(self, op if isinstance(op, OpRecord) else self.ops[op])

    def save(self, path: str | os.PathLike) -> None:
        """Writes the plan as JSON (MindSpore's strategy checkpoint; format in `jshard/plan/_io.py`);
        `parallelize(plan=Plan.load(path))` rebuilds the same program. The file is replaced
        atomically: a crash mid-save leaves the previous one."""
        write_json(to_json(self), path)

    @classmethod
    @api_boundary
    def load(cls, path: str | os.PathLike) -> "Plan":
        """Reads a plan written by `save` (JSON only: nothing in the file is executed).

        Raises:
          ShardingError: the file is not a plan `save` wrote (not JSON, cut short, another format,
            hand-edited keys, types or axis names), naming the file and what is wrong.
        """
        return load(path, f"jshard.Plan.load({os.fspath(path)!r})")

    def __str__(self) -> str:
        return self.summary()


def load(path: str | os.PathLike, call: str) -> Plan:
    """`Plan.load`, its errors naming `call` (the public call that read the file)."""
    return Plan(mesh=None, **read_fields(path, call))


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
            f"{main.primitive} {strategies_str(main.in_strategy)} -> {strategies_str(main.out_strategy)}",
            ", ".join(f"{c} {o}" for o, c in origins.items()),
            human_bytes(comm) if comm else "-",
        ))
    return rows


def _table(rows: Sequence[tuple]) -> str:
    rows = [("source", "pass", "operators", "strategy", "origin", "comm")] + list(rows)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
