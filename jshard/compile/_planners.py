"""The planning stage: one `Planner` contract, four planners.

As Alpa's `ParallelMethod` makes every parallel method one contract, every way jshard lays out the
operators no strategy fixes is a `Planner`: given the traced program and its fixed anchors it
returns a `Planned` (the engine's `Result`, or None where XLA's Shardy propagates). The compile core
picks one per `Options` (`planner_for`) and treats them alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding

from jshard._errors import ShardingError
from jshard._format import var_str
from jshard.compile._fusion import combines
from jshard.compile._options import Options
from jshard.compile._trace import Traced
from jshard.cost import Comm
from jshard.graph import CONSTRAINT, Node, operand_vars
from jshard.hetero import Offload
from jshard.layouts import FineMesh, constraint_spec, replicated, spec_from_pspec
from jshard.plan import Plan
from jshard.propagate import Decision, Result, propagate_globally
from jshard.rules import shape_of
from jshard.search import Memo, SearchReport, search


@dataclasses.dataclass(frozen=True)
class Problem:
    """What a planner plans: the traced program, the argument shardings fixed before planning
    (None: the planner decides), which argument leaves are donated, the memory budget, the state
    kept in host memory between steps (`Offload`, or None), values made in the program whose
    layout is fixed too (value -> `Spec`: a gradient jshard reduce-scatters itself), the argument
    leaves whose fixed layout is the default dataset cut or a lone strategy tuple, which the program
    may move once at the start (`dataset_defaulted`), the batch's argument leaves (`batch`: the search's data-parallel
    and fully-sharded seeds cut their rows), whether the search weighs its seeds (`seeded`: the plan
    propagated from the anchors, and those plans around them; off once a kept seed's compiled
    program has not fit the budget), which seed it returns as made (`as_seeded`: its status, for
    its compiled program to be held to the budget instead of the search's estimate; None: it
    searches), and whether the compiled program is held to the budget (`compiled`: where no plan
    fits the search's estimate, the cheapest seed is returned as made)."""

    traced: Traced
    in_shardings: Sequence[NamedSharding | None]
    donated: frozenset[int]
    budget: float | None
    offload: Offload | None = None
    made: Mapping = dataclasses.field(default_factory=dict)
    movable: frozenset[int] = frozenset()
    batch: frozenset[int] = frozenset()
    seeded: bool = True
    as_seeded: str | None = None
    compiled: bool = False

    @property
    def host(self) -> frozenset:
        """The argument and result values kept in host memory between steps."""
        if self.offload is None:
            return frozenset()
        t = self.traced
        return frozenset([t.invars[i] for i in self.offload.args] + [t.outvars[o] for o in self.offload.results
                                                                     if isinstance(t.outvars[o], jcore.Var)])

    @property
    def fixed(self) -> dict:
        """Value -> `Spec`, for the arguments whose layout is fixed, and `made`."""
        return {**{v: constraint_spec(sh, len(np.shape(x)))
                   for v, sh, x in zip(self.traced.invars, self.in_shardings, self.traced.leaves) if sh is not None},
                **self.made}


@dataclasses.dataclass(frozen=True)
class Planned:
    """A planner's answer: the engine's `Result` (None: XLA propagates), argument shardings it
    fixes itself (None entries: unchanged), and the search's report."""

    result: Result | None
    in_shardings: Sequence[NamedSharding | None] | None = None
    report: SearchReport | None = None


class Planner(Protocol):
    """Lays out the operators of one traced program."""

    def plan(self, problem: Problem) -> Planned: ...


@dataclasses.dataclass(frozen=True)
class XlaPlanner:
    """Shardy propagates from the anchors (`propagation="xla"`, and `mode="manual"`)."""

    def plan(self, problem: Problem) -> Planned:
        return Planned(None)


@dataclasses.dataclass(frozen=True)
class PropagationPlanner:
    """jshard's propagation engine (MindSpore's `sharding_propagation`), its free arguments' and
    movable batch's layouts chosen for the whole program (`propagate_globally`)."""

    options: Options

    def plan(self, problem: Problem) -> Planned:
        t = problem.traced
        anchors = {**t.typed(), **problem.fixed}
        free = [v for v in t.invars if v not in anchors]
        movable = [t.invars[i] for i in problem.movable]
        return Planned(propagate_globally(t.nodes, anchors, free, t.axis_size, self.options.costs,
                                          outputs=t.outvars, movable=movable, table=t.table))


@dataclasses.dataclass(frozen=True)
class SearchPlanner:
    """The strategy search (`mode="auto"`, `search="recursive"` or `"ilp"`); `time_left`: the seconds
    a search may take given `Search.time_limit` (the planning session's deadline: `Planning.time_left`);
    `passed`: whether that deadline has passed (the recursive search then stops weighing once a plan
    fits); `check`: read between the search's units of work, raises where the planning stops the
    plan searched (`Planning.check`); `memo`: the session's store, where the searches keep their
    seeds' propagations (`Planning.kept`)."""

    options: Options
    call: str
    time_left: Callable[[float], float] | None = None
    passed: Callable[[], bool] | None = None
    check: Callable[[], None] | None = None
    memo: Memo | None = None

    def plan(self, problem: Problem) -> Planned:
        t, c = problem.traced, self.options
        consts = list(t.closed.jaxpr.constvars)
        fixed = {**problem.fixed, **{v: replicated(len(v.aval.shape)) for v in consts}}
        donated = frozenset(t.invars[i] for i in problem.donated)
        names = {v: f"args{p}" for v, p in zip(t.invars, t.paths)}
        limit = c.search.time_limit if self.time_left is None else self.time_left(c.search.time_limit)
        result, report = search(t.nodes, list(t.invars) + consts, t.outvars, fixed, t.axis_size, how=c.search.method,
                                cost=c.costs, budget=problem.budget, donated=donated, host=problem.host, names=names,
                                call=self.call, time_limit=limit, replay=c.search.replay,
                                table=t.table, batch=[t.invars[i] for i in sorted(problem.batch)],
                                seeded=problem.seeded, as_seeded=problem.as_seeded,
                                compiled=problem.compiled, combined=combines(c.communication), passed=self.passed,
                                check=self.check, memo=self.memo,
                                ranges=t.live_ranges(list(t.invars) + consts, donated, problem.host))
        return Planned(result, report=report)


@dataclasses.dataclass(frozen=True)
class LoadedPlanner:
    """A `Plan` read back by `Plan.load`, checked against the traced program operator by operator."""

    plan_: Plan
    call: str

    def plan(self, problem: Problem) -> Planned:
        t = problem.traced
        result = result_from_plan(self.plan_, t.nodes, t.invars, t.fine, self.call)
        given = [None if p is None else NamedSharding(t.mesh, p) for p in self.plan_.in_specs]
        return Planned(result, in_shardings=given)


def planner_for(options: Options, call: str, time_left: Callable[[float], float] | None = None,
                passed: Callable[[], bool] | None = None, check: Callable[[], None] | None = None,
                memo: Memo | None = None) -> Planner:
    """The planner `options` ask for (`time_left`, `passed`, `check`, `memo`: the search's,
    `SearchPlanner`'s)."""
    if options.mode == "manual" or options.propagation == "xla":
        return XlaPlanner()
    if options.plan is not None:
        return LoadedPlanner(options.plan, call)
    if options.searching:
        return SearchPlanner(options, call, time_left, passed, check, memo)
    return PropagationPlanner(options)


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
    if len(plan.in_specs) != len(invars):
        raise ShardingError(f"{call}: the loaded plan has {len(plan.in_specs)} arguments, this call "
                            f"{len(invars)}. Load the plan saved for this function, or re-plan without plan=.")
    for i, (node, op) in enumerate(zip(ops, plan.ops)):
        here = (node.primitive, tuple(map(var_str, node.inputs)), tuple(map(var_str, node.outputs)))
        if here != (op.primitive, op.in_shapes, op.out_shapes):
            raise ShardingError(_mismatch(call, i, op, here, node))
    if len(ops) != len(plan.ops):
        raise ShardingError(f"{call}: the loaded plan has {len(plan.ops)} operators, this function "
                            f"{len(ops)} (the first {min(len(ops), len(plan.ops))} match). Load the plan "
                            f"saved for this function, or re-plan without plan=.")
    values, decisions = {}, {}
    for v, spec in zip(invars, plan.in_specs):
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
