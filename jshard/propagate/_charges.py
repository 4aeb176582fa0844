"""The charges made on a finished `Result`, after the engine's walk or a search's choice: a `shard`
constraint's redistribution charged to the operator that meets it (`charge_constraints`), one move
of one value into one layout paid once (`share_moves`, as XLA eliminates the common subexpression),
and the operators no result needs left unpriced (`unpriced_dead`, as XLA removes them)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Mapping, Sequence

from jax.extend import core as jcore

from jshard.cost import CostModel, array_of, redistribution
from jshard.graph import CONSTRAINT, Node, dead_nodes, operand_vars
from jshard.propagate._result import Result


def charge_constraints(
    nodes: Sequence[Node], result: Result, axis_size: Mapping[str, int], cost: CostModel, priced=lambda v: False
) -> None:
    """Charges the redistribution into each sharding constraint (a `shard` call's input arriving
    in another layout: an argument laid out by `in_strategy`) to the first operator that uses the
    constraint's result (else the one that made its input), unless `priced(input)` says its maker
    already paid it. Constraints are no operators of the `Plan`, and XLA moves the value all the
    same."""
    constraints = [i for i, node in enumerate(nodes) if node.primitive == CONSTRAINT]
    if not constraints:  # nothing to charge (a search's program without `shard` calls)
        share_moves(nodes, result, axis_size, cost)
        return
    users: dict = collections.defaultdict(list)
    makers: dict = {}
    for j in sorted(result.decisions):
        for v in operand_vars(nodes[j])[0]:
            if isinstance(v, jcore.Var):
                users[v].append(j)
        if nodes[j].primitive != CONSTRAINT:
            makers.update((v, j) for v in nodes[j].outputs)

    def first_user(v):
        """The first operator that takes `v`, through constraints that take it first (a `shard`
        call with no operator of its own, as a reshape to the same shape)."""
        direct = next((j for j in users.get(v, ()) if nodes[j].primitive != CONSTRAINT), None)
        if direct is not None:
            return direct
        return next((j for c in users.get(v, ()) if (j := first_user(nodes[c].outputs[0])) is not None), None)

    for i in constraints:
        node = nodes[i]
        v = node.inputs[0]
        if not isinstance(v, jcore.Var) or v not in result.values or priced(v):
            continue
        out = node.outputs[0]
        src, dst = result.values[v], result.values.get(out)
        j = first_user(out)
        j = makers.get(v) if j is None else j  # no operator after it: the one that made the value pays
        if dst is None or src == dst or j is None:
            continue
        d = result.decisions[j]
        comms = d.comms + tuple(redistribution(*array_of(v), src, dst, axis_size, cost.alltoall))
        seconds = nodes[j].weight * sum(cost.time(c, axis_size) for c in comms)
        result.decisions[j] = dataclasses.replace(d, comms=comms, seconds=seconds)
    share_moves(nodes, result, axis_size, cost)


def share_moves(nodes: Sequence[Node], result: Result, axis_size: Mapping[str, int], cost: CostModel) -> None:
    """XLA moves one value into one layout once (it eliminates the common subexpression), however
    many operators of one computation take it so (`jnp.take`'s index normalization: three of them):
    the first user pays, the later ones' charge for it is dropped."""
    seen = set()
    for j in sorted(result.decisions):
        node, d = nodes[j], result.decisions[j]
        if node.primitive == CONSTRAINT:
            continue
        comms = list(d.comms)
        for v, dst in zip(operand_vars(node)[0], d.in_specs):
            src = result.values.get(v) if isinstance(v, jcore.Var) else None
            if src is None or dst is None or src == dst:
                continue
            if (v, dst, node.weight) in seen:
                left = list(comms)
                try:
                    for c in redistribution(*array_of(v), src, dst, axis_size, cost.alltoall):
                        left.remove(c)
                except ValueError:  # charged otherwise (a loop-invariant's share): left as it is
                    continue
                comms = left
            seen.add((v, dst, node.weight))
        if len(comms) != len(d.comms):
            seconds = node.weight * sum(cost.time(c, axis_size) for c in comms)
            result.decisions[j] = dataclasses.replace(d, comms=tuple(comms), seconds=seconds)


def unpriced_dead(nodes: Sequence[Node], result: Result, outputs: Collection) -> None:
    """The operators no result needs (`graph.dead_nodes`) cost nothing: XLA removes them."""
    for i in dead_nodes(nodes, outputs):
        d = result.decisions.get(i)
        if d is not None and d.comms:
            result.decisions[i] = dataclasses.replace(d, comms=(), seconds=0.0)
