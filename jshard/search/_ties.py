"""Replay for the recursive search (`_recursive.py`): the repeated runs of units an unrolled loop
leaves (its layers, found as a period in the units' structure and wiring) and the classes of units
a level decides as one (`Ties`): the interior layers of each run as one class, the first and last
`_WINDOW` layers each unit its own; for the boundary check (`Ties.checking`), every unit its own
class but the middle layers of long runs (the first and last `_WINDOW + _MARGIN` layers alone).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jshard.search._shared import Searching

_WINDOW = 1  # replay: layers of a repeated run decided on their own at each end; the interior ones as one
_ROUNDS = 2  # ... runs found on the units' structure refined by their neighbours' to this many hops
_PERIODS = 16  # ... among the commonest periods
_MARGIN = 1  # ... the boundary check: layers beside those decided on their own at each end, each on its own too


class Ties:
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

    def __init__(self, search: Searching, replay: bool = True):
        g = search.g
        found = []
        if replay and g.edges:
            kinds: dict[tuple, int] = {}
            colour = np.array([kinds.setdefault((g.shape_of_unit[k], search.kept_bytes.get(k)), len(kinds))
                               for k in range(len(g.units))], np.int64)
            found = _runs(self._refined(search, colour))
        self._tie(search, found, _WINDOW)

    @classmethod
    def checking(cls, search: Searching, found: list[tuple[int, int, int]]) -> Ties:
        """The boundary check's classes: the runs `found` for the replay, each unit its own class but
        the middle layers of runs long enough to leave two, `_WINDOW + _MARGIN` layers from each end."""
        ties = cls.__new__(cls)
        ties._tie(search, found, _WINDOW + _MARGIN)
        return ties

    def _tie(self, search: Searching, found: list[tuple[int, int, int]], window: int) -> None:
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
            rows = np.stack([of[src], src_pos, of[dst], dst_pos, value], 1)
            _, first, times = np.unique(_row_keys(rows), return_index=True, return_counts=True)
            order = np.argsort(first, kind="stable")
            first = first[order]
            self.edges = dict(zip(map(tuple, rows[first].tolist()), zip(first.tolist(), times[order].tolist())))

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
    def _refined(search: Searching, colour: np.ndarray) -> np.ndarray:
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
    found: list[tuple[int, int, int]] = []
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



def _row_keys(rows: np.ndarray) -> np.ndarray:
    """One int64 per row of non-negative `rows`, equal where the rows are: the row read as a number
    in mixed radix (each column's largest entry plus one), where that fits in 63 bits; else the rows'
    ranks (`np.unique` over rows sorts them as raw bytes, ten times slower than over one column)."""
    radix = [int(c.max()) + 1 for c in rows.T]
    if math.prod(radix) >= 1 << 63:
        return np.unique(rows, axis=0, return_inverse=True)[1].ravel()
    keys = np.zeros(len(rows), np.int64)
    for column, size in zip(rows.T, radix):
        keys = keys * size + column
    return keys


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on an array of uint64 (wrapping arithmetic): a hash of each entry."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))

