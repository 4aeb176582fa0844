"""Whole-chain moves of a free argument's layout, after the search (issue 32).

A *chain* is a free argument's unit and the free units reached from it over the graph's edges, both
ways, whose every array operand has the argument's shape (a scalar operand aside): for a train
step's parameter, its optimizer moments (arguments too, reached through the update), the update's
elementwise operators and the updated results (the state edges pair a result with the next call's
argument). An operator that changes the shape (the parameter's use in the forward pass, its
gradient's contraction) ends the chain.

Why move a chain whole. The recursive search's levels price summed per-unit seconds, and its polish
(`_seeded.polished`) moves one unit one mesh axis at a time, priced by its local summed seconds; but
whole plans are compared by `SearchGraph.seconds`, the schedule's makespan where the cost model
overlaps collectives with compute (`CostModel.overlap`). A parameter's layout can cost more summed
and less on the critical path (issue 32: the 128k-token Llama 3 8B on 1024 H100s stores its
embedding table cut 32x32, which saves summed seconds on its update, while storing it as the
data-parallel plan does takes the embedding's all-gather before the first layer off the critical
path: 1.18 ms less per call). No single-unit move reaches that layout (each one alone breaks the
chain and pays a redistribution), and the seeds (`_seeded.seeds`) reach it only as whole plans.

So `moved` takes each chain of the searched plan to each seed's layout of it as one move, priced by
`SearchGraph.seconds`, and keeps a move where it predicts less and the estimated peak fits the
budget. Chains alike (the same parameter of identical layers: the same unit structures under the
same layouts, now and in every seed) move together, as one trial.

What it costs: per search, one pass over the chains, and per distinct trial (a chain class and a
seed layout of it that differs from the plan's) a lower bound on its seconds read from the units it
moves and their edges (`_Busy`: each resource's busy time), then, only where that bound is under
the plan's seconds, one `SearchGraph.seconds` and, where that predicts less, one `SearchGraph.peak`.
A chain no seed lays out otherwise costs nothing. It acts only where the search made seeds (the
program has anchors, or a budget) and reads `check` before each trial (the planning's deadline).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence

from jshard.rules import shape_of
from jshard.search._graph import Assignment, Edge, SearchGraph, Solved

_LESS = 1e-12
"""A move is kept where it predicts at least this share fewer seconds (not a rounding's worth)."""
_ROUNDING = 1e-9
"""`_Busy`'s bound, summed in another order than the schedule's, is trusted to within this share."""


def chains(g: SearchGraph) -> list[list[int]]:
    """Each free argument's chain (see the module docstring), its units in index order; an argument
    another's chain reached (a parameter's optimizer moment) is in that chain, not one of its own."""
    seen: set[int] = set()
    out = []
    for v, start in g.arg_unit.items():
        if start in seen or not g.units[start].free:
            continue
        shape, chain, todo = shape_of(v), [], [start]
        seen.add(start)
        while todo:
            k = todo.pop()
            chain.append(k)
            for j in _neighbours(g, k):
                if j not in seen and g.units[j].free and _shaped(g, j, shape):
                    seen.add(j)
                    todo.append(j)
        out.append(sorted(chain))
    return out


def _neighbours(g: SearchGraph, k: int) -> list[int]:
    """The units at the other end of unit `k`'s edges, out and in."""
    edges = g.edges
    return [edges[n].dst[0] for n in g.out_edges.get(k, ())] + [edges[n].src[0] for n in g.in_edges.get(k, ())]


def _shaped(g: SearchGraph, k: int, shape: tuple[int, ...]) -> bool:
    """Whether every operand unit `k` lays out has `shape` or is a scalar."""
    u = g.units[k]
    if u.node < 0:
        return shape_of(u.var) == shape
    ins, outs = g.table.vars[u.node]
    operands = ins + outs
    return all(shape_of(operands[pos]) in ((), shape) for pos in u.operands)


def moved(
    g: SearchGraph,
    solved: Solved,
    seeds: Sequence[Solved],
    budget: float | None,
    check: Callable[[], None] | None = None,
) -> Solved:
    """`solved` with each chain (`chains`) moved whole to a seed's layout of it, where that predicts
    fewer seconds (`SearchGraph.seconds`) and the estimated peak fits `budget`; the moves tried one
    class of alike chains and one seed at a time, each kept before the next is tried. A trial whose
    resources' busy time alone (`_Busy`) reaches the plan's seconds is not priced. `check()` is read
    before each trial (it raises where the planning stops the search)."""
    classes = _classes(g, chains(g), solved.choice, seeds) if seeds else []
    if not classes:
        return solved
    choice, best, kept = list(solved.choice), solved.seconds, 0
    # the bound costs about one schedule to set up: worth it where it can spare one
    busy = _Busy(g, list(choice)) if sum(len(trials) for _, trials in classes) > 1 else None
    for group, trials in classes:
        for trial in trials:
            if check is not None:
                check()
            moves = {k: a for chain in group for k, a in zip(chain, trial)}
            if busy is not None and busy.bound(moves) * (1 - _ROUNDING) >= best * (1 - _LESS):
                continue
            tried = list(choice)
            for k, a in moves.items():
                tried[k] = a
            seconds = g.seconds(tried)
            if seconds < best * (1 - _LESS) and (budget is None or g.peak(tried)[0] <= budget):
                choice, best, kept = tried, seconds, kept + 1
                if busy is not None:
                    busy.move(moves)
    if not kept:
        return solved
    peak, _ = g.peak(choice)
    return dataclasses.replace(
        solved,
        choice=choice,
        seconds=best,
        peak=peak,
        status=(
            f"{solved.status}; {kept} argument chain move{'s' if kept > 1 else ''} to a seed's layouts "
            f"(before them: {solved.seconds * 1e6:.6g} us per call)"
        ),
    )


class _Busy:
    """A lower bound on `SearchGraph.seconds` of `choice` as whole chains move (`move`): each
    resource's busy time (the compute, and each collective kind: the redistributions into the
    operators and, on the all-reduce's, their partial sums), the most of them where the cost model
    overlaps collectives with compute (`SearchGraph.scheduled` places each on its own resource), their
    sum where it does not (`SearchGraph.summed`); the combined all-reduces' latency, which only adds,
    left out. A trial's bound reads only the units it moves and their edges, so a trial that adds
    more busy time than the plan has slack is dropped at that cost, not a whole schedule's."""

    def __init__(self, g: SearchGraph, choice: list[Assignment]):
        self.g, self.choice = g, choice
        self.totals: collections.Counter = collections.Counter()
        own: dict[tuple, collections.Counter] = {}  # once per unit structure and assignment (identical layers)
        for k, a in enumerate(choice):
            key = (g.shape_of_unit[k], id(a))
            if key not in own:
                own[key] = self._unit(k, a)
            self.totals.update(own[key])
        for e in g.edges:
            self.totals.update(self._edge(e, choice.__getitem__))

    def _unit(self, k: int, a: Assignment) -> collections.Counter:
        if self.g.units[k].node < 0:  # an argument: no work of its own
            return collections.Counter()
        summed, compute = self.g.unit_parts(k, a)
        return collections.Counter({"all-reduce": summed, "compute": compute})

    def _edge(self, e: Edge, at: Callable[[int], Assignment]) -> collections.Counter:
        """Edge `e`'s redistribution per collective kind, its units under `at(unit)`."""
        g = self.g
        out: collections.Counter = collections.Counter()  # seconds per collective kind
        if g.units[e.dst[0]].node < 0:  # into the next call's argument: not on the schedule
            return out
        src, dst = g.spec(e.src[0], e.src[1], at(e.src[0])), g.spec(e.dst[0], e.dst[1], at(e.dst[0]))
        for kind, t in g.edge_comms(e, src, dst):
            out[kind] += t
        return out

    def _delta(self, moves: Mapping[int, Assignment]) -> collections.Counter:
        """The busy time per resource `moves` (unit -> assignment) adds (negative: takes away)."""
        g, now = self.g, self.choice.__getitem__
        delta: collections.Counter = collections.Counter()
        for k, a in moves.items():
            delta.update(self._unit(k, a))
            delta.subtract(self._unit(k, now(k)))
        edges = {n for k in moves for n in (*g.out_edges.get(k, ()), *g.in_edges.get(k, ()))}
        for n in edges:
            delta.update(self._edge(g.edges[n], lambda k: moves[k] if k in moves else now(k)))
            delta.subtract(self._edge(g.edges[n], now))
        return delta

    def bound(self, moves: Mapping[int, Assignment]) -> float:
        """The lower bound with `moves` (unit -> assignment) made."""
        totals = self.totals.copy()
        totals.update(self._delta(moves))
        lines = [max(t, 0.0) for t in totals.values()]
        return max(lines, default=0.0) if self.g.cost.overlap else sum(lines)

    def move(self, moves: Mapping[int, Assignment]) -> None:
        """`moves` made (in the choice too)."""
        self.totals.update(self._delta(moves))
        for k, a in moves.items():
            self.choice[k] = a


def _classes(
    g: SearchGraph, found: list[list[int]], choice: Sequence[Assignment], seeds: Sequence[Solved]
) -> list[tuple[list[list[int]], list[list[Assignment]]]]:
    """The chains of `found` that some seed lays out otherwise than `choice`, in classes of alike
    ones (the same unit structures, laid out alike by `choice` and by every seed), each with the
    seeds' distinct layouts of its chains (one assignment per unit), in the seeds' order."""
    classes: dict[tuple, tuple[list[list[int]], list[list[Assignment]]]] = {}
    for chain in found:
        now = [choice[k] for k in chain]
        trials: list[list[Assignment]] = []
        for s in seeds:
            trial = [s.choice[k] for k in chain]
            if trial != now and trial not in trials:
                trials.append(trial)
        if not trials:
            continue
        key = (tuple(g.shape_of_unit[k] for k in chain), _key(now), tuple(map(_key, trials)))
        classes.setdefault(key, ([], trials))[0].append(chain)
    return list(classes.values())


def _key(layouts: Sequence[Assignment]) -> tuple:
    return tuple(tuple(sorted(a.items())) for a in layouts)
