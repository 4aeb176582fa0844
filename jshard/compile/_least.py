"""The fewest seconds per step any plan of a traced program predicts: what no search of it can beat.

The search prices a plan (`SearchGraph.seconds`) as the makespan of its operators' compute, run one
after another on each device, and its collectives, each of which waits at least the latency of
its mesh axes. So a plan that runs any collective takes at least the least latency of the mesh,
and one that runs none takes at least its compute. Without a collective no value is gathered: where
an operator takes a dimension of a value whole, every maker of that value for it makes the
dimension whole; a factor whose cut leaves partial sums is never cut; and a result paired with the
argument it becomes at the next call (a train step's parameters) is made as that argument is laid
out. Following these rules back from the operators that take their operands whole (a loss reduced
to a scalar, an operator with no rule) finds the operators no plan without collectives can cut;
the others' compute is split over every device. The weighing of copies (`_weigh_communication`)
reads the bound to leave out a copy count that cannot beat the plan it holds.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

from jax.extend import core as jcore

from jshard.compile._trace import Traced
from jshard.cost import CostModel, paired
from jshard.graph import CONSTRAINT
from jshard.layouts import constraint_spec
from jshard.propagate import MANUAL
from jshard.rules import Factors, shape_of
from jshard.search import unit_components


@dataclasses.dataclass(frozen=True, slots=True)
class Least:
    """The fewest seconds per call any plan of a traced program predicts (`least_step`).

    Attributes:
      latency: the least a plan that runs a collective takes: the lowest latency of a mesh axis.
      compute: the least a plan that runs none takes: the compute of the operators such a plan
        cannot cut, and the others' split over every device.
      whole: how many operators no plan without a collective can cut.
    """

    latency: float
    compute: float
    whole: int

    @property
    def seconds(self) -> float:
        """The bound: the lesser of the two kinds of plan's."""
        return min(self.latency, self.compute)


def least_step(traced: Traced, cost: CostModel) -> Least:
    """The `Least` seconds per call of every plan the search can make of `traced` on `cost`.

    A program with a manual region (`shard_map`), whose work is its body's as written, is given no
    bound (compute 0)."""
    nodes, table, axis = traced.nodes, traced.table, traced.axis_size
    latency = min((cost.axes.get(a, (cost.bandwidth, cost.latency))[1] for a, n in axis.items() if n > 1), default=0.0)
    if any(n.primitive == MANUAL for n in nodes):
        return Least(latency, 0.0, 0)
    blocked = _blocked(traced)
    traffic = table.traffic(traced.outvars) if cost.memory_bandwidth else {}
    devices, compute, whole = math.prod(axis.values()), 0.0, 0
    for i, f in table.factors.items():
        if i in table.unruled or nodes[i].primitive == CONSTRAINT:
            continue
        units = unit_components(f)
        own = units[0][0] if units else ()  # the factors the unit doing the work cuts
        uncut = all(g in blocked[i] for g in own)
        whole += uncut
        moved = traffic.get(i, 0.0) if own else 0.0  # the search prices a unit that cuts nothing at its flops
        if f.flops or moved:
            seconds = nodes[i].weight * cost.compute_seconds(f.flops, moved, i in table.matmul)
            compute += seconds if uncut else seconds / devices
    return Least(latency, compute, whole)


def _blocked(traced: Traced) -> dict[int, set[int]]:
    """Per operator with a rule, its factors no plan without a collective cuts (`least_step`)."""
    walk = _Walk(traced)
    for i, node in enumerate(traced.nodes):
        walk.seed(i, node)
    walk.run()
    return walk.blocked


class _Walk:
    """The dims taken whole followed back to their makers, as the search links values (`SearchGraph`'s
    edges: a use reads the nearest maker before it; a result that becomes an argument, the last)."""

    def __init__(self, traced: Traced) -> None:
        nodes, table = traced.nodes, traced.table
        self.table = table
        args = [v for v in [*traced.invars, *traced.closed.jaxpr.constvars] if _valued(v)]
        self.makers: dict = defaultdict(list)  # value -> [(node, or -1 for an argument; result position)]
        for v in args:
            self.makers[v].append((-1, 0))
        for i in range(len(nodes)):
            for p, v in enumerate(table.vars[i][1]):
                self.makers[v].append((i, p))
        self.state = defaultdict(list)  # argument -> the results that become it at the next call
        for v, arg in paired(args, traced.outvars, lambda v: True, lambda v: _valued(v) and v in self.makers):
            self.state[arg].append(v)
        self.ruled = {
            i: f for i, f in table.factors.items() if i not in table.unruled and nodes[i].primitive != CONSTRAINT
        }
        self.blocked = {i: {g for g, n in enumerate(f.sizes) if n <= 1} for i, f in self.ruled.items()}
        self.work: list = []  # (value, dim, its maker): the maker makes the dim whole
        self.done: set = set()

    def seed(self, i: int, node) -> None:
        """The dims operator `i` takes whole whatever the plan: every operand's where it has no rule,
        its input's where a sharding constraint's spec leaves them whole, and those of its factors
        left uncut; and its factors whose cut leaves partial sums on a result (the search prices
        their all-reduce)."""
        ins, f = self.table.vars[i][0], self.ruled.get(i)
        if f is None:
            constraint = node.primitive == CONSTRAINT
            if not constraint and i not in self.table.unruled:
                return
            for p, v in enumerate(ins[:1] if constraint else ins):
                spec = constraint_spec(node.eqn.params["sharding"], len(shape_of(v))) if constraint else None
                for d in range(len(shape_of(v)) if _valued(v) else 0):
                    if spec is None or not spec[d]:
                        self.taken_whole(i, p, d)
            return
        for p, dims in enumerate(f.inputs):
            for d, facs in enumerate(dims):
                if all(h in self.blocked[i] for h in facs):
                    self.taken_whole(i, p, d)
        for g in f.reduced:
            if f.sizes[g] > 1 and _summed(f, g):
                self.block(i, g)

    def taken_whole(self, i: int, p: int, d: int) -> None:
        """Operator `i` takes its input `p`'s dim `d` whole: the maker it reads must make it so."""
        v = self.table.vars[i][0][p]
        if _valued(v) and v in self.makers:
            found = self.makers[v]
            self.work.append((v, d, next((m for m in reversed(found) if m[0] < i), found[0])))

    def block(self, i: int, g: int) -> None:
        """Factor `g` of operator `i` is cut by no plan without a collective: the input dims it
        makes with other such factors alone are taken whole."""
        if g in self.blocked[i]:
            return
        self.blocked[i].add(g)
        for p, dims in enumerate(self.ruled[i].inputs):
            for d, facs in enumerate(dims):
                if g in facs and all(h in self.blocked[i] for h in facs):
                    self.taken_whole(i, p, d)

    def run(self) -> None:
        """Follows every dim taken whole back to its maker until none is left."""
        while self.work:
            item = self.work.pop()
            if item in self.done:
                continue
            self.done.add(item)
            v, d, (m, q) = item
            if m < 0:  # an argument laid out whole on d: the results that become it are made so
                self.work += [(r, d, self.makers[r][-1]) for r in self.state.get(v, ())]
            elif m in self.ruled:
                for g in self.ruled[m].outputs[q][d]:
                    self.block(m, g)


def _valued(v) -> bool:
    """Whether `v` is a variable with a shape: a value an edge of the search carries."""
    return isinstance(v, jcore.Var) and bool(shape_of(v))


def _summed(f: Factors, g: int) -> bool:
    """Whether cutting reduced factor `g` leaves partial sums the search prices: its unit lays out a
    result."""
    return any(g in facs and any(p >= len(f.inputs) for p in positions) for facs, positions in unit_components(f))
