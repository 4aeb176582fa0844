"""`Timeline`: one resource (a device's compute, one kind of collective) in a predicted schedule.

The predicted step time where collectives overlap compute (`CostModel.overlap`) is the makespan of
the program's operators placed on their resources in program order, each as early as its inputs
allow: in the first idle gap of its resource long enough to hold it, as XLA's latency-hiding
scheduler moves independent work into a collective's shadow rather than wait for it in program
order.
"""

from __future__ import annotations


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
        for a, b in self.gaps:
            worked -= max(min(b, end) - max(a, start), 0.0)
        return worked
