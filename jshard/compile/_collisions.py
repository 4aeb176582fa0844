"""The collision check: `in_strategy` tuples given apart whose cuts land on one mesh axis where an
operator takes them together, directly or through operators that carry one argument's cuts to
their result (elementwise ones, casts, reshapes: `tanh((2.0 * x) @ w)` as `tanh(x @ w)`).

Each argument is also followed through any other operator whose results the plan keeps cut over
its mesh axes (`_followed`), so the tokens meet every layer's kernels through the embedding lookup,
the norms and the residual sums a transformer puts between them. Every pair of leaves given the same
two tuples is one warning.

A lone strategy tuple is its own device matrix (repeated calculation appended as its last axis),
so its cuts take the mesh's major axes: `(2, 1)` for an input and `(1, 4)` for a kernel put the
input's rows and the kernel's columns both on the major axis of 2 devices. The operator that takes
both (the matmul) cannot keep both layouts, and XLA redistributes one of them before it, every
call. One `Layout` holding both cuts (device matrix `[2, 4]`, as MindSpore's matmul strategy
`((2, 1), (1, 4))` in one `shard` call makes) keeps them on different axes. Tuples given together
in one `shard` call share one device matrix, and a `Layout`'s axes are the user's choice: neither is
checked. Only collisions a shared `Layout` can resolve are reported (the cut dims' counts multiply
to a divisor of the device count), as a `LayoutCollisionWarning` naming the predicted cost.

A parameter a `shard` call's `parameter_plan` cuts that the plan then all-gathers where it is used
(`gathered`: a Linen `apply` whose input is cut by rows and kernel by columns, each a lone tuple)
warns the same way, naming the cut, its first use and the bytes moved per call.
"""

from __future__ import annotations

import math
import re
import warnings
from typing import NamedTuple

from jax.extend import core as jcore

from jshard._errors import LayoutCollisionWarning
from jshard._format import human_bytes, var_str
from jshard.compile._options import Options
from jshard.compile._program import Program
from jshard.cost import array_of, redistribution
from jshard.graph import PARAMETER_SCOPE, operand_vars
from jshard.plan import source_str


class Collision(NamedTuple):
    """Two argument leaves (`first`, `second`, leaf indices) given tuples whose cuts share the mesh
    `axes`, the first operator that takes both (its primitive and source), and what redistributing
    them costs per call over all such operators (`bytes` per device, `seconds`)."""

    first: int
    second: int
    axes: tuple[str, ...]
    primitive: str
    source: str
    bytes: float
    seconds: float
    moved: int | None = None


def collisions(program: Program, slots, c: Options) -> list[Collision]:
    """The collisions of `program`'s tuple-given arguments (`slots`: the `in_strategy` slots),
    wherever values that stand for them (`_followed`) meet."""
    traced, result = program.traced, program.result
    given = {} if traced is None or result is None else {
        v: i for i, (v, slot) in enumerate(zip(traced.invars, slots)) if _is_tuple(slot) and v in result.values}
    if len(given) < 2:
        return []
    assert traced is not None and result is not None  # else nothing is given
    moved = _moved(result, given)
    values = {**result.values, **moved}  # a batch moved once at the start, followed as its users take it
    reach = _followed(traced.nodes, given, values)
    cut = {i: _axes(result.values[v]) for v, i in given.items()}  # as given: a moved batch as it arrives
    arrived = {given[v] for v in moved}
    found: dict[tuple[int, int], Collision] = {}
    for k, node in enumerate(traced.nodes):
        decision = result.decisions.get(k)
        ins = [] if decision is None else [(j, v) for j, v in enumerate(operand_vars(node)[0])
                                           if isinstance(v, jcore.Var) and v in reach]
        for a, (ja, va) in enumerate(ins):
            assert decision is not None  # else no inputs
            for jb, vb in ins[a + 1:]:
                specs = (values[va], values[vb])
                shared = _axes(specs[0]) & _axes(specs[1])
                pairs = [(x, y) for x in reach[va] for y in reach[vb] if x != y and x not in reach[vb]
                         and y not in reach[va] and (shared if arrived.isdisjoint((x, y)) else cut[x]) & cut[x] & cut[y]
                         and _shareable(slots[x], slots[y], traced.fine.device_count)]
                if va is vb or not pairs:
                    continue
                moved_here = [m for j, v, spec in ((ja, va, specs[0]), (jb, vb, specs[1]))
                              if decision.in_specs[j] != spec
                              for m in redistribution(*array_of(v), spec, decision.in_specs[j], traced.axis_size,
                                                      c.costs.alltoall)]
                for met in pairs:
                    pair = met if met[::-1] not in found else met[::-1]  # one entry per pair, in the order first met
                    old = found.get(pair)
                    batch = next((v for v, i in given.items() if v in moved and i in pair), None)
                    start = [] if batch is None else redistribution(*array_of(batch), result.values[batch],
                                                                    moved[batch], traced.axis_size, c.costs.alltoall)
                    if start and old is None:  # the collision is the batch's move, once per call
                        found[pair] = Collision(*pair, tuple(sorted(cut[pair[0]] & cut[pair[1]])),
                                                node.primitive, node.source, sum(m.bytes for m in start),
                                                sum(c.costs.time(m, traced.axis_size) for m in start), given[batch])
                    elif not start and moved_here:
                        nbytes = node.weight * sum(m.bytes for m in moved_here)
                        seconds = node.weight * sum(c.costs.time(m, traced.axis_size) for m in moved_here)
                        axes = tuple(sorted(shared & cut[pair[0]] & cut[pair[1]]))
                        found[pair] = (Collision(*pair, axes, node.primitive, node.source, nbytes, seconds)
                                       if old is None else old._replace(bytes=old.bytes + nbytes,
                                                                        seconds=old.seconds + seconds))
    return list(found.values())


def _moved(result, given: dict) -> dict:
    """Given argument -> the layout the plan moves it into once at the start (global propagation's
    weighed layout chosen for it, where that is not as it arrives)."""
    out = {}
    for v in given:
        chosen = [w for w in result.weighed.get(v, ()) if getattr(w, "chosen", False)]
        if chosen and chosen[0].how != "as it arrives" and chosen[0].spec != result.values[v]:
            out[v] = chosen[0].spec
    return out



CARRIED = frozenset({
    "abs", "add", "convert_element_type", "copy", "copy_p", "cos", "div", "erf", "exp", "integer_pow", "log",
    "logistic", "max", "min", "mul", "neg", "pow", "reduce_precision", "reshape", "rsqrt", "sign", "sin", "sqrt",
    "square", "squeeze", "expand_dims", "sub", "tanh", "transpose",
})
"""Operators that carry one argument's cuts to their result: elementwise ones (the other operand a
scalar or a constant), casts, reshapes and transposes."""


def _followed(nodes, given: dict, values, cutting: bool = True) -> dict:
    """Value -> the argument leaves it stands for: `given` (value -> argument leaf) each its own,
    and the values the arguments reach, laid out as they are: through a `CARRIED` operator of one
    of them alone (`(2.0 * x) @ w`: the product stands for `x`), and through any other operator for
    each argument whose mesh axes the plan keeps cutting its results (an embedding lookup of
    tokens cut by rows, a norm, a residual sum: the activations every layer's matmuls take stand
    for the tokens); without `cutting`, through `CARRIED` operators only."""
    out = {v: frozenset({i}) for v, i in given.items()}
    cut = {i: _axes(values[v]) for v, i in given.items() if v in values}
    for node in nodes:
        if node.bodies or not all(v in values for v in node.outputs):
            continue
        sources = frozenset().union(*(out[v] for v in node.inputs if isinstance(v, jcore.Var) and v in out))
        if not sources:
            continue
        if node.primitive in CARRIED and len(sources) == 1:
            kept = sources
        elif not cutting:
            continue
        else:
            made = set().union(*(_axes(values[v]) for v in node.outputs))
            kept = frozenset(i for i in sources if made & cut.get(i, set()))
        if kept:
            out.update(dict.fromkeys(node.outputs, kept))
    return out


class Gathered(NamedTuple):
    """A value the user cut (`what`: an `in_strategy` entry or a `parameter_plan` entry, `given`:
    its strategy) that its first use (`primitive` at `source`) takes gathered over `axes`, and what
    that costs per call over all its uses (`bytes` per device, `seconds`)."""

    what: str
    given: tuple
    shape: str
    axes: tuple[str, ...]
    primitive: str
    source: str
    taken: tuple[int, ...]
    bytes: float
    seconds: float


_GIVEN = re.compile(rf"(jshard_shard\d+)/{PARAMETER_SCOPE}(\d+)")


def _cut_sources(program: Program) -> dict:
    """Value -> `(what, strategy)` for every parameter a `shard` call's `parameter_plan` cuts (the
    value as constrained). Strategy tuples are the collision check's (`collisions`), which reports
    only what a shared `Layout` resolves."""
    traced, result = program.traced, program.result
    assert traced is not None and result is not None  # gathered, the one caller, returned first where either is None
    found = {}
    by_scope = {a.scope: a for a in traced.ctx.annotations if a.params}
    if not by_scope:  # no `shard` call cuts a parameter
        return found
    last: dict = {}
    for node in traced.nodes:
        hit = _GIVEN.search(node.scope)
        if hit is not None and node.outputs and not node.backward:
            last[hit.groups()] = node.outputs[0]
    for (scope, k), v in last.items():
        a, k = by_scope.get(scope), int(k)
        if a is not None and k < len(a.params):
            name, layout = a.params[k]
            found[v] = (f"parameter_plan entry for {name} of jshard.shard({a.name}) at {a.source}", layout.strategy)
    return {v: w for v, w in found.items() if v in result.values}


def gathered(program: Program, c: Options) -> list[Gathered]:
    """The `parameter_plan` cuts (`_cut_sources`) that the plan all-gathers where they are used
    (followed through `CARRIED` operators), with the first such use."""
    traced, result = program.traced, program.result
    if traced is None or result is None:
        return []
    sources = _cut_sources(program)
    if not sources:  # no `parameter_plan` cut: nothing to follow (an unrolled GPT's half a million operators)
        return []
    reach = {v: min(origins, key=list(sources).index) for v, origins in
             _followed(traced.nodes, {v: v for v in sources}, result.values, cutting=False).items()}
    found: dict = {}
    for k, node in enumerate(traced.nodes):
        decision = result.decisions.get(k)
        if (decision is None or (node.primitive in CARRIED and not node.bodies)
                or not any(m.kind == "all-gather" for m in decision.comms)):  # the operator's own rule moves nothing so
            continue
        for j, v in enumerate(operand_vars(node)[0]):
            if not isinstance(v, jcore.Var) or v not in reach or j >= len(decision.in_specs):
                continue
            have, want = result.values[v], decision.in_specs[j]
            moved = [m for m in redistribution(*array_of(v), have, want, traced.axis_size, c.costs.alltoall)
                     if m.kind == "all-gather"] if have != want else []
            if not moved:
                continue
            nbytes = node.weight * sum(m.bytes for m in moved)
            seconds = node.weight * sum(c.costs.time(m, traced.axis_size) for m in moved)
            origin = reach[v]
            old = found.get(origin)
            if old is None:
                what, given = sources[origin]
                axes = tuple(sorted(_axes(have) - _axes(want)))
                taken = tuple(math.prod(traced.axis_size[a] for a in dim) for dim in want)
                found[origin] = Gathered(what, given, var_str(origin), axes, node.primitive, node.source, taken,
                                         nbytes, seconds)
            else:
                found[origin] = old._replace(bytes=old.bytes + nbytes, seconds=old.seconds + seconds)
    return list(found.values())


def warn_collisions(program: Program, slots, c: Options, call: str) -> None:
    """Warns (`LayoutCollisionWarning`) once per pair of colliding tuples (every pair of argument
    leaves given those two tuples named in one warning), and once per `parameter_plan` cut that the
    plan all-gathers where it is used."""
    if program.traced is None:
        return
    paths, n = program.traced.paths, program.traced.fine.device_count
    alike: dict[tuple, list[Collision]] = {}
    for hit in collisions(program, slots, c):
        alike.setdefault((slots[hit.first], slots[hit.second]), []).append(hit)
    for hits in alike.values():
        warnings.warn(_collision_message(hits, slots, paths, n, call), LayoutCollisionWarning, stacklevel=2)
    for cut in gathered(program, c):
        warnings.warn(_gathered_message(cut, call), LayoutCollisionWarning, stacklevel=2)


def _gathered_message(cut: Gathered, call: str) -> str:
    return (f"{call}: the {cut.what} cuts {cut.shape} as {cut.given}, but {cut.primitive} at "
            f"{source_str(cut.source)}, its first use, takes it as {cut.taken}: XLA all-gathers it over mesh axis "
            f"{', '.join(cut.axes)} there on every call, predicted {human_bytes(cut.bytes)} per device per call "
            f"({cut.seconds * 1e6:.3g} us). Cut it as that operator takes it, or give it and the operand it meets "
            f"one Layout (tuples given apart are each their own device matrix and take the mesh's major axes; "
            f"one shard call's strategy for both shares one): plan.explain(op) says what the operator weighed.")


def _is_tuple(slot) -> bool:
    """Whether a slot is a strategy tuple (not a `Layout` call's, nor a `PartitionSpec`, a tuple too)."""
    return isinstance(slot, tuple) and all(isinstance(s, int) for s in slot)


def _axes(spec) -> set[str]:
    return {a for dim in spec for a in dim}


def _shareable(first: tuple[int, ...], second: tuple[int, ...], n: int) -> bool:
    """Whether one device matrix holds both tuples' cuts apart."""
    product = math.prod(s for s in (*first, *second) if s > 1)
    return n % product == 0


def _collision_message(hits: list[Collision], slots, paths, n: int, call: str) -> str:
    """One warning for `hits`, pairs of leaves given the same two tuples: the first pair named, the
    others counted (their leaves given the same `Layout` call), the cost summed over all."""
    hit = hits[0]
    a, b = slots[hit.first], slots[hit.second]
    name_a, name_b = f"in_strategy{paths[hit.first]}", f"in_strategy{paths[hit.second]}"
    # a batch moved once at the start is one move, whichever pairs it resolves
    nbytes, seconds = ((hit.bytes, hit.seconds) if hit.moved is not None else
                       (sum(h.bytes for h in hits), sum(h.seconds for h in hits)))
    more = ""
    if len(hits) > 1:
        leaves = sorted({f"in_strategy{paths[i]}" for h in hits for i in (h.first, h.second)} - {name_a, name_b})
        more = (f" {len(hits) - 1} more {'pair' if len(hits) == 2 else 'pairs'} of leaves given these two tuples collide so ({', '.join(leaves[:3])}"
                f"{', ...' if len(leaves) > 3 else ''}): the cost is {'one move for' if hit.moved is not None else 'over'} all {len(hits)} pairs, and each leaf takes "
                f"the Layout call of the tuple it was given.")
    return (f"{call}: {name_a}={a} and {name_b}={b} are lone tuples, each its own device matrix, so both "
            f"cut onto mesh axis {', '.join(hit.axes)}; {hit.primitive} at {source_str(hit.source)} takes them "
            f"together and {_resolved(hit, slots, paths)}: predicted {human_bytes(nbytes)} per device per call "
            f"({seconds * 1e6:.3g} us). Give both one Layout, as one shard call's strategy {(a, b)} would: "
            f"{_suggestion(a, b, n, name_a, name_b)}.{more}")


def _resolved(hit: Collision, slots, paths) -> str:
    """What the plan does about collision `hit`: XLA redistributes one of the two where they meet,
    or (`hit.moved`, the batch leaf) jshard moves the batch once at the start onto mesh axes the
    other leaves free."""
    if hit.moved is None:
        return "XLA redistributes one first"
    other = hit.second if hit.moved == hit.first else hit.first
    return (f"jshard moves in_strategy{paths[hit.moved]} once at the start, as it arrives cut "
            f"{slots[hit.moved]}, onto mesh axes in_strategy{paths[other]} leaves free")


def _suggestion(a: tuple[int, ...], b: tuple[int, ...], n: int, name_a: str, name_b: str) -> str:
    """`lay = jshard.Layout(...)` with one axis per cut dim of `a`, then of `b` (and one for the
    devices that repeat the computation), and each argument's call of it."""
    matrix, names, calls = [], [], []
    for strategy in (a, b):
        dims = []
        for cut in strategy:
            if cut > 1:
                names.append(f"m{len(matrix)}")
                matrix.append(cut)
            dims.append(repr(names[-1] if cut > 1 else "None"))
        calls.append(f"lay({', '.join(dims)})")
    if math.prod(matrix) < n:
        matrix.append(n // math.prod(matrix))
        names.append("rest")
    return f"lay = jshard.Layout({tuple(matrix)}, {tuple(names)}); {name_a}={calls[0]}, {name_b}={calls[1]}"
