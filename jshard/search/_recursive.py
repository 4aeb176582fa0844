"""`search="recursive"`: bisect the device count one mesh axis at a time (MindSpore's recursive
programming over jshard's factors).

At each level one more mesh axis (one prime factor of the device count, major first) is handed out:
every unit either gives it to one of its factors, on top of what earlier levels gave, or leaves it
unused. A level is a pairwise energy (`Level`): each unit's own cost per candidate (its partial
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

Replay (`Ties`): the interior layers of a repeated run (an unrolled loop's layers, found as a
period in the units' structure and wiring) are decided as one at each level, the way a scanned
body is planned once; the first and last `_WINDOW` layers of the run (`_ties.py`'s constants) are
decided on their own, and the replayed choice is then checked by single and pairwise moves
(`_Recursive._checked`) with every unit its own class but the middle layers of long runs: the first
and last `_WINDOW + _MARGIN` layers move alone, the middle ones as one class. A change made at a boundary that reaches the
layers beside the middle is carried into it (the middle takes their choice and is checked again,
`_WAVES` rounds at most, the lowest energy kept), as weighing every unit alone carries it layer by
layer; so the check too is flat in the number of layers. It weighs the same units on the same
base, so it reads what the replayed level computed (`Shared`: candidates, layouts, edge tables,
own costs, folds, the core's classes and cost evaluations) rather than pricing the program again.

A memory budget sets λ (seconds per byte) on the values held at the peak (at first the replicated
plan's peak; where a plan's peak falls elsewhere, the values held there join them): zero when the
plan fits, else the least λ found by growing and bisection (`_grown`, `_bisected`: each ends once
it learns nothing new) whose plan fits, which moves the plan from replicated parameters to cut ones
(FSDP-style or tensor-parallel) as far as the budget needs.

This module holds the runs and their levels (`solve`, `_Recursive`: a level solved, its combined
sets closed, its replayed choice checked); the pieces live beside it: `_level.py` (a level's energy
and its exact eliminations), `_core.py` (the heuristic search of the core they leave), `_ties.py`
(the repeated runs and the classes of units decided as one) and `_shared.py` (what levels share:
candidates, tables, cached evaluations, recorded eliminations).
"""

from __future__ import annotations

import collections
import logging
import math
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from jshard.cost import array_of, value_bytes
from jshard.search._graph import TIE, Assignment, Group, Infeasible, SearchGraph, Solved
from jshard.search._level import Barred, Level
from jshard.search._shared import Reused
from jshard.search._ties import Ties

_log = logging.getLogger("jshard.search")
"""Progress: one INFO record per level of each run (`jshard plan` shows them on a terminal)."""

_GROWTHS = 24  # λ's grid steps (`_grown`) at most
_SATURATED = 1e6  # ... fewer: it ends where the peak stands still, its bytes over the budget weighing this many
# times the plan's seconds (`_grown`: a pipeline stage's plan that fitted later stood at 2,000 times)
_BISECTIONS = 6
_STALE = 2  # ... fewer: the bisection stops after this many runs in a row that find no new plan
_WAVES = 3  # the boundary check's rounds at most: the middle layers take the choice of the layers beside them


def solve(
    g: SearchGraph,
    levels: Sequence[Group],
    budget: float | None,
    replay: bool = True,
    passed: Callable[[], bool] | None = None,
    check: Callable[[], None] | None = None,
    unweighed: Callable[[Callable[[], tuple]], tuple] | None = None,
    reused: Reused | None = None,
    hint: tuple[float, float] | None = None,
) -> Solved:
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
    made the same run again; `SearchReport.runs` counts the runs this search made). `reused`, where
    given, holds the tables and shared levels of the searches before it on the same program
    (`Reused`): read, not priced again, and added to. `hint`, where given, is the seconds and peak of
    a plan that fits the budget (the cheapest seed fitted to it): λ's growth starts near the price
    per byte it pays (`_start`)."""
    stop = passed or (lambda: False)
    search = _Recursive(g, levels, replay, check, reused)
    choice, seconds = search.run(0.0) if unweighed is None else unweighed(lambda: search.run(0.0))
    choice = _copied(choice)  # the kept run's assignments stay as made
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
    scale = max(seconds, 1e-9) / peak  # λ's scale: the plan's seconds per byte
    low, best = _grown(g, search, budget, scale, seen, _start(scale, seconds, peak, hint))
    seconds, choice, peak, lam = _bisected(g, search, budget, low, best, stop, seen)
    return search.solved(choice, seconds, peak, f"memory weight {lam:.3g} s/byte to fit the budget")


def _start(scale: float, seconds: float, peak: float, hint: tuple[float, float] | None) -> int:
    """The step of λ's grid (`scale`·4^k) `_grown` starts from: one below the step of the price per
    byte that `hint` (the seconds and peak of a plan that fits: the cheapest seed fitted to the
    budget) pays over the unweighted plan's (`seconds`, `peak`) for the bytes it sheds, 0 where
    there is none. The weight that first fits is near that price: on table 2b's models at quick size
    (where the unweighted plan's nanoseconds weigh its bytes at a small λ) the growth from step 0
    ran 5 to 8 runs to reach it (linen_optax's plan first fits at step 6, the price's step 5.1:
    the growth starts at step 4 and makes 3 runs, not 7); at full size, where the plans' seconds
    are larger, the price's step is 2.1 at most and the growth starts at step 0 or 1."""
    if hint is None or hint[0] <= seconds or hint[1] >= peak:
        return 0
    price = (hint[0] - seconds) / (peak - hint[1])
    return min(max(int(math.floor(math.log(price / scale, 4.0))) - 1, 0), _GROWTHS - 1)


def _grown(
    g: SearchGraph, search: _Recursive, budget: float, scale: float, seen: set, start: int = 0
) -> tuple[float, tuple]:
    """λ grown on the grid `scale`·4^k from step `start` (`_start`) to the first whose plan fits
    `budget`: the last λ whose plan did not fit (0 where none below did) and `(seconds, choice,
    peak, λ)` of the first that does; where the plan at `start` fits already, the steps below run
    down to the first whose plan does not (`_below`), so the bisection (`_bisected`) starts from
    the two λ growing from step 0 finds (where fitting holds from the first fit up). No plan fits
    (`Infeasible`) past step `_GROWTHS`, or once the peak stands still (the growth before's) where
    its bytes over the budget weigh `_SATURATED` times the plan's seconds (`_saturated`). The
    growth goes on while the peak stands still short of that: a plan can stand through several
    growths and move at a later one (a pipeline stage's plan under a 41.5 KiB budget stands through
    seven, its bytes over the budget weighing up to 2,000 times its seconds, and fits at the
    eighth); past it no plan moved (eqx_vit's under 0.8 times its unbudgeted peak stands from 80
    times on; the growth went on to 10^12 times, 9 runs more, and found none that fits). A run
    whose peak falls where new values are held is made again at the same λ with them weighed
    (`_Recursive.keep`). Each plan found joins `seen`."""
    k, last = start, -1.0
    while k < _GROWTHS:
        found, peak, seconds = _fitting(g, search, budget, scale * 4.0**k, seen)
        if found is not None:
            return (scale * 4.0 ** (k - 1), found) if k > start else _below(g, search, budget, scale, seen, k, found)
        if peak == last and _saturated(scale * 4.0**k, seconds, peak - budget):
            break
        last, k = peak, k + 1
    raise Infeasible(f"the most memory-bound plan found holds {last:.0f} bytes per device")


def _fitting(g: SearchGraph, search: _Recursive, budget: float, lam: float, seen: set) -> tuple:
    """The run at `lam`, made again while its peak falls where new values are held (`keep`):
    `((seconds, choice, peak, λ), peak, seconds)` where its plan fits `budget`, else `(None, peak,
    seconds)`; each plan found joins `seen`."""
    while True:
        choice, seconds = search.run(lam)
        peak, t = g.peak(choice)
        seen.add((seconds, peak))
        if peak <= budget:
            return (seconds, choice, peak, lam), peak, seconds
        if not search.keep(t):
            return None, peak, seconds


def _below(
    g: SearchGraph, search: _Recursive, budget: float, scale: float, seen: set, high: int, best: tuple
) -> tuple[float, tuple]:
    """`_grown`'s answer where the grid's step `high`, where it started, fits: the steps below run
    down to the first whose plan does not fit (its λ, 0 where all fit) and the lowest that fits."""
    for k in range(high - 1, -1, -1):
        found = _fitting(g, search, budget, scale * 4.0**k, seen)[0]
        if found is None:
            return scale * 4.0**k, best
        best = found
    return 0.0, best


def _saturated(lam: float, seconds: float, over: float) -> bool:
    """Whether `over` bytes over the budget weigh at `lam` `_SATURATED` times a plan's `seconds` or
    more: a run that kept them found no layout that sheds them at a million times the plan's cost."""
    return lam * over >= _SATURATED * seconds


def _bisected(
    g: SearchGraph, search: _Recursive, budget: float, low: float, best: tuple, stop: Callable[[], bool], seen: set
) -> tuple:
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
    def __init__(
        self,
        g: SearchGraph,
        levels: Sequence[Group],
        replay: bool = True,
        check: Callable[[], None] | None = None,
        reused: Reused | None = None,
    ):
        self.g, self.levels, self.replay = g, list(levels), replay
        self.check = check or (lambda: None)
        replicated = g.live_bytes(g.replicated)
        self.kept: dict[int, list] = collections.defaultdict(list)  # unit -> (operand position, value) live at a peak
        self.kept_bytes: dict[int, tuple] = {}  # unit -> (operand position, bytes) of the above: what its unary reads
        values: dict[tuple, int] = {}  # what an edge's table reads of it: its value's array and weight, as ids
        self.edge_values = [values.setdefault((array_of(e.var), e.weight), len(values)) for e in g.edges]
        self.edge_ends = tuple(
            np.array(x, np.int64).reshape(-1)
            for x in (  # per edge: its ends and value, as arrays
                [e.src[0] for e in g.edges],
                [e.src[1] for e in g.edges],
                [e.dst[0] for e in g.edges],
                [e.dst[1] for e in g.edges],
                self.edge_values,
            )
        )
        degree = np.bincount(np.concatenate([self.edge_ends[0], self.edge_ends[2]]), minlength=len(g.units)).tolist()
        self.weight = lambda k: (g.units[k].weight * g.units[k].flops, degree[k])
        self._kept_values: set = set()
        if reused is None or not reused.serves(g, self.edge_values):
            reused = Reused()
        self.layout_lists = reused.layout_lists  # a list of layouts (one per candidate) -> its id
        self.tables = reused.tables  # (edge's value, both ends' layout lists) -> its table
        self.shared = reused.shared  # per level's axes, what its last level shares with the next run's
        self.keep(int(replicated.argmax()))
        self.runs = self.bisections = 0  # runs made, and of them the bisection's of λ
        self.ties: Ties | None = None  # the classes of units decided as one, for the values kept now
        self.checks: Ties | None = None  # ... and those of the boundary check: each unit its own but long runs' middles
        self.unit_classes = self.evaluations = 0  # summed over levels and runs (`SearchReport`)

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
            self.ties, self.checks = Ties(self, self.replay), None
            if self.ties.replayed:
                _log.debug(
                    "replay: %d of %d units in the interior of %d repeated runs, decided as %d",
                    self.ties.replayed,
                    len(self.g.units),
                    self.ties.runs,
                    len(self.ties.reps),
                )
        base: list[Assignment] = [{} for _ in self.g.units]
        for n, group in enumerate(self.levels):
            self.check()
            weighing = f", memory weight {lam:.3g} s/byte (run {self.runs})" if lam else ""
            _log.info(
                "searching: level %d of %d (mesh axes %s), %d units%s",
                n + 1,
                len(self.levels),
                "·".join(group),
                len(self.g.units),
                weighing,
            )
            base = self._level(group, base, lam)
        return base, self.g.seconds(base)

    def _level(self, group: Group, base: list[Assignment], lam: float) -> list[Assignment]:
        assert self.ties is not None  # `run` made them
        level = Level(self, group, base, lam, self.ties)
        picks = level.solve()
        self.unit_classes += level.classes
        self.evaluations += level.evaluations
        picks, barred = self._closed(group, base, lam, level, picks)
        if not self.ties.replayed:
            return _per_unit(level, picks, self.ties)
        if self.checks is None:
            self.checks = Ties.checking(self, self.ties.found)
        of = self.ties.of
        return self._checked(group, base, lam, lambda k: level.cands[of[k]][picks[of[k]]], level, barred)

    def _closed(
        self, group: Group, base: list[Assignment], lam: float, level: Level, picks: list[int]
    ) -> tuple[list[int], Barred]:
        """`level`'s `picks`, or where closing a combined set they open lowers the level's energy with
        the latency of the sets opened (`Level.latency`: the energy leaves it out, as a set pays one
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

    def _closing(
        self, level: Level, picks: list[int], sets: frozenset, toll: float, best: float
    ) -> Iterator[tuple[float, list[int], frozenset]]:
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

    def _checked(
        self,
        group: Group,
        base: list[Assignment],
        lam: float,
        chosen: Callable[[int], Assignment],
        like: Level,
        barred: Barred,
    ) -> list[Assignment]:
        """The boundary check of a replayed level's choice `chosen` (a unit's assignment, read for the
        first unit of each of the check's classes alone): on `checks`' classes
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
        best: tuple[float, Level, list[int]] | None = None
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
                level = Level(self, group, base, lam, ties, like=like, barred=barred)
                believed = seed is None and not ties.tied  # once: the messages do not read the seed
                if seed is None:
                    seed = [seat(chosen(k), cands) for k, cands in zip(ties.reps, level.cands)]
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
        return _per_unit(level, picks, ties)

    def kept_under(self, k: int, a: Assignment) -> float:
        """Bytes per device unit `k` keeps at the peaks weighed (`keep`) under assignment `a`."""
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


def _copied(choice: Sequence[Assignment]) -> list[Assignment]:
    """A copy of each assignment of `choice`, one per object: the units that share one (a class's)
    share its copy, so the tables keyed by an assignment's id (`SearchGraph.peak`'s, `assemble`'s)
    read it once per class, not once per unit."""
    copies: dict[int, Assignment] = {}
    out = []
    for a in choice:
        found = copies.get(id(a))
        if found is None:
            found = copies[id(a)] = dict(a)
        out.append(found)
    return out


def _per_unit(level: Level, picks: list[int], ties: Ties) -> list[Assignment]:
    """Each unit's assignment under `level`'s `picks` (one per class of `ties`): its class's, the
    same object for every unit of a class (read per unit in C, not per unit in Python)."""
    picked = [cands[p] for cands, p in zip(level.cands, picks)]
    return list(map(picked.__getitem__, ties.of))


def _seat(a: Assignment, group: Group, cands: Sequence[Assignment]) -> int:
    """The candidate among `cands` that gives the level's axes (`group`) where `a` gives them: to
    the same factor, or to none (the first candidate where none does). A unit's candidates differ
    with its base, so a choice made for another unit of its kind is read as where the axes went."""
    given = next((fac for fac, axes in a.items() if group[0] in axes), None)
    return next(
        (n for n, c in enumerate(cands) if next((fac for fac, axes in c.items() if group[0] in axes), None) == given), 0
    )
