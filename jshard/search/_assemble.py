"""A search's choice as the engine's `Result` (`assemble`): every value's layout where it is made,
and per operator its layouts, the collectives it pays and, for key operators, the best candidate it
did not take, so a searched plan is emitted, explained, audited and saved like a propagated one.
Operators alike (the same operator of identical layers) are priced once (`_Priced`) and share one
`Decision`; a key operator's best rejected move is found once per unit structure (`_rejected`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from jax.extend import core as jcore

from jshard.cost import array_of
from jshard.graph import CONSTRAINT
from jshard.propagate import MANUAL, Decision, Engine, Rejected, Result, charge_constraints, unpriced_dead
from jshard.rules import write_spec
from jshard.search import _seeded
from jshard.search._graph import SearchGraph
from jshard.search._joins import Joins
from jshard.search._units import Assignment

_KEY_SHARE = 0.01  # key operators, whose best rejected alternative a plan records: this share of the heaviest's work


def assemble(g: SearchGraph, choice: Sequence[Assignment]) -> Result:
    """The engine's `Result` for a search's choice: every value's layout where it is made, and per
    operator its layouts, the collectives it pays, and, for key operators (at least 1% of the
    heaviest one's work: the contractions), the best candidate it did not take. Operators alike in
    factors, operand arrays, weight, assignment and the layouts they meet (the same operator of
    identical layers) are priced once (`_Priced`) and share one `Decision`."""
    e, nodes = Engine(g.nodes, g.axis_size, g.cost, g.table), g.nodes
    priced = _Priced(e, g.axis_size)
    values: dict = {}
    for v, k in g.arg_unit.items():
        values[v] = g.spec(k, 0, choice[k])
    merged: dict[int, tuple] = {}
    manual: dict[int, Decision] = {}
    specs: dict[tuple, tuple] = {}  # ids of a node's factors and its units' assignments -> `priced.specs`' answer
    for i, units in g.node_units.items():
        a = choice[units[0]]
        if len(units) > 1:
            a = {fac: axes for k in units for fac, axes in choice[k].items()}
        node = nodes[i]
        if node.primitive == CONSTRAINT:
            values[node.outputs[0]] = cast(dict, g.units[units[0]].fixed)[1]
            merged[i] = (a, None)
            continue
        if node.primitive == MANUAL:  # a shard_map region: laid out by its own specs, as the engine lays it out
            manual[i] = e.manual(i, node)
            continue
        if i in e.unruled:
            continue
        f = e.factors[i]
        ids = (id(f), *[id(choice[k]) for k in units])  # a class's units share both: sorted and keyed once
        found = specs.get(ids)
        if found is None:
            found = specs[ids] = priced.specs((f, tuple(sorted(a.items()))), a)
        picked, _, out_specs = found
        merged[i] = (a, picked)
        for v, spec in zip(e.vars[i][1], out_specs):
            values.setdefault(v, spec)
    decisions: dict[int, Decision] = {}
    work = [u.weight * u.flops for u in g.units]
    key = _KEY_SHARE * max(work, default=0.0)
    moves: dict = {}  # `_rejected`'s answers, per unit structure, pick and neighbours
    joins = g.joins(choice)
    made: dict[tuple[int, int], Decision] = {}  # ids of `decided`'s answer and `_rejected`'s -> one Decision, both held
    for i, (a, picked) in merged.items():
        if picked is None:
            spec = values[nodes[i].outputs[0]]
            decisions[i] = Decision((spec,), (spec,), (), 0.0, "user", None, False)
            continue
        found = priced.decided(i, picked, a, values)
        rejected = _rejected(g, i, choice, joins, moves) if work[g.node_units[i][0]] >= key > 0 else None
        decision = made.get((id(found), id(rejected)))
        if decision is None:
            seconds, comms, in_specs, out_specs, implied = found
            decision = made[(id(found), id(rejected))] = Decision(
                in_specs, out_specs, comms, seconds, "searched", rejected, implied
            )
        decisions[i] = decision
    decisions.update(manual)
    values.update(e.values)  # the manual regions' results
    result = Result(decisions, values, set(e.unruled))
    charge_constraints(nodes, result, g.axis_size, e.cost)  # each operator above priced its inputs only
    unpriced_dead(nodes, result, g.outvars)
    return result


class _Priced:
    """`assemble`'s per-operator pricing, shared by operators alike: the layouts a node's factors
    give its operands under an assignment, and its comms, seconds and whether XLA infers its
    outputs (`Engine.score`, `Engine.implied`), keyed by everything those read: the factors, the
    assignment, the operands' arrays, the node's weight, its loop-invariant inputs and the layouts
    of the inputs it meets."""

    def __init__(self, e: Engine, axis_size: Mapping[str, int]):
        self.e, self.axis_size = e, axis_size
        self._specs: dict[tuple, tuple] = {}
        self._decided: dict[tuple, tuple] = {}

    def specs(self, picked: tuple, a: Assignment) -> tuple[tuple, tuple, tuple]:
        """`(picked, in_specs, out_specs)` of the node whose factors and sorted assignment are
        `picked`; the `picked` returned is the first one met of its value (identical layers' nodes
        share it, so the keys that hold it compare by identity)."""
        found = self._specs.get(picked)
        if found is None:
            f, size = picked[0], self.axis_size
            found = self._specs[picked] = (
                picked,
                tuple(write_spec(d, a, f.sizes, size) for d in f.inputs),
                tuple(write_spec(d, a, f.sizes, size) for d in f.outputs),
            )
        return found

    def decided(self, i: int, picked: tuple, a: Assignment, values: Mapping) -> tuple:
        """`(seconds, comms, in_specs, out_specs, implied)` of node `i` under `a`, meeting the
        layouts `values` holds of its inputs."""
        e = self.e
        ins, outs = e.vars[i]
        met = tuple([(k, values[v]) for k, v in enumerate(ins) if isinstance(v, jcore.Var) and v in values])
        key = (
            picked,
            e.nodes[i].weight,
            tuple(map(array_of, ins)),
            tuple(map(array_of, outs)),
            tuple(e.invariant.get(v) for v in ins if isinstance(v, jcore.Var)) if e.invariant else (),
            met,
        )
        found = self._decided.get(key)
        if found is None:
            f = picked[0]
            seconds, _, comms, _ = e.score(i, f, a, [(k, spec, "") for k, spec in met])
            _, in_specs, out_specs = self.specs(picked, a)
            found = self._decided[key] = (seconds, comms, in_specs, out_specs, not comms and e.implied(i, f, a))
        return found


def _rejected(g: SearchGraph, i: int, choice: Sequence[Assignment], joins: Joins, memo: dict):
    """The cheapest other candidate of node `i`'s main unit that moves one mesh axis (to another
    factor, or off the operator), its neighbours kept as chosen (`joins`: `choice`'s combined
    all-reduces); once per unit structure, pick, neighbours' layouts and the combined sets the
    others open, in `memo` (the same operator of identical layers)."""
    k = g.node_units[i][0]
    if not g.units[k].free:
        return None
    key = (g.shape_of_unit[k], tuple(sorted(choice[k].items())), _neighbours(g, k, choice), joins.others(k))
    if key not in memo:
        memo[key] = _best_move(g, k, choice, joins)
    return memo[key]


def _neighbours(g: SearchGraph, k: int, choice: Sequence[Assignment]) -> tuple:
    """What `SearchGraph.local_seconds` reads of unit `k`'s neighbours, in its order: per edge out of and into `k`,
    the value's shape, the edge's weight, `k`'s operand and the layout at the other end."""
    out = []
    for n in g.out_edges.get(k, ()):
        e = g.edges[n]
        out.append((array_of(e.var), e.weight, e.src[1], g.spec(e.dst[0], e.dst[1], choice[e.dst[0]])))
    for n in g.in_edges.get(k, ()):
        e = g.edges[n]
        out.append((array_of(e.var), e.weight, e.dst[1], g.spec(e.src[0], e.src[1], choice[e.src[0]])))
    return tuple(out)


def _best_move(g: SearchGraph, k: int, choice: Sequence[Assignment], joins: Joins) -> Rejected | None:
    u = g.units[k]
    scored = [(g.local_seconds(k, a, choice, joins), a) for a in _seeded.moves(g, k, choice[k])]
    if not scored:
        return None
    seconds, a = min(scored, key=lambda s: s[0])
    f = u.factors
    return Rejected(
        tuple(write_spec(d, a, f.sizes, g.axis_size) for d in f.inputs),
        tuple(write_spec(d, a, f.sizes, g.axis_size) for d in f.outputs),
        seconds,
    )
