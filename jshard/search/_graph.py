"""The graph both strategy searches choose over (`search="recursive"` and `search="ilp"`).

A *unit* is one decision. An operator's factors that share operands form one unit (a matrix
product is one; a loop is one per value it carries or stacks, since those are independent); an
argument whose layout is not fixed is a unit whose factors are its dims; a sharding constraint and
a fixed argument are units with one candidate. A *candidate* gives each mesh-axis group of the
search one of the unit's factors, or none (axes given to one factor are concatenated, major first),
and every operand's `Spec` follows from it as in propagation.

Costs are the engine's (`CostModel`, α–β seconds): a unit pays its partial sums and its compute per
device, weighted by how often it runs; an *edge* (a value from the unit that makes it to one that
uses it) pays the redistribution between the two layouts it is given. XLA's all-reduce combiner
merges independent all-reduces of one computation (the top level, or one loop body per iteration)
over the same mesh axes with the same reduction into one: a unit whose partial sums no later
reduction of its computation depends on (a weight gradient's, ahead of the optimizer's elementwise
update) is *combinable*, pays its all-reduces' bandwidth alone, and the plan pays one latency per
set of them (`SearchGraph.combined_latency`); the others pay each all-reduce's latency, as a chain
of dependent all-reduces (a Megatron layer's) runs one after another. Memory is per device: at each
top-level program point, the arguments, the function's results and every value made before the point
and used after it (activations kept for the backward pass, gradients awaiting the update), and at a
loop's point its body's own peak (`jshard.cost.LiveRanges`), each value at its local size under the
layout chosen for it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from jax.extend import core as jcore

from jshard.cost import (
    Comm,
    CostModel,
    LiveRanges,
    Timeline,
    array_of,
    live_ranges,
    local_bytes,
    paired,
    redistribution,
    slice_counter,
    value_bytes,
)
from jshard.graph import CONSTRAINT, NESTED, Node
from jshard.layouts import Spec, constraint_spec
from jshard.propagate import MANUAL, manual_comms, manual_flops, manual_seconds, manual_specs
from jshard.rules import FUSION, Factors, OpTable, expressible, shape_of, write_spec
from jshard.search._joins import Joins
from jshard.search._units import Assignment, Edge, Group, Unit, unit_components

_NOT_SUMS = frozenset({"reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "argmax", "argmin"})
"""The reductions whose partial results an all-reduce other than a sum combines (XLA combines all-reduces
of one reduction only)."""

TIE = 1e-18
"""Seconds per byte held at the peak, added to every plan's cost: between plans of equal cost, the
searches take the one that holds less."""


REPLICATED_SHARE = 0.9
"""The work share per device (`SearchGraph.work_share`, `WorkReport.share`) from which a plan cuts
(nearly) nothing: every device computes (nearly) the whole batch."""


@dataclasses.dataclass(frozen=True)
class Solved:
    """A search's answer: a choice per unit, its predicted seconds per call, its estimated per-device
    peak and how the search ended; the recursive search's work (`SearchReport.unit_classes`,
    `SearchReport.evaluations`, `SearchReport.runs`), None for the ILP."""

    choice: list[Assignment]
    seconds: float
    peak: float
    status: str
    unit_classes: int | None = None
    evaluations: int | None = None
    runs: int | None = None


class Infeasible(Exception):
    """No choice the search finds fits the memory budget."""


class SearchGraph:
    """Units, edges and the memory model of one traced program on a mesh with `axis_size`."""

    def __init__(self, nodes: Sequence[Node], args: Sequence, outvars: Sequence, fixed: Mapping,
                 axis_size: Mapping[str, int], cost: CostModel | None = None, donated: frozenset = frozenset(),
                 host: frozenset = frozenset(), table: OpTable | None = None, combined: bool = True,
                 ranges: LiveRanges | None = None):
        self.nodes, self.axis_size, self.outvars = nodes, dict(axis_size), outvars
        self.cost = cost or CostModel()
        self.table = table or OpTable(nodes)
        self.units: list[Unit] = []
        self.arg_unit: dict = {}
        self.node_units: dict[int, list[int]] = collections.defaultdict(list)
        self._traffic = self.table.traffic(outvars) if self.cost.memory_bandwidth else {}
        for v in args:
            self._add_arg(v, fixed.get(v))
        for i, node in enumerate(nodes):
            self._add_node(i, node)
        self.combinable = self._combinable() if combined else frozenset()  # the combiner off: each pays its own
        self.peers: dict[tuple, list[int]] = collections.defaultdict(list)  # (loop, reduction) -> its combinable units
        for k in sorted(self.combinable):
            self.peers[self.set_key(k)].append(k)
        self.edges = self._edges() + self._state_edges(args, outvars)
        self.out_edges: dict[int, list[int]] = collections.defaultdict(list)
        self.in_edges: dict[int, list[int]] = collections.defaultdict(list)
        out_edges, in_edges = self.out_edges, self.in_edges
        for k, (_, src, dst, _) in enumerate(self.edges):
            out_edges[src[0]].append(k)
            in_edges[dst[0]].append(k)
        self.shape_of_unit = self._signatures()
        self._specs: dict = {}
        self._moves: dict = {}
        self._comms: dict = {}
        self._cands: dict = {}
        self._merged: dict[int, list] = {}  # unit -> its operands' dims made of several factors
        self._memory_model(args, outvars, donated, host, ranges)

    # -- units -------------------------------------------------------------------------------
    def _add_arg(self, v, spec: Spec | None) -> None:
        shape = shape_of(v)
        if not shape or not isinstance(v, jcore.Var):
            return
        f = Factors((), (tuple((k,) for k in range(len(shape))),), tuple(shape))
        own = tuple(k for k, n in enumerate(shape) if n > 1)
        u = Unit(-1, v, f, own, (0,), 1, 0.0, None if spec is None else {0: spec})
        self.arg_unit[v] = len(self.units)
        self.units.append(u)

    def _add_node(self, i: int, node: Node) -> None:
        e = self.table
        ins, outs = e.vars[i]
        if node.primitive == CONSTRAINT:
            spec = constraint_spec(node.eqn.params["sharding"], len(shape_of(node.outputs[0])))
            self._unit(Unit(i, None, Factors((), (), ()), (), (0, 1), node.weight, 0.0, {0: spec, 1: spec}))
            return
        operands = ins + outs
        if node.primitive == MANUAL:  # a shard_map region: its operands in its own specs
            specs = dict(enumerate(sum(manual_specs(node.eqn), ())))
            flops = manual_flops(node.eqn)  # per device already: the body's shapes are local
            region = manual_seconds(manual_comms(node.eqn), self.axis_size, self.cost)
            self._unit(Unit(i, None, Factors((), (), ()), (), tuple(range(len(operands))), node.weight, flops, specs,
                            matmul=True, region=region))
            return
        if i in e.unruled:  # no rule: every operand whole, as the engine leaves it
            fixed = {k: tuple(() for _ in shape_of(v)) for k, v in enumerate(operands)}
            self._unit(Unit(i, None, Factors((), (), ()), (), tuple(range(len(operands))), node.weight, 0.0, fixed))
            return
        f = e.factors[i]
        groups = unit_components(f) or (((), tuple(range(len(operands)))),)
        weight, matmul = node.weight, i in e.matmul
        self._unit(Unit(i, None, f, *groups[0], weight, f.flops, None, self._traffic.get(i, 0.0), matmul))
        for own, positions in groups[1:]:  # the operator's work goes with its first unit
            self._unit(Unit(i, None, f, own, positions, weight, 0.0, None, 0.0, matmul))

    def _unit(self, u: Unit) -> None:
        self.node_units[u.node].append(len(self.units))
        self.units.append(u)

    def _edges(self) -> list[Edge]:
        """Each use of a value, from the operator that made it for that use. A sub-jaxpr that JAX
        caches (`relu`'s `custom_jvp`) is inlined at every call with the same variables, so a
        value can have several makers: a use takes the nearest one before it (a loop's body results
        come after the loop: the nearest after). `self.producers` keeps them all."""
        e = self.table
        producers: dict = collections.defaultdict(list)  # var -> [(node, unit, position)]
        for k, u in enumerate(self.units):
            if u.node < 0:
                producers[u.var].append((-1, k, 0))
                continue
            ins, outs = e.vars[u.node]
            n_in = len(ins)
            for pos in u.operands:
                if pos >= n_in:
                    producers[outs[pos - n_in]].append((u.node, k, pos))
        self.producers = producers
        made, one = self._carried()
        edges: list[Edge] = []
        append, units, var, table, new = edges.append, self.units, jcore.Var, e.vars, tuple.__new__
        for k, u in enumerate(units):
            node = u.node
            if node < 0:
                continue
            ins = table[node][0]
            n_in, weight = len(ins), u.weight
            for pos in u.operands:
                if pos >= n_in:
                    continue
                v = ins[pos]
                if not isinstance(v, var):
                    continue
                found = one.get(v)
                if found is not None:
                    src, made_weight = found
                    append(new(Edge, (v, src, (k, pos), made_weight if made_weight >= weight else weight)))
                    continue
                makers = made.get(v)
                if makers is None:
                    continue
                _, src_unit, src_pos = next((m for m in reversed(makers) if m[0] < node), makers[0])
                append(new(Edge, (v, (src_unit, src_pos), (k, pos), max(units[src_unit].weight, weight))))
        return edges

    def _carried(self) -> tuple[dict, dict]:
        """The values an edge can carry (those with a shape) -> their makers (`producers`), and those
        of one maker -> its `(unit, position)` and its unit's weight: made once per value, read per use."""
        made, one = {}, {}
        for v, makers in self.producers.items():
            if getattr(v.aval, "shape", ()):
                made[v] = makers
                if len(makers) == 1:
                    one[v] = (makers[0][1:], self.units[makers[0][1]].weight)
        return made, one

    def _state_edges(self, args, outvars) -> list[Edge]:
        """A result that is the next call's argument (a train step's parameters and optimizer
        state) pays, if laid out otherwise, the redistribution back before the next call. Results
        are paired with arguments of the same shape and dtype in order (`jshard.cost.paired`)."""

        def made(v) -> bool:
            return isinstance(v, jcore.Var) and bool(shape_of(v)) and v in self.producers

        edges = []
        for v, arg in paired(args, outvars, lambda v: v in self.arg_unit, made):
            _, src_unit, src_pos = self.producers[v][-1]
            edges.append(Edge(v, (src_unit, src_pos), (self.arg_unit[arg], 0), 1))
        return edges

    def _combinable(self) -> frozenset[int]:
        """The units whose all-reduces XLA combines with the others of their set: those of an
        operator from whose results no operator of the same computation that may reduce (one with
        reduced factors, or a loop or branch) can be reached. No such all-reduce depends on another,
        so each set of them is one all-reduce; one with a reduction after it may feed the next."""
        nodes, factors, var = self.nodes, self.table.factors, jcore.Var
        cuts: dict[int, bool] = {}  # id() of an operator's `Factors` -> `_cuts_reduced`'s answer (identical layers share theirs)
        reduces = [node.primitive in NESTED or (i in factors and (
            cuts[id(factors[i])] if id(factors[i]) in cuts else cuts.setdefault(id(factors[i]), _cuts_reduced(factors[i]))))
            for i, node in enumerate(nodes)]
        # the values a node reads that may reduce, or that a reduction can be reached from: those of
        # every node that may reduce, and of each later node found to feed one (a cached call's
        # value read before its maker, made again, counts where its reader reduces)
        reaching = {v for i, node in enumerate(nodes) if reduces[i] for v in node.inputs if isinstance(v, var)}
        feeds = [False] * len(nodes)  # a node that may reduce can be reached from its results
        for i in reversed(range(len(nodes))):
            node = nodes[i]
            if any(v in reaching for v in node.outputs):
                feeds[i] = True
                if not reduces[i]:
                    reaching.update(v for v in node.inputs if isinstance(v, var))
        return frozenset(k for k, u in enumerate(self.units) if u.node >= 0 and not feeds[u.node] and u.free
                         and not u.factors.reduced.isdisjoint(u.own))

    def _signatures(self) -> list[int]:
        """Per unit, the id of its structure: its factors, the operands it lays out, how often it
        runs, its work, its fixed layouts, its results' shapes and whether its all-reduces are
        combinable. Units of one id (the same operator in identical layers of an unrolled loop) have
        the same candidates, layouts and costs, so the searches compute those once per id
        (`candidates`, `spec`, `_recursive`'s tables), as a scanned body is planned once."""
        ids: dict = {}
        out = []
        table, combinable = self.table.vars, self.combinable
        for k, u in enumerate(self.units):
            results = () if u.node < 0 else tuple([array_of(v) for v in table[u.node][1]])
            fixed = None if u.fixed is None else tuple(sorted(u.fixed.items()))
            key = (u.factors, u.own, u.operands, u.weight, u.flops, u.traffic, fixed, results, k in combinable)
            out.append(ids.setdefault(key, len(ids)))
        return out

    # -- candidates and their layouts ----------------------------------------------------------------
    def candidates(self, k: int, groups: Sequence[Group], base: Assignment | None = None) -> list[Assignment]:
        """Every way to give each of `groups` to one of unit `k`'s factors (or none), on top of
        `base`; computed once per unit structure (`shape_of_unit`), the list is the caller's."""
        key = (self.shape_of_unit[k], tuple(groups), tuple(sorted((base or {}).items())))
        found = self._cands.get(key)
        if found is None:
            found = self._cands[key] = self._candidates(k, groups, base)
        return list(found)

    def candidate_count(self, groups: Sequence[Group]) -> int:
        """The candidates of every unit for `groups`, counted (`SearchReport.candidates`): once per
        unit structure, as `candidates` computes them."""
        first: dict[int, int] = {}
        for k, shape in enumerate(self.shape_of_unit):
            first.setdefault(shape, k)
        units = collections.Counter(self.shape_of_unit)
        return sum(units[shape] * len(self.candidates(k, groups)) for shape, k in first.items())

    def _candidates(self, k: int, groups: Sequence[Group], base: Assignment | None) -> list[Assignment]:
        u = self.units[k]
        base = dict(base or {})
        if not u.free:
            return [base]
        sizes = u.factors.sizes
        out = []
        for choice in itertools.product((None,) + u.own, repeat=len(groups)):
            a = dict(base)
            for fac, axes in zip(choice, groups):
                if fac is None:
                    continue
                have = a.get(fac, ())
                cut = math.prod(self.axis_size[x] for x in have + axes)
                if sizes[fac] % cut:
                    break
                a[fac] = have + axes
            else:
                if self.expressible(k, a):
                    out.append(a)
        return out

    def expressible(self, k: int, a: Assignment) -> bool:
        """`rules.expressible` over unit `k`'s operands' merged dims (found once per unit)."""
        merged = self._merged.get(k)
        if merged is None:
            u = self.units[k]
            merged = self._merged[k] = sorted({factors for pos in u.operands for factors in u.factors.operands[pos]
                                               if len(factors) > 1})
        return expressible(self.units[k].factors, a, self.axis_size, merged)

    def spec(self, k: int, pos: int, a: Assignment) -> Spec:
        """The layout unit `k` under assignment `a` gives its operand `pos`."""
        u = self.units[k]
        if u.fixed is not None:
            return u.fixed[pos]
        key = (self.shape_of_unit[k], pos, tuple(sorted(a.items())))
        found = self._specs.get(key)
        if found is None:
            dims = u.factors.operands[pos]
            found = self._specs[key] = write_spec(dims, a, u.factors.sizes, self.axis_size)
        return found

    def partial_sums(self, k: int, a: Assignment) -> list[Group]:
        """The mesh axes of each all-reduce unit `k` runs under `a`: one per reduced factor it cuts."""
        u = self.units[k]
        if not u.free:
            return []
        return [tuple(a[fac]) for fac in sorted(u.factors.reduced) if fac in u.own and a.get(fac)]

    def unit_seconds(self, k: int, a: Assignment) -> float:
        """Unit `k`'s own cost under `a`: its partial sums (a combinable unit's without their
        latency, which `combined_latency` charges once per set), then its compute per device."""
        return sum(self.unit_parts(k, a))

    def unit_parts(self, k: int, a: Assignment) -> tuple[float, float]:
        """Unit `k`'s own cost under `a` as `(partial sums, compute)` (`unit_seconds`), each
        weighted by how often it runs."""
        u = self.units[k]
        if not u.free:  # a manual region's work is its body's, per device as written
            compute = self.cost.compute_seconds(u.flops, 0.0, u.matmul) if u.flops else 0.0
            return u.weight * u.region, u.weight * compute
        f = u.factors
        summed = compute = 0.0
        partial = self.partial_sums(k, a)
        if partial:
            n_in, combined = len(f.inputs), k in self.combinable
            outs = self.table.vars[u.node][1]
            for pos in u.operands:
                if pos >= n_in:
                    v = outs[pos - n_in]
                    shape, itemsize = array_of(v)
                    payload = local_bytes(shape, itemsize, self.spec(k, pos, a), self.axis_size)
                    summed += sum(self.cost.time(Comm("all-reduce", payload, axes), self.axis_size)
                                  - combined * self.cost.group_latency(axes) for axes in partial)
        if u.flops or u.traffic:
            cut = math.prod(self.axis_size[x] for fac in u.own for x in a.get(fac, ()))
            compute = self.cost.compute_seconds(u.flops / cut, u.traffic / cut, u.matmul)
        return u.weight * summed, u.weight * compute

    def edge_seconds(self, e: Edge, src: Spec, dst: Spec) -> float:
        if src == dst:
            return 0.0
        key = (array_of(e.var), src, dst)
        found = self._moves.get(key)
        if found is None:
            comms = redistribution(*key[0], src, dst, self.axis_size, self.cost.alltoall)
            found = self._moves[key] = sum(self.cost.time(c, self.axis_size) for c in comms)
        return e.weight * found

    def edge_comms(self, e: Edge, src: Spec, dst: Spec) -> list[tuple[str, float]]:
        """`edge_seconds` per collective: `(kind, seconds)` in the order they run."""
        if src == dst:
            return []
        key = (array_of(e.var), src, dst)
        found = self._comms.get(key)
        if found is None:
            comms = redistribution(*key[0], src, dst, self.axis_size, self.cost.alltoall)
            found = self._comms[key] = [(c.kind, self.cost.time(c, self.axis_size)) for c in comms]
        return [(kind, e.weight * t) for kind, t in found]
    def local_seconds(self, k: int, a: Assignment, choice: Sequence[Assignment], joins: Joins) -> float:
        """Unit `k`'s own cost under `a`, its edges' redistributions and the latency of the combined
        sets it alone joins (`lone_latency`), the other units as in `choice` (`joins`: its combined
        all-reduces, counted): a move of `k` changes `seconds` by the change of this."""
        total = self.unit_seconds(k, a) + self.lone_latency(k, a, joins)
        for n in self.out_edges.get(k, ()):
            e = self.edges[n]
            total += self.edge_seconds(e, self.spec(k, e.src[1], a), self.spec(e.dst[0], e.dst[1], choice[e.dst[0]]))
        for n in self.in_edges.get(k, ()):
            e = self.edges[n]
            total += self.edge_seconds(e, self.spec(e.src[0], e.src[1], choice[e.src[0]]), self.spec(k, e.dst[1], a))
        return total

    def combined_sets(self, choice: Sequence[Assignment]) -> dict[tuple, int]:
        """The all-reduces XLA's combiner merges under `choice`: per set (the enclosing loop's node
        or -1, the mesh axes, the reduction) of the combinable units' all-reduces, how often it runs."""
        return {self.combined_set(k, axes): self.units[k].weight
                for k in self.combinable for axes in self.partial_sums(k, choice[k])}

    def combined_set(self, k: int, axes: Group) -> tuple:
        """The set combinable unit `k`'s all-reduce over `axes` joins: its enclosing loop's node (or
        -1), the axes and the reduction."""
        loop, reduction = self.set_key(k)
        return loop, axes, reduction

    def set_key(self, k: int) -> tuple:
        """Unit `k`'s enclosing loop's node (or -1) and its reduction: the units whose all-reduces
        over the same mesh axes XLA's combiner may merge with `k`'s (`peers`)."""
        node = self.nodes[self.units[k].node]
        return node.loop, node.primitive if node.primitive in _NOT_SUMS else "add"

    def combined_latency(self, choice: Sequence[Assignment]) -> float:
        """The latency `choice`'s combinable all-reduces pay: one per combined set and run."""
        return self.sets_latency(self.combined_sets(choice))

    def sets_latency(self, sets: Mapping[tuple, int]) -> float:
        """The latency combined `sets` (`combined_set`, each with how often it runs) pay: one
        collective's per set and run."""
        return sum(w * self.cost.group_latency(axes) for (_, axes, _), w in sets.items())

    def joins(self, choice: Sequence[Assignment]) -> Joins:
        """`choice`'s combinable all-reduces, counted per set (`Joins`): what `lone_latency` reads."""
        return Joins(self, choice)

    def lone_latency(self, k: int, a: Assignment, joins: Joins) -> float:
        """The latency of the combined sets unit `k` joins under `a` and no other unit joins in
        `joins`: what `k` adds to `combined_latency`."""
        mine = set(self.partial_sums(k, a)) if k in self.combinable else set()
        if not mine:
            return 0.0
        others = joins.others(k)
        return self.units[k].weight * sum(self.cost.group_latency(axes) for axes in mine - others)

    def all_reduces(self, choice: Sequence[Assignment]) -> int:
        """All-reduces per call the compiled program of `choice` is predicted to run, weighted by
        their loops' trip counts (`jshard.audit`'s count): one per set of combinable ones, and one
        per partial sum of each other unit."""
        alone = sum(u.weight * len(self.partial_sums(k, choice[k]))
                    for k, u in enumerate(self.units) if k not in self.combinable)
        return alone + sum(self.combined_sets(choice).values())

    def seconds(self, choice: Sequence[Assignment]) -> float:
        """The predicted seconds per call of `choice` (the measure both searches' plans are
        compared by): every unit's own cost, every edge's redistribution and the combined
        all-reduces' latency, summed (`summed`); where the cost model overlaps collectives with
        compute (`CostModel.overlap`), the makespan of their schedule instead (`scheduled`)."""
        return self.scheduled(choice) if self.cost.overlap else self.summed(choice)

    def summed(self, choice: Sequence[Assignment]) -> float:
        """`choice`'s units' own costs, edges' redistributions and combined latency, summed."""
        shape, own = self.shape_of_unit, dict[tuple, float]()
        total = self.combined_latency(choice)
        for k, a in enumerate(choice):  # `unit_seconds` once per structure and assignment (identical layers)
            key = (shape[k], id(a))
            found = own.get(key)
            if found is None:
                found = own[key] = self.unit_seconds(k, a)
            total += found
        spec = self._reader(choice)
        for e in self.edges:
            total += self.edge_seconds(e, spec(*e.src), spec(*e.dst))
        return total

    def scheduled(self, choice: Sequence[Assignment]) -> float:
        """The makespan of `choice` with compute and each collective kind on their own resource,
        operators in program order (`jshard.propagate.schedule`'s rule): the redistributions into
        an operator start once their values are made, its compute once they have arrived, its
        partial sums once it has computed; the combined sets' latency is paid on the all-reduces'
        resource at the end."""
        shape, own, spec = self.shape_of_unit, dict[tuple, tuple[float, float]](), self._reader(choice)
        lines: dict[str, Timeline] = collections.defaultdict(Timeline)
        done: dict[int, float] = {-1: 0.0}  # node -> when its results are made (-1: the arguments)
        for i in sorted(self.node_units):
            units = self.node_units[i]
            arrived = 0.0
            for k in units:
                for n in self.in_edges.get(k, ()):
                    e = self.edges[n]
                    made = done.get(self.units[e.src[0]].node, 0.0)
                    for kind, t in self.edge_comms(e, spec(*e.src), spec(*e.dst)):
                        made = lines[kind].place(made, t)
                    arrived = max(arrived, made)
            summed = compute = 0.0
            for k in units:
                key = (shape[k], id(choice[k]))
                parts = own.get(key)
                if parts is None:
                    parts = own[key] = self.unit_parts(k, choice[k])
                summed, compute = summed + parts[0], compute + parts[1]
            done[i] = lines["all-reduce"].place(lines["compute"].place(arrived, compute), summed)
        lines["all-reduce"].place(lines["all-reduce"].tail, self.combined_latency(choice))
        return max((line.tail for line in lines.values()), default=0.0)

    def work_share(self, choice: Sequence[Assignment]) -> float:
        """The share of the single-device FLOPs one device does under `choice` (1.0: nothing is cut),
        as `unit_seconds` prices the compute."""
        whole = done = 0.0
        devices = math.prod(self.axis_size.values())
        for u, a in zip(self.units, choice):
            if u.flops and not u.free:  # a manual region: its body's flops are one device's
                whole += u.weight * u.flops * devices
                done += u.weight * u.flops
            elif u.flops:
                whole += u.weight * u.flops
                done += u.weight * u.flops / math.prod(self.axis_size[x] for fac in u.own for x in a.get(fac, ()))
        return done / whole if whole else 1.0

    def _reader(self, choice: Sequence[Assignment]) -> Callable[[int, int], Spec]:
        """`spec(k, pos, choice[k])`, looked up once per unit structure, operand and assignment
        object while `choice` lives (a search's choice shares its assignments between the units
        of one structure)."""
        shape, found, spec = self.shape_of_unit, {}, self.spec

        def read(k: int, pos: int) -> Spec:
            a = choice[k]
            key = (shape[k], pos, id(a))
            out = found.get(key)
            if out is None:
                out = found[key] = spec(k, pos, a)
            return out

        return read

    # -- memory --------------------------------------------------------------------------------
    def _memory_model(self, args, outvars, donated, host, ranges: LiveRanges | None) -> None:
        """The program's live ranges (`jshard.cost.live_ranges`; `host`: the arguments and results
        kept in host memory between steps; `ranges`: those made already, as `compile.Traced.live_ranges`
        keeps them) and, for each value held, the unit that lays it out."""
        self.ranges = ranges or live_ranges(self.nodes, args, outvars, donated, host, FUSION)
        self.first, self.last, self.end = self.ranges.first, self.ranges.last, self.ranges.end
        # value -> `(unit, operand position)` that lays it out where it is made: its first maker
        self.makers = {v: makers[0][1:] for v, makers in self.producers.items()}
        self.memory_values = [v for v in self.ranges.values() if v in self.makers]

    def live_bytes(self, value_bytes: Mapping) -> np.ndarray:
        """Bytes live at each top-level program point, given each memory value's bytes (a loop's
        point with its body's peak: `LiveRanges.transient`)."""
        return self.ranges.live_bytes(value_bytes)

    def peak(self, choice: Sequence[Assignment]) -> tuple[float, int]:
        """The most bytes one device holds at any program point under `choice`, and that point."""
        spec, makers, slices = self._reader(choice), self.makers, slice_counter(self.axis_size)
        live = self.live_bytes({v: b / slices(spec(*makers[v])) for v, b in self.replicated.items()})
        t = int(np.argmax(live))
        return float(live[t]), t

    @functools.cached_property
    def replicated(self) -> dict:
        """Each memory value's bytes on one device holding all of it."""
        return {v: value_bytes(v) for v in self.memory_values}

    def live_at(self, t: int) -> list:
        return self.ranges.live_at(t, self.memory_values)


def _cuts_reduced(f: Factors) -> bool:
    """Whether the operator may leave partial sums: a reduced factor of more than one element."""
    return any(f.sizes[fac] > 1 for fac in f.reduced)


