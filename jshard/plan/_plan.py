"""`Plan`: what jshard decided for every operator of a program, in a form a person can read."""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard._collector import collector_paused
from jshard._context import Annotation
from jshard._errors import ShardingError, api_boundary
from jshard._format import human_bytes
from jshard.audit import Audit, audit
from jshard.layouts import FineMesh
from jshard.plan._communication import CommunicationReport
from jshard.plan._explain import explain
from jshard.plan._io import read_fields, to_json, write_json
from jshard.plan._offload import HOST_MEMORY, OffloadReport
from jshard.plan._optimizer import OptimizerReport
from jshard.plan._peer import PeerReport
from jshard.plan._recompute import RecomputeReport
from jshard.plan._records import OpRecord
from jshard.plan._slices import RankSlices, rank_slices
from jshard.plan._summary import WIDTH, summary_html, summary_renderable, summary_text
from jshard.plan._work import WorkReport
from jshard.search import SearchReport


class Later:
    """A `Plan` field given as the function that makes it: made on the first read of the field, so
    a caller that needs only the shardings never pays for it (`Plan.ops` at depth)."""

    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]):
        self.make = make


class _Lazy:
    """A frozen dataclass field that may hold a `Later`, made (once) when the field is first read.
    Raises AttributeError on the class: the field has no default."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            raise AttributeError(self.name)
        value = obj.__dict__[self.name]
        if isinstance(value, Later):
            with collector_paused():  # records by the ten thousand, all kept
                value = obj.__dict__[self.name] = value.make()
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.name] = value


@dataclasses.dataclass(frozen=True)
class Plan:
    """The parallel plan of one function for one input signature.

    Attributes:
      mesh: the one `jax.sharding.Mesh` the program runs on.
      fine: its axis sizes, as a `FineMesh`.
      mode: the `parallelize` mode.
      ops: one `OpRecord` per operator, in program order (a planned program's are made on the
        first read of `ops`: `Parallelized.plan` callers that read only shardings never pay for them).
      in_specs / out_specs: the `PartitionSpec` of every argument and result leaf, flat in leaf
        order (a result XLA lays out: None); the pytree forms are `in_shardings` / `out_shardings`.
      in_tree / out_tree: the arguments' and results' tree structures; None for a loaded plan.
      annotations: the `shard` calls met while tracing.
      propagation: `"jshard"` (the engine laid out every operator) or `"xla"` (Shardy did).
      lower: lowers the planned program (what `audit` compiles); None for a loaded plan or one made
        on an abstract mesh.
      search: how `mode="auto"` found the plan (a `SearchReport`), or None.
      optimizer: what optimizer parallel cut (an `OptimizerReport`), or None.
      recompute: the recompute regions and the predicted peak with and without them (a
        `RecomputeReport`), or None where the program recomputes nothing (or was loaded).
      offload: the state kept in host memory and the bytes streamed per step (an `OffloadReport`),
        or None.
      communication: with `parallelize(..., communication=...)`, the copies, the gradients' buckets,
        the XLA options compiled with and their memory (a `CommunicationReport`), or None.
      work: the share of the single-device work each device does and, where it is nearly all of
        it, the data-parallel plan's predicted time beside this plan's (a `WorkReport`); None
        where XLA propagates, or for a loaded plan.
      peer: with `propagation="best"`, jshard's compiled plan against Shardy's from the same
        anchors and which one runs (a `PeerReport`), or None where they were not weighed.
      round_trip: bytes per device (the busiest device's) a training loop moves between two calls
        to place the results that update arguments (result `k` of argument `k`'s structure,
        shapes and dtypes: `(params, state, batch) -> (params, state, loss)`) where the plan
        returns them in other layouts than it takes them; 0.0 where it returns each as taken;
        None for a loaded plan or one on an abstract mesh. `jshard.audit.moved_bytes` measures the
        same in a running loop.
      loaded_choices: a loaded plan's `choices`, as its file holds them (`Plan.load` sets it).
      choices (property): what the planning chose beyond the layouts that rebuilding the program needs, as
        `(name, value)` pairs: `("copies", n)` where the step's batch runs in n > 1 copies
        (multi-copy), `("offload", roles)` where state is kept in host memory, `("context", n)` where
        the search cut the sequence of `jshard.attention` calls without a strategy n ways. `save` writes them
        and `parallelize(plan=Plan.load(path))` rebuilds with them (`parallelize`'s `communication=`
        and `offload=` may repeat them, not contradict them).
    """

    mesh: Mesh | None
    fine: FineMesh
    mode: str
    ops: tuple[OpRecord, ...] = _Lazy()  # type: ignore[assignment]
    in_specs: tuple[PartitionSpec, ...]
    out_specs: tuple[PartitionSpec | None, ...]
    in_tree: jax.tree_util.PyTreeDef | None = None
    out_tree: jax.tree_util.PyTreeDef | None = None
    annotations: tuple[Annotation, ...] = ()
    propagation: str = "jshard"
    lower: Callable[[], Any] | None = dataclasses.field(default=None, repr=False, compare=False)
    search: SearchReport | None = dataclasses.field(default=None, compare=False)
    optimizer: OptimizerReport | None = dataclasses.field(default=None, compare=False)
    recompute: RecomputeReport | None = dataclasses.field(default=None, compare=False)
    offload: OffloadReport | None = dataclasses.field(default=None, compare=False)
    work: WorkReport | None = dataclasses.field(default=None, compare=False)
    communication: CommunicationReport | None = dataclasses.field(default=None, compare=False)
    peer: PeerReport | None = dataclasses.field(default=None, compare=False)
    round_trip: float | None = dataclasses.field(default=None, compare=False)
    loaded_choices: tuple[tuple[str, Any], ...] = dataclasses.field(default=(), compare=False, repr=False)

    @property
    def choices(self) -> tuple[tuple[str, Any], ...]:
        """See the class docstring: a planned program's from its reports, a loaded plan's from its file."""
        if self.loaded_choices:
            return self.loaded_choices
        made: list[tuple[str, Any]] = []
        if self.communication is not None and self.communication.copies > 1:
            made.append(("copies", self.communication.copies))
        if self.offload is not None and self.offload.what:
            made.append(("offload", tuple(self.offload.what)))
        if self.search is not None and (self.search.context_cut or 1) > 1:
            made.append(("context", self.search.context_cut))
        return tuple(made)

    def replace(self, **changes) -> "Plan":
        """`dataclasses.replace(self, **changes)` that leaves `ops` not yet made unmade."""
        return dataclasses.replace(self, **{"ops": self.__dict__["ops"], **changes})

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

    def summary(self, width: int = WIDTH, limit: int | None = None) -> str:
        """The plan grouped by source line, as text no wider than `width` columns: per line and pass, its
        operators, what their strategies do, their origins and predicted collective bytes (the first
        `limit` lines, None: all). `rich.print(plan)` draws the same table in colour, and a notebook
        shows it as an HTML table (`_repr_html_`)."""
        return summary_text(self, width, limit)

    def __rich__(self):
        return summary_renderable(self)

    def _repr_html_(self) -> str:
        return summary_html(self)

    @api_boundary
    def explain(self, op: OpRecord | int) -> str:
        """Why operator `op` (a record or its index) got its strategy: the anchor it came from, the
        chain of operators in between, the cost it paid and the best alternative it rejected."""
        return explain(self, op if isinstance(op, OpRecord) else self.ops[op])

    @api_boundary
    def slices(self, op: OpRecord | int) -> RankSlices:
        """Per rank, which slice of each operand and result of operator `op` (a record or its index) it
        holds, as index ranges (`0:4, :`): MindSpore's per-rank strategies. `print` it, or leave it last
        in a notebook cell (an HTML table). `jshard.visualize` draws one array's slices as a grid."""
        return rank_slices(self, op if isinstance(op, OpRecord) else self.ops[op])

    def save(self, path: str | os.PathLike) -> None:
        """Writes the plan as JSON (MindSpore's strategy checkpoint; format in `jshard/plan/_io.py`)
        with a digest of its content; `parallelize(plan=Plan.load(path))` rebuilds the same program.
        The file is replaced atomically: a crash mid-save leaves the previous one."""
        write_json(to_json(self), path)

    @classmethod
    @api_boundary
    def load(cls, path: str | os.PathLike, *, strict: bool = False) -> "Plan":
        """Reads a plan written by `save` (JSON only: nothing in the file is executed).

        Args:
          path: the file.
          strict: refuse a file whose content no longer matches the digest `save` wrote into it
            (edited since), or that holds none, rather than warn.

        Raises:
          ShardingError: the file is missing or not a plan `save` wrote (not JSON, cut short,
            another format, hand-edited keys, types or axis names), naming the file and what is
            wrong; with `strict`, it was edited since it was saved.

        Warns:
          PlanEditedWarning: the file was edited since it was saved (its layouts may not be the
            ones the search chose; the program follows the file).
        """
        return load(path, f"jshard.Plan.load({os.fspath(path)!r})", strict)

    def __str__(self) -> str:
        return self.summary()


def load(path: str | os.PathLike, call: str, strict: bool = False) -> Plan:
    """`Plan.load`, its errors naming `call` (the public call that read the file)."""
    return Plan(mesh=None, **read_fields(path, call, strict))
