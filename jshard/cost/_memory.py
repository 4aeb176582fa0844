"""The memory model: which values one device holds at each top-level program point.

A value is live from the operator that makes it to its last top-level use (a use inside a loop or
branch counts at the loop); arguments from the start to the end unless donated; the function's
results to the end, and from the start where they do not take over a donated argument's buffer (XLA
allocates each result its own buffer for the whole program: `memory_analysis` counts them beside
the temporaries). State kept in host memory between steps (`parallelize(..., offload=...)`) is
on the device only while the step uses it: such an argument from its first use to its last, a
result that updates it only where it is made (it streams back to the host from there). Bytes per device follow from each value's layout, so the search (and the
recompute, offload and pipeline planners after it) weigh a layout's memory the same way.

A loop or branch adds, at its program point, its body's own peak: the values its body makes, live
over the body's program points by the same rules (its results to the body's end; a nested loop's
body's peak at that loop's point), the largest body's (a `while`'s condition or body, a `cond`'s
branch) counted once whatever the trip count, as XLA runs one iteration's temporaries at a time. What
the loop carries in and out is its operands and results, counted at the top level already. One
attention tile's scores in a scanned layer, and the backward pass's temporaries beside them, are
held this way. Inside a body, buffers follow XLA's fusion (`Fusion`, given by the caller as
`jshard.rules.FUSION`): a fusible result read only by fusible operators holds none (its operands
live to where the fused kernel runs), and an elementwise result takes over an operand that dies
there; an operator of the body whose results nothing reads holds none either (XLA removes it); at
the top level each value keeps its own buffer to its last use. A manual region's
(`shard_map`) body, in per-device shapes, adds its own peak at its point by the same rules.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np
from jax.extend import core as jcore

from jshard.graph import MANUAL, Node, flatten


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
    """Bytes of a whole jaxpr value (on one device holding all of it); once per array type (an
    unrolled model's layers share theirs)."""
    return _whole_bytes(v.aval)


@functools.lru_cache(maxsize=4096)
def _whole_bytes(aval) -> float:
    shape, size = _shape_itemsize(aval)
    return float(math.prod(shape) * size)


class Fusion(NamedTuple):
    """How XLA fuses a loop body's operators, as the memory model counts the body's buffers.

    Attributes:
      fused: primitives whose result, read only by others of them, stays in the kernel's registers.
      in_place: primitives whose result takes over the buffer of an operand that dies there.
    """

    fused: Collection[str] = frozenset()
    in_place: Collection[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class LiveRanges:
    """Live ranges over the program points `0..end` of a flattened program (or of one loop or branch
    body, its points its own operators).

    Attributes:
      first / last: value -> the first and last program point it is held at.
      end: the point after the last operator (the function's, or the body's, results).
      bodies: a loop or branch operator's point -> the `LiveRanges` of each of its bodies.
      manual: a manual region's (`shard_map`) point -> the bytes its body holds at once of the
        values it makes, in its per-device shapes (no layout of the plan's changes them).
    """

    first: Mapping
    last: Mapping
    end: int
    bodies: Mapping[int, tuple[LiveRanges, ...]] = dataclasses.field(default_factory=dict)
    manual: Mapping[int, float] = dataclasses.field(default_factory=dict)

    def live_bytes(self, held: Mapping) -> np.ndarray:
        """Bytes live at each program point, given the bytes one device holds of each value (a value
        `held` lacks holds none); a loop's point adds its largest body's peak (`transient`)."""
        values, points = self._spans
        given = np.fromiter((held.get(v) or 0.0 for v in values), float, len(values))
        delta = np.zeros(self.end + 2)
        np.add.at(delta, points, np.stack([given, -given], 1).ravel())  # in `_spans`' order, as a loop adds
        live = np.cumsum(delta)[: self.end + 1]
        for t in self.bodies:
            live[t] += self.transient(t, held)
        for t, b in self.manual.items():
            live[t] += b
        return live

    @functools.cached_property
    def _spans(self) -> tuple[list, np.ndarray]:
        """The values with a live range here, in `first`'s order, and per value, interleaved, the
        point its bytes join the live ones and the point after its last: what `live_bytes` adds
        each value's bytes at (one `np.add.at` per call, not two item writes per value)."""
        values = list(self.first)
        points = np.empty(2 * len(values), np.intp)
        points[0::2] = np.fromiter(self.first.values(), np.intp, len(values))
        points[1::2] = np.fromiter((self.last[v] + 1 for v in values), np.intp, len(values))
        return values, points

    def transient(self, t: int, held: Mapping) -> float:
        """The most bytes the bodies of the loop or branch at point `t` hold at once of the values
        they make (0 where `t` is no loop's point; a manual region's are `manual`)."""
        return max((float(body.live_bytes(held).max()) for body in self.bodies.get(t, ())), default=0.0)

    def values(self) -> Iterator:
        """Every value with a live range: this program's, then its bodies' (and theirs)."""
        yield from self.first
        for bodies in self.bodies.values():
            for body in bodies:
                yield from body.values()

    def live_at(self, t: int, values: Sequence, held: Mapping | None = None) -> list:
        """Those of `values` held at program point `t`, and at a loop's point those its largest body
        holds at its own peak (`held`: bytes per value; None: each whole)."""
        found = [v for v in values if v in self.first and self.first[v] <= t <= self.last[v]]
        bodies = self.bodies.get(t)
        if bodies:
            sizes = held if held is not None else _Whole()
            body = max(bodies, key=lambda b: float(b.live_bytes(sizes).max()))
            found += body.live_at(int(np.argmax(body.live_bytes(sizes))), values, held)
        return found


class _Whole(dict):
    """Each value's bytes whole (`value_bytes`), as a mapping `LiveRanges.live_bytes` reads."""

    def get(self, v, default=None):
        return value_bytes(v)


def live_ranges(nodes: Sequence[Node], args: Sequence, outvars: Sequence, donated: frozenset = frozenset(),  # noqa: C901  (one pass over the program, each kind of value in its branch)
                host: frozenset = frozenset(), fusion: Fusion | None = None) -> LiveRanges:
    """The `LiveRanges` of the non-scalar values of a flattened program (see the module docstring);
    `host`: the arguments and results kept in host memory between steps; `fusion`: how XLA fuses a
    loop body's operators (`jshard.rules.FUSION`; None: each value its own buffer)."""
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
    fusion = fusion or Fusion()
    bodies = {i: _bodies(nodes, i, fusion) for i, node in enumerate(nodes) if node.bodies and not node.inside}
    manual = {i: _manual(node, fusion) for i, node in enumerate(nodes) if node.primitive == MANUAL and not node.inside}
    return LiveRanges(first, last, end, bodies, manual)


def _manual(node: Node, fusion: Fusion) -> float:
    """The most bytes a manual region's body holds at once of the values it makes (its operands and
    results are the region's, counted where it runs), by the rules of a loop's body."""
    inner = flatten(node.eqn.params["jaxpr"])
    return float(_body(inner, -1, range(len(inner)), (), fusion).live_bytes(_Whole()).max())


def _bodies(nodes: Sequence[Node], loop: int, fusion: Fusion) -> tuple[LiveRanges, ...]:
    """The `LiveRanges` of each body of the loop or branch operator `nodes[loop]`, over the body's own
    operators (the nodes after it whose `loop` it is, each followed by those nested in it)."""
    spans: list[list[int]] = [[] for _ in nodes[loop].bodies]
    body = 0
    for j in range(loop + 1, len(nodes)):
        if nodes[j].loop < loop:  # past the operator's bodies
            break
        if nodes[j].loop == loop:
            body = nodes[j].body
        spans[body].append(j)
    return tuple(_body(nodes, loop, span, results, fusion) for span, (_, results) in zip(spans, nodes[loop].bodies))


def _body(nodes: Sequence[Node], loop: int, span: Sequence[int], results: Sequence,
          fusion: Fusion) -> LiveRanges:
    """One body's `LiveRanges` (`span`: its nodes, nested ones included): each value its own operators
    make, from its operator to its last use in the body (a use in a nested body at that body's
    operator), the body's results to its end."""
    first: dict = {}
    last: dict = {}
    bodies: dict = {}
    manual: dict = {}
    point = -1
    for j in span:
        node = nodes[j]
        own = node.loop == loop
        point += own
        for v in node.inputs:
            if isinstance(v, jcore.Var) and v in first:
                last[v] = point
        if own:
            for v in node.outputs:
                if getattr(v.aval, "shape", ()):
                    first[v] = last[v] = point
            if node.bodies:
                bodies[point] = _bodies(nodes, j, fusion)
            if node.primitive == MANUAL:
                manual[point] = _manual(node, fusion)
    end = point + 1
    for v in results:
        if isinstance(v, jcore.Var) and v in first:
            last[v] = end
    own = [j for j in span if nodes[j].loop == loop]
    _dead(nodes, span, own, first, last, results)
    _fused(nodes, own, first, last, fusion.fused)
    _in_place(nodes, own, first, last, fusion.in_place)
    return LiveRanges(first, last, end, bodies, manual)


def _dead(nodes: Sequence[Node], span: Sequence[int], own: Sequence[int], first: dict, last: dict,
          results: Sequence) -> None:
    """Drops the values of the body's operators that nothing needs: none of their results is read in
    the body (its nested bodies included) or is a body result, nor read by such an operator only,
    and they have no effects. XLA's dead-code elimination removes them (a recomputed forward's
    `jnp.where` fill broadcast to the scores' shape, which the backward never reads), so they hold
    no buffer. (The top level's dead operators are `jshard.graph.dead_nodes`.)"""
    readers: collections.Counter = collections.Counter()
    for j in span:
        readers.update(v for v in nodes[j].inputs if isinstance(v, jcore.Var))
    kept = {v for v in results if isinstance(v, jcore.Var)}
    for j in reversed(own):  # readers first: a chain of dead operators goes whole
        node = nodes[j]
        if node.bodies or node.eqn.effects or node.primitive == MANUAL:
            continue
        if any(readers[v] or v in kept for v in node.outputs):
            continue
        readers.subtract(v for v in node.inputs if isinstance(v, jcore.Var))
        for v in node.outputs:
            first.pop(v, None)
            last.pop(v, None)


def _fused(nodes: Sequence[Node], own: Sequence[int], first: dict, last: dict, fused: Collection[str]) -> None:
    """Drops the values a `fused` operator of the body makes that only `fused` operators of the body
    read: they live in a kernel's registers (XLA's loop fusion), which reads their operands where it
    runs, at their readers: each operand's range reaches theirs."""
    readers: dict = collections.defaultdict(list)
    for j in own:
        for v in nodes[j].inputs:
            if isinstance(v, jcore.Var) and v in first:
                readers[v].append(nodes[j].primitive)
    for point in range(len(own) - 1, -1, -1):  # readers first: a chain's operands reach its last reader
        node = nodes[own[point]]
        if node.primitive not in fused:
            continue
        for out in node.outputs:
            if out not in first or last[out] in (point, len(own)) or not all(p in fused for p in readers[out]):
                continue  # unread, a body result, or read from memory
            for v in node.inputs:
                if isinstance(v, jcore.Var) and v in first:
                    last[v] = max(last[v], last[out])
            del first[out], last[out]


def _in_place(nodes: Sequence[Node], own: Sequence[int], first: dict, last: dict, in_place: Collection[str]) -> None:
    """Each `in_place` (elementwise) operator of the body writes its result into an operand of the
    same shape and item size that dies there, as XLA's buffer assignment shares them: that operand's
    range ends a point earlier."""
    for point, j in enumerate(own):
        node = nodes[j]
        if node.primitive not in in_place:
            continue
        for out in node.outputs:
            if out not in first:
                continue
            dying = next((v for v in node.inputs if isinstance(v, jcore.Var) and last.get(v) == point
                          and first[v] < point and array_of(v) == array_of(out)), None)
            if dying is not None:
                last[dying] = point - 1


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
            free[_pairing(v.aval)].append(v)
    found = []
    for v in outvars:
        queue = free.get(_pairing(v.aval)) if out_kept(v) else None
        if queue:
            found.append((v, queue.pop(0)))
    return found


@functools.lru_cache(maxsize=4096)
def _pairing(aval) -> tuple:
    """What `paired` pairs a result with an argument by: the shape and the dtype's name (once per
    array type: a dtype's name is made in Python, and a train step pairs thousands)."""
    return getattr(aval, "shape", ()), str(aval.dtype)
