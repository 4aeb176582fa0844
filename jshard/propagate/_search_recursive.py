"""`search="recursive"`: bisect the device count one mesh axis at a time (MindSpore's recursive
programming over jshard's factors).

At each level one more mesh axis (one prime factor of the device count, major first) is handed out:
every unit either gives it to one of its factors, on top of what earlier levels gave, or leaves it
unused. The heaviest unit (most compute, then most bytes) is tried with each of its candidates; from
it the choice spreads breadth-first, each unit taking the candidate of least cost against the
neighbours already decided at this level (its partial sums, its compute per device, the
redistribution of the values it shares with them, and λ·bytes it keeps in memory); then every unit
is revisited against all its neighbours until none changes; the trial of least total cost is kept,
or none, if leaving the axis unused (replicating over it) costs less. Units the spread does not reach start their own, in weight order. Each
level is linear in the graph's size, so a search is linear in operators × log(devices).

A memory budget sets λ (seconds per byte): zero when the plan fits, else the least λ found by
doubling and bisection whose plan fits, which moves the plan from replicated parameters to cut ones
(FSDP-style or tensor-parallel) as far as the budget needs.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

from jshard.propagate._search_graph import Assignment, Group, SearchGraph

_GROWTHS = 24
_BISECTIONS = 6
_PASSES = 2
_ROOTS = 4  # the heaviest units tried with each candidate, one after another, per level
_TIE = 1e-18  # seconds per byte kept: between plans of equal cost, the one that holds less
_HEAVY = 0.1  # ... among those with at least this share of the heaviest one's compute


@dataclasses.dataclass(frozen=True)
class Solved:
    choice: list[Assignment]
    seconds: float
    peak: float
    status: str
    levels: int


class Infeasible(Exception):
    """Even the most memory-bound plan the search finds does not fit the budget."""


def solve(g: SearchGraph, levels: Sequence[Group], budget: float | None) -> Solved:
    search = _Recursive(g, levels)
    choice, seconds = search.run(0.0)
    peak, _ = g.peak(choice)
    if budget is None or peak <= budget:
        return Solved(choice, seconds, peak, "fits" if budget else "no budget", len(levels))
    low, high, best = 0.0, max(seconds, 1e-9) / peak, None  # λ's scale: the plan's seconds per byte
    for _ in range(_GROWTHS):
        choice, seconds = search.run(high)
        peak, _ = g.peak(choice)
        if peak <= budget:
            best = (choice, seconds, peak)
            break
        low, high = high, high * 4
    if best is None:
        raise Infeasible(f"the most memory-bound plan found holds {peak:.0f} bytes per device")
    for _ in range(_BISECTIONS):
        mid = (low + high) / 2
        choice, seconds = search.run(mid)
        peak, _ = g.peak(choice)
        if peak <= budget:
            high, best = mid, (choice, seconds, peak)
        else:
            low = mid
    choice, seconds, peak = best
    return Solved(choice, seconds, peak, f"memory weight {high:.3g} s/byte to fit the budget", len(levels))


class _Recursive:
    def __init__(self, g: SearchGraph, levels: Sequence[Group]):
        self.g, self.levels = g, list(levels)
        self.neighbours: dict[int, list[tuple[int, int, bool]]] = collections.defaultdict(list)
        for k, e in enumerate(g.edges):
            self.neighbours[e.src[0]].append((k, e.dst[0], True))
            self.neighbours[e.dst[0]].append((k, e.src[0], False))
        weight = lambda k: (g.units[k].weight * g.units[k].flops, len(self.neighbours[k]))
        self.order = sorted((k for k, u in enumerate(g.units) if u.free), key=weight, reverse=True)
        self.fixed = [k for k, u in enumerate(g.units) if not u.free]
        self.program = [k for k, u in enumerate(g.units) if u.free]  # arguments, then operators in program order
        heaviest = weight(self.order[0])[0] if self.order else 0.0
        self.roots = [k for k in self.order if weight(k)[0] >= _HEAVY * heaviest][:_ROOTS] or self.order[:1]
        replicated = g.live_bytes({v: float(v.aval.size * v.aval.dtype.itemsize) for v in g.memory_values})
        t = int(replicated.argmax())
        self.kept: dict[int, list] = collections.defaultdict(list)  # unit -> (operand position, value) live at the peak
        for v in g.live_at(t):
            k, pos = g.makers[v]
            self.kept[k].append((pos, v))

    def run(self, lam: float) -> tuple[list[Assignment], float]:
        base: list[Assignment] = [{} for _ in self.g.units]
        for group in self.levels:
            base = self._level(group, base, lam)
        return base, self._total(dict(enumerate(base)), 0.0)

    def _level(self, group: Group, base: list[Assignment], lam: float):
        g = self.g
        cands: dict = {}
        self._memo = {}
        best = (self._total(dict(enumerate(base)), lam), dict(enumerate(base)))  # the axis unused: replicate over it
        pinned: dict[int, Assignment] = {}
        for root in self.roots:
            found = None
            for first in self._cands(root, group, base, cands):
                chosen = self._spread(group, base, lam, cands, {**pinned, root: first})
                self._refine(group, base, lam, cands, chosen, set(pinned) | {root})
                total = self._total(chosen, lam)
                if found is None or total < found[0]:
                    found = (total, chosen, first)
            pinned[root] = found[2]
            if found[0] < best[0]:
                best = found[:2]
        _, chosen = best
        return [chosen.get(k, base[k]) for k in range(len(g.units))]

    def _cands(self, k, group, base, cands):
        found = cands.get(k)
        if found is None:
            found = cands[k] = self.g.candidates(k, [group], base[k])
        return found

    def _spread(self, group, base, lam, cands, roots: dict) -> dict[int, Assignment]:
        """The pinned `roots`, then every other unit in program order (arguments first), each
        against the neighbours decided before it: a cut made upstream flows down the program."""
        chosen: dict[int, Assignment] = {k: base[k] for k in self.fixed}
        chosen.update(roots)
        for k in self.program:
            if k not in chosen:
                chosen[k] = self._best(k, group, base, lam, cands, chosen)
        return chosen

    def _refine(self, group, base, lam, cands, chosen, keep) -> None:
        """Revisits every unit, heaviest first, against all its neighbours now that they are decided,
        until no unit changes (a few passes): the spread decided each against only some of them."""
        for _ in range(_PASSES):
            changed = False
            for k in reversed(self.program):
                if k in keep:
                    continue
                best = self._best(k, group, base, lam, cands, chosen)
                if best != chosen[k]:
                    chosen[k], changed = best, True
            if not changed:
                return

    def _best(self, k, group, base, lam, cands, chosen) -> Assignment:
        best, best_cost = None, None
        for a in self._cands(k, group, base, cands):
            c = self._local(k, a, lam, chosen)
            if best_cost is None or c < best_cost:
                best, best_cost = a, c
        return best

    def _local(self, k, a, lam, chosen) -> float:
        # Memoized per level by the identities of the candidate and of the neighbours' choices
        # (all of them live in the level's candidate lists or `base` while the level runs).
        key = (k, id(a), tuple(id(chosen.get(j)) for _, j, _ in self.neighbours[k]))
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self._local_cost(k, a, lam, chosen)
        return found

    def _local_cost(self, k, a, lam, chosen) -> float:
        g = self.g
        cost = g.unit_seconds(k, a)
        for e_index, j, outgoing in self.neighbours[k]:
            if j not in chosen:
                continue
            e = g.edges[e_index]
            mine = g.spec(k, (e.src if outgoing else e.dst)[1], a)
            theirs = g.spec(j, (e.dst if outgoing else e.src)[1], chosen[j])
            cost += g.edge_seconds(e, mine, theirs) if outgoing else g.edge_seconds(e, theirs, mine)
        return cost + max(lam, _TIE) * self._kept(k, a)

    def _kept(self, k, a) -> float:
        g = self.g
        total = 0.0
        for pos, v in self.kept.get(k, ()):
            spec = g.spec(k, pos, a)
            cut = 1
            for axes in spec:
                for x in axes:
                    cut *= g.axis_size[x]
            total += v.aval.size * v.aval.dtype.itemsize / cut
        return total

    def _total(self, chosen, lam) -> float:
        g = self.g
        total = sum(g.unit_seconds(k, a) for k, a in chosen.items())
        for e in g.edges:
            (u, pu), (w, pw) = e.src, e.dst
            total += g.edge_seconds(e, g.spec(u, pu, chosen[u]), g.spec(w, pw, chosen[w]))
        if lam:
            total += lam * sum(self._kept(k, chosen[k]) for k in self.kept)
        return total
