"""What the recursive search's levels share (`_recursive.py`, `_level.py`): the search state they
read (`Searching`), the candidates, layouts, own costs, edge tables and cached evaluations of one
level's units of one kind (`Shared`: the replayed level, the levels barred from it, its boundary
check and the same axes' level of a later run read them rather than pricing the program again), and
a level's eliminations as recorded (`Eliminated`) for a level barred from it to replay.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jshard.search._graph import Assignment, Group, SearchGraph

if TYPE_CHECKING:
    from jshard.search._level import Level
    from jshard.search._ties import Ties


class Searching(Protocol):
    """What a level, its shared caches and the replay's ties read of the search that makes them
    (`_recursive._Recursive`).

    Attributes:
      g: the search graph.
      kept_bytes: unit -> (operand position, bytes) of its values held at a peak the search weighs.
      edge_values: per edge, the id of what its table reads of the value (its array and weight).
      edge_ends: per edge, as arrays: its source unit and operand, its destination unit and operand,
        and its value's id.
      layout_lists / tables: every run's lists of layouts by id, and edge tables by (value, both ends'
        lists): made once per search.
      shared: per level's axes, what its last level shares with the next run's.
    """

    g: SearchGraph
    kept_bytes: dict[int, tuple]
    edge_values: list[int]
    edge_ends: tuple[np.ndarray, ...]
    layout_lists: dict[tuple, int]
    tables: dict[tuple[int, int, int], np.ndarray]
    shared: dict[Group, Shared]
    weight: Callable[[int], tuple[float, int]]

    def kept_under(self, k: int, a: Assignment) -> float:
        """Bytes per device unit `k` keeps at the peaks weighed under assignment `a`."""
        ...


class Shared:
    """What one level's units of one kind (one structure on one base: the same operator of identical
    layers) share, whichever classes `Ties` makes of them: their candidates, the layouts they give
    an operand, their own costs and the tables of the edges between kinds. The replayed level and its
    boundary check (every unit its own class) weigh the same units on the same base, so the second
    reads what the first computed. What reads no memory weight λ (the own seconds and bytes kept
    per kind, per level's classes and kinds the tables summed and the order of its eliminations) is
    read once for every run of the search, whichever λ it weighs."""

    def __init__(self, search: Searching, group: Group, base: list[Assignment], lam: float, past: Shared | None = None):
        self.g, self.group, self.base = search.g, group, base
        self._by_id: dict[tuple[int, int], int] = {}  # (unit structure, id() of its base assignment) -> kind
        self.own: dict[tuple, np.ndarray]  # (kind, bytes it keeps) -> its unary, at λ
        if past is not None:  # the same axes in an earlier run: all but its base and λ's costs read again
            self.__dict__.update({k: v for k, v in past.__dict__.items() if k not in ("base", "_by_id", "own")})
            self.own = self._own.get(lam) or self._own.setdefault(lam, dict(self.unweighted))
            return
        self._layout_lists, self._tables = search.layout_lists, search.tables  # the search's: every run's
        self._kinds: dict[tuple, int] = {}  # (unit structure, base assignment's items) -> kind
        self._cands: dict[int, list[Assignment]] = {}  # kind -> its candidates
        self.specs: dict[tuple[int, int], list] = {}  # (kind, operand) -> its layout under each candidate
        self._specs_id: dict[tuple[int, int], int] = {}  # ... and that list's id (`_Recursive.layout_lists`)
        self.moves: dict[tuple, np.ndarray] = {}  # (edge's value, both ends' (kind, operand)) -> the edge's table
        self._own: dict[float, dict] = {}  # λ -> `own`
        self.unweighted: dict[tuple, np.ndarray] = {}  # `own`'s entries of kinds that keep no byte: every λ's
        self._seconds: dict[int, np.ndarray] = {}  # kind -> its own seconds per candidate, at any λ
        self._kept: dict[tuple, np.ndarray] = {}  # (kind, bytes it keeps) -> bytes kept per candidate
        self._edge_tables: dict[
            tuple, tuple
        ] = {}  # (id() of a `Ties`, its classes' kinds) -> `edge_tables`', and the ties
        self.own = self._own.setdefault(lam, {})
        self.folds: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}  # `Level._fold`'s, by the arrays' bytes
        self.orders: dict[tuple, tuple] = {}  # `Level._key` -> its eliminations' order (`Level._eliminate_as`)
        # The core's classes and cost evaluations (`Level._prepare_core`), by contents: a level
        # barred from another (`_Recursive._closed`), its boundary check or the same axes' level of a
        # later run (another λ, or another base) holds mostly the same arrays, so its core reads what
        # the levels before it evaluated.
        self.contents: dict[tuple, int] = {}  # an array's shape and bytes -> its id
        self.seen: dict[
            tuple[int, bool], tuple[np.ndarray, int]
        ] = {}  # (id(), transposed) -> the array, held, and its id
        self.classes: dict[tuple, int] = {}  # a core unit's contents -> its class
        self.locals: dict[tuple, tuple[np.ndarray, int, int, tuple[bool, ...]]] = {}  # `Level._local`'s
        self.pairs: dict[tuple, tuple[int, int] | None] = {}  # `Level._pair`'s

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

    def seconds_of(self, k: int, kind: int) -> np.ndarray:
        """Unit `k`'s (of `kind`) own seconds per candidate (`SearchGraph.unit_seconds`): they read
        neither λ nor the bytes kept, so every run's level of these axes reads them once."""
        found = self._seconds.get(kind)
        if found is None:
            found = self._seconds[kind] = np.array([self.g.unit_seconds(k, a) for a in self._cands[kind]])
        return found

    def kept_of(self, search: Searching, k: int, kind: int, kept: tuple) -> np.ndarray:
        """The bytes per device unit `k` (of `kind`) keeps at the peaks weighed (`kept`, its
        `Searching.kept_bytes`) per candidate: read once whatever λ weighs them."""
        found = self._kept.get((kind, kept))
        if found is None:
            found = self._kept[(kind, kept)] = np.array([search.kept_under(k, a) for a in self._cands[kind]])
        return found

    def edge_tables(self, ties: Ties, kinds: list[int]) -> tuple[list, dict, dict]:
        """The tables of a level of `ties`' classes, its units of `kinds`: per class, the diagonals of
        the tables of edges inside it (both ends take its one pick) to add to its own costs, in
        order; per pair of neighbouring classes `(a, b)`, `a < b`, their tables summed (indexed
        `[c_a, c_b]`); each class's neighbours. None of it reads λ: the levels of every run on the
        same classes and base (its first level, a boundary check's waves) read them once."""
        key = (id(ties), tuple(kinds))
        found = self._edge_tables.get(key)
        if found is None:
            found = self._edge_tables[key] = (*self._paired(ties, kinds), ties)  # the ties held: their id keys
        return found[:3]

    def _paired(self, ties: Ties, kinds: list[int]) -> tuple[list, dict, dict]:
        diagonals: list[tuple[int, np.ndarray]] = []
        tables: dict[tuple[int, int], np.ndarray] = {}
        nbrs: dict[int, set[int]] = collections.defaultdict(set)
        reps, moves = ties.reps, self.moves
        for (u, pu, v, pv, value), (i, times) in ties.edges.items():  # the loop is per edge
            key = (value, (kinds[u], pu), (kinds[v], pv))
            table = moves.get(key)
            if table is None:
                table = moves[key] = self.table(i, value, reps[u], key[1], reps[v], key[2])
            if times > 1:
                table = table * times
            if u == v:
                diagonals.append((u, np.diag(table)))
                continue
            if u > v:
                u, v, table = v, u, table.T
            found = tables.get((u, v))
            tables[(u, v)] = table if found is None else found + table
            nbrs[u].add(v)
            nbrs[v].add(u)
        return diagonals, tables, dict(nbrs)

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
            found = self._tables[key] = np.array(
                [[g.edge_seconds(e, x, y) for y in self.specs[theirs]] for x in self.specs[mine]]
            )
        return found

    def _layouts_id(self, k: int, key: tuple[int, int]) -> int:
        found = self._specs_id.get(key)
        if found is None:
            lists = self._layout_lists
            found = self._specs_id[key] = lists.setdefault(tuple(self.specs_of(k, key)), len(lists))
        return found


class Reused:
    """What a search's runs share (every run's lists of layouts by id, its edge tables, per level's
    axes the last level's `Shared`), held for the searches of one program whose graphs differ in
    their memory model only (each placement of the state a budget weighs, `_search._reused`): none
    of it reads the memory model (the own costs that weigh the bytes held are keyed by those bytes
    and λ), so a later search reads what the earlier ones priced rather than pricing the program
    again. Claimed by the first search's units and edges (`serves`): a graph whose units or edges
    differ from them makes its own."""

    def __init__(self):
        self.layout_lists: dict[tuple, int] = {}
        self.tables: dict[tuple[int, int, int], np.ndarray] = {}
        self.shared: dict[Group, Shared] = {}
        self._claimed: tuple | None = None

    def serves(self, g: SearchGraph, edge_values: list[int]) -> bool:
        """Whether a search over `g`, its edges' values numbered `edge_values`, may read these: the
        first to ask claims them; a later one, where its units' structures and edges are the first's."""
        mine = (g.shape_of_unit, [(e.src, e.dst) for e in g.edges], edge_values)
        if self._claimed is None:
            self._claimed = mine
        return self._claimed == mine


class Eliminated:
    """A level's eliminations (`Level._eliminate`) as recorded, for a level barred from it to
    replay (`Level._replay`).

    Attributes:
      start / tables_built: the level's own costs and tables as built (`Level._whole`).
      steps: per step, the unit eliminated and its neighbours then (none, one or two), in order.
      at: per eliminated unit (not one of a single candidate), its step.
      used: per table (by its ends), the step that folded it.
      inputs: per step, the unit's costs and its tables (`[c_k, c_neighbour]`) it folded.
      unary_parts / table_parts: per unit's costs, per table, the parts added to it as built, in
        order: `(step, array)`, step -1 for a table of a unit with a single candidate.
      record_of: per step of one or two neighbours, its index in `records`.
      unary, tables, nbrs, picks, records, core: the level once eliminated; table_at: each of its
        tables' place in `tables`; prepared: its core as `Level._prepare_core` made it; beliefs: its
        core's arrays as `Core._beliefs` made them.
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
        self.beliefs: tuple | None = None

    @staticmethod
    def summed(
        parts: Sequence[tuple[int, np.ndarray]], found: np.ndarray | None, redone: dict[int, tuple]
    ) -> np.ndarray:
        """`found` (None: no table yet) with `parts` added in their order, as eliminating added them;
        a step's part read from `redone` where it was folded again."""
        for n, part in parts:
            part = redone[n][0] if n in redone else part
            found = part if found is None else found + part
        assert found is not None  # a table folded had a part at least
        return found

    def close(self, level: Level, core: list[int]) -> None:
        self.unary, self.tables, self.nbrs = list(level.unary), dict(level.tables), level.nbrs
        self.picks, self.records, self.core, self.core_set = dict(level.picks), list(level.records), core, set(core)
        self.table_at = {key: n for n, key in enumerate(level.tables)}
