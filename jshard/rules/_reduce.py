"""Rules for reductions: kept dims pass through; a reduced dim cut leaves partial results.

`reduce_sum`/`max`/`min`/`prod`/`and`/`or` over a cut dim are finished by an all-reduce over the
axes that cut it (MindSpore's ReduceSum with a cut axis). `argmax`/`argmin`, the cumulative
scans and `lax.reduce` with a computation of its own need their axis whole.
"""

from __future__ import annotations

import math

from jax.extend import core as jcore

from jshard.rules._factors import FactorBuilder, Factors, rule, shape_of

REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")


@rule(*REDUCTIONS)
def reduction(eqn: jcore.JaxprEqn) -> Factors:
    shape = shape_of(eqn.invars[0])
    axes = set(eqn.params["axes"])
    b = FactorBuilder()
    dims = b.dims(shape)
    out = [d for i, d in enumerate(dims) if i not in axes]
    return b.build([dims], [out], reduced=[dims[i][0] for i in axes], flops=math.prod(shape))


@rule("argmax", "argmin")
def arg_reduction(eqn: jcore.JaxprEqn) -> Factors:
    shape = shape_of(eqn.invars[0])
    axes = set(eqn.params["axes"])
    b = FactorBuilder()
    dims = [() if i in axes else (b.new(d),) for i, d in enumerate(shape)]
    out = [d for i, d in enumerate(dims) if i not in axes]
    return b.build([dims], [out], flops=math.prod(shape))


@rule("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(eqn: jcore.JaxprEqn) -> Factors:
    shape = shape_of(eqn.invars[0])
    axis = eqn.params["axis"]
    b = FactorBuilder()
    dims = [() if i == axis else (b.new(d),) for i, d in enumerate(shape)]
    return b.build([dims], [dims], flops=math.prod(shape))


@rule("reduce")
def generic_reduction(eqn: jcore.JaxprEqn) -> Factors:
    """`lax.reduce` with a computation of its own (variadic: operands, then as many init values):
    the kept dims pass through; the reduced dims are whole (its computation need not be one XLA
    finishes across devices)."""
    n = len(eqn.outvars)
    shape = shape_of(eqn.invars[0])
    axes = set(eqn.params["dimensions"])
    b = FactorBuilder()
    dims = [() if i in axes else (b.new(d),) for i, d in enumerate(shape)]
    out = [d for i, d in enumerate(dims) if i not in axes]
    return b.build([dims] * n + [()] * n, [out] * n, flops=math.prod(shape) * n)
