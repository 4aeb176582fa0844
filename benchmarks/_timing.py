"""Wall-clock timing: repeated runs under a time budget, and interleaved runs in rotating order."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds `fn()` took, and what it returned."""
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def repeated(fn: Callable[[], Any], runs: int, budget: float) -> tuple[list[float], Any]:
    """Seconds of each of up to `runs` calls of `fn` (at least one; no new call once `budget`
    seconds are spent), and what the last call returned."""
    times: list[float] = []
    result = None
    while len(times) < runs and (not times or sum(times) < budget):
        took, result = timed(fn)
        times.append(took)
    return times, result


def interleaved(
    fns: Sequence[Callable[[], Any]], rounds: int, budget: float, setup: Callable[[], Any] = lambda: None
) -> tuple[list[tuple[float, ...]], list[Any]]:
    """Rounds of one call of each of `fns`, the order rotated by one each round so that none always
    runs right after another; per round the seconds of each (in `fns` order), and what each call
    returned last. `setup` runs, untimed, before every call. At least one round; no new round
    once `budget` seconds are spent."""
    out: list[tuple[float, ...]] = []
    last: list[Any] = [None] * len(fns)
    start = time.perf_counter()
    while len(out) < rounds and (not out or time.perf_counter() - start < budget):
        took = [0.0] * len(fns)
        for k in range(len(fns)):
            i = (k + len(out)) % len(fns)
            setup()
            took[i], last[i] = timed(fns[i])
        out.append(tuple(took))
    return out, last
