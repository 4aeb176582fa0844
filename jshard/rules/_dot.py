"""Rules for `dot_general` and `ragged_dot_general`: batch and free dims pass through, contracted
dims leave partial sums.

This is MindSpore's MatMul device matrix `[batch, lhs free, contracted, rhs free]` read as
factors: cutting a contracted factor leaves each device a partial product, summed by an
all-reduce over the axes that cut it. A ragged dot (`jax.lax.ragged_dot`, the grouped matmul of a
dropless mixture of experts) is the same, but the lhs's ragged dim, the rhs's group dim and the
group sizes stay whole: where the groups' bounds fall is known only at run time.
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


@rule("ragged_dot_general")
def ragged_dot_general(eqn: jcore.JaxprEqn) -> Factors:
    """The three forms `jax.lax.ragged_dot` and its gradients make: ragged lhs rows against grouped
    rhs weights (`[m, k] x [g, k, n] -> [m, n]`), the weight gradient contracting the ragged rows
    (`[m, k] x [m, n] -> [g, k, n]`), and the input gradient (`[m, n] x [g, k, n] -> [m, k]`)."""
    numbers = eqn.params["ragged_dot_dimension_numbers"]
    (lc, rc), (lb, rb) = numbers.dot_dimension_numbers
    (ragged,), groups = numbers.lhs_ragged_dimensions, tuple(numbers.rhs_group_dimensions)
    ls, rs = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    b = FactorBuilder()
    fresh = lambda i, n: () if i == ragged else (b.new(n),)  # the ragged dim: whole
    lhs: list = [None] * len(ls)
    rhs: list = [() if j in groups else None for j in range(len(rs))]
    batch, contracted = [], []
    for i, j in zip(lb, rb):
        lhs[i] = rhs[j] = fresh(i, ls[i])
        batch.append(lhs[i])
    for i, j in zip(lc, rc):
        lhs[i] = rhs[j] = fresh(i, ls[i])
        contracted += lhs[i]
    lfree = [i for i in range(len(ls)) if lhs[i] is None]
    rfree = [j for j in range(len(rs)) if rhs[j] is None]
    for i in lfree:
        lhs[i] = fresh(i, ls[i])
    for j in rfree:
        rhs[j] = (b.new(rs[j]),)
    out = ([] if groups else [()]) + batch + [lhs[i] for i in lfree] + [rhs[j] for j in rfree]
    rest = [tuple(() for _ in shape_of(v)) for v in eqn.invars[2:]]  # group sizes (and offset): whole
    flops = 2 * math.prod(ls) * math.prod(rs[j] for j in rfree)
    return b.build([lhs, rhs, *rest], [out], reduced=contracted, flops=flops)
