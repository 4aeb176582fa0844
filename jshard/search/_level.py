"""One level of the recursive search (`_recursive.py`) as a pairwise energy (`Level`): each class
of units' own cost per candidate (its partial sums, its compute per device, λ·bytes it keeps at the
peak) and, per pair of neighbouring classes, a table of the redistribution their values pay.
MindSpore's dynamic-programming eliminations solve most of it exactly (`Level._eliminate`, replayed
on a level barred from combined sets by `Level._replay`); the core they leave is searched
heuristically (`jshard.search._core`).
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Sequence

import numpy as np

from jshard.search._core import Core
from jshard.search._graph import TIE, Assignment, Group
from jshard.search._shared import Eliminated, Searching, Shared
from jshard.search._ties import Ties

Barred = tuple[frozenset, float]
"""Combined sets (`SearchGraph.combined_set`) a level's units may not join, and the toll in seconds
that each candidate joining one pays in the level (`_Recursive._closed`)."""


class Level(Core):
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

    The level's units are the classes of `ties` (`Ties`): a class of replayed layers is one unit
    with its members' costs and tables summed; where nothing repeats, each unit is its own class.
    """

    def __init__(
        self,
        search: Searching,
        group: Group,
        base: list[Assignment],
        lam: float,
        ties: Ties,
        like: Level | None = None,
        barred: Barred = (frozenset(), 0.0),
    ):
        g = self.g = search.g
        self.search = search
        self.ties = ties  # the level's units are its classes (one unit each where nothing repeats)
        self.reps, count = ties.reps, ties.count
        # Units of one structure on one base (identical layers) share their candidates, costs and
        # tables; `like` (a level on the same base, axes and λ) lends what it computed of them.
        shared = self._shared = (
            Shared(search, group, base, lam, search.shared.get(group)) if like is None else like._shared
        )
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
        self._joins: dict[tuple[int, int], frozenset[tuple]] = {}  # `joins`', shared with the levels barred from this
        self._bar(barred)
        self._key = (id(ties), tuple(kinds))  # its classes and their base: what its eliminations' order reads
        diagonals, tables, nbrs = shared.edge_tables(ties, kinds)
        for c, diagonal in diagonals:  # an edge inside a class: both ends take the class's one pick
            self.unary[c] = self.unary[c] + diagonal
        self.tables: dict[tuple[int, int], np.ndarray] = dict(tables)
        self.nbrs: dict[int, set[int]] = collections.defaultdict(set, {k: set(v) for k, v in nbrs.items()})
        self._whole = (list(self.unary), list(self.tables.items()))  # what `energy` reads: eliminating consumes them
        self._flat_whole: tuple | None = None  # ... as flat arrays, once read
        self.picks: dict[int, int] = {}
        self.records: list[tuple] = []
        self._eliminated: Eliminated | None = None  # recorded by `_eliminate`
        self._replays: Eliminated | None = None  # ... or replayed (`barring`)
        self._touched: tuple[set[int], set[tuple[int, int]]] = (set(), set())  # ... and what that changed in the core
        self.classes = self.evaluations = 0  # the core's distinct units and their cost evaluations

    def barring(self, barred: Barred) -> Level:
        """A level on this one's base with the combined sets `barred[0]` barred by the toll
        `barred[1]` on each candidate of a class that joins one: its own costs and tables as built
        (`_whole`, before eliminating) copied, not rebuilt, as `_Recursive._closed` tries set after
        set on one level; where this level was eliminated, the copy replays its eliminations and
        patches its core where the tolls reach (`_replay`, `_patch_core`) rather than redoing them."""
        other = object.__new__(Level)
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

    def joins(self, c: int, pick: int) -> frozenset[tuple]:
        """The combined sets (`SearchGraph.combined_set`) class `c` joins under its candidate `pick`;
        once per class and pick (`_closed` reads them per set tried, for every combinable class)."""
        found = self._joins.get((c, pick))
        if found is None:
            g, k = self.g, self.reps[c]
            found = self._joins[(c, pick)] = frozenset(
                g.combined_set(k, axes) for axes in g.partial_sums(k, self.cands[c][pick])
            )
        return found

    def opened(self, picks: Sequence[int]) -> set[tuple]:
        """The combined sets the combinable classes open under `picks` (one per class)."""
        return {s for c in self.combinable for s in self.joins(c, picks[c])}

    def latency(self, picks: Sequence[int], of: frozenset | None = None) -> float:
        """The latency the combined sets opened under `picks` (those of `of`, where given) pay: one
        per set and run (`SearchGraph.sets_latency`), which the level's energy leaves out."""
        g = self.g
        return g.sets_latency(
            {
                s: g.units[self.reps[c]].weight
                for c in self.combinable
                for s in self.joins(c, picks[c])
                if of is None or s in of
            }
        )

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
            self._flat_whole = (
                np.concatenate(unary),
                starts,
                np.array([a for (a, _), _ in tables], int),
                np.array([b for (_, b), _ in tables], int),
                np.cumsum([0] + [r * c for r, c in shapes[:-1]]).astype(int),
                np.array([c for _, c in shapes], int),
                np.concatenate([t.ravel() for _, t in tables]) if tables else np.zeros(0),
            )
        flat, starts, a, b, offset, width, flat_tables = self._flat_whole
        picked = np.asarray(picks)
        total = np.cumsum(flat[starts + picked])[-1]
        return total + np.cumsum(flat_tables[offset + picked[a] * width + picked[b]])[-1] if len(a) else total

    def _unary(self, c: int, kind: int, lam: float) -> np.ndarray:
        """Class `c`'s first unit's own seconds and λ·bytes it keeps at the peak, under each candidate."""
        search, k = self.search, self.reps[c]
        kept = search.kept_bytes.get(k)
        own = self._shared.own
        found = own.get((kind, kept))
        if found is None:
            seconds = self._shared.seconds_of(k, kind)
            if kept is None:  # at any λ: each λ's `own` starts with these (`Shared`)
                found = self._shared.unweighted[(kind, kept)] = seconds + 0.0
            else:
                found = seconds + max(lam, TIE) * self._shared.kept_of(search, k, kind, kept)
            own[(kind, kept)] = found
        return found

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
        fold into their neighbours, recorded (`Eliminated`) so that a level barred from it replays
        them on its changed costs alone (`_replay`); returns the core left. Their order (`_order`)
        reads no cost: a level whose classes and base an earlier level had (another λ's run, a
        boundary check's next wave) follows that level's (`Shared.orders`)."""
        self._folds = self._shared.folds
        if self._replays is not None:
            return self._replay(self._replays)
        order = self._shared.orders.get(self._key)
        if order is None:
            order = self._shared.orders[self._key] = self._order()
        return self._eliminate_as(Eliminated(self._whole), *order)

    def _order(self) -> tuple[list, list, dict, list[int]]:
        """Which units `_eliminate` folds, in which order, into which neighbours, read from the
        neighbours and the number of candidates alone: the units of one candidate with their
        neighbours then (`singles`), the steps `(unit, its neighbours then)` in order, the
        neighbours left and the core."""
        nbrs, gone = self.nbrs, set()
        singles: list[tuple[int, list[int]]] = []
        steps: list[tuple[int, list[int]]] = []
        for k, cands in enumerate(self.cands):
            if len(cands) == 1:  # nothing to decide: its tables become its neighbours' own costs
                singles.append((k, list(nbrs[k])))
                for j in nbrs[k]:
                    nbrs[j].discard(k)
                nbrs[k].clear()
                gone.add(k)
        queue = collections.deque(k for k in range(len(self.cands)) if k not in gone and len(nbrs[k]) <= 2)
        while queue:
            k = queue.popleft()
            around = nbrs[k]
            if k in gone or len(around) > 2:
                continue
            ends = sorted(around)
            steps.append((k, ends))
            for j in ends:
                nbrs[j].discard(k)
            if len(ends) == 2:  # the table between them (`_add`)
                nbrs[ends[0]].add(ends[1])
                nbrs[ends[1]].add(ends[0])
            around.clear()
            gone.add(k)
            queue.extend(ends)
        return singles, steps, nbrs, [k for k in range(len(self.cands)) if k not in gone]

    def _eliminate_as(self, done: Eliminated, singles: list, steps: list, nbrs: dict, core: list[int]) -> list[int]:
        """`_eliminate`'s folds in the order `_order` found (`singles`, `steps`), recorded in `done`:
        the level's neighbours left are `nbrs`, its core `core`."""
        self._eliminated = done
        inputs, unary_parts, table_parts, records = done.inputs, done.unary_parts, done.table_parts, self.records
        tables, unary, fold, folds = self.tables, self.unary, self._fold, self._folds
        for k, around in singles:
            for j in around:
                part = tables[(j, k)][:, 0] if j < k else tables[(k, j)][0]
                unary[j] = unary[j] + part
                unary_parts[j].append((-1, part))
                del tables[(j, k) if j < k else (k, j)]
            self.picks[k] = 0
        done.steps.extend(steps)
        for n, (k, ends) in enumerate(steps):
            done.at[k] = n
            if not ends:
                self.picks[k] = int(unary[k].argmin())
                inputs.append((unary[k],))
            elif len(ends) == 1:
                (j,) = ends
                done.used[(k, j) if k < j else (j, k)] = n
                t = tables.pop((k, j)) if k < j else tables.pop((j, k)).T
                uk = unary[k]
                inputs.append((uk, t))
                key = (uk.tobytes(), t.shape, t.tobytes())
                least, best = folds.get(key) or fold(k, t, key=key)
                unary[j] = unary[j] + least
                unary_parts[j].append((n, least))
                done.record_of[n] = len(records)
                records.append((k, "one", j, best))
            else:
                a, b = ends
                done.used[(k, a) if k < a else (a, k)] = done.used[(k, b) if k < b else (b, k)] = n
                ta = tables.pop((k, a)) if k < a else tables.pop((a, k)).T
                tb = tables.pop((k, b)) if k < b else tables.pop((b, k)).T
                uk = unary[k]
                inputs.append((uk, ta, tb))
                key = (uk.tobytes(), ta.shape, ta.tobytes(), tb.shape, tb.tobytes())
                least, best = folds.get(key) or fold(k, ta, tb, key=key)
                done.record_of[n] = len(records)
                records.append((k, "two", a, b, best))
                table_parts[(a, b)].append((n, least))
                found = tables.get((a, b))
                tables[(a, b)] = least if found is None else found + least
        self.nbrs = nbrs
        done.close(self, core)
        return core

    def _replay(self, done: Eliminated) -> list[int]:
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

    def _fold(self, k: int, *tables: np.ndarray, key: tuple | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Unit `k` eliminated between one or two neighbours (`tables`, `[c_k, c_neighbour]`): its
        least cost and best candidate per neighbour pick (a table between two neighbours); once per
        class of inputs (the same operator of identical layers folds the same arrays), `key` the
        inputs' bytes where the caller has them."""
        t = tables[0]
        if key is None:
            key = (
                (self.unary[k].tobytes(), t.shape, t.tobytes())
                if len(tables) == 1
                else (self.unary[k].tobytes(), t.shape, t.tobytes(), tables[1].shape, tables[1].tobytes())
            )
        found = self._folds.get(key)
        if found is None:
            if len(tables) == 1:
                m = self.unary[k][:, None] + tables[0]
            else:
                m = self.unary[k][:, None, None] + tables[0][:, :, None] + tables[1][:, None, :]
            found = self._folds[key] = (m.min(0), m.argmin(0))
        return found
