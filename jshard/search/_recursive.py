"""`search="recursive"`: bisect the device count one mesh axis at a time (MindSpore's recursive
programming over jshard's factors).

At each level one more mesh axis (one prime factor of the device count, major first) is handed out:
every unit either gives it to one of its factors, on top of what earlier levels gave, or leaves it
unused. A level is a pairwise energy (`_Level`): each unit's own cost per candidate (its partial
sums, its compute per device, λ·bytes it keeps at the peak) and, per pair of neighbouring units, a
table of the redistribution their values pay. MindSpore's dynamic-programming eliminations solve
most of it exactly: units with one candidate, one neighbour or two neighbours fold into their
neighbours, so chains (an optimizer's elementwise update between a weight gradient and the next
step's weight) are weighed as one decision. The core that remains is searched heuristically: the
axis left unused, then each of the heaviest units pinned to each of its candidates with the rest
decided in program order, improved by single moves, the best per pinned unit polished with moves of
two neighbours at once; the eliminated units then take their best answers. Each level is linear in
the graph's size, so a search is linear in operators × log(devices). Identical units (one operator
of identical layers of an unrolled loop) are weighed once, as a scanned body is: they share their
candidates, costs and tables, an eliminated unit's fold, and the core's cost evaluations (a unit's
cost against its neighbours' picks, a pair's joint move), keyed by the arrays' bytes, so the choice
is the one weighing each unit alone gives.

Replay (`_Ties`): the interior layers of a repeated run (an unrolled loop's layers, found as a
period in the units' structure and wiring) are decided as one at each level, the way a scanned
body is planned once; the first and last `_WINDOW` layers of the run are decided on their own, and
the replayed choice is then checked by single and pairwise moves (`_Recursive._checked`) with every
unit its own class but the middle layers of long runs: the first and last `_WINDOW + _MARGIN`
layers move alone, the middle ones as one class. A change made at a boundary that reaches the
layers beside the middle is carried into it (the middle takes their choice and is checked again,
`_WAVES` rounds at most, the lowest energy kept), as weighing every unit alone carries it layer by
layer; so the check too is flat in the number of layers. It weighs the same units on the same
base, so it reads what the replayed level computed (`_Shared`: candidates, layouts, edge tables,
own costs, folds, the core's classes and cost evaluations) rather than pricing the program again.

A memory budget sets λ (seconds per byte) on the values held at the peak (at first the replicated
plan's peak; where a plan's peak falls elsewhere, the values held there join them): zero when the
plan fits, else the least λ found by growing and bisection (`_grown`, `_bisected`: each ends once
it learns nothing new) whose plan fits, which moves the plan from replicated parameters to cut ones
(FSDP-style or tensor-parallel) as far as the budget needs.
"""

from __future__ import annotations

import collections
import heapq
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from jshard.cost import array_of, value_bytes
from jshard.search._graph import TIE, Assignment, Group, Infeasible, SearchGraph, Solved

Barred = tuple[frozenset, float]
"""Combined sets (`SearchGraph.combined_set`) a level's units may not join, and the toll in seconds
that each candidate joining one pays in the level (`_Recursive._closed`)."""

_log = logging.getLogger("jshard.search")
"""Progress: one INFO record per level of each run (`jshard plan` shows them on a terminal)."""

_GROWTHS = 24
_SATURATED = 1e6  # ... fewer: it ends where the peak stands still, its bytes over the budget weighing this many
# times the plan's seconds (`_grown`: a pipeline stage's plan that fitted later stood at 2,000 times)
_BISECTIONS = 6
_STALE = 2  # ... fewer: the bisection stops after this many runs in a row that find no new plan
_PASSES = 4
_ROOTS = 4  # the heaviest units tried with each candidate, one after another, per level
_BELIEFS = 32  # the core's min-sum message passing: rounds at most
_HEAVY = 0.1  # ... among those with at least this share of the heaviest one's compute
_WINDOW = 1  # replay: layers of a repeated run decided on their own at each end; the interior ones as one
_ROUNDS = 2  # ... runs found on the units' structure refined by their neighbours' to this many hops
_PERIODS = 16  # ... among the commonest periods
_MARGIN = 1  # ... the boundary check: layers beside those decided on their own at each end, each on its own too
_WAVES = 3  # ... and its rounds at most: the middle layers take the choice of the layers beside them
_UNSEEN: Any = object()  # a key not yet in a cache whose values may be None


def solve(g: SearchGraph, levels: Sequence[Group], budget: float | None, replay: bool = True,
          passed: Callable[[], bool] | None = None, check: Callable[[], None] | None = None,
          unweighed: Callable[[Callable[[], tuple]], tuple] | None = None) -> Solved:
    """The recursive search's plan: the fastest that fits `budget` among its runs, each at a memory
    weight λ (seconds per byte held at the peak). The run at λ = 0 descends to a local optimum of
    seconds alone; where the cost model prices memory traffic (`CostModel.memory_bandwidth`: fewer
    bytes held is often fewer moved), a run at λ's scale (the first plan's seconds per byte) starts
    the same descent on another landscape, and its plan may be faster too: it is weighed whether or
    not the first fits, so a plan without a budget is never slower than the first a budget weighs
    (the runs a budget adds, at other weights, may still find a faster one). Where traffic is not
    priced, held bytes cost nothing moved, and that run, which doubled the search, is left out.
    Once `passed()` (the planning's deadline, `Search.time_limit`) and a plan fits, no further run
    is made: neither that one nor the bisection of λ. `check()` is read before each level of each
    run (it raises where the planning stops this search). `unweighed(make)`, where given, is the run
    at λ = 0 (`make()`) kept for the searches of one program whose graphs differ in their memory
    model only (each placement of the state a budget weighs: at λ = 0 no byte is weighed, so each
    made the same run again; `SearchReport.runs` counts the runs this search made)."""
    stop = passed or (lambda: False)
    search = _Recursive(g, levels, replay, check)
    choice, seconds = search.run(0.0) if unweighed is None else unweighed(lambda: search.run(0.0))
    choice = [dict(a) for a in choice]  # the kept run's assignments stay as made
    peak, t = g.peak(choice)
    if budget is None or peak <= budget:
        status = "fits" if budget else "no budget"
        if peak <= 0.0 or not g.cost.memory_bandwidth or stop():
            return search.solved(choice, seconds, peak, status)
        search.keep(t)
        weighed, weighed_seconds = search.run(max(seconds, 1e-9) / peak)
        weighed_peak, _ = g.peak(weighed)
        if weighed_seconds < seconds and (budget is None or weighed_peak <= budget):
            return search.solved(weighed, weighed_seconds, weighed_peak, status)
        return search.solved(choice, seconds, peak, status)
    search.keep(t)
    seen = {(seconds, peak)}  # the plans found, as (seconds, peak)
    low, best = _grown(g, search, budget, max(seconds, 1e-9) / peak, seen)  # λ's scale: the plan's seconds per byte
    seconds, choice, peak, lam = _bisected(g, search, budget, low, best, stop, seen)
    return search.solved(choice, seconds, peak, f"memory weight {lam:.3g} s/byte to fit the budget")


def _grown(g: SearchGraph, search: _Recursive, budget: float, high: float, seen: set) -> tuple[float, tuple]:
    """λ grown from `high` (four times each time) until the plan fits `budget`: the last λ whose plan
    did not fit and `(seconds, choice, peak, λ)` of the first that does; no plan fits (`Infeasible`)
    after `_GROWTHS` growths, or once the peak stands still (the growth before's) where its bytes over
    the budget weigh `_SATURATED` times the plan's seconds (`_saturated`). The growth goes on while
    the peak stands still short of that: a plan can stand through several growths and move at a
    later one (a pipeline stage's plan under a 41.5 KiB budget stands through seven, its bytes over
    the budget weighing up to 2,000 times its seconds, and fits at the eighth); past it no plan moved
    (eqx_vit's under 0.8 times its unbudgeted peak stands from 80 times on; the growth went on to
    10^12 times, 9 runs more, and found none that fits). Each plan found joins `seen`."""
    low, growths, last = 0.0, 0, -1.0
    while growths < _GROWTHS:
        choice, seconds = search.run(high)
        peak, t = g.peak(choice)
        seen.add((seconds, peak))
        if peak <= budget:
            return low, (seconds, choice, peak, high)
        if search.keep(t):  # new values held at this plan's peak are weighed at the same λ first
            continue
        if peak == last and _saturated(high, seconds, peak - budget):
            break
        last, low, high, growths = peak, high, high * 4, growths + 1
    raise Infeasible(f"the most memory-bound plan found holds {peak:.0f} bytes per device")


def _saturated(lam: float, seconds: float, over: float) -> bool:
    """Whether `over` bytes over the budget weigh at `lam` `_SATURATED` times a plan's `seconds` or
    more: a run that kept them found no layout that sheds them at a million times the plan's cost."""
    return lam * over >= _SATURATED * seconds


def _bisected(g: SearchGraph, search: _Recursive, budget: float, low: float, best: tuple,
              stop: Callable[[], bool], seen: set) -> tuple:
    """λ bisected between `low` (its plan over `budget`) and `best`'s (it fits), the fastest plan
    that fits kept (a plan's seconds need not grow with λ); `_BISECTIONS` runs at most, fewer where
    `_STALE` runs in a row find no plan not in `seen` (the plans found before: the bisection has
    narrowed onto the step between two plans it knows), or once `stop()` (the planning's deadline)."""
    high, stale = best[3], 0
    for _ in range(_BISECTIONS):
        if stop() or stale >= _STALE:
            break
        mid = (low + high) / 2
        choice, seconds = search.run(mid)
        peak, _ = g.peak(choice)
        stale = stale + 1 if (seconds, peak) in seen else 0
        seen.add((seconds, peak))
        search.bisections += 1
        if peak <= budget:
            high, best = mid, min(best, (seconds, choice, peak, mid), key=lambda b: b[0])
        else:
            low = mid
    return best


class _Recursive:
    def __init__(self, g: SearchGraph, levels: Sequence[Group], replay: bool = True,
                 check: Callable[[], None] | None = None):
        self.g, self.levels, self.replay = g, list(levels), replay
        self.check = check or (lambda: None)
        replicated = g.live_bytes({v: value_bytes(v) for v in g.memory_values})
        self.kept: dict[int, list] = collections.defaultdict(list)  # unit -> (operand position, value) live at a peak
        self.kept_bytes: dict[int, tuple] = {}  # unit -> (operand position, bytes) of the above: what its unary reads
        values: dict[tuple, int] = {}  # what an edge's table reads of it: its value's array and weight, as ids
        self.edge_values = [values.setdefault((array_of(e.var), e.weight), len(values)) for e in g.edges]
        self.edge_ends = tuple(np.array(x, np.int64).reshape(-1) for x in (  # per edge: its ends and value, as arrays
            [e.src[0] for e in g.edges], [e.src[1] for e in g.edges], [e.dst[0] for e in g.edges],
            [e.dst[1] for e in g.edges], self.edge_values))
        degree = np.bincount(np.concatenate([self.edge_ends[0], self.edge_ends[2]]), minlength=len(g.units)).tolist()
        self.weight = lambda k: (g.units[k].weight * g.units[k].flops, degree[k])
        self._kept_values: set = set()
        self.layout_lists: dict[tuple, int] = {}  # a list of layouts (one per candidate) -> its id
        self.tables: dict[tuple[int, int, int], np.ndarray] = {}  # (edge's value, both ends' layout lists) -> its table
        self.keep(int(replicated.argmax()))
        self.runs = self.bisections = 0  # runs made, and of them the bisection's of λ
        self.ties: _Ties | None = None  # the classes of units decided as one, for the values kept now
        self.checks: _Ties | None = None  # ... and those of the boundary check: each unit its own but long runs' middles
        self.unit_classes = self.evaluations = 0  # summed over levels and runs (`SearchReport`)
        self.shared: dict[Group, _Shared] = {}  # per level's axes, what its last level shares with the next run's

    def solved(self, choice: list[Assignment], seconds: float, peak: float, status: str) -> Solved:
        return Solved(choice, seconds, peak, status, self.unit_classes, self.evaluations, self.runs)

    def keep(self, t: int) -> bool:
        """Weighs (with λ) the values held at program point `t` too; whether any was new."""
        new = [v for v in self.g.live_at(t) if v not in self._kept_values]
        for v in new:
            k, pos = self.g.makers[v]
            self.kept[k].append((pos, v))
            self.kept_bytes[k] = tuple((p, value_bytes(x)) for p, x in self.kept[k])
            self._kept_values.add(v)
        if new:
            self.ties = None
        return bool(new)

    def run(self, lam: float) -> tuple[list[Assignment], float]:
        self.runs += 1
        if self.ties is None:
            self.ties, self.checks = _Ties(self, self.replay), None
            if self.ties.replayed:
                _log.debug("replay: %d of %d units in the interior of %d repeated runs, decided as %d",
                          self.ties.replayed, len(self.g.units), self.ties.runs, len(self.ties.reps))
        base: list[Assignment] = [{} for _ in self.g.units]
        for n, group in enumerate(self.levels):
            self.check()
            weighing = f", memory weight {lam:.3g} s/byte (run {self.runs})" if lam else ""
            _log.info("searching: level %d of %d (mesh axes %s), %d units%s", n + 1, len(self.levels),
                      "·".join(group), len(self.g.units), weighing)
            base = self._level(group, base, lam)
        return base, self.g.seconds(base)

    def _level(self, group: Group, base: list[Assignment], lam: float) -> list[Assignment]:
        assert self.ties is not None  # `run` made them
        level = _Level(self, group, base, lam, self.ties)
        picks = level.solve()
        self.unit_classes += level.classes
        self.evaluations += level.evaluations
        picks, barred = self._closed(group, base, lam, level, picks)
        chosen = [level.cands[c][picks[c]] for c in self.ties.of]
        if not self.ties.replayed:
            return chosen
        if self.checks is None:
            self.checks = _Ties.checking(self, self.ties.found)
        return self._checked(group, base, lam, chosen, level, barred)

    def _closed(self, group: Group, base: list[Assignment], lam: float, level: _Level,
                picks: list[int]) -> tuple[list[int], Barred]:
        """`level`'s `picks`, or where closing a combined set they open lowers the level's energy with
        the latency of the sets opened (`_Level.latency`: the energy leaves it out, as a set pays one
        latency whichever units join it), the level's picks moved off that set (its units barred from
        it, the core improved by single and pairwise moves from `picks` and from its min-sum
        messages' picks, which move a block of units off at once: solving the level afresh per set
        doubled the 96-layer step's planning). Closing a set whose units move onto sets `picks`
        leaves closed goes on to close those too (`_closing`). Each round tries every set left and
        closes the one that helps most; the next round tries only the sets a class it moved joins,
        before or after (retrying every set after each closing, as this did before the chain,
        made 38 tries for the 96-layer step's plan; with the chain it makes 35. Closing the first
        set that helps, not the best, misses the ILP's plan on
        `test_recursive_search_closes_the_combined_sets_the_gradients_move_onto`). Returns the
        picks and the sets barred with their toll."""
        best = level.energy(picks) + level.latency(picks)
        toll = 2 * best + TIE  # above the whole level's seconds
        barred: Barred = (frozenset(), toll)
        todo = level.opened(picks)
        while todo:
            found = None
            for s in sorted(todo):
                energy, tried, sets = min(self._closing(level, picks, barred[0] | {s}, toll, best), key=lambda t: t[0])
                if energy < (best if found is None else found[0]):
                    found = (energy, tried, sets)
            if found is None:
                break
            moved = [c for c in level.combinable if found[1][c] != picks[c]]
            touched = {s for c in moved for s in level.joins(c, picks[c]) | level.joins(c, found[1][c])}
            best, picks, barred = found[0], found[1], (found[2], toll)
            todo = (level.opened(picks) - barred[0]) & touched
        return picks, barred

    def _closing(self, level: _Level, picks: list[int], sets: frozenset, toll: float,
                 best: float) -> Iterator[tuple[float, list[int], frozenset]]:
        """`level`'s picks with the combined `sets` closed, improved from `picks` (`_closed`), then,
        while the units barred from them move onto sets `picks` leaves closed (which pays the
        latency again: closing one set of gradients' all-reduces over the data and model axes moved
        them onto the model axis alone) and closing those too could still get below `best` (the
        energy with latency to beat, were their latency all it saved), with those closed too,
        improved from the step before. Yields each step's energy with the latency of the sets
        opened, its picks and the sets barred."""
        opened = level.opened(picks)
        while True:
            other = level.barring((sets, toll))
            picks = other.solve(seed=picks, believed=True)
            self.evaluations += other.evaluations
            energy = level.energy(picks) + level.latency(picks)
            yield energy, picks, sets
            new = frozenset(level.opened(picks) - opened - sets)
            if not new or energy - level.latency(picks, new) >= best:
                return
            sets = sets | new

    def _checked(self, group: Group, base: list[Assignment], lam: float, chosen: list[Assignment],
                 like: _Level, barred: Barred) -> list[Assignment]:
        """The boundary check of a replayed level's choice `chosen` (per unit): on `checks`' classes
        (each unit its own but the middle layers of long runs), single and pairwise moves from it
        until none helps; where no run leaves the check a middle (each unit its own class: the level
        unit by unit), also from the core's min-sum messages' picks, as the level's own search does,
        which move a block of units the replay's ties held together (four sibling parameters'
        updates of one shape, alike to two hops, that no single or pairwise move parts). Where the
        layers beside the middle then differ from it (a change at a boundary carried layer to layer
        into the interior), the middle takes each one's choice and is checked again (`_WAVES`
        rounds at most); the lowest energy is kept."""
        assert self.checks is not None  # `_level` made them
        ties = self.checks
        seeds: list[list[int] | None] = [None]  # None: `chosen`, seated on the level's candidates
        best: tuple[float, _Level, list[int]] | None = None
        seated: dict[tuple[int, int], int] = {}  # `_seat`'s answers by the ids of a choice and a candidate list

        def seat(a: Assignment, cands: list[Assignment]) -> int:
            key = (id(a), id(cands))
            found = seated.get(key)
            if found is None:
                found = seated[key] = _seat(a, group, cands)
            return found

        for _ in range(_WAVES):
            better = False
            for seed in seeds:
                level = _Level(self, group, base, lam, ties, like=like, barred=barred)
                believed = seed is None and not ties.tied  # once: the messages do not read the seed
                if seed is None:
                    seed = [seat(chosen[k], cands) for k, cands in zip(ties.reps, level.cands)]
                picks = level.solve(seed=seed, believed=believed)
                self.evaluations += level.evaluations
                energy = level.energy(picks)
                if best is None or energy < best[0]:
                    best, better = (energy, level, picks), True
            if not better:
                break
            assert best is not None  # `better`: set now
            _, level, picks = best
            cands = level.cands

            def moved(src: int, mid: int) -> int:
                return seat(cands[src][picks[src]], cands[mid])

            beside = (ties.window - 1, -ties.window)  # the layers beside the middle ones
            seeds = [seed for seed in (ties.waved(picks, layer, moved) for layer in beside) if seed != picks]
        assert best is not None  # the first seed set it
        _, level, picks = best
        return [level.cands[c][picks[c]] for c in ties.of]

    def _kept(self, k, a) -> float:
        g = self.g
        total = 0.0
        for pos, v in self.kept.get(k, ()):
            spec = g.spec(k, pos, a)
            cut = 1
            for axes in spec:
                for x in axes:
                    cut *= g.axis_size[x]
            total += value_bytes(v) / cut
        return total


class _Ties:
    """Replay: units decided as one at every level, as a scanned body's one decision stands for every
    iteration (MindSpore's extraction and reuse of repeated subgraphs, here over the search's units).

    An unrolled loop leaves runs of units that repeat with a period in program order: layer `i`'s
    units, then layer `i + 1`'s, the same operators on the same shapes wired the same way (the
    forward blocks, the backward blocks in reverse, the optimizer's update of each layer's
    parameters). Each unit gets a colour (its structure and the bytes it keeps at the peak, refined
    `_ROUNDS` times by its neighbours' colours and the values between them); a run is a stretch where
    every unit's colour equals the one a period later, `2 * _WINDOW + 2` periods or more. Its first
    and last `_WINDOW` periods (the boundary layers, beside what does not repeat: the embedding, the
    loss) are decided freely; the same position of every interior period is one class, a unit of the
    level whose costs and tables are its members' summed (an edge inside a class on the diagonal:
    both ends take the one pick). So a level's energy under a choice is exactly the program's with
    every interior layer taking the class's pick: the level's search (its eliminations, the core's
    pinned roots and moves) is flat in the number of layers, and the interior layers replay one
    layer's decisions. The replayed choice is then checked (`_Recursive._checked`, on the classes
    `checking` makes): every unit its own class again but the middle layers of long runs, single and
    pairwise moves from it until none helps, so a boundary layer, or the middle ones, that gain by
    differing from the replayed choice do.

    Attributes:
      found: the repeated runs found, `(first unit, period, repeats)` (`_runs`).
      tied: those long enough to tie two layers or more, `window` layers from each end left alone.
      runs: how many they are.
      replayed: the units in their interior layers (0: every unit is its own class).
      of: per unit its class; classes are numbered in the order of their first units.
      reps: per class its first unit.
      count: per class its number of units.
      edges: per (class, operand, class, operand, value) of the edges between them, one edge's index
        and how many there are.
    """

    def __init__(self, search: _Recursive, replay: bool = True):
        g = search.g
        found = []
        if replay and g.edges:
            kinds: dict[tuple, int] = {}
            colour = np.array([kinds.setdefault((g.shape_of_unit[k], search.kept_bytes.get(k)), len(kinds))
                               for k in range(len(g.units))], np.int64)
            found = _runs(self._refined(search, colour))
        self._tie(search, found, _WINDOW)

    @classmethod
    def checking(cls, search: _Recursive, found: list[tuple[int, int, int]]) -> _Ties:
        """The boundary check's classes: the runs `found` for the replay, each unit its own class but
        the middle layers of runs long enough to leave two, `_WINDOW + _MARGIN` layers from each end."""
        ties = cls.__new__(cls)
        ties._tie(search, found, _WINDOW + _MARGIN)
        return ties

    def _tie(self, search: _Recursive, found: list[tuple[int, int, int]], window: int) -> None:
        g = search.g
        n = len(g.units)
        self.found, self.window = found, window
        runs = self.tied = [r for r in found if r[2] - 2 * window >= 2]  # two interior layers at least
        ties = np.arange(n)
        for start, period, repeats in runs:
            block = start + period * np.arange(window, repeats - window)[:, None] + np.arange(period)
            ties[block] = block[0]  # an interior layer's unit -> the first interior layer's
        self.runs = len(runs)
        self.replayed = int((ties != np.arange(n)).sum() + sum(period for _, period, _ in runs))
        _, first, inverse = np.unique(ties, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")
        rank = np.empty(len(order), np.int64)
        rank[order] = np.arange(len(order))
        self.of: list[int] = rank[inverse.ravel()].tolist()
        self.reps: list[int] = first[order].tolist()
        self.count: list[int] = np.bincount(rank[inverse.ravel()], minlength=len(order)).tolist()
        self.edges: dict[tuple, tuple[int, int]] = {}  # in the order of their first edges
        src, src_pos, dst, dst_pos, value = search.edge_ends
        if len(value):
            of = rank[inverse.ravel()]
            keys, first, times = np.unique(np.stack([of[src], src_pos, of[dst], dst_pos, value], 1), axis=0,
                                           return_index=True, return_counts=True)
            order = np.argsort(first, kind="stable")
            self.edges = dict(zip(map(tuple, keys[order].tolist()), zip(first[order].tolist(), times[order].tolist())))

    def waved(self, picks: list[int], layer: int, moved: Callable[[int, int], int]) -> list[int]:
        """`picks` (one per class) with the middle layers' class of each position of each tied run
        taking `moved(source, middle)`: the pick that gives the level's axes where the class of
        the same position in the run's `layer`-th layer (from its end where negative) gives them."""
        out, of = list(picks), self.of
        for start, period, repeats in self.tied:
            source, middle = start + (layer % repeats) * period, start + self.window * period
            for j in range(period):
                out[of[middle + j]] = moved(of[source + j], of[middle + j])
        return out

    @staticmethod
    def _refined(search: _Recursive, colour: np.ndarray) -> np.ndarray:
        """`colour` refined `_ROUNDS` times (Weisfeiler-Lehman, hashed in numpy): each unit takes in the
        multiset of its neighbours' colours with the values and operand positions between them."""
        g, n = search.g, len(colour)
        types: dict[tuple, int] = {}
        kind = np.array([types.setdefault((value, e.src[1], e.dst[1]), len(types))
                         for e, value in zip(g.edges, search.edge_values)], np.uint64)
        src, _, dst, _, _ = search.edge_ends
        out_kind, in_kind = _mix(kind * np.uint64(2)), _mix(kind * np.uint64(2) + np.uint64(1))
        for _ in range(_ROUNDS):
            heard = np.zeros(n, np.uint64)  # a multiset's hash: the sum of its members' hashes
            np.add.at(heard, src, _mix(out_kind ^ colour[dst].astype(np.uint64)))
            np.add.at(heard, dst, _mix(in_kind ^ colour[src].astype(np.uint64)))
            _, heard = np.unique(heard, return_inverse=True)
            _, colour = np.unique(colour * n + heard.ravel(), return_inverse=True)  # refines: never merges
            colour = colour.ravel()
        return colour


def _runs(colour: np.ndarray) -> list[tuple[int, int, int]]:
    """The periodic runs of `colour` (program order): `(start, period, repeats)`, each stretch where
    every entry equals the one `period` later for at least `2 * _WINDOW + 2` periods, without overlap;
    the periods tried are the commonest gaps between a colour's consecutive units, the run covering
    the most units first."""
    n = len(colour)
    order = np.lexsort((np.arange(n), colour))
    gaps = np.diff(order)[colour[order][1:] == colour[order][:-1]]
    periods, counts = np.unique(gaps, return_counts=True)
    least = 2 * _WINDOW + 2
    tried = periods[np.argsort(-counts, kind="stable")][:_PERIODS]
    free = np.ones(n, bool)
    found = []
    while True:
        best = None
        for period in tried.tolist():
            same = np.zeros(n + 1, bool)
            same[:n - period] = (colour[:-period] == colour[period:]) & free[:-period] & free[period:]
            edges = np.flatnonzero(np.diff(np.concatenate([[False], same])))  # starts and ends of True stretches
            for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
                repeats = (b - a + period) // period
                if repeats >= least and (best is None or repeats * period > best[1] * best[2]):
                    best = (a, period, repeats)
        if best is None:
            return found
        start, period, repeats = best
        free[start:start + period * repeats] = False
        found.append(best)


def _seat(a: Assignment, group: Group, cands: Sequence[Assignment]) -> int:
    """The candidate among `cands` that gives the level's axes (`group`) where `a` gives them: to
    the same factor, or to none (the first candidate where none does). A unit's candidates differ
    with its base, so a choice made for another unit of its kind is read as where the axes went."""
    given = next((fac for fac, axes in a.items() if group[0] in axes), None)
    return next((n for n, c in enumerate(cands) if next((fac for fac, axes in c.items() if group[0] in axes), None)
                 == given), 0)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on an array of uint64 (wrapping arithmetic): a hash of each entry."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class _Shared:
    """What one level's units of one kind (one structure on one base: the same operator of identical
    layers) share, whichever classes `_Ties` makes of them: their candidates, the layouts they give
    an operand, their own costs and the tables of the edges between kinds. The replayed level and its
    boundary check (every unit its own class) weigh the same units on the same base, so the second
    reads what the first computed."""

    def __init__(self, search: _Recursive, group: Group, base: list[Assignment], lam: float,
                 past: _Shared | None = None):
        self.g, self.group, self.base = search.g, group, base
        self._by_id: dict[tuple[int, int], int] = {}  # (unit structure, id() of its base assignment) -> kind
        self.own: dict[tuple, np.ndarray]  # (kind, bytes it keeps) -> its unary, at λ
        if past is not None:  # the same axes in an earlier run: all but its base and λ's costs read again
            self.__dict__.update({k: v for k, v in past.__dict__.items() if k not in ("base", "_by_id", "own")})
            self.own = self._own.setdefault(lam, {})
            return
        self._layout_lists, self._tables = search.layout_lists, search.tables  # the search's: every run's
        self._kinds: dict[tuple, int] = {}  # (unit structure, base assignment's items) -> kind
        self._cands: dict[int, list[Assignment]] = {}  # kind -> its candidates
        self.specs: dict[tuple[int, int], list] = {}  # (kind, operand) -> its layout under each candidate
        self._specs_id: dict[tuple[int, int], int] = {}  # ... and that list's id (`_Recursive.layout_lists`)
        self.moves: dict[tuple, np.ndarray] = {}  # (edge's value, both ends' (kind, operand)) -> the edge's table
        self._own: dict[float, dict] = {}  # λ -> `own`
        self.own = self._own.setdefault(lam, {})
        self.folds: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # `_Level._fold`'s, by the arrays' bytes
        # The core's classes and cost evaluations (`_Level._prepare_core`), by contents: a level
        # barred from another (`_Recursive._closed`), its boundary check or the same axes' level of a
        # later run (another λ, or another base) holds mostly the same arrays, so its core reads what
        # the levels before it evaluated.
        self.contents: dict[tuple, int] = {}  # an array's shape and bytes -> its id
        self.seen: dict[tuple[int, bool], tuple[np.ndarray, int]] = {}  # (id(), transposed) -> the array, held, and its id
        self.classes: dict[tuple, int] = {}  # a core unit's contents -> its class
        self.locals: dict[tuple, tuple[np.ndarray, int, tuple, tuple[bool, ...]]] = {}  # `_Level._local`'s
        self.pairs: dict[tuple, tuple[int, int] | None] = {}  # `_Level._pair`'s

    def kinds(self, units: Sequence[int]) -> list[int]:
        """Each unit's kind. A base assignment is one of few dicts (the candidates picked), all held by
        `base`, so its id() stands for its items while this level lives."""
        shape, base, by_id = self.g.shape_of_unit, self.base, self._by_id
        out = []
        for k in units:
            key = (shape[k], id(base[k]))
            found = by_id.get(key)
            if found is None:
                items = (shape[k], tuple(sorted(base[k].items())))
                found = by_id[key] = self._kinds.setdefault(items, len(self._kinds))
            out.append(found)
        return out

    def candidates(self, k: int, kind: int) -> list[Assignment]:
        found = self._cands.get(kind)
        if found is None:
            found = self._cands[kind] = self.g.candidates(k, [self.group], self.base[k])
        return found

    def specs_of(self, k: int, key: tuple[int, int]) -> list:
        """The layouts unit `k` (of kind `key[0]`) gives its operand `key[1]`, per candidate."""
        found = self.specs.get(key)
        if found is None:
            found = self.specs[key] = [self.g.spec(k, key[1], a) for a in self._cands[key[0]]]
        return found

    def table(self, i: int, value: int, k: int, mine: tuple[int, int], j: int, theirs: tuple[int, int]) -> np.ndarray:
        """Edge `i`'s table of redistribution seconds (its `value`, `_Recursive.edge_values`), from unit
        `k` (of kind and operand `mine`) to unit `j` (`theirs`), indexed by their candidates. A table
        reads only the value and the two lists of layouts, so units of other kinds, on this level or
        another, that give the same lists share it (`_Recursive.tables`): made once per search."""
        key = (value, self._layouts_id(k, mine), self._layouts_id(j, theirs))
        found = self._tables.get(key)
        if found is None:
            g, e = self.g, self.g.edges[i]
            found = self._tables[key] = np.array([[g.edge_seconds(e, x, y) for y in self.specs[theirs]]
                                                  for x in self.specs[mine]])
        return found

    def _layouts_id(self, k: int, key: tuple[int, int]) -> int:
        found = self._specs_id.get(key)
        if found is None:
            lists = self._layout_lists
            found = self._specs_id[key] = lists.setdefault(tuple(self.specs_of(k, key)), len(lists))
        return found


class _Eliminated:
    """A level's eliminations (`_Level._eliminate`) as recorded, for a level barred from it to
    replay (`_Level._replay`).

    Attributes:
      start / tables_built: the level's own costs and tables as built (`_Level._whole`).
      steps: per step, the unit eliminated and its neighbours then (none, one or two), in order.
      at: per eliminated unit (not one of a single candidate), its step.
      used: per table (by its ends), the step that folded it.
      inputs: per step, the unit's costs and its tables (`[c_k, c_neighbour]`) it folded.
      unary_parts / table_parts: per unit's costs, per table, the parts added to it as built, in
        order: `(step, array)`, step -1 for a table of a unit with a single candidate.
      record_of: per step of one or two neighbours, its index in `records`.
      unary, tables, nbrs, picks, records, core: the level once eliminated; table_at: each of its
        tables' place in `tables`; prepared: its core as `_Level._prepare_core` made it.
    """

    def __init__(self, whole: tuple[list, list]):
        self.start, self.tables_built = whole[0], dict(whole[1])
        self.steps: list[tuple[int, list[int]]] = []
        self.at: dict[int, int] = {}
        self.used: dict[tuple[int, int], int] = {}
        self.inputs: list[tuple[np.ndarray, ...]] = []
        self.unary_parts: dict[int, list] = collections.defaultdict(list)
        self.table_parts: dict[tuple[int, int], list] = collections.defaultdict(list)
        self.record_of: dict[int, int] = {}
        self.prepared: tuple | None = None

    @staticmethod
    def summed(parts: Sequence[tuple[int, np.ndarray]], found: np.ndarray | None,
               redone: dict[int, tuple]) -> np.ndarray:
        """`found` (None: no table yet) with `parts` added in their order, as eliminating added them;
        a step's part read from `redone` where it was folded again."""
        for n, part in parts:
            part = redone[n][0] if n in redone else part
            found = part if found is None else found + part
        assert found is not None  # a table folded had a part at least
        return found

    def close(self, level: _Level, core: list[int]) -> None:
        self.unary, self.tables, self.nbrs = list(level.unary), dict(level.tables), level.nbrs
        self.picks, self.records, self.core, self.core_set = dict(level.picks), list(level.records), core, set(core)
        self.table_at = {key: n for n, key in enumerate(level.tables)}


class _Level:
    """One level as a pairwise energy: `unary[k][c]`, unit `k`'s own seconds and λ·bytes kept under
    its candidate `c`, plus one table `[c_a, c_b]` of redistribution seconds per pair of
    neighbouring units.

    `solve` first eliminates what it can exactly (MindSpore's dynamic-programming eliminations): a
    unit with one candidate folds into its neighbours, one with one neighbour folds its best answer
    to each of the neighbour's candidates into the neighbour, one with two neighbours becomes a
    table between them. Chains (an optimizer's elementwise update, a layer's activations) collapse
    this way, so a cut the chain would pay for at both ends is weighed as one decision. The core
    that is left (units with three or more neighbours) is searched heuristically: the axis unused,
    then each of the heaviest units pinned to each of its candidates and the rest decided in program
    order, each improved by single and pairwise moves until none helps; the eliminated units then
    take their best answers to the core's choice.

    The level's units are the classes of `ties` (`_Ties`): a class of replayed layers is one unit
    with its members' costs and tables summed; where nothing repeats, each unit is its own class.
    """

    def __init__(self, search: _Recursive, group: Group, base: list[Assignment], lam: float, ties: _Ties,
                 like: _Level | None = None, barred: Barred = (frozenset(), 0.0)):
        g = self.g = search.g
        self.search = search
        self.ties = ties  # the level's units are its classes (one unit each where nothing repeats)
        self.reps, count = ties.reps, ties.count
        # Units of one structure on one base (identical layers) share their candidates, costs and
        # tables; `like` (a level on the same base, axes and λ) lends what it computed of them.
        shared = self._shared = (_Shared(search, group, base, lam, search.shared.get(group)) if like is None
                                 else like._shared)
        search.shared[group] = shared
        kinds = shared.kinds(self.reps)
        self.cands = [shared.candidates(k, kind) for k, kind in zip(self.reps, kinds)]
        own, kept = shared.own, search.kept_bytes
        known = [own.get((kinds[c], kept.get(k))) for c, k in enumerate(self.reps)]  # `_unary`, where known
        self.unary: list[np.ndarray] = []
        for c, found in enumerate(known):
            if found is None:
                found = self._unary(c, kinds[c], lam)
            self.unary.append(found * count[c] if count[c] > 1 else found)
        self.combinable = [c for c, k in enumerate(self.reps) if k in g.combinable]
        self._bar(barred)
        self.tables: dict[tuple[int, int], np.ndarray] = {}
        self.nbrs: dict[int, set[int]] = collections.defaultdict(set)
        tables, nbrs, unary, moves = self.tables, self.nbrs, self.unary, shared.moves
        for (u, pu, v, pv, value), (i, times) in ties.edges.items():  # `_add`, inlined: the loop is per edge
            key = (value, (kinds[u], pu), (kinds[v], pv))
            table = moves.get(key)
            if table is None:
                table = moves[key] = shared.table(i, value, self.reps[u], key[1], self.reps[v], key[2])
            if times > 1:
                table = table * times
            if u == v:  # both ends take the class's one pick
                unary[u] = unary[u] + np.diag(table)
                continue
            if u > v:
                u, v, table = v, u, table.T
            found = tables.get((u, v))
            tables[(u, v)] = table if found is None else found + table
            nbrs[u].add(v)
            nbrs[v].add(u)
        self._whole = (list(unary), list(tables.items()))  # what `energy` reads: eliminating consumes them
        self._flat_whole: tuple | None = None  # ... as flat arrays, once read
        self.picks: dict[int, int] = {}
        self.records: list[tuple] = []
        self._eliminated: _Eliminated | None = None  # recorded by `_eliminate`
        self._replays: _Eliminated | None = None  # ... or replayed (`barring`)
        self._touched: tuple[set[int], set[tuple[int, int]]] = (set(), set())  # ... and what that changed in the core
        self.classes = self.evaluations = 0  # the core's distinct units and their cost evaluations

    def barring(self, barred: Barred) -> _Level:
        """A level on this one's base with the combined sets `barred[0]` barred by the toll
        `barred[1]` on each candidate of a class that joins one: its own costs and tables as built
        (`_whole`, before eliminating) copied, not rebuilt, as `_Recursive._closed` tries set after
        set on one level; where this level was eliminated, the copy replays its eliminations and
        patches its core where the tolls reach (`_replay`, `_patch_core`) rather than redoing them."""
        other = object.__new__(_Level)
        other.__dict__.update(self.__dict__)
        unary, tables = self._whole
        other.unary, other.tables = list(unary), dict(tables)
        other._replays = self._eliminated  # where this level was eliminated: replayed, not redone
        other.nbrs = collections.defaultdict(set)
        for a, b in other.tables if other._replays is None else ():
            other.nbrs[a].add(b)
            other.nbrs[b].add(a)
        other._bar(barred)
        other._whole, other._flat_whole = (list(other.unary), list(other.tables.items())), None
        other.picks, other.records, other.classes, other.evaluations = {}, [], 0, 0
        return other

    def _bar(self, barred: Barred) -> None:
        """Adds `barred`'s toll to each candidate of a combinable class that joins a barred set."""
        if barred[0]:
            for c in self.combinable:
                toll = np.array([barred[1] if self.joins(c, n) & barred[0] else 0.0 for n in range(len(self.cands[c]))])
                self.unary[c] = self.unary[c] + toll

    def joins(self, c: int, pick: int) -> set[tuple]:
        """The combined sets (`SearchGraph.combined_set`) class `c` joins under its candidate `pick`."""
        g, k = self.g, self.reps[c]
        return {g.combined_set(k, axes) for axes in g.partial_sums(k, self.cands[c][pick])}

    def opened(self, picks: Sequence[int]) -> set[tuple]:
        """The combined sets the combinable classes open under `picks` (one per class)."""
        return {s for c in self.combinable for s in self.joins(c, picks[c])}

    def latency(self, picks: Sequence[int], of: frozenset | None = None) -> float:
        """The latency the combined sets opened under `picks` (those of `of`, where given) pay: one
        per set and run (`SearchGraph.sets_latency`), which the level's energy leaves out."""
        g = self.g
        return g.sets_latency({s: g.units[self.reps[c]].weight for c in self.combinable
                               for s in self.joins(c, picks[c]) if of is None or s in of})

    def weight(self, c: int) -> tuple[float, int]:
        """The order the core tries its heaviest units in: a class's first unit's compute and degree,
        as if it were alone (the program's heaviest operator first, whether or not it repeats)."""
        return self.search.weight(self.reps[c])

    def energy(self, picks: Sequence[int]) -> float:
        """The level's energy under `picks` (one per class): own costs and tables, as built, each
        summed in order (`np.cumsum` adds one entry after another, as `sum` does)."""
        if not len(picks):  # no unit: nothing to sum (the flat arrays need one)
            return 0.0
        if self._flat_whole is None:  # read once per level: `_Recursive._closed` weighs it per set tried
            unary, tables = self._whole
            starts = np.cumsum([0] + [len(u) for u in unary[:-1]])
            shapes = [t.shape for _, t in tables]
            self._flat_whole = (np.concatenate(unary), starts, np.array([a for (a, _), _ in tables], int),
                                np.array([b for (_, b), _ in tables], int),
                                np.cumsum([0] + [r * c for r, c in shapes[:-1]]).astype(int),
                                np.array([c for _, c in shapes], int),
                                np.concatenate([t.ravel() for _, t in tables]) if tables else np.zeros(0))
        flat, starts, a, b, offset, width, flat_tables = self._flat_whole
        picked = np.asarray(picks)
        total = np.cumsum(flat[starts + picked])[-1]
        return total + np.cumsum(flat_tables[offset + picked[a] * width + picked[b]])[-1] if len(a) else total

    def _unary(self, c: int, kind: int, lam: float) -> np.ndarray:
        """Class `c`'s first unit's own seconds and λ·bytes it keeps at the peak, under each candidate."""
        search, cands, k = self.search, self.cands[c], self.reps[c]
        kept = search.kept_bytes.get(k)
        own = self._shared.own
        found = own.get((kind, kept))
        if found is None:
            if kept is None:
                found = np.array([self.g.unit_seconds(k, a) + 0.0 for a in cands])
            else:
                w = max(lam, TIE)
                found = np.array([self.g.unit_seconds(k, a) + w * search._kept(k, a) for a in cands])
            own[(kind, kept)] = found
        return found

    def _add(self, a: int, b: int, table: np.ndarray) -> None:
        if a > b:
            a, b, table = b, a, table.T
        found = self.tables.get((a, b))
        self.tables[(a, b)] = table if found is None else found + table
        self.nbrs[a].add(b)
        self.nbrs[b].add(a)

    def _table(self, k: int, j: int) -> np.ndarray:
        """The table between `k` and `j`, indexed `[c_k, c_j]`."""
        return self.tables[(k, j)] if k < j else self.tables[(j, k)].T

    def solve(self, seed: list[int] | None = None, believed: bool = False) -> list[int]:
        """Each unit's pick: the eliminations, then the core searched, or with `seed` (a pick per
        unit) the seed's core improved by single and pairwise moves, and with `believed` also the
        core's min-sum messages' picks (`_believed`) improved so, the cheaper kept; the eliminated
        units answer."""
        core = self._eliminate()
        if seed is None:
            self.picks.update(self._search_core(core))
        elif core:
            self._prepare_core(core)
            choice = {k: seed[k] for k in core}
            self._improve(core, choice, set(), pairs=True)
            if believed:
                other = self._believed(core)
                self._improve(core, other, set(), pairs=True)
                choice = min((choice, other), key=self._energy)
            self.evaluations = len(self._locals) + len(self._pairs) - self._known
            self.picks.update(choice)
        for record in reversed(self.records):
            k, how, *rest = record
            if how == "one":
                j, best = rest
                self.picks[k] = int(best[self.picks[j]])
            else:
                a, b, best = rest
                self.picks[k] = int(best[self.picks[a], self.picks[b]])
        return [self.picks[k] for k in range(len(self.cands))]

    def _eliminate(self) -> list[int]:
        """The eliminations (the class docstring's): units with one candidate, one neighbour or two
        fold into their neighbours, recorded (`_Eliminated`) so that a level barred from it replays
        them on its changed costs alone (`_replay`); returns the core left."""
        self._folds = self._shared.folds
        if self._replays is not None:
            return self._replay(self._replays)
        gone: set[int] = set()
        done = self._eliminated = _Eliminated(self._whole)
        steps, inputs, unary_parts, table_parts = done.steps, done.inputs, done.unary_parts, done.table_parts
        tables, nbrs, unary, records, fold = self.tables, self.nbrs, self.unary, self.records, self._fold
        for k, cands in enumerate(self.cands):
            if len(cands) == 1:  # nothing to decide: its tables become its neighbours' own costs
                for j in nbrs[k]:
                    part = tables[(j, k)][:, 0] if j < k else tables[(k, j)][0]
                    unary[j] = unary[j] + part
                    unary_parts[j].append((-1, part))  # from a table as built: the same in a barred level
                    del tables[(j, k) if j < k else (k, j)]
                    nbrs[j].discard(k)
                nbrs[k].clear()
                self.picks[k] = 0
                gone.add(k)
        queue = collections.deque(k for k in range(len(self.cands)) if k not in gone and len(nbrs[k]) <= 2)
        while queue:  # `_table` and `_drop`, inlined: the loop is per unit
            k = queue.popleft()
            around = nbrs[k]
            if k in gone or len(around) > 2:
                continue
            ends = sorted(around)
            n = done.at[k] = len(steps)
            steps.append((k, ends))
            if not ends:
                self.picks[k] = int(unary[k].argmin())
                inputs.append((unary[k],))
            elif len(ends) == 1:
                (j,) = ends
                done.used[(k, j) if k < j else (j, k)] = n
                t = tables.pop((k, j)) if k < j else tables.pop((j, k)).T
                inputs.append((unary[k], t))
                least, best = fold(k, t)
                unary[j] = unary[j] + least
                unary_parts[j].append((n, least))
                done.record_of[n] = len(records)
                records.append((k, "one", j, best))
                nbrs[j].discard(k)
            else:
                a, b = ends
                done.used[(k, a) if k < a else (a, k)] = done.used[(k, b) if k < b else (b, k)] = n
                ta = tables.pop((k, a)) if k < a else tables.pop((a, k)).T
                tb = tables.pop((k, b)) if k < b else tables.pop((b, k)).T
                inputs.append((unary[k], ta, tb))
                least, best = fold(k, ta, tb)
                done.record_of[n] = len(records)
                records.append((k, "two", a, b, best))
                table_parts[(a, b)].append((n, least))
                nbrs[a].discard(k)
                nbrs[b].discard(k)
                self._add(a, b, least)
            around.clear()
            gone.add(k)
            queue.extend(ends)
        core = [k for k in range(len(self.cands)) if k not in gone]
        done.close(self, core)
        return core

    def _replay(self, done: _Eliminated) -> list[int]:
        """The eliminations `done` recorded on a level this one was barred from, replayed where this
        level's own costs differ from that one's (`_bar`'s tolls): only the steps a changed cost
        reaches are folded again, each slot's parts summed again in the recorded order, so the core,
        its costs and tables and the eliminated units' answers are those eliminating afresh gives.
        A level's combined sets are few and tried one after another (`_Recursive._closed`): a
        barred level changes a few classes of thousands."""
        start = self.unary  # as built, with the tolls
        unary, tables = list(done.unary), dict(done.tables)
        self.unary, self.tables, self.nbrs = unary, tables, done.nbrs
        self.picks, self.records = dict(done.picks), list(done.records)
        redone: dict[int, tuple] = {}  # step -> its outputs, folded again
        unary_now: dict[int, np.ndarray] = {}
        tables_now: dict[tuple[int, int], np.ndarray] = {}

        def unary_of(u: int) -> np.ndarray:
            if u not in unary_now:
                unary_now[u] = unary[u] = done.summed(done.unary_parts.get(u, ()), start[u], redone)
            return unary_now[u]

        def table_of(key: tuple[int, int]) -> np.ndarray:
            if key not in tables_now:
                found = tables_now[key] = done.summed(done.table_parts.get(key, ()), done.tables_built.get(key), redone)
                if key in tables:
                    tables[key] = found
            return tables_now[key]

        changed = {u for u, (now, was) in enumerate(zip(start, done.start)) if now is not was}
        stale: set[tuple[int, int]] = set()
        heap = [done.at[u] for u in changed if u in done.at]
        heapq.heapify(heap)
        while heap:
            n = heapq.heappop(heap)
            if n in redone:
                continue
            k, ends = done.steps[n]
            recorded = done.inputs[n]
            uk = unary_of(k) if k in changed else recorded[0]
            if not ends:
                redone[n] = (None,)
                self.picks[k] = int(uk.argmin())
                continue
            given = []
            for j, t in zip(ends, recorded[1:]):
                key = (k, j) if k < j else (j, k)
                given.append(t if key not in stale else table_of(key) if k < j else table_of(key).T)
            unary[k] = uk
            least, best = redone[n] = self._fold(k, *given)
            if len(ends) == 1:
                self.records[done.record_of[n]] = (k, "one", ends[0], best)
                changed.add(ends[0])
                follow = done.at.get(ends[0])
            else:
                self.records[done.record_of[n]] = (k, "two", ends[0], ends[1], best)
                stale.add((ends[0], ends[1]))
                follow = done.used.get((ends[0], ends[1]))
            if follow is not None:
                heapq.heappush(heap, follow)
        for u in changed:
            unary_of(u)
        for key in stale:
            table_of(key)
        self._touched = (changed & done.core_set, stale & tables.keys())  # what `_prepare_core` reads again
        return list(done.core)

    def _fold(self, k: int, *tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unit `k` eliminated between one or two neighbours (`tables`, `[c_k, c_neighbour]`): its
        least cost and best candidate per neighbour pick (a table between two neighbours); once per
        class of inputs (the same operator of identical layers folds the same arrays)."""
        t = tables[0]
        key = ((self.unary[k].tobytes(), t.shape, t.tobytes()) if len(tables) == 1 else
               (self.unary[k].tobytes(), t.shape, t.tobytes(), tables[1].shape, tables[1].tobytes()))
        found = self._folds.get(key)
        if found is None:
            if len(tables) == 1:
                m = self.unary[k][:, None] + tables[0]
            else:
                m = self.unary[k][:, None, None] + tables[0][:, :, None] + tables[1][:, None, :]
            found = self._folds[key] = (m.min(0), m.argmin(0))
        return found

    # -- the core: heuristic ------------------------------------------------------------------
    def _energy(self, choice: dict[int, int]) -> float:
        """The core's energy under `choice`, summed in the order `choice` and the tables hold."""
        units = np.fromiter(choice.keys(), int, len(choice))
        picks = np.fromiter(choice.values(), int, len(choice))
        total = sum(self._flat[self._offset[units] + picks].tolist())
        self._picked[units] = picks
        a, b, offset, width = self._ends
        return total + sum(self._flat_tables[offset + self._picked[a] * width + self._picked[b]].tolist())

    def _local(self, k: int, choice: dict[int, int]) -> tuple[np.ndarray, int, tuple, tuple[bool, ...]]:
        """Unit `k`'s own cost per candidate against its neighbours decided in `choice`, its
        cheapest candidate, the entry's key and, per candidate, whether the cheapest costs less. Units of one class (the same costs and tables: one operator of
        identical layers) with the same neighbours' picks share one entry of `_locals`, so
        identical layers are weighed once."""
        key = (self._class[k], tuple(map(choice.get, self._ids[k])))  # None: not decided yet
        found = self._locals.get(key)
        if found is None:
            cost = self.unary[k]
            for j, t in self.around[k]:
                if j in choice:
                    cost = cost + t[:, choice[j]]
            c = int(cost.argmin())
            found = self._locals[key] = (cost, c, key, tuple(bool(cost[c] < x) for x in cost))
        return found

    def _prepare_core(self, core: list[int]) -> None:
        """The core's neighbourhoods, each unit's class (its own costs and tables, as bytes) and
        the flat arrays `_energy` reads; a replayed level's (`_replay`) patched from its level's
        where its costs or tables changed."""
        shared = self._shared
        self._locals, self._pairs = shared.locals, shared.pairs
        self._known = len(self._locals) + len(self._pairs)  # evaluated before: `evaluations` counts what this adds
        self._picked = np.zeros(len(self.cands), int)
        if self._replays is not None and self._replays.prepared is not None:
            self._patch_core(self._replays)
            return
        tables, nbrs = self.tables, self.nbrs
        self._ids = {k: tuple(sorted(nbrs[k])) for k in core}
        self.around = {k: [(j, tables[(k, j)] if k < j else tables[(j, k)].T) for j in ids]  # `_table`, inlined
                       for k, ids in self._ids.items()}
        self._table_class = [self._content(t) for t in tables.values()]
        self._class = {k: self._class_of(k) for k in core}
        n = len(self.cands)
        self._offset = np.zeros(n, int)
        self._offset[core] = np.cumsum([0] + [len(self.unary[k]) for k in core[:-1]])
        self._flat = np.concatenate([self.unary[k] for k in core])
        tables = list(self.tables.values())
        sizes = [t.size for t in tables]
        self._flat_tables = np.concatenate([t.ravel() for t in tables]) if tables else np.zeros(0)
        self._ends = (np.array([a for a, _ in self.tables], int), np.array([b for _, b in self.tables], int),
                      np.cumsum([0] + sizes[:-1]).astype(int), np.array([t.shape[1] for t in tables], int))
        if self._eliminated is not None and self._replays is None:  # for the levels barred from this one
            self._eliminated.prepared = (self._ids, self.around, self._table_class, self._class, self._offset,
                                         self._flat, self._flat_tables, self._ends)

    def _patch_core(self, done: _Eliminated) -> None:
        """`_prepare_core` for a replayed level: its level's core (`done.prepared`) with the costs
        and tables the replay changed (`_touched`) read again, and the classes of the units they reach."""
        assert done.prepared is not None  # `_prepare_core` calls this only then
        ids, around, table_class, classes, self._offset, flat, flat_tables, self._ends = done.prepared
        self._ids, self.around, self._table_class, self._class = ids, dict(around), list(table_class), dict(classes)
        self._flat, self._flat_tables = flat.copy(), flat_tables.copy()
        units, stale = self._touched
        tables, offset, starts = self.tables, self._offset, self._ends[2]
        for key in stale:
            n, t = done.table_at[key], tables[key]
            self._table_class[n] = self._content(t)
            self._flat_tables[starts[n]:starts[n] + t.size] = t.ravel()
        for k in units:
            self._flat[offset[k]:offset[k] + len(self.unary[k])] = self.unary[k]
        for k in units | {k for key in stale for k in key}:
            self.around[k] = [(j, tables[(k, j)] if k < j else tables[(j, k)].T) for j in ids[k]]
            self._class[k] = self._class_of(k)

    def _content(self, t: np.ndarray, transposed: bool = False) -> int:
        """The id of array `t`'s (transposed) shape and bytes, among the level's and those on its base
        (`_Shared`), read once per array held."""
        seen = self._shared.seen
        found = seen.get((id(t), transposed))
        if found is None:
            x = t.T if transposed else t
            contents = self._shared.contents
            found = seen[(id(t), transposed)] = (t, contents.setdefault((x.shape, x.tobytes()), len(contents)))
        return found[1]

    def _class_of(self, k: int) -> int:
        """Core unit `k`'s class: its own costs' and its tables' contents."""
        tables, content = self.tables, self._content
        classes = self._shared.classes
        key = (content(self.unary[k]), tuple(content(tables[(k, j)]) if k < j else content(tables[(j, k)], True)
                                             for j in self._ids[k]))
        return classes.setdefault(key, len(classes))

    def _search_core(self, core: list[int]) -> dict[int, int]:
        if not core:
            return {}
        self._prepare_core(core)
        self.classes = len(set(self._class.values()))
        weight = self.weight
        heaviest = max(weight(k)[0] for k in core)
        roots = [k for k in sorted(core, key=weight, reverse=True) if weight(k)[0] >= _HEAVY * heaviest][:_ROOTS]
        unused = dict.fromkeys(core, 0)
        best = (self._energy(unused), unused)
        start = dict(unused)
        self._improve(core, start, set(), pairs=False)
        best = min(best, (self._energy(start), start), key=lambda t: t[0])
        pinned: dict[int, int] = {}
        for root in roots:
            found = None
            for c in range(len(self.cands[root])):
                choice = self._spread(core, {**pinned, root: c})
                self._improve(core, choice, set(pinned) | {root}, pairs=False)
                total = self._energy(choice)
                if found is None or total < found[0]:
                    found = (total, choice, c)
            assert found is not None  # every unit has a candidate
            pinned[root] = found[2]
            choice = found[1]
            self._improve(core, choice, set(pinned), pairs=True)  # the root's best, polished with pairwise moves
            total = self._energy(choice)
            if total < best[0]:
                best = (total, choice)
        choice = self._believed(core)
        self._improve(core, choice, set(), pairs=True)
        best = min(best, (self._energy(choice), choice), key=lambda t: t[0])
        self.evaluations = len(self._locals) + len(self._pairs) - self._known
        return best[1]

    def _believed(self, core: list[int]) -> dict[int, int]:
        """Each core unit's cheapest candidate under min-sum message passing (loopy belief
        propagation) over the core's tables: every unit tells each neighbour, per candidate of the
        neighbour, the least it adds given what its other neighbours told it, `_BELIEFS` rounds at
        most or until no message changes. Exact on a tree; on the core's cycles it weighs a change
        of many units at once (a block of operators moving from the batch to the experts' dim, which
        no single or pairwise move finds), so it is one more start of the core search."""
        if not self.tables:
            return {k: int(self.unary[k].argmin()) for k in core}
        at = {k: n for n, k in enumerate(core)}
        width = max(len(self.unary[k]) for k in core)
        far = 2.0 ** 100  # a missing candidate (units have fewer than `width`): never the least
        unary = np.full((width, len(core)), far)  # [candidate, unit]: reductions run over the first axis
        for n, k in enumerate(core):
            unary[:len(self.unary[k]), n] = self.unary[k]
        pairs = list(self.tables.items())
        n_pairs = len(pairs)
        src = np.array([at[a] for (a, _), _ in pairs] + [at[b] for (_, b), _ in pairs])
        dst = np.concatenate([src[n_pairs:], src[:n_pairs]])
        tables = np.full((width, width, 2 * n_pairs), far)  # [src's candidate, dst's candidate, message]
        shapes: dict[tuple, list[int]] = collections.defaultdict(list)  # filled per shape, not per table
        for n, (_, t) in enumerate(pairs):
            shapes[t.shape].append(n)
        for (rows, columns), ns in shapes.items():
            block = np.stack([pairs[n][1] for n in ns], axis=-1)
            tables[:rows, :columns, ns] = block
            tables[:columns, :rows, np.array(ns) + n_pairs] = block.transpose(1, 0, 2)
        back = np.concatenate([np.arange(n_pairs) + n_pairs, np.arange(n_pairs)])  # the reverse message
        told = np.zeros((width, 2 * n_pairs))  # message n: from unit src[n] to unit dst[n], per dst's candidate
        bins = (dst + len(core) * np.arange(width)[:, None]).ravel()  # [dst's candidate, dst]: one bincount
        joint = np.empty_like(tables)

        def believed(told: np.ndarray) -> np.ndarray:  # each unit's own costs and all it was told
            return unary + np.bincount(bins, weights=told.ravel(), minlength=unary.size).reshape(unary.shape)

        for _ in range(_BELIEFS):
            np.add((believed(told).take(src, axis=1) - told.take(back, axis=1))[:, None, :], tables, out=joint)
            sent = joint.min(0)  # least over src's candidates
            sent -= sent.min(0)
            done = bool((np.abs(sent - told) <= 1e-12 * np.abs(told)).all())  # `np.allclose(rtol=1e-12, atol=0)`: all finite
            told = sent
            if done:
                break
        picks = believed(told).argmin(0)
        return {k: int(picks[n]) for n, k in enumerate(core)}

    def _spread(self, core: list[int], pinned: dict[int, int]) -> dict[int, int]:
        """The pinned units, then the others in program order, each against those decided before
        it: a cut made upstream flows down the program."""
        choice = dict(pinned)
        known, classes, ids, picked = self._locals, self._class, self._ids, choice.get
        for k in core:
            if k not in choice:  # `_local`, its cache read inline
                choice[k] = (known.get((classes[k], tuple(map(picked, ids[k])))) or self._local(k, choice))[1]
        return choice

    def _improve(self, core: list[int], choice: dict[int, int], keep: set[int], pairs: bool) -> None:
        """Single moves (a unit against all its neighbours) until none lowers the energy, then,
        with `pairs`, moves of two neighbours at once; again while those find any (a few rounds).
        A worklist revisits only the neighbours of a unit that moved."""
        dirty = [k for k in core if k not in keep]
        known, classes, ids, picked = self._locals, self._class, self._ids, choice.get
        for _ in range(_PASSES):
            queued = set(dirty)
            while dirty:
                k = dirty.pop()
                queued.discard(k)
                found = known.get((classes[k], tuple(map(picked, ids[k])))) or self._local(k, choice)  # `_local`, inlined
                if found[3][choice[k]]:
                    choice[k] = found[1]
                    for j in ids[k]:
                        if j not in queued and j not in keep:
                            queued.add(j)
                            dirty.append(j)
            if not pairs:
                return
            local = {k: known.get((classes[k], tuple(map(picked, ids[k])))) or self._local(k, choice)
                     for k in core}  # each against all its neighbours
            pair_moves, table_class = self._pairs, self._table_class
            for n, ((a, b), t) in enumerate(self.tables.items()):
                if a in keep or b in keep:
                    continue
                la, lb, pa, pb = local[a], local[b], choice[a], choice[b]
                move = pair_moves.get((table_class[n], la[2], lb[2], pa, pb), _UNSEEN)  # `_pair`, inlined where known
                if move is _UNSEEN:
                    move = self._pair(n, t, la, lb, pa, pb)
                if move is not None:
                    choice[a], choice[b] = move
                    moved = {j for j, _ in self.around[a] + self.around[b]} | {a, b}
                    local.update((j, self._local(j, choice)) for j in moved)
                    dirty += [j for j in moved if j not in keep]
            if not dirty:
                return

    def _pair(self, n: int, t: np.ndarray, local_a: tuple, local_b: tuple, a: int, b: int) -> tuple[int, int] | None:
        """The best joint move of table `n`'s two units (their `_local` entries `local_a`, `local_b`
        against all their neighbours, picks `a`, `b`), or None where none lowers the energy; once
        per class."""
        key = (self._table_class[n], local_a[2], local_b[2], a, b)
        if key not in self._pairs:
            la, lb = local_a[0], local_b[0]
            joint = (la - t[:, b])[:, None] + (lb - t[a, :])[None, :] + t
            ca, cb = np.unravel_index(int(joint.argmin()), joint.shape)
            self._pairs[key] = (int(ca), int(cb)) if joint[ca, cb] < joint[a, b] else None
        return self._pairs[key]
