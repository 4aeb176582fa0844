"""Rule for `dot_general`: batch and free dims pass through, contracted dims leave partial sums.

This is MindSpore's MatMul device matrix `[batch, lhs free, contracted, rhs free]` read as
factors: cutting a contracted factor leaves each device a partial product, summed by an
all-reduce over the axes that cut it.
"""

from __future__ import annotations

import math

from jax.extend import core as jcore

from jshard.rules._factors import FactorBuilder, Factors, rule, shape_of


@rule("dot_general")
def dot_general(eqn: jcore.JaxprEqn) -> Factors:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ls, rs = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    b = FactorBuilder()
    lhs: list = [None] * len(ls)
    rhs: list = [None] * len(rs)
    batch = []
    for i, j in zip(lb, rb):
        f = b.new(ls[i])
        lhs[i], rhs[j] = (f,), (f,)
        batch.append((f,))
    contracted = []
    for i, j in zip(lc, rc):
        f = b.new(ls[i])
        lhs[i], rhs[j] = (f,), (f,)
        contracted.append(f)
    lfree = [i for i in range(len(ls)) if lhs[i] is None]
    rfree = [j for j in range(len(rs)) if rhs[j] is None]
    for i in lfree:
        lhs[i] = (b.new(ls[i]),)
    for j in rfree:
        rhs[j] = (b.new(rs[j]),)
    out = batch + [lhs[i] for i in lfree] + [rhs[j] for j in rfree]
    flops = 2 * math.prod(shape_of(eqn.outvars[0])) * math.prod(ls[i] for i in lc)
    return b.build([lhs, rhs], [out], reduced=contracted, flops=flops)
