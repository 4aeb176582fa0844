"""`Timeline`: one resource (a device's compute, one kind of collective) in a predicted schedule.

The predicted step time where collectives overlap compute (`CostModel.overlap`) is the makespan of
the program's operators placed on their resources in program order, each as early as its inputs
allow: in the first idle gap of its resource long enough to hold it, as XLA's latency-hiding
scheduler moves independent work into a collective's shadow rather than wait for it in program
order.
"""

from __future__ import annotations

import bisect
import itertools

GAPS = 64
"""Idle gaps a `Timeline` keeps to fill, the latest: work placed in an older one (a scheduler moving
it far back in program order) is not looked for, so a schedule of n pieces costs O(n) and errs long."""


class Timeline:
    """The busy time of one resource: its end (`tail`) and the idle gaps before it.

    Examples:
      >>> t = Timeline()
      >>> t.place(0.0, 1.0), t.place(3.0, 1.0), t.place(0.5, 1.0), t.tail
      (1.0, 4.0, 2.0, 4.0)
    """

    def __init__(self) -> None:
        self.tail = 0.0
        self.gaps: list[tuple[float, float]] = []  # idle [start, end) before `tail`, in order
        self.forgotten: list[tuple[float, float]] = []  # older gaps, no longer filled (`GAPS`), in order

    def place(self, ready: float, length: float) -> float:
        """Runs work of `length` seconds no earlier than `ready`, in the first gap that holds it or
        after the tail; returns when it ends."""
        if length <= 0.0:
            return ready
        for k, (a, b) in enumerate(self.gaps):
            start = max(a, ready)
            if start + length <= b:
                self.gaps[k:k + 1] = [g for g in ((a, start), (start + length, b)) if g[1] > g[0]]
                return start + length
        start = max(ready, self.tail)
        if start > self.tail:
            self.gaps.append((self.tail, start))
            if len(self.gaps) > GAPS:
                self.forgotten.append(self.gaps.pop(0))
        self.tail = start + length
        return self.tail

    def busy(self, start: float, end: float) -> float:
        """Seconds of `[start, end)` the resource works (what it has placed so far).

        Examples:
          >>> t = Timeline()
          >>> t.place(0.0, 1.0), t.place(2.0, 1.0), t.busy(0.5, 2.5)
          (1.0, 3.0, 1.0)
        """
        worked = max(min(end, self.tail) - start, 0.0)
        first = bisect.bisect_left(self.forgotten, (start,)) - 1
        for a, b in itertools.chain(self.forgotten[max(first, 0):], self.gaps):
            if a >= end:
                break
            worked -= max(min(b, end) - max(a, start), 0.0)
        return worked
