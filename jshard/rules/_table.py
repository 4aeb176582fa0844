"""The rule table of one traced program: each operator's operands and factors, read once.

The propagation engine and the strategy search both read operators through an `OpTable`: which
values each operator works on (`operand_vars`), the factors its rule gives them (or that it has no
rule), and who makes and who uses each value.
"""

from __future__ import annotations

import collections
from collections.abc import Collection, Sequence

from jax.extend import core as jcore

from jshard.graph import CONSTRAINT, Node, operand_vars
from jshard.rules._factors import RULES, Factors, shape_of
from jshard.rules._traffic import MATMUL, traffic


class OpTable:
    """Operands, factors, producers and consumers of every node of a flattened program.

    Attributes:
      vars: node index -> `(inputs, outputs)` as the rules see them (`operand_vars`).
      factors: node index -> its `Factors` (scalar-only operators get empty ones).
      unruled: nodes whose primitive has no rule (their operands stay whole).
      producer: value -> the node that makes it.
      consumers: value -> `[(node, operand position)]` that use it.
      matmul: nodes that run on the matrix units (dots, convolutions: `CostModel.matmul_flops`).
    """

    def __init__(self, nodes: Sequence[Node]):
        self.factors: dict[int, Factors] = {}
        self.vars: dict[int, tuple[list, list]] = {}
        self.producer: dict = {}
        self.consumers: dict = collections.defaultdict(list)
        self.unruled: set[int] = set()
        self.nodes = nodes
        self.matmul = {i for i, node in enumerate(nodes) if node.primitive in MATMUL}
        self._traffic: dict[frozenset, dict[int, float]] = {}
        producer, consumers, var = self.producer, self.consumers, jcore.Var
        for i, node in enumerate(nodes):
            ins, outs = self.vars[i] = operand_vars(node)
            for v in outs:
                producer[v] = i
            for k, v in enumerate(ins):
                if isinstance(v, var):
                    consumers[v].append((i, k))
            fn = RULES.get(node.primitive)
            if fn is not None:
                self.factors[i] = _factors_of(fn, node.eqn)
            elif all(not shape_of(v) for v in ins + outs):
                self.factors[i] = Factors(tuple(() for _ in ins), tuple(() for _ in outs), ())  # scalars: nothing to cut
            elif node.primitive not in (CONSTRAINT, "shard_map"):  # a manual region: laid out by its specs
                self.unruled.add(i)

    def traffic(self, outputs: Collection = ()) -> dict[int, float]:
        """Device-memory bytes each operator moves per run once XLA has fused the program (the
        rule of `_traffic.py`), on one device holding everything; `outputs`: the program's results.
        Computed once per `outputs`."""
        key = frozenset(outputs)
        found = self._traffic.get(key)
        if found is None:
            found = self._traffic[key] = traffic(self.nodes, self.vars, key)
        return found


_FACTORS: dict = {}


def _factors_of(rule, eqn) -> Factors:
    """`rule(eqn)`, shared by equations alike in primitive, operand types and parameters (an
    unrolled model repeats each layer's equations). The parameters are keyed in the order the
    equation holds them (one primitive's binds name them in one order; another order only misses)."""
    try:
        key = (eqn.primitive, tuple([v.aval for v in eqn.invars]), tuple([v.aval for v in eqn.outvars]),
               tuple(eqn.params.items()))
        found = _FACTORS.get(key)
    except TypeError:  # an unhashable parameter
        return rule(eqn)
    if found is None:
        if len(_FACTORS) > 16384:
            _FACTORS.clear()
        found = _FACTORS[key] = rule(eqn)
    return found


def neighbours_of(f: Factors) -> dict[int, set[int]]:
    """For each factor, the other factors that appear in one operand with it (or that it leaves
    partial sums on: `Factors.joined`)."""
    together: dict[int, set[int]] = collections.defaultdict(set)
    for facs in f.joined:
        for g in facs:
            together[g] |= facs - {g}
    return together
