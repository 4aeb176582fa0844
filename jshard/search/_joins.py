"""The combined all-reduce sets a choice opens (`Joins`): which sets another combinable unit opens
already, kept as the choice's units move, so a unit's latency (`SearchGraph.lone_latency`) is read
without counting its peers each time."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from typing import TYPE_CHECKING

from jshard.search._units import Assignment, Group

if TYPE_CHECKING:
    from jshard.search._graph import SearchGraph


class Joins:
    """The mesh axes of the combinable units' all-reduces under a choice, counted per (loop,
    reduction) (`SearchGraph.set_key`), kept as the choice's units move (`moved`): which combined
    sets another unit already opens is read in the time of one unit's sets, not its peers'.

    Args:
      g: the search graph.
      choice: the units' assignments.
    """

    def __init__(self, g: SearchGraph, choice: Sequence[Assignment]):
        self._g = g
        self._mine = {k: g.partial_sums(k, choice[k]) for k in g.combinable}
        self._counts: dict[tuple, collections.Counter] = {}
        for key, units in g.peers.items():
            self._counts[key] = collections.Counter(axes for k in units for axes in self._mine[k])

    def others(self, k: int) -> frozenset[Group]:
        """The mesh axes of the all-reduces the other combinable units of `k`'s loop and reduction
        run: the sets `k` can join at no latency."""
        if k not in self._mine:
            return frozenset()
        mine = self._mine[k]
        return frozenset(axes for axes, n in self._counts[self._g.set_key(k)].items() if n > mine.count(axes))

    def moved(self, k: int, a: Assignment) -> None:
        """Unit `k` now under `a`."""
        if k not in self._mine:
            return
        counts = self._counts[self._g.set_key(k)]
        counts.subtract(self._mine[k])
        self._mine[k] = self._g.partial_sums(k, a)
        counts.update(self._mine[k])
