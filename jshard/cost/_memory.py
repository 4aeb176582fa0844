"""The memory model: which values one device holds at each top-level program point.

A value is live from the operator that makes it to its last top-level use (a use inside a loop or
branch counts at the loop); arguments from the start to the end unless donated; the function's
results to the end, and from the start where they do not take over a donated argument's buffer (XLA
allocates each result its own buffer for the whole program: `memory_analysis` counts them beside
the temporaries). State kept in host memory between steps (`parallelize(..., offload=...)`) is
on the device only while the step uses it: such an argument from its first use to its last, a
result that updates it only where it is made (it streams back to the host from there). Bytes per device follow from each value's layout, so the search (and the
recompute, offload and pipeline planners after it) weigh a layout's memory the same way.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
from jax.extend import core as jcore

from jshard.graph import Node


@functools.lru_cache(maxsize=4096)
def _shape_itemsize(aval) -> tuple[tuple[int, ...], int]:
    return tuple(aval.shape), itemsize(aval.dtype)


def itemsize(dtype: object) -> int:
    """Bytes per element of `dtype`; a PRNG key's (`key<fry>`) is its key data's (8 for threefry)."""
    return int(dtype.itemsize) if hasattr(dtype, "itemsize") else np.dtype(dtype).itemsize


def array_of(v) -> tuple[tuple[int, ...], int]:
    """`(shape, itemsize)` of a jaxpr value."""
    return _shape_itemsize(v.aval)


def value_bytes(v) -> float:
    """Bytes of a whole jaxpr value (on one device holding all of it)."""
    shape, itemsize = array_of(v)
    return float(math.prod(shape) * itemsize)


@dataclasses.dataclass(frozen=True)
class LiveRanges:
    """Live ranges over the top-level program points `0..end` of a flattened program.

    Attributes:
      first / last: value -> the first and last program point it is held at.
      end: the point after the last operator (the function's results).
    """

    first: Mapping
    last: Mapping
    end: int

    def live_bytes(self, held: Mapping) -> np.ndarray:
        """Bytes live at each program point, given the bytes one device holds of each value."""
        delta = np.zeros(self.end + 2)
        for v, b in held.items():
            delta[self.first[v]] += b
            delta[self.last[v] + 1] -= b
        return np.cumsum(delta)[: self.end + 1]

    def live_at(self, t: int, values: Sequence) -> list:
        """Those of `values` held at program point `t`."""
        return [v for v in values if self.first[v] <= t <= self.last[v]]


def live_ranges(nodes: Sequence[Node], args: Sequence, outvars: Sequence, donated: frozenset = frozenset(),  # noqa: C901  (one pass over the program, each kind of value in its branch)
                host: frozenset = frozenset()) -> LiveRanges:
    """The `LiveRanges` of the non-scalar values of a flattened program (see the module docstring);
    `host`: the arguments and results kept in host memory between steps."""
    top, enclosing = [], -1
    for i, node in enumerate(nodes):
        if not node.inside:
            enclosing = i
        top.append(enclosing)
    end = len(nodes)
    first: dict = {}
    last: dict = {}
    streamed = set()
    for v in args:
        if isinstance(v, jcore.Var) and getattr(v.aval, "shape", ()):
            first[v], last[v] = 0, (0 if v in donated or v in host else end)
            if v in host:
                streamed.add(v)
    for i, node in enumerate(nodes):
        for v in node.inputs:
            if isinstance(v, jcore.Var) and v in first:
                if v in streamed:  # on the device from its first use
                    first[v], last[v] = top[i], top[i]
                    streamed.discard(v)
                last[v] = max(last[v], top[i])
        if not node.inside:
            for v in node.outputs:
                if getattr(v.aval, "shape", ()):
                    first[v] = last[v] = i
    aliased = _aliased(args, outvars, donated)
    for v in outvars:
        if isinstance(v, jcore.Var) and v in last and v not in host:
            last[v] = end
            if v not in aliased:  # XLA gives a result its own buffer for the whole program
                first[v] = 0
    return LiveRanges(first, last, end)


def _aliased(args: Sequence, outvars: Sequence, donated: frozenset) -> set:
    """The results written into a donated argument's buffer (`paired` with the donated arguments)."""
    return {v for v, _ in paired(args, outvars, lambda v: v in donated, lambda v: isinstance(v, jcore.Var))}


def paired(args: Sequence, outvars: Sequence, arg_kept: Callable[[object], bool],
           out_kept: Callable[[object], bool]) -> list[tuple]:
    """`(result, argument)`: each result `out_kept` takes, paired with the first unpaired argument
    `arg_kept` takes of its shape and dtype, in order, as JAX pairs donated buffers with results."""
    free = collections.defaultdict(list)
    for v in args:
        if arg_kept(v):
            free[(getattr(v.aval, "shape", ()), str(v.aval.dtype))].append(v)
    found = []
    for v in outvars:
        queue = free.get((getattr(v.aval, "shape", ()), str(v.aval.dtype))) if out_kept(v) else None
        if queue:
            found.append((v, queue.pop(0)))
    return found
