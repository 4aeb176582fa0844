"""Whole plans made without searching, as more candidates of the searches (their seeds).

Where a program has anchors (`shard` calls, fixed arguments), propagating from them (the engine's
`propagate_globally`, as `semi_auto` plans) gives a whole plan in one pass. The recursive search
hands out one mesh axis per level and prices each level on the axes handed out so far, so it can
miss a plan that only pays off once every axis is given (a weight gradient's partial sum over the
data-parallel axis is cheap only once the tensor-parallel axes cut it too; a scanned body's batch
cut over every axis, the plain data parallelism the level before prices at a loss). So the
searches also weigh the plans an engineer writes first, around the same anchors (`experts`): data
parallel (the batch cut on its rows over every mesh axis, the state whole) and fully sharded
(ZeRO-3: each state array cut over every mesh axis too), each propagated from there. `seeds` reads
each back as a choice per unit of the `SearchGraph`, priced by the same measure
(`SearchGraph.seconds`, `SearchGraph.peak`), so a search keeps one wherever it predicts less and
fits the budget: never worse than propagating from the same anchors, nor than those plans.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from jshard.cost import LiveRanges, value_bytes
from jshard.graph import CONSTRAINT
from jshard.layouts import Spec, replicated
from jshard.propagate import Result, propagate_globally
from jshard.rules import shape_of
from jshard.search._graph import Assignment, Joins, SearchGraph, Solved

_MOVES = 256  # `fitted`: moves at most
_SWEEPS = 4  # `polished`: sweeps over the units at most
_NEAR = 1e-9  # `_Peak`: within this share of the budget, the peak is read again from the whole choice

PROPAGATED = "the plan propagated from the anchors"
"""`SearchReport.status`'s start where a search kept the propagated plan."""
DATA_PARALLEL = "the data-parallel plan"
"""`SearchReport.status`'s start where a search kept the data-parallel plan (`experts`)."""
FULLY_SHARDED = "the fully-sharded plan"
"""`SearchReport.status`'s start where a search kept the fully-sharded plan (`experts`)."""
SEEDS = (PROPAGATED, DATA_PARALLEL, FULLY_SHARDED)
"""The plans a search weighs beside its own (`seeds`)."""
Memo = Callable[[Hashable, Callable[[], Any], Any], Any]
"""A planning session's store (`compile`'s `Planning.kept`: one cost model): `memo(key, make, holds)`
is `make()` made once per key, `holds` (what ids in `key` stand for) held meanwhile. The searches
of one traced program that its weighings make (each offload placement, say) propagate the same
seeds and read them back alike (`_kept`): the graphs differ in their memory model only."""


def seeds(g: SearchGraph, args: Sequence, outvars: Sequence, fixed: Mapping, batch: Sequence,
          budget: float | None, only: str | None = None, memo: Memo | None = None) -> list[Solved]:
    """The plan propagated from the anchors (`propagated`, as propagated) and, under a `budget`, the
    expert plans around them (`experts`: not without one, where they would add seconds to planning
    a deep unrolled step: 5.3 s of the 96-layer GPT-3-shaped step on 1024 devices), each as made
    (its estimated peak may be over `budget`: `fit_budget` moves it); `only`: the one of that status
    alone (a seed asked for as made: `search(as_seeded=...)`), where it is made; `memo`: where the
    propagations are kept (`Memo`), if anywhere."""
    found = [propagated(g, args, outvars, fixed, budget, fit=False, memo=memo) if only in (None, PROPAGATED) else None,
             *(experts(g, args, outvars, fixed, batch, only, memo) if budget is not None and only != PROPAGATED else ())]
    return [s for s in found if s is not None]


def experts(g: SearchGraph, args: Sequence, outvars: Sequence, fixed: Mapping, batch: Sequence,
            only: str | None = None, memo: Memo | None = None) -> list[Solved]:
    """The data-parallel and the fully-sharded plan around the anchors (`fixed`, kept): the `batch`
    arguments' rows cut over every mesh axis (as many, major first, as divide them), the other
    arguments whole (`DATA_PARALLEL`) or each cut over every mesh axis on its largest dim they
    divide (`FULLY_SHARDED`, ZeRO-3), and every operator propagated from there; none where no batch
    array is cut (no batch, or its rows divide by no mesh axis); `only`: the one of that status alone."""
    rows = {v: _rows(v, g.axis_size) for v in batch if v not in fixed and shape_of(v)}
    rows = {v: spec for v, spec in rows.items() if spec[0]}
    if not any(axes for v in batch if v in fixed for axes in fixed[v]) and not rows:
        return []
    state = [v for v in args if v not in fixed and v not in rows and shape_of(v)]
    found = []
    for status, lay in ((DATA_PARALLEL, _whole), (FULLY_SHARDED, _largest_dim)):
        if only not in (None, status):
            continue
        anchors = {**fixed, **rows, **{v: lay(v, g.axis_size) for v in state}}
        choice, seconds = _kept(memo, g, status, anchors, (), False, lambda: propagate_globally(
            g.nodes, anchors, [], g.axis_size, g.cost, outputs=outvars, table=g.table))
        found.append(Solved(choice, seconds, g.peak(choice)[0], status))
    return found


def _rows(v, axis_size: Mapping[str, int]) -> Spec:
    """`v` cut on its rows over the mesh axes, major first, as many as divide them."""
    taken: list[str] = []
    for x, n in axis_size.items():
        if n > 1 and shape_of(v)[0] % (math.prod(axis_size[a] for a in taken) * n) == 0:
            taken.append(x)
    return (tuple(taken),) + replicated(len(shape_of(v)) - 1)


def _whole(v, axis_size: Mapping[str, int]) -> Spec:
    return replicated(len(shape_of(v)))


def _largest_dim(v, axis_size: Mapping[str, int]) -> Spec:
    """`v` cut over every mesh axis on its largest dim they divide, else whole."""
    shape, n = shape_of(v), math.prod(axis_size.values())
    dims = [d for d in range(len(shape)) if shape[d] % n == 0]
    top = max(dims, key=lambda d: shape[d], default=None)
    return tuple(tuple(x for x, m in axis_size.items() if m > 1) if d == top else () for d in range(len(shape)))


def propagated(g: SearchGraph, args: Sequence, outvars: Sequence, fixed: Mapping,
               budget: float | None, fit: bool = True, memo: Memo | None = None) -> Solved | None:
    """The plan propagated from the anchors (`fixed` arguments and the program's sharding
    constraints) as a choice per unit, its seconds and peak, moved to fit `budget` where it does not
    (`fit_budget`; with `fit` False, as propagated whatever its estimated peak); None where the
    program has no anchor that cuts an array, or no move fits it; `memo`: as `seeds`'."""
    cut = any(axes for spec in fixed.values() for axes in spec)  # a whole array anchors nothing
    if not cut and not any(node.primitive == CONSTRAINT for node in g.nodes):
        return None
    free = [v for v in args if v not in fixed and shape_of(v)]
    # under a budget, of the free arguments' layouts whose seconds tie, the one of fewest bytes
    lean = budget is not None
    choice, seconds = _kept(memo, g, PROPAGATED, fixed, tuple(free), lean, lambda: propagate_globally(
        g.nodes, fixed, free, g.axis_size, g.cost, outputs=outvars, lean=lean, table=g.table))
    peak, _ = g.peak(choice)
    solved = Solved(choice, seconds, peak, PROPAGATED)
    return fit_budget(g, solved, budget) if fit else solved


def _kept(memo: Memo | None, g: SearchGraph, status: str, anchors: Mapping, free: tuple, lean: bool,
          make: Callable[[], Result]) -> tuple[list[Assignment], float]:
    """The seed `status` propagated on `g` from `anchors` (`make()`; `free`, `lean`: as
    `propagate_globally` takes them) read back as a choice per unit (`choice_of`), and its seconds,
    through `memo` where there is one: keyed by the graph's program (its nodes, by identity, held
    meanwhile), mesh and combiner, which are all the choice and its seconds read (not the memory
    model: each placement of the state a budget weighs reads the same back). The choice returned is
    a copy: the kept one's assignments stay as made."""
    def read() -> tuple[list[Assignment], float]:
        choice = choice_of(g, make())
        return choice, g.seconds(choice)

    if memo is None:
        return read()
    choice, seconds = memo(("seed", status, id(g.nodes), tuple(g.axis_size.items()), frozenset(anchors.items()),
                            free, lean, g.combinable), read, g.nodes)
    return [dict(a) for a in choice], seconds


def fit_budget(g: SearchGraph, solved: Solved, budget: float | None,
               check: Callable[[], None] | None = None) -> Solved | None:
    """`solved` (a seed) where its estimated peak fits `budget`, else moved to fit it
    (`fitted`, then `polished`), or None where no move fits it; `check()` read before each move and
    each unit polished (it raises where the planning stops the search)."""
    if budget is None or solved.peak <= budget:
        return solved
    check = check or (lambda: None)
    tracked = _Peak(g, list(solved.choice))
    local = _Local.of(g, tracked.choice, None)  # the prices the fit reads, read again by the polish
    choice = fitted(g, tracked.choice, budget, check, tracked, local)
    if choice is None:
        return None
    choice = polished(g, choice, budget, check, tracked, local)
    peak, _ = g.peak(choice)
    return Solved(choice, g.seconds(choice), peak, f"{solved.status}, moved to fit the budget")


def fitted(g: SearchGraph, choice: Sequence[Assignment], budget: float, check: Callable[[], None] = lambda: None,
           tracked: _Peak | None = None, local: _Local | None = None) -> list[Assignment] | None:
    """`choice` moved one unit at a time until its estimated peak fits `budget`, or None where no
    move lowers it: each time, of the units laying out the values held at the peak, the move
    (`moves`: one mesh axis to another factor, off the unit, or onto it) that adds the fewest
    seconds (`SearchGraph.local_seconds`) per byte it saves there. A unit's moves and the bytes
    each holds are found once (one unit moves per step: the others' stand); the peak is read from
    the live bytes kept as units move (`tracked`: a `_Peak` of `choice`, which moves it; made here
    where None); `local`: the `_Local` prices of `choice`, kept as it moves, where at hand."""
    tracked = tracked or _Peak(g, list(choice))
    choice = tracked.choice
    local = _Local.of(g, choice, local)
    joins = local.joins
    moved: dict[tuple[int, int], tuple[Assignment, list[Assignment]]] = {}  # (unit, id of its choice) -> `moves`

    def moves_of(k: int) -> list[Assignment]:
        key = (k, id(choice[k]))
        found = moved.get(key)
        if found is None:
            found = moved[key] = (choice[k], moves(g, k, choice[k]))  # the choice held: its id stays its own
        return found[1]

    kept: dict[tuple, float] = {}  # (unit, values, id of an assignment `moved` holds) -> `_held`

    def held_by(k: int, values: tuple, a: Assignment) -> float:
        key = (k, values, id(a))
        found = kept.get(key)
        if found is None:
            found = kept[key] = _held(g, k, values, a)
        return found

    for _ in range(_MOVES):
        check()
        peak, t = tracked.peak()
        if peak <= budget:
            return choice
        held = collections.defaultdict(list)  # unit -> (operand position, value) held at `t`
        for v in g.live_at(t):
            k, pos = g.makers[v]
            if g.units[k].free:
                held[k].append((pos, v))
        best = None
        for k, listed in held.items():
            values = tuple(listed)
            now, before = local.seconds(k, choice[k]), _held(g, k, values, choice[k])
            for a in moves_of(k):
                saved = before - held_by(k, values, a)
                if saved <= 0 or not g.expressible(k, a):
                    continue
                added = max(local.seconds(k, a) - now, 0.0)
                key = (added / saved, -saved)
                if best is None or key < best[0]:
                    best = (key, k, a)
        if best is None:
            return None
        tracked.move(best[1], best[2])
        joins.moved(best[1], best[2])
        local.moved(best[1])
    return None


def polished(g: SearchGraph, choice: list[Assignment], budget: float, check: Callable[[], None] = lambda: None,
             tracked: _Peak | None = None, local: _Local | None = None) -> list[Assignment]:
    """`choice` improved by single moves (`moves`), unit after unit in program order, while one
    lowers the predicted seconds and keeps the estimated peak within `budget`; `_SWEEPS` sweeps at
    most (`tracked`: a `_Peak` of `choice`, which moves it, where one is at hand). A unit a sweep
    found no faster move for, its peak never read, is `settled`: the sweeps after it pass it by
    until it or a unit at the other end of its edges moves (what its prices read, `_Local`), as
    they would find the same (eqx_vit under 0.8x its unbudgeted peak: 2,736 units priced, not
    8,940); `local`: the prices of `choice` read so far (`fitted`'s), where at hand."""
    peak = tracked if tracked is not None and tracked.choice is choice else _Peak(g, choice)
    local = _Local.of(g, choice, local)
    joins = local.joins
    settled: set[int] = set()
    for _ in range(_SWEEPS):
        better = False
        for k, u in enumerate(g.units):
            if not u.free or k in settled:
                continue
            check()
            moved = _polish(g, k, choice, budget, local, peak)
            if moved is None:
                if k not in g.combinable:  # a combinable unit's price reads every unit of its set (`joins`)
                    settled.add(k)
                continue
            if moved:
                joins.moved(k, choice[k])
                local.moved(k)
                settled.difference_update(local.neighbours(k))
                better = True
        if not better:
            break
    return choice


def _polish(g: SearchGraph, k: int, choice: list[Assignment], budget: float, local: _Local, peak: _Peak) -> bool | None:
    """Unit `k` moved (`peak.move`) to its fastest single move (`moves`) that lowers its predicted
    seconds and fits `budget`, in `polished`'s order: True where it moved, False where a faster move
    did not fit (the peak was read), None where there is no faster move (the peak was not read)."""
    now = local.seconds(k, choice[k])
    tried = sorted((local.seconds(k, a), n, a) for n, a in enumerate(moves(g, k, choice[k])))
    read = None
    for seconds, _, a in tried:
        if seconds >= now * (1 - 1e-9) or not g.expressible(k, a):
            break
        read = False
        if peak.fits(k, a, budget):
            peak.move(k, a)
            return True
    return read


class _Local:
    """`SearchGraph.local_seconds` of units' trial assignments under `choice` as its units move one
    at a time (`moved`): each kept until the unit or one at the other end of its edges moves, the
    only units it reads. A unit under an assignment that opens combined all-reduce sets (a lone
    latency, which reads every unit of its set through `joins`) is priced afresh each time. The
    trial moves of `fitted` and `polished` were most of a budgeted search's time (49 of 67 s planning
    the 128k-token Llama 3 8B on 256 devices), each move changing the price of a few units only."""

    def __init__(self, g: SearchGraph, choice: Sequence[Assignment], joins: Joins):
        self.g, self.choice, self.joins = g, choice, joins
        self.kept: dict[int, dict[tuple, float]] = collections.defaultdict(dict)

    @classmethod
    def of(cls, g: SearchGraph, choice: Sequence[Assignment], local: _Local | None) -> _Local:
        """`local` where it prices `choice`, else a `_Local` of it."""
        return local if local is not None and local.choice is choice else cls(g, choice, g.joins(choice))

    def seconds(self, k: int, a: Assignment) -> float:
        """`SearchGraph.local_seconds` of unit `k` under `a`, the others as in `choice`."""
        g = self.g
        if k in g.combinable and g.partial_sums(k, a):
            return g.local_seconds(k, a, self.choice, self.joins)
        mine, key = self.kept[k], tuple(sorted(a.items()))
        found = mine.get(key)
        if found is None:
            found = mine[key] = g.local_seconds(k, a, self.choice, self.joins)
        return found

    def moved(self, k: int) -> None:
        """Unit `k` moved (in `choice`): its prices and its neighbours' read again."""
        for m in self.neighbours(k):
            self.kept.pop(m, None)

    def neighbours(self, k: int) -> list[int]:
        """Unit `k` and the units at the other end of its edges: those whose prices a move of `k` changes."""
        g = self.g
        return [k, *(g.edges[n].dst[0] for n in g.out_edges.get(k, ())),
                *(g.edges[n].src[0] for n in g.in_edges.get(k, ()))]


class _Peak:
    """The estimated peak (`SearchGraph.peak`) of `choice` as its units move one at a time: the bytes
    live at each program point, kept, each move adding the change in the bytes of the values its
    unit lays out over their live ranges, and for those a loop's body makes, the change in that
    loop's body peak (`LiveRanges.transient`) at its point (`SearchGraph.peak` of every trial move was
    most of `polished`'s time, and of `fitted`'s). Within `_NEAR` of the budget, where the sums'
    rounding could tell, the peak is read again from the whole choice, so each answer is the one
    `SearchGraph.peak` gives; `peak` reads the kept bytes only where the sums are exact (`_exact`)."""

    def __init__(self, g: SearchGraph, choice: list[Assignment]):
        self.g, self.choice = g, choice
        self.exact = _exact(g)
        self.made: dict[int, list] = collections.defaultdict(list)  # unit -> (operand position, value) it lays out
        for v in g.memory_values:
            k, pos = g.makers[v]
            self.made[k].append((pos, v))
        self.loops = _loops(g.ranges)  # a loop body's value -> its loop's top-level point
        self.held = {v: self._bytes(k, pos, v, choice[k]) for k, made in self.made.items() for pos, v in made}
        self.live = g.live_bytes(self.held)
        self.transient = {t: g.ranges.transient(t, self.held) for t in g.ranges.bodies}  # each loop's body peak

    def _bytes(self, k: int, pos: int, v, a: Assignment) -> float:
        return _held(self.g, k, ((pos, v),), a)

    def _moved(self, k: int, a: Assignment) -> tuple[np.ndarray, dict, dict]:
        """The live bytes with unit `k` moved to `a`, the values whose bytes change -> their new bytes,
        and the loops whose body peak changes -> their new one."""
        live, changed, loops = self.live.copy(), {}, set()
        for pos, v in self.made.get(k, ()):
            now = self._bytes(k, pos, v, a)
            if now == self.held[v]:
                continue
            changed[v] = now
            if v in self.loops:
                loops.add(self.loops[v])
            else:
                live[self.g.first[v]:self.g.last[v] + 1] += now - self.held[v]
        transient = {}
        if loops:
            after = collections.ChainMap(changed, self.held)
            for t in loops:
                transient[t] = self.g.ranges.transient(t, after)
                live[t] += transient[t] - self.transient[t]
        return live, changed, transient

    def peak(self) -> tuple[float, int]:
        """`SearchGraph.peak` of the choice: the most bytes held at a program point, and that point
        (read from the kept bytes where they are exact, else from the whole choice)."""
        if not self.exact:
            return self.g.peak(self.choice)
        t = int(np.argmax(self.live))
        return float(self.live[t]), t

    def fits(self, k: int, a: Assignment, budget: float) -> bool:
        """Whether the estimated peak fits `budget` with unit `k` moved to `a`."""
        peak = float(self._moved(k, a)[0].max()) if k in self.made else float(self.live.max())
        if abs(peak - budget) > _NEAR * budget:
            return peak <= budget
        kept, self.choice[k] = self.choice[k], a
        try:
            return self.g.peak(self.choice)[0] <= budget
        finally:
            self.choice[k] = kept

    def move(self, k: int, a: Assignment) -> None:
        """Unit `k` moved to `a` (in the choice too)."""
        if k in self.made:
            self.live, changed, transient = self._moved(k, a)
            self.held.update(changed)
            self.transient.update(transient)
        self.choice[k] = a


def _exact(g: SearchGraph) -> bool:
    """Whether the live bytes `_Peak` keeps are those `SearchGraph.peak` sums, bit for bit, in any
    order: every mesh axis a power of two, so a value's bytes per device are a multiple of one over
    the device count, and every sum of them, up to all the values held whole, is a float with room
    to spare (below 2**53 such steps; a move's change, added and taken away, stays within four times
    that whole, so the margin is four)."""
    n, manual = math.prod(g.axis_size.values()), g.ranges.manual.values()
    whole = sum(value_bytes(v) for v in g.memory_values) + sum(manual)
    return (all(m & (m - 1) == 0 for m in g.axis_size.values()) and all(float(b).is_integer() for b in manual)
            and all(float(value_bytes(v)).is_integer() for v in g.memory_values) and 4 * whole * n < 2**53)


def _loops(ranges: LiveRanges) -> dict:
    """Each value a loop or branch body makes (nested ones' too) -> that loop's top-level point."""
    return {v: t for t, bodies in ranges.bodies.items() for body in bodies for v in body.values()}


def moves(g: SearchGraph, k: int, mine: Assignment) -> list[Assignment]:
    """Unit `k`'s assignments one mesh axis away from `mine`: the axis taken off its factor (if
    any) and given to another factor of the unit, or to none."""
    u = g.units[k]
    out = []
    for x, n in g.axis_size.items():
        if n <= 1:
            continue
        rest = {fac: tuple(a for a in axes if a != x) for fac, axes in mine.items()}
        rest = {fac: axes for fac, axes in rest.items() if axes}
        for target in (None,) + u.own:
            a = dict(rest)
            if target is not None:
                axes = a.get(target, ()) + (x,)
                if u.factors.sizes[target] % _cut(g, axes):
                    continue
                a[target] = axes
            if a != mine and a not in out:
                out.append(a)
    return out


def _held(g: SearchGraph, k: int, values: Sequence, a: Assignment) -> float:
    """Bytes per device of `values` (operand position, value) unit `k` lays out under `a`."""
    return sum(value_bytes(v) / _cut(g, [x for axes in g.spec(k, pos, a) for x in axes]) for pos, v in values)


def choice_of(g: SearchGraph, result: Result) -> list[Assignment]:
    """Each unit's assignment read from `result`'s layouts (an argument's value, an operator's
    operands); a unit whose layouts no assignment of its factors writes takes none (whole)."""
    choice: list[Assignment] = []
    for k, u in enumerate(g.units):
        if not u.free:
            choice.append({})
            continue
        if u.node < 0:
            specs = {0: result.values.get(u.var)}
        else:
            d = result.decisions.get(u.node)
            specs = {} if d is None else dict(enumerate(d.in_specs + d.out_specs))
        a = _read(g, k, specs)
        choice.append(a if a and _valid(g, k, a) else {})
    return choice


def _read(g: SearchGraph, k: int, specs: Mapping[int, Spec | None]) -> Assignment:
    """The axes each of unit `k`'s factors takes in `specs` (operand position -> layout): a dim of one
    factor gives it its axes; a dim of several gives each, major first, the axes that make up its
    size (the rest dropped, as `write_spec` drops a minor factor's axes)."""
    u = g.units[k]
    a: Assignment = {}
    for pos in u.operands:
        spec = specs.get(pos)
        dims = u.factors.operands[pos]
        if spec is None or len(spec) != len(dims):
            continue
        for factors, axes in zip(dims, spec):
            rest = list(axes)
            for fac in factors:
                taken: list[str] = []
                while rest and u.factors.sizes[fac] % (_cut(g, taken) * g.axis_size[rest[0]]) == 0:
                    taken.append(rest.pop(0))
                if taken and fac in u.own:
                    a.setdefault(fac, tuple(taken))
                if _cut(g, taken) != u.factors.sizes[fac]:
                    break
    return a


def _valid(g: SearchGraph, k: int, a: Assignment) -> bool:
    """Whether `a` gives no mesh axis twice, every cut divides its factor, and the unit's operands
    can be written with it."""
    axes = [x for fac in a.values() for x in fac]
    sizes = g.units[k].factors.sizes
    return (len(axes) == len(set(axes)) and all(sizes[fac] % _cut(g, t) == 0 for fac, t in a.items())
            and g.expressible(k, a))


def _cut(g: SearchGraph, axes: Sequence[str]) -> int:
    return math.prod(g.axis_size[x] for x in axes)
