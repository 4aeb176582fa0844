"""Global propagation: the anchors kept, the free arguments' layouts chosen for the whole program.

The engine (`Engine`) decides greedily: each operator takes the least-cost layout given its
neighbours' known ones, and a free argument (a parameter no `shard` call takes directly) is laid out
by its first user. That cannot see a choice whose price falls elsewhere: an embedding table looked
up whole at the start is summed whole in the backward pass, where the table cut by vocabulary, as
the output head could take it, sums a quarter; a batch cut eight ways by the default dataset policy
drags every activation into that cut, where one redistribution of the small token array at the
start would put it in the layout the `shard` calls want.

`propagate_globally` weighs those choices over the whole program's predicted cost: its collectives'
bytes at each axis' bandwidth and its compute per device. The per-collective latency the engine's
local choices count does not separate whole plans: XLA's combiner merges independent collectives of
one kind over one group (the backward pass's gradient all-reduces), so an alternative that sums in
more, smaller collectives is not slower by their count (the expert Megatron plan of a GPT compiles
to 13 all-reduces where its operators' sums number over 40).

First the batch arguments laid out by the default dataset policy, or given a lone strategy tuple, are
weighed left where they arrive against moved there once at the start into the layouts the anchors
propagate to them: all of them, and each alone (a ResNet's images best left where they arrive, its
labels moved to the layout the classifier's loss takes them in); and all of them cut over the mesh
axes no anchor uses, the data axes the parameters' layouts leave free (`_data_cut`: Megatron layouts
over `mp` leave the batch `dp`, where the default cuts it over every device and the anchors alone
propagate nothing to it). A batch cut the anchors collide with keeps its count there, on the axes
they leave (`_refilled`: rows given `(2, 1)` and kernels `(1, 4)`, each tuple its own device matrix,
cut the major mesh axis both; the rows are moved once onto the minor one, where every matrix
product would otherwise redistribute a kernel or an activation each step).
Then each free argument that a contraction or lookup takes (directly or through a transpose,
reshape or cast) while that operator, holding at least 1% of the program's work, repeats over some
of the anchors' mesh-axis groups, is weighed cut over each such group on each dim; arguments one after another,
the biggest first, each keeping the layout of least cost, an alternative taken only where the
operators it lays out otherwise cost at least 2% less under it (`_Runs.cheaper`: 2% of what changes,
not of the whole program, whose gradient all-reduce both alternatives pay would hide a cheaper
loss). Each alternative is one propagation from the anchors sharing the `OpTable` and
the engine's choices of operators met in the same layouts; a program with nothing to weigh costs
one propagation. The alternatives weighed, with their predicted seconds, are `Result.weighed`
(`OpRecord.weighed` in the `Plan`, shown by `Plan.explain`).

Last, memory is weighed with time (`_weigh_peak`): a value held at the predicted peak per device
(the memory model, `cost.live_ranges`) that is made coarser than a user takes it is tried made in
that finer layout, and kept where the peak drops for at most `_PEAK_TIME` of the program's seconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping, Sequence

from jshard.cost import CostModel, array_of, live_ranges, local_bytes, value_bytes
from jshard.graph import CONSTRAINT, Node
from jshard.layouts import Spec, constraint_spec
from jshard.propagate._charges import share_moves
from jshard.propagate._engine import Engine
from jshard.propagate._priced import devices_over
from jshard.propagate._result import Result, WeighedLayout
from jshard.rules import FUSION, OpTable, shape_of

_BETTER = 0.98
"""An alternative is taken where the operators it lays out otherwise cost, under it, below this share
of what they cost under the best so far: a gain within the cost model's error is not worth moving
off the layout propagation gives."""


class _Runs:
    """Propagations of one program from varying anchors, sharing its `OpTable` and the engine's
    choices of operators met in the same layouts."""

    def __init__(self, nodes: Sequence[Node], axis_size: Mapping[str, int], cost: CostModel, outputs: Collection,
                 table: OpTable | None = None):
        self.nodes, self.axis_size, self.cost, self.outputs = nodes, axis_size, cost, outputs
        self.table = table or OpTable(nodes)
        self.moved = self.table.traffic(outputs) if cost.memory_bandwidth else {}
        self.streamed = dataclasses.replace(cost, latency=0.0, axes={a: (bw, 0.0) for a, (bw, _) in cost.axes.items()})
        self.memo: dict = {}
        self._parts: dict = {}
        self._flops: float | None = None

    @property
    def flops(self) -> float:
        """The program's floating-point work on one device holding everything."""
        if self._flops is None:
            t = self.table
            self._flops = sum(n.weight * t.factors[i].flops for i, n in enumerate(self.nodes) if i in t.factors)
        return self._flops

    def run(self, anchors: Mapping, moved: Mapping = ()) -> Result:
        """The result from `anchors`, with each of `moved` (argument -> the layout it arrives in)
        laid out where it arrives and moved once at the start into the layout `anchors` give it."""
        engine = Engine(self.nodes, self.axis_size, self.cost, self.table, memo=self.memo)
        result = engine.run(anchors, self.outputs)
        if moved:
            for v, spec in dict(moved).items():
                if v in result.values and result.values[v] != spec:
                    engine.move_at_start(v, spec)
                else:
                    result.values[v] = spec
            share_moves(self.nodes, result, self.axis_size, self.cost)
        return result

    def parts(self, result: Result) -> dict[int, float]:
        """`result`'s predicted seconds per call, per operator that costs any: its collectives' bytes
        at each axis' bandwidth (no latency per collective) and its compute per device (computed
        once per result)."""
        if id(result) not in self._parts:
            parts = {}
            for i, node in enumerate(self.nodes):
                d, f = result.decisions.get(i), self.table.factors.get(i)
                seconds = node.weight * sum(self.streamed.time(c, self.axis_size) for c in d.comms) if d else 0.0
                if f is not None and (f.flops or i in self.moved) and i not in result.unruled:
                    n = devices_over(d, self.axis_size)
                    seconds += node.weight * self.cost.compute_seconds(f.flops / n, self.moved.get(i, 0.0) / n,
                                                                       i in self.table.matmul)
                if seconds:
                    parts[i] = seconds
            self._parts[id(result)] = (result, parts)  # the result kept: its id stays its own
        return self._parts[id(result)][1]

    def seconds(self, result: Result) -> float:
        """`result`'s predicted seconds per call (`parts`, summed)."""
        return sum(self.parts(result).values())

    def cheaper(self, trial: Result, best: Result) -> bool:
        """Whether `trial` is cheaper than `best` by more than the cost model's error: the operators
        the two price otherwise cost, under `trial`, less than `_BETTER` of what they cost under
        `best`. The share is of what changes, not of the whole program: a gradient all-reduce both
        pay alike does not hide a cheaper loss."""
        a, b = self.parts(trial), self.parts(best)
        changed = [i for i in a.keys() | b.keys() if a.get(i, 0.0) != b.get(i, 0.0)]
        return sum(a.get(i, 0.0) for i in changed) < _BETTER * sum(b.get(i, 0.0) for i in changed)


def propagate_globally(nodes: Sequence[Node], anchors: Mapping, free: Sequence, axis_size: Mapping[str, int],
                       cost: CostModel | None = None, outputs: Collection = (), movable: Collection = (),
                       lean: bool = False, table: OpTable | None = None) -> Result:
    """Propagation from `anchors` (var -> `Spec`), with the layouts of the `free` arguments (vars no
    anchor fixes) and of the `movable` ones (anchored vars a program may move once at the start:
    the batch on the default dataset cut, or given a lone strategy tuple) chosen for the least
    predicted cost of the whole program; see the module docstring. `outputs`: the program's results. With `lean` (a search under a memory
    budget), a free argument's layout that costs within the cost model's error of the best (neither
    `_Runs.cheaper` than the other) and holds the argument in fewer bytes per device is taken too:
    the tied embedding cut by vocabulary, as the head takes it, rather than whole on every device.
    `table`: the nodes' `OpTable` where one is at hand (the traced program's, which the search graph
    reads too: its factors and memory traffic are then read once per program, not once per call)."""
    runs = _Runs(nodes, axis_size, cost or CostModel(), outputs, table)
    fixed = dict(anchors)
    best = runs.run(fixed)
    weighed: dict = {}
    moved: dict = {}
    arrive = {v: fixed[v] for v in movable if v in fixed}
    if arrive:
        best, fixed, moved, weighed = _weigh_moves(runs, best, fixed, arrive)
    groups = _groups(nodes, fixed.values())
    for v in sorted((v for v in free if shape_of(v)), key=value_bytes, reverse=True):
        have = best.values.get(v)
        layouts = [spec for spec in _layouts(v, runs, best, groups) if spec != have]
        if not layouts:
            continue
        tried = [WeighedLayout(have, runs.seconds(best), "propagated", True)] if have is not None else []
        for spec in layouts:
            result = runs.run({**fixed, v: spec}, moved)
            tried.append(WeighedLayout(spec, runs.seconds(result), "weighed", False))
            if runs.cheaper(result, best) or (lean and _fewer_bytes(v, spec, have, axis_size)
                                              and not runs.cheaper(best, result)):
                best, have, fixed = result, spec, {**fixed, v: spec}
        weighed[v] = tuple(w._replace(chosen=w.spec == have) for w in tried)
    best = _weigh_peak(runs, best, fixed, moved, [*anchors, *free], weighed)
    best.weighed = weighed
    return best


_PEAK_TRIALS = 4
"""The most values `_weigh_peak` weighs made finer: each is one more propagation."""
_PEAK_SHARE = 0.01
"""The least share of the predicted peak a value made finer must save to be weighed."""
_PEAK_TIME = 0.01
"""The most share of the whole program's predicted seconds a lower peak may cost, all trials together."""


def _weigh_peak(runs: _Runs, best: Result, fixed: dict, moved: dict, args: Sequence, weighed: dict) -> Result:
    """Memory weighed with time: the values held at the plan's predicted peak (the memory model's
    live bytes per device, `cost.live_ranges`) that are made coarser than a user of theirs takes them
    (a loss's gradient scattered into the whole vocabulary, then sliced by the output head's
    backward pass) weighed made in that user's finer layout, the most bytes saved first, each one
    propagation with the value fixed so; an alternative is taken where its peak is lower and the
    whole program's predicted seconds, all such alternatives together, grow by at most `_PEAK_TIME`:
    the neighbours it moves reduce a slice rather than the whole (a few bytes of all-reduce) while
    every device stops holding and computing all of it."""
    ranges = live_ranges(runs.nodes, args, list(runs.outputs), fusion=FUSION)
    peak, allowed = _peak(runs, best, ranges), (1 + _PEAK_TIME) * runs.seconds(best)
    tried = 0
    for v, finer, saved in _coarser_at_peak(runs, best, ranges):
        if tried == _PEAK_TRIALS or saved < _PEAK_SHARE * peak:
            break
        tried += 1
        trial = runs.run({**fixed, v: finer}, moved)
        if runs.seconds(trial) <= allowed and (trial_peak := _peak(runs, trial, ranges)) < peak:
            weighed[v] = (WeighedLayout(best.values[v], runs.seconds(best), "propagated", False),
                          WeighedLayout(finer, runs.seconds(trial), "made as its user takes it, at the peak", True))
            best, peak, fixed = trial, trial_peak, {**fixed, v: finer}
    return best


def _held(runs: _Runs, result: Result, ranges) -> dict:
    return {v: local_bytes(*array_of(v), result.values[v], runs.axis_size) for v in ranges.values() if v in result.values}


def _peak(runs: _Runs, result: Result, ranges) -> float:
    live = ranges.live_bytes(_held(runs, result, ranges))
    return float(live.max()) if len(live) else 0.0


def _coarser_at_peak(runs: _Runs, result: Result, ranges) -> list[tuple]:
    """`(value, finer layout, bytes saved)` for each value made by an operator, held at the predicted
    peak and taken by a user in a layout that refines the one it is made in (each dim's axes kept,
    major first, more added), the most saved first; none that a loop, branch or remat region makes
    or takes."""
    live = ranges.live_bytes(_held(runs, result, ranges))
    if not len(live):
        return []
    t = int(live.argmax())
    found = []
    for v in ranges.live_at(t, [v for v in ranges.first if v in runs.table.producer and v not in runs.outputs]):
        have, users = result.values.get(v), runs.table.consumers.get(v, ())
        if have is None or any(runs.nodes[j].bodies for j in (runs.table.producer[v], *(j for j, _ in users))):
            continue  # a loop's, branch's or remat region's value: its body's layouts follow it
        for j, pos in users:
            d = result.decisions.get(j)
            want = None if d is None else d.in_specs[pos]
            if want is not None and want != have and all(w[: len(h)] == h for h, w in zip(have, want)):
                saved = local_bytes(*array_of(v), have, runs.axis_size) - local_bytes(*array_of(v), want, runs.axis_size)
                found.append((v, want, saved))
                break
    return sorted(found, key=lambda f: -f[2])


def _fewer_bytes(v, spec: Spec, have: Spec | None, axis_size: Mapping[str, int]) -> bool:
    """Whether `v` laid out as `spec` holds fewer bytes per device than as `have` (None: whole)."""
    ways = lambda s: math.prod(axis_size[a] for axes in (s or ()) for a in axes)  # noqa: E731
    return ways(spec) > ways(have)


def _weigh_moves(runs: _Runs, best: Result, fixed: dict, arrive: dict) -> tuple[Result, dict, dict, dict]:
    """The movable batch arrays (`arrive`: argument -> the layout it arrives in) weighed left
    where they arrive against moved once at the start into the layouts the other anchors propagate
    to them: all of them moved, and each alone (an image batch best left where it arrives while its
    labels move to the layout the loss takes them in); of those `_Runs.cheaper` than leaving them,
    the least predicted seconds. Returns the best result, its anchors, the arguments it moves (->
    where they arrive) and the `WeighedLayout`s per argument."""
    loose = {v: s for v, s in fixed.items() if v not in arrive}
    left = runs.run(loose).values
    wanted = {v: left[v] for v, spec in arrive.items() if left.get(v, spec) != spec}
    subsets = [wanted, *([{v: s} for v, s in wanted.items()] if len(wanted) > 1 else [])] if wanted else []
    data = _data_cut(runs.nodes, loose.values(), arrive, runs.axis_size)
    if data and data not in subsets:
        subsets.append(data)
    if not subsets:
        return best, fixed, {}, {}
    trials = [(sub, runs.run({**fixed, **sub}, {v: arrive[v] for v in sub})) for sub in subsets]
    gains = [(sub, trial) for sub, trial in trials if runs.cheaper(trial, best)]
    sub, trial = min(gains or trials, key=lambda t: runs.seconds(t[1]))
    take = bool(gains)
    weighed = {}
    for v in dict.fromkeys(v for s in subsets for v in s):
        tried = [WeighedLayout(arrive[v], runs.seconds(best), "as it arrives", not (take and v in sub))]
        for spec, how in ((wanted.get(v), "moved once at the start"), (data.get(v), _DATA_CUT)):
            seconds = [runs.seconds(t) for s, t in trials if s.get(v) == spec]
            if spec is not None and seconds:
                tried.append(WeighedLayout(spec, min(seconds), how, take and sub.get(v) == spec))
        weighed[v] = tuple(tried)
    if not take:
        return best, fixed, {}, weighed
    return trial, {**fixed, **sub}, {v: arrive[v] for v in sub}, weighed


_DATA_CUT = "moved once at the start, cut over the axes the anchors leave free"


def _data_cut(nodes: Sequence[Node], specs: Collection[Spec], arrive: dict, axis_size: Mapping[str, int]) -> dict:
    """The movable batch arrays (`arrive`) each cut over the mesh axes no anchor (`specs`, and the
    program's constraints) uses, where that differs from how it arrives: the data axes the
    parameters' layouts leave (a Megatron layout over `mp`: the batch over `dp` alone, as the expert
    lays it, where the default cuts it over every device and the model-parallel operators then
    re-lay each activation; a batch given on an axis the parameters' tuples cut: the same count on
    the axes they leave, `_refilled`). Empty where no anchor cuts anything or every axis is used."""
    used = {a for axes in _groups(nodes, specs) for a in axes}
    if not used:
        return {}
    cut = {v: _refilled(spec, used, axis_size) for v, spec in arrive.items()}
    return {v: spec for v, spec in cut.items() if spec != arrive[v] and any(spec)}


def _refilled(spec: Spec, used: set, axis_size: Mapping[str, int]) -> Spec:
    """`spec` without the axes in `used`, each dim cut again to its count over axes neither `used`
    nor `spec` holds, where they make it up (a batch given `(2, 1)` on the major axis, the
    parameters' tuples on the two major ones: the rows moved onto the minor axis); without them
    where they do not."""
    free = [a for a in axis_size if a not in used and all(a not in axes for axes in spec)]
    out = []
    for axes in spec:
        kept = tuple(a for a in axes if a not in used)
        need = math.prod(axis_size[a] for a in axes) // math.prod(axis_size[a] for a in kept)
        added = []
        for a in free:
            if 1 < need and need % axis_size[a] == 0:
                added.append(a)
                need //= axis_size[a]
        if need == 1 and added:
            free = [a for a in free if a not in added]
            kept = (*kept, *added)
        out.append(kept)
    return tuple(out)


def _groups(nodes: Sequence[Node], specs: Collection[Spec]) -> list[tuple[str, ...]]:
    """The mesh-axis groups the anchors cut one dim over (`("d1", "d2")` for a tuple's 4 on a mesh
    of three axes of 2), each once, in the order met."""
    found: dict = {}
    constrained = [constraint_spec(n.eqn.params["sharding"], len(shape_of(n.outputs[0])))
                   for n in nodes if n.primitive == CONSTRAINT]
    for spec in [*specs, *constrained]:
        for axes in spec:
            if axes:
                found.setdefault(tuple(axes), None)
    return list(found)


def _layouts(v, runs: _Runs, result: Result, groups: Sequence[tuple[str, ...]]) -> list[Spec]:
    """The layouts weighed for free argument `v`: where an operator that contracts or looks up
    over it (a matrix product, a convolution, a gather: reached directly, or through a transpose,
    reshape or cast), holding at least `_WORK` of the program's work, runs whole over some of the
    anchors' axis groups (`result` left those devices repeating it), each dim of `v` cut over each
    such group that divides it. None elsewhere: an argument only elementwise operators take
    (optimizer state) follows its neighbours, and so does one whose operators' work is negligible
    (one propagation per alternative is not worth it)."""
    shape, found = shape_of(v), {}
    for j in _contracting_users(v, runs):
        d = result.decisions.get(j)
        if d is None or runs.nodes[j].weight * runs.table.factors[j].flops < _WORK * runs.flops:
            continue
        used = {a for spec in (*d.in_specs, *d.out_specs) for axes in spec for a in axes}
        for axes in groups:
            ways = math.prod(runs.axis_size[a] for a in axes)
            if set(axes) & used:
                continue
            for k, n in enumerate(shape):
                if n > 1 and n % ways == 0:
                    found.setdefault(tuple(tuple(axes) if i == k else () for i in range(len(shape))), None)
    return list(found)


def _contracting_users(v, runs: _Runs) -> list[int]:
    """The operators with partial sums to make (contractions, lookups) that take `v`, directly or
    through operators that only move or cast it."""
    out, todo, seen = [], [v], set()
    while todo:
        for j, _ in runs.table.consumers.get(todo.pop(), ()):
            if j in seen:
                continue
            seen.add(j)
            node, f = runs.nodes[j], runs.table.factors.get(j)
            if node.primitive in _MOVES and len(node.outputs) == 1:
                todo.append(node.outputs[0])
            elif f is not None and f.reduced:
                out.append(j)
    return out


_WORK = 0.01
"""The share of the program's floating-point work an operator repeating over idle devices must hold
for its free arguments to be weighed in other layouts."""

_MOVES = ("transpose", "reshape", "convert_element_type", "copy")
