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

A memory budget sets λ (seconds per byte) on the values held at the peak (at first the replicated
plan's peak; where a plan's peak falls elsewhere, the values held there join them): zero when the
plan fits, else the least λ found by growing and bisection whose plan fits, which moves the plan from replicated parameters to cut ones
(FSDP-style or tensor-parallel) as far as the budget needs.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

import numpy as np

from jshard.cost import array_of, value_bytes
from jshard.search._graph import TIE, Assignment, Group, Infeasible, SearchGraph, Solved

_log = logging.getLogger("jshard.search")
"""Progress: one INFO record per level of each run (`jshard plan` shows them on a terminal)."""

_GROWTHS = 24
_BISECTIONS = 6
_PASSES = 4
_ROOTS = 4  # the heaviest units tried with each candidate, one after another, per level
_HEAVY = 0.1  # ... among those with at least this share of the heaviest one's compute


def solve(g: SearchGraph, levels: Sequence[Group], budget: float | None) -> Solved:
    search = _Recursive(g, levels)
    choice, seconds = search.run(0.0)
    peak, t = g.peak(choice)
    if budget is None or peak <= budget:
        return search.solved(choice, seconds, peak, "fits" if budget else "no budget")
    search.keep(t)
    low, high, best = 0.0, max(seconds, 1e-9) / peak, None  # λ's scale: the plan's seconds per byte
    growths = 0
    while growths < _GROWTHS:
        choice, seconds = search.run(high)
        peak, t = g.peak(choice)
        if peak <= budget:
            best = (seconds, choice, peak, high)
            break
        if not search.keep(t):  # new values held at this plan's peak are weighed at the same λ first
            low, high, growths = high, high * 4, growths + 1
    if best is None:
        raise Infeasible(f"the most memory-bound plan found holds {peak:.0f} bytes per device")
    for _ in range(_BISECTIONS):  # a plan's seconds need not grow with λ: the fastest that fits is kept
        mid = (low + high) / 2
        choice, seconds = search.run(mid)
        peak, _ = g.peak(choice)
        if peak <= budget:
            high, best = mid, min(best, (seconds, choice, peak, mid), key=lambda b: b[0])
        else:
            low = mid
    seconds, choice, peak, lam = best
    return search.solved(choice, seconds, peak, f"memory weight {lam:.3g} s/byte to fit the budget")


class _Recursive:
    def __init__(self, g: SearchGraph, levels: Sequence[Group]):
        self.g, self.levels = g, list(levels)
        degree = collections.Counter(k for e in g.edges for k in (e.src[0], e.dst[0]))
        self.weight = lambda k: (g.units[k].weight * g.units[k].flops, degree[k])
        replicated = g.live_bytes({v: value_bytes(v) for v in g.memory_values})
        self.kept: dict[int, list] = collections.defaultdict(list)  # unit -> (operand position, value) live at a peak
        self.kept_bytes: dict[int, tuple] = {}  # unit -> (operand position, bytes) of the above: what its unary reads
        self.edge_values = [(array_of(e.var), e.weight) for e in g.edges]  # what an edge's table reads of it
        self._kept_values: set = set()
        self.keep(int(replicated.argmax()))
        self.runs = 0
        self.unit_classes = self.evaluations = 0  # summed over levels and runs (`SearchReport`)

    def solved(self, choice: list[Assignment], seconds: float, peak: float, status: str) -> Solved:
        return Solved(choice, seconds, peak, status, self.unit_classes, self.evaluations)

    def keep(self, t: int) -> bool:
        """Weighs (with λ) the values held at program point `t` too; whether any was new."""
        new = [v for v in self.g.live_at(t) if v not in self._kept_values]
        for v in new:
            k, pos = self.g.makers[v]
            self.kept[k].append((pos, v))
            self.kept_bytes[k] = tuple((p, value_bytes(x)) for p, x in self.kept[k])
            self._kept_values.add(v)
        return bool(new)

    def run(self, lam: float) -> tuple[list[Assignment], float]:
        self.runs += 1
        base: list[Assignment] = [{} for _ in self.g.units]
        for n, group in enumerate(self.levels):
            weighing = f", memory weight {lam:.3g} s/byte (run {self.runs})" if lam else ""
            _log.info("searching: level %d of %d (mesh axes %s), %d units%s", n + 1, len(self.levels),
                      "·".join(group), len(self.g.units), weighing)
            base = self._level(group, base, lam)
        return base, self.g.seconds(base)

    def _level(self, group: Group, base: list[Assignment], lam: float) -> list[Assignment]:
        level = _Level(self, group, base, lam)
        picks = level.solve()
        self.unit_classes += level.classes
        self.evaluations += level.evaluations
        return [level.cands[k][picks[k]] for k in range(len(self.g.units))]

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
    """

    def __init__(self, search: _Recursive, group: Group, base: list[Assignment], lam: float):
        g = self.g = search.g
        self.search = search
        # Units of one structure on one base (identical layers) share their candidates, costs and tables.
        kinds = [(g.shape_of_unit[k], tuple(sorted(base[k].items()))) for k in range(len(g.units))]
        cands: dict[tuple, list[Assignment]] = {}
        self.cands = [cands[kind] if kind in cands else cands.setdefault(kind, g.candidates(k, [group], base[k]))
                      for k, kind in enumerate(kinds)]
        self._own: dict[tuple, np.ndarray] = {}  # unit kind (and the bytes it keeps) -> its unary
        self.unary = [self._unary(k, kinds[k], lam) for k in range(len(g.units))]
        self.tables: dict[tuple[int, int], np.ndarray] = {}
        self.nbrs: dict[int, set[int]] = collections.defaultdict(set)
        specs: dict[tuple, list] = {}  # (unit kind, operand) -> its layout under each candidate
        moves: dict[tuple, np.ndarray] = {}  # ((value, weight), both ends' kinds) -> the edge's table

        def laid(end: tuple[int, int]) -> tuple:
            key = (kinds[end[0]], end[1])
            if key not in specs:
                specs[key] = [g.spec(end[0], end[1], a) for a in self.cands[end[0]]]
            return key

        for e, value in zip(g.edges, search.edge_values):
            u, v = e.src[0], e.dst[0]
            key = (value, laid(e.src), laid(e.dst))
            table = moves.get(key)
            if table is None:
                mine, theirs = specs[key[1]], specs[key[2]]
                table = moves[key] = np.array([[g.edge_seconds(e, x, y) for y in theirs] for x in mine])
            if u == v:
                self.unary[u] = self.unary[u] + np.diag(table)
            else:
                self._add(u, v, table)
        self.picks: dict[int, int] = {}
        self.records: list[tuple] = []
        self.classes = self.evaluations = 0  # the core's distinct units and their cost evaluations

    def _unary(self, k: int, kind: tuple, lam: float) -> np.ndarray:
        """Unit `k`'s own seconds and λ·bytes it keeps at the peak, under each candidate."""
        search, cands = self.search, self.cands[k]
        kept = search.kept_bytes.get(k)
        found = self._own.get((kind, kept))
        if found is None:
            if kept is None:
                found = np.array([self.g.unit_seconds(k, a) + 0.0 for a in cands])
            else:
                w = max(lam, TIE)
                found = np.array([self.g.unit_seconds(k, a) + w * search._kept(k, a) for a in cands])
            self._own[(kind, kept)] = found
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

    def _drop(self, k: int, j: int) -> None:
        self.tables.pop((min(k, j), max(k, j)))
        self.nbrs[k].discard(j)
        self.nbrs[j].discard(k)

    def solve(self) -> list[int]:
        core = self._eliminate()
        self.picks.update(self._search_core(core))
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
        gone: set[int] = set()
        self._folds: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        for k, cands in enumerate(self.cands):
            if len(cands) == 1:  # nothing to decide: its tables become its neighbours' own costs
                for j in list(self.nbrs[k]):
                    self.unary[j] = self.unary[j] + self._table(j, k)[:, 0]
                    self._drop(k, j)
                self.picks[k] = 0
                gone.add(k)
        queue = collections.deque(k for k in range(len(self.cands)) if k not in gone and len(self.nbrs[k]) <= 2)
        while queue:
            k = queue.popleft()
            if k in gone or len(self.nbrs[k]) > 2:
                continue
            nbrs = sorted(self.nbrs[k])
            if not nbrs:
                self.picks[k] = int(self.unary[k].argmin())
            elif len(nbrs) == 1:
                (j,) = nbrs
                least, best = self._fold(k, self._table(k, j))
                self.unary[j] = self.unary[j] + least
                self.records.append((k, "one", j, best))
                self._drop(k, j)
            else:
                a, b = nbrs
                least, best = self._fold(k, self._table(k, a), self._table(k, b))
                self.records.append((k, "two", a, b, best))
                self._drop(k, a)
                self._drop(k, b)
                self._add(a, b, least)
            gone.add(k)
            queue.extend(nbrs)
        return [k for k in range(len(self.cands)) if k not in gone]

    def _fold(self, k: int, *tables: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Unit `k` eliminated between one or two neighbours (`tables`, `[c_k, c_neighbour]`): its
        least cost and best candidate per neighbour pick (a table between two neighbours); once per
        class of inputs (the same operator of identical layers folds the same arrays)."""
        key = (self.unary[k].tobytes(), *((t.shape, t.tobytes()) for t in tables))
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
        the flat arrays `_energy` reads."""
        self.around = {k: [(j, self._table(k, j)) for j in sorted(self.nbrs[k])] for k in core}
        self._ids = {k: tuple(j for j, _ in around) for k, around in self.around.items()}
        classes: dict[tuple, int] = {}
        self._class = {k: classes.setdefault(
            (self.unary[k].tobytes(), tuple((t.shape, t.tobytes()) for _, t in self.around[k])), len(classes))
            for k in core}
        kinds: dict[tuple, int] = {}
        self._table_class = [kinds.setdefault((t.shape, t.tobytes()), len(kinds)) for t in self.tables.values()]
        self._locals: dict[tuple, tuple[np.ndarray, int, tuple]] = {}
        self._pairs: dict[tuple, tuple[int, int] | None] = {}
        n = len(self.cands)
        self._offset = np.zeros(n, int)
        self._offset[core] = np.cumsum([0] + [len(self.unary[k]) for k in core[:-1]])
        self._flat = np.concatenate([self.unary[k] for k in core])
        tables = list(self.tables.values())
        sizes = [t.size for t in tables]
        self._flat_tables = np.concatenate([t.ravel() for t in tables]) if tables else np.zeros(0)
        self._ends = (np.array([a for a, _ in self.tables], int), np.array([b for _, b in self.tables], int),
                      np.cumsum([0] + sizes[:-1]).astype(int), np.array([t.shape[1] for t in tables], int))
        self._picked = np.zeros(n, int)

    def _search_core(self, core: list[int]) -> dict[int, int]:
        if not core:
            return {}
        self._prepare_core(core)
        self.classes = len(set(self._class.values()))
        weight = self.search.weight
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
            pinned[root] = found[2]
            choice = found[1]
            self._improve(core, choice, set(pinned), pairs=True)  # the root's best, polished with pairwise moves
            total = self._energy(choice)
            if total < best[0]:
                best = (total, choice)
        self.evaluations = len(self._locals) + len(self._pairs)
        return best[1]

    def _spread(self, core: list[int], pinned: dict[int, int]) -> dict[int, int]:
        """The pinned units, then the others in program order, each against those decided before
        it: a cut made upstream flows down the program."""
        choice = dict(pinned)
        for k in core:
            if k not in choice:
                choice[k] = self._local(k, choice)[1]
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
            local = {k: self._local(k, choice) for k in core}  # each against all its neighbours
            for n, ((a, b), t) in enumerate(self.tables.items()):
                if a in keep or b in keep:
                    continue
                move = self._pair(n, t, local[a], local[b], choice[a], choice[b])
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
